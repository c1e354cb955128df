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
custom mask on the prefix, sizes past a launch limit, bfloat16 under the
interpreter, and malformed input.

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

from .checks import check_features, check_verify_inputs
from .kernel import block_m_for, rows_per_tile
from .occupancy import head_tiles
from .splits import MAX_GRID_SPLITS, fixed_n_splits

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
    custom_mask,
    is_causal,
    mask_indptr,
    max_len_extend,
    sliding_window_size=-1,
    sinks=None,
    logit_cap=0.0,
    xai_temperature_len=-1,
    *,
    skip_prefix_custom_mask=True,
    window_kv_offsets=None,
    k_scale=1.0,
    v_scale=1.0,
    sm_scale=None,
    o_extend=None,
    max_bs=None,
    split_tokens=None,
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
    except ValueError as err:
        return f"malformed input: {err}"
    if not 1 <= max_len_extend <= MAX_DRAFT_TOKENS:
        return f"max_len_extend {max_len_extend} outside [1, {MAX_DRAFT_TOKENS}]"
    if dims.num_tokens > dims.batch_size * max_len_extend:
        return "malformed input: more draft rows than batch_size * max_len_extend"
    if q_extend.device.type == "cpu" and q_extend.dtype == torch.bfloat16:
        return "bfloat16 under the Triton interpreter (its bf16 tl.dot is wrong)"
    return _launch_limit(dims, max_len_extend, kv_indices.shape[0] * dims.page_size, max_bs, split_tokens)


def _launch_limit(dims, max_len_extend: int, keys: int, max_bs, split_tokens) -> Optional[str]:
    """Why a launch for these sizes would exceed a CUDA or 32-bit limit, or ``None``.

    The grid is ``(batch x head_tiles, n_splits)``: axis 0 holds up to
    ``2^31 - 1`` programs, axis 1 (slices) up to 65535. Adaptive slices are at
    most 64; fixed slices are ``cdiv(keys, split_tokens)``, ``keys`` being
    ``len(kv_indices)`` times the page size (1 for a token pool). Pool rows,
    draft rows and mask positions are 64-bit in the kernel; key positions
    are 32-bit.
    """
    block_m = block_m_for(rows_per_tile(dims.group, max_len_extend))
    tiles = max(dims.batch_size, max_bs or 0) * head_tiles(
        dims.num_q_heads, dims.num_kv_heads, max_len_extend, block_m)
    if tiles >= 2**31:
        return f"launch limit: {tiles} tiles exceed CUDA's 2^31 - 1 programs on grid axis 0"
    if keys >= 2**31:
        return f"launch limit: {keys} prefix keys exceed 32-bit positions"
    if split_tokens is not None:
        if not isinstance(split_tokens, int) or split_tokens < 128 or split_tokens % 128:
            return f"split_tokens must be a positive multiple of 128, got {split_tokens!r}"
        if fixed_n_splits(keys, split_tokens) > MAX_GRID_SPLITS:
            return (f"launch limit: {fixed_n_splits(keys, split_tokens)} slices of {split_tokens} tokens "
                    f"exceed CUDA's {MAX_GRID_SPLITS} on grid axis 1")
    return None


def can_handle(
    q_extend,
    k_extend,
    v_extend,
    k_buffer,
    v_buffer,
    qo_indptr,
    kv_indptr,
    kv_indices,
    custom_mask,
    is_causal,
    mask_indptr,
    max_len_extend,
    sliding_window_size=-1,
    sinks=None,
    logit_cap=0.0,
    xai_temperature_len=-1,
    *,
    skip_prefix_custom_mask=True,
    window_kv_offsets=None,
    k_scale=1.0,
    v_scale=1.0,
    sm_scale=None,
    o_extend=None,
    kv_last_page_len=None,
) -> bool:
    """True iff the split-KV path computes exactly what ``extend_attention_fwd`` would.

    Reads shapes, dtypes, devices and Python scalars only (CUDA-graph safe).
    Malformed input is declined, not raised: use :func:`decline_reason` to
    see why a call is declined. The positional order is the seed's
    ``can_handle`` (``extend_attention_fwd``'s first arguments without
    ``o_extend``, then four feature flags); the rest are keywords.

    Args:
        q_extend: draft queries ``[tokens, H_Q, D]``.
        k_extend: draft keys ``[tokens, H_KV, D]``.
        v_extend: draft values ``[tokens, H_KV, Dv]``.
        k_buffer: the key pool ``[pool_tokens, H_KV, D]``.
        v_buffer: the value pool ``[pool_tokens, H_KV, Dv]``.
        qo_indptr: ``[bs + 1]`` draft rows per sequence.
        kv_indptr: ``[bs + 1]`` ranges of ``kv_indices`` per sequence.
        kv_indices: prefix slots in the pool.
        custom_mask: ``None`` or the flat tree mask.
        is_causal: causal draft block when there is no ``custom_mask``.
        mask_indptr: ``[bs + 1]`` start of each sequence's mask.
        max_len_extend: most draft tokens of any sequence (in ``[1, 64]``).
        sliding_window_size: ``> 0``: sliding window (served).
        sinks: ``None`` or ``[H_Q]`` sink logits (served).
        logit_cap: ``> 0``: logit cap (served).
        xai_temperature_len: ``> 0``: xai temperature (served; 1 is malformed).
        skip_prefix_custom_mask: declined when ``False`` with a ``custom_mask``.
        window_kv_offsets: ``[bs]`` mask column offsets (served).
        k_scale: must be a finite Python number.
        v_scale: must be a finite Python number.
        sm_scale: ``None`` or a finite Python number.
        o_extend: the output, checked when given.
        kv_last_page_len: ``[bs]`` rows used in each last page, for a paged pool.

    Returns:
        ``True`` when the split path serves the call exactly.
    """
    return (
        decline_reason(
            q_extend, k_extend, v_extend, k_buffer, v_buffer,
            qo_indptr, kv_indptr, kv_indices, custom_mask, is_causal,
            mask_indptr, max_len_extend, sliding_window_size, sinks,
            logit_cap, xai_temperature_len,
            skip_prefix_custom_mask=skip_prefix_custom_mask,
            window_kv_offsets=window_kv_offsets,
            k_scale=k_scale, v_scale=v_scale, sm_scale=sm_scale, o_extend=o_extend,
            kv_last_page_len=kv_last_page_len,
        )
        is None
    )
