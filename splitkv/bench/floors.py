"""The gather floor: how fast can a bare kernel read the prefix K/V at all?

The benchmark measures every verify kernel against a *floor*. The simplest
floor is the roofline one: the prefix K and V bytes divided by the HBM read
bandwidth that ``x.sum()`` reaches over a large contiguous tensor. A verify
kernel cannot reach it exactly, because it does not read contiguous memory:
the prefix of sequence ``b`` lives on the token-pool slots
``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``, which a serving system hands out
in any order. Every key tile is a *gather*: load the slot numbers, then load
one row of ``head_dim`` elements per slot, wherever it lies.

The **gather floor** answers: with exactly that access pattern, how fast can
any kernel go? This module's kernel does nothing but the memory traffic of
the verify problem:

* it walks the same ``kv_indices`` (all sequences' prefixes, concatenated),
* loads the same K and V rows of the same pool, one KV head per program,
  ``BLOCK_N`` slots per step, exactly as the attention kernels tile them,
* and adds them up in float32, into one accumulator of ``BLOCK_N x BLOCK_C``
  (each row read in chunks of at most :data:`MAX_BLOCK_C` columns), so that
  the registers go to loads in flight rather than to a sum as wide as the rows.
  The search also tries whole rows per load (``BLOCK_C`` the row's width):
  for short prefixes of wide heads, fewer and wider loads can win.

The sum is there only so that the compiler cannot drop the loads: a load
whose value is never used is dead code. Each program writes one float (its
partial sum), so the output is tiny and the time is all reads. No dot
products, no softmax, no second stage: whatever the attention kernel spends
beyond this time is spent on work other than reading its inputs.

No single launch setting is best for every shape (tiles of 16 keys keep
more loads in flight per byte of registers; 512 tokens per program means
fewer programs, each with a longer loop), so :func:`search_gather_floor`
times a small grid of them and keeps the best. The benchmark replays each
setting from a CUDA graph under ``triton.testing.do_bench`` (median, L2
flushed), the way it times the attention kernels.

The floor is a lower bound on what a *simple Triton gather kernel* achieves,
not on what the hardware can do; if an attention kernel ever beats it, the
search grid is too small. It also reads ``kv_indices`` once per KV head,
as the attention kernels do (those index bytes are not in the roofline
floor's byte count).

**Heads together.** The kernel above reads one KV head per program: at an
fp8 pool of 8 heads x 128 dims that is 128 bytes per token, one short run
per slot. With ``heads_together=True`` the same kernel's program reads every
KV head of a token at once, ``H_KV x D`` contiguous elements (1 KB per token
at that shape), from fewer, longer rows. Its tiles hold fewer tokens
(:data:`TOKEN_BLOCK_NS`) for the same bytes in flight.

The kernel runs under the Triton interpreter too, so its sum can be checked
against ``torch`` on a CPU (``tests/test_bench.py``).
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, replace
from typing import Callable, List, Optional, Sequence

import torch
import triton
import triton.language as tl

__all__ = [
    "FloorConfig",
    "gather_sum",
    "floor_configs",
    "fits_registers",
    "chunk_width",
    "row_width",
    "search_gather_floor",
    "BLOCK_NS",
    "TOKENS_PER_PROGRAM",
    "NUM_STAGES",
    "NUM_WARPS",
    "REDUCED_GRID",
    "MAX_BLOCK_C",
    "TOKEN_BLOCK_NS",
    "TOKEN_TOKENS_PER_PROGRAM",
]

#: Slots gathered per loop step (the key-tile height of the attention kernels).
BLOCK_NS = (16, 32, 64)
#: Prefix tokens (pool slots) one program walks, per KV head.
TOKENS_PER_PROGRAM = (32, 64, 128, 256, 512)
#: Slots per loop step when a program gathers all KV heads of a token (``heads_together``).
TOKEN_BLOCK_NS = (2, 4, 8, 16)
#: Tokens per program for that kernel (pass as ``tokens_per_program``): it has ``H_KV`` times
#: fewer programs than the per-head one, so shorter walks keep small prefixes spread.
TOKEN_TOKENS_PER_PROGRAM = (8, 16, 32, 64, 128, 256)
#: Software-pipelining depth of the loop (1: none).
NUM_STAGES = (1, 3)
#: Warps per program.
NUM_WARPS = (2, 4)
#: Settings of the first search round: every (BLOCK_N, tokens per program) at these.
FIRST_ROUND_STAGES, FIRST_ROUND_WARPS = 3, 4
#: Most registers per thread a setting may need for its accumulator and one step's loads (more spills).
MAX_ACC_REGISTERS = 128
#: Widest column chunk of one load (``BLOCK_C``): the accumulator is ``BLOCK_N x BLOCK_C`` float32.
MAX_BLOCK_C = 128
#: A reduced search (``python -m splitkv.bench --small``): 4 warps only, and token counts that span
#: the full search's range of winners.
REDUCED_GRID = dict(tokens_per_program=(32, 128, 512), num_warps=(4,))


@triton.jit
def _add_rows(acc, rows, stride_h, n_ok, WIDTH: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_C: tl.constexpr):
    """``acc`` plus the first ``WIDTH`` elements of each row, ``BLOCK_C`` columns at a time.

    Row ``n`` starts at pointer ``rows[n]``; a row of several heads has column
    ``c`` at ``(c // HEAD_DIM) * stride_h + c % HEAD_DIM``. Each chunk is one
    ``[BLOCK_N, BLOCK_C]`` load (the chunks of a row are independent loads, all
    in flight at once), widened to float32 and added element-wise.
    """
    for c0 in tl.static_range(0, WIDTH, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        if WIDTH == HEAD_DIM:
            col = c  # one head: the columns are contiguous
        else:
            col = (c // HEAD_DIM) * stride_h + c % HEAD_DIM
        x = tl.load(rows + col[None, :], mask=n_ok[:, None] & (c < WIDTH)[None, :], other=0.0)
        acc += x.to(tl.float32)
    return acc


@triton.jit
def _gather_sum_kernel(
    K_Buf, V_Buf, kv_indices, Out,
    n_tokens,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    HEAD_DIM: tl.constexpr,
    V_HEAD_DIM: tl.constexpr,
    HEADS: tl.constexpr,  # KV heads one program reads per token: 1, or all (heads together)
    BLOCK_C: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TOKENS_PER_PROGRAM: tl.constexpr,
    HAS_V: tl.constexpr,  # False: the values are a view of the keys (MLA), read with them
):
    """Program (chunk, head group): sum the K and V rows of slots ``kv_indices[chunk * T : (chunk + 1) * T]``.

    The loads are the attention kernels' prefix gather: slot numbers first,
    then the rows at those slots, ``BLOCK_N`` slots per step. All of it is
    added into one ``[BLOCK_N, BLOCK_C]`` float32 accumulator (no reduction
    inside the loop, so the loop is nothing but loads and adds), reduced once
    at the end: the accumulator's registers do not grow with the row's width,
    and the rest are left to the loads in flight.
    """
    chunk = tl.program_id(0)
    head = tl.program_id(1) * HEADS
    acc = tl.zeros([BLOCK_N, BLOCK_C], tl.float32)
    lo = chunk * TOKENS_PER_PROGRAM
    hi = tl.minimum(lo + TOKENS_PER_PROGRAM, n_tokens)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        # The gather: pool row of token n is kv_indices[n] (64-bit offsets, large pools).
        slot = tl.load(kv_indices + offs_n, mask=n_ok, other=0).to(tl.int64)
        acc = _add_rows(acc, K_Buf + slot[:, None] * stride_kt + head * stride_kh, stride_kh, n_ok,
                        HEADS * HEAD_DIM, HEAD_DIM, BLOCK_C)
        if HAS_V:
            acc = _add_rows(acc, V_Buf + slot[:, None] * stride_vt + head * stride_vh, stride_vh, n_ok,
                            HEADS * V_HEAD_DIM, V_HEAD_DIM, BLOCK_C)
    tl.store(Out + tl.program_id(1) * tl.num_programs(0) + chunk, tl.sum(tl.sum(acc, axis=1), axis=0))


@dataclass(frozen=True)
class FloorConfig:
    """Launch setting of the gather kernel.

    Attributes:
        block_n: pool slots gathered per loop step.
        tokens_per_program: prefix tokens one program walks (a multiple of ``block_n``).
        num_warps: warps per program.
        num_stages: software-pipelining depth of the loop.
        block_c: columns per load, a power of two; 0: :func:`chunk_width` of the rows
            (at most :data:`MAX_BLOCK_C`).
    """

    block_n: int = 32
    tokens_per_program: int = 128
    num_warps: int = 4
    num_stages: int = 3
    block_c: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def gather_sum(
    k_buffer: torch.Tensor,
    v_buffer: Optional[torch.Tensor],
    kv_indices: torch.Tensor,
    config: FloorConfig = FloorConfig(),
    out: Optional[torch.Tensor] = None,
    *,
    heads_together: bool = False,
) -> torch.Tensor:
    """Gather K and V rows at ``kv_indices`` and sum them; one float32 per program.

    Args:
        k_buffer: the key pool ``[pool_tokens, H_KV, D]`` (unit last stride; any dtype
            Triton loads, fp8 included).
        v_buffer: the value pool ``[pool_tokens, H_KV, Dv]``; ``None`` where the values
            are a view of the keys (MLA's latent): K rows only, each read once.
        kv_indices: ``[n]`` pool slots (int32 or int64), e.g. every prefix of a batch.
        config: the launch setting.
        out: float32 output of ``cdiv(n, tokens_per_program) * H_KV`` elements
            (``cdiv(n, tokens_per_program)`` with ``heads_together``; allocated
            if ``None``; pass one to replay the launch from a CUDA graph).
        heads_together: one program reads every KV head of its tokens (see the
            module docstring) instead of one KV head.

    Returns:
        ``out``: element ``h * n_chunks + c`` is the sum over K and V, KV head
        ``h``, of the slots ``kv_indices[c * T : (c + 1) * T]``
        (``T = tokens_per_program``); with ``heads_together`` element ``c`` is
        that sum over every head. ``out.sum()`` is the sum of every gathered element.

    Raises:
        ValueError: on a pool without unit last stride, mismatched pools, or a
            ``tokens_per_program`` that is not a multiple of ``block_n``, or a
            ``block_c`` that is not a power of two.
    """
    has_v = v_buffer is not None
    v_buffer = v_buffer if has_v else k_buffer[..., :0]
    if k_buffer.stride(-1) != 1 or v_buffer.stride(-1) != 1:
        raise ValueError("the K/V pools need a unit last stride")
    if k_buffer.shape[:2] != v_buffer.shape[:2]:
        raise ValueError(f"k_buffer {tuple(k_buffer.shape)} and v_buffer {tuple(v_buffer.shape)} differ")
    if config.tokens_per_program % config.block_n:
        raise ValueError(f"tokens_per_program must be a multiple of block_n: {config}")
    if config.block_c and config.block_c & (config.block_c - 1):
        raise ValueError(f"block_c must be a power of two: {config}")
    n_tokens, h_kv = kv_indices.shape[0], k_buffer.shape[1]
    n_chunks = max(1, triton.cdiv(n_tokens, config.tokens_per_program))
    n_out = n_chunks if heads_together else n_chunks * h_kv
    if out is None:
        out = torch.empty(n_out, dtype=torch.float32, device=k_buffer.device)
    elif out.numel() != n_out or out.dtype != torch.float32:
        raise ValueError(f"out must be {n_out} float32 elements")
    head_dim, v_head_dim = k_buffer.shape[2], v_buffer.shape[2]
    heads = h_kv if heads_together else 1
    _gather_sum_kernel[(n_chunks, h_kv // heads)](
        k_buffer, v_buffer, kv_indices, out,
        n_tokens,
        k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        HEAD_DIM=head_dim,
        V_HEAD_DIM=v_head_dim,
        HEADS=heads,
        BLOCK_C=config.block_c or chunk_width(heads * head_dim, heads * v_head_dim),
        BLOCK_N=config.block_n,
        TOKENS_PER_PROGRAM=config.tokens_per_program,
        HAS_V=has_v,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def chunk_width(width: int, v_width: int = 0) -> int:
    """Columns per load of the gather (``BLOCK_C``) by default: the row's power-of-two width, at most
    :data:`MAX_BLOCK_C`."""
    return min(MAX_BLOCK_C, row_width(width, v_width))


def row_width(width: int, v_width: int = 0) -> int:
    """The rows' power-of-two width: ``BLOCK_C`` when a load takes whole rows."""
    return triton.next_power_of_2(max(width, v_width))


def fits_registers(config: FloorConfig, head_dim: int, v_head_dim: int, num_kv_heads: int = 1,
                   element_size: int = 2) -> bool:
    """Whether a setting fits :data:`MAX_ACC_REGISTERS` registers per thread.

    A program holds its ``BLOCK_N x BLOCK_C`` float32 accumulator and, while
    they are in flight, one step's loaded rows: ``BLOCK_N x num_kv_heads x
    (D + Dv)`` elements of ``element_size`` bytes, over ``32 x num_warps``
    threads. Beyond ~128 per thread the compiler spills to local memory and
    the setting is only slower.
    """
    width, v_width = num_kv_heads * head_dim, num_kv_heads * v_head_dim
    words = (config.block_c or chunk_width(width, v_width)) + (width + v_width) * element_size / 4
    return config.block_n * words <= MAX_ACC_REGISTERS * 32 * config.num_warps


def floor_configs(head_dim: int, v_head_dim: int, element_size: int = 2) -> List[FloorConfig]:
    """Every setting of the full grid that is valid and fits the registers (pool elements of ``element_size`` bytes).

    The grid: ``BLOCK_N`` in :data:`BLOCK_NS` x tokens per program in
    :data:`TOKENS_PER_PROGRAM` (a multiple of ``BLOCK_N``) x :data:`NUM_STAGES`
    x :data:`NUM_WARPS`. :func:`search_gather_floor` times only a part of it.
    """
    return [
        FloorConfig(bn, tpp, w, s)
        for bn, tpp, s, w in itertools.product(BLOCK_NS, TOKENS_PER_PROGRAM, NUM_STAGES, NUM_WARPS)
        if tpp % bn == 0 and fits_registers(FloorConfig(bn, tpp, w, s), head_dim, v_head_dim, 1, element_size)
    ]


def search_gather_floor(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_indices: torch.Tensor,
    time_us: Callable[[Callable[[], object]], float],
    *,
    tokens_per_program: Sequence[int] = TOKENS_PER_PROGRAM,
    num_warps: Sequence[int] = NUM_WARPS,
    heads_together: bool = False,
) -> dict:
    """The fastest launch setting of :func:`gather_sum` for these inputs.

    Three rounds, so a search costs at most 18 timings instead of the 56 of :func:`floor_configs`:

    1. every (``BLOCK_N``, tokens per program) at 4 warps and 3 stages;
    2. the other warps x stages settings at the best pair of round 1;
    3. the winner with whole rows per load (``block_c`` = :func:`row_width`),
       where rows are wider than :func:`chunk_width` and that fits the registers.

    ``tokens_per_program`` and ``num_warps`` narrow the grid (:data:`REDUCED_GRID`:
    9 or 10 timings); the first round keeps its 4 warps only where ``num_warps`` has them.

    Settings that do not fit the registers (:func:`fits_registers`) are skipped;
    one that fails (compile error, out of resources) is recorded and skipped.

    Args:
        k_buffer: the key pool ``[pool_tokens, H_KV, D]``.
        v_buffer: the value pool ``[pool_tokens, H_KV, Dv]``, or ``None`` (values a view of the keys).
        kv_indices: the prefix slots (all sequences).
        time_us: times a zero-argument callable, in µs (the benchmark replays it
            from a CUDA graph under ``do_bench``).
        tokens_per_program: the tokens-per-program values searched.
        num_warps: the warp counts searched.
        heads_together: time the kernel that reads every KV head of a token in
            one program, at ``BLOCK_N`` in :data:`TOKEN_BLOCK_NS` (pass
            :data:`TOKEN_TOKENS_PER_PROGRAM` as ``tokens_per_program``).

    Returns:
        ``{"us": best µs or None, "config": FloorConfig.as_dict() or None,
        "trials": [[block_n, tokens_per_program, num_warps, num_stages, block_c, µs or None], ...],
        "errors": {setting: message}}``.
    """
    head_dim, v_head_dim = k_buffer.shape[2], (v_buffer.shape[2] if v_buffer is not None else 0)
    n_tokens, h_kv = kv_indices.shape[0], k_buffer.shape[1]
    block_ns = TOKEN_BLOCK_NS if heads_together else BLOCK_NS
    heads_read = h_kv if heads_together else 1  # KV heads one program's accumulators hold
    trials: dict = {}
    errors: dict = {}

    def trial(cfg: FloorConfig):
        if (cfg in trials or cfg.tokens_per_program % cfg.block_n
                or not fits_registers(cfg, head_dim, v_head_dim, heads_read, k_buffer.element_size())):
            return
        n_chunks = max(1, triton.cdiv(n_tokens, cfg.tokens_per_program))
        out = torch.empty(n_chunks * h_kv // heads_read, dtype=torch.float32, device=k_buffer.device)
        try:
            trials[cfg] = time_us(lambda: gather_sum(k_buffer, v_buffer, kv_indices, cfg, out,
                                                     heads_together=heads_together))
        except Exception as err:  # a setting that cannot run here is skipped, not fatal
            trials[cfg] = None
            errors[f"{cfg.block_n}/{cfg.tokens_per_program}/{cfg.num_warps}w/{cfg.num_stages}s/{cfg.block_c}c"] = (
                f"{type(err).__name__}: {err}"[:200]
            )

    def best() -> Optional[FloorConfig]:
        timed = [c for c, t in trials.items() if t is not None]
        return min(timed, key=lambda c: trials[c]) if timed else None

    first_warps = FIRST_ROUND_WARPS if FIRST_ROUND_WARPS in num_warps else num_warps[0]
    for bn, tpp in itertools.product(block_ns, tokens_per_program):
        trial(FloorConfig(bn, tpp, first_warps, FIRST_ROUND_STAGES))
    first = best()
    # Round 2 at round 1's winner; if every setting failed, at the smallest tile and a middle token count.
    if first:
        bn, tpp = first.block_n, first.tokens_per_program
    else:
        bn, tpp = block_ns[0], sorted(tokens_per_program)[len(tokens_per_program) // 2]
    for s, w in itertools.product(NUM_STAGES, num_warps):
        trial(FloorConfig(bn, tpp, w, s))
    second = best()
    # Round 3: the winner with whole rows per load, where a row is more than one chunk.
    width, v_width = heads_read * head_dim, heads_read * v_head_dim
    if second and row_width(width, v_width) > chunk_width(width, v_width):
        trial(replace(second, block_c=row_width(width, v_width)))
    winner = best()
    return {
        "us": trials[winner] if winner else None,
        "config": winner.as_dict() if winner else None,
        "trials": [[c.block_n, c.tokens_per_program, c.num_warps, c.num_stages, c.block_c, t]
                   for c, t in trials.items()],
        "errors": errors,
    }
