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
(:mod:`splitkv.resources`), bfloat16 under the interpreter, and malformed input.

The gate decides from shapes, dtypes, devices and Python scalars alone. It
never reads a tensor's values: the verify step runs inside captured CUDA
graphs, where a device-to-host copy is an error. What it cannot see from
shapes is the caller's contract, as for ``extend_attention_fwd`` itself:
``max_len_extend`` is at least every sequence's draft count.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional

import torch

from .validate import check_batch_invariant, check_features, check_verify_inputs
from .resources import device_shared_memory, rope_dim, shared_memory_reason, shares_rows
from .schedule import MAX_SPLITS, TileConfig, block_m_for, fixed_n_splits, head_tiles, launch_limit_reason, rows_per_tile

__all__ = ["can_handle", "decline_reason", "MAX_DRAFT_TOKENS"]

#: Most draft tokens per sequence the split path serves; longer extends are
#: prefills, which the extend kernel's query tiles already parallelise.
MAX_DRAFT_TOKENS = 64


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def decline_reason(
    q_extend,
    k_extend,
    v_extend,
    k_buffer,
    v_buffer,
    qo_indptr,
    kv_indptr,
    kv_indices,
    *,
    max_len_extend,
    custom_mask=None,
    mask_indptr=None,
    is_causal=True,
    sliding_window_size=-1,
    sinks=None,
    logit_cap=0.0,
    xai_temperature_len=-1,
    skip_prefix_custom_mask=True,
    window_kv_offsets=None,
    k_scale=1.0,
    v_scale=1.0,
    sm_scale=None,
    o_extend=None,
    max_bs=None,
    split_tokens=None,
    max_prefix_len=None,
    kv_last_page_len=None,
) -> Optional[str]:
    """Why the split path declines this call, or ``None`` if it serves it.

    Same arguments as :func:`can_handle`.

    Returns:
        A short reason (``"malformed input: ..."``, ``"launch limit: ..."``, ...), or
        ``None`` when the split path serves the call exactly.
    """
    if custom_mask is not None and not skip_prefix_custom_mask:
        return "custom mask on the prefix (skip_prefix_custom_mask=False)"
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not _is_real(value):
            return f"{name} must be a finite Python number (a tensor would need a device read)"
    if sm_scale is not None and not _is_real(sm_scale):
        return "sm_scale must be a finite Python number or None"
    try:
        dims = check_verify_inputs(
            q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer,
            qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr,
            max_len_extend, sinks, kv_last_page_len=kv_last_page_len,
        )
        check_features(dims, logit_cap, sliding_window_size, window_kv_offsets, xai_temperature_len,
                       q_extend.device)
        check_batch_invariant(split_tokens, max_prefix_len)
    except ValueError as err:
        return f"malformed input: {err}"
    if not isinstance(is_causal, bool):
        return f"malformed input: is_causal must be a bool, got {type(is_causal).__name__}"
    if not 1 <= max_len_extend <= MAX_DRAFT_TOKENS:
        return f"max_len_extend {max_len_extend} outside [1, {MAX_DRAFT_TOKENS}]"
    if q_extend.device.type == "cpu" and q_extend.dtype == torch.bfloat16:
        return "bfloat16 under the Triton interpreter (its bf16 tl.dot is wrong)"
    return _launch_limit(dims, max_len_extend, kv_indices.shape[0] * dims.page_size, max_bs,
                         split_tokens, max_prefix_len) or _tile_reason(dims, max_len_extend, k_buffer, v_buffer,
                                                                        q_extend.dtype, q_extend.device)


def _tile_reason(dims, max_len_extend: int, k_buffer, v_buffer, q_dtype, device) -> Optional[str]:
    """Why not even the smallest tile (16 keys, one stage) fits the device's shared memory, or ``None``.

    The plan starts from the tuned tile and shrinks it the same way
    (:func:`splitkv.resources.fit_tile`), so it always finds a tile the gate let through. MLA's
    576/512 is taken in two chunks (512 + 64: nothing padded, and one query tile through the
    prefix loop), so its fp8 pool fits, where padded to 1024 not even this tile did; a value pool
    that is a view of the key pool is read once, which leaves room for a larger tile.
    """
    block_m = block_m_for(rows_per_tile(dims.group, max_len_extend))
    smallest = TileConfig(block_m, 16, 4, 1)
    kv_shared = bool(rope_dim(dims.head_dim, dims.v_head_dim)) and shares_rows(k_buffer, v_buffer)
    return shared_memory_reason(smallest, dims.head_dim, dims.v_head_dim, k_buffer.dtype, q_dtype,
                                device_shared_memory(device), dims.page_size, max_len_extend, kv_shared)


def _launch_limit(dims, max_len_extend: int, keys: int, max_bs, split_tokens, max_prefix_len) -> Optional[str]:
    """Why a launch for these sizes would pass a CUDA or 32-bit limit, or ``None``.

    The grid is ``(batch x head_tiles, n_splits)`` (:func:`splitkv.schedule.launch_limit_reason`):
    adaptive slices are at most 64, fixed ones ``cdiv(max_prefix_len, split_tokens)``.
    """
    block_m = block_m_for(rows_per_tile(dims.group, max_len_extend))
    tiles = max(dims.batch_size, max_bs or 0) * head_tiles(
        dims.num_q_heads, dims.num_kv_heads, max_len_extend, block_m)
    n_splits = MAX_SPLITS if split_tokens is None else fixed_n_splits(max_prefix_len, split_tokens)
    return launch_limit_reason(tiles, n_splits, keys)


def can_handle(
    q_extend,
    k_extend,
    v_extend,
    k_buffer,
    v_buffer,
    qo_indptr,
    kv_indptr,
    kv_indices,
    *,
    max_len_extend,
    **options,
) -> bool:
    """True iff the split-KV path computes exactly what ``extend_attention_fwd`` would.

    Reads shapes, dtypes, devices and Python scalars only (CUDA-graph safe).
    Malformed input is declined, not raised: use :func:`decline_reason` to
    see why a call is declined. Everything after ``kv_indices`` is a keyword,
    named as in :func:`splitkv.verify_attention`.

    Args:
        q_extend: draft queries ``[tokens, H_Q, D]``.
        k_extend: draft keys ``[tokens, H_KV, D]``.
        v_extend: draft values ``[tokens, H_KV, Dv]``.
        k_buffer: the key pool ``[pool_tokens, H_KV, D]`` (paged: ``[pages, page_size, H_KV, D]``).
        v_buffer: the value pool ``[pool_tokens, H_KV, Dv]``.
        qo_indptr: ``[bs + 1]`` draft rows per sequence.
        kv_indptr: ``[bs + 1]`` ranges of ``kv_indices`` per sequence.
        kv_indices: prefix slots in the pool (paged: page ids).
        max_len_extend: most draft tokens of any sequence (in ``[1, 64]``).
        **options: :func:`decline_reason`'s keywords: ``custom_mask``,
            ``mask_indptr``, ``is_causal``, ``sliding_window_size``, ``sinks``,
            ``logit_cap``, ``xai_temperature_len``, ``skip_prefix_custom_mask``
            (declined when ``False`` with a ``custom_mask``),
            ``window_kv_offsets``, ``k_scale``/``v_scale``/``sm_scale``
            (finite Python numbers), ``o_extend`` (checked when given),
            ``max_bs``, ``split_tokens`` and ``max_prefix_len``, ``kv_last_page_len``.

    Returns:
        ``True`` when the split path serves the call exactly.
    """
    return decline_reason(q_extend, k_extend, v_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
                          max_len_extend=max_len_extend, **options) is None
