"""Launch settings measured on the H200: the table the kernel's tile choice reads.

``tuned_h200.json`` beside this file is written by ``python -m splitkv.bench.tune
--replace`` on an H200 (a sweep over BLOCK_N, warps, pipeline stages and the K tile's layout, and
over the split chooser's slice length, timed from CUDA graphs with
``do_bench``). It holds:

* ``tiles``: per (widest head dim, BLOCK_M, pool bytes per element) the fastest
  ``block_n``, ``num_warps``, ``num_stages``, ``k_rows`` (see
  :class:`splitkv.schedule.TileConfig`) and the programs per SM that the
  compiled kernel's registers and shared memory allow;
* ``paged_tiles``: the same per (key, page size) for paged pools, swept
  apart because a page's contiguous rows change what the tile costs (see
  :func:`paged_tile_row`);
* ``min_split_tokens``: the shortest prefix slice worth a program of its own;
* ``small_batch_tiles``: per key, the tile for launches too small to fill
  the device (at most one program per SM, see :func:`small_batch_tile`),
  where one was measured faster than the ``tiles`` entry: with one program
  per SM, a deeper pipeline (more shared memory) costs no occupancy;
* the device, date and software versions of the sweep.

A key the sweep did not measure takes its :data:`DEFAULT_TILES` entry if it
has one (``measured`` says whether it was timed), else the
nearest measured entry (same pool element size, then nearest head dim, then
nearest BLOCK_M) for its block sizes, warps and stages, and the K layout the
kernel was written for (``k_rows=False``): the layout's effect does not carry
over between tile shapes (see :func:`k_rows`).
"""

from __future__ import annotations

import functools
import json
import os
import warnings
from typing import Dict, Tuple

from .validate import interpreting

__all__ = ["TUNED", "tuned_tile", "programs_per_sm", "min_split_tokens", "small_batch_tile", "TABLE_PATH",
           "SMALL_BATCH_SMS_PER_TILE", "SMALL_BATCH_MAX_PREFIX", "k_rows", "paged_tile_row", "DEFAULT_TILES"]

#: Where the sweep's table lives.
TABLE_PATH = os.path.join(os.path.dirname(__file__), "tuned_h200.json")


def _load() -> dict:
    with open(TABLE_PATH) as f:
        table = json.load(f)
    tiles = {}
    for row in table["tiles"]:
        tiles[(row["head_dim"], row["block_m"], row["kv_bytes"])] = row
    table["tiles"] = tiles
    table["paged_tiles"] = {(r["head_dim"], r["block_m"], r["kv_bytes"], r["page_size"]): r
                            for r in table.get("paged_tiles", [])}
    table["small_batch_tiles"] = {(r["head_dim"], r["block_m"], r["kv_bytes"]): r
                                  for r in table.get("small_batch_tiles", [])}
    return table


#: The sweep's table (see the module docstring).
TUNED: dict = _load()

_untuned_checked = False


def _notice_if_untuned() -> None:
    """Once per process, on a CUDA GPU the table was not swept on: one line saying how to tune.

    That GPU gets the table's entries as its defaults, as before; under the
    interpreter (no GPU) there is nothing to say.
    """
    global _untuned_checked
    if _untuned_checked or interpreting():
        return
    _untuned_checked = True
    import torch

    if not torch.cuda.is_available():
        return
    name, swept = torch.cuda.get_device_name(), TUNED.get("device")
    if name != swept:
        warnings.warn(f"splitkv: no tuned tile table for {name}; using the defaults measured on the {swept} "
                      f"(splitkv/{os.path.basename(TABLE_PATH)}). To tune for this GPU: "
                      "python -m splitkv.bench.tune --replace (over ten minutes)", stacklevel=3)


#: Tiles for keys ``(widest head dim, BLOCK_M, pool bytes per element)`` that the table's sweep
#: does not cover. MLA (576/512, one KV head, 64 rows): 64 keys, 8 warps, 2 stages was the fastest
#: of ``python -m splitkv.bench.mla --tiles`` (BLOCK_N 32/64 x warps 4/8 x stages 1/2, and 32 keys
#: in 3 stages) on all four of its rows, bf16 pool, H200 (``figures/mla_tiles_h200.json``): at 8
#: warps the 64 x 512 float32 accumulator takes 128 registers a thread, at 4 warps the kernel spills
#: and the same tile runs 1.5-1.8x slower. MLA's 32-row tiles (:func:`splitkv.schedule.launch_block_m`: batch 1)
#: take the same tile: at batch 1, 16 heads, 4k / 16k / 64k it ran in 28.0 / 43.4 / 104.0 us, where 4 warps took
#: 31.6 / 50.3 / 114.6 and the 64-row tile 33.4 / 53.9 / 122.6 (64 slices each; H200, 2026-12-02, bf16).
#: The fp8 pool's entries are the same tiles (``measured: False``): ``--tiles --fp8`` (H200, 2026-12-03,
#: ``figures/mla_tiles_fp8_h200.json``) found one stage 2-8 % faster on all four rows, not taken while
#: fp8 MLA's wrong outputs under compute-sanitizer (64-key tiles only, worse at one stage; never seen
#: without the tool) are unexplained (benchmarks page, Known limits).
DEFAULT_TILES = {
    (576, block_m, kv_bytes): dict(head_dim=576, block_m=block_m, kv_bytes=kv_bytes, block_n=64, num_warps=8,
                                   num_stages=2, k_rows=False, programs_per_sm=1, measured=kv_bytes == 2)
    for kv_bytes in (1, 2) for block_m in (32, 64)
}


@functools.lru_cache(maxsize=None)
def _nearest(head_dim: int, block_m: int, kv_bytes: int) -> Dict:
    tiles = TUNED["tiles"]
    if (head_dim, block_m, kv_bytes) in tiles:
        return tiles[(head_dim, block_m, kv_bytes)]
    if (head_dim, block_m, kv_bytes) in DEFAULT_TILES:
        return DEFAULT_TILES[(head_dim, block_m, kv_bytes)]
    same = [k for k in tiles if k[2] == kv_bytes] or list(tiles)
    key = min(same, key=lambda k: (abs(k[0] - head_dim), abs(k[1] - block_m)))
    return tiles[key]


def paged_tile_row(head_dim: int, block_m: int, kv_bytes: int, page_size: int):
    """The ``paged_tiles`` row a paged pool of ``page_size`` uses, or ``None`` (the token pool's tile).

    Only keys the paged sweep measured have one; among them, the row of the
    largest swept page size not above ``page_size`` (pages of 32 take the row
    of 16, pages of 128 the row of 64). A token pool (``page_size`` 1) and
    pages smaller than every swept size take the token pool's tile.

    Why a row of its own: a page is contiguous rows, and the compiler buffers
    a tile of such rows in shared memory differently from a gather of
    scattered slots, so the fastest stage count (and with it the programs
    per SM) can differ from the token pool's (docs/benchmarks.md).
    """
    if page_size <= 1:
        return None
    rows = [(key[3], row) for key, row in TUNED["paged_tiles"].items()
            if key[:3] == (head_dim, block_m, kv_bytes) and key[3] <= page_size]
    return max(rows, key=lambda r: r[0])[1] if rows else None


def _tile_row(head_dim: int, block_m: int, kv_bytes: int, page_size: int) -> Dict:
    """The table row a launch's tile comes from: its paged row if it has one, else the nearest token-pool row."""
    _notice_if_untuned()
    return paged_tile_row(head_dim, block_m, kv_bytes, page_size) or _nearest(head_dim, block_m, kv_bytes)


def tuned_tile(head_dim: int, block_m: int, kv_bytes: int, page_size: int = 1) -> Tuple[int, int, int, bool]:
    """``(block_n, num_warps, num_stages, k_rows)`` for the widest head dim, BLOCK_M and pool element size.

    ``page_size`` > 1: a paged pool, which takes its :func:`paged_tile_row`
    where the sweep has one. float32 pools (4 bytes, tests and references
    rather than serving) are not swept: they take the 16-bit entry with half
    the keys per step and at most two stages, which keeps the pipelined K/V
    tiles inside shared memory. ``k_rows`` follows :func:`k_rows`.
    """
    if kv_bytes > 2:
        block_n, warps, stages, _ = tuned_tile(head_dim, block_m, 2, page_size)
        return max(16, block_n // 2), warps, min(stages, 2), k_rows(head_dim, block_m, kv_bytes, page_size)
    row = _tile_row(head_dim, block_m, kv_bytes, page_size)
    return row["block_n"], row["num_warps"], row["num_stages"], k_rows(head_dim, block_m, kv_bytes, page_size)


def k_rows(head_dim: int, block_m: int, kv_bytes: int, page_size: int = 1) -> bool:
    """Whether K tiles load as ``[BLOCK_N, D]`` rows (``TileConfig.k_rows``): the sweep's choice.

    Only for a key the sweep measured (for a paged pool, its
    :func:`paged_tile_row`, else the token pool's row); any other key (for
    instance Gemma-2's 16-row tiles of head dim 256, or a float32 pool) loads
    K as ``[D, BLOCK_N]``. The layout's effect does not carry over between
    tile shapes: rows help some tiles and slow others, so only a measured
    key gets them.
    """
    row = paged_tile_row(head_dim, block_m, kv_bytes, page_size) or TUNED["tiles"].get((head_dim, block_m, kv_bytes))
    return bool(row is not None and row.get("k_rows", False))


def programs_per_sm(head_dim: int, block_m: int, kv_bytes: int, page_size: int = 1) -> int:
    """Programs of the verify kernel one SM holds at once (from the sweep's compiled kernels)."""
    return _tile_row(head_dim, block_m, kv_bytes, page_size)["programs_per_sm"]


#: Under the Triton interpreter (CPU tests): short slices, so that small test
#: problems are cut into several slices and the in-kernel merge runs.
INTERPRETER_MIN_SPLIT_TOKENS = 32


def min_split_tokens() -> int:
    """The shortest prefix slice the adaptive chooser gives a program of its own."""
    if interpreting():
        return INTERPRETER_MIN_SPLIT_TOKENS
    _notice_if_untuned()
    return TUNED["min_split_tokens"]


#: A launch is *small* when each of its tiles (sequence x head tile) has at
#: least this many SMs to itself: the schedule then gives every tile
#: ``num_sms // tiles`` slices, one program per SM, one wave.
SMALL_BATCH_SMS_PER_TILE = 8
#: Longest representative prefix served by the small-launch schedule: the
#: sweep measured it faster up to 16k; at 64k the throughput tile and the
#: usual chooser are faster.
SMALL_BATCH_MAX_PREFIX = 16384


def small_batch_tile(head_dim: int, block_m: int, kv_bytes: int, tiles: int, num_sms: int,
                     prefix_len: int = 0):
    """``(block_n, num_warps, num_stages, k_rows)`` for a small launch, or ``None``.

    ``k_rows`` follows :func:`k_rows` (the throughput tile's layout). ``None`` when the launch is not small
    (``tiles * SMALL_BATCH_SMS_PER_TILE > num_sms``), its representative
    prefix is longer than :data:`SMALL_BATCH_MAX_PREFIX`, or the sweep found
    no tile faster than the throughput tile for this (head dim, BLOCK_M, pool
    element size): then the usual schedule runs.
    """
    if tiles * SMALL_BATCH_SMS_PER_TILE > num_sms or prefix_len > SMALL_BATCH_MAX_PREFIX:
        return None
    row = TUNED["small_batch_tiles"].get((head_dim, block_m, kv_bytes))
    if row is None:
        return None
    return row["block_n"], row["num_warps"], row["num_stages"], k_rows(head_dim, block_m, kv_bytes)
