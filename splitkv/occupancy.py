"""Who does what: the work of every program of a verify launch, without a GPU.

The notebooks (and anyone tuning the kernels) need to answer questions such as
"which (sequence, split) programs get keys?", "how many programs does the
launch have, and how many waves of the SMs is that?" or "how many prefix bytes
do the programs read, with and without GQA packing?". This module answers them
from the same rules the kernels use, in plain Python, so the answers can be
drawn for real shapes (a 64k prefix on 132 SMs) on any machine.

It mirrors, and must stay in step with:

* :mod:`splitkv.partials` -- the stage-1 grid ``(n_splits + 1, batch x
  head_tiles x m_blocks)``, BLOCK_N-aligned prefix slices
  (``split_len = cdiv(cdiv(prefix, n_splits), BLOCK_N) * BLOCK_N``), the draft
  block as part ``n_splits``, and the early exit of row tiles past a
  sequence's draft tokens;
* :mod:`splitkv.extend` -- the baseline grid ``(batch, H_Q, cdiv(L, BLOCK_M))``
  whose programs each walk a whole prefix.

``tests/test_occupancy.py`` checks the mirror against the kernel itself.
Nothing here launches a kernel or touches a tensor.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

__all__ = [
    "Program",
    "cdiv",
    "split_len",
    "split_ranges",
    "split_keys",
    "head_tiles",
    "partials_programs",
    "extend_programs",
    "prefix_bytes_read",
    "waves",
    "schedule",
]


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


@dataclass(frozen=True)
class Program:
    """One program (CUDA block) of a launch and the work it does.

    Attributes:
        index: position in launch order (``program_id(0)`` varies fastest,
            as Triton/CUDA linearise a grid).
        seq: the sequence ``b`` it serves.
        head_tile: its head tile (a KV head with GQA packing; a query head
            without packing and in the extend kernel).
        m_block: its tile of query rows.
        split: its part: ``0 .. n_splits-1`` a prefix slice, ``n_splits`` the
            draft block (always 0 for the extend kernel, which has no parts).
        prefix_keys: prefix keys it streams from the token pool.
        draft_keys: draft keys it attends (the draft block; every row tile of
            the extend kernel).
        rows: live query rows; 0 means the program returns at once.
    """

    index: int
    seq: int
    head_tile: int
    m_block: int
    split: int
    prefix_keys: int
    draft_keys: int
    rows: int

    @property
    def keys(self) -> int:
        """All keys the program walks (prefix and draft)."""
        return self.prefix_keys + self.draft_keys


def split_len(prefix_len: int, n_splits: int, block_n: int) -> int:
    """Keys per prefix slice, rounded up to a whole number of ``block_n`` tiles.

    The kernel's rule: ``cdiv(cdiv(prefix_len, n_splits), block_n) * block_n``.
    Alignment means only a slice's last key tile can be partial; the price is
    that short prefixes leave the last slices empty.
    """
    if n_splits < 1 or block_n < 1 or prefix_len < 0:
        raise ValueError("need n_splits >= 1, block_n >= 1 and prefix_len >= 0")
    return cdiv(cdiv(prefix_len, n_splits), block_n) * block_n


def split_ranges(prefix_len: int, n_splits: int, block_n: int) -> List[Tuple[int, int]]:
    """``[lo, hi)`` prefix positions of each slice (``lo == hi``: empty slice)."""
    step = split_len(prefix_len, n_splits, block_n)
    return [
        (min(s * step, prefix_len), min(s * step + step, prefix_len)) for s in range(n_splits)
    ]


def split_keys(prefix_lens: Sequence[int], n_splits: int, block_n: int) -> List[List[int]]:
    """Prefix keys of every (sequence, slice): ``[batch][n_splits]`` ints."""
    return [[hi - lo for lo, hi in split_ranges(p, n_splits, block_n)] for p in prefix_lens]


def head_tiles(
    num_q_heads: int, num_kv_heads: int, max_len_extend: int, block_m: int, pack_gqa: bool = True
) -> int:
    """Stage-1 programs per sequence and part: head tiles times row tiles.

    With GQA packing a head tile is a KV head whose ``GROUP x L`` query rows
    are cut into ``cdiv(GROUP x L, block_m)`` row tiles; without packing it is
    one query head of ``L`` rows. :class:`splitkv.VerifySplitKV` sizes its launches with it.
    """
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError("num_q_heads must be a positive multiple of num_kv_heads")
    per_tile = num_q_heads // num_kv_heads if pack_gqa else 1
    return (num_q_heads // per_tile) * cdiv(per_tile * max_len_extend, block_m)


def partials_programs(
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    num_q_heads: int,
    num_kv_heads: int,
    n_splits: int,
    *,
    block_m: int,
    block_n: int,
    pack_gqa: bool = True,
    max_len_extend: Optional[int] = None,
) -> List[Program]:
    """Every program of one stage-1 launch, in launch order.

    The grid is ``(n_splits + 1, batch x head_tiles x m_blocks)``: axis 0 is
    the part (prefix slices, then the draft block), axis 1 walks sequences,
    head tiles and row tiles. Row tile ``m`` of a sequence with ``L`` draft
    tokens is live iff ``m x block_m < heads_per_tile x L``.

    Args:
        prefix_lens, extend_lens: per-sequence prefix and draft lengths.
        num_q_heads, num_kv_heads: head counts.
        n_splits: prefix slices per sequence.
        block_m, block_n: the kernel's row and key tile sizes
            (:func:`splitkv.partials.tile_config`).
        pack_gqa: GQA packing (one program per KV head) or one per query head.
        max_len_extend: sizes the grid (default ``max(extend_lens)``).
    """
    if len(prefix_lens) != len(extend_lens):
        raise ValueError("prefix_lens and extend_lens differ in length")
    max_len = max(extend_lens) if max_len_extend is None else max_len_extend
    per_tile = num_q_heads // num_kv_heads if pack_gqa else 1
    tiles = num_q_heads // per_tile
    m_blocks = cdiv(per_tile * max_len, block_m)
    keys = split_keys(prefix_lens, n_splits, block_n)
    programs = []
    index = 0
    for b in range(len(prefix_lens)):
        for tile in range(tiles):
            for m in range(m_blocks):
                rows = max(0, min(block_m, per_tile * extend_lens[b] - m * block_m))
                for part in range(n_splits + 1):
                    if rows == 0:
                        pre = draft = 0
                    elif part < n_splits:
                        pre, draft = keys[b][part], 0
                    else:
                        pre, draft = 0, extend_lens[b]
                    programs.append(Program(index, b, tile, m, part, pre, draft, rows))
                    index += 1
    return programs


def extend_programs(
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    num_q_heads: int,
    *,
    block_m: int,
    causal: bool = True,
    max_len_extend: Optional[int] = None,
) -> List[Program]:
    """Every program of one baseline (:func:`splitkv.extend_attention_fwd`) launch.

    The grid is ``(batch, H_Q, cdiv(max_len_extend, block_m))`` with the
    sequence varying fastest. A live program streams its sequence's *whole*
    prefix, then the draft keys up to its last row (all of them if not causal).
    """
    if len(prefix_lens) != len(extend_lens):
        raise ValueError("prefix_lens and extend_lens differ in length")
    max_len = max(extend_lens) if max_len_extend is None else max_len_extend
    programs = []
    index = 0
    for m in range(cdiv(max_len, block_m)):
        for h in range(num_q_heads):
            for b in range(len(prefix_lens)):
                rows = max(0, min(block_m, extend_lens[b] - m * block_m))
                if rows == 0:
                    pre = draft = 0
                else:
                    pre = prefix_lens[b]
                    draft = min(extend_lens[b], (m + 1) * block_m) if causal else extend_lens[b]
                programs.append(Program(index, b, h, m, 0, pre, draft, rows))
                index += 1
    return programs


def prefix_bytes_read(programs: Sequence[Program], head_dim: int, v_head_dim: int, itemsize: int) -> int:
    """Prefix K+V bytes the programs load from the pool (no cache reuse assumed).

    Every program loads one KV head's K and V row for each prefix key it
    streams. With GQA packing that is each byte once per row tile; without
    it, once per query head (``GROUP`` times).
    """
    return sum(p.prefix_keys for p in programs) * (head_dim + v_head_dim) * itemsize


def waves(num_programs: int, num_sms: int, programs_per_sm: int = 1) -> int:
    """Rounds of ``num_sms x programs_per_sm`` resident programs a launch needs."""
    return cdiv(num_programs, num_sms * programs_per_sm)


def schedule(costs: Sequence[float], num_sms: int, programs_per_sm: int = 1) -> Tuple[List[Tuple[int, float, float]], float]:
    """A greedy model of the block scheduler: who runs where, and when.

    Programs start in launch order, each on the slot that frees first
    (``num_sms x programs_per_sm`` slots; slot ``i`` is on SM ``i % num_sms``,
    so the first wave spreads over all SMs). ``costs`` are arbitrary time
    units (for a memory-bound kernel: keys streamed plus a fixed overhead).
    Slots of one SM are modelled as independent, which ignores that they
    share the SM's bandwidth: use it to see *where* work lands, not for times.

    Returns:
        ``(placement, makespan)``: per program ``(sm, start, end)``, and the
        time the last program ends.
    """
    if num_sms < 1 or programs_per_sm < 1:
        raise ValueError("num_sms and programs_per_sm must be positive")
    free = [(0.0, slot) for slot in range(num_sms * programs_per_sm)]
    heapq.heapify(free)
    placement = []
    makespan = 0.0
    for cost in costs:
        start, slot = heapq.heappop(free)
        end = start + float(cost)
        placement.append((slot % num_sms, start, end))
        makespan = max(makespan, end)
        heapq.heappush(free, (end, slot))
    return placement, makespan
