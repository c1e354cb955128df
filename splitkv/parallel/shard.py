"""Sharding metadata: which rank holds which prefix keys, and each rank's view of them.

How the prefix is cut is the caller's (the engine's) choice, as long as every
key is on exactly one rank; :func:`shard_prefix` implements the two usual
layouts, by contiguous chunks and by round-robin blocks (its docstring draws
them), :func:`shard_owner` says which rank holds a position, and
:func:`shard_mask` re-lays a tree mask for a rank's local prefix length. With
paged pools a rank holds whole pages: :func:`shard_prefix` deals them out like
tokens (``block`` then counts pages) and :func:`shard_last_page_len` gives the
rank's ``kv_last_page_len`` (:func:`shard_mask` then takes ``page_size`` and
``kv_last_page_len`` to lay the mask out in keys).

:func:`shard_prefix` and :func:`shard_mask` read lengths on the host: they are
plan-time steps, not for graph capture.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

from ..paged import paged_prefix_lens, token_indices

__all__ = ["PrefixShard", "SHARD_MODES", "ROUND_ROBIN_BLOCK", "shard_owner", "shard_prefix", "shard_mask",
           "shard_last_page_len"]

#: The prefix layouts :func:`shard_prefix` knows.
SHARD_MODES = ("chunk", "round_robin")
#: Default block (tokens) of the round-robin layout; the chunk layout defaults to 1.
ROUND_ROBIN_BLOCK = 256


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
    seq, pos, lens = _entry_positions(kvp)
    keep = shard_owner(pos, lens[seq], world_size, mode, block) == rank
    local = kv_indices[int(kvp[0]):int(kvp[-1])][keep]
    counts = torch.bincount(seq[keep], minlength=kvp.shape[0] - 1)
    indptr = torch.zeros(kvp.shape[0], dtype=torch.int32, device=device)
    indptr[1:] = torch.cumsum(counts, 0)
    if local.numel() == 0:  # a device pointer is never null: a padding entry past the end
        local = torch.zeros(1, dtype=kv_indices.dtype, device=device)
    return PrefixShard(indptr, local, pos[keep], counts)


def _entry_positions(kvp: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sequence, position in its prefix)`` of every entry ``kvp[0]:kvp[-1]``, and the prefix lengths.

    Raises:
        ValueError: for a ``kvp`` (int64 ``kv_indptr``) shorter than 2 entries or decreasing.
    """
    lens = kvp[1:] - kvp[:-1]
    if lens.numel() < 1 or bool((lens < 0).any()):
        raise ValueError("kv_indptr must have >= 2 entries and never decrease")
    j = torch.arange(int(kvp[0]), int(kvp[-1]), device=kvp.device, dtype=torch.int64)
    seq = torch.searchsorted(kvp, j, right=True) - 1
    return seq, j - kvp[seq], lens


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
    if kv_last_page_len is not None:  # the mask's columns are keys: see the shard key by key
        shard, n_glob = _key_shard(shard, kvp, page_size, kv_last_page_len.to(device))
    else:
        n_glob = kvp[1:] - kvp[:-1]
    src, out_ptr = _local_mask_sources(shard, qo[1:] - qo[:-1], n_glob, mask_indptr.to(device=device, dtype=i64))
    return custom_mask[src], out_ptr


def _local_mask_sources(shard: PrefixShard, n_draft: torch.Tensor, n_glob: torch.Tensor,
                        mask_indptr: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """For every entry of the local mask, the index of the global mask's entry it copies.

    Entry ``t`` of the local mask is row ``row``, column ``col`` of its sequence
    ``b``'s block (rows ``n_draft[b]``, width ``n_r + n_draft[b]``); a prefix
    column reads the global column of the key's position, a draft column the
    same draft column past the global prefix.

    Args:
        shard: the rank's shard, key by key (positions and counts).
        n_draft: ``[bs]`` int64 draft rows per sequence.
        n_glob: ``[bs]`` int64 global prefix keys per sequence.
        mask_indptr: ``[bs + 1]`` int64 starts of the global mask.

    Returns:
        ``(sources, local_mask_indptr)``, int64.
    """
    device, i64 = n_draft.device, torch.int64
    n_loc = shard.prefix_lens.to(device=device, dtype=i64)
    loc_ptr = shard.kv_indptr.to(device=device, dtype=i64)
    positions = shard.positions.to(device)
    width = n_loc + n_draft
    out_ptr = torch.zeros(len(width) + 1, dtype=i64, device=device)
    out_ptr[1:] = torch.cumsum(n_draft * width, 0)
    t = torch.arange(int(out_ptr[-1]), device=device, dtype=i64)
    b = torch.searchsorted(out_ptr, t, right=True) - 1
    rem = t - out_ptr[b]
    row = torch.div(rem, width[b], rounding_mode="floor")
    col = rem - row * width[b]
    in_prefix = col < n_loc[b]
    pos_idx = torch.where(in_prefix, loc_ptr[b] + col, 0)
    prefix_col = positions[pos_idx] if positions.numel() else torch.zeros_like(col)
    glob_col = torch.where(in_prefix, prefix_col, n_glob[b] + col - n_loc[b])
    return mask_indptr[b] + row * (n_glob[b] + n_draft[b]) + glob_col, out_ptr
