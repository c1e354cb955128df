"""How many slices to cut each prefix into: the split chooser.

The verify kernel's grid is ``(batch x head_tiles, n_splits)``. Verify
attention is memory-bound, so the goal is to keep every SM streaming KV:
enough programs for a few full waves, but no slice so short that its fixed
costs (loading the query tile, writing a partial that the merge must read
back) outweigh the prefix bytes it streams.

The rule, from static shapes only (no device value is read, so it is safe
inside CUDA-graph capture)::

    base    = batch x head_tiles                   programs per slice
    slots   = programs_per_sm x num_sms            programs the device runs at once
    useful  = clamp(cdiv(prefix_len, min_split_tokens), 1, MAX_SPLITS)
    waves(n)      = base x n / slots
    efficiency(n) = waves(n) / ceil(waves(n))      busy fraction of the last wave
    n_splits = the smallest n <= useful whose efficiency is within 5 % of the
               best over 1 .. useful

Wave quantisation is the point: on an H200 (132 SMs, two programs each),
64 programs per slice with 4 slices fill 256 of 264 slots in one wave, while
9 slices need 576 programs, 2.2 waves, and run about 20 % slower. A batch
that fills the device by itself (``base >= slots``) gets one slice.

``n_splits`` is the grid's size; each sequence's own prefix decides how many
of those programs get keys (the kernel's ``n_used``, never more than
``n_splits``, never slices shorter than ``min_split_tokens``). So
``prefix_len`` needs only be a representative length, and the chooser is
asked with it rounded up to a multiple of ``min_split_tokens``: as a prefix
grows token by token from step to step, the answer (and its cache entry)
changes only every ``min_split_tokens`` tokens.

Small launches. When a batch's tiles are so few that each has eight SMs or
more to itself (batch 1-2 of an 8-KV-head model on an H200), and the sweep
measured a deeper-pipelined tile faster there
(:func:`splitkv.tuning.small_batch_tile`), the runner uses that tile and
:func:`one_wave_n_splits`: ``num_sms // tiles`` slices, one program per SM.

``programs_per_sm`` and ``min_split_tokens`` come from the H200 sweep
(:mod:`splitkv.tuning`). :func:`fixed_n_splits` is the other mode: a fixed
slice length, which makes every sequence's result independent of the batch
it runs in.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch

__all__ = [
    "choose_n_splits",
    "one_wave_n_splits",
    "fixed_n_splits",
    "device_sm_count",
    "launch_limit_reason",
    "LaunchLimitError",
    "MAX_SPLITS",
    "MAX_GRID_SPLITS",
]

#: Upper bound on adaptive slices: bounds the scratch and the merge's work per row.
MAX_SPLITS = 64
#: CUDA's limit on grid axis 1, where the slices go.
MAX_GRID_SPLITS = 65535
#: SM count assumed under the Triton interpreter (no device to ask).
INTERPRETER_SMS = 8


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def device_sm_count(device) -> int:
    """Streaming multiprocessors of ``device`` (a static property, cached)."""
    device = torch.device(device)
    if device.type != "cuda":
        return INTERPRETER_SMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_sm_count(index)


def choose_n_splits(
    batch_size: int,
    head_tiles: int,
    prefix_len: int,
    num_sms: int,
    *,
    programs_per_sm: int = 2,
    min_split_tokens: int = 128,
    max_splits: int = MAX_SPLITS,
) -> int:
    """Number of prefix slices per sequence for one verify call.

    Args:
        batch_size: sequences in the batch.
        head_tiles: stage-1 programs per sequence and split (KV heads x row
            tiles with GQA packing; query heads without).
        prefix_len: representative prefix length (``kv_indices.shape[0] //
            batch_size``), a Python int read off shapes.
        num_sms: streaming multiprocessors (:func:`device_sm_count`).
        programs_per_sm: programs one SM runs at once.
        min_split_tokens: shortest slice worth a program.
        max_splits: most slices.

    Returns:
        An int in ``[1, max_splits]``. Results are cached per
        ``(batch, head_tiles, cdiv(prefix_len, min_split_tokens), ...)``.
    """
    if batch_size < 1 or head_tiles < 1 or num_sms < 1 or programs_per_sm < 1 or min_split_tokens < 1:
        raise ValueError("batch_size, head_tiles, num_sms, programs_per_sm and min_split_tokens must be positive")
    useful = max(1, min(-(-int(prefix_len) // min_split_tokens), max_splits))
    return _choose(batch_size * head_tiles, programs_per_sm * num_sms, useful)


@functools.lru_cache(maxsize=4096)
def _choose(base: int, slots: int, useful: int) -> int:
    def efficiency(n: int) -> float:
        waves = base * n / slots
        return waves / math.ceil(waves)

    best = max(efficiency(n) for n in range(1, useful + 1))
    return next(n for n in range(1, useful + 1) if efficiency(n) >= 0.95 * best)


def one_wave_n_splits(base: int, prefix_len: int, num_sms: int, *, min_split_tokens: int = 128,
                      max_splits: int = MAX_SPLITS) -> int:
    """Slices for a small launch: one program per SM, in one wave.

    ``num_sms // base`` slices (``base`` = batch x head tiles), no more than
    the prefix has ``min_split_tokens`` slices for, at least 1.
    """
    useful = max(1, min(-(-int(prefix_len) // min_split_tokens), max_splits))
    return max(1, min(useful, num_sms // max(1, base)))


def fixed_n_splits(max_prefix_len: int, split_tokens: int) -> int:
    """Grid slices for the fixed-slice (batch-invariant) mode.

    Every sequence's prefix is cut into ``cdiv(n_prefix, split_tokens)``
    slices whatever the batch; ``cdiv(max_prefix_len, split_tokens)`` slices
    cover every prefix up to the caller's bound ``max_prefix_len``.
    """
    if split_tokens < 1:
        raise ValueError(f"split_tokens must be positive, got {split_tokens}")
    return max(1, -(-int(max_prefix_len) // split_tokens))


class LaunchLimitError(ValueError):
    """A launch whose grid or key positions would pass a CUDA or 32-bit limit."""


def launch_limit_reason(tiles: int, n_splits: int, keys: int) -> Optional[str]:
    """Why a verify grid of ``(tiles, n_splits)`` over ``keys`` prefix keys cannot launch, or ``None``.

    Axis 0 (tiles) holds up to ``2^31 - 1`` programs, axis 1 (slices) up to
    :data:`MAX_GRID_SPLITS`; key positions are 32-bit in the kernel (pool
    rows, draft rows and mask positions are 64-bit).
    """
    if tiles >= 2**31:
        return f"launch limit: {tiles} tiles exceed CUDA's 2^31 - 1 programs on grid axis 0"
    if n_splits > MAX_GRID_SPLITS:
        return f"launch limit: {n_splits} slices exceed CUDA's {MAX_GRID_SPLITS} on grid axis 1"
    if keys >= 2**31:
        return f"launch limit: {keys} prefix keys exceed 32-bit positions"
    return None
