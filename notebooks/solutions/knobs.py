"""Solutions to notebook 06b's exercises."""

from splitkv.resources import SLACK
from splitkv.schedule import TileConfig
from splitkv.teaching.exercises.knobs import MAX_PROGRAMS, SM_REGISTERS, SM_SHARED_MEMORY, SM_THREADS


def tile_shared_bytes(tile: TileConfig, head_dim: int, kv_bytes: int) -> int:
    """Shared memory (bytes) of one program of ``tile``: head dim ``head_dim`` for K and V, a pool of
    ``kv_bytes``-byte elements (2: bf16, 1: fp8), bf16 queries; the simple case of splitkv.resources."""
    q = tile.block_m * head_dim * 2                  # the query tile, bf16
    if kv_bytes == 1:
        q *= 2                                       # an fp8 pool's dot reads a converted (bf16) copy too
    buffers = max(1, tile.num_stages - 1)            # the pipeline: loads in flight while one step computes
    kv = buffers * tile.block_n * 2 * head_dim * kv_bytes  # a K row and a V row per key, per buffer
    p = tile.block_m * tile.block_n * 2              # the softmax weights P, bf16, for the P.V dot
    return q + kv + p + SLACK


def programs_per_sm(n_regs: int, num_warps: int, shared: int) -> int:
    """Programs one H200 SM holds at once: the fewest its registers, shared memory and threads allow (1 at least)."""
    threads = 32 * num_warps
    by_registers = SM_REGISTERS // (max(1, n_regs) * threads)
    by_shared = SM_SHARED_MEMORY // max(1, shared)
    by_threads = SM_THREADS // threads
    return max(1, min(by_registers, by_shared, by_threads, MAX_PROGRAMS))
