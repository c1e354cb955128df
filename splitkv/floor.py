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
* and adds them up in float32.

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

The kernel runs under the Triton interpreter too, so its sum can be checked
against ``torch`` on a CPU (``tests/test_bench.py``).
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from typing import Callable, List, Optional

import torch
import triton
import triton.language as tl

__all__ = [
    "FloorConfig",
    "gather_sum",
    "floor_configs",
    "fits_registers",
    "search_gather_floor",
    "BLOCK_NS",
    "TOKENS_PER_PROGRAM",
    "NUM_STAGES",
    "NUM_WARPS",
]

#: Slots gathered per loop step (the key-tile height of the attention kernels).
BLOCK_NS = (16, 32, 64)
#: Prefix tokens (pool slots) one program walks, per KV head.
TOKENS_PER_PROGRAM = (32, 64, 128, 256, 512)
#: Software-pipelining depth of the loop (1: none).
NUM_STAGES = (1, 3)
#: Warps per program.
NUM_WARPS = (2, 4)
#: Settings of the first search round: every (BLOCK_N, tokens per program) at these.
FIRST_ROUND_STAGES, FIRST_ROUND_WARPS = 3, 4
#: Most float32 accumulator registers per thread a setting may need (more spills).
MAX_ACC_REGISTERS = 128


@triton.jit
def _gather_sum_kernel(
    K_Buf, V_Buf, kv_indices, Out,
    n_tokens,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    HEAD_DIM: tl.constexpr,
    V_HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TOKENS_PER_PROGRAM: tl.constexpr,
):
    """Program (chunk, kv_head): sum K and V rows of slots ``kv_indices[chunk * T : (chunk + 1) * T]``.

    The loads are the attention kernels' prefix gather: slot numbers first,
    then one ``[BLOCK_N, D]`` tile of K and one of V at those slots. They are
    accumulated element-wise in float32 (no reduction inside the loop, so
    the loop is nothing but loads and adds) and reduced once at the end.
    """
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_ok = offs_d < HEAD_DIM
    dv_ok = offs_dv < V_HEAD_DIM
    acc_k = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    acc_v = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    lo = chunk * TOKENS_PER_PROGRAM
    hi = tl.minimum(lo + TOKENS_PER_PROGRAM, n_tokens)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        # The gather: pool row of token n is kv_indices[n] (64-bit offsets, large pools).
        slot = tl.load(kv_indices + offs_n, mask=n_ok, other=0).to(tl.int64)
        k = tl.load(
            K_Buf + slot[:, None] * stride_kt + head * stride_kh + offs_d[None, :],
            mask=n_ok[:, None] & d_ok[None, :], other=0.0,
        )
        v = tl.load(
            V_Buf + slot[:, None] * stride_vt + head * stride_vh + offs_dv[None, :],
            mask=n_ok[:, None] & dv_ok[None, :], other=0.0,
        )
        acc_k += k.to(tl.float32)
        acc_v += v.to(tl.float32)
    total = tl.sum(tl.sum(acc_k, axis=1), axis=0) + tl.sum(tl.sum(acc_v, axis=1), axis=0)
    tl.store(Out + head * tl.num_programs(0) + chunk, total)


@dataclass(frozen=True)
class FloorConfig:
    """Launch setting of the gather kernel.

    Attributes:
        block_n: pool slots gathered per loop step.
        tokens_per_program: prefix tokens one program walks (a multiple of ``block_n``).
        num_warps: warps per program.
        num_stages: software-pipelining depth of the loop.
    """

    block_n: int = 32
    tokens_per_program: int = 128
    num_warps: int = 4
    num_stages: int = 3

    def as_dict(self) -> dict:
        return asdict(self)


def gather_sum(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_indices: torch.Tensor,
    config: FloorConfig = FloorConfig(),
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Gather K and V rows at ``kv_indices`` and sum them; one float32 per program.

    Args:
        k_buffer: the key pool ``[pool_tokens, H_KV, D]`` (unit last stride; any dtype
            Triton loads, fp8 included).
        v_buffer: the value pool ``[pool_tokens, H_KV, Dv]``.
        kv_indices: ``[n]`` pool slots (int32 or int64), e.g. every prefix of a batch.
        config: the launch setting.
        out: float32 output of ``cdiv(n, tokens_per_program) * H_KV`` elements
            (allocated if ``None``; pass one to replay the launch from a CUDA graph).

    Returns:
        ``out``: element ``h * n_chunks + c`` is the sum over K and V, KV head
        ``h``, of the slots ``kv_indices[c * T : (c + 1) * T]``
        (``T = tokens_per_program``). ``out.sum()`` is the sum of every gathered element.

    Raises:
        ValueError: on a pool without unit last stride, mismatched pools, or a
            ``tokens_per_program`` that is not a multiple of ``block_n``.
    """
    if k_buffer.stride(-1) != 1 or v_buffer.stride(-1) != 1:
        raise ValueError("the K/V pools need a unit last stride")
    if k_buffer.shape[:2] != v_buffer.shape[:2]:
        raise ValueError(f"k_buffer {tuple(k_buffer.shape)} and v_buffer {tuple(v_buffer.shape)} differ")
    if config.tokens_per_program % config.block_n:
        raise ValueError(f"tokens_per_program must be a multiple of block_n: {config}")
    n_tokens, h_kv = kv_indices.shape[0], k_buffer.shape[1]
    n_chunks = max(1, triton.cdiv(n_tokens, config.tokens_per_program))
    if out is None:
        out = torch.empty(n_chunks * h_kv, dtype=torch.float32, device=k_buffer.device)
    elif out.numel() != n_chunks * h_kv or out.dtype != torch.float32:
        raise ValueError(f"out must be {n_chunks * h_kv} float32 elements")
    head_dim, v_head_dim = k_buffer.shape[2], v_buffer.shape[2]
    _gather_sum_kernel[(n_chunks, h_kv)](
        k_buffer, v_buffer, kv_indices, out,
        n_tokens,
        k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        HEAD_DIM=head_dim,
        V_HEAD_DIM=v_head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_DV=triton.next_power_of_2(v_head_dim),
        BLOCK_N=config.block_n,
        TOKENS_PER_PROGRAM=config.tokens_per_program,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def fits_registers(config: FloorConfig, head_dim: int, v_head_dim: int) -> bool:
    """Whether a setting's float32 accumulators fit :data:`MAX_ACC_REGISTERS` per thread.

    The kernel holds ``BLOCK_N x (D + Dv)`` float32 accumulators over
    ``32 x num_warps`` threads; beyond ~128 per thread (plus the tiles in
    flight) the compiler spills to local memory and the setting is only slower.
    """
    width = triton.next_power_of_2(head_dim) + triton.next_power_of_2(v_head_dim)
    return config.block_n * width <= MAX_ACC_REGISTERS * 32 * config.num_warps


def floor_configs(head_dim: int, v_head_dim: int) -> List[FloorConfig]:
    """Every setting of the full grid that is valid and fits the registers.

    The grid: ``BLOCK_N`` in :data:`BLOCK_NS` x tokens per program in
    :data:`TOKENS_PER_PROGRAM` (a multiple of ``BLOCK_N``) x :data:`NUM_STAGES`
    x :data:`NUM_WARPS`. :func:`search_gather_floor` times only a part of it.
    """
    return [
        FloorConfig(bn, tpp, w, s)
        for bn, tpp, s, w in itertools.product(BLOCK_NS, TOKENS_PER_PROGRAM, NUM_STAGES, NUM_WARPS)
        if tpp % bn == 0 and fits_registers(FloorConfig(bn, tpp, w, s), head_dim, v_head_dim)
    ]


def search_gather_floor(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_indices: torch.Tensor,
    time_us: Callable[[Callable[[], object]], float],
) -> dict:
    """The fastest launch setting of :func:`gather_sum` for these inputs.

    Two rounds, so a search costs at most 17 timings instead of the grid's 56:

    1. every (``BLOCK_N``, tokens per program) at 4 warps and 3 stages;
    2. the other warps x stages settings at the best pair of round 1.

    Settings that do not fit the registers (:func:`fits_registers`) are skipped;
    one that fails (compile error, out of resources) is recorded and skipped.

    Args:
        k_buffer: the key pool ``[pool_tokens, H_KV, D]``.
        v_buffer: the value pool ``[pool_tokens, H_KV, Dv]``.
        kv_indices: the prefix slots (all sequences).
        time_us: times a zero-argument callable, in µs (the benchmark replays it
            from a CUDA graph under ``do_bench``).

    Returns:
        ``{"us": best µs or None, "config": FloorConfig.as_dict() or None,
        "trials": [[block_n, tokens_per_program, num_warps, num_stages, µs or None], ...],
        "errors": {setting: message}}``.
    """
    head_dim, v_head_dim = k_buffer.shape[2], v_buffer.shape[2]
    n_tokens, h_kv = kv_indices.shape[0], k_buffer.shape[1]
    trials: dict = {}
    errors: dict = {}

    def trial(cfg: FloorConfig):
        if cfg in trials or cfg.tokens_per_program % cfg.block_n or not fits_registers(cfg, head_dim, v_head_dim):
            return
        n_chunks = max(1, triton.cdiv(n_tokens, cfg.tokens_per_program))
        out = torch.empty(n_chunks * h_kv, dtype=torch.float32, device=k_buffer.device)
        try:
            trials[cfg] = time_us(lambda: gather_sum(k_buffer, v_buffer, kv_indices, cfg, out))
        except Exception as err:  # a setting that cannot run here is skipped, not fatal
            trials[cfg] = None
            errors[f"{cfg.block_n}/{cfg.tokens_per_program}/{cfg.num_warps}w/{cfg.num_stages}s"] = (
                f"{type(err).__name__}: {err}"[:200]
            )

    def best() -> Optional[FloorConfig]:
        timed = [c for c, t in trials.items() if t is not None]
        return min(timed, key=lambda c: trials[c]) if timed else None

    for bn, tpp in itertools.product(BLOCK_NS, TOKENS_PER_PROGRAM):
        trial(FloorConfig(bn, tpp, FIRST_ROUND_WARPS, FIRST_ROUND_STAGES))
    first = best()
    if first is None:  # every first-round setting failed: try the small-tile ones
        for s, w in itertools.product(NUM_STAGES, NUM_WARPS):
            trial(FloorConfig(BLOCK_NS[0], TOKENS_PER_PROGRAM[2], w, s))
    else:
        for s, w in itertools.product(NUM_STAGES, NUM_WARPS):
            trial(FloorConfig(first.block_n, first.tokens_per_program, w, s))
    winner = best()
    return {
        "us": trials[winner] if winner else None,
        "config": winner.as_dict() if winner else None,
        "trials": [[c.block_n, c.tokens_per_program, c.num_warps, c.num_stages, t] for c, t in trials.items()],
        "errors": errors,
    }
