"""Stage 2 of split-KV verify: merge the partial results exactly.

Part ``s`` of a query row holds ``o_s`` (softmax attention restricted to that
part's keys) and ``lse_s = log sum_{j in part s} exp(score_j)``. The attention
over all keys is the LSE-weighted mean of the parts::

    lse = log sum_s exp(lse_s)          o = sum_s exp(lse_s - lse) * o_s

which is exact, associative and commutative. An empty part (``lse_s = -inf``)
gets weight 0. An attention sink adds ``exp(sink)`` to the denominator only:
it is a logit with no value row.

The merge is itself an online softmax, over parts instead of keys: one program
per (token, query head, slice of the value dimension) walks the
``n_splits + 1`` parts in chunks of ``BLOCK_S``, keeping a running maximum so
no ``exp`` overflows. ``BLOCK_S`` covers all parts when they fit a register
tile, so the loop usually runs once: the merge is one round trip to memory,
which is what matters at small batch, where it is pure latency. Logs are
base 2, as in stage 1.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["merge_partials"]


@triton.jit
def _merge_partials_kernel(
    Part_O, Part_LSE, O, Sinks, qo_indptr,
    batch_size,
    n_parts,
    stride_ot, stride_oh,
    NUM_Q_HEADS: tl.constexpr,
    V_HEAD_DIM: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched early: wait here until stage 1 has finished
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    if t >= tl.load(qo_indptr + batch_size):
        return  # a padding row that belongs to no sequence: leave it alone

    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    offs_dv = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < V_HEAD_DIM
    row = (t * NUM_Q_HEADS + h) * n_parts  # first part of this (token, head)

    m = tl.full([1], float("-inf"), tl.float32)  # running max of lse (base 2)
    den = tl.zeros([1], tl.float32)  # sum of 2^(lse_s - m)
    acc = tl.zeros([BLOCK_DV], tl.float32)  # sum of 2^(lse_s - m) * o_s
    for s0 in range(0, n_parts, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        s_ok = s < n_parts
        lse = tl.load(Part_LSE + row + s, mask=s_ok, other=float("-inf"))
        o = tl.load(
            Part_O + (row + s)[:, None] * V_HEAD_DIM + offs_dv[None, :],
            mask=s_ok[:, None] & dv_ok[None, :], other=0.0,
        )
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_shift)
        w = tl.exp2(lse - m_shift)
        # An empty part contributes nothing, whatever its o slot holds.
        contrib = tl.where(w[:, None] > 0, w[:, None] * o, 0.0)
        den = den * alpha + tl.sum(w, 0)
        acc = acc * alpha + tl.sum(contrib, 0)
        m = m_new
    if HAS_SINKS:
        sink = tl.load(Sinks + h).to(tl.float32) * 1.4426950408889634  # to base 2
        m_shift = tl.where(m == float("-inf"), 0.0, m)
        den += tl.exp2(sink - m_shift)
    out = acc / tl.where(den > 0, den, 1.0)  # a row with no visible key: 0
    tl.store(O + t * stride_ot + h * stride_oh + offs_dv, out.to(O.dtype.element_ty), mask=dv_ok)


def merge_partials(part_o, part_lse, o_extend, qo_indptr, sinks, *, batch_size: int, n_splits: int,
                   pdl: bool = False):
    """Launch stage 2: write ``o_extend[t, h]`` for every token of every sequence.

    Rows of ``o_extend`` past ``qo_indptr[batch_size]`` are not written.
    ``pdl``: launched as a programmatic dependent of stage 1 (which must
    have been launched with ``pdl`` too); it waits for stage 1's results.

    Args:
        part_o: stage 1's partial outputs (float32 scratch).
        part_lse: stage 1's base-2 LSEs (float32 scratch).
        o_extend: the output ``[tokens, H_Q, Dv]``, written in place.
        qo_indptr: ``[bs + 1]`` draft rows of each sequence.
        sinks: ``[H_Q]`` sink logits, or ``None``.
        batch_size: sequences in the call.
        n_splits: prefix slices stage 1 used.
        pdl: see above.

    Returns:
        The launch grid ``(tokens, H_Q, value-dimension blocks)``.
    """
    n_tok, h_q, v_head_dim = o_extend.shape
    n_parts = n_splits + 1
    # All parts in one tile when they fit (<= 8K fp32 values per program).
    block_s = min(triton.next_power_of_2(n_parts), 128)
    block_dv = min(triton.next_power_of_2(v_head_dim), max(16, 8192 // block_s))
    grid = (n_tok, h_q, triton.cdiv(v_head_dim, block_dv))
    _merge_partials_kernel[grid](
        part_o, part_lse, o_extend,
        sinks if sinks is not None else part_lse,  # placeholder pointer, never read
        qo_indptr,
        batch_size,
        n_parts,
        o_extend.stride(0), o_extend.stride(1),
        NUM_Q_HEADS=h_q,
        V_HEAD_DIM=v_head_dim,
        BLOCK_DV=block_dv,
        BLOCK_S=block_s,
        HAS_SINKS=sinks is not None,
        USE_PDL=pdl,
        num_warps=4,
        **({"launch_pdl": True} if pdl else {}),
    )
    return grid
