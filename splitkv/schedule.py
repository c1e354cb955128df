"""The verify launch's arithmetic, in one place.

Everything that decides the shape of a verify launch is here, in plain Python
on static shapes (no device value is read, so it is safe under CUDA-graph
capture): the plan launches with it, the gate declines with it, the teaching
model (:mod:`splitkv.teaching.occupancy`) draws with it, and the kernels
compute the same slicing on the device (``_tile_slices`` in
:mod:`splitkv.kernels.common`; ``tests/test_occupancy.py`` checks the two
agree on the kernel's actual writes).

* **Tiles.** A tile is one sequence, one KV head with all its query heads
  (GQA packing) and a block of ``BLOCK_M`` query rows: :func:`rows_per_tile`,
  :func:`block_m_for`, :func:`head_tiles`; a launch of too few tiles to fill
  the device cuts its rows further (:func:`launch_block_m`); the key tile and
  warps come from the device's tuned table (:func:`plan_tile`, :mod:`splitkv.tuning`).
* **Slicing.** Sequence ``b``'s prefix of ``P`` keys is cut into ``n_used``
  slices of ``split_len`` keys (:func:`slicing`)::

      adaptive:  split_len = max(roundup(cdiv(P, n_splits), BLOCK_N), min_split)
      fixed:     split_len = split_tokens                   (batch-invariant)
      n_used   = max(1, cdiv(P, split_len))                 <= n_splits

* **Split counts.** :func:`choose_n_splits` sizes the grid's axis 1 so that
  the launch fills whole waves of the SMs; :func:`one_wave_n_splits` gives a
  small launch one program per SM; :func:`fixed_n_splits` serves the
  batch-invariant mode.
* **Merge mode.** :func:`merge_mode` says who merges a tile's slices: the
  tile's last program, merge programs in the same grid, or a second launch.
* **Limits and sizes.** :func:`launch_limit_reason` (CUDA's grid limits,
  32-bit positions), :func:`workspace_bytes` (a caller-owned workspace).
* **The plan.** :func:`plan_tile` and :func:`plan_splits`: from a call's
  :class:`VerifyParams`, the device's :class:`DeviceFacts` and the tuned table,
  the immutable :class:`TilePlan` (once per plan) and :class:`SplitPlan` (per
  split count, :func:`count_splits`). Everything a launch is shaped by is
  decided there; :mod:`splitkv.plan` only binds and launches.

The split chooser's rule::

    base    = batch x head_tiles                   programs per slice
    slots   = programs_per_sm x num_sms            programs the device runs at once
    useful  = clamp(cdiv(prefix_len, min_split_tokens), 1, MAX_SPLITS)
    waves(u)      = base x u / slots
    efficiency(u) = waves(u) / ceil(waves(u))      busy fraction of the last wave
    used(n)       = slices of n that hold keys, once rounded to whole key tiles (slicing)
    n_splits = used(n) for the smallest n <= useful with efficiency(used(n)) within 5 % of
               the best efficiency(n) over n <= useful (else the most efficient used(n))

Wave quantisation is the point: on an H200 (132 SMs, two programs each), 64
programs per slice with 4 slices fill 256 of 264 slots in one wave, while 9
slices need 576 programs, 2.2 waves. ``prefix_len`` need only be
representative: each sequence's own prefix decides how many slices it uses.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from .kernels.common import LAST_PROGRAM, MERGE_PROGRAMS, SEPARATE_MERGE
from .resources import device_shared_memory, fit_tile, next_pow2, shared_memory_reason
from .tile import TileConfig

__all__ = [
    "TileConfig", "tile_config", "rows_per_tile", "block_m_for", "head_tiles", "launch_block_m", "MIN_BLOCK_M",
    "cdiv", "min_split_for", "slicing", "split_len", "n_used", "split_ranges", "split_keys",
    "choose_n_splits", "one_wave_n_splits", "fixed_n_splits", "device_sm_count",
    "merge_mode", "fused_merge_fits", "grid_merge_rows", "merge_unroll", "grid_merge_block", "merge_launch_block",
    "merge_chunks",
    "launch_limit_reason", "LaunchLimitError", "workspace_bytes", "counter_bytes", "pool_offsets_32",
    "MAX_SPLITS", "MAX_GRID_SPLITS", "SEPARATE_MERGE", "LAST_PROGRAM", "MERGE_PROGRAMS",
    "VerifyParams", "DeviceFacts", "TilePlan", "SplitPlan", "device_facts", "launch_rows", "plan_tile", "count_splits", "plan_splits",
]


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


def element_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype`` (1 for fp8 pools, 2 for 16-bit ones)."""
    return torch.empty((), dtype=dtype).element_size()


# ---------------------------------------------------------------------------- tiles


def rows_per_tile(heads_per_tile: int, max_len_extend: int) -> int:
    """Query rows one (sequence, head tile) needs: heads x draft tokens."""
    return heads_per_tile * max_len_extend


def block_m_for(rows: int) -> int:
    """``BLOCK_M`` for ``rows`` query rows: a power of two in ``[16, 64]``.

    At least 16 for the tensor cores; at most 64 to bound the fp32
    accumulator ``BLOCK_M x DV`` (more rows take several row blocks).
    """
    return min(64, max(16, next_pow2(rows)))


def tile_config(head_dim: int, v_head_dim: int, rows: int, interpret: bool = False,
                kv_bytes: int = 2, page_size: int = 1, block_m: Optional[int] = None, table=None) -> TileConfig:
    """Block sizes for a head configuration, from a tuned table.

    A table (:class:`splitkv.tuning.TunedTable`, ``python -m splitkv.bench.tune``) holds
    the fastest ``(BLOCK_N, warps, stages)`` measured per (head dim, rows per
    tile, pool element size), and per page size for paged pools; a
    configuration it does not list takes the nearest measured one by head dim
    and rows; the K layout follows :meth:`~splitkv.tuning.TunedTable.k_rows`.

    Args:
        head_dim: query/key head dimension.
        v_head_dim: value head dimension.
        rows: query rows per (sequence, head tile), see :func:`rows_per_tile`.
        interpret: small tiles for the Triton interpreter.
        kv_bytes: bytes per pool element (2 for 16-bit pools, 1 for fp8).
        page_size: keys per page of a paged pool (1: a token pool).
        block_m: the tile's rows, if not :func:`block_m_for` ``(rows)`` (see :func:`launch_block_m`).
        table: the device's tuned table (default: the H200's, :func:`splitkv.tuning.table_for`).

    Returns:
        The :class:`TileConfig`.
    """
    block_m = block_m or block_m_for(rows)
    if interpret:
        return interpreter_tile(block_m)
    if table is None:
        from .tuning import table_for

        table = table_for(None)
    return _tile_of(block_m, table.row(max(head_dim, v_head_dim), block_m, kv_bytes, page_size))


def interpreter_tile(block_m: int) -> TileConfig:
    """The Triton interpreter's tile: small blocks, which the CPU runs quickest."""
    return TileConfig(block_m, 16, 4, 1)


def _tile_of(block_m: int, row) -> TileConfig:
    """A :class:`TileConfig` of ``block_m`` rows from a table row (:class:`splitkv.tuning.TileRow`)."""
    return TileConfig(block_m, row.block_n, row.num_warps, row.num_stages, row.k_rows)


#: Fewest query rows a tile is cut to (a tensor-core dot's height).
MIN_BLOCK_M = 16


def launch_block_m(block_m: int, tiles_at, num_sms: int) -> int:
    """``BLOCK_M`` for a launch: ``block_m``, halved while even ``MAX_SPLITS`` slices per tile would give the
    grid fewer programs than half the device's SMs.

    ``tiles_at(block_m)`` is the launch's tiles at that many rows (batch x
    :func:`head_tiles`). On the H200 (132 SMs) only a launch of one tile is
    cut: MLA at batch 1 (one KV head, 16 query heads x 4 drafts = 64 rows),
    whose at most 64 slices left half the device idle. Two tiles of 32 rows
    read the latent cache twice, the second time mostly from L2, and fill it
    (:data:`splitkv.tuning.DEFAULT_TILES` holds their tile). Every other shape
    we serve has enough tiles already and keeps its rows.
    """
    while block_m > MIN_BLOCK_M and 2 * tiles_at(block_m) * MAX_SPLITS < num_sms:
        block_m //= 2
    return block_m


def head_tiles(
    num_q_heads: int, num_kv_heads: int, max_len_extend: int, block_m: int, pack_gqa: bool = True
) -> int:
    """Tiles per sequence (grid axis 0 is ``batch x head_tiles``): head tiles times row blocks.

    With GQA packing a head tile is a KV head whose ``GROUP x L`` query rows
    are cut into ``cdiv(GROUP x L, block_m)`` row blocks; without packing it is
    one query head of ``L`` rows. :class:`splitkv.VerifySplitKV` sizes its launches with it.
    """
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError("num_q_heads must be a positive multiple of num_kv_heads")
    per_tile = num_q_heads // num_kv_heads if pack_gqa else 1
    return (num_q_heads // per_tile) * cdiv(per_tile * max_len_extend, block_m)


# ---------------------------------------------------------------------------- slicing


def min_split_for(block_n: int, min_split_tokens: Optional[int] = None) -> int:
    """The kernel's ``min_split``: ``min_split_tokens`` rounded up to whole ``block_n`` tiles.

    Args:
        block_n: the kernel's key tile.
        min_split_tokens: the shortest slice worth a program (default: the
            H200 sweep's, ``splitkv.tuning.TUNED["min_split_tokens"]``; the
            runner uses :func:`splitkv.tuning.min_split_tokens`, which is
            smaller under the interpreter).
    """
    if min_split_tokens is None:
        from .tuning import TUNED

        min_split_tokens = TUNED["min_split_tokens"]
    if block_n < 1 or min_split_tokens < 0:
        raise ValueError("need block_n >= 1 and min_split_tokens >= 0")
    return cdiv(min_split_tokens, block_n) * block_n


def slicing(prefix_len: int, n_splits: int, block_n: int, min_split: Optional[int] = None,
            split_tokens: Optional[int] = None) -> Tuple[int, int]:
    """``(split_len, n_used)`` of a prefix of ``prefix_len`` keys, exactly as the kernel computes them.

    Arguments as for :func:`split_len`.
    """
    if n_splits < 1 or block_n < 1 or prefix_len < 0:
        raise ValueError("need n_splits >= 1, block_n >= 1 and prefix_len >= 0")
    even = cdiv(cdiv(prefix_len, n_splits), block_n) * block_n
    if split_tokens:
        step = split_tokens
    else:
        step = max(even, min_split_for(block_n) if min_split is None else min_split)
    used = max(1, cdiv(prefix_len, step)) if step else 1  # step 0: empty prefix, min_split 0
    if split_tokens and used > n_splits:
        # The host sizes the grid so that this never binds; the kernel stays exact if it does.
        step, used = even, n_splits
    return step, used


def split_len(
    prefix_len: int, n_splits: int, block_n: int, min_split: Optional[int] = None, *,
    split_tokens: Optional[int] = None,
) -> int:
    """Keys per prefix slice (the last used slice may hold fewer).

    Adaptive mode: ``max(roundup(cdiv(prefix_len, n_splits), block_n), min_split)``;
    fixed-slice mode: ``split_tokens``. Alignment means only a slice's last
    key tile can be partial; ``min_split`` keeps short prefixes from being cut
    into slices too short to pay for their program.

    Args:
        prefix_len: the sequence's prefix keys.
        n_splits: the grid's slices (axis 1).
        block_n: the kernel's key tile.
        min_split: shortest slice, a multiple of ``block_n`` (default
            :func:`min_split_for`\\ ``(block_n)``, the GPU's); 0 for plain even slices.
        split_tokens: the fixed slice length (batch-invariant mode) or ``None``.
    """
    return slicing(prefix_len, n_splits, block_n, min_split, split_tokens)[0]


def n_used(
    prefix_len: int, n_splits: int, block_n: int, min_split: Optional[int] = None, *,
    split_tokens: Optional[int] = None,
) -> int:
    """Slices of a prefix that get a working program: ``max(1, cdiv(prefix_len, split_len))``.

    At most ``n_splits``; at least 1 (an empty prefix still has a program,
    which does the draft block). Arguments as for :func:`split_len`.
    """
    return slicing(prefix_len, n_splits, block_n, min_split, split_tokens)[1]


def split_ranges(
    prefix_len: int, n_splits: int, block_n: int, min_split: Optional[int] = None, *,
    split_tokens: Optional[int] = None,
) -> List[Tuple[int, int]]:
    """``[lo, hi)`` prefix positions of each of the ``n_splits`` slices.

    Slices ``s < n_used`` are the working ones (all non-empty unless the
    prefix is empty); slices ``s >= n_used`` are programs that exit at once
    and are given as the empty range ``(prefix_len, prefix_len)``. Arguments
    as for :func:`split_len`.
    """
    step, used = slicing(prefix_len, n_splits, block_n, min_split, split_tokens)
    ranges = []
    for s in range(n_splits):
        if s < used:
            ranges.append((min(s * step, prefix_len), min(s * step + step, prefix_len)))
        else:
            ranges.append((prefix_len, prefix_len))
    return ranges


def split_keys(
    prefix_lens: Sequence[int], n_splits: int, block_n: int, min_split: Optional[int] = None, *,
    split_tokens: Optional[int] = None,
) -> List[List[int]]:
    """Prefix keys of every (sequence, slice): ``[batch][n_splits]`` ints (0 for exited slices)."""
    return [
        [hi - lo for lo, hi in split_ranges(p, n_splits, block_n, min_split, split_tokens=split_tokens)]
        for p in prefix_lens
    ]


# ---------------------------------------------------------------------------- split counts


#: Upper bound on adaptive slices: bounds the scratch and the merge's work per row.
MAX_SPLITS = 64


#: CUDA's limit on grid axis 1, where the slices go.
MAX_GRID_SPLITS = 65535


#: SM count assumed under the Triton interpreter (no device to ask).
INTERPRETER_SMS = 8


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def device_sm_count(device) -> int:
    """Streaming multiprocessors of ``device`` (a static property, cached)."""
    device = torch.device(device)
    if device.type != "cuda":
        return INTERPRETER_SMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_sm_count(index)


def choose_n_splits(
    batch_size: int,
    head_tiles: int,
    prefix_len: int,
    num_sms: int,
    *,
    programs_per_sm: int = 2,
    min_split_tokens: int = 128,
    max_splits: int = MAX_SPLITS,
    block_n: int = 1,
) -> int:
    """Number of prefix slices per sequence for one verify call.

    Args:
        batch_size: sequences in the batch.
        head_tiles: stage-1 programs per sequence and split (KV heads x row
            tiles with GQA packing; query heads without).
        prefix_len: representative prefix length (``kv_indices.shape[0] //
            batch_size``), a Python int read off shapes.
        num_sms: streaming multiprocessors (:func:`device_sm_count`).
        programs_per_sm: programs one SM runs at once.
        min_split_tokens: shortest slice worth a program.
        max_splits: most slices.
        block_n: the kernel's key tile. Slices are whole key tiles
            (:func:`slicing`), so a count ``n`` may leave programs with nothing
            to read: 31 slices of a 4096-key prefix in 64-key tiles are 22
            slices of 192 keys. The rule weighs each ``n`` by the slices that
            work, and returns that count.

    Returns:
        An int in ``[1, max_splits]``: every slice of a ``prefix_len`` prefix
        holds keys. Results are cached per argument tuple, the prefix counted
        in whole ``block_n`` tiles.
    """
    if batch_size < 1 or head_tiles < 1 or num_sms < 1 or programs_per_sm < 1 or min_split_tokens < 1:
        raise ValueError("batch_size, head_tiles, num_sms, programs_per_sm and min_split_tokens must be positive")
    useful = _useful(prefix_len, min_split_tokens, max_splits)
    # Slicing sees a prefix only through its count of key tiles: pass it rounded up to whole tiles, so the
    # cache keeps its answer while a growing prefix stays within one tile (a step's plan asks once).
    tiles_len = cdiv(int(prefix_len), block_n) * block_n
    return _choose(batch_size * head_tiles, programs_per_sm * num_sms, useful, tiles_len, block_n,
                   min_split_for(block_n, min_split_tokens))


def _useful(prefix_len: int, min_split_tokens: int, max_splits: int) -> int:
    """Most slices worth cutting: one per ``min_split_tokens`` keys, within ``[1, max_splits]``."""
    return max(1, min(-(-int(prefix_len) // min_split_tokens), max_splits))


@functools.lru_cache(maxsize=4096)
def _choose(base: int, slots: int, useful: int, prefix_len: int, block_n: int, min_split: int) -> int:
    def efficiency(used: int) -> float:
        waves = base * used / slots
        return waves / math.ceil(waves)

    ideal = max(efficiency(n) for n in range(1, useful + 1))  # as if every count's slices held keys
    working = [slicing(prefix_len, n, block_n, min_split)[1] for n in range(1, useful + 1)]
    good = [u for u in working if efficiency(u) >= 0.95 * ideal]
    return good[0] if good else max(working, key=efficiency)


def one_wave_n_splits(base: int, prefix_len: int, num_sms: int, *, min_split_tokens: int = 128,
                      max_splits: int = MAX_SPLITS, block_n: int = 1) -> int:
    """Slices for a small launch: one program per SM, in one wave.

    ``num_sms // base`` slices (``base`` = batch x head tiles), no more than
    the prefix has ``min_split_tokens`` slices for, at least 1; then, as in
    :func:`choose_n_splits`, the count of those slices that hold keys once
    they are rounded to whole ``block_n`` tiles.
    """
    n = max(1, min(_useful(prefix_len, min_split_tokens, max_splits), num_sms // max(1, base)))
    return slicing(int(prefix_len), n, block_n, min_split_for(block_n, min_split_tokens))[1]


def fixed_n_splits(max_prefix_len: int, split_tokens: int) -> int:
    """Grid slices for the fixed-slice (batch-invariant) mode.

    Every sequence's prefix is cut into ``cdiv(n_prefix, split_tokens)``
    slices whatever the batch; ``cdiv(max_prefix_len, split_tokens)`` slices
    cover every prefix up to the caller's bound ``max_prefix_len``.
    """
    if split_tokens < 1:
        raise ValueError(f"split_tokens must be positive, got {split_tokens}")
    return max(1, -(-int(max_prefix_len) // split_tokens))


def mean_prefix(kv_len: int, page_size: int, batch_size: int) -> int:
    """Keys per sequence, on average, of ``kv_len`` entries of ``kv_indices`` (pages of ``page_size`` keys)."""
    return kv_len * page_size // max(batch_size, 1)


# ---------------------------------------------------------------------------- merge mode


#: Most partial-output floats (``n_splits x BLOCK_M x Dv``) a tile's last program
#: merges by itself. Past it that one program's serial read of every slice costs
#: more than spreading the merge over several programs (docs/benchmarks.md).
FUSED_MAX_MERGE = 65536


#: Largest ``BLOCK_M`` the tile's last program merges: taller tiles merge faster spread.
FUSED_MAX_BLOCK_M = 16


#: Merge programs inside the verify grid (``MERGE_PROGRAMS``) each merge a block of
#: rows x ``GRID_MERGE_DV`` value columns: ``GRID_MERGE_ROWS[0]`` rows in launches of at
#: most ``GRID_MERGE_FEW`` slices, else ``GRID_MERGE_ROWS[1]`` (the fastest measured).
GRID_MERGE_ROWS = (16, 8)
GRID_MERGE_DV = 64
GRID_MERGE_FEW = 8


#: The second merge launch's program shape (``SEPARATE_MERGE``): tile rows x value columns.
MERGE_ROWS, MERGE_DV = 4, 32


#: Slices a merging program loads per step (the kernels' ``MERGE_UNROLL``): ``MERGE_UNROLL``, or
#: ``GRID_MERGE_UNROLL`` for merge programs in launches of more than ``GRID_MERGE_FEW`` slices, where
#: more loads in flight paid (H200, batch 1, 16-64 slices: 2-7 % faster). The order, hence the bits,
#: is the same either way.
MERGE_UNROLL = 4
GRID_MERGE_UNROLL = 16


def fused_merge_fits(n_splits: int, block_m: int, v_head_dim: int) -> bool:
    """Whether a tile's last program merges its slices itself (one launch); see ``FUSED_MAX_MERGE``."""
    return block_m <= FUSED_MAX_BLOCK_M and n_splits * block_m * v_head_dim <= FUSED_MAX_MERGE


def grid_merge_rows(n_splits: int) -> int:
    """Tile rows per merge program in the verify grid (see ``GRID_MERGE_ROWS``)."""
    return GRID_MERGE_ROWS[0] if n_splits <= GRID_MERGE_FEW else GRID_MERGE_ROWS[1]


def merge_unroll(mode: Optional[int], n_splits: int) -> int:
    """Slices a merging program loads per step, for merge mode ``mode`` (see ``MERGE_UNROLL``)."""
    return GRID_MERGE_UNROLL if mode == MERGE_PROGRAMS and n_splits > GRID_MERGE_FEW else MERGE_UNROLL


def grid_merge_block(n_splits: int, v_head_dim: int) -> Tuple[int, int]:
    """A merge program's block in the verify grid (``MERGE_PROGRAMS``): (tile rows, value columns)."""
    return grid_merge_rows(n_splits), min(GRID_MERGE_DV, next_pow2(v_head_dim))


def merge_launch_block(v_head_dim: int) -> Tuple[int, int]:
    """A program's block in the second merge launch (``SEPARATE_MERGE``): (tile rows, value columns)."""
    return MERGE_ROWS, min(MERGE_DV, next_pow2(v_head_dim))


def merge_chunks(n_splits: int, block_m: int, v_head_dim: int) -> int:
    """Merge programs per tile in the verify grid (``MERGE_PROGRAMS``): blocks of
    :func:`grid_merge_rows` rows x ``GRID_MERGE_DV`` value columns."""
    rows, cols = grid_merge_block(n_splits, v_head_dim)
    return cdiv(block_m, rows) * cdiv(v_head_dim, cols)


def merge_mode(n_splits: int, tiles: int, block_m: int, v_head_dim: int, one_launch: bool = True) -> Optional[int]:
    """Who merges a launch's slices.

    ``None`` for one slice (each tile finishes in registers); with
    ``one_launch=False``, ``SEPARATE_MERGE`` (a second launch); else
    ``LAST_PROGRAM`` where :func:`fused_merge_fits`, else ``MERGE_PROGRAMS``
    (merge programs in the verify grid) while the grid's programs fit CUDA's
    axis-1 limit and a 32-bit ticket, else ``SEPARATE_MERGE``.
    """
    if n_splits == 1:
        return None
    if not one_launch:
        return SEPARATE_MERGE
    if fused_merge_fits(n_splits, block_m, v_head_dim):
        return LAST_PROGRAM
    extra = merge_chunks(n_splits, block_m, v_head_dim)
    if n_splits + extra <= MAX_GRID_SPLITS and tiles * (n_splits + extra) < 2**31:
        return MERGE_PROGRAMS
    return SEPARATE_MERGE


# ---------------------------------------------------------------------------- limits and sizes


class LaunchLimitError(ValueError):
    """A launch whose grid or key positions would pass a CUDA or 32-bit limit."""


def launch_limit_reason(tiles: int, n_splits: int, keys: int) -> Optional[str]:
    """Why a verify grid of ``(tiles, n_splits)`` over ``keys`` prefix keys cannot launch, or ``None``.

    Axis 0 (tiles) holds up to ``2^31 - 1`` programs, axis 1 (slices) up to
    :data:`MAX_GRID_SPLITS`; key positions are 32-bit in the kernel (pool
    rows, draft rows and mask positions are 64-bit).
    """
    if tiles >= 2**31:
        return f"launch limit: {tiles} tiles exceed CUDA's 2^31 - 1 programs on grid axis 0"
    if n_splits > MAX_GRID_SPLITS:
        return f"launch limit: {n_splits} slices exceed CUDA's {MAX_GRID_SPLITS} on grid axis 1"
    if keys >= 2**31:
        return f"launch limit: {keys} prefix keys exceed 32-bit positions"
    return None


#: Polls a merge program makes of its tile's counter before it gives up and reports
#: ``ERR_MERGE_WAIT`` (seconds of polling; a healthy wait ends within a slice's time).
SPIN_LIMIT = 1 << 24


#: Pools whose every element offset is below this gather with 32-bit address arithmetic
#: (the kernel's ``OFFSETS_32``: fewer registers per gathered row), larger ones with 64-bit.
OFFSETS_32_LIMIT = 2**31


def pool_offsets_32(buf: torch.Tensor) -> bool:
    """Whether every element of pool ``buf`` lies within :data:`OFFSETS_32_LIMIT` of its start."""
    return sum((n - 1) * s for n, s in zip(buf.shape, buf.stride())) < OFFSETS_32_LIMIT


#: Counters past a launch's tiles that the merge programs' launch uses: the ticket and the exit count.
GRID_COUNTERS = 2


def workspace_bytes(
    num_q_heads: int,
    num_kv_heads: int,
    v_head_dim: int,
    max_len_extend: int,
    max_bs: int,
    max_splits: int = MAX_SPLITS,
    *,
    pack_gqa: bool = True,
    block_m: Optional[int] = None,
) -> int:
    """Bytes of a caller-owned workspace for calls of up to ``max_bs`` sequences.

    ``tiles = max_bs x head_tiles`` counters (int32), 2 more for the
    grid's ticket and exit count, then (from a 16-byte boundary) the partials
    of ``tiles x max_splits x BLOCK_M`` rows of ``v_head_dim + 1`` float32
    (output and LSE; a bf16 call stores its partial outputs in bf16 and uses half of theirs), where ``BLOCK_M`` is the tile's row count
    (:func:`block_m_for` of ``GROUP x max_len_extend``) and
    ``head_tiles = KV heads x ceil(GROUP x max_len_extend / BLOCK_M)``.

    Args:
        num_q_heads: query heads.
        num_kv_heads: KV heads.
        v_head_dim: value head dimension.
        max_len_extend: most draft tokens per sequence.
        max_bs: most sequences per call.
        max_splits: most prefix slices per call (64 in the adaptive mode; in
            the batch-invariant mode ``cdiv(max_prefix_len, split_tokens)``).
        pack_gqa: as for :class:`VerifySplitKV`.
        block_m: the tile's rows if a custom :class:`TileConfig` is used.

    Returns:
        Bytes (a multiple of 16).
    """
    per_tile = num_q_heads // num_kv_heads if pack_gqa else 1
    block_m = block_m or block_m_for(rows_per_tile(per_tile, max_len_extend))
    tiles = max_bs * head_tiles(num_q_heads, num_kv_heads, max_len_extend, block_m, pack_gqa)
    return counter_bytes(tiles) + tiles * max_splits * block_m * (v_head_dim + 1) * 4


def counter_bytes(tiles: int) -> int:
    """Bytes a workspace's counters take for ``tiles`` tiles (int32, ``GRID_COUNTERS`` more), padded to 16."""
    return -(-(tiles + GRID_COUNTERS) * 4 // 16) * 16


# ---------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class VerifyParams:
    """What a verify launch is planned from: the call's static description and the runner's limits.

    Built by :class:`splitkv.VerifySplitKV` from a call's tensors and options
    (:class:`splitkv.options.VerifyOptions`); never holds a tensor or reads a value.

    Attributes:
        num_q_heads, num_kv_heads, head_dim, v_head_dim, max_len_extend: the head configuration.
        batch_size: sequences in the call (``None``: plan for no particular batch).
        kv_dtype, q_dtype: the pools' and the queries' dtypes.
        page_size: keys per ``kv_indices`` entry (1: a token pool).
        kv_shared: V is a view of K's first ``Dv`` columns in the pools (MLA).
        window: the sliding window's keys, or ``None``.
        pack_gqa: one tile per KV head with all its query heads (else one per query head).
        config: a caller's fixed tile, or ``None`` (the tuned one).
        n_splits: a caller's fixed split count, or ``None`` (the chooser's).
        split_tokens, max_prefix_len: the batch-invariant mode's slice length and bound.
        one_launch: merge in the verify launch where the merge mode allows.
        workspace_tiles: tiles a caller's workspace has counters for, or ``None``.
    """

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    max_len_extend: int
    batch_size: Optional[int]
    kv_dtype: torch.dtype
    q_dtype: torch.dtype
    page_size: int = 1
    kv_shared: bool = False
    window: Optional[int] = None
    pack_gqa: bool = True
    config: Optional[TileConfig] = None
    n_splits: Optional[int] = None
    split_tokens: Optional[int] = None
    max_prefix_len: Optional[int] = None
    one_launch: bool = True
    workspace_tiles: Optional[int] = None

    @property
    def heads_per_tile(self) -> int:
        return self.num_q_heads // self.num_kv_heads if self.pack_gqa else 1

    @property
    def block_m(self) -> int:
        """The tile's rows before a small launch cuts them."""
        return self.config.block_m if self.config else block_m_for(rows_per_tile(self.heads_per_tile,
                                                                                 self.max_len_extend))

    @property
    def fixed_shape(self) -> bool:
        """The caller fixed the tile, the split count or the slice length: the schedule adapts nothing."""
        return self.config is not None or self.n_splits is not None or self.split_tokens is not None

    def head_tiles(self, block_m: int) -> int:
        """Tiles per sequence at ``block_m`` rows (KV heads x row blocks)."""
        return head_tiles(self.num_q_heads, self.num_kv_heads, self.max_len_extend, block_m, self.pack_gqa)

    def prefix(self, kv_len: int) -> int:
        """Representative keys per sequence for ``kv_len`` entries of ``kv_indices``; under a window, the
        window's keys (the grid is sized for the window itself, as a plain prefix of that length would be:
        a 128-key window at a 64k prefix takes one slice and one launch)."""
        prefix = mean_prefix(kv_len, self.page_size, self.batch_size or 1)
        return prefix if self.window is None else min(prefix, self.window)


@dataclass(frozen=True)
class DeviceFacts:
    """What the schedule needs to know of a device: SMs, per-block shared memory (``None``: no limit,
    the interpreter), and whether kernels run through the interpreter."""

    num_sms: int
    shared_memory: Optional[int]
    interpreting: bool


@dataclass(frozen=True)
class TilePlan:
    """A plan's tile, fixed when the plan is made.

    Attributes:
        params, facts: what it was planned from (a plan takes a tile planned from equal ones).
        config: the tile shape.
        small: the small-launch schedule (one program per SM, one wave).
        head_tiles: tiles per sequence at ``config.block_m`` rows.
        tiles: tiles of the launch (grid axis 0).
        min_split: the shortest slice, in keys (the kernel's ``min_split``).
        programs_per_sm: programs of this tile one SM holds at once.
    """

    params: VerifyParams
    facts: DeviceFacts
    config: TileConfig
    small: bool
    head_tiles: int
    tiles: int
    min_split: int
    programs_per_sm: int


@dataclass(frozen=True)
class SplitPlan:
    """A launch's slices and who merges them: fixed by the split count, which follows the step's prefixes.

    Attributes:
        n_splits: the grid's prefix slices.
        merge: who merges (``None`` for one slice, ``LAST_PROGRAM``, ``MERGE_PROGRAMS``, ``SEPARATE_MERGE``).
        grid: ``(tiles, n_splits [+ merge programs], 1)``.
        merge_rows, merge_dv, merge_unroll: a merging program's block and slices per step.
        scratch_bytes: partials, sized as float32 (0 with one slice); ``lse_offset``: where the LSEs start.
        counters: int32 counters the launch needs, zeroed (0: none).
        merge_grid: the second merge launch's grid (``SEPARATE_MERGE``), else ``None``.
    """

    n_splits: int
    merge: Optional[int]
    grid: Tuple[int, int, int]
    merge_rows: int
    merge_dv: int
    merge_unroll: int
    scratch_bytes: int
    lse_offset: int
    counters: int
    merge_grid: Optional[Tuple[int, int, int]]

    @property
    def fused(self) -> bool:
        """One launch: no merge kernel follows the verify kernel."""
        return self.merge != SEPARATE_MERGE


def device_facts(device, num_sms: Optional[int] = None) -> DeviceFacts:
    """The schedule's :class:`DeviceFacts` of ``device`` (``num_sms``: plan for that many SMs instead)."""
    from .launch import interpreting

    device = torch.device(device)
    return DeviceFacts(num_sms if num_sms is not None else device_sm_count(device), device_shared_memory(device),
                       interpreting())


def launch_rows(p: VerifyParams, facts: DeviceFacts) -> int:
    """Rows per tile for ``p``'s batch: :func:`launch_block_m`, but the plan's own rows where the caller fixed
    the shape (a batch-invariant call's bits must not depend on the batch) or a caller's workspace has fewer
    counters than the cut tiles would need."""
    if p.batch_size is None or p.fixed_shape:
        return p.block_m
    block_m = launch_block_m(p.block_m, lambda b: p.batch_size * p.head_tiles(b), facts.num_sms)
    if p.workspace_tiles is not None and p.batch_size * p.head_tiles(block_m) > p.workspace_tiles:
        return p.block_m
    return block_m


def plan_tile(p: VerifyParams, facts: DeviceFacts, table, prefix: int = 0) -> TilePlan:
    """The tile for ``p`` on a device, for sequences of about ``prefix`` keys: the tuned tile, or the
    small-launch tile where it was measured faster, shrunk where it would not fit the device's shared
    memory (:func:`splitkv.resources.fit_tile`).

    ``table`` is the device's :class:`splitkv.tuning.TunedTable` (its own file, a user's, or one derived
    from the device's properties: :func:`splitkv.tuning.table_for`); the tile, its K layout and the
    programs per SM come from one of its rows (:meth:`~splitkv.tuning.TunedTable.row`). The gate plans
    the tile of a new call and its plan takes that one (:func:`splitkv.gate.admit`).

    Raises:
        ValueError: when no tile fits (the gate declines such calls first).
    """
    block_m = launch_rows(p, facts)
    widest, kv_bytes = max(p.head_dim, p.v_head_dim), element_size(p.kv_dtype)
    # The tile, its K layout and the programs per SM the split chooser counts: one row of the device's table.
    row = table.row(widest, block_m, kv_bytes, p.page_size)
    small = None
    if not (p.batch_size is None or p.fixed_shape or facts.interpreting):
        small = table.small_batch_tile(widest, block_m, kv_bytes, p.batch_size * p.head_tiles(block_m),
                                       facts.num_sms, prefix)
    if p.config is not None:
        cfg = p.config
    else:
        if facts.interpreting:
            cfg = interpreter_tile(block_m)
        elif small is not None:
            cfg = TileConfig(block_m, *small)
        else:
            cfg = _tile_of(block_m, row)
        fitted = fit_tile(cfg, p.head_dim, p.v_head_dim, p.kv_dtype, p.q_dtype, facts.shared_memory, p.page_size,
                          p.max_len_extend, p.kv_shared)
        if fitted is None:
            raise ValueError(shared_memory_reason(cfg, p.head_dim, p.v_head_dim, p.kv_dtype, p.q_dtype,
                                                  facts.shared_memory, p.page_size, p.max_len_extend, p.kv_shared))
        cfg = fitted
    per_seq = p.head_tiles(cfg.block_m)
    return TilePlan(params=p, facts=facts, config=cfg, small=small is not None, head_tiles=per_seq,
                    tiles=(p.batch_size or 1) * per_seq,
                    min_split=min_split_for(cfg.block_n, table.min_split_tokens()),
                    programs_per_sm=row.programs_per_sm)


def count_splits(p: VerifyParams, tile: TilePlan, facts: DeviceFacts, table, prefix: int) -> int:
    """Grid slices for sequences of about ``prefix`` keys: the caller's fixed count; in the batch-invariant
    mode ``cdiv(max_prefix_len, split_tokens)``; for a small launch one program per SM
    (:func:`one_wave_n_splits`); else :func:`choose_n_splits`."""
    if p.n_splits is not None:
        return p.n_splits
    if p.split_tokens is not None:
        return fixed_n_splits(p.max_prefix_len, p.split_tokens)
    block_n, min_tokens = tile.config.block_n, table.min_split_tokens()
    if tile.small:
        return one_wave_n_splits(tile.tiles, prefix, facts.num_sms, min_split_tokens=min_tokens, block_n=block_n)
    return choose_n_splits(p.batch_size or 1, tile.head_tiles, prefix, facts.num_sms,
                           programs_per_sm=tile.programs_per_sm, min_split_tokens=min_tokens, block_n=block_n)


def plan_splits(p: VerifyParams, tile: TilePlan, n_splits: int, separate: bool = False) -> SplitPlan:
    """Slices, merge mode, grid and scratch for a launch of ``n_splits`` slices (``separate``: merge in a
    second launch whatever :func:`merge_mode` says)."""
    block_m, dv = tile.config.block_m, p.v_head_dim
    mode = merge_mode(n_splits, tile.tiles, block_m, dv, p.one_launch)
    if separate and mode is not None:
        mode = SEPARATE_MERGE
    # Variants: without merge programs the slice count is taken as 1, so that it makes no other kernels.
    variant = n_splits if mode == MERGE_PROGRAMS else 1
    extra = merge_chunks(n_splits, block_m, dv) if mode == MERGE_PROGRAMS else 0
    rows = tile.tiles * n_splits * block_m
    merge_grid = None
    if mode == SEPARATE_MERGE:
        m_rows, m_cols = merge_launch_block(dv)
        merge_grid = (tile.tiles, cdiv(block_m, m_rows), cdiv(dv, m_cols))
    return SplitPlan(
        n_splits=n_splits, merge=mode, grid=(tile.tiles, n_splits + extra, 1),
        merge_rows=grid_merge_rows(variant), merge_dv=grid_merge_block(n_splits, dv)[1],
        merge_unroll=merge_unroll(mode, variant),
        scratch_bytes=0 if n_splits == 1 else rows * (dv + 1) * 4,
        lse_offset=0 if n_splits == 1 else rows * dv,
        counters=tile.tiles + GRID_COUNTERS if mode in (LAST_PROGRAM, MERGE_PROGRAMS) else 0,
        merge_grid=merge_grid,
    )
