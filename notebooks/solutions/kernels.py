"""Solutions to the Triton kernels of notebooks 03 and 04: the same functions, with the same
signatures, as the stubs in ``notebooks/your_kernels.py``."""

import splitkv  # noqa: F401  (before triton: on a CPU the kernels run in Triton's interpreter)
import triton
import triton.language as tl


@triton.jit
def tile_step(m_i, l_i, acc, s, v):
    """Fold a tile of base-2 scores ``s [BLOCK_M, BLOCK_N]`` (``-inf``: hidden) and values ``v`` in.

    ``m_i`` is the running row maximum, ``l_i`` the running sum of
    ``2^(s - m_i)``, ``acc`` the unnormalised output; when the maximum grows,
    both are rescaled by ``alpha = 2^(m_old - m_new)``.
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
    alpha = tl.exp2(m_i - shift)
    p = tl.exp2(s - shift[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def merge_kernel(Part_O, Part_LSE, O, LSE, n_parts, DV: tl.constexpr, BLOCK_M: tl.constexpr):
    """Program ``t`` merges tile ``t``'s ``n_parts`` states into ``O [t] [BLOCK_M, DV]``, ``LSE [t]`` (natural log)."""
    t = tl.program_id(0)
    r, dv = tl.arange(0, BLOCK_M), tl.arange(0, DV)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running maximum of the base-2 LSEs
    den = tl.zeros([BLOCK_M], tl.float32)                # sum of 2^(lse_s - m)
    acc = tl.zeros([BLOCK_M, DV], tl.float32)            # sum of 2^(lse_s - m) o_s
    for s in range(n_parts):  # parts in a fixed order: the same bits on every run
        row = (t * n_parts + s) * BLOCK_M + r
        lse = tl.load(Part_LSE + row)
        o = tl.load(Part_O + row[:, None] * DV + dv[None, :])
        m_new = tl.maximum(m, lse)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # every part so far empty: shift by 0, not -inf
        alpha = tl.exp2(m - shift)  # rescales what was summed against the old maximum
        w = tl.exp2(lse - shift)    # this part's weight, at most 1; 0 for an empty part
        den = den * alpha + w
        acc = acc * alpha[:, None] + tl.where(w[:, None] > 0, w[:, None] * o, 0.0)  # select: 0 * NaN = NaN
        m = m_new
    has = den > 0
    tl.store(O + (t * BLOCK_M + r)[:, None] * DV + dv[None, :], acc / tl.where(has, den, 1.0)[:, None])
    lse2 = m + tl.log2(tl.where(has, den, 1.0))
    tl.store(LSE + t * BLOCK_M + r, tl.where(has, lse2 * 0.6931471805599453, float("-inf")))  # x ln 2: natural log


@triton.jit
def load_q_tile(Q, q_start, n_draft, kv_head, stride_qt, stride_qh,
                         GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr):
    """The ``[BLOCK_M, D]`` query tile of one KV head: row ``r`` is draft ``r // GROUP`` of head ``kv_head * GROUP + r % GROUP``."""
    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    token = q_start + r // GROUP        # draft-major: the G heads of draft 0, then of draft 1, ...
    head = kv_head * GROUP + r % GROUP  # the query heads that share this KV head
    row_ok = r // GROUP < n_draft       # padding rows: 0, never the next sequence's queries
    return tl.load(Q + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                   mask=row_ok[:, None], other=0.0)


@triton.jit
def slice_kernel(Q, K, V, qo_indptr, kv_indptr, kv_indices, Part_O, Part_LSE, qk_scale, n_parts,
                          stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                          GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid ``(batch, H_kv, n_splits)``: the base-2 partial state of one tile over one slice of its prefix."""
    b, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # The slice: an even share of the prefix, rounded up to whole key tiles; the last ones may be short or empty.
    kv_start = tl.load(kv_indptr + b)
    n_prefix = tl.load(kv_indptr + b + 1) - kv_start
    split_len = tl.cdiv(tl.cdiv(n_prefix, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, n_prefix)
    q_start = tl.load(qo_indptr + b)
    q = load_q_tile(Q, q_start, tl.load(qo_indptr + b + 1) - q_start, kv_head, stride_qt, stride_qh,
                             GROUP, D, BLOCK_M)
    d, dv = tl.arange(0, D), tl.arange(0, DV)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        slot = tl.load(kv_indices + kv_start + n, mask=n_ok, other=0).to(tl.int64)  # the gather
        k = tl.load(K + slot[:, None] * stride_kt + kv_head * stride_kh + d[None, :], mask=n_ok[:, None], other=0.0)
        v = tl.load(V + slot[:, None] * stride_vt + kv_head * stride_vh + dv[None, :], mask=n_ok[:, None],
                    other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # base 2: qk_scale = sm_scale * log2(e)
        m_i, l_i, acc = tile_step(m_i, l_i, acc, tl.where(n_ok[None, :], s, float("-inf")), v)
    # Part `split` of tile (b, kv_head); an empty slice (l_i = 0) stores (0, -inf), never 0 / 0.
    r = tl.arange(0, BLOCK_M)
    has = l_i > 0
    part = ((b * tl.num_programs(1) + kv_head) * n_parts + split) * BLOCK_M + r
    tl.store(Part_O + part[:, None] * DV + dv[None, :], acc / tl.where(has, l_i, 1.0)[:, None])
    tl.store(Part_LSE + part, tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf")))


@triton.jit
def draft_kernel(Q, K_Ext, V_Ext, qo_indptr, kv_indptr, Mask, mask_indptr, Part_O, Part_LSE,
                          qk_scale, n_parts, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                          GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_L: tl.constexpr, TREE: tl.constexpr):
    """Grid ``(batch, H_kv)``: the partial state of one tile over its draft block, stored as part ``n_parts - 1``."""
    b, kv_head = tl.program_id(0), tl.program_id(1)
    q_start = tl.load(qo_indptr + b)
    n_draft = tl.load(qo_indptr + b + 1) - q_start
    q = load_q_tile(Q, q_start, n_draft, kv_head, stride_qt, stride_qh, GROUP, D, BLOCK_M)
    d, dv = tl.arange(0, D), tl.arange(0, DV)
    row_l = tl.arange(0, BLOCK_M) // GROUP  # the draft token of each packed row
    j = tl.arange(0, BLOCK_L)               # the draft keys
    j_ok = j < n_draft
    k = tl.load(K_Ext + (q_start + j)[:, None] * stride_kt + kv_head * stride_kh + d[None, :],
                mask=j_ok[:, None], other=0.0)
    v = tl.load(V_Ext + (q_start + j)[:, None] * stride_vt + kv_head * stride_vh + dv[None, :],
                mask=j_ok[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    ok = (row_l < n_draft)[:, None] & j_ok[None, :]
    if TREE:
        # Row l of the sequence's [L, P + L] mask; the draft columns start after the P prefix columns.
        n_prefix = tl.load(kv_indptr + b + 1) - tl.load(kv_indptr + b)
        at = tl.load(mask_indptr + b) + row_l[:, None] * (n_prefix + n_draft) + n_prefix + j[None, :]
        visible = ok & (tl.load(Mask + at, mask=ok, other=0) != 0)
    else:
        visible = ok & (j[None, :] <= row_l[:, None])  # causal: draft l sees drafts 0..l, itself included
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV], tl.float32)
    m_i, l_i, acc = tile_step(m_i, l_i, acc, tl.where(visible, s, float("-inf")), v)
    # The tile's last part; padding rows (l_i = 0) store (0, -inf).
    r = tl.arange(0, BLOCK_M)
    has = l_i > 0
    part = ((b * tl.num_programs(1) + kv_head) * n_parts + n_parts - 1) * BLOCK_M + r
    tl.store(Part_O + part[:, None] * DV + dv[None, :], acc / tl.where(has, l_i, 1.0)[:, None])
    tl.store(Part_LSE + part, tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf")))
