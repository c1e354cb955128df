"""The baseline: SGLang-style extend (prefill) attention used for target verify.

:func:`extend_attention_fwd` computes what :mod:`splitkv.testing.reference` specifies
with one Triton kernel shaped like SGLang's prefill/extend kernel: a program
per ``(sequence, query head, block of BLOCK_M draft tokens)`` loads its query
tile once, then walks the sequence's *whole* cached prefix serially in tiles
of ``BLOCK_N`` keys (gathered from the token pool through ``kv_indices``),
then the draft keys themselves, keeping an online softmax (running max,
running denominator, rescaled accumulator) in registers.

It is the correctness baseline and the fallback of the package, not the fast
path. For verify it is slow by construction: a sequence has only a handful of
draft tokens, so the whole step launches ``bs * H_Q * ceil(L / BLOCK_M)``
programs (``bs * H_Q`` in practice, each using a few of its ``BLOCK_M`` query
rows), and every one of them streams a prefix of thousands of tokens alone.
At small batch that is far too few programs in flight to saturate HBM, and
the query heads of a GQA group each re-read their shared KV head. Splitting
the prefix across programs (split-KV) is what the rest of the package is for.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional

import torch
import triton
import triton.language as tl

from .checks import check_verify_inputs, interpreting
from .kernel import soft_cap

__all__ = ["extend_attention_fwd", "MAX_HEAD_DIM"]

#: Largest ``head_dim``/``v_head_dim`` the kernel takes: a whole head is one
#: register tile, padded to a power of two.
MAX_HEAD_DIM = 256


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, k, v, visible, qk_scale, v_scale, temperature, logit_cap,
    HAS_LOGIT_CAP: tl.constexpr, HAS_XAI_TEMP: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Fold one key tile into the online softmax of a query tile.

    ``q`` is ``[BLOCK_M, BLOCK_D]``, ``k`` ``[BLOCK_D, BLOCK_N]`` (already
    transposed), ``v`` ``[BLOCK_N, BLOCK_DV]``; ``visible`` ``[BLOCK_M,
    BLOCK_N]`` says which scores survive. ``m_i``/``l_i`` are the running max
    and denominator per row, ``acc`` the unnormalised output ``sum p * v``,
    all float32.
    """
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
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

    q_ptrs = Q + (q_start + offs_m)[:, None] * stride_q_tok + pid_h * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

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
        k = tl.load(
            K_buf + slots[None, :] * stride_kb_tok + kv_head * stride_kb_head + offs_d[:, None],
            mask=n_ok[None, :] & d_ok[:, None],
            other=0.0,
        ).to(q.dtype)
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
            acc, m_i, l_i, q, k, v, visible, prefix_scale, v_scale, temperature, logit_cap,
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
        k = tl.load(
            K_ext + (q_start + offs_n)[None, :] * stride_k_tok + kv_head * stride_k_head + offs_d[:, None],
            mask=n_ok[None, :] & d_ok[:, None],
            other=0.0,
        )
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
            acc, m_i, l_i, q, k, v, visible, sm_scale, 1.0, temperature, logit_cap,
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


def _scale_value(name: str, value) -> float:
    """A k/v scale as a Python float, without ever reading device memory."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise ValueError(
                f"{name} must be a Python float or a CPU tensor, got a tensor on "
                f"{value.device}: reading it would synchronise with the device"
            )
        if value.numel() != 1:
            raise ValueError(f"{name} must hold one value, got shape {tuple(value.shape)}")
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    return float(value)


def _launch_config(head_dim: int, v_head_dim: int) -> tuple:
    """``(BLOCK_M, BLOCK_N, num_warps)`` for a head size."""
    if interpreting():
        # Interpreter cost is per operation, not per element: small but not
        # tiny tiles keep the CPU tests quick.
        return 16, 32, 1
    if max(head_dim, v_head_dim) <= 128:
        return 64, 64, 4
    return 64, 32, 8


def extend_attention_fwd(
    q_extend: torch.Tensor,
    k_extend: torch.Tensor,
    v_extend: torch.Tensor,
    o_extend: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    custom_mask: Optional[torch.Tensor],
    is_causal: bool,
    mask_indptr: Optional[torch.Tensor],
    max_len_extend: int,
    k_scale=1.0,
    v_scale=1.0,
    sm_scale: Optional[float] = None,
    logit_cap: float = 0.0,
    skip_prefix_custom_mask: bool = True,
    sliding_window_size: int = -1,
    sinks: Optional[torch.Tensor] = None,
    window_kv_offsets: Optional[torch.Tensor] = None,
    xai_temperature_len: int = -1,
) -> None:
    """Verify (extend) attention of draft tokens over their prefix and each other.

    The baseline kernel: one program per (sequence, query head, block of
    draft tokens) walks the whole prefix. Semantics are those of SGLang's
    ``extend_attention_fwd`` as written out in :mod:`splitkv.testing.reference`.
    Writes ``o_extend`` in place; reads no tensor values on the host, so the
    call can be captured in a CUDA graph.

    Args:
        q_extend: draft queries ``[tokens, H_Q, D]``; float16, bfloat16 or
            float32; any token/head strides, unit stride in the last dim.
        k_extend: draft keys ``[tokens, H_KV, D]``, same dtype as ``q_extend``.
        v_extend: draft values ``[tokens, H_KV, Dv]``, same dtype.
        o_extend: output ``[tokens, H_Q, Dv]``, same dtype; may be a strided
            view, only its elements are written.
        k_buffer: the key token pool ``[pool, H_KV, D]``; the activation
            dtypes or float8 (upcast to ``q_extend``'s dtype in the kernel).
        v_buffer: the value token pool ``[pool, H_KV, Dv]``, ``k_buffer``'s dtype.
        qo_indptr: ``[bs + 1]`` offsets of each sequence's draft tokens.
        kv_indptr: ``[bs + 1]`` offsets of each sequence's prefix in ``kv_indices``.
        kv_indices: pool slots of the prefixes, int32 or int64.
        custom_mask: flat bool/uint8 visibility, per sequence ``b`` a row-major
            ``[L_b, prefix_b + L_b (+ offset_b)]`` block at ``mask_indptr[b]``;
            ``None`` for none.
        is_causal: without ``custom_mask``, draft token ``i`` sees drafts
            ``j <= i`` if true, every draft if false.
        mask_indptr: ``[bs + 1]`` offsets into ``custom_mask``.
        max_len_extend: the largest number of draft tokens of a sequence
            (sizes the grid; a smaller value leaves rows unwritten).
        k_scale: prefix-key dequantisation multiplier: a Python number or a
            CPU tensor.
        v_scale: prefix-value dequantisation multiplier, likewise.
        sm_scale: softmax scale, ``1 / sqrt(D)`` if ``None``.
        logit_cap: if ``> 0``, scores ``s`` become ``cap * tanh(s / cap)``.
        skip_prefix_custom_mask: if true, ``custom_mask`` masks only the
            draft keys and every prefix key is visible.
        sliding_window_size: if ``> 0``, the query at position ``p`` sees only
            keys at positions ``>= p - sliding_window_size``.
        sinks: ``[H_Q]`` attention-sink logits added to each head's softmax
            denominator, or ``None``.
        window_kv_offsets: ``[bs]`` int32/int64 column offsets into each
            sequence's ``custom_mask`` rows (rows grow by the offset, the first
            ``offset`` columns are skipped); ignored without ``custom_mask``.
        xai_temperature_len: if ``> 0``, scores of the query at position
            ``p > len`` are multiplied by ``log2(p) / log2(len)``.

    Returns:
        None; the result is in ``o_extend``. Rows whose every key is masked
        (and no sink) come out NaN, as in SGLang and the oracle.

    Raises:
        ValueError: on malformed inputs (shapes, dtypes, devices, strides; see
            :func:`splitkv.checks.check_verify_inputs`), on a k/v scale that is
            a device tensor, on a malformed ``window_kv_offsets``, or on
            ``xai_temperature_len == 1`` (its ``log2`` is 0).
        NotImplementedError: if ``head_dim`` or ``v_head_dim`` exceeds
            :data:`MAX_HEAD_DIM`, or for bfloat16 under the Triton interpreter
            (its bf16 ``tl.dot`` returns garbage, triton-lang/triton#11584).
    """
    dims = check_verify_inputs(
        q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer,
        qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, max_len_extend, sinks,
    )
    k_scale = _scale_value("k_scale", k_scale)
    v_scale = _scale_value("v_scale", v_scale)
    if max(dims.head_dim, dims.v_head_dim) > MAX_HEAD_DIM:
        raise NotImplementedError(
            f"head_dim {dims.head_dim} / v_head_dim {dims.v_head_dim}: the extend "
            f"kernel holds a whole head in one tile and supports up to {MAX_HEAD_DIM}"
        )
    if q_extend.device.type == "cpu" and torch.bfloat16 in (q_extend.dtype, k_buffer.dtype):
        raise NotImplementedError(
            "bfloat16 under the Triton interpreter: its bf16 tl.dot returns garbage "
            "(triton-lang/triton#11584); use float16/float32 on the CPU, bfloat16 on a GPU"
        )
    if xai_temperature_len == 1:
        raise ValueError("xai_temperature_len must be <= 0 (off) or >= 2: log2(1) is 0")
    use_offsets = custom_mask is not None and window_kv_offsets is not None
    if use_offsets:
        w = window_kv_offsets
        if (
            not isinstance(w, torch.Tensor)
            or w.dim() != 1
            or w.shape[0] != dims.batch_size
            or w.dtype not in (torch.int32, torch.int64)
            or w.device != q_extend.device
        ):
            raise ValueError(
                f"window_kv_offsets must be a 1-D int32/int64 tensor of {dims.batch_size} "
                f"entries on {q_extend.device}, got {w!r:.80}"
            )
    if max_len_extend == 0 or dims.num_tokens == 0:
        return
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(dims.head_dim)
    window = -1 if sliding_window_size is None else int(sliding_window_size)

    block_m, block_n, num_warps = _launch_config(dims.head_dim, dims.v_head_dim)
    grid = (dims.batch_size, dims.num_q_heads, triton.cdiv(max_len_extend, block_m))
    _extend_attention_kernel[grid](
        q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer,
        qo_indptr, kv_indptr, kv_indices,
        custom_mask, mask_indptr, window_kv_offsets if use_offsets else None, sinks,
        float(sm_scale), k_scale, v_scale, float(logit_cap), int(xai_temperature_len), window,
        q_extend.stride(0), q_extend.stride(1),
        k_extend.stride(0), k_extend.stride(1),
        v_extend.stride(0), v_extend.stride(1),
        o_extend.stride(0), o_extend.stride(1),
        k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        GROUP=dims.group,
        HEAD_DIM=dims.head_dim,
        V_HEAD_DIM=dims.v_head_dim,
        BLOCK_D=triton.next_power_of_2(dims.head_dim),
        BLOCK_DV=triton.next_power_of_2(dims.v_head_dim),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        USE_CUSTOM_MASK=custom_mask is not None,
        MASK_PREFIX=custom_mask is not None and not skip_prefix_custom_mask,
        CAUSAL_DRAFT=custom_mask is None and bool(is_causal),
        HAS_WINDOW=window > 0,
        HAS_KV_OFFSETS=use_offsets,
        HAS_LOGIT_CAP=logit_cap > 0,
        HAS_XAI_TEMP=xai_temperature_len > 0,
        HAS_SINKS=sinks is not None,
        DOT_PRECISION="ieee" if q_extend.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
    )
