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

__all__ = ["Dims", "check_verify_inputs", "check_verify_values", "interpreting", "ACT_DTYPES", "KV_DTYPES"]

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
    # Each tensor's attributes are read once: this runs on every eager call.
    names = ["q_extend", "k_extend", "v_extend", "k_buffer", "v_buffer", "qo_indptr", "kv_indptr", "kv_indices"]
    tensors = [q_extend, k_extend, v_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices]
    if o_extend is not None:
        names.append("o_extend")
        tensors.append(o_extend)
    if custom_mask is not None:
        if mask_indptr is None:
            _fail("custom_mask needs mask_indptr")
        names += ["custom_mask", "mask_indptr"]
        tensors += [custom_mask, mask_indptr]
    if sinks is not None:
        names.append("sinks")
        tensors.append(sinks)
    for name, t in zip(names, tensors):
        if not isinstance(t, torch.Tensor):
            _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    device = q_extend.device
    for name, t in zip(names, tensors):
        if t.device != device:
            _fail(f"{name} is on {t.device}, q_extend on {device}: all inputs must share a device")
    if device.type == "cpu" and not interpreting():
        _fail("CPU tensors run only through the Triton interpreter: set TRITON_INTERPRET=1")

    dense = list(zip(names[:5], tensors[:5]))
    if o_extend is not None:
        dense.append(("o_extend", o_extend))
    for name, t in dense:
        if t.dim() != 3:
            _fail(f"{name} must be 3-D [tokens, heads, head_dim], got shape {tuple(t.shape)}")
        if t.stride(2) != 1 and t.shape[2] > 1:
            _fail(f"{name} must have a unit stride in its last dimension, got {t.stride()}")
    index = list(zip(names[5:8], tensors[5:8]))
    if custom_mask is not None:
        index.append(("mask_indptr", mask_indptr))
    for name, t in index:
        if t.dim() != 1 or t.dtype not in INDEX_DTYPES:
            _fail(f"{name} must be a 1-D int32/int64 tensor, got {t.dtype} of shape {tuple(t.shape)}")

    act = q_extend.dtype
    if act not in ACT_DTYPES:
        _fail(f"q_extend dtype {act} is not supported (float16, bfloat16, float32)")
    for name, t in (("k_extend", k_extend), ("v_extend", v_extend), ("o_extend", o_extend)):
        if t is not None and t.dtype != act:
            _fail(f"{name} is {t.dtype} but q_extend is {act}")
    if k_buffer.dtype not in KV_DTYPES:
        _fail(f"k_buffer dtype {k_buffer.dtype} is not supported")
    if v_buffer.dtype != k_buffer.dtype:
        _fail(f"v_buffer is {v_buffer.dtype} but k_buffer is {k_buffer.dtype}")
    if custom_mask is not None and custom_mask.dtype not in (torch.bool, torch.uint8, torch.int8):
        _fail(f"custom_mask must be bool or uint8, got {custom_mask.dtype}")

    n_tok, h_q, d = q_extend.shape
    k_shape, v_shape = k_extend.shape, v_extend.shape
    h_kv, dv = k_shape[1], v_shape[2]
    if h_kv < 1 or h_q % h_kv:
        _fail(f"{h_q} query heads are not a multiple of {h_kv} KV heads")
    kb_shape, vb_shape = k_buffer.shape, v_buffer.shape
    for name, shape in (("v_extend", v_shape), ("k_buffer", kb_shape), ("v_buffer", vb_shape)):
        if shape[1] != h_kv:
            _fail(f"{name} has {shape[1]} heads, k_extend has {h_kv}")
    for name, shape in (("k_extend", k_shape), ("v_extend", v_shape)):
        if shape[0] != n_tok:
            _fail(f"{name} has {shape[0]} tokens, q_extend has {n_tok}")
    if k_shape[2] != d or kb_shape[2] != d:
        _fail(f"head_dim mismatch: q {d}, k_extend {k_shape[2]}, k_buffer {kb_shape[2]}")
    if vb_shape[2] != dv:
        _fail(f"v_head_dim mismatch: v_extend {dv}, v_buffer {vb_shape[2]}")
    if o_extend is not None and o_extend.shape != (n_tok, h_q, dv):
        _fail(f"o_extend must have shape {(n_tok, h_q, dv)}, got {tuple(o_extend.shape)}")
    n_seq = qo_indptr.shape[0]
    if kv_indptr.shape[0] != n_seq or n_seq < 2:
        _fail(
            f"qo_indptr ({n_seq}) and kv_indptr ({kv_indptr.shape[0]}) "
            "must both have batch_size + 1 >= 2 entries"
        )
    bs = n_seq - 1
    if custom_mask is not None and mask_indptr.shape[0] != n_seq:
        _fail(f"mask_indptr must have {n_seq} entries, got {mask_indptr.shape[0]}")
    if sinks is not None and sinks.shape != (h_q,):
        _fail(f"sinks must have shape ({h_q},), got {tuple(sinks.shape)}")
    if max_len_extend is not None:
        if (
            isinstance(max_len_extend, bool)
            or not isinstance(max_len_extend, numbers.Integral)
            or max_len_extend < 0
        ):
            _fail(f"max_len_extend must be a non-negative Python int, got {max_len_extend!r}")
    return Dims(bs, n_tok, h_q, h_kv, d, dv)


def _first_bad(bad: torch.Tensor) -> int:
    """Index of the first True in a 1-D bool tensor, or -1 (one device read)."""
    idx = torch.nonzero(bad)
    return int(idx[0, 0]) if idx.numel() else -1


def check_verify_values(
    qo_indptr,
    kv_indptr,
    kv_indices,
    pool_tokens: int,
    max_len_extend: int,
    custom_mask=None,
    mask_indptr=None,
    num_tokens: Optional[int] = None,
) -> None:
    """Validate the *values* of a verify call's metadata (the checked mode).

    Checks, per sequence ``b``: ``qo_indptr`` and ``kv_indptr`` start at 0 and
    never decrease; ``qo_indptr[-1] <= num_tokens`` and ``kv_indptr[-1] <=
    len(kv_indices)``; the draft count ``qo_indptr[b+1] - qo_indptr[b]`` is at
    most ``max_len_extend``; every slot ``kv_indices[kv_indptr[0]:kv_indptr[-1]]``
    is in ``[0, pool_tokens)``; with a ``custom_mask``, each sequence's mask
    (``n_draft x (n_prefix + n_draft)`` entries from ``mask_indptr[b]``) lies
    inside it.

    It reads device values (a few small reductions and one copy to the host),
    so it cannot run inside CUDA-graph capture: the production entries skip
    it while the current stream is capturing.

    Raises:
        ValueError: naming the first bad sequence and field.
    """
    qo = qo_indptr.to(torch.int64)
    kv = kv_indptr.to(torch.int64)
    for name, ptr in (("qo_indptr", qo), ("kv_indptr", kv)):
        if int(ptr[0]) != 0:
            raise ValueError(f"{name}[0] is {int(ptr[0])}, must be 0")
        b = _first_bad(ptr[1:] < ptr[:-1])
        if b >= 0:
            raise ValueError(f"sequence {b}: {name} decreases ({int(ptr[b])} -> {int(ptr[b + 1])})")
    if num_tokens is not None and int(qo[-1]) > num_tokens:
        raise ValueError(f"qo_indptr[-1] = {int(qo[-1])} exceeds the {num_tokens} draft rows")
    if int(kv[-1]) > kv_indices.shape[0]:
        raise ValueError(f"kv_indptr[-1] = {int(kv[-1])} exceeds the {kv_indices.shape[0]} kv_indices")
    n_draft = qo[1:] - qo[:-1]
    b = _first_bad(n_draft > max_len_extend)
    if b >= 0:
        raise ValueError(f"sequence {b}: {int(n_draft[b])} draft tokens exceed max_len_extend={max_len_extend}")
    used = kv_indices[: int(kv[-1])].to(torch.int64)
    bad = (used < 0) | (used >= pool_tokens)
    pos = _first_bad(bad)
    if pos >= 0:
        seq = int(torch.searchsorted(kv[1:], torch.tensor(pos, device=kv.device), right=True))
        raise ValueError(
            f"sequence {seq}: kv_indices[{pos}] = {int(used[pos])} is outside the pool [0, {pool_tokens})"
        )
    if custom_mask is not None:
        mp = mask_indptr.to(torch.int64)
        n_prefix = kv[1:] - kv[:-1]
        end = mp[:-1] + n_draft * (n_prefix + n_draft)
        b = _first_bad((mp[:-1] < 0) | (end > custom_mask.numel()))
        if b >= 0:
            raise ValueError(
                f"sequence {b}: mask_indptr[{b}] = {int(mp[b])} puts its "
                f"{int(n_draft[b])} x {int(n_prefix[b] + n_draft[b])} mask outside custom_mask "
                f"({custom_mask.numel()} entries)"
            )
