"""Input validation shared by the production entries.

:func:`check_verify_inputs` raises a ``ValueError`` naming the first problem it
finds. It reads shapes, strides, dtypes and devices only, never tensor values,
so it is safe inside CUDA-graph capture.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Optional

import torch

from .launch import interpreting
from .options import _batch_invariant_problem
from .paged import paged_prefix_lens

__all__ = ["Dims", "check_call", "check_values", "check_verify_inputs", "check_verify_values", "check_output",
           "check_batch_invariant", "device_index",
           "ACT_DTYPES", "KV_DTYPES"]

#: dtypes of queries, draft K/V and outputs.
ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: dtypes of the KV pool (fp8 pools are dequantised with ``k_scale``/``v_scale``).
KV_DTYPES = ACT_DTYPES + tuple(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)
)
INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class Dims:
    """Static sizes of a verify call."""

    batch_size: int
    num_tokens: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    #: keys per ``kv_indices`` entry: 1 for a token pool, else the page size
    page_size: int = 1

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
    kv_last_page_len: Optional[torch.Tensor] = None,
) -> Dims:
    """Validate a verify/extend call; return its :class:`Dims`.

    ``o_extend`` may be ``None`` (the gate checks inputs before an output exists).
    With ``kv_last_page_len`` the pools are paged: ``k_buffer``/``v_buffer``
    are ``[pages, page_size, H_KV, D]`` and ``kv_indices`` holds page ids.

    Raises ``ValueError`` on mismatched devices, dtypes, ranks, head counts or
    head dims, on a non-unit last-dimension stride, or on CPU tensors outside
    the Triton interpreter.
    """
    # Each tensor's attributes are read once: this runs on every eager call.
    names, tensors = _named_tensors(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr,
                                    kv_indptr, kv_indices, custom_mask, mask_indptr, sinks, kv_last_page_len)
    page_size = 1
    if kv_last_page_len is not None:
        page_size = _check_pages(k_buffer, v_buffer, kv_last_page_len, qo_indptr.shape[0] - 1)
        # Heads and head dims are checked below on [pages, heads, dims].
        k_buffer, v_buffer = k_buffer[:, 0], v_buffer[:, 0]
    _check_ranks(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer,
                 list(zip(names[5:8], tensors[5:8])) + ([("mask_indptr", mask_indptr)] if custom_mask is not None else []))
    _check_dtypes(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, custom_mask)
    dims = _check_shapes(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr,
                         mask_indptr if custom_mask is not None else None, sinks, page_size)
    if max_len_extend is not None and (isinstance(max_len_extend, bool) or not isinstance(
            max_len_extend, numbers.Integral) or max_len_extend < 0):
        _fail(f"max_len_extend must be a non-negative Python int, got {max_len_extend!r}")
    return dims


def _named_tensors(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
                   custom_mask, mask_indptr, sinks, kv_last_page_len):
    """The call's tensors with their names, checked to be tensors on one device the kernels can run on."""
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
    if kv_last_page_len is not None:
        names.append("kv_last_page_len")
        tensors.append(kv_last_page_len)
    for name, t in zip(names, tensors):
        if not isinstance(t, torch.Tensor):
            _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    device = q_extend.device
    for name, t in zip(names, tensors):
        if t.device != device:
            _fail(f"{name} is on {t.device}, q_extend on {device}: all inputs must share a device")
    if device.type == "cpu" and not interpreting():
        _fail("CPU tensors run only through the Triton interpreter: set TRITON_INTERPRET=1")
    return names, tensors


def _check_pages(k_buffer, v_buffer, kv_last_page_len, batch_size: int) -> int:
    """Check paged pools ``[pages, page_size, H_KV, D]`` and the last-page lengths; return the page size."""
    for name, t in (("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        if t.dim() != 4:
            _fail(f"{name} must be 4-D [pages, page_size, heads, head_dim] with kv_last_page_len, "
                  f"got shape {tuple(t.shape)}")
        if t.stride(3) != 1 and t.shape[3] > 1:
            _fail(f"{name} must have a unit stride in its last dimension, got {t.stride()}")
    page_size = k_buffer.shape[1]
    if v_buffer.shape[1] != page_size or page_size < 1:
        _fail(f"k_buffer and v_buffer pages must hold the same positive number of tokens, "
              f"got {k_buffer.shape[1]} and {v_buffer.shape[1]}")
    if kv_last_page_len.dim() != 1 or kv_last_page_len.dtype not in INDEX_DTYPES:
        _fail(f"kv_last_page_len must be a 1-D int32/int64 tensor, got {kv_last_page_len.dtype} "
              f"of shape {tuple(kv_last_page_len.shape)}")
    if kv_last_page_len.shape[0] != batch_size:
        _fail(f"kv_last_page_len must have batch_size = {batch_size} entries, got {kv_last_page_len.shape[0]}")
    return page_size


def _check_ranks(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, index) -> None:
    """3-D token tensors with unit last strides; 1-D integer index tensors (``index``: (name, tensor) pairs)."""
    dense = [("q_extend", q_extend), ("k_extend", k_extend), ("v_extend", v_extend),
             ("k_buffer", k_buffer), ("v_buffer", v_buffer)]
    if o_extend is not None:
        dense.append(("o_extend", o_extend))
    for name, t in dense:
        if t.dim() != 3:
            hint = " (a paged pool needs kv_last_page_len)" if t.dim() == 4 and name.endswith("buffer") else ""
            _fail(f"{name} must be 3-D [tokens, heads, head_dim], got shape {tuple(t.shape)}{hint}")
        if t.stride(2) != 1 and t.shape[2] > 1:
            _fail(f"{name} must have a unit stride in its last dimension, got {t.stride()}")
    for name, t in index:
        if t.dim() != 1 or t.dtype not in INDEX_DTYPES:
            _fail(f"{name} must be a 1-D int32/int64 tensor, got {t.dtype} of shape {tuple(t.shape)}")


def _check_dtypes(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, custom_mask) -> None:
    """One activation dtype for q, k, v and the output; a supported pool dtype shared by both pools."""
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


def _check_shapes(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr,
                  mask_indptr, sinks, page_size: int) -> Dims:
    """Heads, head dims, token counts and batch sizes that agree across the tensors; the call's :class:`Dims`."""
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
        _fail(f"qo_indptr ({n_seq}) and kv_indptr ({kv_indptr.shape[0]}) must both have batch_size + 1 >= 2 entries")
    if mask_indptr is not None and mask_indptr.shape[0] != n_seq:
        _fail(f"mask_indptr must have {n_seq} entries, got {mask_indptr.shape[0]}")
    if sinks is not None and sinks.shape != (h_q,):
        _fail(f"sinks must have shape ({h_q},), got {tuple(sinks.shape)}")
    return Dims(n_seq - 1, n_tok, h_q, h_kv, d, dv, page_size)


def _check_offsets(dims: Dims, window_kv_offsets, device) -> None:
    """``window_kv_offsets``: ``None`` or a 1-D int32/int64 ``[bs]`` tensor on the inputs' device."""
    w = window_kv_offsets
    if w is None:
        return
    if (not isinstance(w, torch.Tensor) or w.dim() != 1 or w.dtype not in INDEX_DTYPES
            or w.shape[0] != dims.batch_size or w.device != device):
        _fail(f"window_kv_offsets must be a 1-D int32/int64 tensor of {dims.batch_size} entries "
              f"on the inputs' device, got {getattr(w, 'dtype', type(w).__name__)} "
              f"of shape {tuple(getattr(w, 'shape', ()))}")


def check_call(tensors: tuple, meta: dict, opts) -> Dims:
    """Validate a call's tensors (:data:`splitkv.options.TENSORS`; ``o_extend`` may be ``None``), its
    metadata tensors by name and its :class:`splitkv.options.VerifyOptions`; return its :class:`Dims`.

    Shapes, dtypes, devices and Python scalars only (CUDA-graph safe).

    Raises:
        ValueError: naming the first problem found.
    """
    problem = opts.scale_problem() or opts.problem()
    if problem is not None:
        _fail(problem)
    q = tensors[0]
    dims = check_verify_inputs(*tensors, meta["custom_mask"], meta["mask_indptr"], opts.max_len_extend,
                               meta["sinks"], kv_last_page_len=meta["kv_last_page_len"])
    _check_offsets(dims, meta["window_kv_offsets"], q.device)
    return dims


def check_values(tensors: tuple, meta: dict, opts) -> None:
    """:func:`check_verify_values` for a call (``check="full"``): reads the device."""
    q, kb = tensors[0], tensors[4]
    last = meta["kv_last_page_len"]
    check_verify_values(tensors[6], tensors[7], tensors[8], kb.shape[0], opts.max_len_extend,
                        meta["custom_mask"], meta["mask_indptr"], num_tokens=q.shape[0], kv_last_page_len=last,
                        page_size=kb.shape[1] if last is not None else 1)


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
    kv_last_page_len=None,
    page_size: int = 1,
) -> None:
    """Validate the *values* of a verify call's metadata (the checked mode).

    Checks, per sequence ``b``: ``qo_indptr`` and ``kv_indptr`` start at 0 or
    later (a sub-batch's view) and never decrease; ``qo_indptr[-1] <= num_tokens`` and ``kv_indptr[-1] <=
    len(kv_indices)``; the draft count ``qo_indptr[b+1] - qo_indptr[b]`` is at
    most ``max_len_extend``; every slot ``kv_indices[kv_indptr[0]:kv_indptr[-1]]``
    is in ``[0, pool_tokens)``; with a ``custom_mask``, each sequence's mask
    (``n_draft x (n_prefix + n_draft)`` entries from ``mask_indptr[b]``) lies
    inside it. Paged pools (``kv_last_page_len`` given): ``kv_indices`` are
    page ids in ``[0, pool_tokens)`` (the pool's pages), and each sequence's
    last page holds ``1 .. page_size`` rows (0 when it has no page).

    It reads device values (a few small reductions and one copy to the host),
    so it cannot run inside CUDA-graph capture: the production entries skip
    it while the current stream is capturing.

    Raises:
        ValueError: naming the first bad sequence and field.
    """
    qo = qo_indptr.to(torch.int64)
    kv = kv_indptr.to(torch.int64)
    for name, ptr in (("qo_indptr", qo), ("kv_indptr", kv)):
        if int(ptr[0]) < 0:  # a sub-batch's view may start anywhere inside its tensors
            raise ValueError(f"{name}[0] is {int(ptr[0])}, must be >= 0")
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
    bad[: int(kv[0])] = False  # before the first sequence: not part of this call
    pos = _first_bad(bad)
    if pos >= 0:
        seq = int(torch.searchsorted(kv[1:], torch.tensor(pos, device=kv.device), right=True))
        raise ValueError(
            f"sequence {seq}: kv_indices[{pos}] = {int(used[pos])} is outside the pool [0, {pool_tokens})"
        )
    n_prefix = kv[1:] - kv[:-1]
    if kv_last_page_len is not None:
        last = kv_last_page_len.to(torch.int64)
        lo = (n_prefix > 0).to(torch.int64)  # a sequence with pages uses at least one row of its last
        hi = torch.where(n_prefix > 0, page_size, 0)
        b = _first_bad((last < lo) | (last > hi))
        if b >= 0:
            raise ValueError(f"sequence {b}: kv_last_page_len = {int(last[b])} is outside "
                             f"[{int(lo[b])}, {int(hi[b])}] for its {int(n_prefix[b])} pages")
        n_prefix = paged_prefix_lens(kv, last, page_size)
    if custom_mask is not None:
        mp = mask_indptr.to(torch.int64)
        end = mp[:-1] + n_draft * (n_prefix + n_draft)
        b = _first_bad((mp[:-1] < 0) | (end > custom_mask.numel()))
        if b >= 0:
            raise ValueError(
                f"sequence {b}: mask_indptr[{b}] = {int(mp[b])} puts its "
                f"{int(n_draft[b])} x {int(n_prefix[b] + n_draft[b])} mask outside custom_mask "
                f"({custom_mask.numel()} entries)"
            )


def check_output(out, lse, out_shape, wants_lse: bool) -> None:
    """Validate a run's ``out`` (``out_shape``, unit last stride, an activation dtype) and ``lse``
    (``out_shape[:2]`` contiguous float32, given exactly when ``wants_lse``). Host attributes only.

    The device is the caller's to check (with the layer's tensors).
    """
    if not isinstance(out, torch.Tensor):
        _fail(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.shape != out_shape or out.dtype not in ACT_DTYPES or (out.stride(2) != 1 and out_shape[2] > 1):
        _fail(f"out must be {list(out_shape)} float16/bfloat16/float32 with a unit last stride, got "
              f"{list(out.shape)} {out.dtype} with strides {out.stride()}")
    if lse is None:
        if wants_lse:
            _fail("this plan writes the LSE (return_lse=True): pass lse, a [tokens, H_Q] float32 tensor")
        return
    if not wants_lse:
        _fail("lse given to a plan made without return_lse")
    if not isinstance(lse, torch.Tensor):
        _fail(f"lse must be a torch.Tensor, got {type(lse).__name__}")
    if (lse.shape != out_shape[:2] or lse.dtype != torch.float32 or lse.device != out.device
            or lse.stride() != (out_shape[1], 1)):
        _fail(f"lse must be a contiguous {list(out_shape[:2])} float32 tensor on {out.device}, got "
              f"{list(lse.shape)} {lse.dtype} on {lse.device} with strides {lse.stride()}")


def device_index(device: torch.device) -> int:
    """The CUDA device index of ``device`` (its current device when it has none), ``-1`` off CUDA."""
    if device.type != "cuda":
        return -1
    return device.index if device.index is not None else torch.cuda.current_device()


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_batch_invariant(split_tokens, max_prefix_len) -> None:
    """``split_tokens`` (a positive multiple of 128, or ``None``) and its bound ``max_prefix_len``.

    Raises ``ValueError`` for a bad value, or for one given without the other.
    """
    problem = _batch_invariant_problem(split_tokens, max_prefix_len)
    if problem is not None:
        _fail(problem)
