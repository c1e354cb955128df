"""One call: :func:`cp_verify_attention`, and its per-thread cache of plans.

An eager call costs what Python does before the launches, so, as
:func:`splitkv.verify_attention` does on one GPU, plans
(:class:`~splitkv.parallel.ContextParallelPlan`) are cached by the call's
*signature* (:func:`_signature`): a call seen before only rebinds the step's
metadata, then runs the kernel, the all-gather and the merge. Plans hold a
step's bound metadata and their exchange buffers, which two threads must not
share, so each thread has its own cache (:class:`_Caches`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Optional

import torch

from ..schedule import mean_prefix
from ..resources import OutOfDeviceResources
from ..tuning import SMALL_BATCH_MAX_PREFIX
from ..options import VerifyOptions, split_options
from ..validate import check_call, check_values
from ..launch import capturing
from .group import DstType, group_info
from .plan import ContextParallelPlan, ContextParallelVerify

__all__ = ["cp_verify_attention", "clear_cp_caches"]

#: Most signatures a thread's plan cache keeps (least recently used dropped first).
CP_PLAN_CACHE_SIZE = 128


class _Caches(threading.local):
    """One thread's runners (by head configuration, group and ranks) and plans (by signature)."""

    def __init__(self):
        self.runners: "dict[tuple, ContextParallelVerify]" = {}
        self.plans: "OrderedDict[tuple, ContextParallelPlan]" = OrderedDict()


_CACHES = _Caches()


def clear_cp_caches() -> None:
    """Drop this thread's cached runners and plans (:func:`cp_verify_attention`'s)."""
    _CACHES.runners.clear()
    _CACHES.plans.clear()


def cp_verify_attention(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr,
                        kv_indices, *, group=None, draft_rank: int = 0, dst: DstType = None, **options):
    """Context-parallel verify attention in one call (every rank of ``group`` calls it).

    The arguments of :func:`splitkv.verify_attention` (the tensors up to
    ``kv_indices`` positional, ``o_extend`` may be ``None``; the options of
    :class:`splitkv.options.VerifyOptions` and the metadata tensors as keywords,
    ``check`` ``True`` by default), with this rank's prefix shard in
    ``k_buffer``/``v_buffer``/``kv_indptr``/``kv_indices`` (and, on
    ``draft_rank``, the mask laid out for it: :func:`~splitkv.parallel.shard_mask`).
    No sliding window or xai temperature (see :mod:`splitkv.parallel`);
    ``max_prefix_len`` bounds this rank's local prefixes. Give every rank the
    same options. Plans are cached per thread by signature (:func:`_signature`):
    a repeated call is graph-capturable once a call of its signature has run eagerly.

    Args:
        group, draft_rank, dst: see :class:`~splitkv.parallel.ContextParallelVerify`.

    Returns:
        On merging ranks ``o_extend`` (new if ``None``), or ``(o, lse)`` with
        ``return_lse``; ``None`` elsewhere.

    Raises:
        ValueError: on malformed input (and what the plan and its run raise).
        TypeError: for an unknown option, or a ``check`` or ``is_causal`` of the wrong type.
        NotImplementedError: for calls the split path declines (among them a kernel whose compile ran
            out of the device's resources: :class:`splitkv.resources.OutOfDeviceResources`).
    """
    opts, meta = split_options(options)
    rank, world = group_info(group)
    if rank != draft_rank:  # the mask belongs to the draft block: other ranks neither check nor bind it
        meta = dict(meta, custom_mask=None, mask_indptr=None)
    layer = (q_extend, k_extend, v_extend, k_buffer, v_buffer)
    indptrs = (qo_indptr, kv_indptr, kv_indices)
    dims = check_call((q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, *indptrs), meta, opts)
    cp, runner_key = _runner_for(dims, q_extend.device, int(opts.max_len_extend),
                                 max(opts.max_bs or 1, dims.batch_size), group=group, rank=rank, world_size=world,
                                 draft_rank=draft_rank, dst=dst, split_tokens=opts.split_tokens,
                                 max_prefix_len=opts.max_prefix_len)
    key = _signature(runner_key, layer, indptrs, meta, opts)
    plan = _plan_for(cp, key, layer, indptrs, meta, opts)
    try:
        return _run(plan, layer, o_extend, opts.return_lse)
    except OutOfDeviceResources:  # the next call of this signature is declined when it is planned
        _CACHES.plans.pop(key, None)
        raise


def _runner_for(dims, device, max_len_extend: int, max_bs: int, *, group, rank: int, world_size: int,
                draft_rank: int, dst: DstType, split_tokens: Optional[int],
                max_prefix_len: Optional[int]) -> "tuple[ContextParallelVerify, tuple]":
    """This thread's :class:`~splitkv.parallel.ContextParallelVerify` for a call, and its cache key.

    One per process group, rank, head configuration, draft length, batch-invariant
    mode and merging ranks. Its batch bound grows to the largest ``max_bs`` asked:
    it is made without a caller workspace, so only bounds checks read the bound.

    Args:
        dims: the call's dimensions (:func:`splitkv.validate.check_verify_inputs`).
        device: the draft tensors' device.
        max_len_extend, max_bs, group, draft_rank, dst, split_tokens, max_prefix_len:
            as for :func:`cp_verify_attention`.
        rank, world_size: this rank in ``group`` and the group's size.
    """
    dst_key = None if dst is None else (dst if isinstance(dst, int) else tuple(dst))
    key = (id(group), rank, world_size, str(device), dims.num_q_heads, dims.num_kv_heads, dims.head_dim,
           dims.v_head_dim, max_len_extend, split_tokens, max_prefix_len, draft_rank, dst_key)
    cp = _CACHES.runners.get(key)
    if cp is None:
        cp = _CACHES.runners[key] = ContextParallelVerify(
            dims.num_q_heads, dims.num_kv_heads, dims.head_dim, dims.v_head_dim, max_len_extend, max_bs, device,
            group=group, draft_rank=draft_rank, dst=dst, split_tokens=split_tokens, max_prefix_len=max_prefix_len)
    cp.runner.max_bs = max(cp.runner.max_bs, max_bs)
    return cp, key


def _signature(runner_key: tuple, layer: tuple, indptrs: tuple, meta: dict, opts: VerifyOptions) -> tuple:
    """Everything a plan depends on, except the metadata's lengths and values and the tensors' addresses.

    * the runner's key (:func:`_runner_for`);
    * the layer tensors' (``q/k/v_extend``, the pools) shapes, strides and dtypes;
    * the metadata's dtypes (``qo_indptr``'s shape: the batch), not their lengths,
      which change every step as prefixes grow: a cached plan rebinds them;
    * of ``kv_indices``' length, only whether this rank's mean prefix passes
      :data:`splitkv.tuning.SMALL_BATCH_MAX_PREFIX` keys, counted as the plan
      counts it (:func:`splitkv.schedule.mean_prefix`): it fixes the plan's tile;
    * for an MLA head (``Dv < D``), whether V is a view of K, in the pools and in
      the draft block: the plan then reads V from K's rows, so a copy needs its own plan;
    * the options.
    """
    q, k, v, kb, vb = layer
    qo, kvp, kvi = indptrs
    mask, sinks, last = meta["custom_mask"], meta["sinks"], meta["kv_last_page_len"]
    page_size = kb.shape[1] if kb.dim() == 4 else 1
    return (
        runner_key,
        tuple(t.shape for t in layer), tuple(t.stride() for t in layer), tuple(t.dtype for t in layer),
        qo.shape, qo.dtype, kvp.dtype, kvi.dtype,
        None if mask is None else (mask.dtype, meta["mask_indptr"].dtype),
        None if sinks is None else sinks.dtype,
        None if last is None else (last.shape, last.dtype),
        mean_prefix(kvi.shape[0], page_size, qo.shape[0] - 1) > SMALL_BATCH_MAX_PREFIX,
        (kb.data_ptr() == vb.data_ptr(), k.data_ptr() == v.data_ptr()) if kb.shape[-1] != vb.shape[-1] else None,
        opts,
    )


def _plan_for(cp: ContextParallelVerify, key: tuple, layer: tuple, indptrs: tuple, meta: dict,
              opts: VerifyOptions) -> ContextParallelPlan:
    """This thread's cached plan for ``key``, rebound to the call's metadata, or a new one (then cached).

    Args:
        cp: the call's runner (:func:`_runner_for`).
        key: the call's :func:`_signature`.
        layer, indptrs, meta, opts: the call's tensors, metadata and options.
    """
    plans = _CACHES.plans
    plan = plans.get(key)
    if plan is None:
        tensors = (*layer[:3], None, *layer[3:], *indptrs)
        plan = plans[key] = cp._plan(tensors, meta, opts)
        if len(plans) > CP_PLAN_CACHE_SIZE:
            plans.popitem(last=False)
        return plan
    plans.move_to_end(key)
    plan.rebind(*indptrs, **meta)
    if opts.check == "full" and not capturing(layer[0].device):  # a new plan checks the values itself
        check_values((*layer[:3], None, *layer[3:], *indptrs), meta, opts)
    return plan


def _run(plan: ContextParallelPlan, layer: tuple, o_extend, return_lse: bool):
    """Run ``plan`` on the call's layer tensors; what :func:`cp_verify_attention` returns."""
    if not plan.merges:
        plan.run(*layer)
        return None
    if o_extend is None:
        o_extend = torch.empty(plan.out_shape, dtype=plan.dtype, device=plan.device)
    lse = torch.empty(plan.out_shape[:2], dtype=torch.float32, device=plan.device) if return_lse else None
    out = plan.run(*layer, out=o_extend, lse=lse)
    return (out, lse) if return_lse else out
