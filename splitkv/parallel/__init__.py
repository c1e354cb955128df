"""Context-parallel verify: every sequence's prefix sharded over ranks, partial states merged exactly.

At a long context one GPU spends the whole verify step streaming the prefix
K/V from its memory. Context parallelism splits that read: each rank of a
process group holds a *shard* of every sequence's prefix in its own token pool
(a quarter of a 1M-token context on each of 4 GPUs), all ranks receive the same
draft queries, and each attends to its own keys only. What a rank computes is
an attention *state* over a disjoint key set (:mod:`splitkv.merge`)::

    rank r:  (o_r, s_r)    o_r: output over its keys,  s_r = log sum_{j on r} exp(score_j)

and attention over the whole prefix is their LSE-weighted mean, exactly::

    s = log sum_r exp(s_r)          o = sum_r exp(s_r - s) * o_r

One step, on every rank::

    1. local split-KV kernel over the local shard  -> (o_r, s_r)  into a send buffer
       (the draft block and the sinks on ``draft_rank`` only)
    2. all-gather of (o_r, s_r) into a receive buffer  (world rows of the send buffer)
    3. splitkv.merge_states over the world axis      -> (o, s) on the merging ranks

The exchange is ``tokens x heads x (Dv x 2 + 4)`` bytes per rank (bf16
partials, float32 LSE) whatever the context length: 260 KiB for 8 sequences of
4 drafts at 32 heads x 128, against gigabytes of prefix K/V. Nothing reads the
device between the launches: a step plans once (:meth:`ContextParallelVerify.plan`)
and its :meth:`ContextParallelPlan.run` can be captured into a CUDA graph with
the all-gather inside it (NCCL collectives are capturable; run one step eagerly
first so the communicator exists).

The draft block. Each draft token sees its own sequence's draft tokens (causal
or a tree mask). Those keys are attended on exactly one rank, ``draft_rank``;
the others launch with ``attend_draft=False``. Attention sinks add
``exp(sink)`` to the denominator once, so they too are applied on
``draft_rank`` only; its LSE includes them and the merge carries them through.

Sharding. How the prefix is cut is the caller's (the engine's) choice, as long
as every key is on exactly one rank; :func:`shard_prefix` implements the two
usual layouts, by contiguous chunks and by round-robin blocks (its docstring
draws them), and :func:`shard_mask` re-lays a tree mask for a rank's local
prefix length. A rank holding no key of a sequence (an *empty shard*: a short
sequence, or a round-robin block not yet reached) computes the empty state
``s_r = -inf``, which weighs 0 in the merge.

Paged pools. With ``k_buffer``/``v_buffer`` of shape ``[pages, page_size,
H_KV, D]`` the entries of ``kv_indices`` are page ids (:mod:`splitkv.paged`),
and a rank holds whole pages: :func:`shard_prefix` deals them out like
tokens (``block`` then counts pages), :func:`shard_last_page_len` gives the
rank's ``kv_last_page_len`` (the sequence's own on the rank holding its last
page, a full page elsewhere, 0 where it holds none), and :func:`shard_mask`
takes ``page_size`` and ``kv_last_page_len`` to lay a tree mask out in keys.

Score features. The logit cap changes each score alone, so it is served as on
one GPU. The sliding window and the xai temperature depend on each key's and
query's absolute position, which a shard's kernel does not see (it counts
positions within the shard): the context-parallel entries do not take them.

Entry points:

* :class:`ContextParallelVerify` -- plan once per step, run once per layer,
  like :class:`splitkv.VerifySplitKV`; send/receive buffers are allocated at
  plan time (runs allocate only what a :class:`~splitkv.VerifyPlan` run does:
  the output if none is given, the split-KV scratch) and are graph-capturable;
* :func:`cp_verify_attention` -- one call (plans cached by signature), the
  arguments of :func:`splitkv.verify_attention` (the 9 tensors up to
  ``kv_indices`` positional, everything after as keywords of the same names);
* :func:`shard_prefix`, :func:`shard_mask`, :func:`shard_owner`,
  :func:`shard_last_page_len` -- sharding metadata for engines;
* for tests and notebooks, :mod:`splitkv.testing.parallel`: shard a
  :class:`~splitkv.testing.VerifyProblem`, run a whole world in one process,
  or spawn a local gloo world on ``127.0.0.1`` (CPU, Triton interpreter).

Ranks (``draft_rank``, ``dst``) are ranks *within* ``group``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple, Optional, Sequence, Tuple, Union

import torch

from ..validate import check_batch_invariant, check_mode, check_output, check_verify_inputs, check_verify_values
from ..gate import decline_reason
from ..merge import merge_states
from ..paged import paged_prefix_lens, token_indices
from ..plan import VerifyPlan, VerifySplitKV

try:
    import torch.distributed as dist
except ImportError:  # pragma: no cover - builds without distributed
    dist = None

__all__ = [
    "ContextParallelVerify",
    "ContextParallelPlan",
    "PrefixShard",
    "SHARD_MODES",
    "ROUND_ROBIN_BLOCK",
    "cp_verify_attention",
    "shard_owner",
    "shard_prefix",
    "shard_mask",
    "shard_last_page_len",
    "clear_cp_caches",
]

#: The prefix layouts :func:`shard_prefix` knows.
SHARD_MODES = ("chunk", "round_robin")
#: Default block (tokens) of the round-robin layout; the chunk layout defaults to 1.
ROUND_ROBIN_BLOCK = 256

DstType = Union[None, int, Sequence[int]]


# ---- Sharding ------------------------------------------------------------------------------------


class PrefixShard(NamedTuple):
    """One rank's shard of a batch's prefixes (see :func:`shard_prefix`).

    Attributes:
        kv_indptr: ``[bs + 1]`` int32, the local ranges of ``kv_indices`` (starts at 0).
        kv_indices: the pool slots of the local keys (entries of the global
            ``kv_indices``, in prefix order; at least one entry, see below).
        positions: ``[n_local]`` int64, each local key's position in its
            sequence's prefix (what a rebuilt mask needs).
        prefix_lens: ``[bs]`` int64, keys per sequence on this rank.
    """

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    positions: torch.Tensor
    prefix_lens: torch.Tensor


def _check_shard_args(world_size: int, rank: int, mode: str, block: Optional[int]) -> int:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank {rank} of {world_size}")
    if mode not in SHARD_MODES:
        raise ValueError(f"unknown shard mode {mode!r}: one of {SHARD_MODES}")
    if block is None:
        block = 1 if mode == "chunk" else ROUND_ROBIN_BLOCK
    if int(block) < 1:
        raise ValueError(f"block must be a positive number of tokens, got {block}")
    return int(block)


def shard_owner(positions: torch.Tensor, prefix_lens: torch.Tensor, world_size: int,
                mode: str = "chunk", block: Optional[int] = None) -> torch.Tensor:
    """The rank holding each prefix position (element-wise, any device).

    Args:
        positions: int64 positions in their sequence's prefix.
        prefix_lens: the prefix length of each position's sequence (same shape).
        world_size: ranks.
        mode: ``"chunk"`` or ``"round_robin"`` (see :func:`shard_prefix`).
        block: tokens per block (default 1 for chunks, :data:`ROUND_ROBIN_BLOCK` for round robin).

    Returns:
        int64 ranks, the shape of ``positions``.
    """
    block = _check_shard_args(world_size, 0, mode, block)
    page = positions // block
    if mode == "round_robin":
        return page % world_size
    n_pages = torch.div(prefix_lens + block - 1, block, rounding_mode="floor").clamp_min(1)
    return torch.div((page + 1) * world_size - 1, n_pages, rounding_mode="floor")


def shard_prefix(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, world_size: int, rank: int,
                 mode: str = "chunk", block: Optional[int] = None) -> PrefixShard:
    """Rank ``rank``'s shard of every sequence's prefix.

    Sequence ``b``'s prefix (``n`` keys, entries ``kv_indptr[b]:kv_indptr[b+1]``
    of ``kv_indices``) is cut into ``P = ceil(n / block)`` blocks of ``block``
    tokens (the last one may be short), and whole blocks are dealt to ranks::

        prefix of one sequence, P = 10 blocks, world_size = 2

        position      0 ......................................................... n-1
        block         | 0  | 1  | 2  | 3  | 4  | 5  | 6  | 7  | 8  | 9  |
        chunk         |        rank 0            |        rank 1            |
        round_robin   | r0 | r1 | r0 | r1 | r0 | r1 | r0 | r1 | r0 | r1 |
                                                                       then the draft block
                                                                       (on draft_rank only)

    * ``"chunk"``: rank ``r`` holds blocks ``[floor(r P / W), floor((r+1) P / W))``,
      one contiguous run (balanced to a block). ``block`` (default 1: token
      granularity) aligns the cuts to pages.
    * ``"round_robin"``: block ``p`` is on rank ``p % W`` (default block
      :data:`ROUND_ROBIN_BLOCK` tokens). A growing sequence keeps the ranks
      balanced: the next block goes to the next rank, and nothing moves.

    A sequence with fewer blocks than ranks leaves some ranks an *empty shard*
    (no key of it); they contribute the empty state, which weighs 0. Which
    keys a rank holds never changes the result, only the balance of work.

    Reads ``kv_indptr`` on the host (a plan-time step, not for graph capture).

    Args:
        kv_indptr: ``[bs + 1]`` global ranges of ``kv_indices``.
        kv_indices: global pool slots of the prefixes.
        world_size: ranks sharing the prefix.
        rank: this rank (``0 <= rank < world_size``).
        mode: ``"chunk"`` or ``"round_robin"``.
        block: tokens per block (see above).

    Returns:
        A :class:`PrefixShard`: local ``kv_indptr`` (int32, from 0) and
        ``kv_indices`` (the global slots this rank holds, same dtype), each key's
        prefix position, and the local prefix lengths. ``kv_indices`` has at
        least one entry (a padding 0 past ``kv_indptr[-1]`` when the shard is
        empty), so a device pointer is never null.

    Raises:
        ValueError: on a bad rank, mode or block, or a decreasing ``kv_indptr``.
    """
    block = _check_shard_args(world_size, rank, mode, block)
    device = kv_indices.device
    kvp = kv_indptr.to(device=device, dtype=torch.int64)
    bs = kvp.shape[0] - 1
    lens = kvp[1:] - kvp[:-1]
    if bs < 1 or bool((lens < 0).any()):
        raise ValueError("kv_indptr must have >= 2 entries and never decrease")
    lo, hi = int(kvp[0]), int(kvp[-1])
    j = torch.arange(lo, hi, device=device, dtype=torch.int64)
    seq = torch.searchsorted(kvp, j, right=True) - 1  # sequence of every entry
    pos = j - kvp[seq]
    keep = shard_owner(pos, lens[seq], world_size, mode, block) == rank
    local = kv_indices[lo:hi][keep]
    positions = pos[keep]
    counts = torch.bincount(seq[keep], minlength=bs)
    indptr = torch.zeros(bs + 1, dtype=torch.int32, device=device)
    indptr[1:] = torch.cumsum(counts, 0)
    if local.numel() == 0:
        local = torch.zeros(1, dtype=kv_indices.dtype, device=device)
    return PrefixShard(indptr, local, positions, counts)


def shard_last_page_len(shard: PrefixShard, kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor,
                        page_size: int) -> torch.Tensor:
    """A rank's ``kv_last_page_len`` for its shard of a paged prefix.

    With a paged pool the entries :func:`shard_prefix` deals out are pages, in
    prefix order. A sequence's last page holds ``kv_last_page_len[b]`` keys,
    every other page ``page_size``; the rank holding the last page has it last
    in its local list, so its local last-page length is the sequence's own;
    on every other rank the local last page is full::

        pages of one sequence (page_size 4, last page 2 rows), two ranks, chunks
        global:  [####][####][####][##  ]      kv_last_page_len = 2
        rank 0:  [####][####]                  local last page len 4
        rank 1:              [####][##  ]      local last page len 2

    Args:
        shard: the rank's :class:`PrefixShard` of the page entries.
        kv_indptr: ``[bs + 1]`` *global* ranges of the page ids.
        kv_last_page_len: ``[bs]`` global last-page lengths.
        page_size: rows per page.

    Returns:
        ``[bs]`` int32 on ``kv_last_page_len``'s device (0 for a sequence
        this rank holds no page of, as for a sequence without prefix).
    """
    device = kv_last_page_len.device
    kvp = kv_indptr.to(device=device, dtype=torch.int64)
    n_pages = kvp[1:] - kvp[:-1]
    ptr = shard.kv_indptr.to(device=device, dtype=torch.int64)
    held = ptr[1:] > ptr[:-1]
    positions = shard.positions.to(device)
    # Entries are in prefix order: the rank holds the last page iff its own last entry is it.
    last_entry = positions[(ptr[1:] - 1).clamp_min(0)] if positions.numel() else torch.zeros_like(n_pages)
    holds_last = held & (last_entry == n_pages - 1)
    full = torch.full_like(kv_last_page_len, page_size)
    return torch.where(held, torch.where(holds_last, kv_last_page_len, full), 0).to(torch.int32)


def _key_shard(shard: PrefixShard, kv_indptr: torch.Tensor, page_size: int,
               kv_last_page_len: torch.Tensor) -> Tuple[PrefixShard, torch.Tensor]:
    """A paged shard seen key by key: ``(shard of keys, global keys per sequence)``.

    Local page ``q`` of sequence ``b`` holds keys ``q * page_size + [0, rows)``.
    That is :func:`splitkv.paged.token_indices` with page *positions* in
    place of page ids: the "slots" it returns are the keys' positions. Only
    the positions and counts are filled in (what :func:`shard_mask` reads).
    """
    device = shard.positions.device
    local_last = shard_last_page_len(shard, kv_indptr, kv_last_page_len.to(device), page_size)
    key_ptr, key_pos = token_indices(shard.kv_indptr.to(device), shard.positions, local_last, page_size)
    key_ptr = key_ptr.to(torch.int64)
    shard_of_keys = PrefixShard(key_ptr, shard.kv_indices, key_pos.to(torch.int64), key_ptr[1:] - key_ptr[:-1])
    return shard_of_keys, paged_prefix_lens(kv_indptr.to(device), kv_last_page_len.to(device), page_size)


def shard_mask(custom_mask: torch.Tensor, mask_indptr: torch.Tensor, qo_indptr: torch.Tensor,
               kv_indptr: torch.Tensor, shard: PrefixShard, *, page_size: int = 1,
               kv_last_page_len: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """A tree mask re-laid for a rank's local prefix.

    The kernel reads row ``l`` of sequence ``b``'s mask as ``[prefix keys |
    draft keys]`` with the *local* call's prefix length ``n_r`` (the draft
    entry ``j`` at ``mask_indptr[b] + l (n_r + L) + n_r + j``), so the global
    mask (rows of width ``n + L``) cannot be passed to a shard as it is::

        global row l (width n + L):    [ k_0 k_1 ... k_{n-1}             | d_0 ... d_{L-1} ]
        local row l (width n_r + L):   [ the n_r keys this rank holds    | d_0 ... d_{L-1} ]

    The local mask keeps, in every row, the global mask's columns of the keys
    the rank holds (in local order) and the whole draft block. (The split path
    reads only the draft part; the prefix part is kept so the local mask means
    what the global one does, restricted to the local keys.)

    Args:
        custom_mask: the global flat mask (bool/uint8).
        mask_indptr: ``[bs + 1]`` starts of each sequence's global mask.
        qo_indptr: ``[bs + 1]`` draft rows of each sequence.
        kv_indptr: ``[bs + 1]`` *global* prefix ranges (for the global widths).
        shard: the rank's :class:`PrefixShard` from :func:`shard_prefix`.
        page_size, kv_last_page_len: for a paged pool (the shard deals pages):
            the mask's columns are keys, which these turn the pages into.

    Returns:
        ``(local_mask, local_mask_indptr)``: same dtype as ``custom_mask``,
        int64 indptr. Reads lengths on the host (plan time).
    """
    device = custom_mask.device
    i64 = torch.int64
    qo = qo_indptr.to(device=device, dtype=i64)
    kvp = kv_indptr.to(device=device, dtype=i64)
    mp = mask_indptr.to(device=device, dtype=i64)
    n_draft = qo[1:] - qo[:-1]
    if kv_last_page_len is not None:
        shard, n_glob = _key_shard(shard, kvp, page_size, kv_last_page_len.to(device))
    else:
        n_glob = kvp[1:] - kvp[:-1]
    n_loc = shard.prefix_lens.to(device=device, dtype=i64)
    loc_ptr = shard.kv_indptr.to(device=device, dtype=i64)
    positions = shard.positions.to(device)
    width = n_loc + n_draft
    sizes = n_draft * width
    out_ptr = torch.zeros(len(sizes) + 1, dtype=i64, device=device)
    out_ptr[1:] = torch.cumsum(sizes, 0)
    total = int(out_ptr[-1])
    t = torch.arange(total, device=device, dtype=i64)
    b = torch.searchsorted(out_ptr, t, right=True) - 1
    rem = t - out_ptr[b]
    row = torch.div(rem, width[b], rounding_mode="floor")
    col = rem - row * width[b]
    in_prefix = col < n_loc[b]
    pos_idx = torch.where(in_prefix, loc_ptr[b] + col, 0)
    prefix_col = positions[pos_idx] if positions.numel() else torch.zeros_like(col)
    glob_col = torch.where(in_prefix, prefix_col, n_glob[b] + col - n_loc[b])
    src = mp[b] + row * (n_glob[b] + n_draft[b]) + glob_col
    return custom_mask[src], out_ptr


# ---- The context-parallel runner -----------------------------------------------------------------


def _group_info(group) -> Tuple[int, int]:
    """``(rank, world_size)`` in ``group``; ``(0, 1)`` without an initialised process group."""
    if dist is None or not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialised")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _merging_ranks(dst: DstType, world_size: int) -> Tuple[int, ...]:
    if dst is None:
        return tuple(range(world_size))
    ranks = (int(dst),) if isinstance(dst, int) else tuple(sorted({int(r) for r in dst}))
    if not ranks or any(not 0 <= r < world_size for r in ranks):
        raise ValueError(f"dst must name ranks in [0, {world_size}), got {dst!r}")
    return ranks


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    """``all_gather_into_tensor`` (``all_gather_single`` where torch renamed it)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _round16(n: int) -> int:
    return -(-n // 16) * 16


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class ContextParallelVerify:
    """Context-parallel split-KV verify attention for one head configuration.

    Every rank of ``group`` builds one with the same arguments. Each rank's
    plan/run takes its *local* prefix metadata (``kv_indptr``/``kv_indices``
    into its own pool, e.g. from :func:`shard_prefix`) and the same draft
    tensors as every other rank; the output on every merging rank is attention
    over the whole prefix and the drafts.

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
        self.rank, self.world_size = _group_info(group)
        if not 0 <= draft_rank < self.world_size:
            raise ValueError(f"draft_rank {draft_rank} is not a rank of a world of {self.world_size}")
        self.draft_rank = int(draft_rank)
        self.merging_ranks = _merging_ranks(dst, self.world_size)
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

    def plan(
        self,
        q_extend, k_extend, v_extend, k_buffer, v_buffer,
        qo_indptr, kv_indptr, kv_indices, *,
        custom_mask=None, mask_indptr=None, is_causal: bool = True,
        sm_scale: Optional[float] = None, k_scale: float = 1.0, v_scale: float = 1.0,
        sinks=None, return_lse: bool = False, check=False,
        logit_cap: float = 0.0, kv_last_page_len=None,
    ) -> "ContextParallelPlan":
        """Plan one step on this rank (every rank of the group calls it).

        Everything after ``kv_indices`` is a keyword, named as for
        :meth:`splitkv.VerifySplitKV.plan`.

        Args:
            q_extend, k_extend, v_extend: the draft tensors, the same on every rank.
            k_buffer, v_buffer: this rank's token pool.
            qo_indptr: ``[bs + 1]`` draft rows, the same on every rank.
            kv_indptr, kv_indices: this rank's shard of the prefixes (local pool slots).
            custom_mask, mask_indptr: on ``draft_rank``, the tree mask laid out
                for the *local* prefix lengths (:func:`shard_mask`); ignored elsewhere.
            is_causal: draft-block visibility without a mask (``draft_rank``; a bool).
            sm_scale, k_scale, v_scale: as for :meth:`splitkv.VerifySplitKV.plan`.
            sinks: ``[H_Q]`` sink logits (may be given on every rank; applied on
                ``draft_rank`` only).
            return_lse: runs also write the merged natural-log LSE (sinks
                included) into the ``lse`` a merging rank then passes to
                :meth:`ContextParallelPlan.run`.
            check: ``True``: the local kernel validates the metadata of every run
                and :meth:`ContextParallelPlan.run` raises what it found
                (:class:`splitkv.errors.VerifyError`); ``"full"``: that, and now, on
                the host, the metadata values
                (:func:`splitkv.validate.check_verify_values`) and that every rank
                planned the same draft shapes (reads the device and talks to the
                group: skipped under graph capture); ``False``: neither (every
                rank must give the same value).
            logit_cap: if ``> 0``, scores ``s`` become ``cap * tanh(s / cap)`` (on
                every rank: give the same value everywhere).
            kv_last_page_len: ``[bs]`` for a paged local pool (``k_buffer`` of
                shape ``[pages, page_size, H_KV, D]``, ``kv_indices`` page ids):
                this rank's last-page lengths (:func:`shard_last_page_len`).

        Returns:
            The :class:`ContextParallelPlan`.

        Raises:
            ValueError: on malformed input, or (``check="full"``) ranks that disagree.
            TypeError: for an ``is_causal`` or ``check`` of the wrong type.
            NotImplementedError: for calls the split path declines (bf16 under
                the interpreter, more than 64 drafts per sequence, ...).
        """
        if not isinstance(is_causal, bool):
            raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
        check_mode(check)
        draft = self.owns_draft
        if not draft:
            custom_mask = mask_indptr = sinks = None
        if kv_indices.numel() == 0:  # an empty shard: never hand the kernel a null pointer
            kv_indices = torch.zeros(1, dtype=kv_indices.dtype, device=kv_indices.device)
        reason = decline_reason(q_extend, k_extend, v_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
                                max_len_extend=self.runner.max_len_extend, custom_mask=custom_mask,
                                mask_indptr=mask_indptr, is_causal=is_causal, sinks=sinks, logit_cap=logit_cap,
                                k_scale=k_scale, v_scale=v_scale, sm_scale=sm_scale, max_bs=self.runner.max_bs,
                                split_tokens=self.runner.split_tokens, max_prefix_len=self.runner.max_prefix_len,
                                kv_last_page_len=kv_last_page_len)
        if reason is not None:
            if reason.startswith("malformed input"):
                raise ValueError(reason)
            raise NotImplementedError(f"the split path declines this call: {reason}")
        local = self.runner.plan(
            q_extend, k_extend, v_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
            custom_mask=custom_mask, mask_indptr=mask_indptr, is_causal=is_causal, sm_scale=sm_scale,
            k_scale=k_scale, v_scale=v_scale, sinks=sinks, return_lse=True, attend_draft=draft, check=check,
            logit_cap=logit_cap, kv_last_page_len=kv_last_page_len,
        )
        return ContextParallelPlan(self, local, return_lse=return_lse, check=check)

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
        pdt = cp.partial_dtype or local.dtype
        self.partial_dtype = pdt
        esize = torch.empty((), dtype=pdt).element_size()
        self._o_bytes = _round16(n_tok * h_q * dv * esize)
        lse_bytes = _round16(n_tok * h_q * 4)
        self.comm_bytes = self._o_bytes + lse_bytes
        w = self.world_size
        if w > 1:
            if check == "full" and not _capturing():
                self._check_ranks_agree()
            self.send = torch.empty(self.comm_bytes, dtype=torch.uint8, device=self.device)
            self.recv = torch.empty(w * self.comm_bytes, dtype=torch.uint8, device=self.device)
            self.part_o, self.part_lse = self._views(self.send.view(1, -1))
            self.part_o, self.part_lse = self.part_o[:, 0], self.part_lse[:, 0]
            self.part_o.zero_()
            self.part_lse.fill_(float("-inf"))  # unwritten rows: the empty state
            self.recv_o, self.recv_lse = self._views(self.recv.view(w, -1))
        else:
            self.send = self.recv = None
        # The merged LSE always has somewhere to go; without return_lse, here (not a per-run allocation).
        self._lse_scratch = torch.empty(n_tok, h_q, dtype=torch.float32, device=self.device)

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

    def rebind(self, qo_indptr, kv_indptr, kv_indices, custom_mask=None, mask_indptr=None, sinks=None,
               kv_last_page_len=None) -> None:
        """Point the plan at another step's metadata of the same signature (see :meth:`splitkv.VerifyPlan.rebind`)."""
        if not self.cp.owns_draft:
            custom_mask = mask_indptr = sinks = None
        if kv_indices.numel() == 0:
            kv_indices = torch.zeros(1, dtype=kv_indices.dtype, device=kv_indices.device)
        self.local.rebind(qo_indptr, kv_indptr, kv_indices, custom_mask=custom_mask, mask_indptr=mask_indptr,
                          sinks=sinks, kv_last_page_len=kv_last_page_len)

    # The three stages, separately (the benchmark times them one by one).

    def run_local(self, q_extend, k_extend, v_extend, k_buffer, v_buffer) -> None:
        """Stage 1: the local split-KV kernel, writing this rank's partial state into the send buffer."""
        self.local.run(q_extend, k_extend, v_extend, k_buffer, v_buffer, out=self.part_o, lse=self.part_lse)

    def exchange(self) -> None:
        """Stage 2: all-gather every rank's partial state into the receive buffer."""
        _all_gather(self.recv, self.send, self.group)

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


# ---- One call ------------------------------------------------------------------------------------

_CP_RUNNERS: dict = {}
_CP_PLANS: "OrderedDict[tuple, ContextParallelPlan]" = OrderedDict()
CP_PLAN_CACHE_SIZE = 128


def clear_cp_caches() -> None:
    """Drop :func:`cp_verify_attention`'s cached runners and plans."""
    _CP_RUNNERS.clear()
    _CP_PLANS.clear()


def cp_verify_attention(
    q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer,
    qo_indptr, kv_indptr, kv_indices, *,
    max_len_extend,
    custom_mask=None,
    mask_indptr=None,
    is_causal=True,
    k_scale=1.0,
    v_scale=1.0,
    sm_scale=None,
    logit_cap=0.0,
    sinks=None,
    kv_last_page_len=None,
    max_bs: Optional[int] = None,
    split_tokens: Optional[int] = None,
    max_prefix_len: Optional[int] = None,
    check=True,
    return_lse: bool = False,
    group=None,
    draft_rank: int = 0,
    dst: DstType = None,
):
    """Context-parallel verify attention in one call (every rank of ``group`` calls it).

    The arguments of :func:`splitkv.verify_attention` (the tensors up to
    ``kv_indices`` positional, ``o_extend`` may be ``None``; everything after
    is a keyword of the same name), with this rank's prefix shard in
    ``k_buffer``/``v_buffer``/``kv_indptr``/``kv_indices`` (and, on
    ``draft_rank``, the mask laid out for it: :func:`shard_mask`). Of the score
    features only ``logit_cap`` (see the module docstring). Plans are cached by
    signature (shapes, strides, dtypes, scalars; not ``kv_indices``' length),
    so a repeated call only rebinds metadata, runs the kernel, the all-gather
    and the merge: graph-capturable once a call of the signature has run
    eagerly.

    Args:
        max_len_extend: most draft tokens of any sequence (required).
        group, draft_rank, dst: see :class:`ContextParallelVerify`.
        return_lse: also return the merged natural-log LSE.
        max_bs: largest batch of this shape (default: this batch).
        split_tokens, max_prefix_len: the batch-invariant mode (fixed slices),
            see :class:`splitkv.VerifySplitKV`; ``max_prefix_len`` bounds this
            rank's local prefixes.
        check: ``True`` (default): the local kernel validates the metadata
            (:class:`splitkv.errors.VerifyError` at this call or the next);
            ``"full"``: also the synchronous host checks of
            :meth:`ContextParallelVerify.plan` on every call (skipped under
            graph capture); ``False``: none. Give every rank the same value.
        logit_cap: as for :meth:`ContextParallelVerify.plan`.
        kv_last_page_len: this rank's last-page lengths, for a paged local pool
            (:func:`shard_last_page_len`).

    Returns:
        On merging ranks ``o_extend`` (new if ``None``), or ``(o, lse)`` with
        ``return_lse``; ``None`` elsewhere.

    Raises:
        ValueError: on malformed input (and what :meth:`ContextParallelVerify.plan`
            and :meth:`ContextParallelPlan.run` raise).
        TypeError: for a ``check`` or ``is_causal`` of the wrong type.
        NotImplementedError: for calls the split path declines.
    """
    check_mode(check)
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    check_batch_invariant(split_tokens, max_prefix_len)
    rank, world = _group_info(group)
    dims = check_verify_inputs(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr,
                               kv_indices, custom_mask if rank == draft_rank else None,
                               mask_indptr if rank == draft_rank else None, max_len_extend, sinks,
                               kv_last_page_len=kv_last_page_len)
    bs = dims.batch_size
    max_bs = max(max_bs or 1, bs)
    rkey = (id(group), rank, world, str(q_extend.device), dims.num_q_heads, dims.num_kv_heads, dims.head_dim,
            dims.v_head_dim, int(max_len_extend), split_tokens, max_prefix_len, draft_rank,
            None if dst is None else (dst if isinstance(dst, int) else tuple(dst)))
    cp = _CP_RUNNERS.get(rkey)
    if cp is None:
        cp = _CP_RUNNERS[rkey] = ContextParallelVerify(
            dims.num_q_heads, dims.num_kv_heads, dims.head_dim, dims.v_head_dim, int(max_len_extend), max_bs,
            q_extend.device, group=group, draft_rank=draft_rank, dst=dst, split_tokens=split_tokens,
            max_prefix_len=max_prefix_len)
    cp.runner.max_bs = max(cp.runner.max_bs, max_bs)
    use_mask = custom_mask is not None and rank == draft_rank
    t = (q_extend, k_extend, v_extend, k_buffer, v_buffer)
    key = (rkey, tuple(x.shape for x in t), tuple(x.stride() for x in t), tuple(x.dtype for x in t),
           qo_indptr.shape, qo_indptr.dtype, kv_indptr.dtype, kv_indices.dtype, use_mask,
           None if not use_mask else (custom_mask.dtype, mask_indptr.dtype),
           None if sinks is None else (sinks.dtype,), is_causal, float(k_scale), float(v_scale),
           sm_scale, return_lse, float(logit_cap),
           None if kv_last_page_len is None else (kv_last_page_len.shape, kv_last_page_len.dtype), check)
    plan = _CP_PLANS.get(key)
    if plan is not None:
        _CP_PLANS.move_to_end(key)
        plan.rebind(qo_indptr, kv_indptr, kv_indices, custom_mask if use_mask else None,
                    mask_indptr if use_mask else None, sinks, kv_last_page_len)
        if check == "full" and not _capturing():
            check_verify_values(qo_indptr, kv_indptr, kv_indices, k_buffer.shape[0], int(max_len_extend),
                                custom_mask if use_mask else None, mask_indptr if use_mask else None,
                                num_tokens=dims.num_tokens, kv_last_page_len=kv_last_page_len,
                                page_size=dims.page_size)
    else:
        plan = cp.plan(q_extend, k_extend, v_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
                       custom_mask=custom_mask, mask_indptr=mask_indptr, is_causal=is_causal, sm_scale=sm_scale,
                       k_scale=k_scale, v_scale=v_scale, sinks=sinks, return_lse=return_lse, check=check,
                       logit_cap=logit_cap, kv_last_page_len=kv_last_page_len)
        _CP_PLANS[key] = plan
        if len(_CP_PLANS) > CP_PLAN_CACHE_SIZE:
            _CP_PLANS.popitem(last=False)
    if not plan.merges:
        plan.run(q_extend, k_extend, v_extend, k_buffer, v_buffer)
        return None
    if o_extend is None:
        o_extend = torch.empty(plan.out_shape, dtype=plan.dtype, device=plan.device)
    lse = torch.empty(plan.out_shape[:2], dtype=torch.float32, device=plan.device) if return_lse else None
    out = plan.run(q_extend, k_extend, v_extend, k_buffer, v_buffer, out=o_extend, lse=lse)
    return (out, lse) if return_lse else out
