"""Runner and plan: work out a verify launch once, then only launch.

A :class:`VerifySplitKV` is made once per head configuration (query/KV heads,
head dims, most draft tokens). Its :meth:`~VerifySplitKV.plan` takes one
step's metadata (``qo_indptr``, ``kv_indptr``, ``kv_indices``, the mask, the
scales) and the layout of the step's tensors, checks them, and fixes
everything that does not change from layer to layer: the split count, the
tile shape, the grid, the kernel's integer and constexpr arguments, the
compiled kernel. :meth:`VerifyPlan.run` then takes a layer's tensors and
launches, with almost no Python in between. This is the shape of
FlashInfer's wrappers: plan once per step, run once per layer.

Scratch (partials and counters) is :mod:`splitkv.workspace`'s; the launch's
arithmetic (split count, grid, merge mode, limits) is :mod:`splitkv.schedule`'s.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch

from . import workspace as _ws
from .errors import error_word, raise_pending
from .kernels.common import LOG2E
from .kernels.merge import _merge_kernel
from .kernels.verify import _verify_kernel
from .launch import Launcher, _specialization, alignment_bits
from .resources import device_shared_memory, fit_tile, rope_dim, shared_memory_reason, shares_rows
from .schedule import (GRID_COUNTERS, MAX_GRID_SPLITS, MAX_SPLITS, MERGE_PROGRAMS, SEPARATE_MERGE, SPIN_LIMIT,
                       LaunchLimitError, TileConfig, block_m_for, cdiv, choose_n_splits, device_sm_count,
                       element_size, fixed_n_splits, grid_merge_block, grid_merge_rows, head_tiles, launch_block_m,
                       launch_limit_reason, mean_prefix, merge_chunks, merge_launch_block, merge_mode, merge_unroll,
                       min_split_for, next_pow2, one_wave_n_splits, pool_offsets_32, rows_per_tile, tile_config,
                       workspace_bytes)
from .tuning import min_split_tokens, programs_per_sm, small_batch_tile
from .validate import (check_batch_invariant, check_features, check_mode, check_output, check_verify_inputs,
                       check_verify_values, interpreting)

__all__ = ["VerifySplitKV", "VerifyPlan", "workspace_bytes"]


class VerifySplitKV:
    """Split-KV verify attention for one head configuration.

    Args:
        num_q_heads: query heads.
        num_kv_heads: KV heads (divides ``num_q_heads``).
        head_dim: query/key head dimension.
        v_head_dim: value head dimension.
        max_len_extend: most draft tokens per sequence.
        max_bs: most sequences per call (bounds the workspace and the gate's
            launch-limit checks).
        device: where the kernels run.
        num_sms: SMs the split chooser plans for (default: the device's).
        pack_gqa: one program per KV head with all its query heads as tile
            rows (reads each prefix byte once). ``False`` gives the seed's
            one-program-per-query-head layout, kept for teaching and benchmarks.
        config: kernel tile shape (default: :func:`splitkv.schedule.tile_config`).
        n_splits: a fixed grid of prefix slices for every call (default: the
            adaptive chooser, :func:`splitkv.choose_n_splits`).
        split_tokens: a fixed slice length in tokens, a multiple of 128
            (batch-invariant mode: a sequence's output is then bitwise the same
            in any batch). Needs ``max_prefix_len``.
        max_prefix_len: with ``split_tokens``, the most keys of any
            sequence's prefix: the grid has ``cdiv(max_prefix_len,
            split_tokens)`` slices, and the scratch is sized for them
            (:func:`workspace_bytes`), whatever the batch's total. A longer
            prefix is still exact, but not batch-invariant (the checked mode
            reports it).
        workspace: caller-owned zeroed bytes of at least :func:`workspace_bytes`
            (default: per-call allocation, see the module docstring).
        one_launch: merge in the verify launch (default): by the tile's last
            program, or by merge programs in the same grid (:func:`merge_mode`).
            ``False`` always merges in a second launch, which needs no counters.

    Calling the runner plans and runs in one go; see :meth:`plan` to reuse a plan.
    """

    def __init__(
        self,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        v_head_dim: int,
        max_len_extend: int,
        max_bs: int,
        device=None,
        *,
        num_sms: Optional[int] = None,
        pack_gqa: bool = True,
        config: Optional[TileConfig] = None,
        n_splits: Optional[int] = None,
        split_tokens: Optional[int] = None,
        max_prefix_len: Optional[int] = None,
        workspace: Optional[torch.Tensor] = None,
        one_launch: bool = True,
    ):
        if num_kv_heads < 1 or num_q_heads % num_kv_heads:
            raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
        if max_len_extend < 1 or max_bs < 1:
            raise ValueError("max_len_extend and max_bs must be positive")
        if n_splits is not None and not 1 <= n_splits <= MAX_GRID_SPLITS:
            raise ValueError(f"n_splits must be in [1, {MAX_GRID_SPLITS}], got {n_splits}")
        if n_splits is not None and split_tokens is not None:
            raise ValueError("give n_splits or split_tokens, not both")
        check_batch_invariant(split_tokens, max_prefix_len)
        self.num_q_heads, self.num_kv_heads = num_q_heads, num_kv_heads
        self.head_dim, self.v_head_dim = head_dim, v_head_dim
        self.max_len_extend, self.max_bs = max_len_extend, max_bs
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.num_sms = num_sms if num_sms is not None else device_sm_count(self.device)
        self.pack_gqa = pack_gqa
        self.heads_per_tile = num_q_heads // num_kv_heads if pack_gqa else 1
        self._config = config
        #: rows per tile (a small launch may cut them: :meth:`block_m_for_batch`)
        self.block_m = config.block_m if config else block_m_for(rows_per_tile(self.heads_per_tile, max_len_extend))
        #: programs per sequence and slice at ``block_m`` rows (KV heads x row blocks)
        self.head_tiles = head_tiles(num_q_heads, num_kv_heads, max_len_extend, self.block_m, pack_gqa)
        self.fixed_n_splits = n_splits
        self.split_tokens = split_tokens
        #: batch-invariant mode: the most keys any sequence's prefix holds (the grid's slices cover it)
        self.max_prefix_len = max_prefix_len
        #: where the kernel reports faults (:mod:`splitkv.errors`)
        self.error_word = error_word(self.device)
        self.workspace = workspace
        self._workspace: Optional[_ws.Workspace] = None
        self.one_launch = one_launch
        if workspace is not None:
            need = workspace_bytes(num_q_heads, num_kv_heads, v_head_dim, max_len_extend, max_bs,
                                   self._max_splits(), pack_gqa=pack_gqa, block_m=self.block_m)
            if workspace.device.type != self.device.type or workspace.numel() * workspace.element_size() < need:
                raise ValueError(f"workspace must hold {need} bytes on {self.device}")
            self._workspace = _ws.Workspace(workspace, max_bs * self.head_tiles)
        self._launchers: Dict[tuple, Launcher] = {}

    def _head_tiles(self, block_m: int) -> int:
        """Tiles per sequence at ``block_m`` rows (KV heads x row blocks)."""
        return head_tiles(self.num_q_heads, self.num_kv_heads, self.max_len_extend, block_m, self.pack_gqa)

    def block_m_for_batch(self, batch_size: Optional[int]) -> int:
        """Rows per tile for a call of ``batch_size`` sequences (:func:`splitkv.schedule.launch_block_m`).

        The runner's own where the rows are fixed: a custom tile, a fixed split
        count, the batch-invariant mode (its bits must not depend on the
        batch), or a caller's workspace with fewer counters than the cut
        tiles would need.
        """
        if (batch_size is None or self._config is not None or self.fixed_n_splits is not None
                or self.split_tokens is not None):
            return self.block_m
        block_m = launch_block_m(self.block_m, lambda b: batch_size * self._head_tiles(b), self.num_sms)
        if self._workspace is not None and batch_size * self._head_tiles(block_m) > self._workspace.tiles:
            return self.block_m
        return block_m

    def _max_splits(self) -> int:
        if self.fixed_n_splits is not None:
            return self.fixed_n_splits
        if self.split_tokens is not None:
            return fixed_n_splits(self.max_prefix_len, self.split_tokens)
        return MAX_SPLITS

    def _small_batch(self, batch_size: Optional[int], kv_dtype: torch.dtype, prefix_len: int):
        """The small-launch tile for ``batch_size`` sequences, or ``None`` (see :mod:`splitkv.schedule`)."""
        if (batch_size is None or self._config is not None or self.fixed_n_splits is not None
                or self.split_tokens is not None or interpreting()):
            return None
        block_m = self.block_m_for_batch(batch_size)
        return small_batch_tile(max(self.head_dim, self.v_head_dim), block_m, element_size(kv_dtype),
                                batch_size * self._head_tiles(block_m), self.num_sms, prefix_len)

    def config(self, kv_dtype: torch.dtype, batch_size: Optional[int] = None, prefix_len: int = 0,
               page_size: int = 1, q_dtype: Optional[torch.dtype] = None, kv_shared: bool = False) -> TileConfig:
        """The tile shape for a pool of ``kv_dtype`` in pages of ``page_size`` keys (1: a token pool),
        queries of ``q_dtype`` (default: bf16 for fp8 pools, else the pool's), and a batch of
        ``batch_size`` sequences of about ``prefix_len`` keys, if given; ``kv_shared``: the value
        pool is a view of the key pool (MLA, :func:`splitkv.resources.shares_rows`).

        The tuned tile, shrunk where it would not fit the device's shared memory
        (:func:`splitkv.resources.fit_tile`: wide heads the table has no entry for).

        Raises:
            ValueError: when no tile fits (the gate declines such calls first).
        """
        if self._config is not None:
            return self._config
        block_m = self.block_m_for_batch(batch_size)
        small = self._small_batch(batch_size, kv_dtype, prefix_len)
        if small is not None:
            cfg = TileConfig(block_m, *small)
        else:
            cfg = tile_config(self.head_dim, self.v_head_dim, rows_per_tile(self.heads_per_tile, self.max_len_extend),
                              interpreting(), kv_bytes=element_size(kv_dtype), page_size=page_size,
                              block_m=block_m)
        if q_dtype is None:
            q_dtype = torch.bfloat16 if element_size(kv_dtype) == 1 else kv_dtype
        limit = device_shared_memory(self.device)
        fitted = fit_tile(cfg, self.head_dim, self.v_head_dim, kv_dtype, q_dtype, limit, page_size,
                          self.max_len_extend, kv_shared)
        if fitted is None:
            raise ValueError(shared_memory_reason(cfg, self.head_dim, self.v_head_dim, kv_dtype, q_dtype, limit,
                                                  page_size, self.max_len_extend, kv_shared))
        return fitted

    def n_splits(self, batch_size: int, prefix_len: int, kv_dtype: torch.dtype = torch.bfloat16,
                 small: Optional[bool] = None, page_size: int = 1, block_n: Optional[int] = None) -> int:
        """Grid slices for a batch (static shapes only).

        Args:
            batch_size: sequences in the call.
            prefix_len: representative prefix length (``kv_indices.shape[0] // batch_size``).
            kv_dtype: the pool's dtype (fp8 pools may tile differently).
            small: whether the launch runs the small-launch tile (a plan fixes
                it when made); default: as :meth:`config` decides for
                ``batch_size`` and ``prefix_len``.
            page_size: keys per page of a paged pool (1: a token pool); its
                tile may hold a different number of programs per SM.
            block_n: the launch's key tile (default: :meth:`config`'s), to which
                slices are rounded.

        Returns:
            The fixed count if one was given; in the batch-invariant mode
            ``cdiv(max_prefix_len, split_tokens)``; else
            :func:`splitkv.choose_n_splits`'s.
        """
        if self.fixed_n_splits is not None:
            return self.fixed_n_splits
        if self.split_tokens is not None:
            return self._max_splits()
        if small is None:
            small = self._small_batch(batch_size, kv_dtype, prefix_len) is not None
        if block_n is None:
            block_n = self.config(kv_dtype, batch_size, prefix_len, page_size).block_n
        block_m = self.block_m_for_batch(batch_size)
        if small:
            return one_wave_n_splits(batch_size * self._head_tiles(block_m), prefix_len, self.num_sms,
                                     min_split_tokens=min_split_tokens(), block_n=block_n)
        kv_bytes = element_size(kv_dtype)
        return choose_n_splits(
            batch_size, self._head_tiles(block_m), prefix_len, self.num_sms,
            programs_per_sm=programs_per_sm(max(self.head_dim, self.v_head_dim), block_m, kv_bytes, page_size),
            min_split_tokens=min_split_tokens(), block_n=block_n,
        )

    def plan(
        self,
        q_extend, k_extend, v_extend, k_buffer, v_buffer,
        qo_indptr, kv_indptr, kv_indices, *,
        custom_mask=None, mask_indptr=None, is_causal: bool = True,
        sm_scale: Optional[float] = None, k_scale: float = 1.0, v_scale: float = 1.0,
        sinks=None, return_lse: bool = False, attend_draft: bool = True, check=False,
        logit_cap: float = 0.0, sliding_window_size: int = -1, window_kv_offsets=None,
        xai_temperature_len: int = -1, kv_last_page_len=None,
    ) -> "VerifyPlan":
        """Check one step's inputs and fix its launch.

        The tensors given are those of one layer; :meth:`VerifyPlan.run` takes
        any layer's tensors of the same shapes, dtypes and strides. The
        metadata tensors (indptrs, indices, mask, sinks) are bound to the plan:
        their *values* may change between runs (a graph replay with new
        lengths), not their addresses or sizes.

        Everything after ``kv_indices`` is a keyword.

        Args:
            q_extend, k_extend, v_extend, k_buffer, v_buffer, qo_indptr,
            kv_indptr, kv_indices, custom_mask, mask_indptr: as for
                :func:`splitkv.verify_splitkv_fwd`.
            is_causal: causal draft block when there is no ``custom_mask`` (a bool).
            sm_scale: softmax scale (default ``1/sqrt(head_dim)``).
            k_scale: key-pool multiplier (Python number).
            v_scale: value-pool multiplier (Python number).
            sinks: optional ``[H_Q]`` sink logits.
            return_lse: also write the natural-log LSE per (token, query head).
            attend_draft: ``False`` attends to the prefix only (a context-parallel
                shard that does not own the draft block).
            check: ``True``: the kernel validates the metadata of every run and
                :meth:`VerifyPlan.run` raises what it found (:mod:`splitkv.errors`);
                ``"full"``: that, and the values are checked on the host now
                (:func:`splitkv.validate.check_verify_values`, which reads the device:
                skipped while the stream is being captured); ``False``: neither.
            logit_cap: if ``> 0``, scores ``s`` become ``cap * tanh(s / cap)``.
            sliding_window_size: if ``> 0``, the query at position ``p`` sees keys
                at positions ``>= p - sliding_window_size``; only the slices that
                hold such keys are read.
            window_kv_offsets: ``[bs]`` column offsets of each sequence's
                ``custom_mask`` rows (as in ``extend_attention_fwd``; used only
                with a ``custom_mask``).
            xai_temperature_len: if ``> 0``, scores of the query at position
                ``p > len`` are multiplied by ``log2(p) / log2(len)``.
            kv_last_page_len: ``[bs]`` int32, for a paged pool (``k_buffer`` and
                ``v_buffer`` of shape ``[pages, page_size, H_KV, D]``; ``kv_indptr``
                and ``kv_indices`` then describe page ids): the rows used in each
                sequence's last page (see :mod:`splitkv.paged`).

        Raises:
            ValueError: on malformed input or shapes this runner was not built for.
            TypeError: for an ``is_causal`` or ``check`` of the wrong type.
        """
        if not isinstance(is_causal, bool):
            raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
        check_mode(check)
        dims = check_verify_inputs(
            q_extend, k_extend, v_extend, None, k_buffer, v_buffer,
            qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, self.max_len_extend, sinks,
            kv_last_page_len=kv_last_page_len,
        )
        check_features(dims, logit_cap, sliding_window_size, window_kv_offsets, xai_temperature_len, q_extend.device)
        want = (self.num_q_heads, self.num_kv_heads, self.head_dim, self.v_head_dim)
        got = (dims.num_q_heads, dims.num_kv_heads, dims.head_dim, dims.v_head_dim)
        if got != want:
            raise ValueError(f"this runner serves (H_Q, H_KV, D, Dv) = {want}, got {got}")
        if dims.batch_size > self.max_bs:
            raise ValueError(f"batch of {dims.batch_size} exceeds this runner's max_bs={self.max_bs}")
        if check == "full" and not _ws.capturing(q_extend.device):
            check_verify_values(qo_indptr, kv_indptr, kv_indices, k_buffer.shape[0], self.max_len_extend,
                                custom_mask, mask_indptr, num_tokens=dims.num_tokens,
                                kv_last_page_len=kv_last_page_len, page_size=dims.page_size)
        return VerifyPlan(self, q_extend, k_extend, v_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
                          custom_mask, mask_indptr, is_causal, sm_scale=sm_scale, k_scale=k_scale,
                          v_scale=v_scale, sinks=sinks, return_lse=return_lse, attend_draft=attend_draft,
                          logit_cap=logit_cap, sliding_window_size=sliding_window_size,
                          window_kv_offsets=window_kv_offsets, xai_temperature_len=xai_temperature_len,
                          kv_last_page_len=kv_last_page_len, check=bool(check))

    def _launcher(self, key: tuple, constexprs: dict, options: dict, fn) -> Launcher:
        launcher = self._launchers.get(key)
        if launcher is None:
            launcher = self._launchers[key] = Launcher(fn, constexprs, options)
        return launcher

    def __call__(
        self,
        q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer,
        qo_indptr, kv_indptr, kv_indices, **options,
    ):
        """Plan and run in one go; writes and returns ``o_extend``. ``options``: :meth:`plan`'s keywords
        (without ``return_lse``)."""
        plan = self.plan(q_extend, k_extend, v_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
                         **options)
        return plan.run(q_extend, k_extend, v_extend, k_buffer, v_buffer, out=o_extend)


class VerifyPlan:
    """One step's verify launch, fixed; :meth:`run` launches it for a layer.

    Made by :meth:`VerifySplitKV.plan`. Attributes worth reading:

    Attributes:
        batch_size: sequences in the step.
        n_splits: the grid's prefix slices.
        grid: ``(tiles, n_splits)``, plus each tile's merge programs on axis 1
            when ``merge`` is ``MERGE_PROGRAMS``.
        merge: who merges the slices (:func:`merge_mode`; ``None`` for one slice).
        fused: one launch (no merge kernel follows).
        config: the tile shape.
        scratch_bytes: bytes of partials one run needs, sized as float32 (0 with one slice).
        offsets_32: whether the pools are small enough for 32-bit gather
            offsets (:data:`OFFSETS_32_LIMIT`).
        kv_shared, draft_shared: a head in two chunks (MLA) whose V is a view
            of K's first ``Dv`` columns in the pools, in the draft block: the
            kernel loads those rows once for both.
    """

    def __init__(self, runner: VerifySplitKV, q_extend, k_extend, v_extend, k_buffer, v_buffer,
                 qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, is_causal, *,
                 sm_scale, k_scale, v_scale, sinks, return_lse, attend_draft,
                 logit_cap=0.0, sliding_window_size=-1, window_kv_offsets=None, xai_temperature_len=-1,
                 kv_last_page_len=None, check=False):
        r = self.runner = runner
        self.batch_size = qo_indptr.shape[0] - 1
        self.num_tokens = q_extend.shape[0]
        self.out_shape = (self.num_tokens, r.num_q_heads, r.v_head_dim)
        self.dtype = q_extend.dtype
        self.device = q_extend.device
        self.return_lse = return_lse
        #: the kernel validates the metadata and run() raises what it found (:mod:`splitkv.errors`)
        self.checked = bool(check)
        #: most polls of a merge program waiting for its slices before it reports a fault
        self.spin_limit = SPIN_LIMIT
        #: keys per kv_indices entry: 1 (token pool) or the page size
        self.page_size = k_buffer.shape[1] if k_buffer.dim() == 4 else 1
        #: keys a query may see in the prefix (sliding window), else None
        self.window = int(sliding_window_size) if sliding_window_size is not None and sliding_window_size > 0 else None
        self._hold_layer(q_extend, k_extend, v_extend, k_buffer, v_buffer)
        self._fix_tile(kv_indices.shape[0], k_buffer.dtype, q_extend.dtype)
        # Bound metadata: the same tensors every run (their values may change).
        self._bind(qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, sinks,
                   kv_last_page_len, window_kv_offsets)
        if sm_scale is None:
            sm_scale = 1.0 / math.sqrt(r.head_dim)
        self._scales = (float(sm_scale) * float(k_scale) * LOG2E, float(sm_scale) * LOG2E, float(v_scale),
                        float(logit_cap) * LOG2E if logit_cap and logit_cap > 0 else 0.0)
        self._p_err = r.error_word.data_ptr()
        has_xai = xai_temperature_len is not None and xai_temperature_len > 0
        self._features = (self.window or 0, int(xai_temperature_len) if has_xai else 0)
        self._set_scalars(kv_indices.shape[0], custom_mask)
        self._constexprs = self._kernel_constexprs(
            q_extend.dtype, k_buffer.dtype, USE_MASK=custom_mask is not None,
            HAS_MASK_OFFSETS=custom_mask is not None and window_kv_offsets is not None, IS_CAUSAL=bool(is_causal),
            HAS_LOGIT_CAP=bool(logit_cap and logit_cap > 0), HAS_XAI_TEMP=has_xai, ATTEND_DRAFT=bool(attend_draft),
            HAS_SINKS=sinks is not None, WRITE_LSE=bool(return_lse))
        self._options = dict(num_warps=self.config.num_warps, num_stages=self.config.num_stages)
        cuda = self.device.type == "cuda"
        self._pdl = cuda and not interpreting() and torch.cuda.get_device_capability(self.device)[0] >= 9
        self._pick_launchers()

    def _hold_layer(self, q_extend, k_extend, v_extend, k_buffer, v_buffer) -> None:
        """Record what every run's layer tensors must match, and the strides the kernel takes."""
        #: the device index (-1 for the CPU) every tensor of a run must report: the launch
        #: passes addresses, not tensors (see ``run``), so nothing downstream would check it
        self._dev_index = q_extend.get_device()
        #: what every run's tensors must report: 6 devices (q, k, v, pools, out), then 5 dtypes
        #: (q, k, v, pools; the output's is free: a context-parallel shard writes float32 partials)
        self._layer = (self._dev_index,) * 6 + (q_extend.dtype,) * 3 + (k_buffer.dtype,) * 2
        #: and their shapes, then strides: the launch's strides and bounds are the planned ones
        layer = (q_extend, k_extend, v_extend, k_buffer, v_buffer)
        self._layout = tuple(t.shape for t in layer) + tuple(t.stride() for t in layer)
        self._pool_tokens = min(k_buffer.shape[0], v_buffer.shape[0])
        #: the pools' element offsets fit 32 bits: the kernel gathers with 32-bit address arithmetic
        self.offsets_32 = pool_offsets_32(k_buffer) and pool_offsets_32(v_buffer)
        #: MLA (a head in two chunks): whether V is a view of K's first Dv columns, in the pools and in
        #: the draft block; each run's tensors must share the same way (their addresses are compared)
        rope = rope_dim(self.runner.head_dim, self.runner.v_head_dim)
        self.kv_shared = bool(rope) and shares_rows(k_buffer, v_buffer)
        self.draft_shared = bool(rope) and shares_rows(k_extend, v_extend)

        def pool_strides(buf):  # (slot or page, row within a page, head)
            return (buf.stride(0), buf.stride(1), buf.stride(2)) if buf.dim() == 4 else (buf.stride(0), 0, buf.stride(1))

        self._strides = (q_extend.stride(0), q_extend.stride(1), k_extend.stride(0), k_extend.stride(1),
                         v_extend.stride(0), v_extend.stride(1), *pool_strides(k_buffer), *pool_strides(v_buffer))

    def _fix_tile(self, kv_len: int, kv_dtype: torch.dtype, q_dtype: torch.dtype) -> None:
        """The tile, fixed from this call's prefix (a rebind may change only the split count), and the grid."""
        r, prefix = self.runner, self._prefix(kv_len)
        self._kv_dtype = kv_dtype
        self._small = r._small_batch(self.batch_size, kv_dtype, prefix) is not None
        self._spread = False  # merge in a second launch whatever merge_mode() says
        self.merge: Optional[int] = None  # set by _pick_launchers
        self.config = r.config(kv_dtype, self.batch_size, prefix, self.page_size, q_dtype, self.kv_shared)
        self._tiles = self.batch_size * r._head_tiles(self.config.block_m)
        self._min_split = min_split_for(self.config.block_n, min_split_tokens())
        self._size(kv_len)

    def _kernel_constexprs(self, q_dtype: torch.dtype, kv_dtype: torch.dtype, **features) -> dict:
        """The verify kernel's constexprs, but for who merges (:meth:`_pick_launchers` adds those)."""
        r, cfg = self.runner, self.config
        return dict(
            NUM_Q_HEADS=r.num_q_heads, GROUP=r.num_q_heads // r.num_kv_heads, HEADS_PER_TILE=r.heads_per_tile,
            M_BLOCKS=cdiv(rows_per_tile(r.heads_per_tile, r.max_len_extend), cfg.block_m),
            HEAD_DIM=r.head_dim, V_HEAD_DIM=r.v_head_dim,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_N_DRAFT=max(16, min(cfg.block_n, next_pow2(r.max_len_extend))),
            BLOCK_D=next_pow2(r.head_dim), BLOCK_DV=next_pow2(r.v_head_dim), K_ROWS=cfg.k_rows,
            PAGE_SIZE=self.page_size, OFFSETS_32=self.offsets_32, SPLIT_TOKENS=r.split_tokens or 0,
            USE_MASK=features["USE_MASK"], HAS_MASK_OFFSETS=features["HAS_MASK_OFFSETS"],
            IS_CAUSAL=features["IS_CAUSAL"], HAS_WINDOW=self.window is not None,
            HAS_LOGIT_CAP=features["HAS_LOGIT_CAP"], HAS_XAI_TEMP=features["HAS_XAI_TEMP"],
            ATTEND_DRAFT=features["ATTEND_DRAFT"], HAS_SINKS=features["HAS_SINKS"], WRITE_LSE=features["WRITE_LSE"],
            DOT_PRECISION="ieee" if q_dtype == torch.float32 else None,
            # bf16 queries meet fp8 keys in float16: one instruction widens two e4m3 values
            DOT_F16=element_size(kv_dtype) == 1 and q_dtype == torch.bfloat16,
            CHECK=self.checked,
            ROPE_DIM=rope_dim(r.head_dim, r.v_head_dim), KV_SHARED=self.kv_shared, DRAFT_SHARED=self.draft_shared,
        )

    def _size(self, kv_len: int) -> None:
        """Split count, grid and scratch for ``kv_len`` entries of ``kv_indices``."""
        r, bs = self.runner, self.batch_size
        n_splits = r.n_splits(bs, self._prefix(kv_len), self._kv_dtype, self._small, self.page_size,
                              self.config.block_n)
        reason = launch_limit_reason(self._tiles, n_splits, kv_len * self.page_size)
        if reason is not None:
            raise LaunchLimitError(reason)
        self.kv_len, self.n_splits = kv_len, n_splits
        self._set_grid()
        rows = self._tiles * self.n_splits * self.config.block_m
        self.scratch_bytes = 0 if self.n_splits == 1 else rows * (r.v_head_dim + 1) * 4
        self._part_rows = rows
        #: where the partial LSEs start in the scratch, after the partial outputs
        self._lse_offset = 0 if self.n_splits == 1 else rows * r.v_head_dim
        if r.workspace is not None and self.n_splits > 1 and rows * (r.v_head_dim + 1) > r._workspace.partials.numel():
            raise ValueError("the workspace is too small for this call's slices")

    def _prefix(self, kv_len: int) -> int:
        """Representative keys per sequence; under a window, the window's keys.

        The kernel reads from the key tile holding the window's first key, so up to
        ``BLOCK_N - 1`` keys more than the window; the grid is sized for the window
        itself, as a plain prefix of that length would be: a 128-key window at a 64k
        prefix takes one slice and one launch, like a 128-key prefix (sizing it for
        ``window + BLOCK_N`` would cut two slices and merge them, which is slower).
        """
        prefix = mean_prefix(kv_len, self.page_size, self.batch_size)
        return prefix if self.window is None else min(prefix, self.window)

    def _merge_mode(self) -> Optional[int]:
        """Who merges: ``None`` (one slice), ``LAST_PROGRAM``, ``MERGE_PROGRAMS`` or ``SEPARATE_MERGE``
        (:func:`merge_mode`; ``SEPARATE_MERGE`` too once :meth:`_pick_launchers` was told to spread)."""
        mode = merge_mode(self.n_splits, self._tiles, self.config.block_m, self.runner.v_head_dim,
                          self.runner.one_launch)
        return SEPARATE_MERGE if self._spread and mode is not None else mode

    def _launch_kind(self) -> Tuple[Optional[int], int, int]:
        """What the launchers are compiled for: who merges, the merge programs' rows and slices loaded per
        step (without merge programs the slice count is taken as 1, so that it makes no other variants)."""
        mode = self._merge_mode()
        n_splits = self.n_splits if mode == MERGE_PROGRAMS else 1
        return mode, grid_merge_rows(n_splits), merge_unroll(mode, n_splits)

    def _set_grid(self) -> None:
        """The verify grid: ``(tiles, n_splits)``, plus a tile's merge programs on axis 1 (``MERGE_PROGRAMS``)."""
        extra = (merge_chunks(self.n_splits, self.config.block_m, self.runner.v_head_dim)
                 if self.merge == MERGE_PROGRAMS else 0)
        self.grid = (self._tiles, self.n_splits + extra, 1)

    def _pick_launchers(self, spread: bool = False) -> None:
        """Fix who merges (:meth:`_merge_mode`; ``spread``: from now on a second launch) and the launchers."""
        r, cfg = self.runner, self.config
        self._spread = self._spread or spread
        #: who merges the slices: None (one slice), LAST_PROGRAM, MERGE_PROGRAMS or SEPARATE_MERGE
        self.merge, rows, unroll = self._launch_kind()
        #: one launch: no merge kernel follows the verify kernel
        self.fused = self.merge != SEPARATE_MERGE
        # Programmatic dependent launch: the merge kernel may start while the verify grid drains,
        # since it waits for it before its first load. The verify kernel is never launched early:
        # the kernel before it (the caller's) may write q or the metadata until it ends.
        pdl = self._pdl and not self.fused
        consts = dict(self._constexprs, MERGE=self.merge or SEPARATE_MERGE, MERGE_ROWS=rows, MERGE_UNROLL=unroll,
                      MERGE_DV=grid_merge_block(self.n_splits, r.v_head_dim)[1], USE_PDL=pdl,
                      DOT_PRECISION=self._constexprs["DOT_PRECISION"])
        options = dict(self._options)
        self._launch = r._launcher(("verify",) + tuple(consts.values()) + (cfg,), consts, options, _verify_kernel)
        self._set_grid()
        self._merge = None
        if not self.fused:
            c = self._constexprs
            rows, cols = merge_launch_block(r.v_head_dim)
            mconsts = dict(NUM_Q_HEADS=c["NUM_Q_HEADS"], HEADS_PER_TILE=c["HEADS_PER_TILE"], M_BLOCKS=c["M_BLOCKS"],
                           V_HEAD_DIM=c["V_HEAD_DIM"], BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"],
                           MERGE_ROWS=rows, MERGE_DV=cols,
                           PAGE_SIZE=c["PAGE_SIZE"], SPLIT_TOKENS=c["SPLIT_TOKENS"], HAS_WINDOW=c["HAS_WINDOW"],
                           HAS_SINKS=c["HAS_SINKS"], WRITE_LSE=c["WRITE_LSE"],
                           MERGE_UNROLL=merge_unroll(SEPARATE_MERGE, self.n_splits), USE_PDL=pdl)
            moptions = dict(num_warps=2, **({"launch_pdl": True} if pdl else {}))
            self._merge = r._launcher(("merge",) + tuple(mconsts.values()), mconsts, moptions, _merge_kernel)
            self._merge_grid = (self._tiles, cdiv(cfg.block_m, rows), cdiv(r.v_head_dim, cols))

    def _set_scalars(self, kv_len: int, custom_mask) -> None:
        scalars = (
            *self._scales, self.num_tokens, self._pool_tokens, kv_len,
            custom_mask.numel() if custom_mask is not None else 0, self.n_splits, self._min_split,
            *self._features, self.runner.max_len_extend, self.spin_limit,
        )
        if scalars != getattr(self, "_scalars", None):
            self._scalars = scalars
            self._tail = scalars + self._strides
            #: the merge launch's scalars: num_tokens, kv_len, n_splits, min_split, window
            self._merge_scalars = (self.num_tokens, kv_len, self.n_splits, self._min_split, self._features[0])
            # What the compiled kernel is specialised on among the plan's integers (the scratch's
            # LSE offset only by its width); run() adds the rest (dtypes, output strides,
            # alignment) to its launch key.
            self._spec = (_specialization(self._tail), self._lse_offset < 2**31)

    def _bind(self, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, sinks,
              kv_last_page_len, window_kv_offsets, check: bool = True) -> None:
        """Hold this step's metadata tensors and their addresses (``check``: their devices too)."""
        use_mask = custom_mask is not None
        # Placeholders (kv_indptr, qo_indptr) stand for absent tensors: never read.
        m = (
            qo_indptr, kv_indptr, kv_indices,
            kv_last_page_len if kv_last_page_len is not None else kv_indptr,
            custom_mask if use_mask else kv_indptr,
            mask_indptr if use_mask else kv_indptr,
            window_kv_offsets if use_mask and window_kv_offsets is not None else kv_indptr,
            sinks if sinks is not None else qo_indptr,
        )
        if check:
            if (m[0].get_device(), m[1].get_device(), m[2].get_device(), m[3].get_device(), m[4].get_device(),
                    m[5].get_device(), m[6].get_device(), m[7].get_device()) != (self._dev_index,) * 8:
                raise ValueError(f"metadata tensors must be on the plan's device, {self.device}")
            dtypes = (m[0].dtype, m[1].dtype, m[2].dtype, m[3].dtype, m[4].dtype, m[5].dtype, m[6].dtype, m[7].dtype)
        else:  # the caller knows the dtypes are the last bind's
            dtypes = self._static_key[1]
        # A placeholder's address is its tensor's, taken once: every data_ptr() call costs host time.
        p_qo, p_kvp = m[0].data_ptr(), m[1].data_ptr()
        ptrs = (p_qo, p_kvp, m[2].data_ptr(),
                m[3].data_ptr() if kv_last_page_len is not None else p_kvp,
                m[4].data_ptr() if use_mask else p_kvp,
                m[5].data_ptr() if use_mask else p_kvp,
                m[6].data_ptr() if use_mask and window_kv_offsets is not None else p_kvp,
                m[7].data_ptr() if sinks is not None else p_qo)
        self._meta, self._meta_ptrs = m, ptrs
        # What the compiled kernel is specialised on that is fixed per bind: the inputs' and the
        # metadata's dtypes, the metadata's 16-byte alignment.
        self._static_key = (self._layer[6:], dtypes, alignment_bits(ptrs))

    def rebind(self, qo_indptr, kv_indptr, kv_indices, custom_mask=None, mask_indptr=None, sinks=None,
               kv_last_page_len=None, window_kv_offsets=None) -> None:
        """Point the plan at another step's metadata of the same signature.

        The drop-in uses it to reuse one plan across eager steps: the tensors
        are new every step and ``kv_indices`` grows, but shapes, dtypes and
        scalars are the same. Only the split count may change (it follows
        ``len(kv_indices) // batch``, rounded as :func:`splitkv.choose_n_splits` does).
        ``kv_last_page_len`` and ``window_kv_offsets`` are given again when the
        plan was made with them (paged pools, mask offsets).

        Raises:
            ValueError: for a tensor on another device than the plan's (the plan
                is left as it was).
        """
        self._bind(qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, sinks,
                   kv_last_page_len, window_kv_offsets)
        self._resize(kv_indices.shape[0], custom_mask)

    def _rebind_same_signature(self, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, sinks,
                               kv_last_page_len, window_kv_offsets) -> None:
        """:meth:`rebind` for a caller that has checked the tensors' devices and dtypes
        against the plan's (the drop-in: they are part of its cache key)."""
        self._bind(qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, sinks,
                   kv_last_page_len, window_kv_offsets, check=False)
        self._resize(kv_indices.shape[0], custom_mask)

    def _resize(self, kv_len: int, custom_mask) -> None:
        if kv_len != self.kv_len:
            launch = self._launch_kind()
            self._size(kv_len)
            if self._launch_kind() != launch:  # e.g. one slice -> several: the kernel must now merge
                self._pick_launchers()
        elif custom_mask is None:
            return  # the scalars depend on nothing else that can change between binds
        self._set_scalars(kv_len, custom_mask)

    def release(self) -> None:
        """Drop the references to the bound metadata (a cached plan between rebinds)."""
        self._meta = self._meta_ptrs = None

    def run(self, q_extend, k_extend, v_extend, k_buffer, v_buffer, *, out=None, lse=None) -> torch.Tensor:
        """Launch for one layer's tensors (same shapes, dtypes and strides as planned).

        Args:
            q_extend, k_extend, v_extend, k_buffer, v_buffer: the layer's tensors.
            out: ``[tokens, H_Q, Dv]`` output to write, unit stride in its last
                dimension (default: a new tensor). Rows past ``qo_indptr[-1]``
                are not written.
            lse: ``[tokens, H_Q]`` contiguous float32 for the natural-log LSE;
                required by a plan made with ``return_lse``, refused by others.

        Returns:
            ``out``.

        Raises:
            ValueError: for a tensor of another device, dtype, shape or strides
                than planned, a malformed ``out`` or ``lse``; with a checked
                plan, :class:`splitkv.errors.VerifyError` for a fault the kernel
                found in this run's or an earlier run's metadata.
            RuntimeError: after :meth:`release`, until the next :meth:`rebind`.
        """
        if out is None:
            out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        layer = (q_extend, k_extend, v_extend, k_buffer, v_buffer)
        # The launch passes addresses, not tensors: nothing downstream would check these.
        if (q_extend.get_device(), k_extend.get_device(), v_extend.get_device(), k_buffer.get_device(),
                v_buffer.get_device(), out.get_device(), q_extend.dtype, k_extend.dtype,
                v_extend.dtype, k_buffer.dtype, v_buffer.dtype) != self._layer or (
                q_extend.shape, k_extend.shape, v_extend.shape, k_buffer.shape, v_buffer.shape,
                q_extend.stride(), k_extend.stride(), v_extend.stride(), k_buffer.stride(),
                v_buffer.stride()) != self._layout:
            self._refuse(layer, out)
        check_output(out, lse, self.out_shape, self.return_lse)
        if self._meta is None:
            raise RuntimeError("this plan was released: rebind() it to a step's metadata first")
        if self.checked:
            raise_pending(self.device, self._dev_index)
        self._run(q_extend, k_extend, v_extend, k_buffer, v_buffer, out, lse if lse is not None else out)
        if self.checked:
            raise_pending(self.device, self._dev_index)
        return out

    def _refuse(self, layer, out) -> None:
        """Raise the ValueError naming the first tensor that differs from the planned ones."""
        names = ("q_extend", "k_extend", "v_extend", "k_buffer", "v_buffer")
        for i, (name, t) in enumerate(zip(names, layer)):
            if t.get_device() != self._dev_index:
                raise ValueError(f"run() takes tensors on the plan's device, {self.device}; {name} is on {t.device}")
            if t.dtype != self._layer[6 + i]:
                raise ValueError(f"run() takes tensors of the planned dtypes; {name} is {t.dtype}, "
                                 f"planned {self._layer[6 + i]}")
            if (t.shape, t.stride()) != (self._layout[i], self._layout[5 + i]):
                raise ValueError(f"run() takes tensors of the planned shapes and strides; {name} is "
                                 f"{tuple(t.shape)} with strides {t.stride()}, planned "
                                 f"{tuple(self._layout[i])} with {self._layout[5 + i]}")
        raise ValueError(f"run() takes tensors on the plan's device, {self.device}; out is on {out.device}")

    def _run(self, q_extend, k_extend, v_extend, k_buffer, v_buffer, out, lse_arg) -> None:
        """Launch, for tensors whose devices and dtypes are the plan's (``lse_arg``: ``out`` without LSE).

        A launch that cannot merge in the verify grid (no counters to be had inside a capture, or
        merge programs that would make the kernel spill) switches the plan to a second merge launch
        and goes again.
        """
        if not self._launch_once(q_extend, k_extend, v_extend, k_buffer, v_buffer, out, lse_arg):
            self._launch_once(q_extend, k_extend, v_extend, k_buffer, v_buffer, out, lse_arg)

    def _launch_once(self, q_extend, k_extend, v_extend, k_buffer, v_buffer, out, lse_arg) -> bool:
        """:meth:`_run`'s launches; ``False`` (nothing launched) when the plan switched to a second merge launch."""
        stream = torch._C._cuda_getCurrentRawStream(self._dev_index) if self._dev_index >= 0 else None
        # The addresses serve twice: the launch key's alignment bits, and the launch itself
        # (Launcher.run_ptrs: Triton would otherwise ask the driver about each tensor again).
        # The metadata's were taken when it was bound.
        ptrs = (q_extend.data_ptr(), k_extend.data_ptr(), v_extend.data_ptr(), k_buffer.data_ptr(),
                v_buffer.data_ptr(), out.data_ptr(), lse_arg.data_ptr())
        if (self.kv_shared and ptrs[3] != ptrs[4]) or (self.draft_shared and ptrs[1] != ptrs[2]):
            raise ValueError("this plan reads V from K's rows (v_buffer / v_extend views of k_buffer / k_extend); "
                             "this run's V is another tensor: plan again")
        strides = (out.stride(0), out.stride(1))
        # The scratch's alignment is not in the key: within a runner it never changes (a
        # workspace's fixed carve-out, or else allocator blocks, arena slices and null
        # addresses, all 16-byte aligned).
        key = (self._spec, self._static_key, out.dtype, *strides, alignment_bits(ptrs))
        scratch = self._scratch(stream, key)
        if scratch is None:
            return False
        parts, p_parts, cnt, p_cnt, block = scratch
        try:
            if not self._launch.run_ptrs(key, self.grid, (*ptrs, *self._meta_ptrs, p_parts, self._lse_offset, p_cnt,
                                                          self._p_err, *self._tail, *strides), stream):
                if self.n_splits == 1:  # held by no one past this call (a plan may be made inside a graph's pool)
                    parts = cnt = torch.empty(1, dtype=torch.float32, device=self.device)
                args = (q_extend, k_extend, v_extend, k_buffer, v_buffer, out, lse_arg, *self._meta,
                        parts, self._lse_offset, cnt, self.runner.error_word, *self._tail, *strides)
                if self.merge == MERGE_PROGRAMS and self._launch.spills(args, self.grid):
                    # Merge programs share the verify kernel's registers: where they would make the
                    # slices' loop spill, a second merge launch is faster (see docs/design.md).
                    self._pick_launchers(spread=True)
                    return False
                self._launch(self.grid, args, stream, key)  # compiles
            if self._merge is not None:
                self._launch_merge(key, stream, out, lse_arg, parts, p_parts, strides)
        finally:
            if block:
                _ws.raw_delete(block)  # back to the cache, for what this stream runs next
        return True

    def _scratch(self, stream: Optional[int], key: tuple):
        """This run's ``(partials, address, counters, address, raw block to free)``; ``None`` (nothing
        allocated) when a capture has no zeroed counters left and the plan switched to a second merge launch."""
        if self.n_splits == 1:
            # One slice: no partials, no counters. The kernels never dereference them: null
            # addresses (and a placeholder tensor for a launch that compiles).
            return None, 0, None, 0, 0
        ws = self.runner._workspace
        if ws is not None:
            return ws.partials, ws.partials.data_ptr(), ws.counters, ws.counters.data_ptr(), 0
        # A raw block only where every launch of this run is compiled (compiling takes tensors).
        raw = self._launch.ready(key) and (self._merge is None or self._merge.ready(key))
        parts, p_parts = _ws.new_partials(self.device, self.scratch_bytes, stream, raw)
        block = p_parts if parts is None else 0
        if not self.fused:  # a second merge launch: no counters
            return parts, p_parts, parts, p_parts, block
        cnt = _ws.counters(self.device, self._tiles + GRID_COUNTERS,
                           None if stream is None else (self._dev_index, stream))
        if cnt is None:  # inside a capture with no zeroed counters left
            if block:
                _ws.raw_delete(block)
            self._pick_launchers(spread=True)
            return None
        return parts, p_parts, cnt, cnt.data_ptr(), block

    def _launch_merge(self, key, stream, out, lse_arg, parts, p_parts, strides) -> None:
        """The second merge launch (``SEPARATE_MERGE``): a subset of the verify launch's arguments,
        whose specialisation the same key fixes."""
        meta, tail = self._meta_ptrs, (self._lse_offset, *self._merge_scalars, *strides)
        if not self._merge.run_ptrs(key, self._merge_grid, (out.data_ptr(), lse_arg.data_ptr(), meta[0], meta[1],
                                                            meta[3], meta[7], p_parts, *tail), stream):
            m = self._meta
            self._merge(self._merge_grid, (out, lse_arg, m[0], m[1], m[3], m[7], parts, *tail), stream, key)
