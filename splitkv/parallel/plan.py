"""Plan once per step, run once per layer: :class:`ContextParallelVerify` and :class:`ContextParallelPlan`.

One step, on every rank of the group::

    1. local split-KV kernel over the local shard  -> (o_r, s_r)  into a send buffer
       (the draft block and the sinks on ``draft_rank`` only)
    2. all-gather of (o_r, s_r) into a receive buffer  (world rows of the send buffer)
    3. splitkv.merge_states over the world axis      -> (o, s) on the merging ranks

Nothing reads the device between the launches, so :meth:`ContextParallelPlan.run`
can be captured into a CUDA graph with the all-gather inside it (NCCL
collectives are capturable; run one step eagerly first so the communicator
exists). Ranks (``draft_rank``, ``dst``) are ranks *within* ``group``.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..gate import Decline, admit
from ..merge import merge_states
from ..options import VerifyOptions, metadata_of
from ..plan import VerifyPlan, VerifySplitKV
from ..validate import check_output
from ..launch import capturing
from .group import DstType, all_gather, dist, group_info, merging_ranks

__all__ = ["ContextParallelVerify", "ContextParallelPlan"]


class ContextParallelVerify:
    """Context-parallel split-KV verify attention for one head configuration.

    Every rank of ``group`` builds one with the same arguments. Each rank's
    plan/run takes its *local* prefix metadata (``kv_indptr``/``kv_indices``
    into its own pool, e.g. from :func:`~splitkv.parallel.shard_prefix`) and
    the same draft tensors as every other rank; the output on every merging
    rank is attention over the whole prefix and the drafts.

    Args:
        num_q_heads, num_kv_heads, head_dim, v_head_dim, max_len_extend, max_bs,
        device: as for :class:`splitkv.VerifySplitKV`.
        group: the process group sharing the prefix (default: the default group;
            without an initialised ``torch.distributed``, a world of one rank).
        draft_rank: the rank that attends the draft block and applies the sinks.
        dst: ranks that need the output: ``None`` (all), a rank, or a sequence
            of ranks. Every rank takes part in the all-gather; only these merge.
        partial_dtype: dtype of the exchanged partial outputs (default: the
            output's; ``torch.float32`` doubles the bytes exchanged for one
            rounding less). LSEs are always float32.
        **runner_kwargs: passed to :class:`splitkv.VerifySplitKV` (``n_splits``,
            ``split_tokens``, ``config``, ``num_sms``, ...).
    """

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, v_head_dim: int,
                 max_len_extend: int, max_bs: int, device=None, *, group=None, draft_rank: int = 0,
                 dst: DstType = None, partial_dtype: Optional[torch.dtype] = None, **runner_kwargs):
        self.group = group
        self.rank, self.world_size = group_info(group)
        if not 0 <= draft_rank < self.world_size:
            raise ValueError(f"draft_rank {draft_rank} is not a rank of a world of {self.world_size}")
        self.draft_rank = int(draft_rank)
        self.merging_ranks = merging_ranks(dst, self.world_size)
        self.partial_dtype = partial_dtype
        self.runner = VerifySplitKV(num_q_heads, num_kv_heads, head_dim, v_head_dim, max_len_extend, max_bs,
                                    device, **runner_kwargs)

    @property
    def owns_draft(self) -> bool:
        """Whether this rank attends the draft block (and the sinks)."""
        return self.rank == self.draft_rank

    @property
    def merges(self) -> bool:
        """Whether this rank merges (its runs return the output)."""
        return self.rank in self.merging_ranks

    def plan(self, q_extend, k_extend, v_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
             **options) -> "ContextParallelPlan":
        """Plan one step on this rank (every rank of the group calls it).

        Args:
            q_extend, k_extend, v_extend: the draft tensors, the same on every rank.
            k_buffer, v_buffer: this rank's pool (paged: ``[pages, page_size, H_KV, D]``
                with ``kv_last_page_len`` from :func:`~splitkv.parallel.shard_last_page_len`).
            qo_indptr: ``[bs + 1]`` draft rows, the same on every rank.
            kv_indptr, kv_indices: this rank's shard of the prefixes (local pool slots or pages).
            **options: as for :meth:`splitkv.VerifySplitKV.plan`, every rank giving the same
                values. The tree mask, on ``draft_rank``, is laid out for the *local* prefix
                lengths (:func:`~splitkv.parallel.shard_mask`); it and the sinks are applied on
                ``draft_rank`` only. ``return_lse``: merging runs write the merged natural-log
                LSE (sinks included). ``check="full"`` also has every rank compare its draft
                shapes with the others' (a collective; not under graph capture).

        Returns:
            The :class:`ContextParallelPlan`.

        Raises:
            ValueError: on malformed input, or (``check="full"``) ranks that disagree.
            TypeError: for an unknown option, or an ``is_causal`` or ``check`` of the wrong type.
            NotImplementedError: for the sliding window and the xai temperature (they need
                absolute positions, which a shard does not see) and for calls the split path
                declines (bf16 under the interpreter, more than 64 drafts per sequence, ...).
        """
        opts, meta = self.runner.plan_options(options)
        tensors = (q_extend, k_extend, v_extend, None, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices)
        return self._plan(tensors, meta, opts)

    def _plan(self, tensors: tuple, meta: dict, opts: VerifyOptions) -> "ContextParallelPlan":
        """:meth:`plan` for a call's tensors (:data:`splitkv.options.TENSORS`), metadata and options."""
        if opts.window is not None or opts.xai_len or meta["window_kv_offsets"] is not None:
            raise NotImplementedError("context parallelism takes no sliding window or xai temperature: "
                                      "they need absolute positions, which a shard's kernel does not see")
        kv_indices, meta = self._local_metadata(tensors[8], meta)
        tensors = tensors[:8] + (kv_indices,)
        found = admit(tensors, meta, opts)
        if isinstance(found, Decline):  # no baseline to fall back on across ranks
            if found.malformed:
                raise ValueError(found.reason)
            raise NotImplementedError(f"the split path declines this call: {found.reason}")
        # The local partial state always carries its LSE: the merge weighs the ranks by it.
        local = self.runner._plan(tensors, meta, opts._replace(return_lse=True),
                                  attend_draft=self.owns_draft, tile=found)
        return ContextParallelPlan(self, local, return_lse=opts.return_lse, check=opts.check)

    def _local_metadata(self, kv_indices, meta: dict):
        """What this rank's kernel takes of a step's metadata: ``(kv_indices, metadata by name)``.

        The mask and the sinks belong to the draft block, attended on ``draft_rank``
        only (``None`` elsewhere); an empty shard's ``kv_indices`` becomes one
        padding entry, so the kernel is never handed a null pointer.
        """
        if not self.owns_draft:
            meta = dict(meta, custom_mask=None, mask_indptr=None, sinks=None)
        if kv_indices.numel() == 0:
            kv_indices = torch.zeros(1, dtype=kv_indices.dtype, device=kv_indices.device)
        return kv_indices, meta

    def __call__(self, q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr,
                 kv_indices, **options):
        """Plan and run in one go; returns what :meth:`ContextParallelPlan.run` does (``o_extend`` on
        merging ranks, ``None`` elsewhere). ``options``: :meth:`plan`'s keywords (without ``return_lse``)."""
        plan = self.plan(q_extend, k_extend, v_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
                         **options)
        return plan.run(q_extend, k_extend, v_extend, k_buffer, v_buffer, out=o_extend)


class ContextParallelPlan:
    """One step's context-parallel launch on one rank; :meth:`run` runs it for a layer.

    Made by :meth:`ContextParallelVerify.plan`. Holds the local
    :class:`~splitkv.VerifyPlan` and the exchange buffers, allocated once:

    * ``send``: this rank's partial output ``[tokens, H_Q, Dv]`` (``partial_dtype``)
      then its LSE ``[tokens, H_Q]`` (float32), in one byte buffer (each part
      16-byte aligned), written directly by the kernel;
    * ``recv``: ``world_size`` such rows, filled by the all-gather.

    The buffers are reused by every run (every layer): do not run one plan on
    two streams at once. Rows past ``qo_indptr[-1]`` (a padded graph batch) are
    merged too, from whatever the send buffer holds there (the empty state,
    output 0, until a run writes them).

    Args:
        cp: the runner planning the step.
        local: the rank's local plan, made with ``return_lse`` (the merge weighs
            the ranks by their LSEs).
        return_lse: whether merging runs write the merged LSE into the caller's ``lse``.
        check: the plan's checks; ``"full"`` also has every rank compare its
            draft shapes with the others' now (a collective; not under graph capture).

    Attributes:
        local: the rank's :class:`~splitkv.VerifyPlan` (``attend_draft`` on
            ``draft_rank`` only).
        rank, world_size: this rank and the group's size.
        merges: whether :meth:`run` merges and returns the output here.
        comm_bytes: bytes this rank contributes to the all-gather.
    """

    def __init__(self, cp: ContextParallelVerify, local: VerifyPlan, *, return_lse: bool, check=False):
        self.cp = cp
        self.local = local
        self.group = cp.group
        self.rank, self.world_size = cp.rank, cp.world_size
        self.merges = cp.merges
        self.return_lse = return_lse
        n_tok, h_q, dv = local.out_shape
        self.out_shape = local.out_shape
        self.dtype = local.dtype
        self.device = local.device
        self.partial_dtype = cp.partial_dtype or local.dtype
        esize = torch.empty((), dtype=self.partial_dtype).element_size()
        self._o_bytes = _round16(n_tok * h_q * dv * esize)
        self.comm_bytes = self._o_bytes + _round16(n_tok * h_q * 4)
        if self.world_size > 1:
            if check == "full" and not capturing(self.device):
                self._check_ranks_agree()
            self._alloc_exchange()
        else:  # a world of one exchanges nothing: run() calls the local plan straight into the output
            self.send = self.recv = None
        # The merged LSE always has somewhere to go; without return_lse, here (not a per-run allocation).
        self._lse_scratch = torch.empty(n_tok, h_q, dtype=torch.float32, device=self.device)

    def _alloc_exchange(self) -> None:
        """The send and receive buffers, and the views the kernel, the all-gather and the merge use."""
        w = self.world_size
        self.send = torch.empty(self.comm_bytes, dtype=torch.uint8, device=self.device)
        self.recv = torch.empty(w * self.comm_bytes, dtype=torch.uint8, device=self.device)
        self.part_o, self.part_lse = self._views(self.send.view(1, -1))
        self.part_o, self.part_lse = self.part_o[:, 0], self.part_lse[:, 0]
        self.part_o.zero_()
        self.part_lse.fill_(float("-inf"))  # unwritten rows: the empty state
        self.recv_o, self.recv_lse = self._views(self.recv.view(w, -1))

    def _views(self, rows: torch.Tensor):
        """``[tokens, n, H, Dv]`` partial outputs and ``[tokens, n, H]`` LSEs of byte rows ``[n, bytes]``."""
        n_tok, h_q, dv = self.out_shape
        n = rows.shape[0]
        o = rows[:, : n_tok * h_q * dv * torch.empty((), dtype=self.partial_dtype).element_size()]
        o = o.view(self.partial_dtype).view(n, n_tok, h_q, dv).permute(1, 0, 2, 3)
        lse = rows[:, self._o_bytes: self._o_bytes + n_tok * h_q * 4].view(torch.float32)
        lse = lse.view(n, n_tok, h_q).permute(1, 0, 2)
        return o, lse

    def _check_ranks_agree(self) -> None:
        mine = (tuple(self.out_shape), str(self.partial_dtype), self.local.batch_size, self.comm_bytes)
        every = [None] * self.world_size
        dist.all_gather_object(every, mine, group=self.group)
        if any(x != mine for x in every):
            raise ValueError(f"ranks planned different draft shapes (tokens, heads, dims, dtype, batch, bytes): "
                             f"{every}")

    def rebind(self, qo_indptr, kv_indptr, kv_indices, **metadata) -> None:
        """Point the plan at another step's metadata of the same signature (see :meth:`splitkv.VerifyPlan.rebind`;
        ``metadata``: the tensors of :data:`splitkv.options.METADATA` by name)."""
        kv_indices, meta = self.cp._local_metadata(kv_indices, metadata_of(metadata))
        self.local.rebind(qo_indptr, kv_indptr, kv_indices, **meta)

    # The three stages, separately (the benchmark times them one by one).

    def run_local(self, q_extend, k_extend, v_extend, k_buffer, v_buffer) -> None:
        """Stage 1: the local split-KV kernel, writing this rank's partial state into the send buffer."""
        self.local.run(q_extend, k_extend, v_extend, k_buffer, v_buffer, out=self.part_o, lse=self.part_lse)

    def exchange(self) -> None:
        """Stage 2: all-gather every rank's partial state into the receive buffer."""
        all_gather(self.recv, self.send, self.group)

    def merge(self, out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None):
        """Stage 3: merge the gathered states (:func:`splitkv.merge_states`); returns ``(out, lse)``."""
        if out is None:
            out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        return merge_states(self.recv_o, self.recv_lse, out=out, out_lse=self._lse_scratch if lse is None else lse)

    def run(self, q_extend, k_extend, v_extend, k_buffer, v_buffer, *, out=None, lse=None):
        """Run the step for one layer's tensors (same shapes, dtypes and strides as planned).

        Every rank of the group must call it (it holds a collective). As
        :meth:`splitkv.VerifyPlan.run`: ``out`` is returned, and a plan made
        with ``return_lse`` writes the merged LSE into the ``lse`` the caller
        passes.

        Args:
            q_extend, k_extend, v_extend: the layer's draft tensors.
            k_buffer, v_buffer: the layer's local pool.
            out: ``[tokens, H_Q, Dv]`` output on merging ranks, unit stride in
                its last dimension (default: new).
            lse: ``[tokens, H_Q]`` contiguous float32 for the merged
                natural-log LSE; required on merging ranks by a plan made with
                ``return_lse``, refused by others. Ranks that do not merge use
                neither ``out`` nor ``lse``.

        Returns:
            On merging ranks ``out``; ``None`` elsewhere.

        Raises:
            ValueError: for a tensor of another device, dtype, shape or strides
                than planned, a malformed ``out`` or ``lse`` (on a merging rank,
                after the all-gather: no rank is left waiting in it); with a
                checked plan, :class:`splitkv.errors.VerifyError` for a fault the
                local kernel found.
            NotImplementedError: :class:`splitkv.resources.OutOfDeviceResources` where the local
                kernel's compile runs out of the device's resources, before the all-gather (every
                rank compiles the same kernel for the same device, so every rank declines alike).
        """
        if self.world_size > 1:
            self.run_local(q_extend, k_extend, v_extend, k_buffer, v_buffer)
            self.exchange()
            if not self.merges:
                return None
        if out is None:
            out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        check_output(out, lse, self.out_shape, self.return_lse)
        if lse is None:
            lse = self._lse_scratch  # the merged LSE always has somewhere to go
        if self.world_size == 1:  # nothing to exchange: the local call is the whole step
            self.local.run(q_extend, k_extend, v_extend, k_buffer, v_buffer, out=out, lse=lse)
        else:
            self.merge(out, lse)
        return out


def _round16(n: int) -> int:
    """``n`` bytes rounded up to 16: each part of an exchange row starts 16-byte aligned."""
    return -(-n // 16) * 16
