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

**Heads together.** The kernel above reads one KV head per program: at an
fp8 pool of 8 heads x 128 dims that is 128 bytes per token, one short run
per slot. ``heads_together=True`` gathers with a second kernel whose program
reads every KV head of a token at once, ``H_KV x D`` contiguous elements
(1 KB per token at that shape), from fewer, longer rows. Its tiles hold
fewer tokens (:data:`TOKEN_BLOCK_NS`) for the same bytes in flight.

The kernel runs under the Triton interpreter too, so its sum can be checked
against ``torch`` on a CPU (``tests/test_bench.py``).
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from typing import Callable, List, Optional, Sequence

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
    "REDUCED_GRID",
    "TOKEN_BLOCK_NS",
    "TOKEN_TOKENS_PER_PROGRAM",
]

#: Slots gathered per loop step (the key-tile height of the attention kernels).
BLOCK_NS = (16, 32, 64)
#: Prefix tokens (pool slots) one program walks, per KV head.
TOKENS_PER_PROGRAM = (32, 64, 128, 256, 512)
#: Slots per loop step when a program gathers all KV heads of a token (``heads_together``).
TOKEN_BLOCK_NS = (2, 4, 8)
#: Tokens per program for that kernel (pass as ``tokens_per_program``): it has ``H_KV`` times
#: fewer programs than the per-head one, so shorter walks keep small prefixes spread.
TOKEN_TOKENS_PER_PROGRAM = (8, 16, 32, 64, 128, 256)
#: Software-pipelining depth of the loop (1: none).
NUM_STAGES = (1, 3)
#: Warps per program.
NUM_WARPS = (2, 4)
#: Settings of the first search round: every (BLOCK_N, tokens per program) at these.
FIRST_ROUND_STAGES, FIRST_ROUND_WARPS = 3, 4
#: Most float32 accumulator registers per thread a setting may need (more spills).
MAX_ACC_REGISTERS = 128
#: A reduced search (``python -m splitkv.bench --small``): 8 + 1 settings instead of 14 + 3. Every
#: winner of the full search has 4 warps, and these token counts span its range of winners.
REDUCED_GRID = dict(tokens_per_program=(32, 128, 512), num_warps=(4,))


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
    HAS_V: tl.constexpr,  # False: the values are a view of the keys (MLA), read with them
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
        acc_k += k.to(tl.float32)
        if HAS_V:
            v = tl.load(
                V_Buf + slot[:, None] * stride_vt + head * stride_vh + offs_dv[None, :],
                mask=n_ok[:, None] & dv_ok[None, :], other=0.0,
            )
            acc_v += v.to(tl.float32)
    total = tl.sum(tl.sum(acc_k, axis=1), axis=0) + tl.sum(tl.sum(acc_v, axis=1), axis=0)
    tl.store(Out + head * tl.num_programs(0) + chunk, total)


@triton.jit
def _gather_sum_tokens_kernel(
    K_Buf, V_Buf, kv_indices, Out,
    n_tokens,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    HEAD_DIM: tl.constexpr,
    V_HEAD_DIM: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_HD: tl.constexpr,
    BLOCK_HDV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TOKENS_PER_PROGRAM: tl.constexpr,
):
    """Program (chunk): sum every KV head's K and V rows of slots ``kv_indices[chunk * T : (chunk + 1) * T]``.

    A token's heads are one row of ``NUM_KV_HEADS x HEAD_DIM`` elements:
    column ``c`` is dim ``c % HEAD_DIM`` of head ``c // HEAD_DIM``, contiguous
    in a pool whose head stride is ``HEAD_DIM``. Otherwise as ``_gather_sum_kernel``.
    """
    chunk = tl.program_id(0)
    ck = tl.arange(0, BLOCK_HD)
    cv = tl.arange(0, BLOCK_HDV)
    col_k = (ck // HEAD_DIM) * stride_kh + ck % HEAD_DIM
    col_v = (cv // V_HEAD_DIM) * stride_vh + cv % V_HEAD_DIM
    k_ok = ck < NUM_KV_HEADS * HEAD_DIM
    v_ok = cv < NUM_KV_HEADS * V_HEAD_DIM
    acc_k = tl.zeros([BLOCK_N, BLOCK_HD], tl.float32)
    acc_v = tl.zeros([BLOCK_N, BLOCK_HDV], tl.float32)
    lo = chunk * TOKENS_PER_PROGRAM
    hi = tl.minimum(lo + TOKENS_PER_PROGRAM, n_tokens)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        slot = tl.load(kv_indices + offs_n, mask=n_ok, other=0).to(tl.int64)
        k = tl.load(K_Buf + slot[:, None] * stride_kt + col_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0.0)
        v = tl.load(V_Buf + slot[:, None] * stride_vt + col_v[None, :], mask=n_ok[:, None] & v_ok[None, :],
                    other=0.0)
        acc_k += k.to(tl.float32)
        acc_v += v.to(tl.float32)
    total = tl.sum(tl.sum(acc_k, axis=1), axis=0) + tl.sum(tl.sum(acc_v, axis=1), axis=0)
    tl.store(Out + chunk, total)


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
            ``tokens_per_program`` that is not a multiple of ``block_n``.
    """
    has_v = v_buffer is not None
    if heads_together and not has_v:
        raise ValueError("heads_together reads a value pool of its own")
    v_buffer = v_buffer if has_v else k_buffer[..., :0]
    if k_buffer.stride(-1) != 1 or v_buffer.stride(-1) != 1:
        raise ValueError("the K/V pools need a unit last stride")
    if k_buffer.shape[:2] != v_buffer.shape[:2]:
        raise ValueError(f"k_buffer {tuple(k_buffer.shape)} and v_buffer {tuple(v_buffer.shape)} differ")
    if config.tokens_per_program % config.block_n:
        raise ValueError(f"tokens_per_program must be a multiple of block_n: {config}")
    n_tokens, h_kv = kv_indices.shape[0], k_buffer.shape[1]
    n_chunks = max(1, triton.cdiv(n_tokens, config.tokens_per_program))
    n_out = n_chunks if heads_together else n_chunks * h_kv
    if out is None:
        out = torch.empty(n_out, dtype=torch.float32, device=k_buffer.device)
    elif out.numel() != n_out or out.dtype != torch.float32:
        raise ValueError(f"out must be {n_out} float32 elements")
    head_dim, v_head_dim = k_buffer.shape[2], v_buffer.shape[2]
    if heads_together:
        _gather_sum_tokens_kernel[(n_chunks,)](
            k_buffer, v_buffer, kv_indices, out,
            n_tokens,
            k_buffer.stride(0), k_buffer.stride(1),
            v_buffer.stride(0), v_buffer.stride(1),
            HEAD_DIM=head_dim,
            V_HEAD_DIM=v_head_dim,
            NUM_KV_HEADS=h_kv,
            BLOCK_HD=triton.next_power_of_2(h_kv * head_dim),
            BLOCK_HDV=triton.next_power_of_2(h_kv * v_head_dim),
            BLOCK_N=config.block_n,
            TOKENS_PER_PROGRAM=config.tokens_per_program,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
        return out
    _gather_sum_kernel[(n_chunks, h_kv)](
        k_buffer, v_buffer, kv_indices, out,
        n_tokens,
        k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        HEAD_DIM=head_dim,
        V_HEAD_DIM=v_head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_DV=triton.next_power_of_2(max(v_head_dim, 1)),
        BLOCK_N=config.block_n,
        TOKENS_PER_PROGRAM=config.tokens_per_program,
        HAS_V=has_v,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def fits_registers(config: FloorConfig, head_dim: int, v_head_dim: int, num_kv_heads: int = 1) -> bool:
    """Whether a setting's float32 accumulators fit :data:`MAX_ACC_REGISTERS` per thread.

    The kernel holds ``BLOCK_N x (D + Dv)`` float32 accumulators over
    ``32 x num_warps`` threads; beyond ~128 per thread (plus the tiles in
    flight) the compiler spills to local memory and the setting is only slower.
    A program that gathers ``num_kv_heads`` heads of each token holds
    ``BLOCK_N x num_kv_heads x (D + Dv)``.
    """
    width = (triton.next_power_of_2(num_kv_heads * head_dim)
             + (triton.next_power_of_2(num_kv_heads * v_head_dim) if v_head_dim else 0))
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
    *,
    tokens_per_program: Sequence[int] = TOKENS_PER_PROGRAM,
    num_warps: Sequence[int] = NUM_WARPS,
    heads_together: bool = False,
) -> dict:
    """The fastest launch setting of :func:`gather_sum` for these inputs.

    Two rounds, so a search costs at most 17 timings instead of the grid's 56:

    1. every (``BLOCK_N``, tokens per program) at 4 warps and 3 stages;
    2. the other warps x stages settings at the best pair of round 1.

    ``tokens_per_program`` and ``num_warps`` narrow the grid (:data:`REDUCED_GRID`:
    9 timings); the first round keeps its 4 warps only where ``num_warps`` has them.

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
        "trials": [[block_n, tokens_per_program, num_warps, num_stages, µs or None], ...],
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
                or not fits_registers(cfg, head_dim, v_head_dim, heads_read)):
            return
        n_chunks = max(1, triton.cdiv(n_tokens, cfg.tokens_per_program))
        out = torch.empty(n_chunks * h_kv // heads_read, dtype=torch.float32, device=k_buffer.device)
        try:
            trials[cfg] = time_us(lambda: gather_sum(k_buffer, v_buffer, kv_indices, cfg, out,
                                                     heads_together=heads_together))
        except Exception as err:  # a setting that cannot run here is skipped, not fatal
            trials[cfg] = None
            errors[f"{cfg.block_n}/{cfg.tokens_per_program}/{cfg.num_warps}w/{cfg.num_stages}s"] = (
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
    winner = best()
    return {
        "us": trials[winner] if winner else None,
        "config": winner.as_dict() if winner else None,
        "trials": [[c.block_n, c.tokens_per_program, c.num_warps, c.num_stages, t] for c, t in trials.items()],
        "errors": errors,
    }
