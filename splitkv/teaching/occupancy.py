"""Who does what: the work of every program of a verify launch, without a GPU (a teaching model).

The notebooks (and anyone tuning the kernels) need to answer questions such as
"which (sequence, slice) programs get keys?", "how many programs does the
launch have, and how many waves of the SMs is that?" or "how many prefix bytes
do the programs read, with and without GQA packing?". This module answers them
from the same rules the kernels use, in plain Python, so the answers can be
drawn for real shapes (a 64k prefix on 132 SMs) on any machine.

The slicing, tiles, split counts and merge mode are :mod:`splitkv.schedule`'s
(re-exported here for the notebooks); this module lists the programs they give:

* :mod:`splitkv.kernels.verify` -- the one-launch verify kernel. Its grid is
  ``(tiles, n_splits)`` with ``tiles = batch x head_tiles`` on axis 0 (a tile
  is a sequence, a head tile and a block of query rows) and the prefix slices
  on axis 1 (:func:`splitkv.schedule.slicing`). Programs with ``split >= n_used`` exit at once, the program of slice
  ``n_used - 1`` also attends the draft block. When ``n_used > 1`` every
  program of the tile writes a partial to scratch, and :func:`merge_mode` says
  who merges: the last one to finish (which one that is depends on timing,
  not on the grid) while the tile's partials are few and its rows at most
  16; else merge programs appended to the same grid, or (``one_launch=False``)
  a second launch; :func:`merge_programs` lists the merge programs;
* :mod:`splitkv.extend` -- the baseline grid ``(batch, H_Q, cdiv(L, BLOCK_M))``
  whose programs each walk a whole prefix.

``tests/test_occupancy.py`` checks the mirror against the kernel itself.
Nothing here launches a kernel or touches a tensor.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from .. import tuning
from ..resources import H200_SHARED_MEMORY
from ..schedule import (MERGE_PROGRAMS, SEPARATE_MERGE, DeviceFacts, VerifyParams, cdiv,
                        count_splits, grid_merge_block, head_tiles, merge_launch_block, merge_mode,
                        min_split_for, n_used, plan_tile, slicing, split_keys, split_len, split_ranges)

__all__ = [
    "Program",
    "cdiv",
    "min_split_for",
    "split_len",
    "n_used",
    "split_ranges",
    "split_keys",
    "head_tiles",
    "verify_programs",
    "GpuLaunch",
    "gpu_launch",
    "MergeProgram",
    "merge_mode",
    "merge_programs",
    "extend_programs",
    "prefix_bytes_read",
    "scratch_bytes",
    "waves",
    "schedule",
]




@dataclass(frozen=True)
class Program:
    """One program (CUDA block) of a launch and the work it does.

    Attributes:
        index: position in launch order (``program_id(0)`` varies fastest,
            as Triton/CUDA linearise a grid).
        seq: the sequence ``b`` it serves.
        head_tile: its head tile (a KV head with GQA packing; a query head
            without packing and in the extend kernel).
        m_block: its block of query rows.
        split: its prefix slice (always 0 for the extend kernel).
        prefix_keys: prefix keys it streams from the token pool.
        draft_keys: draft keys it attends (the draft block, in the verify
            kernel only for the tile's last used slice).
        rows: live query rows; 0 means the program returns at once (a row
            block past the sequence's drafts, or a slice ``>= n_used``).
        n_used: slices of its tile's prefix that have a program at work
            (``> 1``: the tile's programs write partials, the last merges).
    """

    index: int
    seq: int
    head_tile: int
    m_block: int
    split: int
    prefix_keys: int
    draft_keys: int
    rows: int
    n_used: int = 1

    @property
    def keys(self) -> int:
        """All keys the program walks (prefix and draft)."""
        return self.prefix_keys + self.draft_keys

    @property
    def writes_partial(self) -> bool:
        """True when the program publishes its slice to scratch for the tile's merge."""
        return self.rows > 0 and self.n_used > 1
















@dataclass(frozen=True)
class GpuLaunch:
    """What :class:`splitkv.VerifySplitKV` launches on a GPU for one call shape.

    Attributes:
        cfg: the tile shape (:class:`splitkv.schedule.TileConfig`) from the H200 table.
        head_tiles: tiles per sequence.
        n_splits: the grid's slices (the adaptive chooser).
        programs_per_sm: what the chooser assumes an SM holds.
        min_split: the kernel's shortest slice, in keys.
    """

    cfg: object
    head_tiles: int
    n_splits: int
    programs_per_sm: int
    min_split: int


def gpu_launch(num_q_heads: int, num_kv_heads: int, head_dim: int, batch: int, prefix: int, *,
               max_len_extend: int = 4, num_sms: int = 132, kv_bytes: int = 2, page_size: int = 1,
               table=None) -> GpuLaunch:
    """The runner's GPU launch for ``batch`` sequences of ``prefix`` keys, computed on any machine.

    The schedule's own planning functions (:func:`splitkv.schedule.plan_tile`,
    :func:`~splitkv.schedule.count_splits`) with a GPU's facts (``num_sms`` SMs, the H200's
    shared memory, no interpreter: under the interpreter the runner itself uses small tiles
    and short slices instead) and the H200's tuned table (or ``table``). ``kv_bytes``: pool
    element size; ``page_size``: keys per page of a paged pool (1: a token pool).
    """
    kv_dtype = {1: torch.float8_e4m3fn, 2: torch.bfloat16, 4: torch.float32}[kv_bytes]
    q_dtype = torch.float32 if kv_bytes == 4 else torch.bfloat16
    p = VerifyParams(num_q_heads, num_kv_heads, head_dim, head_dim, max_len_extend, batch, kv_dtype, q_dtype,
                     page_size=page_size)
    facts = DeviceFacts(num_sms, H200_SHARED_MEMORY, False)
    table = tuning.table_named(tuning.DEFAULT_DEVICE) if table is None else table
    tile = plan_tile(p, facts, table, prefix)
    n = count_splits(p, tile, facts, table, prefix)
    return GpuLaunch(tile.config, tile.head_tiles, n, 1 if tile.small else tile.programs_per_sm, tile.min_split)


def verify_programs(
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
    min_split: Optional[int] = None,
    split_tokens: Optional[int] = None,
    attend_draft: bool = True,
) -> List[Program]:
    """Every program of one verify launch, in launch order.

    The grid is ``(batch x head_tiles, n_splits)``: axis 0 walks sequences,
    head tiles and row blocks (row block fastest), axis 1 the prefix slices.
    Program ``(tile, split)`` is live iff ``split < n_used`` of its sequence
    and its row block ``m`` has rows (``m x block_m < heads_per_tile x L``);
    the live program of slice ``n_used - 1`` also does the draft block.

    Args:
        prefix_lens, extend_lens: per-sequence prefix and draft lengths.
        num_q_heads, num_kv_heads: head counts.
        n_splits: the grid's slices (the plan's ``n_splits``).
        block_m, block_n: the kernel's row and key tile sizes
            (:func:`splitkv.schedule.tile_config`).
        pack_gqa: GQA packing (one program per KV head) or one per query head.
        max_len_extend: sizes the row blocks (default ``max(extend_lens)``).
        min_split: as for :func:`split_len` (the runner passes
            ``min_split_for(block_n, splitkv.tuning.min_split_tokens())``).
        split_tokens: the fixed slice length (batch-invariant mode) or ``None``.
        attend_draft: ``False`` for a prefix-only launch.
    """
    if len(prefix_lens) != len(extend_lens):
        raise ValueError("prefix_lens and extend_lens differ in length")
    max_len = max(extend_lens) if max_len_extend is None else max_len_extend
    per_tile = num_q_heads // num_kv_heads if pack_gqa else 1
    tiles = num_q_heads // per_tile
    m_blocks = cdiv(per_tile * max_len, block_m)
    cuts = [slicing(p, n_splits, block_n, min_split, split_tokens) for p in prefix_lens]
    ranges = [split_ranges(p, n_splits, block_n, min_split, split_tokens=split_tokens) for p in prefix_lens]
    programs = []
    index = 0
    for split in range(n_splits):
        for b in range(len(prefix_lens)):
            used = cuts[b][1]
            for tile in range(tiles):
                for m in range(m_blocks):
                    rows = max(0, min(block_m, per_tile * extend_lens[b] - m * block_m))
                    if split >= used:
                        rows = 0
                    if rows == 0:
                        pre = draft = 0
                    else:
                        lo, hi = ranges[b][split]
                        pre = hi - lo
                        draft = extend_lens[b] if attend_draft and split == used - 1 else 0
                    programs.append(Program(index, b, tile, m, split, pre, draft, rows, used))
                    index += 1
    return programs




@dataclass(frozen=True)
class MergeProgram:
    """One merge program: in the verify grid (``MERGE_PROGRAMS``) or a second launch (``SEPARATE_MERGE``).

    Attributes:
        index: position in launch order, the tile fastest (in the verify grid: its
            ticket, after every slice program's).
        seq, head_tile, m_block: the tile whose slices it merges.
        row_chunk, col_chunk: its block of the tile's rows and of the value columns.
        rows: live rows it merges (0: it returns at once, e.g. a one-slice tile).
        columns: value columns it merges.
        slices: partials it reads per row (the tile's ``n_used``; 0 if it returns at once).
        in_verify_grid: a program of the verify grid (``MERGE_PROGRAMS``), else of a second launch.
    """

    index: int
    seq: int
    head_tile: int
    m_block: int
    row_chunk: int
    col_chunk: int
    rows: int
    columns: int
    slices: int
    in_verify_grid: bool = False


def merge_programs(
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    num_q_heads: int,
    num_kv_heads: int,
    n_splits: int,
    *,
    block_m: int,
    block_n: int,
    v_head_dim: int,
    pack_gqa: bool = True,
    max_len_extend: Optional[int] = None,
    min_split: Optional[int] = None,
    split_tokens: Optional[int] = None,
    one_launch: bool = True,
    merge_rows: Optional[int] = None,
    merge_dv: Optional[int] = None,
) -> List[MergeProgram]:
    """Every merge program of a launch; ``[]`` where the tiles' last programs merge (or nothing does).

    Arguments as for :func:`verify_programs`, plus ``v_head_dim`` and the
    merge's block shape (default the plan's: :func:`~splitkv.schedule.grid_merge_block`
    in the verify grid, :func:`~splitkv.schedule.merge_launch_block` in a second
    launch, the columns capped at the padded value width). In the verify grid
    the merge programs take the tickets after the ``tiles x n_splits`` slice
    programs': block ``c`` of every tile, then block ``c + 1``; a second launch's
    grid is ``(tiles, row chunks, column chunks)``.
    """

    max_len = max(extend_lens) if max_len_extend is None else max_len_extend
    per_tile = num_q_heads // num_kv_heads if pack_gqa else 1
    tiles = num_q_heads // per_tile
    m_blocks = cdiv(per_tile * max_len, block_m)
    mode = merge_mode(n_splits, len(prefix_lens) * tiles * m_blocks, block_m, v_head_dim, one_launch)
    if mode not in (MERGE_PROGRAMS, SEPARATE_MERGE):
        return []
    in_grid = mode == MERGE_PROGRAMS
    rows, cols = grid_merge_block(n_splits, v_head_dim) if in_grid else merge_launch_block(v_head_dim)
    merge_rows, merge_dv = merge_rows or rows, merge_dv or cols
    row_chunks, col_chunks = cdiv(block_m, merge_rows), cdiv(v_head_dim, merge_dv)
    used = [slicing(p, n_splits, block_n, min_split, split_tokens)[1] for p in prefix_lens]
    # Launch order: in the verify grid, chunk = row_chunk x col_chunks + col_chunk, then the tile;
    # in the second launch, the tile, then the row chunk, then the column chunk.
    order = ([(c // col_chunks, c % col_chunks) for c in range(row_chunks * col_chunks)] if in_grid else
             [(r, c) for c in range(col_chunks) for r in range(row_chunks)])
    first = len(prefix_lens) * tiles * m_blocks * n_splits if in_grid else 0
    programs = []
    for chunk, col in order:
        for b in range(len(prefix_lens)):
            for tile in range(tiles):
                for m in range(m_blocks):
                    live = per_tile * extend_lens[b] - m * block_m  # live rows of the tile
                    lo = chunk * merge_rows
                    rows = max(0, min(merge_rows, block_m - lo, live - lo)) if used[b] > 1 else 0
                    columns = min(merge_dv, v_head_dim - col * merge_dv)
                    programs.append(MergeProgram(first + len(programs), b, tile, m, chunk, col, rows, columns,
                                                 used[b] if rows else 0, in_grid))
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
    streams. With GQA packing that is each byte once per row block; without
    it, once per query head (``GROUP`` times).
    """
    return sum(p.prefix_keys for p in programs) * (head_dim + v_head_dim) * itemsize


def scratch_bytes(programs: Sequence[Program], v_head_dim: int, block_m: int,
                  merge: Optional[Sequence[MergeProgram]] = None, *, out_bytes: int = 4) -> Tuple[int, int]:
    """Scratch traffic of a verify launch: ``(written, read)`` bytes.

    Every program of a tile with ``n_used > 1`` writes its whole
    ``block_m``-row partial: a row is ``v_head_dim`` outputs of ``out_bytes``
    each and a float32 LSE. The kernel stores the outputs in bfloat16 when the
    call's output is bfloat16 (``out_bytes=2``), in float32 otherwise (4, the
    default). Merging in the verify kernel, the tile's last program reads back
    the live rows of all ``n_used`` partials; with a spread merge (``merge``,
    from :func:`merge_programs`) each merge program reads its rows' LSEs and
    its columns of every partial. Tiles with one slice touch no scratch.
    """
    row = v_head_dim * out_bytes + 4
    writers = [p for p in programs if p.writes_partial]
    written = len(writers) * block_m * row
    if merge:
        read = sum(m.rows * m.slices * (m.columns * out_bytes + 4) for m in merge)
    else:
        read = sum(p.n_used * p.rows * row for p in writers if p.split == 0)
    return written, read


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
