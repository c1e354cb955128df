"""How many slices to cut each prefix into: the split chooser.

Stage 1 launches ``batch x head_tiles x (n_splits + 1)`` programs (the ``+ 1``
is the draft block). Verify attention is memory-bound, so the goal is to keep
every SM streaming KV: enough programs for a few full waves, but no slice so
short that its fixed costs (loading the query tile, writing a partial that
stage 2 must read back) outweigh the prefix bytes it streams.

The rule, from static shapes only (no device value is read, so it is safe
inside CUDA-graph capture)::

    base    = batch x head_tiles                   programs per split
    slots   = PROGRAMS_PER_SM x num_sms            programs the device runs at once
    useful  = clamp(prefix_len // MIN_SPLIT_TOKENS, 1, MAX_SPLITS)
    waves(n)      = base x n / slots
    efficiency(n) = waves(n) / ceil(waves(n))      busy fraction of the last wave
    n_splits = the smallest n <= useful whose efficiency is within 5 % of the
               best over 1 .. useful

Wave quantisation is the point: on an H200 (132 SMs, two programs each),
64 programs per split with 4 splits fill 256 of 264 slots in one wave, while
9 splits need 576 programs, 2.2 waves, and run about 20 % slower. A batch
that fills the device by itself (``base >= slots``) gets one split.

``prefix_len`` is the *average* prefix, ``kv_indices.shape[0] // batch``: under
CUDA graphs ``kv_indices`` is a buffer of fixed (maximum) size, so the split
count is fixed per captured batch size while the kernel cuts each sequence's
actual prefix into that many slices at run time.
"""

from __future__ import annotations

import functools
import math

import torch

__all__ = [
    "choose_n_splits",
    "device_sm_count",
    "MAX_SPLITS",
    "MIN_SPLIT_TOKENS",
    "PROGRAMS_PER_SM",
]

#: Stage-1 programs resident per SM (register- and shared-memory-bound: two).
PROGRAMS_PER_SM = 2
#: A slice streams at least this many prefix tokens.
MIN_SPLIT_TOKENS = 128
#: Upper bound on slices: bounds the scratch and the merge's work per row.
MAX_SPLITS = 64
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


@functools.lru_cache(maxsize=4096)
def choose_n_splits(
    batch_size: int,
    head_tiles: int,
    prefix_len: int,
    num_sms: int,
    *,
    programs_per_sm: int = PROGRAMS_PER_SM,
    min_split_tokens: int = MIN_SPLIT_TOKENS,
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

    Returns:
        An int in ``[1, max_splits]``. Results are cached: the rule runs once
        per distinct shape, not once per call.
    """
    if batch_size < 1 or head_tiles < 1 or num_sms < 1:
        raise ValueError("batch_size, head_tiles and num_sms must be positive")
    base = batch_size * head_tiles
    slots = programs_per_sm * num_sms
    useful = max(1, min(int(prefix_len) // min_split_tokens, max_splits))

    def efficiency(n: int) -> float:
        waves = base * n / slots
        return waves / math.ceil(waves)

    best = max(efficiency(n) for n in range(1, useful + 1))
    return next(n for n in range(1, useful + 1) if efficiency(n) >= 0.95 * best)
