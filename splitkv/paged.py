"""Paged KV pools: the layout, its token view, and vLLM block tables.

A *token pool* (what :func:`splitkv.verify_attention` reads by default) is
``k_buffer``/``v_buffer`` of shape ``[pool_tokens, H_KV, D]``; sequence ``b``'s
prefix is the slots ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``, one index
per token.

A *paged pool* (FlashInfer's paged-KV convention) stores keys in fixed-size
pages: ``k_pages``/``v_pages`` of shape ``[num_pages, page_size, H_KV, D]``.
``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` are then the *page ids* of
sequence ``b``, in order, and ``kv_last_page_len[b]`` says how many rows of
its last page are used (``1 .. page_size``; ``0`` for a sequence without
pages). With ``n_b = kv_indptr[b+1] - kv_indptr[b]`` pages::

    prefix_len[b] = (n_b - 1) * page_size + kv_last_page_len[b]   (0 if n_b == 0)
    key n of b    = k_pages[kv_indices[kv_indptr[b] + n // page_size], n % page_size]

For example, page_size 4, a sequence of 10 keys on pages 7, 2, 5::

    kv_indices[kv_indptr[b]:]  = [7, 2, 5]      kv_last_page_len[b] = 2
    page 7: | k0 k1 k2 k3 |
    page 2: | k4 k5 k6 k7 |
    page 5: | k8 k9 -- -- |     rows 2, 3 unused: never read

Merging the first two dimensions of a paged pool gives a token pool
(:func:`flat_pool`): row ``r`` of page ``p`` is slot ``p * page_size + r``,
and :func:`token_indices` rewrites a page table into those slots. The split-KV
kernel does not need either: :func:`splitkv.verify_attention` and the other
entries take a paged pool directly through ``kv_last_page_len=`` and read the
pages natively, one ``kv_indices`` load per page instead of one per token.
Those two helpers are for checking, debugging and feeding token-pool code.

vLLM keeps the same information as a *block table*: ``block_table[b, j]`` is
the ``j``-th page (block) of sequence ``b`` and ``seq_lens[b]`` its length, so
row ``b``'s first ``cdiv(seq_lens[b], page_size)`` entries are its page ids
and the rest of the row is padding. :func:`pages_from_block_table` packs those
rows into ``kv_indptr``/``kv_indices``/``kv_last_page_len`` with tensor ops
only (no host read, fixed output sizes), so it can run inside a captured CUDA
graph.
"""

from __future__ import annotations

from typing import Tuple

import torch

__all__ = ["paged_prefix_lens", "token_indices", "flat_pool", "pages_from_block_table"]

_INDEX_DTYPES = (torch.int32, torch.int64)
_INT32_MAX = torch.iinfo(torch.int32).max


def _check_index(name: str, t: torch.Tensor, dim: int = 1) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != dim or t.dtype not in _INDEX_DTYPES:
        what = f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a {dim}-D int32/int64 tensor, got {what}")


def _check_page_size(page_size: int) -> None:
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")


def paged_prefix_lens(kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor, page_size: int) -> torch.Tensor:
    """Keys per sequence of a paged prefix: ``(pages - 1) * page_size + kv_last_page_len`` (0 without pages).

    Int64, on ``kv_indptr``'s device; no validation (see :func:`token_indices`).
    """
    n_pages = kv_indptr[1:].to(torch.int64) - kv_indptr[:-1].to(torch.int64)
    last = kv_last_page_len.to(device=kv_indptr.device, dtype=torch.int64)
    return torch.where(n_pages > 0, (n_pages - 1) * page_size + last, torch.zeros_like(last))


def token_indices(
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    page_size: int,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The prefixes of a paged pool as slots of its :func:`flat_pool` token pool.

    Key ``n`` of sequence ``b`` becomes slot
    ``kv_indices[kv_indptr[b] + n // page_size] * page_size + n % page_size``
    of the flattened pool ``[num_pages * page_size, H_KV, D]``; the slots of
    each sequence are packed one after the other.

    This reads the device (the output's size and the validation depend on
    values), so it must not be called during CUDA-graph capture.

    Args:
        kv_indptr: ``[bs + 1]`` ranges of ``kv_indices`` (non-decreasing).
        kv_indices: page ids of every sequence.
        kv_last_page_len: ``[bs]`` rows used in each sequence's last page:
            ``1 .. page_size``, or ``0`` for a sequence with no pages.
        page_size: rows per page.

    Returns:
        ``(tok_indptr, tok_indices)``: ``[bs + 1]`` token ranges starting at 0
        (``kv_indptr``'s dtype) and the token slots (``kv_indices``' dtype);
        either is int64 where its values would overflow int32.

    Raises:
        ValueError: on non-1-D or non-integer inputs, tensors on different
            devices, mismatched lengths, ``page_size < 1``, a ``kv_indptr``
            that decreases or runs past ``kv_indices``, a last-page length out
            of range, or a negative page id.
    """
    _check_index("kv_indptr", kv_indptr)
    _check_index("kv_indices", kv_indices)
    _check_index("kv_last_page_len", kv_last_page_len)
    _check_page_size(page_size)
    device = kv_indptr.device
    if kv_indices.device != device or kv_last_page_len.device != device:
        raise ValueError("kv_indptr, kv_indices and kv_last_page_len must share a device")
    bs = kv_indptr.numel() - 1
    if bs < 0 or kv_last_page_len.numel() != bs:
        raise ValueError(
            f"kv_last_page_len has {kv_last_page_len.numel()} entries, kv_indptr {kv_indptr.numel()}:"
            " need one per sequence and one more in kv_indptr"
        )

    indptr = kv_indptr.to(torch.int64)
    n_pages = indptr[1:] - indptr[:-1]
    if bs and (int(indptr[0]) < 0 or bool((n_pages < 0).any()) or int(indptr[-1]) > kv_indices.numel()):
        raise ValueError(f"kv_indptr must be non-decreasing within [0, {kv_indices.numel()}] (kv_indices' length)")
    last = kv_last_page_len.to(torch.int64)
    has_pages = n_pages > 0
    in_range = torch.where(has_pages, (last >= 1) & (last <= page_size), last == 0)
    if not bool(in_range.all()):
        b = int((~in_range).nonzero()[0])
        raise ValueError(
            f"kv_last_page_len[{b}] = {int(last[b])} with {int(n_pages[b])} pages: must be in "
            f"[1, {page_size}] for a sequence with pages, 0 for one without"
        )

    seq_lens = paged_prefix_lens(indptr, last, page_size)
    tok_indptr = torch.zeros(bs + 1, dtype=torch.int64, device=device)
    torch.cumsum(seq_lens, 0, out=tok_indptr[1:])
    total = int(tok_indptr[-1])

    # Token t belongs to sequence seq[t] and is key n[t] of it.
    seq = torch.repeat_interleave(torch.arange(bs, device=device), seq_lens, output_size=total)
    n = torch.arange(total, device=device) - tok_indptr[seq]
    pages = kv_indices[indptr[seq] + n // page_size].to(torch.int64)
    if total and int(pages.min()) < 0:
        raise ValueError("kv_indices holds a negative page id")
    slots = pages * page_size + n % page_size

    def narrowest(t: torch.Tensor, like: torch.dtype) -> torch.Tensor:
        big = t.numel() > 0 and int(t.max()) > _INT32_MAX
        return t.to(torch.int64 if big else like)

    return narrowest(tok_indptr, kv_indptr.dtype), narrowest(slots, kv_indices.dtype)


def flat_pool(pages: torch.Tensor) -> torch.Tensor:
    """A paged pool as a token pool: ``[num_pages, page_size, H, D] -> [num_pages * page_size, H, D]``.

    Row ``r`` of page ``p`` becomes slot ``p * page_size + r``. The result is a
    *view* of ``pages`` whenever the first two dimensions can be merged
    (``pages.stride(0) == page_size * pages.stride(1)``, as in any contiguous
    pool; or one of them has size 1), so writes through it reach the pages.
    Otherwise -- say ``pages`` is a slice ``big[:, :page_size]`` of a pool
    with larger pages -- it is a contiguous *copy*, and writes to it do not.

    Args:
        pages: the paged pool, 4-D.

    Returns:
        The ``[num_pages * page_size, H, D]`` token pool.

    Raises:
        ValueError: if ``pages`` is not 4-D.
    """
    if not isinstance(pages, torch.Tensor) or pages.dim() != 4:
        shape = tuple(pages.shape) if isinstance(pages, torch.Tensor) else type(pages).__name__
        raise ValueError(f"pages must be 4-D [num_pages, page_size, heads, head_dim], got {shape}")
    num_pages, page_size, heads, dim = pages.shape
    return pages.reshape(num_pages * page_size, heads, dim)


def pages_from_block_table(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A vLLM block table in the paged convention, CUDA-graph safe.

    Sequence ``b`` has ``n_b = cdiv(seq_lens[b], page_size)`` pages,
    ``block_table[b, :n_b]``. Their ids are packed at the front of
    ``kv_indices`` in sequence order (``kv_indptr`` is the exclusive cumsum of
    ``n_b``); ``kv_indices`` always has ``bs * max_blocks`` entries, and those
    past ``kv_indptr[bs]`` are 0 (a valid page id, so a stray read stays in
    the pool). Every output size depends on shapes only and nothing is read
    back to the host: the packing scatters each used entry to its place and
    every unused one to a dump slot past the end, which is then sliced off.

    The contract ``0 <= seq_lens[b] <= max_blocks * page_size`` is not checked
    (that would read the device); lengths outside it are clamped into it, so
    the outputs always describe pages of the table.

    Args:
        block_table: ``[bs, max_blocks]`` page ids (int32 or int64).
        seq_lens: ``[bs]`` tokens of each sequence (int32 or int64).
        page_size: rows per page (vLLM's ``block_size``).

    Returns:
        ``(kv_indptr, kv_indices, kv_last_page_len)``, int32, of sizes
        ``bs + 1``, ``bs * max_blocks`` and ``bs``, on ``block_table``'s device.

    Raises:
        ValueError: on non-integer inputs, wrong ranks, mismatched batch
            sizes, different devices or ``page_size < 1``.
    """
    _check_index("block_table", block_table, dim=2)
    _check_index("seq_lens", seq_lens)
    _check_page_size(page_size)
    bs, max_blocks = block_table.shape
    if seq_lens.numel() != bs:
        raise ValueError(f"seq_lens has {seq_lens.numel()} entries, block_table {bs} rows")
    if seq_lens.device != block_table.device:
        raise ValueError("block_table and seq_lens must share a device")
    device = block_table.device
    capacity = bs * max_blocks

    lens = seq_lens.to(torch.int64).clamp(0, max_blocks * page_size)
    n_pages = (lens + page_size - 1) // page_size
    kv_indptr = torch.zeros(bs + 1, dtype=torch.int64, device=device)
    torch.cumsum(n_pages, 0, out=kv_indptr[1:])
    last = torch.where(n_pages > 0, lens - (n_pages - 1) * page_size, torch.zeros_like(lens))

    # Entry (b, j) goes to kv_indptr[b] + j if used, else to the dump slot `capacity`.
    j = torch.arange(max_blocks, device=device)
    used = j[None, :] < n_pages[:, None]
    dest = torch.where(used, kv_indptr[:-1, None] + j[None, :], capacity)
    packed = torch.zeros(capacity + 1, dtype=torch.int32, device=device)
    packed.scatter_(0, dest.reshape(-1), block_table.to(torch.int32).reshape(-1))
    return kv_indptr.to(torch.int32), packed[:capacity], last.to(torch.int32)
