"""Input validation shared by the production entries.

:func:`check_verify_inputs` raises a ``ValueError`` naming the first problem it
finds. It reads shapes, strides, dtypes and devices only, never tensor values,
so it is safe inside CUDA-graph capture.
"""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["Dims", "check_verify_inputs", "interpreting", "ACT_DTYPES", "KV_DTYPES"]

#: dtypes of queries, draft K/V and outputs.
ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: dtypes of the KV pool (fp8 pools are dequantised with ``k_scale``/``v_scale``).
KV_DTYPES = ACT_DTYPES + tuple(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)
)
INDEX_DTYPES = (torch.int32, torch.int64)


def interpreting() -> bool:
    """True when Triton kernels run through the interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True)
class Dims:
    """Static sizes of a verify call."""

    batch_size: int
    num_tokens: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads


def _fail(msg: str):
    raise ValueError(msg)


def check_verify_inputs(
    q_extend,
    k_extend,
    v_extend,
    o_extend,
    k_buffer,
    v_buffer,
    qo_indptr,
    kv_indptr,
    kv_indices,
    custom_mask=None,
    mask_indptr=None,
    max_len_extend=None,
    sinks: Optional[torch.Tensor] = None,
) -> Dims:
    """Validate a verify/extend call; return its :class:`Dims`.

    ``o_extend`` may be ``None`` (the gate checks inputs before an output exists).

    Raises ``ValueError`` on mismatched devices, dtypes, ranks, head counts or
    head dims, on a non-unit last-dimension stride, or on CPU tensors outside
    the Triton interpreter.
    """
    named = {
        "q_extend": q_extend, "k_extend": k_extend, "v_extend": v_extend,
        "k_buffer": k_buffer, "v_buffer": v_buffer,
        "qo_indptr": qo_indptr, "kv_indptr": kv_indptr, "kv_indices": kv_indices,
    }
    if o_extend is not None:
        named["o_extend"] = o_extend
    if custom_mask is not None:
        named["custom_mask"] = custom_mask
        if mask_indptr is None:
            _fail("custom_mask needs mask_indptr")
        named["mask_indptr"] = mask_indptr
    if sinks is not None:
        named["sinks"] = sinks
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    device = q_extend.device
    for name, t in named.items():
        if t.device != device:
            _fail(f"{name} is on {t.device}, q_extend on {device}: all inputs must share a device")
    if device.type == "cpu" and not interpreting():
        _fail("CPU tensors run only through the Triton interpreter: set TRITON_INTERPRET=1")

    for name in ("q_extend", "k_extend", "v_extend", "o_extend", "k_buffer", "v_buffer"):
        t = named.get(name)
        if t is None:
            continue
        if t.dim() != 3:
            _fail(f"{name} must be 3-D [tokens, heads, head_dim], got shape {tuple(t.shape)}")
        if t.stride(2) != 1 and t.shape[2] > 1:
            _fail(f"{name} must have a unit stride in its last dimension, got {t.stride()}")
    for name in ("qo_indptr", "kv_indptr", "kv_indices", "mask_indptr"):
        t = named.get(name)
        if t is not None and (t.dim() != 1 or t.dtype not in INDEX_DTYPES):
            _fail(f"{name} must be a 1-D int32/int64 tensor, got {t.dtype} of shape {tuple(t.shape)}")

    act = q_extend.dtype
    if act not in ACT_DTYPES:
        _fail(f"q_extend dtype {act} is not supported (float16, bfloat16, float32)")
    for name in ("k_extend", "v_extend", "o_extend"):
        if name in named and named[name].dtype != act:
            _fail(f"{name} is {named[name].dtype} but q_extend is {act}")
    if k_buffer.dtype not in KV_DTYPES:
        _fail(f"k_buffer dtype {k_buffer.dtype} is not supported")
    if v_buffer.dtype != k_buffer.dtype:
        _fail(f"v_buffer is {v_buffer.dtype} but k_buffer is {k_buffer.dtype}")
    if custom_mask is not None and custom_mask.dtype not in (torch.bool, torch.uint8, torch.int8):
        _fail(f"custom_mask must be bool or uint8, got {custom_mask.dtype}")

    n_tok, h_q, d = q_extend.shape
    h_kv, dv = k_extend.shape[1], v_extend.shape[2]
    if h_kv < 1 or h_q % h_kv:
        _fail(f"{h_q} query heads are not a multiple of {h_kv} KV heads")
    for name in ("v_extend", "k_buffer", "v_buffer"):
        if named[name].shape[1] != h_kv:
            _fail(f"{name} has {named[name].shape[1]} heads, k_extend has {h_kv}")
    for name in ("k_extend", "v_extend"):
        if named[name].shape[0] != n_tok:
            _fail(f"{name} has {named[name].shape[0]} tokens, q_extend has {n_tok}")
    if k_extend.shape[2] != d or k_buffer.shape[2] != d:
        _fail(f"head_dim mismatch: q {d}, k_extend {k_extend.shape[2]}, k_buffer {k_buffer.shape[2]}")
    if v_buffer.shape[2] != dv:
        _fail(f"v_head_dim mismatch: v_extend {dv}, v_buffer {v_buffer.shape[2]}")
    if o_extend is not None and tuple(o_extend.shape) != (n_tok, h_q, dv):
        _fail(f"o_extend must have shape {(n_tok, h_q, dv)}, got {tuple(o_extend.shape)}")
    if qo_indptr.shape[0] != kv_indptr.shape[0] or qo_indptr.shape[0] < 2:
        _fail(
            f"qo_indptr ({qo_indptr.shape[0]}) and kv_indptr ({kv_indptr.shape[0]}) "
            "must both have batch_size + 1 >= 2 entries"
        )
    bs = qo_indptr.shape[0] - 1
    if mask_indptr is not None and custom_mask is not None and mask_indptr.shape[0] != bs + 1:
        _fail(f"mask_indptr must have {bs + 1} entries, got {mask_indptr.shape[0]}")
    if sinks is not None and tuple(sinks.shape) != (h_q,):
        _fail(f"sinks must have shape ({h_q},), got {tuple(sinks.shape)}")
    if max_len_extend is not None:
        if (
            isinstance(max_len_extend, bool)
            or not isinstance(max_len_extend, numbers.Integral)
            or max_len_extend < 0
        ):
            _fail(f"max_len_extend must be a non-negative Python int, got {max_len_extend!r}")
    return Dims(bs, n_tok, h_q, h_kv, d, dv)
