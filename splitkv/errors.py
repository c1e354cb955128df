"""Faults the verify kernel finds on the device, raised on the host.

The kernel bounds every gather, so malformed metadata never reads a wild
address; what it bounded it can also *report*. A checked launch (``check=True``,
the default of :func:`splitkv.verify_attention`) validates the step's
metadata as it reads it (see "Checks" in :mod:`splitkv.kernels.verify`); every
launch, checked or not, reports merge counters that no launch could have left
and a merge that gave up waiting for its slices. A report is one int32,
``sequence * 16 + field`` (:data:`FIELDS`).

The fault log. Each device has one array of int32 words that the kernel
writes and the host reads without waiting: on a GPU it lives in pinned host
memory mapped into the device's address space (the kernel's stores go
straight to it); under the interpreter it is an ordinary CPU tensor. Every
launch gets a *slot* of its own, so reports of different launches never
overwrite each other, and the host knows which launch wrote each one: an
eager launch takes the next slot of a ring, a launch captured into a CUDA
graph keeps one slot for every replay. Word 0 is a flag that any report
raises, so a call reads one word to know whether there is anything to look
at.

The contract:

* **Nothing is lost.** A slot is cleared only by the host read that takes its
  report out (to raise it, or to keep it for the thread that launched it),
  and a launch's slot is never handed to another launch while it holds an
  unread report (the ring skips it).
* **Raised where it can be.** Under the interpreter the kernel has finished
  when the launch returns, so the call that launched it raises. On a GPU the
  kernel runs later: its fault is raised by the next call of the same thread
  on that device (every entry reads the flag before and after it launches,
  checked or not), or by :func:`check_device_errors`, which waits for the
  device and reads every slot.
* **Blamed on its own launch.** The message names the launch that wrote it:
  its thread, its number among that device's launches, and whether it was
  captured into a CUDA graph. A call raises the reports of its own thread's
  eager launches and of captured launches (a graph may be replayed from any
  thread); another thread's reports stay pending for that thread or for
  :func:`check_device_errors`, kept on the host: while they wait, the other
  threads' calls read the flag and a dictionary, no slot.
* **The portable path** (:func:`splitkv.launch.portable`: ROCm builds, ``SPLITKV_PORTABLE=1``)
  maps no host memory into the device: the log lives in device memory, and
  faults are raised by :func:`check_device_errors` only.
* **CUDA graphs.** A replay runs no host code, so a replayed launch's fault
  is raised by the next call on the device or by :func:`check_device_errors`:
  an engine that replays graphs calls it once per step, after the step's
  outputs are read (it waits for the device), or :func:`raise_pending_faults`
  (no wait) at the start of the next step.
"""

from __future__ import annotations

import itertools
import threading
from typing import Dict, List, Optional

import numpy as np
import torch

from .kernels.common import (ERR_COUNTERS, ERR_DRAFTS, ERR_KV_INDPTR, ERR_LAST_PAGE, ERR_MASK, ERR_MERGE_WAIT,
                             ERR_PREFIX_BOUND, ERR_QO_INDPTR, ERR_SLOT)
from .launch import portable
from .validate import device_index

__all__ = ["VerifyError", "check_device_errors", "raise_pending_faults", "fault_log", "FaultLog", "describe",
           "FIELDS", "EAGER_SLOTS", "CAPTURED_SLOTS"]

#: What each field of a report means.
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

#: Slots of the eager ring: launches whose reports may be pending at once (a launch's slot is
#: reused only after that many later launches, and never while it holds an unraised report).
EAGER_SLOTS = 4096
#: Slots for launches captured into CUDA graphs, one each for the graph's life; past them,
#: captured launches share the last one (still raised, named less precisely).
CAPTURED_SLOTS = 1 << 16


class VerifyError(ValueError):
    """Malformed verify metadata (or corrupted merge counters) found by the kernel."""


def describe(code: int) -> str:
    """The message for a report ``code`` (``sequence * 16 + field``)."""
    field = code % 16
    what = FIELDS.get(field, f"unknown fault {field}")
    return what if field in _NO_SEQUENCE else f"sequence {code // 16}: {what}"


def _launch_name(owner) -> str:
    """A slot's owner ``(number, thread, captured)`` in words."""
    if owner is None:
        return "an unknown launch"
    number, thread, captured = owner
    return f"launch #{number} ({'captured into a CUDA graph' if captured else 'eager'}, thread {thread})"


class FaultLog:
    """One device's fault log: the flag (word 0), the eager ring, then the captured launches' slots.

    ``mapped`` (default: every device but on the portable path, :func:`splitkv.launch.portable`):
    the words live in host memory the device writes through (pinned and mapped on a GPU), so the
    host reads them without waiting. Otherwise they live in device memory and are read only when
    the host copies them, which waits for the device: faults are then raised by
    :func:`check_device_errors` (and :func:`raise_pending_faults`), not by the next call.
    """

    def __init__(self, device: torch.device, mapped: Optional[bool] = None):
        self.device = device
        size = 1 + EAGER_SLOTS + CAPTURED_SLOTS
        self.mapped = (device.type != "cuda" or not portable()) if mapped is None else mapped
        if self.mapped:
            # Pinned host memory is mapped into the device's address space (unified addressing):
            # the kernel stores to it directly, the host reads it through a NumPy view without a copy.
            self.words = torch.zeros(size, dtype=torch.int32, pin_memory=device.type == "cuda")
            self._view = self.words.numpy()
        else:
            self.words = torch.zeros(size, dtype=torch.int32, device=device)
            self._view = None
        self._base = self.words.data_ptr()
        #: per slot, its launch: ``(number on the device, thread, captured)``
        self._owners: List[Optional[tuple]] = [None] * size
        self._numbers = itertools.count(1)  # next() is atomic under the GIL: no lock on the call path
        self._lock = threading.Lock()  # captured slots, and the read-and-clear of reports
        self._next_captured = 1 + EAGER_SLOTS
        #: reports read out of the log by another thread's scan, per thread that launched them
        self._queued: Dict[int, List[tuple]] = {}

    @property
    def address(self) -> int:
        """The log's device-visible address (word 0: the flag); the kernel gets it and its slot."""
        return self._base

    def take_slot(self, captured: bool) -> int:
        """A slot for one launch, recorded as this thread's (``captured``: for every replay of a graph)."""
        number = next(self._numbers)
        owner = (number, threading.get_ident(), captured)
        if captured:
            with self._lock:
                slot = min(self._next_captured, len(self._owners) - 1)
                self._next_captured += 1
        else:
            slot = 1 + number % EAGER_SLOTS
            view = self._view
            if view is not None and view[slot]:  # skip slots holding unread reports
                for _ in range(EAGER_SLOTS):
                    slot = 1 + next(self._numbers) % EAGER_SLOTS
                    if not view[slot]:
                        break
        self._owners[slot] = owner
        return slot

    def raise_pending(self, everyone: bool = False, scan: bool = False) -> None:
        """Raise :class:`VerifyError` for the reports this thread may raise (``everyone``: all), clearing them.

        Reads the flag only (and whether another thread's scan left reports for this one), unless the
        flag is set or ``scan`` (then every slot). A scan takes every report out of the log: those this
        thread may raise it raises, the others it keeps for the threads that launched them, so that one
        thread's pending report costs the other threads nothing. No waiting for the device, but in
        device memory (not ``mapped``), which only a ``scan`` reads, through a copy that waits.
        """
        view = self._view
        if not (scan or self._queued or (view is not None and view[0])):
            return
        me = threading.get_ident()
        with self._lock:
            if scan or (view is not None and view[0]):
                self._take_reports(me, everyone, scan)
            found = self._queued.pop(me, [])
            if everyone:
                found += [report for reports in self._queued.values() for report in reports]
                self._queued.clear()
        if found:
            lines = [f"{describe(code)} (from {_launch_name(owner)})" for _, owner, code in found]
            raise VerifyError(f"splitkv verify kernel on {self.device}: " + "; ".join(lines))

    def _take_reports(self, me: int, everyone: bool, scan: bool) -> None:
        """Read every slot's report out of the log (under the lock) into :attr:`_queued`, by the thread that
        may raise it (``me`` for this thread's, captured and unknown launches, or ``everyone``)."""
        view = self._view
        if view is None:
            view = self.words.cpu().numpy()
        elif self.mapped:
            view[0] = 0  # before the slots are read: a report landing meanwhile raises it again
        slots = np.flatnonzero(view[1:]) + 1
        for slot in slots:
            owner = self._owners[slot]
            mine = everyone or owner is None or owner[2] or owner[1] == me
            self._queued.setdefault(me if mine else owner[1], []).append((int(slot), owner, int(view[slot])))
        if self.mapped:
            view[slots] = 0
        else:
            if len(slots):
                self.words[torch.from_numpy(slots).to(self.device)] = 0
            self.words[0] = 0


_LOGS: Dict[int, FaultLog] = {}
_LOGS_LOCK = threading.Lock()


def fault_log(device) -> FaultLog:
    """The fault log of ``device`` (made on first use)."""
    device = torch.device(device)
    index = device_index(device)
    log = _LOGS.get(index)
    if log is None:
        with _LOGS_LOCK:
            log = _LOGS.get(index)
            if log is None:
                log = _LOGS[index] = FaultLog(device)
    return log


def raise_pending_faults(device=None) -> None:
    """Raise the faults the device's kernels have reported so far, every thread's, without waiting."""
    log = _LOGS.get(device_index(_device_or_current(device)))
    if log is not None:
        log.raise_pending(everyone=True, scan=True)


def check_device_errors(device=None) -> None:
    """Wait for ``device`` (default: the current CUDA device, else the CPU) and raise every pending fault.

    Raises:
        VerifyError: naming each fault's sequence, field and launch.
    """
    device = _device_or_current(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    raise_pending_faults(device)


def _device_or_current(device) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(device)
