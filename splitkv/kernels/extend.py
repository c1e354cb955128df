"""The extend (prefill) kernel: one program per (sequence, query head, block of draft rows) walks its whole prefix."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import soft_cap


@triton.jit
def _scores(q, q_r, k, k_r, ROPE_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Raw scores ``q k`` of a query tile against a key tile, ``[BLOCK_M, BLOCK_N]`` float32.

    ``k`` is ``[BLOCK_D, BLOCK_N]`` (already transposed). With ``ROPE_DIM > 0``
    (MLA) the head comes in two chunks, latent and rope, and so does the dot:
    ``q k + q_r k_r``; otherwise ``q_r``/``k_r`` are unused.
    """
    s = tl.dot(q, k, input_precision=DOT_PRECISION)
    if ROPE_DIM > 0:
        s = tl.dot(q_r, k_r, acc=s, input_precision=DOT_PRECISION)
    return s


@triton.jit
def _attend_tile(
    acc, m_i, l_i, s, v, visible, qk_scale, v_scale, temperature, logit_cap,
    HAS_LOGIT_CAP: tl.constexpr, HAS_XAI_TEMP: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Fold one key tile into the online softmax of a query tile.

    ``s`` holds the tile's raw scores ``[BLOCK_M, BLOCK_N]`` (:func:`_scores`),
    ``v`` the values ``[BLOCK_N, BLOCK_DV]``; ``visible`` ``[BLOCK_M,
    BLOCK_N]`` says which scores survive. ``m_i``/``l_i`` are the running max
    and denominator per row, ``acc`` the unnormalised output ``sum p * v``,
    all float32.
    """
    s = s * qk_scale
    if HAS_LOGIT_CAP:
        s = soft_cap(s, logit_cap)
    if HAS_XAI_TEMP:
        s = s * temperature[:, None]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no visible key yet keeps m = -inf; subtracting 0
    # instead keeps exp() at 0 rather than exp(-inf + inf) = NaN, so rows
    # that are masked over a whole tile (sliding window, custom prefix mask)
    # stay clean. Rows masked everywhere still end as 0 / 0 = NaN, as in
    # the oracle.
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_ref)
    p = tl.exp(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    acc = acc * alpha[:, None] + pv * v_scale
    return acc, m_new, l_i

@triton.jit
def _extend_attention_kernel(
    Q, K_ext, V_ext, O, K_buf, V_buf,
    qo_indptr, kv_indptr, kv_indices,
    custom_mask, mask_indptr, window_kv_offsets, sinks,
    sm_scale, k_scale, v_scale, logit_cap, xai_temperature_len, sliding_window_size,
    stride_q_tok, stride_q_head,
    stride_k_tok, stride_k_head,
    stride_v_tok, stride_v_head,
    stride_o_tok, stride_o_head,
    stride_kb_tok, stride_kb_head,
    stride_vb_tok, stride_vb_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, V_HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_CUSTOM_MASK: tl.constexpr, MASK_PREFIX: tl.constexpr, CAUSAL_DRAFT: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_KV_OFFSETS: tl.constexpr,
    HAS_LOGIT_CAP: tl.constexpr, HAS_XAI_TEMP: tl.constexpr, HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROPE_DIM: tl.constexpr,  # > 0: the head is V_HEAD_DIM + ROPE_DIM, taken in two chunks (MLA)
):
    """One program: draft rows ``[pid_m * BLOCK_M, +BLOCK_M)`` of sequence
    ``pid_b``, query head ``pid_h``, against the sequence's prefix and drafts.

    Memory layout: q/k/v/o rows are tokens (stride ``*_tok``), then heads
    (stride ``*_head``), then a unit-stride head dimension; the draft tokens
    of sequence ``b`` are rows ``qo_indptr[b]:qo_indptr[b+1]``. The prefix of
    ``b`` is pool slots ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` of
    ``K_buf``/``V_buf`` (``[pool, H_KV, D]``). Query head ``h`` reads KV head
    ``h // GROUP``. Key positions are absolute: prefix key ``n`` sits at
    position ``n``, draft key ``j`` at ``prefix_len + j``, draft query ``i`` at
    ``prefix_len + i``.

    MLA (``ROPE_DIM > 0``): a key is ``[latent (V_HEAD_DIM) | rope (ROPE_DIM)]``
    and the head is taken in those two chunks, ``BLOCK_D = V_HEAD_DIM``, so
    576 = 512 + 64 pads nothing (one chunk would pad it to 1024).
    """
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_m = tl.program_id(2)
    kv_head = pid_h // GROUP

    q_start = tl.load(qo_indptr + pid_b)
    ext_len = tl.load(qo_indptr + pid_b + 1) - q_start
    if pid_m * BLOCK_M >= ext_len:
        return
    kv_start = tl.load(kv_indptr + pid_b)
    prefix_len = tl.load(kv_indptr + pid_b + 1) - kv_start

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # draft row within the sequence
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < ext_len
    d_ok = offs_d < HEAD_DIM
    dv_ok = offs_dv < V_HEAD_DIM
    q_pos = prefix_len + offs_m  # absolute position of each query row

    q_rows = Q + (q_start + offs_m)[:, None] * stride_q_tok + pid_h * stride_q_head
    q = tl.load(q_rows + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_r = q  # the rope chunk (MLA); unused otherwise
    if ROPE_DIM > 0:
        offs_r = V_HEAD_DIM + tl.arange(0, ROPE_DIM)
        q_r = tl.load(q_rows + offs_r[None, :], mask=row_ok[:, None], other=0.0)

    # xai temperature: scores of the query at position p > len scale by
    # log2(p) / log2(len).
    temperature = tl.full([BLOCK_M], 1.0, tl.float32)
    if HAS_XAI_TEMP:
        temperature = tl.where(
            q_pos > xai_temperature_len,
            tl.log2(q_pos.to(tl.float32)) / tl.log2(xai_temperature_len.to(tl.float32)),
            1.0,
        )

    # Custom mask: sequence b's rows start at mask_indptr[b], row i holds the
    # visibility of key position n at column offset + n, rows being
    # offset + prefix_len + ext_len wide.
    mask_row = offs_m
    if USE_CUSTOM_MASK:
        kv_offset = 0
        if HAS_KV_OFFSETS:
            kv_offset = tl.load(window_kv_offsets + pid_b)
        row_width = prefix_len + ext_len + kv_offset
        mask_row = tl.load(mask_indptr + pid_b) + offs_m.to(tl.int64) * row_width + kv_offset

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    # ---- Prefix: gathered from the pool, dequantised with k_scale/v_scale.
    prefix_scale = sm_scale * k_scale
    start_n = tl.full([], 0, tl.int32)
    if HAS_WINDOW:
        # No query of this block sees a key before its first row's window.
        start_n = tl.maximum(prefix_len + pid_m * BLOCK_M - sliding_window_size, 0).to(tl.int32)
    # `while`, not `range`: the Triton interpreter cannot take loaded values
    # as range bounds under numpy >= 2.4 (it calls int() on a 1-element
    # array). Compiled, this is an scf.while, which Triton does not software-
    # pipeline; the baseline gives that up.
    while start_n < prefix_len:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < prefix_len
        slots = tl.load(kv_indices + kv_start + offs_n, mask=n_ok, other=0).to(tl.int64)
        k_cols = K_buf + slots[None, :] * stride_kb_tok + kv_head * stride_kb_head
        k = tl.load(k_cols + offs_d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0).to(q.dtype)
        k_r = k
        if ROPE_DIM > 0:
            k_r = tl.load(k_cols + offs_r[:, None], mask=n_ok[None, :], other=0.0).to(q.dtype)
        v = tl.load(
            V_buf + slots[:, None] * stride_vb_tok + kv_head * stride_vb_head + offs_dv[None, :],
            mask=n_ok[:, None] & dv_ok[None, :],
            other=0.0,
        ).to(q.dtype)
        visible = row_ok[:, None] & n_ok[None, :]
        if MASK_PREFIX:
            bits = tl.load(custom_mask + mask_row[:, None] + offs_n[None, :], mask=visible, other=0)
            visible = visible & (bits != 0)
        if HAS_WINDOW:
            visible = visible & (q_pos[:, None] <= offs_n[None, :] + sliding_window_size)
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, _scores(q, q_r, k, k_r, ROPE_DIM, DOT_PRECISION), v, visible, prefix_scale, v_scale,
            temperature, logit_cap,
            HAS_LOGIT_CAP, HAS_XAI_TEMP, DOT_PRECISION,
        )
        start_n += BLOCK_N

    # ---- Drafts: rows of k_extend/v_extend, unscaled, under the draft mask.
    n_hi = ext_len
    if CAUSAL_DRAFT:
        # Causal: no row of this block sees a draft past its last row.
        n_hi = tl.minimum(ext_len, (pid_m + 1) * BLOCK_M)
    start_n = tl.full([], 0, tl.int32)
    while start_n < n_hi:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < ext_len
        k_cols = K_ext + (q_start + offs_n)[None, :] * stride_k_tok + kv_head * stride_k_head
        k = tl.load(k_cols + offs_d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        k_r = k
        if ROPE_DIM > 0:
            k_r = tl.load(k_cols + offs_r[:, None], mask=n_ok[None, :], other=0.0)
        v = tl.load(
            V_ext + (q_start + offs_n)[:, None] * stride_v_tok + kv_head * stride_v_head + offs_dv[None, :],
            mask=n_ok[:, None] & dv_ok[None, :],
            other=0.0,
        )
        visible = row_ok[:, None] & n_ok[None, :]
        if USE_CUSTOM_MASK:
            bits = tl.load(
                custom_mask + mask_row[:, None] + prefix_len + offs_n[None, :], mask=visible, other=0
            )
            visible = visible & (bits != 0)
        if CAUSAL_DRAFT:
            visible = visible & (offs_m[:, None] >= offs_n[None, :])
        if HAS_WINDOW:
            visible = visible & (q_pos[:, None] <= prefix_len + offs_n[None, :] + sliding_window_size)
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, _scores(q, q_r, k, k_r, ROPE_DIM, DOT_PRECISION), v, visible, sm_scale, 1.0,
            temperature, logit_cap,
            HAS_LOGIT_CAP, HAS_XAI_TEMP, DOT_PRECISION,
        )
        start_n += BLOCK_N

    if HAS_SINKS:
        # The sink is one extra logit per head that carries no value. A row
        # that saw no key (m_i = -inf) gets l_i = inf and comes out 0, as in
        # the oracle.
        sink = tl.load(sinks + pid_h).to(tl.float32)
        l_i += tl.exp(sink - m_i)

    out = acc / l_i[:, None]
    o_ptrs = O + (q_start + offs_m)[:, None] * stride_o_tok + pid_h * stride_o_head + offs_dv[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])
