"""The gate: does the split-KV path serve this call exactly?

The split path computes exactly what ``extend_attention_fwd`` computes when

* the prefix is fully visible to every draft token (no custom mask on the
  prefix: ``custom_mask is None`` or ``skip_prefix_custom_mask``),
* the draft block is causal, fully visible, or given by ``custom_mask``
  (chains at speculative ``topk == 1`` and trees at ``topk > 1`` alike:
  the kernel reads the draft block's mask),

with any of the score features: ``logit_cap``, a sliding window (with
``window_kv_offsets``), xai temperature, attention ``sinks``, k/v scales; on
a token pool or a paged pool (``kv_last_page_len``). So it declines only a
custom mask on the prefix, sizes past a launch limit, head dims whose
smallest tile does not fit the device's shared memory
(:mod:`splitkv.resources`), a tile whose compile ran out of the device's
resources before (:func:`splitkv.resources.refuse`), bfloat16 under the
interpreter, and malformed input.

The gate decides from shapes, dtypes, devices and Python scalars alone. It
never reads a tensor's values: the verify step runs inside captured CUDA
graphs, where a device-to-host copy is an error. What it cannot see from
shapes is the caller's contract, as for ``extend_attention_fwd`` itself:
``max_len_extend`` is at least every sequence's draft count.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch

from . import tuning
from .options import VerifyOptions, batch_view, split_options
from .resources import refusal, rope_dim, shares_rows
from .schedule import MAX_SPLITS, TilePlan, VerifyParams, device_facts, fixed_n_splits, launch_limit_reason, plan_tile
from .validate import Dims, check_call

__all__ = ["can_handle", "decline_reason", "Decline", "decline", "admit", "MAX_DRAFT_TOKENS"]

#: Most draft tokens per sequence the split path serves; longer extends are
#: prefills, which the extend kernel's query tiles already parallelise.
MAX_DRAFT_TOKENS = 64


class Decline(NamedTuple):
    """Why the split path does not serve a call: ``malformed`` (the input is wrong: the entries that
    raise on bad input raise ``ValueError(reason)``) or not (the baseline serves it)."""

    reason: str
    malformed: bool = False

    def __str__(self) -> str:
        return self.reason


def decline(tensors: tuple, meta: dict, opts: VerifyOptions) -> Optional[Decline]:
    """The gate: why the split path declines a call, or ``None`` when it serves it exactly.

    ``tensors``: :data:`splitkv.options.TENSORS` (``o_extend`` may be ``None``); ``meta``: the
    metadata tensors by name; ``opts``: the call's options. Shapes, dtypes, devices and Python
    scalars only.
    """
    found = admit(tensors, meta, opts)
    return found if isinstance(found, Decline) else None


def admit(tensors: tuple, meta: dict, opts: VerifyOptions) -> Union[Decline, TilePlan]:
    """:func:`decline`'s answer, or for a call it serves the tile it checked
    (:func:`splitkv.schedule.plan_tile`), which the call's plan then takes rather than plan it again."""
    if meta["custom_mask"] is not None and not opts.skip_prefix_custom_mask:
        return Decline("custom mask on the prefix (skip_prefix_custom_mask=False)")
    scales = opts.scale_problem()
    if scales is not None:
        return Decline(scales)
    try:
        dims = check_call(tensors, meta, opts)
    except ValueError as err:
        return Decline(f"malformed input: {err}", malformed=True)
    if not 1 <= opts.max_len_extend <= MAX_DRAFT_TOKENS:
        return Decline(f"max_len_extend {opts.max_len_extend} outside [1, {MAX_DRAFT_TOKENS}]")
    q, kb, vb = tensors[0], tensors[4], tensors[5]
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        return Decline("bfloat16 under the Triton interpreter (its bf16 tl.dot is wrong)")
    kv_len = tensors[8].shape[0]
    tile = _tile(dims, opts, q, kb, vb, kv_len)
    if isinstance(tile, Decline):
        return tile
    reason = _launch_limit(tile, dims, opts, kv_len * dims.page_size)
    return tile if reason is None else Decline(reason)


def _tile(dims: Dims, opts: VerifyOptions, q, k_buffer, v_buffer, kv_len: int) -> Union[Decline, TilePlan]:
    """The call's tile, or why none fits the device's shared memory: the plan's own tile choice
    (:func:`splitkv.schedule.plan_tile`, which shrinks the tuned tile until it fits), so the gate
    never accepts a call the plan cannot tile."""
    p = VerifyParams(dims.num_q_heads, dims.num_kv_heads, dims.head_dim, dims.v_head_dim, opts.max_len_extend,
                     dims.batch_size, k_buffer.dtype, q.dtype, page_size=dims.page_size,
                     kv_shared=bool(rope_dim(dims.head_dim, dims.v_head_dim)) and shares_rows(k_buffer, v_buffer),
                     window=opts.window, split_tokens=opts.split_tokens, max_prefix_len=opts.max_prefix_len)
    try:
        tile = plan_tile(p, device_facts(q.device), tuning.table_for(q.device), p.prefix(kv_len))
    except ValueError as err:
        return Decline(str(err))
    refused = refusal(tile)  # a compile of this tile ran out of the device's resources before
    return tile if refused is None else Decline(refused)


def _launch_limit(tile: TilePlan, dims: Dims, opts: VerifyOptions, keys: int) -> Optional[str]:
    """Why a launch of this tile for these sizes would pass a CUDA or 32-bit limit, or ``None``.

    The grid is ``(batch x head_tiles, n_splits)`` (:func:`splitkv.schedule.launch_limit_reason`, which the
    plan checks each step's launch with): here for the most sequences the call allows (``max_bs``) and the
    most slices (64 adaptive ones, or ``cdiv(max_prefix_len, split_tokens)`` fixed ones).
    """
    tiles = max(dims.batch_size, opts.max_bs or 0) * tile.head_tiles
    n_splits = MAX_SPLITS if opts.split_tokens is None else fixed_n_splits(opts.max_prefix_len, opts.split_tokens)
    return launch_limit_reason(tiles, n_splits, keys)


def decline_reason(q_extend, k_extend, v_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, *,
                   o_extend=None, **options) -> Optional[str]:
    """Why the split path declines this call, or ``None`` if it serves it.

    Same arguments as :func:`can_handle`.

    Returns:
        A short reason (``"malformed input: ..."``, ``"launch limit: ..."``, ...), or
        ``None`` when the split path serves the call exactly.

    Raises:
        TypeError: for an unknown keyword, or an ``is_causal``, ``check`` or
            ``max_len_extend`` of the wrong type.
    """
    opts, meta = split_options(options)
    kv_indptr, meta = batch_view(qo_indptr, kv_indptr, meta)
    tensors = (q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices)
    found = decline(tensors, meta, opts)
    return None if found is None else found.reason


def can_handle(q_extend, k_extend, v_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, *,
               o_extend=None, **options) -> bool:
    """True iff the split-KV path computes exactly what ``extend_attention_fwd`` would.

    Reads shapes, dtypes, devices and Python scalars only (CUDA-graph safe).
    Malformed input is declined, not raised: use :func:`decline_reason` to
    see why a call is declined.

    Args:
        q_extend: draft queries ``[tokens, H_Q, D]``.
        k_extend: draft keys ``[tokens, H_KV, D]``.
        v_extend: draft values ``[tokens, H_KV, Dv]``.
        k_buffer: the key pool ``[pool_tokens, H_KV, D]`` (paged: ``[pages, page_size, H_KV, D]``).
        v_buffer: the value pool ``[pool_tokens, H_KV, Dv]``.
        qo_indptr: ``[bs + 1]`` draft rows per sequence.
        kv_indptr: ``[bs + 1]`` ranges of ``kv_indices`` per sequence.
        kv_indices: prefix slots in the pool (paged: page ids).
        o_extend: the output, checked when given.
        **options: :func:`splitkv.verify_attention`'s options
            (:class:`splitkv.options.VerifyOptions`, ``max_len_extend`` required,
            and the metadata tensors of :data:`splitkv.options.METADATA`).

    Returns:
        ``True`` when the split path serves the call exactly.
    """
    return decline_reason(q_extend, k_extend, v_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
                          o_extend=o_extend, **options) is None
