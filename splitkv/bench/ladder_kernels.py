"""The latency ladder's kernels: the verify kernel's slices, built up one step at a time.

Every rung runs the verify kernel's grid ``(tiles, n_splits)``: a tile is one
sequence x one KV head with all its query heads x draft tokens as rows (GQA
packing, ``row r -> draft r // GROUP, query head kv_head * GROUP + r % GROUP``),
and program ``(tile, split)`` walks the same slice of the prefix as the real
kernel, found by the same ``_tile_slices``. ``RUNG`` says how much of the
kernel's work the slice does:

1. gather: load the slice's slots, gather its K and V rows (K in the layout
   the dot takes), keep their element-wise maximum in the pool's dtype (a
   compare and a select per element, and no more registers than the tiles
   themselves, as in the rungs above it; float32 sums would hold twice as many);
2. + the QK dot: the query tile is loaded, scores ``q k^T`` computed and each
   row's maximum kept (V is still only kept as in rung 1, so that its loads stay);
3. + the online softmax and the PV dot, the slice's state ``(m, l, acc)``
   kept in registers; the last slice's program also attends to the draft
   block, as the verify kernel does;
4. + the slice's normalised output and base-2 LSE written to float32 scratch,
   in the verify kernel's layout ``[tiles, n_splits, BLOCK_M, (V_HEAD_DIM)]``.

Rungs 1-3 write one float per working program (a checksum of what they
computed, ``Out[tile * n_splits + split]``), so that nothing is dead code and
the output costs nothing. With ``EXPOSE`` rung 3 also stores its raw state
(``acc`` to ``Part_O``, ``m`` to ``Part_LSE``, ``l`` to ``Part_L``), so that a
test can merge it; timed launches leave it off. The fifth rung, the merge, is
the verify kernel itself.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..kernels.common import _attend_tile, _finish, _pool_offset, _tile_slices


@triton.jit
def _empty_kernel(X):
    """Does nothing: a graph of this one launch times the launch itself."""
    pass


@triton.jit
def _gather_tile(K_Buf, V_Buf, kv_indices, kv_start, offs_n, n_ok, pool_tokens, kv_head, offs_d, offs_dv, d_ok,
                 dv_ok, stride_kbt, stride_kbh, stride_vbt, stride_vbh, K_ROWS: tl.constexpr,
                 OFFSETS_32: tl.constexpr):
    """The verify kernel's prefix gather of one key tile: ``(k [D, BLOCK_N], v [BLOCK_N, DV], n_ok)``.

    Slots outside the pool are masked off, as there. ``K_ROWS`` loads K as
    rows and transposes it on chip; otherwise the addresses walk ``D`` within a key.
    """
    slot = tl.load(kv_indices + kv_start + offs_n, mask=n_ok, other=0)
    n_ok = n_ok & (slot >= 0) & (slot < pool_tokens)
    slot = _pool_offset(slot, OFFSETS_32)
    if K_ROWS:
        k = tl.trans(tl.load(K_Buf + slot[:, None] * stride_kbt + kv_head * stride_kbh + offs_d[None, :],
                             mask=n_ok[:, None] & d_ok[None, :], other=0.0))
    else:
        k = tl.load(K_Buf + slot[None, :] * stride_kbt + kv_head * stride_kbh + offs_d[:, None],
                    mask=n_ok[None, :] & d_ok[:, None], other=0.0)
    v = tl.load(V_Buf + slot[:, None] * stride_vbt + kv_head * stride_vbh + offs_dv[None, :],
                mask=n_ok[:, None] & dv_ok[None, :], other=0.0)
    return k, v, n_ok


@triton.jit
def _keep_max(acc, x):
    """The element-wise maximum of two tiles of the pool's dtype, in that dtype. A compare and a select,
    not ``tl.maximum``: Triton 3.6 widens bf16 operands of ``tl.maximum`` to float32, which would change
    the loop-carried tile's type (a compile error) and add two conversions per element."""
    return tl.where(x > acc, x, acc)


@triton.jit
def _draft_block(q, K_Ext, V_Ext, q_start, n_draft, kv_head, l, row_ok, offs_d, offs_dv, d_ok, dv_ok,
                 qk_scale_draft, m_i, l_i, acc, stride_ket, stride_keh, stride_vet, stride_veh,
                 BLOCK_N_DRAFT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The causal draft block, as the verify kernel's last slice takes it: draft ``l`` sees drafts ``j <= l``."""
    for start in range(0, n_draft, BLOCK_N_DRAFT):
        j = start + tl.arange(0, BLOCK_N_DRAFT)
        j_ok = j < n_draft
        rows = (q_start + j).to(tl.int64)
        k = tl.load(K_Ext + rows[None, :] * stride_ket + kv_head * stride_keh + offs_d[:, None],
                    mask=j_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(V_Ext + rows[:, None] * stride_vet + kv_head * stride_veh + offs_dv[None, :],
                    mask=j_ok[:, None] & dv_ok[None, :], other=0.0)
        visible = row_ok[:, None] & j_ok[None, :] & (j[None, :] <= l[:, None])
        # No logit cap, no temperature (their arguments are placeholders).
        m_i, l_i, acc = _attend_tile(q, k, v, visible, qk_scale_draft, m_i, l_i, acc, 0.0, m_i,
                                     False, False, DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def _rung_kernel(
    Q, K_Ext, V_Ext, K_Buf, V_Buf, qo_indptr, kv_indptr, kv_indices,
    Out, Part_O, Part_LSE, Part_L,
    qk_scale, qk_scale_draft, num_tokens, pool_tokens, kv_len, n_splits, min_split,
    stride_qt, stride_qh, stride_ket, stride_keh, stride_vet, stride_veh,
    stride_kbt, stride_kbh, stride_vbt, stride_vbh,
    RUNG: tl.constexpr, EXPOSE: tl.constexpr,
    GROUP: tl.constexpr, NUM_KV_HEADS: tl.constexpr, M_BLOCKS: tl.constexpr,
    HEAD_DIM: tl.constexpr, V_HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N_DRAFT: tl.constexpr, K_ROWS: tl.constexpr, OFFSETS_32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Program ``(tile, split)``: rung ``RUNG`` of the ladder over the verify kernel's slice (module docstring).

    ``qk_scale`` is the prefix scores' scale (``sm_scale x k_scale x log2(e)``,
    base 2), ``qk_scale_draft`` the draft block's; token pools only, causal drafts.
    """
    tile = tl.program_id(0)
    split = tl.program_id(1)
    b, kv_head, m_block, q_start, n_draft, kv_start, n_prefix, first_key, split_len, n_used = _tile_slices(
        tile, qo_indptr, kv_indptr, kv_indptr, num_tokens, kv_len, n_splits, min_split, 0,
        NUM_KV_HEADS, M_BLOCKS, BLOCK_N, 0, 1, False)
    if (split < n_used) & (m_block * BLOCK_M < n_draft * GROUP):
        r = tl.arange(0, BLOCK_M)
        rows = m_block * BLOCK_M + r
        l = rows // GROUP
        row_ok = l < n_draft
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        d_ok = offs_d < HEAD_DIM
        dv_ok = offs_dv < V_HEAD_DIM
        if RUNG >= 2:
            h = kv_head * GROUP + rows % GROUP
            q = tl.load(Q + (q_start + l).to(tl.int64)[:, None] * stride_qt + h[:, None] * stride_qh
                        + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        acc_k = tl.zeros([BLOCK_D, BLOCK_N], K_Buf.dtype.element_ty)  # rung 1
        acc_v = tl.zeros([BLOCK_N, BLOCK_DV], V_Buf.dtype.element_ty)  # rungs 1 and 2
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        lo = first_key + split * split_len
        hi = tl.minimum(lo + split_len, n_prefix)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            k, v, n_ok = _gather_tile(K_Buf, V_Buf, kv_indices, kv_start, offs_n, offs_n < hi, pool_tokens,
                                      kv_head, offs_d, offs_dv, d_ok, dv_ok, stride_kbt, stride_kbh, stride_vbt,
                                      stride_vbh, K_ROWS, OFFSETS_32)
            if RUNG == 1:
                acc_k = _keep_max(acc_k, k)
                acc_v = _keep_max(acc_v, v)
            elif RUNG == 2:
                s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale
                m_i = tl.maximum(m_i, tl.max(tl.where(n_ok[None, :], s, float("-inf")), 1))
                acc_v = _keep_max(acc_v, v)
            else:
                m_i, l_i, acc = _attend_tile(q, k.to(q.dtype), v.to(q.dtype), n_ok[None, :], qk_scale,
                                             m_i, l_i, acc, 0.0, m_i, False, False, DOT_PRECISION)
        if RUNG >= 3:
            if split == n_used - 1:
                m_i, l_i, acc = _draft_block(q, K_Ext, V_Ext, q_start, n_draft, kv_head, l, row_ok, offs_d,
                                             offs_dv, d_ok, dv_ok, qk_scale_draft, m_i, l_i, acc, stride_ket,
                                             stride_keh, stride_vet, stride_veh, BLOCK_N_DRAFT, DOT_PRECISION)
        program = tile.to(tl.int64) * n_splits + split
        part = program * BLOCK_M + r
        if RUNG == 4:
            o_s, lse_s = _finish(acc, m_i, l_i, 0.0, False)
            tl.store(Part_O + part[:, None] * V_HEAD_DIM + offs_dv[None, :], o_s, mask=dv_ok[None, :])
            tl.store(Part_LSE + part, lse_s)
        else:
            # The checksum: what the rung computed, one float (rows that saw no key add 0 for m).
            m_seen = tl.sum(tl.where(m_i > float("-inf"), m_i, 0.0), 0)
            if RUNG == 1:
                total = tl.sum(tl.sum(acc_k.to(tl.float32), 1), 0) + tl.sum(tl.sum(acc_v.to(tl.float32), 1), 0)
            elif RUNG == 2:
                total = tl.sum(tl.sum(acc_v.to(tl.float32), 1), 0) + m_seen
            else:
                total = tl.sum(tl.sum(acc, 1), 0) + tl.sum(l_i, 0) + m_seen
            tl.store(Out + program, total)
            if EXPOSE:
                tl.store(Part_O + part[:, None] * V_HEAD_DIM + offs_dv[None, :], acc, mask=dv_ok[None, :])
                tl.store(Part_LSE + part, m_i)
                tl.store(Part_L + part, l_i)
