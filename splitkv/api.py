"""Public entry points: the drop-in and the always-right production entry.

* :func:`verify_splitkv_fwd` takes ``extend_attention_fwd``'s positional
  arguments; it runs the split-KV path and returns ``True``, or returns
  ``False`` having written nothing, so the caller falls back.
* :func:`verify_attention` is for callers that want one call that is always
  right: it raises ``ValueError`` on malformed calls, has the kernel validate
  the metadata (by default), runs the split path when the gate allows and the
  baseline otherwise, can return the LSE, and under ``torch.compile`` becomes
  the custom op ``torch.ops.splitkv.verify_attention``.

The host path. An eager call costs what Python does before the launch, so
both entries keep a cache of plans (:class:`splitkv.plan.VerifyPlan`) keyed
by the call's *signature*: every tensor's shape, strides, dtype and device
except ``kv_indices``'s length (which changes every step as prefixes grow;
only whether the mean prefix exceeds :data:`splitkv.tuning.SMALL_BATCH_MAX_PREFIX`
counts, since it picks the plan's tile), and every scalar. A signature seen
before was already checked by the gate and planned; the call only rebinds
the step's metadata tensors (re-checking the launch limits, which depend on
the length) and launches the compiled kernel directly (:mod:`splitkv.launch`).
A new signature goes through the gate (:func:`splitkv.decline_reason`) and
is planned once. Plans hold a step's bound metadata, so each thread has its
own cache.

Checks. ``check=True`` (the default of :func:`verify_attention`; for the
drop-in ``SPLITKV_CHECK=1``) launches the kernel's checked variant, which
reports malformed metadata in a device error word that the host reads
without waiting (:mod:`splitkv.errors`): a fault raises
:class:`splitkv.errors.VerifyError` at that call or the next, or at
:func:`splitkv.check_device_errors`. ``check="full"`` (``SPLITKV_CHECK=full``)
also runs :func:`splitkv.validate.check_verify_values` first, which reads the
device and names every kind of fault at once; it is skipped while the
stream is being captured into a CUDA graph.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Optional

import torch

from .validate import check_batch_invariant, check_dropin_types, check_mode, check_verify_inputs, check_verify_values
from .errors import raise_pending
from .extend import extend_attention_fwd
from .gate import decline_reason
from .paged import flat_pool, token_indices
from .plan import VerifyPlan, VerifySplitKV
from .schedule import LaunchLimitError, mean_prefix
from .tuning import SMALL_BATCH_MAX_PREFIX

__all__ = ["verify_splitkv_fwd", "verify_attention", "get_runner", "clear_caches"]

#: Most signatures a thread's plan cache keeps (least recently used dropped first).
PLAN_CACHE_SIZE = 512


class _Caches(threading.local):
    """One thread's runners (by head configuration) and plans (by signature; a plan or a decline reason)."""

    def __init__(self):
        self.runners: dict = {}
        self.plans: "OrderedDict[tuple, object]" = OrderedDict()


_CACHES = _Caches()


def clear_caches() -> None:
    """Drop this thread's cached runners and plans (their counters stay: graphs may use them)."""
    _CACHES.runners.clear()
    _CACHES.plans.clear()


# ``SPLITKV_CHECK`` is read on every drop-in call (it may be set at any time), straight from
# ``os.environ``'s dict of encoded names and values: ``os.environ.get`` encodes and decodes each time.
_ENV_DATA = getattr(os.environ, "_data", None)
_CHECK_KEY = os.environ.encodekey("SPLITKV_CHECK") if _ENV_DATA is not None else None
_CHECK_VALUES = {None: False, b"": False, b"0": False, b"full": "full"}
_CUDA = torch.cuda.is_available()


def _env_check():
    """The drop-in's default ``check``, from ``SPLITKV_CHECK``: unset or ``0``, ``full``, else on."""
    if _ENV_DATA is None:  # pragma: no cover - an os.environ without its dict
        raw = os.environ.get("SPLITKV_CHECK")
        raw = None if raw is None else raw.encode()
    else:
        raw = _ENV_DATA.get(_CHECK_KEY)
    return _CHECK_VALUES.get(raw, True)


def _capturing() -> bool:
    return _CUDA and torch.cuda.is_current_stream_capturing()


def get_runner(q_extend, k_extend, v_extend, max_len_extend: int, max_bs: int, *,
               split_tokens: Optional[int] = None, max_prefix_len: Optional[int] = None,
               one_launch: bool = True) -> VerifySplitKV:
    """This thread's cached :class:`VerifySplitKV` for these inputs' head configuration.

    Args:
        q_extend: draft queries (device, query heads and head_dim are read).
        k_extend: draft keys (KV heads are read).
        v_extend: draft values (v_head_dim is read).
        max_len_extend: most draft tokens per sequence.
        max_bs: most sequences per call (the cached runner's bound grows to it).
        split_tokens, max_prefix_len: the batch-invariant mode (see :class:`VerifySplitKV`).
        one_launch: see :class:`VerifySplitKV`.

    Returns:
        The runner shared by every call of this thread with the same configuration.
    """
    h_q, d = q_extend.shape[1], q_extend.shape[2]
    h_kv, dv = k_extend.shape[1], v_extend.shape[2]
    key = (str(q_extend.device), h_q, h_kv, d, dv, int(max_len_extend), split_tokens, max_prefix_len, one_launch)
    runner = _CACHES.runners.get(key)
    if runner is None:
        runner = VerifySplitKV(h_q, h_kv, d, dv, int(max_len_extend), max_bs, q_extend.device,
                               split_tokens=split_tokens, max_prefix_len=max_prefix_len, one_launch=one_launch)
        _CACHES.runners[key] = runner
    runner.max_bs = max(runner.max_bs, max_bs)  # only bounds checks: no scratch is sized by it
    return runner


def _small(t):
    """Shape, dtype and device of an optional metadata tensor."""
    return None if t is None else (t.shape, t.dtype, t.get_device())


def _signature(q, k, v, o, kb, vb, qo, kvp, kvi, cm, mi, sinks, last, offsets, scalars):
    """Everything the gate and the plan depend on, except kv_indices' length and tensor values
    (and addresses, but for whether an MLA head's V is a view of its K).

    Of the length, only whether the mean prefix passes ``SMALL_BATCH_MAX_PREFIX`` keys
    (it fixes the plan's tile: :meth:`VerifySplitKV.config`), counted as the plan counts it
    (:func:`splitkv.schedule.mean_prefix`). Written out flat: it runs on every eager call.
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
        # An MLA plan whose V is a view of K reads V from K's rows: a copy of V needs its own plan.
        (kb.data_ptr() == vb.data_ptr(), k.data_ptr() == v.data_ptr()) if kb.shape[-1] != vb.shape[-1] else None,
        None if cm is None else (_small(cm), _small(mi)),
        None if sinks is None else _small(sinks),
        None if last is None else _small(last),
        None if offsets is None else _small(offsets),
        scalars,
    )


def _plan_for(args, features, max_bs, split_tokens, max_prefix_len, return_lse, check, kv_last_page_len):
    """This thread's cached plan for a call, or the gate's reason to decline.

    ``args``: ``extend_attention_fwd``'s 15 positional arguments; ``features``: its keyword
    arguments as a tuple (sm_scale, logit_cap, skip_prefix_custom_mask, sliding_window_size,
    sinks, window_kv_offsets, xai_temperature_len); ``check``: the plan's kernel checks (a
    bool). A plan found in the cache is rebound to this call's metadata.
    """
    (q, k, v, o, kb, vb, qo, kvp, kvi, cm, is_causal, mi, max_len_extend, k_scale, v_scale) = args
    sm_scale, logit_cap, skip_prefix_custom_mask, window, sinks, offsets, xai_temperature_len = features
    scalars = (is_causal, max_len_extend, k_scale, v_scale, sm_scale, logit_cap, skip_prefix_custom_mask, window,
               xai_temperature_len, max_bs, split_tokens, max_prefix_len, return_lse, check)
    plans = _CACHES.plans
    try:
        key = _signature(q, k, v, o, kb, vb, qo, kvp, kvi, cm, mi, sinks, kv_last_page_len, offsets, scalars)
        plan = plans.get(key)  # hashing the key raises TypeError for an unhashable scalar
    except (AttributeError, TypeError):  # not tensors, or unhashable scalars: let the gate say why
        key = plan = None
    if plan is not None:
        plans.move_to_end(key)
        if isinstance(plan, VerifyPlan):
            try:
                # The key holds every tensor's device and dtype: the plan need not check them again.
                plan._rebind_same_signature(qo, kvp, kvi, cm, mi, sinks, kv_last_page_len, offsets)
            except LaunchLimitError as err:  # this step's length passes a limit: decline, as a new call would
                plan.release()
                return str(err)
        return plan
    reason = decline_reason(
        q, k, v, kb, vb, qo, kvp, kvi, max_len_extend=max_len_extend, custom_mask=cm, mask_indptr=mi,
        is_causal=is_causal, sliding_window_size=window, sinks=sinks, logit_cap=logit_cap,
        xai_temperature_len=xai_temperature_len, skip_prefix_custom_mask=skip_prefix_custom_mask,
        window_kv_offsets=offsets, k_scale=k_scale, v_scale=v_scale, sm_scale=sm_scale, o_extend=o,
        max_bs=max_bs, split_tokens=split_tokens, max_prefix_len=max_prefix_len, kv_last_page_len=kv_last_page_len,
    )
    if reason is None:
        runner = get_runner(q, k, v, max_len_extend, max_bs, split_tokens=split_tokens, max_prefix_len=max_prefix_len)
        try:
            plan = runner.plan(q, k, v, kb, vb, qo, kvp, kvi, custom_mask=cm, mask_indptr=mi, is_causal=is_causal,
                               sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale, sinks=sinks,
                               return_lse=return_lse, logit_cap=logit_cap, sliding_window_size=window,
                               window_kv_offsets=offsets, xai_temperature_len=xai_temperature_len,
                               kv_last_page_len=kv_last_page_len, check=check)
        except LaunchLimitError as err:
            plan = str(err)
    else:
        plan = reason
    if key is not None and isinstance(k_scale, (int, float)) and isinstance(v_scale, (int, float)):
        plans[key] = plan
        if len(plans) > PLAN_CACHE_SIZE:
            plans.popitem(last=False)
    return plan


def _check_values(args, kv_last_page_len) -> None:
    """The synchronous value checks (``check="full"``) for a call's positional arguments."""
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
    k_scale=1.0,
    v_scale=1.0,
    sm_scale=None,
    logit_cap=0.0,
    skip_prefix_custom_mask=True,
    sliding_window_size=-1,
    sinks=None,
    window_kv_offsets=None,
    xai_temperature_len=-1,
    *,
    kv_last_page_len=None,
    max_bs=None,
    split_tokens=None,
    max_prefix_len=None,
    check=None,
) -> bool:
    """Drop-in for ``extend_attention_fwd`` on the target-verify shape.

    Takes the same arguments in the same order. When :func:`splitkv.can_handle`
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
        is_causal: causal draft block when ``custom_mask`` is ``None`` (a bool).
        mask_indptr: ``None`` or ``[bs + 1]`` start of each sequence's mask.
        max_len_extend: most draft tokens of any sequence (an int).
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
        kv_last_page_len: ``[bs]`` rows used in each sequence's last page: the
            pools are paged (see :mod:`splitkv.paged`). Default: a token pool.
        max_bs: the largest batch this shape will see (default: this batch).
        split_tokens: a fixed slice length in tokens (a multiple of 128): the
            batch-invariant mode, where a sequence's output is bitwise the same
            whatever batch it runs in. Needs ``max_prefix_len``.
        max_prefix_len: with ``split_tokens``, the most prefix keys of any
            sequence (sizes the grid and its scratch: see :class:`VerifySplitKV`).
        check: ``True`` / ``"full"`` / ``False``, as for :func:`verify_attention`
            (default: ``SPLITKV_CHECK``: ``1``, ``full``, or unset).

    Returns:
        ``True`` if ``o_extend`` was written, ``False`` if the call was declined.

    Raises:
        TypeError: for arguments of the wrong type (``is_causal`` not a bool,
            ``mask_indptr`` not a tensor or ``None``, ...): a swapped argument.
        ValueError: for a bad ``split_tokens``/``max_prefix_len``; checked,
            for malformed metadata (:class:`splitkv.errors.VerifyError`) or
            input the gate finds malformed (unchecked, that is declined).
    """
    check_dropin_types(custom_mask, is_causal, mask_indptr, max_len_extend)
    check_batch_invariant(split_tokens, max_prefix_len)
    check = check_mode(_env_check() if check is None else check)
    args = (q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
            custom_mask, is_causal, mask_indptr, max_len_extend, k_scale, v_scale)
    features = (sm_scale, logit_cap, skip_prefix_custom_mask, sliding_window_size, sinks, window_kv_offsets,
                xai_temperature_len)
    bs = qo_indptr.shape[0] - 1 if isinstance(qo_indptr, torch.Tensor) else 0
    full = check == "full" and not _capturing()
    plan = _plan_for(args, features, max(max_bs or 1, bs), split_tokens, max_prefix_len, False, bool(check),
                     kv_last_page_len)
    if not isinstance(plan, VerifyPlan):
        if full and plan.startswith("malformed input"):
            _check_values(args, kv_last_page_len)  # name the bad sequence and field where the values say it
        if check and plan.startswith("malformed input"):
            raise ValueError(plan)
        return False
    if full:
        _check_values(args, kv_last_page_len)
    _launch(plan, args, bool(check))
    return True


def _launch(plan: VerifyPlan, args, checked: bool, lse=None) -> None:
    """Run a cached plan on a call's tensors (checked: raise the device's pending faults around it)."""
    (q, k, v, o, kb, vb) = args[:6]
    if checked:
        raise_pending(plan.device, plan._dev_index)
    try:
        # The plan's cache key fixed the tensors' devices, dtypes, shapes and strides: launch without
        # checking them again.
        plan._run(q, k, v, kb, vb, o, o if lse is None else lse)
    finally:
        plan.release()
    if checked:  # a read of host memory: safe inside a capture too
        raise_pending(plan.device, plan._dev_index)


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
    *,
    max_len_extend,
    custom_mask=None,
    mask_indptr=None,
    is_causal=True,
    k_scale=1.0,
    v_scale=1.0,
    sm_scale=None,
    logit_cap=0.0,
    skip_prefix_custom_mask=True,
    sliding_window_size=-1,
    sinks=None,
    window_kv_offsets=None,
    xai_temperature_len=-1,
    kv_last_page_len=None,
    max_bs=None,
    split_tokens=None,
    max_prefix_len=None,
    check=True,
    return_lse=False,
):
    """Verify attention that is always right: split-KV when it applies, else the baseline.

    The tensors up to ``kv_indices`` are positional (``o_extend`` may be
    ``None``: a new output is allocated); everything after is a keyword,
    named as in :func:`verify_splitkv_fwd`. Under ``torch.compile`` the call
    becomes the custom op ``torch.ops.splitkv.verify_attention`` (no graph
    break, no recompilation as prefixes grow once ``kv_indices`` is dynamic).

    Args:
        max_len_extend: most draft tokens of any sequence (required).
        check: ``True`` (default): the kernel validates the metadata as it
            reads it, at no host cost; a fault raises
            :class:`splitkv.errors.VerifyError` at this call or the next on the
            device, or at :func:`splitkv.check_device_errors`. ``"full"``: the
            same, after a synchronous check that reads the device (debugging;
            skipped during CUDA-graph capture). ``False``: no checks.
        return_lse: also return the natural-log LSE per (token, query head),
            ``[tokens, H_Q]`` float32 (the sinks included): the state
            :func:`splitkv.merge_states` merges. Needs the split path.
        kv_last_page_len: ``[bs]`` rows used in each sequence's last page, for
            paged pools. Where the split path declines a paged call, the
            baseline runs on the pool seen as a token pool (expanding the page
            table reads the device: not inside CUDA-graph capture).
        split_tokens, max_prefix_len: the batch-invariant mode (see :func:`verify_splitkv_fwd`).

    Returns:
        ``o_extend`` (or the new output), fully written for every draft row;
        ``(o, lse)`` with ``return_lse``.

    Raises:
        ValueError: on malformed input (mismatched devices, dtypes, ranks,
            head counts or head dims, CPU tensors outside the interpreter);
            :class:`splitkv.errors.VerifyError` (a ``ValueError``) for
            malformed metadata values when checked; from the baseline for
            scales held in CUDA tensors or ``xai_temperature_len == 1``.
        TypeError: for a ``check`` or ``is_causal`` of the wrong type.
        NotImplementedError: for calls neither path serves (head dims above
            256 that the split path declines), and ``return_lse`` for a call
            the split path declines.
    """
    features = (sm_scale, logit_cap, skip_prefix_custom_mask, sliding_window_size, sinks, window_kv_offsets,
                xai_temperature_len)
    if torch.compiler.is_compiling():
        return _compiled_call(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr,
                              kv_indices, max_len_extend, custom_mask, mask_indptr, is_causal, k_scale, v_scale,
                              features, kv_last_page_len, split_tokens, max_prefix_len, check, return_lse)
    check_mode(check)
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    check_batch_invariant(split_tokens, max_prefix_len)
    if o_extend is None:
        o_extend = torch.empty((q_extend.shape[0], q_extend.shape[1], v_extend.shape[2]),
                               dtype=q_extend.dtype, device=q_extend.device)
    args = (q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
            custom_mask, is_causal, mask_indptr, max_len_extend, k_scale, v_scale)
    full = check == "full" and not _capturing()
    bs = qo_indptr.shape[0] - 1 if isinstance(qo_indptr, torch.Tensor) else 0
    plan = _plan_for(args, features, max(max_bs or 1, bs), split_tokens, max_prefix_len, bool(return_lse),
                     bool(check), kv_last_page_len)
    if isinstance(plan, VerifyPlan):
        if full:
            _check_values(args, kv_last_page_len)
        lse = torch.empty(o_extend.shape[:2], dtype=torch.float32, device=o_extend.device) if return_lse else None
        _launch(plan, args, bool(check), lse)
        return (o_extend, lse) if return_lse else o_extend
    if plan.startswith("malformed input"):
        raise ValueError(plan)
    if return_lse:
        raise NotImplementedError(f"return_lse needs the split path, which declines this call: {plan}")
    return _baseline(args, features, kv_last_page_len, check)


def _baseline(args, features, kv_last_page_len, check):
    """The extend kernel, for a call the split path declines (checked: synchronously, before it runs)."""
    (q, k, v, o, kb, vb, qo, kvp, kvi, cm, is_causal, mi, max_len_extend, k_scale, v_scale) = args
    check_verify_inputs(q, k, v, o, kb, vb, qo, kvp, kvi, cm, mi, max_len_extend, features[4],
                        kv_last_page_len=kv_last_page_len)
    if check and not _capturing():
        _check_values(args, kv_last_page_len)
    if kv_last_page_len is not None:
        page_size = kb.shape[1]
        kvp, kvi = token_indices(kvp, kvi, kv_last_page_len, page_size)
        kb, vb = flat_pool(kb), flat_pool(vb)
    sm_scale, logit_cap, skip_prefix_custom_mask, window, sinks, offsets, xai_temperature_len = features
    extend_attention_fwd(q, k, v, o, kb, vb, qo, kvp, kvi, cm, is_causal, mi, max_len_extend, k_scale, v_scale,
                         sm_scale=sm_scale, logit_cap=logit_cap, skip_prefix_custom_mask=skip_prefix_custom_mask,
                         sliding_window_size=window, sinks=sinks, window_kv_offsets=offsets,
                         xai_temperature_len=xai_temperature_len)
    return o


def _compiled_call(q, k, v, o, kb, vb, qo, kvp, kvi, max_len_extend, cm, mi, is_causal, k_scale, v_scale,
                   features, kv_last_page_len, split_tokens, max_prefix_len, check, return_lse):
    """:func:`verify_attention` while ``torch.compile`` traces: the custom op (a compiled graph reads no
    device value, so ``check="full"`` runs the kernel's checks only)."""
    sm_scale, logit_cap, skip_prefix_custom_mask, window, sinks, offsets, xai_temperature_len = features
    out, lse = torch.ops.splitkv.verify_attention(
        q, k, v, kb, vb, qo, kvp, kvi, max_len_extend=max_len_extend, custom_mask=cm, mask_indptr=mi,
        is_causal=is_causal, k_scale=k_scale, v_scale=v_scale, sm_scale=sm_scale, logit_cap=logit_cap,
        skip_prefix_custom_mask=skip_prefix_custom_mask, sliding_window_size=window, sinks=sinks,
        window_kv_offsets=offsets, xai_temperature_len=xai_temperature_len, kv_last_page_len=kv_last_page_len,
        split_tokens=split_tokens, max_prefix_len=max_prefix_len, check=check is not False, return_lse=return_lse,
    )
    if o is not None:
        o.copy_(out)
        out = o
    return (out, lse) if return_lse else out
