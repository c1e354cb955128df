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

from .kernels.extend import _extend_attention_kernel
from .resources import next_pow2, rope_dim
from .launch import interpreting
from .validate import check_verify_inputs

__all__ = ["extend_attention_fwd", "MAX_HEAD_DIM", "MAX_LATENT_DIM"]


#: Largest ``head_dim``/``v_head_dim`` the kernel takes in one chunk: a whole head is one
#: register tile, padded to a power of two.
MAX_HEAD_DIM = 256
#: Largest value dim of a head taken in two chunks, ``v_head_dim + rope``
#: (:func:`splitkv.resources.rope_dim`): MLA's 576 = 512 + 64.
MAX_LATENT_DIM = 512


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


def _launch_config(head_dim: int, v_head_dim: int, elem_bytes: int) -> tuple:
    """``(BLOCK_M, BLOCK_N, num_warps)`` for a head size and the queries' bytes per element."""
    if interpreting():
        # Interpreter cost is per operation, not per element: small but not
        # tiny tiles keep the CPU tests quick.
        return 16, 32, 1
    if max(head_dim, v_head_dim) <= 128:
        return 64, 64, 4
    if max(head_dim, v_head_dim) <= MAX_HEAD_DIM:
        return 64, 32, 8
    # MLA (two chunks, 512 + rope): 16 draft rows a program (a verify step has a few), 64 keys, 8 warps.
    # H200, bf16, 4 drafts, at 16 heads 1 x 4k / 16 heads 8 x 16k / 128 heads 8 x 4k: 539 / 2203 / 4367 us,
    # against 1017 / 7175 / 14669 for 32 rows and 32 keys (the 256-wide heads' tile). In float32 a
    # 64-key tile of K and V (576 + 512 columns) would need 272 KB of shared memory: 32 keys.
    return 16, 64 if elem_bytes <= 2 else 32, 8


def _supported_head(head_dim: int, v_head_dim: int) -> bool:
    """One padded chunk of at most :data:`MAX_HEAD_DIM`, or two exact chunks (MLA) of at most
    :data:`MAX_LATENT_DIM` + rope."""
    if rope_dim(head_dim, v_head_dim):
        return v_head_dim <= MAX_LATENT_DIM
    return max(head_dim, v_head_dim) <= MAX_HEAD_DIM


def _check_extend_call(dims, device, q_dtype, kv_dtype, xai_temperature_len, window_kv_offsets) -> None:
    """What the extend kernel adds to the shared input checks: head size, dtype, features."""
    if not _supported_head(dims.head_dim, dims.v_head_dim):
        raise NotImplementedError(
            f"head_dim {dims.head_dim} / v_head_dim {dims.v_head_dim}: the extend kernel holds a whole "
            f"head in one tile of up to {MAX_HEAD_DIM}, or in two chunks of {MAX_LATENT_DIM} + a power of two (MLA)"
        )
    if device.type == "cpu" and torch.bfloat16 in (q_dtype, kv_dtype):
        raise NotImplementedError(
            "bfloat16 under the Triton interpreter: its bf16 tl.dot returns garbage "
            "(triton-lang/triton#11584); use float16/float32 on the CPU, bfloat16 on a GPU"
        )
    if xai_temperature_len == 1:
        raise ValueError("xai_temperature_len must be <= 0 (off) or >= 2: log2(1) is 0")
    if window_kv_offsets is not None:
        w = window_kv_offsets
        if (
            not isinstance(w, torch.Tensor)
            or w.dim() != 1
            or w.shape[0] != dims.batch_size
            or w.dtype not in (torch.int32, torch.int64)
            or w.device != device
        ):
            raise ValueError(
                f"window_kv_offsets must be a 1-D int32/int64 tensor of {dims.batch_size} "
                f"entries on {device}, got {w!r:.80}"
            )


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
        sm_scale: softmax scale, ``1 / sqrt(D)`` if ``None`` or 0 (as SGLang's kernel reads it).
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
            :func:`splitkv.validate.check_verify_inputs`), on a k/v scale that is
            a device tensor, on a malformed ``window_kv_offsets``, or on
            ``xai_temperature_len == 1`` (its ``log2`` is 0).
        NotImplementedError: if ``head_dim`` or ``v_head_dim`` exceeds
            :data:`MAX_HEAD_DIM` (a head of ``v_head_dim + rope``, as MLA's
            512 + 64, up to :data:`MAX_LATENT_DIM` + rope), or for bfloat16 under the Triton interpreter
            (its bf16 ``tl.dot`` returns garbage, triton-lang/triton#11584).
    """
    dims = check_verify_inputs(
        q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer,
        qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, max_len_extend, sinks,
    )
    k_scale = _scale_value("k_scale", k_scale)
    v_scale = _scale_value("v_scale", v_scale)
    _check_extend_call(dims, q_extend.device, q_extend.dtype, k_buffer.dtype, xai_temperature_len,
                       window_kv_offsets if custom_mask is not None else None)
    use_offsets = custom_mask is not None and window_kv_offsets is not None
    if max_len_extend == 0 or dims.num_tokens == 0:
        return
    if not sm_scale:  # None or 0: the default, as SGLang's kernel reads it
        sm_scale = 1.0 / math.sqrt(dims.head_dim)
    window = -1 if sliding_window_size is None else int(sliding_window_size)

    block_m, block_n, num_warps = _launch_config(dims.head_dim, dims.v_head_dim, q_extend.element_size())
    rope = rope_dim(dims.head_dim, dims.v_head_dim)
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
        BLOCK_D=dims.v_head_dim if rope else next_pow2(dims.head_dim),
        BLOCK_DV=next_pow2(dims.v_head_dim),
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
        ROPE_DIM=rope,
        num_warps=num_warps,
    )
