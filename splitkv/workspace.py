"""Scratch for the verify launch: tile counters and partials.

A call whose prefixes are cut into several slices needs scratch for the
slices' partial outputs and LSEs (sized as float32; a bf16 call stores its
partial outputs in bf16, see :mod:`splitkv.kernels.verify`), and (when it merges in the same launch)
int32 counters: one per tile, which tells the tile's last program that it is
last, or its merge programs that the slices are published, and two more for
the merge programs' tickets and exit count (:func:`splitkv.schedule.merge_mode`).

* Partials come from PyTorch's caching allocator on every run (on a GPU as a
  raw block of the run's stream, freed once the launches are queued:
  :func:`new_partials`). Under CUDA-graph capture that memory belongs to the
  graph's private pool and keeps its address for every replay.
* Counters must start at zero and are kept between calls (:func:`counters`):
  eager launches on a stream share a slice of a per-device arena, each
  launch captured into a graph gets a slice of its own, and every launch
  leaves its counters zeroed.
* A caller-owned workspace (:class:`Workspace`) carves both from bytes the
  caller allocated up front; its counters are zeroed when it is bound.
"""

from __future__ import annotations

import threading
from typing import Dict, Optional, Tuple

import torch

from .launch import alloc_raw, capturing, current_stream
from .resources import next_pow2
from .schedule import GRID_COUNTERS, counter_bytes
from .validate import device_index

__all__ = ["counters", "new_partials", "Workspace", "stream_key", "stream_key_of"]


#: Counters per (device, stream): ``{(device index, raw stream handle): int32 tensor}``.
_COUNTERS: Dict[Tuple[int, int], torch.Tensor] = {}
#: Smallest counter array allocated (tiles); arrays grow by doubling.
_MIN_COUNTERS = 4096
#: Per device: ``[zeroed int32 arena, next free entry]``; per-stream counters are cut from it.
_ARENAS: Dict[int, list] = {}
#: Counters per arena (4 MB): room for many streams' arrays and captured launches.
ARENA_COUNTERS = 1 << 20
#: Guards the arenas and the per-stream table when they change (never on a call's fast path).
_LOCK = threading.Lock()
#: Arrays replaced by larger ones: kept alive, since a captured graph may still use them.
_OUTGROWN: list = []

def stream_key(device: torch.device) -> Tuple[int, int]:
    """``(device index, raw stream handle)`` of ``device``'s current stream."""
    index = device_index(device)
    return stream_key_of(index, current_stream(index) if index >= 0 else None)


def stream_key_of(index: int, stream: Optional[int]) -> Tuple[int, int]:
    """:func:`stream_key` of device ``index`` (-1: the CPU) and its current ``stream`` (``None`` on the CPU)."""
    if index < 0:
        return (-1, threading.get_ident())  # the interpreter runs a launch on the calling thread
    return (index, stream)


def new_partials(device: torch.device, nbytes: int, stream: Optional[int], raw: bool
                 ) -> Tuple[Optional[torch.Tensor], int]:
    """A run's ``nbytes`` of partials (a float32 tensor) from the caching allocator: ``(tensor, address)``,
    or with ``raw`` and where the allocator allows, ``(None, address)`` of a raw block on
    ``stream`` that the caller frees with :func:`splitkv.launch.free_raw` once its launches are queued."""
    if raw and stream is not None:
        return None, alloc_raw(nbytes, device_index(device), stream)
    parts = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    return parts, parts.data_ptr()


class Workspace:
    """Counters and partials carved from a caller's bytes (``bytes`` of at least
    :func:`splitkv.schedule.workspace_bytes`) for launches of up to ``tiles`` tiles.

    The counters come first (``tiles`` + ``GRID_COUNTERS`` int32, padded to 16
    bytes), the partials take the rest. The counters are zeroed here: a
    caller's bytes may hold anything, and the one-launch merges need zeros.
    """

    def __init__(self, buffer: torch.Tensor, tiles: int):
        #: the most tiles a launch may have (one counter each)
        self.tiles = tiles
        raw = buffer.view(torch.uint8).reshape(-1)
        start = counter_bytes(tiles)
        self.counters = raw[: (tiles + GRID_COUNTERS) * 4].view(torch.int32)
        self.partials = raw[start: start + (raw.numel() - start) // 4 * 4].view(torch.float32)
        self.counters.zero_()


def counters(device: torch.device, tiles: int, key: Optional[Tuple[int, int]] = None,
             captured: Optional[bool] = None) -> Optional[torch.Tensor]:
    """Zeroed tile counters (at least ``tiles``) for a launch on ``device``'s current stream, or ``None``.

    Eager launches on one stream run one after another, so they share that
    stream's array: a slice of a per-device arena, zeroed when it was made;
    the kernel leaves every counter it uses at zero again. A launch captured
    into a CUDA graph gets a slice of its own, shared with nothing, so the
    graph may be replayed on any stream alongside anything else. Capture
    allocates nothing (a zeroing recorded into the graph would run at replay,
    after the arena was in use): when no arena has room this returns ``None``
    and the plan merges in a second launch, which needs no counters. Arrays
    and arenas are never freed (a captured graph may still use them).
    ``key``: the stream's :func:`stream_key`, ``captured``: whether it is being captured, when the
    caller has them.
    """
    if capturing(device) if captured is None else captured:
        with _LOCK:
            return _arena_slice(device, tiles, allocate=False)
    key = key or stream_key(device)
    arr = _COUNTERS.get(key)
    if arr is not None and arr.numel() >= tiles:
        return arr
    with _LOCK:
        if arr is not None:
            _OUTGROWN.append(arr)
        arr = _COUNTERS[key] = _arena_slice(device, max(_MIN_COUNTERS, next_pow2(tiles)))
    return arr


def _arena_slice(device: torch.device, size: int, allocate: bool = True) -> Optional[torch.Tensor]:
    """``size`` unused zeroed counters of ``device``'s arena (a new arena if it is full and ``allocate``)."""
    size = -(-size // 4) * 4  # every slice starts on a 16-byte boundary: the launch key assumes aligned scratch
    index = device_index(device)
    arena = _ARENAS.get(index)
    if arena is None or arena[1] + size > arena[0].numel():
        if not allocate:
            return None
        if arena is not None:
            _OUTGROWN.append(arena[0])
        arena = _ARENAS[index] = [_zeroed_arena(device, max(ARENA_COUNTERS, size)), 0]
    arr = arena[0][arena[1]: arena[1] + size]
    arena[1] += size
    return arr


def _zeroed_arena(device: torch.device, size: int) -> torch.Tensor:
    """A zeroed int32 array outside any CUDA-graph memory pool, zeroed before it is returned.

    Made on a side stream: a graph pool that a caller routes the current
    stream's allocations to (``torch.compile``'s CUDA-graph trees do while
    warming up) does not take it.
    """
    if device.type != "cuda":
        return torch.zeros(size, dtype=torch.int32, device=device)
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        arena = torch.zeros(size, dtype=torch.int32, device=device)
    side.synchronize()
    return arena
