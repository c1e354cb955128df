"""Public entry points: the drop-in and the always-right production entry.

* :func:`verify_splitkv_fwd` takes ``extend_attention_fwd``'s positional
  arguments; it runs the split-KV path and returns ``True``, or returns
  ``False`` having written nothing, so the caller falls back.
* :func:`verify_attention` is for callers that want one call that is always
  right: it raises ``ValueError`` on malformed calls, has the kernel validate
  the metadata (by default), runs the split path when the gate allows and the
  baseline otherwise, can return the LSE, and under ``torch.compile`` becomes
  the custom op ``torch.ops.splitkv.verify_attention``.

Both translate their arguments into the call's tensors, its metadata tensors
and its :class:`splitkv.options.VerifyOptions`, then share one path:

    signature -> cached plan (or the gate's decline) -> bind the step's metadata -> launch

The host path. An eager call costs what Python does before the launch, so
both entries keep a cache of plans (:class:`splitkv.plan.VerifyPlan`) keyed
by the call's *signature*: every tensor's shape, strides, dtype and device
except the lengths that change every step (``kv_indices``'s as prefixes grow,
a tree mask's; of ``kv_indices``'s length only whether the mean prefix
exceeds :data:`splitkv.tuning.SMALL_BATCH_MAX_PREFIX` counts, since it picks
the plan's tile), and the options. A signature seen before was already
checked by the gate and planned; the call only binds its metadata to a step
of that plan (re-checking the launch limits, which depend on the length) and
launches. A new signature goes through the gate (:func:`splitkv.gate.decline`)
and is planned once. Cached plans hold no step; each thread has its own cache
all the same (a plan learns its compiled launchers as it goes).

Faults. Every launch reports what its kernel found in its own slot of the
device's fault log, and every call raises what is pending before and after it
launches (:mod:`splitkv.errors` states the contract). ``check="full"``
(``SPLITKV_CHECK=full`` for the drop-in) also runs
:func:`splitkv.validate.check_verify_values` first, which reads the device
and names every kind of fault at once; it is skipped while the stream is
being captured into a CUDA graph.
"""

from __future__ import annotations

import itertools
import threading
from typing import Dict, Optional, Tuple, Union

import torch

from .extend import extend_attention_fwd
from .gate import Decline, admit
from .launch import capturing
from .options import VerifyOptions, batch_view, check_from_env, split_options
from .paged import flat_pool, token_indices
from .plan import VerifyPlan, VerifySplitKV
from .resources import OutOfDeviceResources
from .schedule import LaunchLimitError, TilePlan, mean_prefix
from .tuning import SMALL_BATCH_MAX_PREFIX
from .validate import check_values, check_verify_inputs

__all__ = ["verify_splitkv_fwd", "verify_attention", "get_runner", "clear_caches"]

#: Most signatures a thread's plan cache keeps (least recently used dropped first).
PLAN_CACHE_SIZE = 512


class _Caches(threading.local):
    """One thread's runners (by head configuration) and plans (by signature: ``[a plan or a decline, when it
    was last used]``; a hit only stamps its entry, which costs no second hash of the signature)."""

    def __init__(self):
        self.runners: dict = {}
        self.plans: "Dict[tuple, list]" = {}
        self.uses = itertools.count()


_CACHES = _Caches()


def clear_caches() -> None:
    """Drop this thread's cached runners and plans (their counters stay: graphs may use them)."""
    _CACHES.runners.clear()
    _CACHES.plans.clear()


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


def _signature(tensors: tuple, meta: dict, opts: VerifyOptions) -> tuple:
    """Everything the gate and the plan depend on, except the lengths that change every step and tensor
    values (and addresses, but for whether an MLA head's V is a view of its K).

    Of ``kv_indices``' length, only whether the mean prefix passes ``SMALL_BATCH_MAX_PREFIX`` keys
    (it fixes the plan's tile: :meth:`VerifySplitKV.config`), counted as the plan counts it
    (:func:`splitkv.schedule.mean_prefix`). Written out flat: it runs on every eager call.
    """
    q, k, v, o, kb, vb, qo, kvp, kvi = tensors
    cm, mi, sinks = meta["custom_mask"], meta["mask_indptr"], meta["sinks"]
    offsets, last = meta["window_kv_offsets"], meta["kv_last_page_len"]
    kb_shape, vb_shape, qo_shape, kvi_shape = kb.shape, vb.shape, qo.shape, kvi.shape  # each read costs
    return (
        q.shape, q.stride(), q.dtype, q.get_device(),
        k.shape, k.stride(), k.dtype, k.get_device(),
        v.shape, v.stride(), v.dtype, v.get_device(),
        o.shape, o.stride(), o.dtype, o.get_device(),
        kb_shape, kb.stride(), kb.dtype, kb.get_device(),
        vb_shape, vb.stride(), vb.dtype, vb.get_device(),
        qo_shape, qo.dtype, qo.get_device(), kvp.shape, kvp.dtype, kvp.get_device(),
        len(kvi_shape), kvi.dtype, kvi.get_device(),
        mean_prefix(kvi_shape[0], kb_shape[1] if len(kb_shape) == 4 else 1, qo_shape[0] - 1) > SMALL_BATCH_MAX_PREFIX,
        # An MLA plan whose V is a view of K reads V from K's rows: a copy of V needs its own plan.
        (kb.data_ptr() == vb.data_ptr(), k.data_ptr() == v.data_ptr()) if kb_shape[-1] != vb_shape[-1] else None,
        # The optional tensors: their shapes, but a tree mask's length, which grows with the prefixes.
        None if cm is None else (cm.dim(), cm.dtype, cm.get_device()),
        None if mi is None else (mi.shape, mi.dtype, mi.get_device()),
        None if sinks is None else (sinks.shape, sinks.dtype, sinks.get_device()),
        None if offsets is None else (offsets.shape, offsets.dtype, offsets.get_device()),
        None if last is None else (last.shape, last.dtype, last.get_device()),
        opts,
    )


def _plan_for(tensors: tuple, meta: dict, opts: VerifyOptions):
    """This thread's cached plan for a call, the call's step bound to it (or the gate's decline and
    ``None``), and the cache key (``None``: not cacheable)."""
    caches = _CACHES
    plans = caches.plans
    try:
        key = _signature(tensors, meta, opts)
        entry = plans.get(key)  # hashing the key raises TypeError for an unhashable option
    except (AttributeError, TypeError):  # not tensors, or unhashable options: let the gate say why
        key = entry = None
    if entry is not None:
        entry[1] = next(caches.uses)
        plan = entry[0]
        if not isinstance(plan, VerifyPlan):
            return plan, None, key
        try:
            # The key holds every tensor's device and dtype: the step need not check them again.
            return plan, plan._bind(tensors[6], tensors[7], tensors[8], meta, check=False), key
        except LaunchLimitError as err:  # this step's length passes a limit: decline, as a new call would
            return Decline(str(err)), None, key
    found = admit(tensors, meta, opts)
    plan = found if isinstance(found, Decline) else _new_plan(tensors, meta, opts, found)
    step = None
    if isinstance(plan, VerifyPlan):
        step = plan.step
        plan.release()  # a cached plan holds no step's tensors
    if not opts.cacheable:
        key = None
    if key is not None:
        _cache(key, plan)
    return plan, step, key


def _cache(key: tuple, plan: Union[VerifyPlan, Decline]) -> None:
    """Keep ``plan`` for signature ``key`` in this thread's cache, dropping the least recently used past
    :data:`PLAN_CACHE_SIZE`."""
    plans = _CACHES.plans
    plans[key] = [plan, next(_CACHES.uses)]
    if len(plans) > PLAN_CACHE_SIZE:
        del plans[min(plans, key=lambda k: plans[k][1])]


def _new_plan(tensors: tuple, meta: dict, opts: VerifyOptions, tile: TilePlan) -> Union[VerifyPlan, Decline]:
    """A plan for a call the gate accepted (inputs checked) with the tile it checked, or the launch limit
    it passes."""
    q, k, v = tensors[:3]
    max_bs = max(opts.max_bs or 1, tensors[6].shape[0] - 1)
    runner = get_runner(q, k, v, opts.max_len_extend, max_bs, split_tokens=opts.split_tokens,
                        max_prefix_len=opts.max_prefix_len)
    try:
        return VerifyPlan(runner, tensors, meta, opts, tile=tile)
    except LaunchLimitError as err:
        return Decline(str(err))


def _serve(tensors: tuple, meta: dict, opts: VerifyOptions) -> Tuple[Optional[Decline], Optional[torch.Tensor]]:
    """The split path for a call: ``(None, lse)`` when it ran (``lse`` with ``return_lse``), else
    ``(the decline, None)``, having written nothing.

    A kernel whose compile runs out of the device's resources (a tile the shared-memory model
    under-estimated) is declined, for this call and for every later call of its signature.
    """
    plan, step, key = _plan_for(tensors, meta, opts)
    if not isinstance(plan, VerifyPlan):
        return plan, None
    if opts.check == "full" and not capturing(tensors[0].device):
        check_values(tensors, meta, opts)
    q, k, v, o, kb, vb = tensors[:6]
    lse = torch.empty(o.shape[:2], dtype=torch.float32, device=o.device) if opts.return_lse else None
    try:
        # The plan's cache key fixed the tensors' devices, dtypes, shapes and strides: no check again.
        plan._run(step, q, k, v, kb, vb, o, o if lse is None else lse)
    except OutOfDeviceResources as err:
        found = Decline(str(err))
        if key is not None:
            _cache(key, found)
        return found, None
    return None, lse


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

    Takes the same arguments in the same order (they mean what
    :class:`splitkv.options.VerifyOptions` and :data:`splitkv.options.METADATA`
    say). When :func:`splitkv.can_handle` accepts the call, runs split-KV
    attention, writes ``o_extend`` and returns ``True``; otherwise returns
    ``False`` and writes nothing, and the caller runs ``extend_attention_fwd``.
    Never reads device values unless ``check="full"`` (CUDA-graph safe).

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
        custom_mask, mask_indptr, sinks, window_kv_offsets, kv_last_page_len: the
            metadata tensors (:data:`splitkv.options.METADATA`).
        is_causal, max_len_extend, k_scale, v_scale, sm_scale, logit_cap,
            skip_prefix_custom_mask, sliding_window_size, xai_temperature_len,
            max_bs, split_tokens, max_prefix_len: :class:`splitkv.options.VerifyOptions`.
        check: as in :class:`~splitkv.options.VerifyOptions`; default ``SPLITKV_CHECK``
            (``0/false/off/no`` or unset: off, ``1/true/on/yes``: on, ``full``).

    Returns:
        ``True`` if ``o_extend`` was written, ``False`` if the call was declined.

    Raises:
        TypeError: for arguments of the wrong type (``is_causal`` not a bool,
            ``custom_mask``/``mask_indptr`` not a tensor or ``None``, ...): a swapped argument.
        ValueError: for a bad ``SPLITKV_CHECK``; checked, for input the gate finds
            malformed (unchecked, that is declined);
            :class:`splitkv.errors.VerifyError` for a fault a kernel reported.
    """
    for name, t in (("custom_mask", custom_mask), ("mask_indptr", mask_indptr)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor or None, got {type(t).__name__}")
    scalars = (max_len_extend, is_causal, k_scale, v_scale, sm_scale, logit_cap, skip_prefix_custom_mask,
               sliding_window_size, xai_temperature_len, max_bs, split_tokens, max_prefix_len,
               check_from_env() if check is None else check)
    opts = _dropin_options(scalars)
    meta = dict(custom_mask=custom_mask, mask_indptr=mask_indptr, sinks=sinks, window_kv_offsets=window_kv_offsets,
                kv_last_page_len=kv_last_page_len)
    kv_indptr, meta = batch_view(qo_indptr, kv_indptr, meta)
    tensors = (q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices)
    declined, _ = _serve(tensors, meta, opts)
    if declined is None:
        return True
    if declined.malformed and opts.check:
        if opts.check == "full" and not capturing(q_extend.device):
            check_values(tensors, meta, opts)  # name the bad sequence and field where the values say it
        raise ValueError(declined.reason)
    return False


#: The drop-in's options by its scalar arguments (a memo: an eager call need not build them again).
_DROPIN_OPTIONS: dict = {}


def _dropin_options(scalars: tuple) -> VerifyOptions:
    """:class:`VerifyOptions` of the drop-in's scalar arguments (in :class:`VerifyOptions`' order), checked.

    Arguments whose type :meth:`VerifyOptions.checked` refuses compare equal to ones it takes
    (``1 == True``), so only those of the checked types are looked up in the memo.
    """
    max_len_extend, is_causal, check = scalars[0], scalars[1], scalars[-1]
    typed = type(max_len_extend) is int and type(is_causal) is bool and (check is True or check is False
                                                                          or check == "full")
    try:
        opts = _DROPIN_OPTIONS.get(scalars) if typed else None
    except TypeError:  # an unhashable argument: checked (or served) without the memo
        return VerifyOptions(*scalars).checked()
    if opts is None:
        opts = VerifyOptions(*scalars).checked()
        if typed:
            if len(_DROPIN_OPTIONS) >= PLAN_CACHE_SIZE:
                _DROPIN_OPTIONS.clear()
            _DROPIN_OPTIONS[scalars] = opts
    return opts


def verify_attention(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
                     **options):
    """Verify attention that is always right: split-KV when it applies, else the baseline.

    The tensors up to ``kv_indices`` are positional (``o_extend`` may be
    ``None``: a new output is allocated); everything after is a keyword:
    :class:`splitkv.options.VerifyOptions` (``max_len_extend`` required;
    ``check`` defaults to ``True``) and the metadata tensors of
    :data:`splitkv.options.METADATA`. Under ``torch.compile`` the call
    becomes the custom op ``torch.ops.splitkv.verify_attention`` (no graph
    break, no recompilation as prefixes grow once ``kv_indices`` is dynamic).

    Where the split path declines a paged call, the baseline runs on the pool
    seen as a token pool (expanding the page table reads the device: not
    inside CUDA-graph capture).

    Returns:
        ``o_extend`` (or the new output), fully written for every draft row;
        ``(o, lse)`` with ``return_lse`` (natural-log LSE per token and query
        head, ``[tokens, H_Q]`` float32, the sinks included).

    Raises:
        ValueError: on malformed input (mismatched devices, dtypes, ranks,
            head counts or head dims, CPU tensors outside the interpreter);
            :class:`splitkv.errors.VerifyError` (a ``ValueError``) for a fault a
            kernel reported; from the baseline for scales held in CUDA tensors.
        TypeError: for an unknown keyword, or a ``check`` or ``is_causal`` of the wrong type.
        NotImplementedError: for calls neither path serves (head dims above
            256 that the split path declines), and ``return_lse`` for a call
            the split path declines.
    """
    if torch.compiler.is_compiling():
        return _compiled_call(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr,
                              kv_indices, options)
    opts, meta = split_options(options)
    kv_indptr, meta = batch_view(qo_indptr, kv_indptr, meta)
    if o_extend is None:
        o_extend = torch.empty((q_extend.shape[0], q_extend.shape[1], v_extend.shape[2]),
                               dtype=q_extend.dtype, device=q_extend.device)
    tensors = (q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices)
    declined, lse = _serve(tensors, meta, opts)
    if declined is None:
        return (o_extend, lse) if opts.return_lse else o_extend
    if declined.malformed:
        raise ValueError(declined.reason)
    if opts.return_lse:
        raise NotImplementedError(f"return_lse needs the split path, which declines this call: {declined.reason}")
    return _baseline(tensors, meta, opts)


def _baseline(tensors: tuple, meta: dict, opts: VerifyOptions):
    """The extend kernel, for a call the split path declines (checked: synchronously, before it runs)."""
    q, k, v, o, kb, vb, qo, kvp, kvi = tensors
    # The gate may have declined before it checked the tensors (a mask on the prefix, scales in tensors).
    check_verify_inputs(*tensors, meta["custom_mask"], meta["mask_indptr"], opts.max_len_extend, meta["sinks"],
                        kv_last_page_len=meta["kv_last_page_len"])
    if opts.check and not capturing(q.device):
        check_values(tensors, meta, opts)
    last = meta["kv_last_page_len"]
    if last is not None:
        kvp, kvi = token_indices(kvp, kvi, last, kb.shape[1])
        kb, vb = flat_pool(kb), flat_pool(vb)
    extend_attention_fwd(q, k, v, o, kb, vb, qo, kvp, kvi, meta["custom_mask"], opts.is_causal, meta["mask_indptr"],
                         opts.max_len_extend, opts.k_scale, opts.v_scale, sm_scale=opts.sm_scale,
                         logit_cap=opts.logit_cap, skip_prefix_custom_mask=opts.skip_prefix_custom_mask,
                         sliding_window_size=opts.sliding_window_size, sinks=meta["sinks"],
                         window_kv_offsets=meta["window_kv_offsets"], xai_temperature_len=opts.xai_temperature_len)
    return o


def _compiled_call(q, k, v, o, kb, vb, qo, kvp, kvi, options: dict):
    """:func:`verify_attention` while ``torch.compile`` traces: the custom op (a compiled graph reads no
    device value, so ``check="full"`` runs the kernel's checks only)."""
    options = dict(options, check=options.get("check", True) is not False)
    out, lse = torch.ops.splitkv.verify_attention(q, k, v, kb, vb, qo, kvp, kvi, **options)
    if o is not None:
        o.copy_(out)
        out = o
    return (out, lse) if options.get("return_lse", False) else out
