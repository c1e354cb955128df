"""Merge kernels: a tile's slices merged in a fixed order, and the public state merge.

``lse = log2 sum_s 2^lse_s`` and ``o = sum_s 2^(lse_s - lse) o_s``, always
reading slices ``s = 0, 1, ...`` in order so that the result is bitwise the
same whichever program merges.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import _finish, _tile_slices


@triton.jit
def _partial_outputs(Part_O, O):
    """Where the slices' partial outputs are stored: ``Part_O`` (float32), or the same
    address as bfloat16 when the output ``O`` is bfloat16 (half the bytes to write and merge)."""
    if O.dtype.element_ty == tl.bfloat16:
        return Part_O.to(tl.pointer_type(tl.bfloat16))
    else:
        return Part_O


@triton.jit
def _merge_rows(Part_O, Part_LSE, first, n_used, r, row_ok, offs_dv, dv_ok,
                BLOCK_M: tl.constexpr, V_HEAD_DIM: tl.constexpr, MERGE_UNROLL: tl.constexpr):
    """Merge slices ``0 .. n_used-1`` of tile rows ``r`` (columns ``offs_dv``) in order.

    Scratch rows of slice ``s`` start at ``first + s * BLOCK_M``. Returns the
    merged state ``(acc, m, den)``: ``acc = sum_s 2^(lse_s - m) o_s``,
    ``den = sum_s 2^(lse_s - m)``, ``m`` the largest ``lse_s`` (base 2). The
    order is fixed, so the result does not depend on which program merges.
    """
    m = tl.full(r.shape, float("-inf"), tl.float32)
    den = tl.zeros(r.shape, tl.float32)
    acc = tl.zeros([r.shape[0], offs_dv.shape[0]], tl.float32)
    for s0 in range(0, n_used, MERGE_UNROLL):
        for u in tl.static_range(MERGE_UNROLL):
            s = s0 + u
            rs = first + s * BLOCK_M + r
            s_ok = row_ok & ((r * 0 + s) < n_used)
            # .cg: read through L2, where the other programs' stores are.
            lse_u = tl.load(Part_LSE + rs, mask=s_ok, other=float("-inf"), cache_modifier=".cg")
            o_u = tl.load(Part_O + rs[:, None] * V_HEAD_DIM + offs_dv[None, :],
                          mask=s_ok[:, None] & dv_ok[None, :], other=0.0, cache_modifier=".cg").to(tl.float32)
            m_new = tl.maximum(m, lse_u)
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_shift)
            w = tl.exp2(lse_u - m_shift)
            den = den * alpha + w
            # Empty slices (w == 0) add nothing whatever their o; a NaN weight propagates.
            acc = acc * alpha[:, None] + tl.where(w[:, None] == 0, 0.0, w[:, None] * o_u)
            m = m_new
    return acc, m, den

@triton.jit
def _merge_chunk(O, LSE_Out, Sinks, Part_O, Part_LSE, tile, row_chunk, col_chunk, m_block, head_tile, q_start,
                 n_draft, n_used, n_splits, stride_ot, stride_oh,
                 NUM_Q_HEADS: tl.constexpr, HEADS_PER_TILE: tl.constexpr, V_HEAD_DIM: tl.constexpr,
                 BLOCK_M: tl.constexpr, MERGE_ROWS: tl.constexpr, MERGE_DV: tl.constexpr,
                 HAS_SINKS: tl.constexpr, WRITE_LSE: tl.constexpr, MERGE_UNROLL: tl.constexpr):
    """Merge rows ``row_chunk * MERGE_ROWS + [0, MERGE_ROWS)`` x columns ``col_chunk * MERGE_DV + [0, MERGE_DV)``
    of tile ``tile``'s ``n_used`` slices and write them to the output (the LSE from column chunk 0)."""
    r = row_chunk * MERGE_ROWS + tl.arange(0, MERGE_ROWS)
    rows = m_block * BLOCK_M + r
    l = rows // HEADS_PER_TILE
    h = head_tile * HEADS_PER_TILE + rows % HEADS_PER_TILE
    row_ok = (l < n_draft) & (r < BLOCK_M)
    offs_dv = col_chunk * MERGE_DV + tl.arange(0, MERGE_DV)
    dv_ok = offs_dv < V_HEAD_DIM
    acc, m, den = _merge_rows(Part_O, Part_LSE, tile.to(tl.int64) * n_splits * BLOCK_M, n_used,
                              r, row_ok, offs_dv, dv_ok, BLOCK_M, V_HEAD_DIM, MERGE_UNROLL)
    sink2 = 0.0
    if HAS_SINKS:
        sink2 = tl.load(Sinks + h, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    o, lse2 = _finish(acc, m, den, sink2, HAS_SINKS)
    out_rows = (q_start + l).to(tl.int64)
    tl.store(O + out_rows[:, None] * stride_ot + h[:, None] * stride_oh + offs_dv[None, :],
             o.to(O.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])
    if WRITE_LSE:
        if col_chunk == 0:
            tl.store(LSE_Out + out_rows * NUM_Q_HEADS + h, lse2 * 0.6931471805599453, mask=row_ok)

@triton.jit(do_not_specialize=["lse_offset", "num_tokens", "kv_len", "n_splits", "min_split", "window"])
def _merge_kernel(
    O, LSE_Out, qo_indptr, kv_indptr, Last_Page_Len, Sinks, Part_O, lse_offset,
    num_tokens, kv_len, n_splits, min_split, window,
    stride_ot, stride_oh,
    NUM_Q_HEADS: tl.constexpr,
    HEADS_PER_TILE: tl.constexpr,
    M_BLOCKS: tl.constexpr,
    V_HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MERGE_ROWS: tl.constexpr,  # tile rows per program
    MERGE_DV: tl.constexpr,  # value columns per program
    PAGE_SIZE: tl.constexpr,
    SPLIT_TOKENS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    MERGE_UNROLL: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched early: wait here until the verify kernel has finished
):
    """The merge spread over a grid ``(tiles, row chunks, column chunks)``.

    For launches with many slices per tile (small batches), one program per
    tile would merge alone, reading every slice's partial; here each program
    merges ``MERGE_ROWS x MERGE_DV`` of it. Same slicing (``_tile_slices``),
    same order (``_merge_rows``), same results as the in-kernel merge.
    """
    tile = tl.program_id(0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    HEAD_TILES: tl.constexpr = NUM_Q_HEADS // HEADS_PER_TILE
    b, head_tile, m_block, q_start, n_draft, kv_start, n_prefix, first_key, split_len, n_used = _tile_slices(
        tile, qo_indptr, kv_indptr, Last_Page_Len, num_tokens, kv_len, n_splits, min_split, window,
        HEAD_TILES, M_BLOCKS, BLOCK_N, SPLIT_TOKENS, PAGE_SIZE, HAS_WINDOW)
    Part_LSE = Part_O + lse_offset
    Part_O = _partial_outputs(Part_O, O)
    # Tiles with one slice were finished by the verify kernel itself.
    if (n_used > 1) & (tl.program_id(1) * MERGE_ROWS < BLOCK_M):
        _merge_chunk(O, LSE_Out, Sinks, Part_O, Part_LSE, tile, tl.program_id(1), tl.program_id(2),
                     m_block, head_tile, q_start, n_draft, n_used, n_splits, stride_ot, stride_oh,
                     NUM_Q_HEADS, HEADS_PER_TILE, V_HEAD_DIM, BLOCK_M, MERGE_ROWS, MERGE_DV,
                     HAS_SINKS, WRITE_LSE, MERGE_UNROLL)


@triton.jit
def _merge_states_kernel(
    V, S, V_Out, S_Out,
    n_states,
    stride_vt, stride_vs, stride_vh,
    stride_st, stride_ss, stride_sh,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WRITE_S: tl.constexpr,
):
    """One program per (token, head, slice of the head dim): an online LSE merge over the states."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs < HEAD_DIM
    m = tl.full([1], float("-inf"), tl.float32)  # running max of s_i
    den = tl.zeros([1], tl.float32)  # sum_i exp(s_i - m)
    acc = tl.zeros([BLOCK_D], tl.float32)  # sum_i exp(s_i - m) * v_i
    for i in range(0, n_states):
        s_i = tl.load(S + t * stride_st + i * stride_ss + h * stride_sh + tl.zeros([1], tl.int32)).to(tl.float32)
        m_new = tl.maximum(m, s_i)
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_shift)
        w = tl.exp(s_i - m_shift)
        # An empty state (s_i = -inf) weighs 0 and its v is not read.
        v_i = tl.load(V + t * stride_vt + i * stride_vs + h * stride_vh + offs, mask=d_ok & (w > 0), other=0.0)
        den = den * alpha + w
        acc = acc * alpha + w * v_i.to(tl.float32)
        m = m_new
    has = den > 0
    out = acc / tl.where(has, den, 1.0)
    tl.store(V_Out + t * stride_ot + h * stride_oh + offs, out.to(V_Out.dtype.element_ty), mask=d_ok)
    if WRITE_S:
        s = tl.where(has, m + tl.log(tl.where(has, den, 1.0)), float("-inf"))
        if tl.program_id(2) == 0:
            tl.store(S_Out + t * tl.num_programs(1) + h + tl.zeros([1], tl.int32), s)
