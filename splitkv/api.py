"""Public entry points: the drop-in and the always-right production entry.

* :func:`verify_splitkv_fwd` takes ``extend_attention_fwd``'s positional
  arguments; it runs the split-KV path and returns ``True``, or returns
  ``False`` having written nothing, so the caller falls back.
* :func:`verify_attention` is for callers that want one call that is always
  right: it validates its input (shapes always; values too outside CUDA-graph
  capture), raises ``ValueError`` on malformed calls, runs the split path when
  the gate allows and the baseline otherwise, and can return the LSE.

The host path. An eager call costs what Python does before the launch, so the
drop-in keeps a cache of plans (:class:`splitkv.runner.VerifyPlan`) keyed by
the call's *signature*: every tensor's shape, strides, dtype and device except
``kv_indices``'s length (which changes every step as prefixes grow; only
whether the mean prefix exceeds :data:`splitkv.tuning.SMALL_BATCH_MAX_PREFIX`
counts, since it picks the plan's tile), and every scalar. A signature seen
before was already checked by the gate and planned; the call only rebinds
the step's metadata tensors and launches the compiled kernel directly
(:mod:`splitkv.launch`). A new signature goes through the gate
(:func:`splitkv.decline_reason`) and is planned once.

Checked mode: ``check=True`` or the environment variable ``SPLITKV_CHECK=1``
adds :func:`splitkv.checks.check_verify_values` (slots inside the pool,
well-formed indptrs, draft counts within ``max_len_extend``, masks inside
``custom_mask``), which reads the device; it is skipped while the stream is
being captured into a CUDA graph.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Optional

import torch

from .checks import check_verify_inputs, check_verify_values
from .extend import extend_attention_fwd
from .gate import decline_reason
from .paged import flat_pool, token_indices
from .runner import VerifyPlan, VerifySplitKV, mean_prefix
from .tuning import SMALL_BATCH_MAX_PREFIX

__all__ = ["verify_splitkv_fwd", "verify_attention", "get_runner", "clear_caches"]

_RUNNERS: dict = {}
#: signature -> VerifyPlan (served) or a decline reason (str)
_PLANS: "OrderedDict[tuple, object]" = OrderedDict()
#: Most signatures kept (least recently used dropped first).
PLAN_CACHE_SIZE = 512


def clear_caches() -> None:
    """Drop cached runners and plans (their counters stay: graphs may use them)."""
    _RUNNERS.clear()
    _PLANS.clear()


# ``SPLITKV_CHECK`` is read on every call (it may be set at any time), straight from
# ``os.environ``'s own dict of encoded keys and values: ``os.environ.get`` re-encodes the
# name and decodes the value each time, which costs a microsecond of a call's ~20.
_ENV_DATA = getattr(os.environ, "_data", None)
_CHECK_KEY = os.environ.encodekey("SPLITKV_CHECK") if _ENV_DATA is not None else None
_CHECK_OFF = (None, os.environ.encodevalue(""), os.environ.encodevalue("0")) if _ENV_DATA is not None else ()


def _env_check() -> bool:
    """``SPLITKV_CHECK`` is set to something other than ``""`` or ``"0"``."""
    if _ENV_DATA is None:  # pragma: no cover - an os.environ without its dict
        return os.environ.get("SPLITKV_CHECK", "0") not in ("", "0")
    return _ENV_DATA.get(_CHECK_KEY) not in _CHECK_OFF


def _checking(check: Optional[bool]) -> bool:
    if check is None:
        check = _env_check()
    return bool(check) and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def get_runner(q_extend, k_extend, v_extend, max_len_extend: int, max_bs: int,
               split_tokens: Optional[int] = None, one_launch: bool = True) -> VerifySplitKV:
    """The cached :class:`VerifySplitKV` for these inputs' head configuration.

    Args:
        q_extend: draft queries (device, query heads and head_dim are read).
        k_extend: draft keys (KV heads are read).
        v_extend: draft values (v_head_dim is read).
        max_len_extend: most draft tokens per sequence.
        max_bs: most sequences per call (the cached runner's bound grows to it).
        split_tokens: fixed slice length (batch-invariant mode) or ``None``.
        one_launch: see :class:`VerifySplitKV`.

    Returns:
        The runner shared by every call with the same configuration.
    """
    h_q, d = q_extend.shape[1], q_extend.shape[2]
    h_kv, dv = k_extend.shape[1], v_extend.shape[2]
    key = (str(q_extend.device), h_q, h_kv, d, dv, int(max_len_extend), split_tokens, one_launch)
    runner = _RUNNERS.get(key)
    if runner is None:
        runner = VerifySplitKV(h_q, h_kv, d, dv, int(max_len_extend), max_bs, q_extend.device,
                               split_tokens=split_tokens, one_launch=one_launch)
        _RUNNERS[key] = runner
    runner.max_bs = max(runner.max_bs, max_bs)  # only bounds checks: no scratch is sized by it
    return runner


def _small(t):
    """Shape, dtype and device of an optional metadata tensor."""
    return None if t is None else (t.shape, t.dtype, t.get_device())


def _signature(q, k, v, o, kb, vb, qo, kvp, kvi, cm, mi, sinks, last, offsets, scalars):
    """Everything the gate and the plan depend on, except kv_indices' length and tensor values.

    Of the length, only whether the mean prefix passes ``SMALL_BATCH_MAX_PREFIX`` keys
    (it fixes the plan's tile: :meth:`VerifySplitKV.config`), counted as the plan counts it
    (:func:`splitkv.runner.mean_prefix`).

    Written out flat: it runs on every eager call.
    """
    return (
        q.shape, q.stride(), q.dtype, q.get_device(),
        k.shape, k.stride(), k.dtype, k.get_device(),
        v.shape, v.stride(), v.dtype, v.get_device(),
        o.shape, o.stride(), o.dtype, o.get_device(),
        kb.shape, kb.stride(), kb.dtype, kb.get_device(),
        vb.shape, vb.stride(), vb.dtype, vb.get_device(),
        qo.shape, qo.dtype, qo.get_device(), kvp.shape, kvp.dtype, kvp.get_device(),
        kvi.dim(), kvi.dtype, kvi.get_device(),
        mean_prefix(kvi.shape[0], kb.shape[1] if kb.dim() == 4 else 1, qo.shape[0] - 1) > SMALL_BATCH_MAX_PREFIX,
        None if cm is None else (_small(cm), _small(mi)),
        None if sinks is None else _small(sinks),
        None if last is None else _small(last),
        None if offsets is None else _small(offsets),
        scalars,
    )


def _plan_for(args, features, max_bs, split_tokens, return_lse, one_launch=True, kv_last_page_len=None):
    """The cached plan for a drop-in call, or the gate's reason to decline.

    ``args``: ``extend_attention_fwd``'s 15 positional arguments; ``features``: its keyword
    arguments as a tuple (sm_scale, logit_cap, skip_prefix_custom_mask, sliding_window_size,
    sinks, window_kv_offsets, xai_temperature_len). A plan found in the cache is rebound to
    this call's metadata.
    """
    (q, k, v, o, kb, vb, qo, kvp, kvi, cm, is_causal, mi, max_len_extend, k_scale, v_scale) = args
    sm_scale, logit_cap, skip_prefix_custom_mask, window, sinks, offsets, xai_temperature_len = features
    scalars = (is_causal, max_len_extend, k_scale, v_scale, sm_scale, logit_cap, skip_prefix_custom_mask, window,
               xai_temperature_len, max_bs, split_tokens, return_lse, one_launch)
    try:
        key = _signature(q, k, v, o, kb, vb, qo, kvp, kvi, cm, mi, sinks, kv_last_page_len, offsets, scalars)
        plan = _PLANS.get(key)  # hashing the key raises TypeError for an unhashable scalar
    except (AttributeError, TypeError):  # not tensors, or unhashable scalars: let the gate say why
        key = plan = None
    if plan is not None:
        _PLANS.move_to_end(key)
        if isinstance(plan, VerifyPlan):
            # The key holds every tensor's device and dtype: the plan need not check them again.
            plan._rebind_same_signature(qo, kvp, kvi, cm, mi, sinks, kv_last_page_len, offsets)
        return plan
    reason = decline_reason(
        q, k, v, kb, vb, qo, kvp, kvi, cm, is_causal, mi, max_len_extend,
        window, sinks, logit_cap, xai_temperature_len,
        skip_prefix_custom_mask=skip_prefix_custom_mask, window_kv_offsets=offsets,
        k_scale=k_scale, v_scale=v_scale, sm_scale=sm_scale, o_extend=o,
        max_bs=max_bs, split_tokens=split_tokens, kv_last_page_len=kv_last_page_len,
    )
    if reason is None:
        runner = get_runner(q, k, v, max_len_extend, max_bs, split_tokens, one_launch)
        plan = runner.plan(q, k, v, kb, vb, qo, kvp, kvi, cm, mi, is_causal, sm_scale=sm_scale,
                           k_scale=k_scale, v_scale=v_scale, sinks=sinks, return_lse=return_lse,
                           logit_cap=logit_cap, sliding_window_size=window,
                           window_kv_offsets=offsets, xai_temperature_len=xai_temperature_len,
                           kv_last_page_len=kv_last_page_len)
    else:
        plan = reason
    if key is not None and isinstance(k_scale, (int, float)) and isinstance(v_scale, (int, float)):
        _PLANS[key] = plan
        if len(_PLANS) > PLAN_CACHE_SIZE:
            _PLANS.popitem(last=False)
    return plan


def _check_values(args, kv_last_page_len) -> None:
    """The checked mode's value checks for a call's positional arguments."""
    (q, _, _, _, kb, _, qo, kvp, kvi, cm, _, mi, max_len_extend, _, _) = args
    check_verify_values(qo, kvp, kvi, kb.shape[0], max_len_extend, cm, mi, num_tokens=q.shape[0],
                        kv_last_page_len=kv_last_page_len,
                        page_size=kb.shape[1] if kv_last_page_len is not None else 1)


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
    split_tokens=None,
    check=None,
    kv_last_page_len=None,
) -> bool:
    """Drop-in for ``extend_attention_fwd`` on the target-verify shape.

    Takes the same positional arguments. When :func:`splitkv.can_handle`
    accepts the call, runs split-KV attention, writes ``o_extend`` and returns
    ``True``; otherwise returns ``False`` and writes nothing, and the caller
    runs ``extend_attention_fwd``. Never reads device values unless checked
    (CUDA-graph safe).

    Args:
        q_extend: draft queries ``[tokens, H_Q, D]`` (row strides free, unit last stride).
        k_extend: draft keys ``[tokens, H_KV, D]``.
        v_extend: draft values ``[tokens, H_KV, Dv]``.
        o_extend: output ``[tokens, H_Q, Dv]``, written in place.
        k_buffer: the key pool ``[pool_tokens, H_KV, D]`` (paged: ``[pages, page_size, H_KV, D]``).
        v_buffer: the value pool ``[pool_tokens, H_KV, Dv]`` (paged: ``[pages, page_size, H_KV, Dv]``).
        qo_indptr: ``[bs + 1]`` draft rows of each sequence.
        kv_indptr: ``[bs + 1]`` ranges of ``kv_indices`` per sequence.
        kv_indices: pool slots (paged: page ids) of the prefixes, int32 or int64.
        custom_mask: ``None`` or the flat tree mask (rows ``[prefix | drafts]``).
        is_causal: causal draft block when ``custom_mask`` is ``None``.
        mask_indptr: ``[bs + 1]`` start of each sequence's mask.
        max_len_extend: most draft tokens of any sequence (Python int).
        k_scale: key-pool dequantisation multiplier (a Python number).
        v_scale: value-pool dequantisation multiplier (a Python number).
        sm_scale: softmax scale, default ``1 / sqrt(D)``.
        logit_cap: as in ``extend_attention_fwd`` (``> 0``: scores ``cap * tanh(s / cap)``).
        skip_prefix_custom_mask: as in ``extend_attention_fwd``; declined when
            ``False`` with a ``custom_mask``.
        sliding_window_size: as in ``extend_attention_fwd`` (``> 0``: the query at
            position ``p`` sees keys at ``>= p - W``; only those slices are read).
        sinks: optional ``[H_Q]`` attention-sink logits.
        window_kv_offsets: as in ``extend_attention_fwd`` (column offsets of the
            ``custom_mask`` rows).
        xai_temperature_len: as in ``extend_attention_fwd``.
        max_bs: the largest batch this shape will see (default: this batch).
        split_tokens: a fixed slice length in tokens (a multiple of 128): the
            batch-invariant mode, where a sequence's output is bitwise the same
            whatever batch it runs in. Default: adaptive slices.
        check: validate metadata values (default: ``SPLITKV_CHECK``); see the
            module docstring.
        kv_last_page_len: ``[bs]`` rows used in each sequence's last page: the
            pools are paged (see :mod:`splitkv.paged`). Default: a token pool.

    Returns:
        ``True`` if ``o_extend`` was written, ``False`` if the call was declined.

    Raises:
        ValueError: only in checked mode, for metadata values that are wrong
            or input the gate finds malformed (unchecked, those are declined).
    """
    args = (q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
            custom_mask, is_causal, mask_indptr, max_len_extend, k_scale, v_scale)
    features = (sm_scale, logit_cap, skip_prefix_custom_mask, sliding_window_size, sinks, window_kv_offsets,
                xai_temperature_len)
    bs = qo_indptr.shape[0] - 1 if isinstance(qo_indptr, torch.Tensor) else 0
    checking = _checking(check)
    plan = _plan_for(args, features, max(max_bs or 1, bs), split_tokens, False,
                     kv_last_page_len=kv_last_page_len)
    if not isinstance(plan, VerifyPlan):
        if checking and plan.startswith("malformed input"):
            # Name the bad sequence and field where the values say it.
            _check_values(args, kv_last_page_len)
            raise ValueError(plan)
        return False
    if checking:
        _check_values(args, kv_last_page_len)
    # The plan's cache key fixed the tensors' devices and dtypes: launch without checking them again.
    plan._run(q_extend, k_extend, v_extend, k_buffer, v_buffer, o_extend, o_extend)
    plan.release()
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
    split_tokens=None,
    check=True,
    return_lse=False,
    one_launch=True,
    kv_last_page_len=None,
):
    """Verify attention that is always right: split-KV when it applies, else the baseline.

    Same arguments as :func:`verify_splitkv_fwd`; ``o_extend`` may be ``None``
    (a new output is allocated).

    Args:
        check: validate metadata values as well as shapes (default ``True``;
            skipped during CUDA-graph capture, where it would read the device).
        return_lse: also return the natural-log LSE per (token, query head),
            ``[tokens, H_Q]`` float32 (the sinks included): the state
            :func:`splitkv.merge_states` merges. Needs the split path.
        one_launch: see :class:`splitkv.VerifySplitKV` (the custom op passes ``False``).
        kv_last_page_len: ``[bs]`` rows used in each sequence's last page, for
            paged pools. Where the split path declines a paged call, the
            baseline runs on the pool seen as a token pool (expanding the page
            table reads the device: not inside CUDA-graph capture).

    Returns:
        ``o_extend`` (or the new output), fully written for every draft row;
        ``(o, lse)`` with ``return_lse``.

    Raises:
        ValueError: on malformed input (mismatched devices, dtypes, ranks,
            head counts or head dims, CPU tensors outside the interpreter;
            checked: slots outside the pool, bad indptrs, more draft tokens
            than ``max_len_extend``, masks out of range), and from the
            baseline for scales held in CUDA tensors or ``xai_temperature_len == 1``.
        NotImplementedError: for features neither path supports (head dims
            above 256), and ``return_lse`` for a call the split path declines.
    """
    if o_extend is None:
        o_extend = torch.empty(
            (q_extend.shape[0], q_extend.shape[1], v_extend.shape[2]),
            dtype=q_extend.dtype, device=q_extend.device,
        )
    dims = check_verify_inputs(
        q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer,
        qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, max_len_extend, sinks,
        kv_last_page_len=kv_last_page_len,
    )
    args = (
        q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer,
        qo_indptr, kv_indptr, kv_indices, custom_mask, is_causal, mask_indptr,
        max_len_extend, k_scale, v_scale,
    )
    if _checking(check):
        _check_values(args, kv_last_page_len)
    features = (sm_scale, logit_cap, skip_prefix_custom_mask, sliding_window_size, sinks, window_kv_offsets,
                xai_temperature_len)
    plan = _plan_for(args, features, max(max_bs or 1, dims.batch_size), split_tokens, bool(return_lse),
                     one_launch, kv_last_page_len)
    if isinstance(plan, VerifyPlan):
        result = plan.run(q_extend, k_extend, v_extend, k_buffer, v_buffer, out=o_extend)
        plan.release()
        return result
    if plan.startswith("malformed input"):
        raise ValueError(plan)
    if return_lse:
        raise NotImplementedError(f"return_lse needs the split path, which declines this call: {plan}")
    if kv_last_page_len is not None:
        page_size = k_buffer.shape[1]
        tok_indptr, tok_indices = token_indices(kv_indptr, kv_indices, kv_last_page_len, page_size)
        args = args[:4] + (flat_pool(k_buffer), flat_pool(v_buffer), qo_indptr, tok_indptr, tok_indices) + args[9:]
    extend_attention_fwd(*args, sm_scale=sm_scale, logit_cap=logit_cap, skip_prefix_custom_mask=skip_prefix_custom_mask,
                         sliding_window_size=sliding_window_size, sinks=sinks, window_kv_offsets=window_kv_offsets,
                         xai_temperature_len=xai_temperature_len)
    return o_extend
