"""The verify kernel's error word: faults found on the device, raised on the host.

A checked launch (``check=True``, the default of :func:`splitkv.verify_attention`)
validates the step's metadata inside the kernel, which bounds every gather
anyway, and stores a fault it meets (one of them, if several) in one int32 word per device
(see "Checks" in :mod:`splitkv.kernels.verify`). On a GPU that word lives in pinned
host memory that the kernel writes through: the host reads it with a plain
load, no synchronisation, no copy. A fault is therefore raised at the next
checked call on that device, or at once by :func:`check_device_errors`, which
waits for the device first. Under the Triton interpreter the kernel has run
by the time the launch returns, so the call that met the fault raises.

Counter faults (a caller's workspace holding garbage, or one workspace on two
streams at once) are recorded whether or not the launch was checked.
"""

from __future__ import annotations

import threading
from typing import Dict, Optional, Tuple

import torch

from .validate import device_index
from .kernels.common import (ERR_COUNTERS, ERR_DRAFTS, ERR_KV_INDPTR, ERR_LAST_PAGE, ERR_MASK, ERR_MERGE_WAIT,
                     ERR_PREFIX_BOUND, ERR_QO_INDPTR, ERR_SLOT)

__all__ = ["VerifyError", "check_device_errors", "error_word", "raise_pending", "describe", "FIELDS"]

#: What each field of the error word means.
FIELDS = {
    ERR_QO_INDPTR.value: "qo_indptr decreases or points outside the draft rows of q_extend",
    ERR_DRAFTS.value: "more draft tokens than max_len_extend",
    ERR_KV_INDPTR.value: "kv_indptr decreases or points outside kv_indices",
    ERR_SLOT.value: "kv_indices holds a slot (or page id) outside the pool",
    ERR_LAST_PAGE.value: "kv_last_page_len is outside [1, page_size] (0 for a sequence with no pages)",
    ERR_MASK.value: "its custom_mask rows (from mask_indptr) run outside custom_mask",
    ERR_PREFIX_BOUND.value: "its prefix is longer than max_prefix_len (the batch-invariant mode's bound)",
    ERR_COUNTERS.value: "the merge counters held values no launch leaves (a workspace that was not zeroed, "
                        "or one workspace used on two streams at once)",
    ERR_MERGE_WAIT.value: "a merge program gave up waiting for its slices (corrupted merge counters)",
}
_NO_SEQUENCE = (ERR_COUNTERS.value, ERR_MERGE_WAIT.value)


class VerifyError(ValueError):
    """Malformed verify metadata (or corrupted merge counters) found by the kernel."""


#: device index (-1: CPU) -> (the word as a tensor, a NumPy view of it for the host's reads)
_WORDS: Dict[int, Tuple[torch.Tensor, object]] = {}
_LOCK = threading.Lock()


def error_word(device) -> torch.Tensor:
    """The error word of ``device`` (one int32, zero while no fault is pending), made on first use."""
    device = torch.device(device)
    index = device_index(device)
    entry = _WORDS.get(index)
    if entry is None:
        with _LOCK:
            entry = _WORDS.get(index)
            if entry is None:
                # Pinned host memory is mapped into the device's address space (unified addressing):
                # the kernel stores to it directly, the host reads it without a copy.
                word = torch.zeros(1, dtype=torch.int32, pin_memory=device.type == "cuda")
                entry = _WORDS[index] = (word, word.numpy())
    return entry[0]


def describe(code: int) -> str:
    """The message for an error word's value ``code`` (``sequence * 16 + field``)."""
    field = code % 16
    what = FIELDS.get(field, f"unknown fault {field}")
    return what if field in _NO_SEQUENCE else f"sequence {code // 16}: {what}"


def raise_pending(device: torch.device, index: Optional[int] = None) -> None:
    """Raise :class:`VerifyError` if ``device``'s error word holds a fault (and clear it); no waiting."""
    entry = _WORDS.get(device_index(device) if index is None else index)
    if entry is None:
        return
    view = entry[1]
    code = int(view[0])
    if code:
        view[0] = 0
        raise VerifyError(f"splitkv verify kernel on {device}: {describe(code)} "
                          "(found by this call's kernel or an earlier one)")


def check_device_errors(device=None) -> None:
    """Wait for ``device`` (default: the current CUDA device, else the CPU) and raise any pending fault.

    Raises:
        VerifyError: naming the sequence and field of a fault a checked launch found.
    """
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    raise_pending(device)
