"""Public entry points: the drop-in and the always-right production entry.

* :func:`verify_splitkv_fwd` takes ``extend_attention_fwd``'s positional
  arguments; it runs the split-KV path and returns ``True``, or returns
  ``False`` having written nothing, so the caller falls back.
* :func:`verify_attention` is for callers that want one call that is always
  right: it validates its input (``ValueError`` on malformed calls), then runs
  the split path when the gate allows and the baseline otherwise.

Runners are cached per (device, head configuration, ``max_len_extend``). A
runner outgrown by a larger ``max_bs`` is replaced, and the old one is kept
alive: CUDA graphs captured with its scratch keep valid addresses.
"""

from __future__ import annotations

import math

import torch

from .checks import check_verify_inputs
from .extend import extend_attention_fwd
from .gate import decline_reason
from .runner import VerifySplitKV

__all__ = ["verify_splitkv_fwd", "verify_attention", "get_runner"]

_RUNNERS: dict = {}
_RETIRED: list = []  # outgrown runners: graphs may still replay with their scratch


def get_runner(q_extend, k_extend, v_extend, max_len_extend: int, max_bs: int) -> VerifySplitKV:
    """The cached :class:`VerifySplitKV` for these inputs' head configuration.

    Grows (replaces) the cached runner when ``max_bs`` exceeds its capacity.

    Args:
        q_extend: draft queries (device, query heads and head_dim are read).
        k_extend: draft keys (KV heads are read).
        v_extend: draft values (v_head_dim is read).
        max_len_extend: most draft tokens per sequence.
        max_bs: most sequences per call.

    Returns:
        The runner, shared by every call with the same configuration.
    """
    h_q, d = q_extend.shape[1], q_extend.shape[2]
    h_kv, dv = k_extend.shape[1], v_extend.shape[2]
    key = (str(q_extend.device), h_q, h_kv, d, dv, int(max_len_extend))
    runner = _RUNNERS.get(key)
    if runner is None or runner.max_bs < max_bs:
        if runner is not None:
            _RETIRED.append(runner)
        runner = VerifySplitKV(h_q, h_kv, d, dv, int(max_len_extend), max_bs, q_extend.device)
        _RUNNERS[key] = runner
    return runner


def verify_splitkv_fwd(
    q_extend,
    k_extend,
    v_extend,
    o_extend,
    k_buffer,
    v_buffer,
    qo_indptr,
    kv_indptr,
    kv_indices,
    custom_mask,
    is_causal,
    mask_indptr,
    max_len_extend,
    k_scale,
    v_scale,
    sm_scale=None,
    logit_cap=0.0,
    skip_prefix_custom_mask=True,
    sliding_window_size=-1,
    sinks=None,
    window_kv_offsets=None,
    xai_temperature_len=-1,
    max_bs=None,
) -> bool:
    """Drop-in for ``extend_attention_fwd`` on the target-verify shape.

    Takes the same positional arguments. When :func:`splitkv.can_handle`
    accepts the call, runs split-KV attention, writes ``o_extend`` and returns
    ``True``; otherwise returns ``False`` and writes nothing, and the caller
    runs ``extend_attention_fwd``. Never reads device values (CUDA-graph safe).

    Args:
        q_extend: draft queries ``[tokens, H_Q, D]`` (row strides free, unit last stride).
        k_extend: draft keys ``[tokens, H_KV, D]``.
        v_extend: draft values ``[tokens, H_KV, Dv]``.
        o_extend: output ``[tokens, H_Q, Dv]``, written in place.
        k_buffer: the key pool ``[pool_tokens, H_KV, D]``.
        v_buffer: the value pool ``[pool_tokens, H_KV, Dv]``.
        qo_indptr: ``[bs + 1]`` draft rows of each sequence.
        kv_indptr: ``[bs + 1]`` ranges of ``kv_indices`` per sequence.
        kv_indices: pool slots of the prefixes, int32 or int64.
        custom_mask: ``None`` or the flat tree mask (rows ``[prefix | drafts]``).
        is_causal: causal draft block when ``custom_mask`` is ``None``.
        mask_indptr: ``[bs + 1]`` start of each sequence's mask.
        max_len_extend: most draft tokens of any sequence (Python int).
        k_scale: key-pool dequantisation multiplier (a Python number).
        v_scale: value-pool dequantisation multiplier (a Python number).
        sm_scale: softmax scale, default ``1 / sqrt(D)``.
        logit_cap: as in ``extend_attention_fwd``; declined when > 0.
        skip_prefix_custom_mask: as in ``extend_attention_fwd``; declined when
            ``False`` with a ``custom_mask``.
        sliding_window_size: as in ``extend_attention_fwd``; declined when > 0.
        sinks: optional ``[H_Q]`` attention-sink logits.
        window_kv_offsets: as in ``extend_attention_fwd``; declined when given.
        xai_temperature_len: as in ``extend_attention_fwd``; declined when > 0.
        max_bs: the largest batch this shape will see (scratch is sized for
            it; default: this batch rounded up to a power of two).

    Returns:
        ``True`` if ``o_extend`` was written, ``False`` if the call was declined.
    """
    if decline_reason(
        q_extend, k_extend, v_extend, k_buffer, v_buffer,
        qo_indptr, kv_indptr, kv_indices, custom_mask, is_causal,
        mask_indptr, max_len_extend, sliding_window_size, sinks,
        logit_cap, xai_temperature_len,
        skip_prefix_custom_mask=skip_prefix_custom_mask,
        window_kv_offsets=window_kv_offsets,
        k_scale=k_scale, v_scale=v_scale, sm_scale=sm_scale, o_extend=o_extend,
    ) is not None:
        return False
    bs = qo_indptr.shape[0] - 1
    if max_bs is None or max_bs < bs:
        max_bs = 1 << (bs - 1).bit_length()
    runner = get_runner(q_extend, k_extend, v_extend, max_len_extend, max_bs)
    runner(
        q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer,
        qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, is_causal,
        sm_scale=float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(q_extend.shape[2]),
        k_scale=float(k_scale), v_scale=float(v_scale), sinks=sinks,
    )
    return True


def verify_attention(
    q_extend,
    k_extend,
    v_extend,
    o_extend,
    k_buffer,
    v_buffer,
    qo_indptr,
    kv_indptr,
    kv_indices,
    custom_mask,
    is_causal,
    mask_indptr,
    max_len_extend,
    k_scale=1.0,
    v_scale=1.0,
    sm_scale=None,
    logit_cap=0.0,
    skip_prefix_custom_mask=True,
    sliding_window_size=-1,
    sinks=None,
    window_kv_offsets=None,
    xai_temperature_len=-1,
    max_bs=None,
) -> torch.Tensor:
    """Verify attention that is always right: split-KV when it applies, else the baseline.

    Same arguments as :func:`verify_splitkv_fwd`; ``o_extend`` may be ``None``
    (a new output is allocated).

    Returns:
        ``o_extend`` (or the new output), fully written.

    Raises:
        ValueError: on malformed input (mismatched devices, dtypes, ranks,
            head counts or head dims, CPU tensors outside the interpreter),
            and from the baseline for scales held in CUDA tensors or
            ``xai_temperature_len == 1``.
        NotImplementedError: for features neither path supports (head dims
            above 256).
    """
    if o_extend is None:
        o_extend = torch.empty(
            (q_extend.shape[0], q_extend.shape[1], v_extend.shape[2]),
            dtype=q_extend.dtype, device=q_extend.device,
        )
    check_verify_inputs(
        q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer,
        qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, max_len_extend, sinks,
    )
    args = (
        q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer,
        qo_indptr, kv_indptr, kv_indices, custom_mask, is_causal, mask_indptr,
        max_len_extend, k_scale, v_scale,
    )
    features = dict(
        sm_scale=sm_scale, logit_cap=logit_cap, skip_prefix_custom_mask=skip_prefix_custom_mask,
        sliding_window_size=sliding_window_size, sinks=sinks,
        window_kv_offsets=window_kv_offsets, xai_temperature_len=xai_temperature_len,
    )
    if not verify_splitkv_fwd(*args, **features, max_bs=max_bs):
        extend_attention_fwd(*args, **features)
    return o_extend
