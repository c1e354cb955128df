"""The options of a verify call, written once.

Every entry (the drop-in :func:`splitkv.verify_splitkv_fwd`,
:func:`splitkv.verify_attention`, the custom op, the gate, plan/run and the
context-parallel entries) takes the same options, by the same names. They
are declared here, once:

* :class:`VerifyOptions` -- the call's Python scalars (an immutable record,
  hashable, so it is part of the plan caches' keys);
* :data:`METADATA` -- the optional metadata tensors, named as
  ``extend_attention_fwd`` names them (a step's tensors, bound to a plan);
* :func:`split_options` -- keyword arguments into those two.

The custom op's schema (:mod:`splitkv.ops`), the surface tests and the API
page are derived from these declarations.
"""

from __future__ import annotations

import math
import numbers
import typing
from typing import Dict, NamedTuple, Optional, Tuple, Union

from .launch import environ_reader

__all__ = ["VerifyOptions", "METADATA", "TENSORS", "split_options", "metadata_of", "batch_view", "option_names",
           "check_from_env", "CHECK_ENV", "CHECK_MODES"]

#: The tensors every entry takes first, positionally, in ``extend_attention_fwd``'s order
#: (``o_extend`` is the drop-in's output; :func:`splitkv.verify_attention` allocates one for ``None``).
TENSORS = ("q_extend", "k_extend", "v_extend", "o_extend", "k_buffer", "v_buffer",
           "qo_indptr", "kv_indptr", "kv_indices")

#: The optional metadata tensors (``None``: absent), as ``extend_attention_fwd`` names them:
#: the tree mask and where each sequence's rows start, attention-sink logits ``[H_Q]``,
#: the mask rows' column offsets ``[bs]``, and for paged pools the rows used in each
#: sequence's last page ``[bs]`` (:mod:`splitkv.paged`).
METADATA = ("custom_mask", "mask_indptr", "sinks", "window_kv_offsets", "kv_last_page_len")

#: Values of ``check``: no checks, the kernel's checks, those plus a synchronous value check.
CHECK_MODES = (False, True, "full")
#: The environment variable that sets the drop-in's default ``check``.
CHECK_ENV = "SPLITKV_CHECK"
_CHECK_WORDS = {"": False, "0": False, "false": False, "off": False, "no": False,
                "1": True, "true": True, "on": True, "yes": True, "full": "full"}


class VerifyOptions(NamedTuple):
    """The Python scalars of a verify call: an immutable record, read by name.

    A named tuple rather than a frozen dataclass because every eager call builds one: on the
    CPU here it is made and hashed in a fraction of a frozen dataclass's time. Entries build it as
    ``VerifyOptions(...).checked()`` (:meth:`checked`: the types that an equal value of another
    type would hide in a cache key, ``1 == True``); :meth:`problem` checks the rest, once per new key.

    Attributes:
        max_len_extend: most draft tokens of any sequence (in ``[1, 64]`` for the split path).
        is_causal: causal draft block when there is no ``custom_mask`` (a bool).
        k_scale: key-pool dequantisation multiplier (a Python number: a tensor would need a device read).
        v_scale: value-pool dequantisation multiplier (a Python number).
        sm_scale: softmax scale (``None`` or ``0``: the default ``1 / sqrt(head_dim)``, as
            ``extend_attention_fwd`` reads ``sm_scale or 1 / sqrt(head_dim)``).
        logit_cap: ``> 0``: scores become ``cap * tanh(s / cap)``.
        skip_prefix_custom_mask: ``custom_mask`` holds no prefix columns the kernel must read
            (the split path declines ``False`` with a mask).
        sliding_window_size: ``> 0``: the query at position ``p`` sees keys at ``>= p - W``;
            only those slices are read.
        xai_temperature_len: ``> 0``: scores of the query at position ``p > len`` are multiplied
            by ``log2(p) / log2(len)``.
        max_bs: the largest batch this shape will see (default: the call's).
        split_tokens: a fixed slice length in tokens (a multiple of 128): the batch-invariant
            mode, where a sequence's output is bitwise the same in any batch. Needs ``max_prefix_len``.
        max_prefix_len: with ``split_tokens``, the most prefix keys of any sequence (sizes the grid).
        check: ``True``: the kernel validates the metadata as it reads it; ``"full"``: that and a
            synchronous check that reads the device first (skipped during CUDA-graph capture);
            ``False``: neither (see :mod:`splitkv.errors` for how faults are raised).
        return_lse: also return the natural-log LSE per (token, query head).
    """

    max_len_extend: int
    is_causal: bool = True
    k_scale: float = 1.0
    v_scale: float = 1.0
    sm_scale: Optional[float] = None
    logit_cap: float = 0.0
    skip_prefix_custom_mask: bool = True
    sliding_window_size: int = -1
    xai_temperature_len: int = -1
    max_bs: Optional[int] = None
    split_tokens: Optional[int] = None
    max_prefix_len: Optional[int] = None
    check: Union[bool, str] = True
    return_lse: bool = False

    def checked(self) -> "VerifyOptions":
        """These options, once the types that an equal value of another type would hide in a cache key
        (``1 == True``) are checked: every entry builds its options as ``VerifyOptions(...).checked()``.

        Raises:
            TypeError: for an ``is_causal``, ``check`` or ``max_len_extend`` of the wrong type.
        """
        if type(self.is_causal) is not bool:
            raise TypeError(f"is_causal must be a bool, got {type(self.is_causal).__name__}")
        if not (self.check is True or self.check is False or self.check == "full"):
            raise TypeError(f"check must be one of {CHECK_MODES}, got {self.check!r}")
        n = self.max_len_extend
        if type(n) is not int and (isinstance(n, bool) or not isinstance(n, numbers.Integral)):
            raise TypeError(f"max_len_extend must be an int, got {type(n).__name__}")
        return self

    def scale_problem(self) -> Optional[str]:
        """Why the split path cannot take these scales (it needs Python numbers), or ``None``."""
        for name in ("k_scale", "v_scale"):
            if not _finite(getattr(self, name)):
                return f"{name} must be a finite Python number (a tensor would need a device read)"
        if self.sm_scale is not None and not _finite(self.sm_scale):
            return "sm_scale must be a finite Python number or None"
        return None

    def problem(self) -> Optional[str]:
        """Why these scalars are malformed (a ``ValueError``'s message), or ``None``."""
        if not _finite(self.logit_cap) or self.logit_cap < 0:
            return f"logit_cap must be a finite Python number >= 0 (0: off), got {self.logit_cap!r}"
        for name in ("sliding_window_size", "xai_temperature_len"):
            if not _is_int(getattr(self, name)):
                return f"{name} must be a Python int (<= 0: off), got {getattr(self, name)!r}"
        if self.xai_temperature_len == 1:
            return "xai_temperature_len must be <= 0 (off) or >= 2: log2(1) is 0"
        if self.max_len_extend < 0:
            return f"max_len_extend must be a non-negative Python int, got {self.max_len_extend!r}"
        if self.max_bs is not None and (not _is_int(self.max_bs) or self.max_bs < 1):
            return f"max_bs must be a positive int or None, got {self.max_bs!r}"
        return _batch_invariant_problem(self.split_tokens, self.max_prefix_len)

    @property
    def window(self) -> Optional[int]:
        """Keys a query may see before its own position (the sliding window), or ``None``."""
        w = self.sliding_window_size
        return int(w) if w is not None and w > 0 else None

    @property
    def xai_len(self) -> int:
        """The xai temperature's length, 0 when off."""
        x = self.xai_temperature_len
        return int(x) if x is not None and x > 0 else 0

    @property
    def cacheable(self) -> bool:
        """Whether a plan for these options may be cached (scales that are numbers, not tensors)."""
        return isinstance(self.k_scale, numbers.Real) and isinstance(self.v_scale, numbers.Real)


def _finite(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _batch_invariant_problem(split_tokens, max_prefix_len) -> Optional[str]:
    """``split_tokens`` (a positive multiple of 128, or ``None``) and its bound ``max_prefix_len``."""
    if split_tokens is None:
        if max_prefix_len is not None:
            return "max_prefix_len bounds the batch-invariant mode's slices: give it with split_tokens"
        return None
    if not _is_int(split_tokens) or split_tokens < 128 or split_tokens % 128:
        return f"split_tokens must be a positive multiple of 128 (whole key tiles), got {split_tokens!r}"
    if max_prefix_len is None:
        return ("split_tokens needs max_prefix_len, the most prefix keys of any sequence: "
                "it sizes the grid's slices and their scratch")
    if not _is_int(max_prefix_len) or max_prefix_len < 1:
        return f"max_prefix_len must be a positive int, got {max_prefix_len!r}"
    return None


#: The option names, in declaration order.
OPTION_NAMES: Tuple[str, ...] = VerifyOptions._fields


def option_names() -> Tuple[str, ...]:
    """Every keyword an entry takes after its tensors: :class:`VerifyOptions`' fields, then :data:`METADATA`."""
    return OPTION_NAMES + METADATA


def option_types() -> Dict[str, object]:
    """Each :class:`VerifyOptions` field's annotation, resolved (the custom op's schema is built from them)."""
    return typing.get_type_hints(VerifyOptions)


def split_options(options: Dict[str, object]) -> Tuple[VerifyOptions, Dict[str, object]]:
    """Keyword arguments into ``(VerifyOptions, {metadata name: tensor or None})``.

    Raises:
        TypeError: for a keyword that is neither an option nor a metadata tensor.
    """
    meta = {name: options.pop(name, None) for name in METADATA}
    return VerifyOptions(**options).checked(), meta


def metadata_of(tensors: Dict[str, object]) -> Dict[str, object]:
    """Keyword arguments naming metadata tensors into ``{metadata name: tensor or None}``.

    Raises:
        TypeError: for a keyword that is not in :data:`METADATA`.
    """
    unknown = sorted(set(tensors) - set(METADATA))
    if unknown:
        raise TypeError(f"the metadata tensors are {METADATA}, not {unknown}")
    return {name: tensors.get(name) for name in METADATA}


def batch_view(qo_indptr, kv_indptr, meta: Dict[str, object]) -> Tuple[object, Dict[str, object]]:
    """``kv_indptr`` and the metadata cut to the batch that ``qo_indptr`` describes.

    ``extend_attention_fwd`` takes its batch size from ``qo_indptr`` and reads only the first ``bs + 1``
    entries of the other indptrs and ``bs`` of the per-sequence tensors, so engines pass buffers allocated
    for their largest batch (SGLang's CUDA-graph ``window_kv_offsets`` is ``[max_bs]``). The cuts are views:
    no copy and no device read, and a captured graph keeps reading the engine's buffers. Anything that is
    not a longer 1-D tensor is returned as it is, for validation to judge.

    Returns:
        ``(kv_indptr, meta)``: the arguments themselves when nothing was longer than the batch.
    """
    mi, offsets, last = meta["mask_indptr"], meta["window_kv_offsets"], meta["kv_last_page_len"]
    # Nothing to cut, the common call, is written out flat (it runs on every eager call) with numel(), the
    # cheapest size to read: a tensor no longer than n entries has no first dimension longer than n.
    try:
        n = qo_indptr.numel()
        if (kv_indptr.numel() <= n and (mi is None or mi.numel() <= n)
                and (offsets is None or offsets.numel() < n) and (last is None or last.numel() < n)):
            return kv_indptr, meta
    except (AttributeError, TypeError):  # not tensors: for validation to name
        return kv_indptr, meta
    if qo_indptr.dim() != 1:
        return kv_indptr, meta
    cut = (_first(mi, n), _first(offsets, n - 1), _first(last, n - 1))
    return _first(kv_indptr, n), dict(meta, mask_indptr=cut[0], window_kv_offsets=cut[1], kv_last_page_len=cut[2])


def _first(t, n: int):
    """The first ``n`` entries of a longer 1-D tensor ``t``; anything else as it is."""
    shape = getattr(t, "shape", None)
    return t[:n] if shape is not None and len(shape) == 1 and shape[0] > n else t


#: Reads ``SPLITKV_CHECK`` as it is set when called (every eager drop-in call does).
_read_check_env = environ_reader(CHECK_ENV)


def check_from_env() -> Union[bool, str]:
    """The drop-in's default ``check``, from ``SPLITKV_CHECK``: ``0/false/off/no`` (or unset) off,
    ``1/true/on/yes`` on, ``full``; anything else raises ``ValueError``."""
    raw = _read_check_env()
    if raw is None:
        return False
    mode = _CHECK_WORDS.get(raw)
    if mode is None:
        mode = _CHECK_WORDS.get(raw.strip().lower())
    if mode is None:
        raise ValueError(f"{CHECK_ENV}={raw!r}: use one of 0/false/off/no, 1/true/on/yes, full")
    return mode
