"""Runner, plan and step: work out a verify launch once, bind each step's metadata, launch per layer.

A :class:`VerifySplitKV` is made once per head configuration (query/KV heads,
head dims, most draft tokens). Its :meth:`~VerifySplitKV.plan` takes one
step's tensors and options, checks them, and fixes everything that does not
change from layer to layer or from step to step: the tile, the kernel's
constexpr arguments, the layout of the tensors every run must match. The
launch's arithmetic is :mod:`splitkv.schedule`'s, as pure functions of the
plan's :class:`~splitkv.schedule.VerifyParams`, the device's facts and the
tuned table: :func:`~splitkv.schedule.plan_tile` once per plan,
:func:`~splitkv.schedule.plan_splits` for each split count.

A plan is not changed by running it. A step's metadata (``qo_indptr``,
``kv_indptr``, ``kv_indices``, a tree mask, ...) binds to a small immutable
:class:`Step` (:meth:`VerifyPlan.bind`): its tensors' addresses, the split
count its prefixes call for, the launch's scalars. :meth:`VerifyPlan.run`
takes a layer's tensors and a step. A step that only changes lengths (longer
prefixes, a longer tree mask) binds to the same plan. For the simple case a
plan keeps one bound step (:meth:`VerifyPlan.rebind`); threads that share a
plan bind steps of their own and pass them to :meth:`VerifyPlan.run`.

Everything a plan may launch follows from what it fixed: per split count its
split plan and, where the slices merge in the verify launch, the same launch
merged in a second one (:attr:`Step.fallback`), which a run takes when a
capture has no zeroed counters or the merge programs spill registers. What is
learned on the way is the runner's, shared by its plans and only growing: the
compiled launchers (by their constexprs) and which of them spill.

Scratch (partials and counters) is :mod:`splitkv.workspace`'s; faults are
:mod:`splitkv.errors`'.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Dict, NamedTuple, Optional, Tuple

import torch
import triton

from . import tuning
from . import workspace as _ws
from .errors import fault_log
from .kernels.common import LOG2E
from .kernels.merge import _merge_kernel
from .kernels.verify import _verify_kernel
from .launch import Launcher, _specialization, alignment_bits, capturing, current_stream, free_raw, supports_pdl
from .options import VerifyOptions, metadata_of, split_options
from .resources import refuse, rope_dim, shares_rows
from .schedule import (MAX_GRID_SPLITS, MAX_SPLITS, MERGE_PROGRAMS, SEPARATE_MERGE, SPIN_LIMIT, LaunchLimitError,
                       SplitPlan, TileConfig, TilePlan, VerifyParams, cdiv, count_splits, device_facts, element_size,
                       fixed_n_splits, launch_limit_reason, launch_rows, merge_launch_block, merge_unroll, next_pow2,
                       plan_splits, plan_tile, pool_offsets_32, rows_per_tile, workspace_bytes)
from .validate import check_batch_invariant, check_call, check_output, check_values

__all__ = ["VerifySplitKV", "VerifyPlan", "Step", "workspace_bytes"]


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

    Threads. A runner and its plans may be shared by threads: binding and running assign no
    attribute of a plan. What they share only grows, and is the same whoever fills it: the
    runner's compiled launchers and which of them spill (filled under a lock), a plan's split
    plans per split count. Each thread binds its own :class:`Step` (:meth:`VerifyPlan.bind`) and
    passes it to :meth:`VerifyPlan.run`; what a plan reports of the step bound last
    (:attr:`VerifyPlan.n_splits` and the like) is per thread. A plan's own bound step
    (:meth:`VerifyPlan.rebind`) is one thread's. A caller's ``workspace`` is one stream's at a time.
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
        self.device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
        #: what the schedule knows of the device (:class:`splitkv.schedule.DeviceFacts`)
        self.facts = device_facts(self.device, num_sms)
        #: the device's tuned table (:func:`splitkv.tuning.table_for`: its own, a user's, or derived)
        self.table = tuning.table_for(self.device)
        self.num_sms = self.facts.num_sms
        self.pack_gqa = pack_gqa
        self.config_override, self.fixed_n_splits = config, n_splits
        self.split_tokens, self.max_prefix_len = split_tokens, max_prefix_len
        self.one_launch = one_launch
        base = self.params(None, torch.bfloat16)
        self.heads_per_tile = base.heads_per_tile
        #: rows per tile (a small launch may cut them: :meth:`block_m_for_batch`)
        self.block_m = base.block_m
        #: programs per sequence and slice at ``block_m`` rows (KV heads x row blocks)
        self.head_tiles = base.head_tiles(self.block_m)
        self.workspace = workspace
        self._workspace: Optional[_ws.Workspace] = None
        if workspace is not None:
            need = workspace_bytes(num_q_heads, num_kv_heads, v_head_dim, max_len_extend, max_bs,
                                   self._max_splits(), pack_gqa=pack_gqa, block_m=self.block_m)
            if workspace.device.type != self.device.type or workspace.numel() * workspace.element_size() < need:
                raise ValueError(f"workspace must hold {need} bytes on {self.device}")
            self._workspace = _ws.Workspace(workspace, max_bs * self.head_tiles)
        self._launchers: Dict[tuple, Launcher] = {}
        self._launchers_lock = threading.Lock()
        #: verify launchers whose kernel spills registers with merge programs (learned when one compiles)
        self._spilling: set = set()
        self._numbers: Dict[tuple, int] = {}  # launch-key parts by number (:meth:`VerifyPlan._spec_id`)

    def params(self, batch_size: Optional[int], kv_dtype: torch.dtype, q_dtype: Optional[torch.dtype] = None,
               page_size: int = 1, kv_shared: bool = False, window: Optional[int] = None) -> VerifyParams:
        """The schedule's :class:`~splitkv.schedule.VerifyParams` for a call of this runner's heads:
        ``batch_size`` sequences (``None``: no particular batch), a pool of ``kv_dtype`` in pages of
        ``page_size`` keys (1: a token pool), queries of ``q_dtype`` (default: bf16 for fp8 pools, else the
        pool's), ``kv_shared`` (V a view of K: MLA) and a sliding ``window``."""
        if q_dtype is None:
            q_dtype = torch.bfloat16 if element_size(kv_dtype) == 1 else kv_dtype
        return VerifyParams(
            self.num_q_heads, self.num_kv_heads, self.head_dim, self.v_head_dim, self.max_len_extend, batch_size,
            kv_dtype, q_dtype, page_size=page_size, kv_shared=kv_shared, window=window, pack_gqa=self.pack_gqa,
            config=self.config_override, n_splits=self.fixed_n_splits, split_tokens=self.split_tokens,
            max_prefix_len=self.max_prefix_len, one_launch=self.one_launch,
            workspace_tiles=self._workspace.tiles if getattr(self, "_workspace", None) is not None else None)

    def _max_splits(self) -> int:
        if self.fixed_n_splits is not None:
            return self.fixed_n_splits
        if self.split_tokens is not None:
            return fixed_n_splits(self.max_prefix_len, self.split_tokens)
        return MAX_SPLITS

    def block_m_for_batch(self, batch_size: Optional[int]) -> int:
        """Rows per tile for a call of ``batch_size`` sequences (:func:`splitkv.schedule.launch_rows`)."""
        return launch_rows(self.params(batch_size, torch.bfloat16), self.facts)

    def config(self, kv_dtype: torch.dtype, batch_size: Optional[int] = None, prefix_len: int = 0,
               page_size: int = 1, q_dtype: Optional[torch.dtype] = None, kv_shared: bool = False) -> TileConfig:
        """The tile for a pool of ``kv_dtype`` and a batch of ``batch_size`` sequences of about ``prefix_len``
        keys (:func:`splitkv.schedule.plan_tile`; other arguments as for :meth:`params`).

        Raises:
            ValueError: when no tile fits (the gate declines such calls first).
        """
        p = self.params(batch_size, kv_dtype, q_dtype, page_size, kv_shared)
        return plan_tile(p, self.facts, self.table, prefix_len).config

    def n_splits(self, batch_size: int, prefix_len: int, kv_dtype: torch.dtype = torch.bfloat16,
                 small: Optional[bool] = None, page_size: int = 1, block_n: Optional[int] = None) -> int:
        """Grid slices for ``batch_size`` sequences of about ``prefix_len`` keys
        (:func:`splitkv.schedule.count_splits`). ``small`` and ``block_n`` override the tile's
        small-launch choice and key tile (default: as :meth:`config` decides)."""
        p = self.params(batch_size, kv_dtype, page_size=page_size)
        tile = plan_tile(p, self.facts, self.table, prefix_len)
        if small is not None or block_n is not None:
            cfg = tile.config
            tile = dataclasses.replace(
                tile, config=TileConfig(cfg.block_m, block_n or cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.k_rows),
                small=tile.small if small is None else small)
        return count_splits(p, tile, self.facts, self.table, prefix_len)

    def plan(self, q_extend, k_extend, v_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, *,
             attend_draft: bool = True, **options) -> "VerifyPlan":
        """Check one step's inputs and fix its launch.

        The tensors given are those of one layer; :meth:`VerifyPlan.run` takes
        any layer's tensors of the same shapes, dtypes and strides. The
        metadata tensors (indptrs, indices, mask, sinks) are bound to the plan:
        their *values* may change between runs (a graph replay with new
        lengths), not their addresses or sizes.

        Args:
            q_extend, k_extend, v_extend, k_buffer, v_buffer, qo_indptr,
            kv_indptr, kv_indices: as for :func:`splitkv.verify_splitkv_fwd`.
            attend_draft: ``False`` attends to the prefix only (a context-parallel
                shard that does not own the draft block).
            **options: the options of :func:`splitkv.verify_attention`
                (:class:`splitkv.options.VerifyOptions` and the metadata tensors of
                :data:`splitkv.options.METADATA`), but those the runner fixed
                (``max_len_extend``, ``max_bs``, ``split_tokens``, ``max_prefix_len``);
                ``check`` defaults to ``False`` here.

        Raises:
            ValueError: on malformed input or shapes this runner was not built for.
            TypeError: for an unknown option, one the runner fixed, or an
                ``is_causal`` or ``check`` of the wrong type.
        """
        opts, meta = self.plan_options(options)
        tensors = (q_extend, k_extend, v_extend, None, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices)
        return self._plan(tensors, meta, opts, attend_draft=attend_draft)

    def plan_options(self, options: dict):
        """A ``plan()`` call's keywords into ``(VerifyOptions, metadata by name)``: the runner's own limits
        added, ``check`` off unless given.

        Raises:
            TypeError: for an unknown keyword, or one the runner fixes.
        """
        fixed = sorted(set(options) & set(self._limits))
        if fixed:
            raise TypeError(f"{', '.join(fixed)}: fixed by the runner (VerifySplitKV), not by plan()")
        return split_options({"check": False, **options, **self._limits})

    def _plan(self, tensors: tuple, meta: dict, opts: VerifyOptions, *, attend_draft: bool = True,
              tile: Optional[TilePlan] = None) -> "VerifyPlan":
        """:meth:`plan` for a call's tensors (:data:`splitkv.options.TENSORS`), metadata and options
        (``tile``: the gate's, which checked the call, taken where it was planned from this plan's
        parameters)."""
        dims = check_call(tensors, meta, opts) if tile is None else tile.params
        want = (self.num_q_heads, self.num_kv_heads, self.head_dim, self.v_head_dim)
        got = (dims.num_q_heads, dims.num_kv_heads, dims.head_dim, dims.v_head_dim)
        if got != want:
            raise ValueError(f"this runner serves (H_Q, H_KV, D, Dv) = {want}, got {got}")
        if dims.batch_size > self.max_bs:
            raise ValueError(f"batch of {dims.batch_size} exceeds this runner's max_bs={self.max_bs}")
        if opts.check == "full" and not capturing(tensors[0].device):
            check_values(tensors, meta, opts)
        return VerifyPlan(self, tensors, meta, opts, attend_draft=attend_draft, tile=tile)

    @property
    def _limits(self) -> dict:
        """The options a runner fixes for its plans."""
        return dict(max_len_extend=self.max_len_extend, max_bs=self.max_bs, split_tokens=self.split_tokens,
                    max_prefix_len=self.max_prefix_len)

    def _launcher(self, key: tuple, constexprs: dict, options: dict, fn) -> Launcher:
        """The runner's launcher for ``fn`` with these constexprs and options (made once, shared by its plans)."""
        launcher = self._launchers.get(key)
        if launcher is None:
            with self._launchers_lock:
                launcher = self._launchers.setdefault(key, Launcher(fn, constexprs, options))
        return launcher

    def _number(self, part: tuple) -> int:
        """A number for ``part`` of a launch key, the same for equal parts (the launchers' keys are this
        runner's: its plans share them)."""
        number = self._numbers.get(part)
        if number is None:
            with self._launchers_lock:
                number = self._numbers.setdefault(part, len(self._numbers))
        return number

    def __call__(self, q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr,
                 kv_indices, **options):
        """Plan and run in one go; writes and returns ``o_extend``. ``options``: :meth:`plan`'s keywords
        (without ``return_lse``)."""
        plan = self.plan(q_extend, k_extend, v_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
                         **options)
        return plan.run(q_extend, k_extend, v_extend, k_buffer, v_buffer, out=o_extend)


class Step(NamedTuple):
    """One step's metadata bound to a plan (:meth:`VerifyPlan.bind`): immutable, cheap, per step.

    Attributes:
        split: the launch's slices and merge (:class:`splitkv.schedule.SplitPlan`).
        kv_len: entries of ``kv_indices``.
        meta: the kernel's eight metadata tensors (absent ones stood for by placeholders, never read).
        meta_ptrs: their addresses.
        key: what the compiled kernel is specialised on that the plan, the lengths and the metadata fix:
            ``(the runner's number for the plan's and the lengths' part, the metadata's dtypes where
            they are not the plan's, else None, their 16-byte alignment)``.
        tail: the kernel's scalar arguments and strides.
        merge_scalars: the second merge launch's scalars.
        launch: the verify kernel's launcher for ``split``.
        merge: the second merge launch's launcher, or ``None``.
        fallback: where ``split`` merges in the verify launch, the same launch merged in a second one
            ``(split plan, its key's first entry, launcher, merge launcher)``: what a run takes when no zeroed
            counters are to be had (inside a capture) or the merge programs turn out to spill.
    """

    split: SplitPlan
    kv_len: int
    meta: tuple
    meta_ptrs: tuple
    key: tuple
    tail: tuple
    merge_scalars: tuple
    launch: Launcher
    merge: Optional[Launcher]
    fallback: Optional[tuple]


class _Seen(threading.local):
    """A plan's per-thread memo: the lengths the thread bound last and what they launch (:meth:`VerifyPlan._size`)."""

    sized: Optional[tuple] = None


class VerifyPlan:
    """One step shape's verify launch, fixed; :meth:`run` launches it for a layer and a step.

    Made by :meth:`VerifySplitKV.plan`. Binding and running assign nothing in a plan; :meth:`rebind`
    replaces the step it keeps bound, and :meth:`bind` makes a step without touching the plan
    (for threads that share a plan: each binds its own and passes it to :meth:`run`). Per thread the
    plan keeps a memo of the lengths bound last, which is what :attr:`n_splits` and the like describe.

    Attributes:
        params: what the schedule planned from (:class:`splitkv.schedule.VerifyParams`).
        tile: the tile (:class:`splitkv.schedule.TilePlan`); ``config`` its shape.
        step: the bound step (:class:`Step`), ``None`` after :meth:`release`.
        batch_size: sequences in the step.
        n_splits, grid, merge, fused, scratch_bytes: what the step this thread bound last launches
            (else the plan's own step; its :class:`splitkv.schedule.SplitPlan`, for introspection:
            each step carries its own).
        offsets_32: whether the pools are small enough for 32-bit gather offsets.
        kv_shared, draft_shared: a head in two chunks (MLA) whose V is a view
            of K's first ``Dv`` columns in the pools, in the draft block: the
            kernel loads those rows once for both.
    """

    def __init__(self, runner: VerifySplitKV, tensors: tuple, meta: dict, opts: VerifyOptions, *,
                 attend_draft: bool = True, tile: Optional[TilePlan] = None):
        r = self.runner = runner
        q_extend, k_extend, v_extend, _, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices = tensors
        self.batch_size = qo_indptr.shape[0] - 1
        self.num_tokens = q_extend.shape[0]
        self.out_shape = (self.num_tokens, r.num_q_heads, r.v_head_dim)
        self.dtype, self.device = q_extend.dtype, q_extend.device
        self.return_lse = opts.return_lse
        #: the kernel validates the metadata (:mod:`splitkv.errors` says how faults are raised)
        self.checked = bool(opts.check)
        #: most polls of a merge program waiting for its slices before it reports a fault
        self.spin_limit = SPIN_LIMIT
        #: keys per kv_indices entry: 1 (token pool) or the page size
        self.page_size = k_buffer.shape[1] if k_buffer.dim() == 4 else 1
        #: keys a query may see in the prefix (sliding window), else None
        self.window = opts.window
        self._hold_layer(q_extend, k_extend, v_extend, k_buffer, v_buffer)
        self.params = r.params(self.batch_size, k_buffer.dtype, q_extend.dtype, self.page_size, self.kv_shared,
                               self.window)
        if tile is None or (tile.params, tile.facts) != (self.params, r.facts):  # the gate's tile, where it fits
            tile = plan_tile(self.params, r.facts, r.table, self.params.prefix(kv_indices.shape[0]))
        self.tile = tile
        self.config = self.tile.config
        sm_scale = opts.sm_scale or 1.0 / math.sqrt(r.head_dim)  # as extend_attention_fwd: 0 is the default too
        scales = (float(sm_scale) * float(opts.k_scale) * LOG2E, float(sm_scale) * LOG2E,
                  float(opts.v_scale), float(opts.logit_cap) * LOG2E)
        self._fixed_scalars = (scales, (self.num_tokens, self._pool_tokens),
                               (self.tile.min_split, self.window or 0, opts.xai_len, r.max_len_extend,
                                self.spin_limit))
        self._fixed_spec = _specialization(sum(self._fixed_scalars, ()) + self._strides)
        self._log = fault_log(self.device)
        self._log_address = self._log.address
        custom_mask = meta["custom_mask"]
        self._constexprs = self._kernel_constexprs(
            q_extend.dtype, k_buffer.dtype, USE_MASK=custom_mask is not None,
            HAS_MASK_OFFSETS=custom_mask is not None and meta["window_kv_offsets"] is not None,
            IS_CAUSAL=opts.is_causal, HAS_LOGIT_CAP=opts.logit_cap > 0, HAS_XAI_TEMP=opts.xai_len > 0,
            ATTEND_DRAFT=bool(attend_draft), HAS_SINKS=meta["sinks"] is not None, WRITE_LSE=opts.return_lse)
        self._pdl = supports_pdl(self.device)
        # Memos of pure functions of the plan (split plans per count, launchers per variant): filled on
        # first use, equal whoever fills them.
        self._splits: Dict[Tuple[int, bool], SplitPlan] = {}
        self._variants: Dict[tuple, Tuple[Launcher, Optional[Launcher]]] = {}
        self._seen = _Seen()  # per thread: the lengths it bound last and what they launch
        self.step: Optional[Step] = None
        self._meta_dtypes = self._metadata(qo_indptr, kv_indptr, kv_indices, meta, True)[2]
        self.rebind(qo_indptr, kv_indptr, kv_indices, **meta)

    def _hold_layer(self, q_extend, k_extend, v_extend, k_buffer, v_buffer) -> None:
        """Record what every run's layer tensors must match, and the strides the kernel takes."""
        #: the device index (-1 for the CPU) every tensor of a run must report: the launch
        #: passes addresses, not tensors (see ``run``), so nothing downstream would check it
        self._dev_index = q_extend.get_device()
        self._cuda = self._dev_index >= 0
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

    def _kernel_constexprs(self, q_dtype: torch.dtype, kv_dtype: torch.dtype, **features) -> dict:
        """The verify kernel's constexprs, but for who merges (:meth:`_launchers_for` adds those)."""
        r, cfg = self.runner, self.config
        return dict(
            NUM_Q_HEADS=r.num_q_heads, GROUP=r.num_q_heads // r.num_kv_heads, HEADS_PER_TILE=r.heads_per_tile,
            M_BLOCKS=cdiv(rows_per_tile(r.heads_per_tile, r.max_len_extend), cfg.block_m),
            HEAD_DIM=r.head_dim, V_HEAD_DIM=r.v_head_dim,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_N_DRAFT=max(16, min(cfg.block_n, next_pow2(r.max_len_extend))),
            BLOCK_D=next_pow2(r.head_dim), BLOCK_DV=next_pow2(r.v_head_dim), K_ROWS=cfg.k_rows,
            PAGE_SIZE=self.page_size, OFFSETS_32=self.offsets_32, SPLIT_TOKENS=r.split_tokens or 0,
            HAS_WINDOW=self.window is not None, **features,
            DOT_PRECISION="ieee" if q_dtype == torch.float32 else None,
            # bf16 queries meet fp8 keys in float16: one instruction widens two e4m3 values
            DOT_F16=element_size(kv_dtype) == 1 and q_dtype == torch.bfloat16,
            CHECK=self.checked,
            ROPE_DIM=rope_dim(r.head_dim, r.v_head_dim), KV_SHARED=self.kv_shared, DRAFT_SHARED=self.draft_shared,
        )

    # ---- binding a step

    def bind(self, qo_indptr, kv_indptr, kv_indices, **metadata) -> Step:
        """A step for this plan: its metadata tensors (:data:`splitkv.options.METADATA` by name, as the
        plan was made with) and the split count their lengths call for. The plan launches nothing
        differently for it; it only records the step's split plan, for :attr:`n_splits` and the like.

        Raises:
            ValueError: for a tensor on another device than the plan's.
            LaunchLimitError: for a ``kv_indices`` too long for one launch (a ``ValueError``).
            TypeError: for a keyword that is not a metadata tensor's name.
        """
        return self._bind(qo_indptr, kv_indptr, kv_indices, metadata_of(metadata))

    def rebind(self, qo_indptr, kv_indptr, kv_indices, **metadata) -> None:
        """Bind another step's metadata of the same signature and keep it as the plan's :attr:`step`.

        The tensors may be new every step and ``kv_indices`` (and a tree mask) longer; shapes,
        dtypes and scalars are the plan's. Only the split count may change (it follows
        ``len(kv_indices) // batch``). Not for plans shared by threads: use :meth:`bind`.

        Raises:
            ValueError: as :meth:`bind` does (the plan is then left as it was).
        """
        self.step = self.bind(qo_indptr, kv_indptr, kv_indices, **metadata)

    def release(self) -> None:
        """Drop the bound step and its references to the step's metadata tensors."""
        self.step = None

    def _bind(self, qo_indptr, kv_indptr, kv_indices, meta: dict, check: bool = True) -> Step:
        """:meth:`bind` for metadata by name (``check``: the tensors' devices and dtypes too; the entries'
        cache keys hold them already)."""
        m, ptrs, dtypes = self._metadata(qo_indptr, kv_indptr, kv_indices, meta, check)
        mask = meta["custom_mask"]
        lengths = (kv_indices.shape[0], mask.numel() if mask is not None else 0)
        seen = self._seen
        sized = seen.sized
        if sized is None or sized[0] != lengths:  # the lengths changed: the split count may have
            sized = seen.sized = (lengths, self._size(*lengths))
        split, tail, spec_id, merge_scalars, launch, merge, fallback = sized[1]
        return Step(split, lengths[0], m, ptrs, (spec_id, None if dtypes == self._meta_dtypes else dtypes,
                                                 alignment_bits(ptrs)), tail, merge_scalars, launch, merge, fallback)

    def _size(self, kv_len: int, mask_len: int) -> tuple:
        """What a step of these lengths launches: ``(split plan, scalars, their specialisation, the second
        merge's scalars, launchers, the fallback)`` (:meth:`_bind` keeps the last per thread, as steps'
        lengths repeat). Merge programs whose kernel is known to spill give way to the second launch."""
        n = count_splits(self.params, self.tile, self.runner.facts, self.runner.table, self.params.prefix(kv_len))
        reason = launch_limit_reason(self.tile.tiles, n, kv_len * self.page_size)
        if reason is not None:
            raise LaunchLimitError(reason)
        split = self._split(n)
        ws = self.runner._workspace
        if ws is not None and split.scratch_bytes > 4 * ws.partials.numel():
            raise ValueError("the workspace is too small for this call's slices")
        scales, sizes, rest = self._fixed_scalars
        tail = scales + sizes + (kv_len, mask_len, n) + rest + self._strides
        spec = (self._fixed_spec, _specialization((kv_len, mask_len, n)))
        merge_scalars = (self.num_tokens, kv_len, n, self.tile.min_split, self.window or 0)
        fallback = None
        if split.merge is not None and split.merge != SEPARATE_MERGE:
            separate = self._split(n, True)
            fallback = (separate, self._spec_id(spec, separate), *self._launchers_for(separate))
        launch, merge = self._launchers_for(split)
        if fallback is not None and launch in self.runner._spilling:
            return (*fallback[:1], tail, fallback[1], merge_scalars, *fallback[2:], None)
        return (split, tail, self._spec_id(spec, split), merge_scalars, launch, merge, fallback)

    def _spec_id(self, spec: tuple, split: SplitPlan) -> int:
        """The runner's number for what a launch of ``split`` is specialised on that the plan and the
        lengths fix (``spec``, the layer's and the plan's metadata dtypes): launch keys stay small."""
        return self.runner._number((spec, split.lse_offset < 2**31, self._layer[6:], self._meta_dtypes))

    def _metadata(self, qo_indptr, kv_indptr, kv_indices, meta: dict, check: bool):
        """The kernel's eight metadata tensors (placeholders, never read, for absent ones), their
        addresses and dtypes (``check``: their devices are checked)."""
        custom_mask, sinks, last = meta["custom_mask"], meta["sinks"], meta["kv_last_page_len"]
        offsets = meta["window_kv_offsets"]
        use_mask = custom_mask is not None
        m = (
            qo_indptr, kv_indptr, kv_indices,
            last if last is not None else kv_indptr,
            custom_mask if use_mask else kv_indptr,
            meta["mask_indptr"] if use_mask else kv_indptr,
            offsets if use_mask and offsets is not None else kv_indptr,
            sinks if sinks is not None else qo_indptr,
        )
        if check and (m[0].get_device(), m[1].get_device(), m[2].get_device(), m[3].get_device(),
                      m[4].get_device(), m[5].get_device(), m[6].get_device(),
                      m[7].get_device()) != (self._dev_index,) * 8:
            raise ValueError(f"metadata tensors must be on the plan's device, {self.device}")
        # A placeholder's address is its tensor's, taken once: every data_ptr() call costs host time.
        p_qo, p_kvp = m[0].data_ptr(), m[1].data_ptr()
        ptrs = (p_qo, p_kvp, m[2].data_ptr(),
                m[3].data_ptr() if last is not None else p_kvp,
                m[4].data_ptr() if use_mask else p_kvp,
                m[5].data_ptr() if use_mask else p_kvp,
                m[6].data_ptr() if use_mask and offsets is not None else p_kvp,
                m[7].data_ptr() if sinks is not None else p_qo)
        if not check:  # the entries' cache keys fixed the dtypes: the plan's
            return m, ptrs, self._meta_dtypes
        return m, ptrs, (m[0].dtype, m[1].dtype, m[2].dtype, m[3].dtype, m[4].dtype, m[5].dtype, m[6].dtype,
                         m[7].dtype)

    def _split(self, n_splits: int, separate: bool = False) -> SplitPlan:
        """The split plan for ``n_splits`` slices (``separate``: merged in a second launch)."""
        key = (n_splits, separate)
        split = self._splits.get(key)
        if split is None:
            split = self._splits[key] = plan_splits(self.params, self.tile, n_splits, separate)
        return split

    def _launchers_for(self, split: SplitPlan) -> Tuple[Launcher, Optional[Launcher]]:
        """The verify kernel's launcher for ``split``'s merge variant, and the second merge launch's."""
        variant = _variant(split)
        found = self._variants.get(variant)
        if found is None:
            found = self._variants[variant] = self._make_launchers(split)
        return found

    def _make_launchers(self, split: SplitPlan) -> Tuple[Launcher, Optional[Launcher]]:
        r, cfg, c = self.runner, self.config, self._constexprs
        # Programmatic dependent launch: the merge kernel may start while the verify grid drains,
        # since it waits for it before its first load. The verify kernel is never launched early:
        # the kernel before it (the caller's) may write q or the metadata until it ends.
        pdl = self._pdl and not split.fused
        consts = dict(c, MERGE=split.merge or SEPARATE_MERGE, MERGE_ROWS=split.merge_rows,
                      MERGE_UNROLL=split.merge_unroll, MERGE_DV=split.merge_dv, USE_PDL=pdl)
        options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        launch = r._launcher(("verify",) + tuple(consts.values()) + (cfg,), consts, options, _verify_kernel)
        if split.fused:
            return launch, None
        rows, cols = merge_launch_block(r.v_head_dim)
        mconsts = dict(NUM_Q_HEADS=c["NUM_Q_HEADS"], HEADS_PER_TILE=c["HEADS_PER_TILE"], M_BLOCKS=c["M_BLOCKS"],
                       V_HEAD_DIM=c["V_HEAD_DIM"], BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"],
                       MERGE_ROWS=rows, MERGE_DV=cols,
                       PAGE_SIZE=c["PAGE_SIZE"], SPLIT_TOKENS=c["SPLIT_TOKENS"], HAS_WINDOW=c["HAS_WINDOW"],
                       HAS_SINKS=c["HAS_SINKS"], WRITE_LSE=c["WRITE_LSE"],
                       MERGE_UNROLL=merge_unroll(SEPARATE_MERGE, split.n_splits), USE_PDL=pdl)
        moptions = dict(num_warps=2, **({"launch_pdl": True} if pdl else {}))
        return launch, r._launcher(("merge",) + tuple(mconsts.values()), mconsts, moptions, _merge_kernel)

    # ---- what the step this thread bound last launches (read-only)

    @property
    def _seen_split(self) -> SplitPlan:
        """The split plan of the step this thread bound last (else of the plan's own step)."""
        sized = self._seen.sized
        if sized is not None:
            return sized[1][0]
        if self.step is None:
            raise RuntimeError("this plan was released and this thread bound no step to it")
        return self.step.split

    @property
    def n_splits(self) -> int:
        """The grid's prefix slices."""
        return self._seen_split.n_splits

    @property
    def grid(self) -> Tuple[int, int, int]:
        """``(tiles, n_splits [+ merge programs], 1)``."""
        return self._seen_split.grid

    @property
    def merge(self) -> Optional[int]:
        """Who merges the slices: None (one slice), LAST_PROGRAM, MERGE_PROGRAMS or SEPARATE_MERGE."""
        return self._seen_split.merge

    @property
    def fused(self) -> bool:
        """One launch: no merge kernel follows the verify kernel."""
        return self._seen_split.fused

    @property
    def scratch_bytes(self) -> int:
        """Bytes of partials one run needs, sized as float32 (0 with one slice)."""
        return self._seen_split.scratch_bytes

    # ---- running

    def run(self, q_extend, k_extend, v_extend, k_buffer, v_buffer, *, out=None, lse=None,
            step: Optional[Step] = None) -> torch.Tensor:
        """Launch for one layer's tensors (same shapes, dtypes and strides as planned) and a step.

        Args:
            q_extend, k_extend, v_extend, k_buffer, v_buffer: the layer's tensors.
            out: ``[tokens, H_Q, Dv]`` output to write, unit stride in its last
                dimension (default: a new tensor). Rows past ``qo_indptr[-1]``
                are not written.
            lse: ``[tokens, H_Q]`` contiguous float32 for the natural-log LSE;
                required by a plan made with ``return_lse``, refused by others.
            step: a step from :meth:`bind` (default: the plan's bound :attr:`step`).

        Returns:
            ``out``.

        Raises:
            ValueError: for a tensor of another device, dtype, shape or strides
                than planned, a malformed ``out`` or ``lse``;
                :class:`splitkv.errors.VerifyError` for a fault a kernel reported
                in this run or an earlier launch (:mod:`splitkv.errors`).
            RuntimeError: with no step: after :meth:`release`, until the next :meth:`rebind`.
            NotImplementedError: :class:`splitkv.resources.OutOfDeviceResources`, the split path's
                decline, when the kernel's compile runs out of the device's resources (nothing was
                launched; from then on the gate declines calls of this tile, as :func:`splitkv.can_handle` says).
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
        step = self.step if step is None else step
        if step is None:
            raise RuntimeError("this plan was released: rebind() it to a step's metadata, or pass a step")
        self._run(step, q_extend, k_extend, v_extend, k_buffer, v_buffer, out, lse if lse is not None else out)
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

    def _run(self, step: Step, q_extend, k_extend, v_extend, k_buffer, v_buffer, out, lse_arg) -> None:
        """Launch ``step`` for tensors whose devices and dtypes are the plan's (``lse_arg``: ``out`` without
        LSE), raising the faults reported so far before and after (:mod:`splitkv.errors`).

        A launch that cannot merge in the verify grid (no zeroed counters to be had inside a capture,
        or merge programs that spill) merges in a second launch instead.
        """
        log = self._log
        log.raise_pending()
        captured = self._captured()
        slot = log.take_slot(captured)
        layer = (q_extend, k_extend, v_extend, k_buffer, v_buffer, out, lse_arg)
        try:
            if not self._launch_once(step, layer, slot, captured):
                split, spec_id, launch, merge = step.fallback
                self._launch_once(step._replace(split=split, key=(spec_id, *step.key[1:]), launch=launch,
                                                merge=merge, fallback=None), layer, slot, captured)
        except triton.OutOfResources as err:  # the shared-memory model under-estimated this tile
            raise refuse(self.tile, str(err)) from err
        log.raise_pending()

    def _captured(self) -> bool:
        """Whether this run is being captured into a CUDA graph (:func:`splitkv.launch.capturing`, without
        asking a CPU plan's device for its type)."""
        return self._cuda and torch.cuda.is_current_stream_capturing()

    def _launch_once(self, step: Step, layer: tuple, slot: int, captured: bool) -> bool:
        """:meth:`_run`'s launches; ``False`` (nothing launched) when this launch must merge in a second launch."""
        q_extend, k_extend, v_extend, k_buffer, v_buffer, out, lse_arg = layer
        stream = current_stream(self._dev_index) if self._dev_index >= 0 else None
        # The addresses serve twice: the launch key's alignment bits, and the launch itself
        # (Launcher.run_ptrs: Triton would otherwise ask the driver about each tensor again).
        # The metadata's were taken when the step was bound.
        ptrs = (q_extend.data_ptr(), k_extend.data_ptr(), v_extend.data_ptr(), k_buffer.data_ptr(),
                v_buffer.data_ptr(), out.data_ptr(), lse_arg.data_ptr())
        if (self.kv_shared and ptrs[3] != ptrs[4]) or (self.draft_shared and ptrs[1] != ptrs[2]):
            raise ValueError("this plan reads V from K's rows (v_buffer / v_extend views of k_buffer / k_extend); "
                             "this run's V is another tensor: plan again")
        strides = out.stride()[:2]
        # The scratch's alignment is not in the key: it is always 16-byte aligned (a workspace's
        # carve-out, allocator blocks, counter slices padded to 16 bytes, null addresses).
        key = (*step.key, out.dtype, *strides, alignment_bits(ptrs))
        scratch = self._scratch(step, stream, key, captured)
        if scratch is None:
            return False
        parts, p_parts, cnt, p_cnt, block = scratch
        split = step.split
        try:
            if not step.launch.run_ptrs(key, split.grid, (*ptrs, *step.meta_ptrs, p_parts, split.lse_offset, p_cnt,
                                                          self._log_address, slot, *step.tail, *strides), stream):
                if split.n_splits == 1:  # held by no one past this call (a plan may be made inside a graph's pool)
                    parts = cnt = torch.empty(1, dtype=torch.float32, device=self.device)
                args = (*layer, *step.meta, parts, split.lse_offset, cnt, self._log.words, slot, *step.tail, *strides)
                if split.merge == MERGE_PROGRAMS and step.launch.spills(args, split.grid):
                    # Merge programs share the verify kernel's registers: where they would make the
                    # slices' loop spill, a second merge launch is faster (see docs/design.md).
                    self._learn_spills(step)
                    return False
                step.launch(split.grid, args, stream, key)  # compiles
            if step.merge is not None:
                self._launch_merge(step, key, stream, out, lse_arg, parts, p_parts, strides)
        finally:
            if block:
                free_raw(block)  # back to the cache, for what this stream runs next
        return True

    def _learn_spills(self, step: Step) -> None:
        """Record with the runner that ``step``'s merge-program launcher spills: steps bound from now on
        merge in a second launch (this thread's last lengths are sized again, so that it says so)."""
        self.runner._spilling.add(step.launch)
        seen = self._seen
        if seen.sized is not None and seen.sized[1][4] is step.launch:
            seen.sized = (seen.sized[0], self._size(*seen.sized[0]))

    def _scratch(self, step: Step, stream: Optional[int], key: tuple, captured: bool):
        """This run's ``(partials, address, counters, address, raw block to free)``; ``None`` (nothing
        allocated) when a capture has no zeroed counters left for a launch that merges in the grid."""
        split = step.split
        if split.n_splits == 1:
            # One slice: no partials, no counters. The kernels never dereference them: null
            # addresses (and a placeholder tensor for a launch that compiles).
            return None, 0, None, 0, 0
        ws = self.runner._workspace
        if ws is not None:
            return ws.partials, ws.partials.data_ptr(), ws.counters, ws.counters.data_ptr(), 0
        # A raw block only where every launch of this run is compiled (compiling takes tensors).
        raw = step.launch.ready(key) and (step.merge is None or step.merge.ready(key))
        parts, p_parts = _ws.new_partials(self.device, split.scratch_bytes, stream, raw)
        block = p_parts if parts is None else 0
        if not split.counters:  # a second merge launch: no counters
            return parts, p_parts, parts, p_parts, block
        cnt = _ws.counters(self.device, split.counters, _ws.stream_key_of(self._dev_index, stream), captured)
        if cnt is None:  # inside a capture with no zeroed counters left
            if block:
                free_raw(block)
            return None
        return parts, p_parts, cnt, cnt.data_ptr(), block

    def _launch_merge(self, step: Step, key, stream, out, lse_arg, parts, p_parts, strides) -> None:
        """The second merge launch (``SEPARATE_MERGE``): a subset of the verify launch's arguments,
        whose specialisation the same key fixes."""
        meta, tail = step.meta_ptrs, (step.split.lse_offset, *step.merge_scalars, *strides)
        grid = step.split.merge_grid
        if not step.merge.run_ptrs(key, grid, (out.data_ptr(), lse_arg.data_ptr(), meta[0], meta[1], meta[3],
                                               meta[7], p_parts, *tail), stream):
            m = step.meta
            step.merge(grid, (out, lse_arg, m[0], m[1], m[3], m[7], parts, *tail), stream, key)


def _variant(split: SplitPlan) -> tuple:
    """What a split plan's verify kernel is compiled for: who merges, and the merging programs' block."""
    return split.merge, split.merge_rows, split.merge_unroll, split.merge_dv
