"""Tuned launch settings per GPU: the tables the kernel's tile choice reads, one per device name.

Where the tables are. :func:`table_for` looks for ``<name>.json``, ``<name>``
the device name normalised by :func:`normalise_name` (``"NVIDIA H200"`` ->
``nvidia_h200``), first in the **user table directory** (:func:`user_dir`:
``$SPLITKV_TUNED_DIR``, else ``$XDG_CACHE_HOME/splitkv/tuned``, else
``~/.cache/splitkv/tuned``), which ``python -m splitkv.bench.tune`` writes,
then in the package's ``splitkv/tables/`` (:data:`PACKAGE_TABLES`; the H200's,
``nvidia_h200.json``, ships with the package). The package's own files are
never written.

What a table holds (written by ``python -m splitkv.bench.tune``: a sweep over
BLOCK_N, warps, pipeline stages and the K tile's layout, and over the split
chooser's slice length, timed from CUDA graphs with ``do_bench``):

* ``tiles``: per (widest head dim, BLOCK_M, pool bytes per element) the fastest
  ``block_n``, ``num_warps``, ``num_stages``, ``k_rows`` (see
  :class:`splitkv.schedule.TileConfig`) and the programs per SM that the
  compiled kernel's registers and shared memory allow;
* ``paged_tiles``: the same per (key, page size) for paged pools, swept
  apart because a page's contiguous rows change what the tile costs (see
  :meth:`TunedTable.paged_tile_row`);
* ``min_split_tokens``: the shortest prefix slice worth a program of its own;
* ``small_batch_tiles``: per key, the tile for launches too small to fill
  the device (at most one program per SM, see :meth:`TunedTable.small_batch_tile`),
  where one was measured faster than the ``tiles`` entry: with one program
  per SM, a deeper pipeline (more shared memory) costs no occupancy;
* the device, date and software versions of the sweep.

A key the sweep did not measure takes its :data:`DEFAULT_TILES` entry if it
has one (``measured`` says whether it was timed), else the
nearest measured entry (same pool element size, then nearest head dim, then
nearest BLOCK_M) for its block sizes, warps and stages, and the K layout the
kernel was written for (``k_rows=False``): the layout's effect does not carry
over between tile shapes (see :meth:`TunedTable.k_rows`).

A GPU without a table of its own (``TunedTable.measured`` false) keeps the
tile shapes of the package's default table (:data:`DEFAULT_DEVICE`'s), and
takes its programs per SM from its own limits (:class:`DeviceLimits`, read
from ``torch.cuda.get_device_properties``): shared memory per SM and per
block against the tile's estimate (:func:`splitkv.resources.shared_memory_bytes`),
registers per SM against the registers the sweep's compiled kernel used, and
threads per SM. One warning per device name says so, and how to tune. Under
the Triton interpreter (``table_for(None)`` or a CPU device) the default
table's answers hold, with shorter slices (:data:`INTERPRETER_MIN_SPLIT_TOKENS`).

Module-level ``TUNED``, ``TABLE_PATH``, ``min_split_tokens`` and
``small_batch_tile`` are kept for the notebooks; each is a thin wrapper over
:func:`table_for` (see their docstrings).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import re
import threading
import warnings
from collections import abc
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Dict, Iterator, Mapping, Optional, Tuple

from .resources import DeviceLimits, device_limits
from .launch import interpreting

__all__ = ["TunedTable", "TileRow", "DeviceLimits", "table_for", "table_named", "normalise_name", "user_dir",
           "table_path", "clear_cache", "using", "PACKAGE_TABLES", "DEFAULT_DEVICE", "TUNED_DIR_ENV", "DEFAULT_TILES",
           "SMALL_BATCH_SMS_PER_TILE", "SMALL_BATCH_MAX_PREFIX", "INTERPRETER_MIN_SPLIT_TOKENS",
           # wrappers over table_for, kept for the notebooks (see the module docstring)
           "TUNED", "TABLE_PATH", "min_split_tokens", "small_batch_tile"]

#: The tables the package ships, one ``<normalise_name(device)>.json`` each.
PACKAGE_TABLES = os.path.join(os.path.dirname(__file__), "tables")
#: The GPU whose table gives the tile shapes of GPUs without one (and of the interpreter).
DEFAULT_DEVICE = "NVIDIA H200"
#: The environment variable naming the user table directory (:func:`user_dir`).
TUNED_DIR_ENV = "SPLITKV_TUNED_DIR"
#: Under the Triton interpreter (CPU tests): short slices, so that small test
#: problems are cut into several slices and the in-kernel merge runs.
INTERPRETER_MIN_SPLIT_TOKENS = 32
#: A launch is *small* when each of its tiles (sequence x head tile) has at
#: least this many SMs to itself: the schedule then gives every tile
#: ``num_sms // tiles`` slices, one program per SM, one wave.
SMALL_BATCH_SMS_PER_TILE = 8
#: Longest representative prefix served by the small-launch schedule: the
#: sweep measured it faster up to 16k; at 64k the throughput tile and the
#: usual chooser are faster.
SMALL_BATCH_MAX_PREFIX = 16384
#: Most programs an SM is counted to hold (a derived count never says more).
MAX_PROGRAMS_PER_SM = 32
#: Registers per thread assumed for a tile the sweep did not compile (the most a thread can have).
UNKNOWN_REGS_PER_THREAD = 255

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
DEFAULT_TILES = MappingProxyType({
    (576, block_m, kv_bytes): MappingProxyType(dict(
        head_dim=576, block_m=block_m, kv_bytes=kv_bytes, block_n=64, num_warps=8, num_stages=2, k_rows=False,
        programs_per_sm=1, measured=kv_bytes == 2))
    for kv_bytes in (1, 2) for block_m in (32, 64)
})

Tile = Tuple[int, int, int, bool]


# ---------------------------------------------------------------------------- names and places


def normalise_name(device_name: str) -> str:
    """A safe file stem for a device name: lower case, runs of anything but ``[a-z0-9]`` as one ``_``.

    ``"NVIDIA H200"`` -> ``"nvidia_h200"``, ``"NVIDIA A100-SXM4-80GB"`` ->
    ``"nvidia_a100_sxm4_80gb"``, ``"AMD Instinct MI300X"`` -> ``"amd_instinct_mi300x"``.
    No separators, dots or spaces survive, so the stem cannot leave its
    directory; at most 100 characters; ``"unknown_gpu"`` for a name with none left.
    """
    stem = re.sub(r"[^a-z0-9]+", "_", str(device_name).lower()).strip("_")[:100].strip("_")
    return stem or "unknown_gpu"


def user_dir() -> str:
    """The user table directory, read before the package's and written by ``python -m splitkv.bench.tune``.

    ``$SPLITKV_TUNED_DIR`` where set, else ``$XDG_CACHE_HOME/splitkv/tuned``,
    else ``~/.cache/splitkv/tuned``. Read at every lookup (it need not exist).
    """
    env = os.environ.get(TUNED_DIR_ENV)
    if env:
        return os.path.abspath(os.path.expanduser(env))
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "splitkv", "tuned")


def table_path(device_name: str) -> Optional[str]:
    """The table file a device reads: ``<user_dir()>/<name>.json`` if it exists, else the package's, else ``None``."""
    stem = normalise_name(device_name) + ".json"
    for directory in (user_dir(), PACKAGE_TABLES):
        path = os.path.join(directory, stem)
        if os.path.isfile(path):
            return path
    return None


# ---------------------------------------------------------------------------- the table


class _Frozen(tuple):
    """A list of JSON data once frozen (:func:`_freeze` passes it through)."""


def _freeze(obj: Any) -> Any:
    """A read-only deep copy of JSON data: dicts as mapping proxies, lists as tuples. Data already frozen
    is returned as it is (tables are made from frozen files), and only containers cost a call."""
    if type(obj) is MappingProxyType or type(obj) is _Frozen:
        return obj
    if isinstance(obj, abc.Mapping):
        return MappingProxyType({k: v if type(v) in _SCALARS else _freeze(v) for k, v in obj.items()})
    if isinstance(obj, (list, tuple)):
        return _Frozen([v if type(v) in _SCALARS else _freeze(v) for v in obj])
    return obj


#: What JSON holds that is read-only already.
_SCALARS = frozenset((str, int, float, bool, type(None)))


def _thaw(obj: Any) -> Any:
    """A plain (JSON) deep copy of :func:`_freeze`'s output: dicts and lists again."""
    if isinstance(obj, abc.Mapping):
        return {k: _thaw(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return [_thaw(v) for v in obj]
    return copy.copy(obj)


def _rows(rows, *fields) -> Mapping:
    """Rows (a list of dicts, or an already keyed mapping) keyed by ``fields``, read-only, in their order."""
    if isinstance(rows, abc.Mapping):
        return MappingProxyType({tuple(k): _freeze(r) for k, r in rows.items()})
    return MappingProxyType({tuple(r[f] for f in fields): _freeze(r) for r in rows or ()})


_KEY = ("head_dim", "block_m", "kv_bytes")


@dataclass(frozen=True, eq=False)
class TunedTable:
    """One GPU's tuned launch settings (read-only): what :func:`table_for` gives for a device.

    Attributes:
        device_name: the device's name (``"interpreter"`` for the Triton interpreter's table).
        source: the file the table came from, or ``"derived"`` (an untuned GPU: the default
            table's tile shapes, programs per SM from :attr:`limits`).
        measured: whether the table was swept on this GPU (its file names this device).
        tiles, paged_tiles, small_batch_tiles: the file's rows, keyed as in the module docstring.
        split_tokens: the table's ``min_split_tokens`` (see :meth:`min_split_tokens`).
        interpreter: the Triton interpreter's table (:meth:`min_split_tokens` gives its short slices).
        limits: the device's :class:`DeviceLimits`, where known.
        derived_from: for a derived table, the file its tile shapes came from.
        data: the whole file, read-only (sweep records, date, versions).

    Every mapping in it is read-only and the dataclass is frozen. To try
    other settings (as the sweep does), make a new table with
    :meth:`from_json` (``table.to_json()`` edited) and install it with :func:`using`.
    """

    device_name: str
    source: str
    measured: bool
    tiles: Mapping = field(repr=False)
    paged_tiles: Mapping = field(repr=False)
    small_batch_tiles: Mapping = field(repr=False)
    split_tokens: int = 128
    interpreter: bool = False
    limits: Optional[DeviceLimits] = None
    derived_from: Optional[str] = None
    data: Mapping = field(default_factory=lambda: MappingProxyType({}), repr=False)

    # -- construction

    @classmethod
    def from_json(cls, data: Mapping, device_name: str, source: str, measured: bool, *,
                  limits: Optional[DeviceLimits] = None, interpreter: bool = False,
                  derived_from: Optional[str] = None) -> "TunedTable":
        """A table from a table file's content (``tiles`` etc. as lists of rows, or already keyed)."""
        return cls(device_name=device_name, source=source, measured=measured,
                   tiles=_rows(data.get("tiles"), *_KEY),
                   paged_tiles=_rows(data.get("paged_tiles"), *_KEY, "page_size"),
                   small_batch_tiles=_rows(data.get("small_batch_tiles"), *_KEY),
                   split_tokens=int(data["min_split_tokens"]), interpreter=interpreter, limits=limits,
                   derived_from=derived_from,
                   data=_freeze({k: v for k, v in data.items()
                                 if k not in ("tiles", "paged_tiles", "small_batch_tiles")}))

    def to_json(self) -> Dict:
        """The table as a table file holds it (a new, mutable dict: rows as lists)."""
        out = _thaw(self.data)
        out["min_split_tokens"] = self.split_tokens
        for name in ("tiles", "paged_tiles", "small_batch_tiles"):
            out[name] = [_thaw(r) for r in getattr(self, name).values()]
        return out

    def replace(self, **changes) -> "TunedTable":
        """A new table: this one with ``changes`` (this one is unchanged).

        Attributes (``device_name``, ``source``, ``measured``, ``limits``,
        ``interpreter``, ``derived_from``) or table-file entries:
        ``min_split_tokens``, ``tiles`` / ``paged_tiles`` / ``small_batch_tiles``
        (lists of rows, or mappings keyed as :attr:`tiles` is), any other key.
        With :func:`using`, for instance a small-batch tile to try::

            trial = table_for(None).replace(small_batch_tiles={(128, 16, 2): dict(block_n=64, num_warps=4,
                                                                                  num_stages=3)})
            with using(trial): ...
        """
        names = ("device_name", "source", "measured", "limits", "interpreter", "derived_from")
        attrs = {name: changes.pop(name, getattr(self, name)) for name in names}
        data = dict(self.data, min_split_tokens=self.split_tokens, tiles=self.tiles, paged_tiles=self.paged_tiles,
                    small_batch_tiles=self.small_batch_tiles)
        data.update(changes)
        return TunedTable.from_json(data, attrs.pop("device_name"), attrs.pop("source"), attrs.pop("measured"),
                                    **attrs)

    def keyed(self) -> Mapping:
        """The table in the old ``TUNED`` form (read-only): the file's entries, ``tiles``,
        ``paged_tiles`` and ``small_batch_tiles`` keyed by their tuples."""
        return MappingProxyType(dict(self.data, min_split_tokens=self.split_tokens, tiles=self.tiles,
                                     paged_tiles=self.paged_tiles, small_batch_tiles=self.small_batch_tiles))

    # -- rows

    def nearest(self, head_dim: int, block_m: int, kv_bytes: int) -> Mapping:
        """The token-pool row for a key: its own, its :data:`DEFAULT_TILES` entry, else the nearest measured."""
        return _nearest(self, head_dim, block_m, kv_bytes)

    def paged_tile_row(self, head_dim: int, block_m: int, kv_bytes: int, page_size: int) -> Optional[Mapping]:
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
        rows = [(key[3], row) for key, row in self.paged_tiles.items()
                if key[:3] == (head_dim, block_m, kv_bytes) and key[3] <= page_size]
        return max(rows, key=lambda r: r[0])[1] if rows else None

    def _tile_row(self, head_dim: int, block_m: int, kv_bytes: int, page_size: int) -> Mapping:
        """The row a launch's tile comes from: its paged row if it has one, else the nearest token-pool row."""
        return self.paged_tile_row(head_dim, block_m, kv_bytes, page_size) or self.nearest(head_dim, block_m,
                                                                                          kv_bytes)

    # -- answers

    def row(self, head_dim: int, block_m: int, kv_bytes: int, page_size: int = 1) -> "TileRow":
        """Everything a launch takes from the table for one key, in one lookup: :meth:`tile`'s block sizes
        and K layout with :meth:`programs_per_sm`'s count (the schedule's one read of the table per plan)."""
        return _row(self, head_dim, block_m, kv_bytes, page_size)

    def tile(self, head_dim: int, block_m: int, kv_bytes: int, page_size: int = 1) -> Tile:
        """``(block_n, num_warps, num_stages, k_rows)`` for the widest head dim, BLOCK_M and pool element size.

        ``page_size`` > 1: a paged pool, which takes its :meth:`paged_tile_row`
        where the sweep has one. float32 pools (4 bytes, tests and references
        rather than serving) are not swept: they take the 16-bit entry with half
        the keys per step and at most two stages, which keeps the pipelined K/V
        tiles inside shared memory. ``k_rows`` follows :meth:`k_rows`.
        """
        if kv_bytes > 2:
            block_n, warps, stages, _ = self.tile(head_dim, block_m, 2, page_size)
            return max(16, block_n // 2), warps, min(stages, 2), self.k_rows(head_dim, block_m, kv_bytes, page_size)
        row = self._tile_row(head_dim, block_m, kv_bytes, page_size)
        return row["block_n"], row["num_warps"], row["num_stages"], self.k_rows(head_dim, block_m, kv_bytes,
                                                                                 page_size)

    def k_rows(self, head_dim: int, block_m: int, kv_bytes: int, page_size: int = 1) -> bool:
        """Whether K tiles load as ``[BLOCK_N, D]`` rows (``TileConfig.k_rows``): the sweep's choice.

        Only for a key the sweep measured (for a paged pool, its
        :meth:`paged_tile_row`, else the token pool's row); any other key (for
        instance Gemma-2's 16-row tiles of head dim 256, or a float32 pool) loads
        K as ``[D, BLOCK_N]``. The layout's effect does not carry over between
        tile shapes: rows help some tiles and slow others, so only a measured
        key gets them.
        """
        row = self.paged_tile_row(head_dim, block_m, kv_bytes, page_size) or self.tiles.get(
            (head_dim, block_m, kv_bytes))
        return bool(row is not None and row.get("k_rows", False))

    def programs_per_sm(self, head_dim: int, block_m: int, kv_bytes: int, page_size: int = 1) -> int:
        """Programs of the verify kernel one SM holds at once.

        A measured table (and the interpreter's): the sweep's count, from its
        compiled kernels. A GPU without a table of its own: :meth:`derived_programs_per_sm`.
        """
        row = self._tile_row(head_dim, block_m, kv_bytes, page_size)
        if self.measured or self.interpreter or self.limits is None:
            return row["programs_per_sm"]
        return self.derived_programs_per_sm(head_dim, block_m, kv_bytes, page_size)

    def derived_programs_per_sm(self, head_dim: int, block_m: int, kv_bytes: int, page_size: int = 1) -> int:
        """Programs per SM from :attr:`limits` (``programs_per_sm`` of an untuned GPU).

        The fewest of: shared memory per SM over the tile's estimate
        (:func:`splitkv.resources.shared_memory_bytes`, plus the driver's
        reserve per block; the tile first shrunk by :func:`splitkv.resources.fit_tile`
        where it exceeds the per-block limit, as a plan would); registers per
        SM over the registers of a program (the sweep's compiled kernel's per
        thread where it recorded this row, else :data:`UNKNOWN_REGS_PER_THREAD`);
        threads per SM over a program's; at most :data:`MAX_PROGRAMS_PER_SM`
        and at least 1. A limit the device does not report is not counted;
        with none known, the table row's own count.
        """
        return _derived_pps(self, head_dim, block_m, kv_bytes, page_size)

    def min_split_tokens(self) -> int:
        """The shortest prefix slice the adaptive chooser gives a program of its own
        (:data:`INTERPRETER_MIN_SPLIT_TOKENS` for the interpreter's table)."""
        if self.interpreter:
            return INTERPRETER_MIN_SPLIT_TOKENS
        return self.split_tokens

    def small_batch_tile(self, head_dim: int, block_m: int, kv_bytes: int, tiles: int, num_sms: int,
                         prefix_len: int = 0) -> Optional[Tile]:
        """``(block_n, num_warps, num_stages, k_rows)`` for a small launch, or ``None``.

        ``k_rows`` follows :meth:`k_rows` (the throughput tile's layout). ``None`` when the launch is not small
        (``tiles * SMALL_BATCH_SMS_PER_TILE > num_sms``), its representative
        prefix is longer than :data:`SMALL_BATCH_MAX_PREFIX`, or the sweep found
        no tile faster than the throughput tile for this (head dim, BLOCK_M, pool
        element size): then the usual schedule runs.
        """
        if tiles * SMALL_BATCH_SMS_PER_TILE > num_sms or prefix_len > SMALL_BATCH_MAX_PREFIX:
            return None
        row = self.small_batch_tiles.get((head_dim, block_m, kv_bytes))
        if row is None:
            return None
        return row["block_n"], row["num_warps"], row["num_stages"], self.k_rows(head_dim, block_m, kv_bytes)


@dataclass(frozen=True)
class TileRow:
    """A key's launch settings from one table (:meth:`TunedTable.row`): the tile's ``block_n``,
    ``num_warps``, ``num_stages`` and K layout (``k_rows``), and the programs of it an SM holds."""

    block_n: int
    num_warps: int
    num_stages: int
    k_rows: bool
    programs_per_sm: int


@functools.lru_cache(maxsize=None)
def _row(table: TunedTable, head_dim: int, block_m: int, kv_bytes: int, page_size: int) -> TileRow:
    return TileRow(*table.tile(head_dim, block_m, kv_bytes, page_size),
                   programs_per_sm=table.programs_per_sm(head_dim, block_m, kv_bytes, page_size))


@functools.lru_cache(maxsize=None)
def _nearest(table: TunedTable, head_dim: int, block_m: int, kv_bytes: int) -> Mapping:
    tiles = table.tiles
    if (head_dim, block_m, kv_bytes) in tiles:
        return tiles[(head_dim, block_m, kv_bytes)]
    if (head_dim, block_m, kv_bytes) in DEFAULT_TILES:
        return DEFAULT_TILES[(head_dim, block_m, kv_bytes)]
    same = [k for k in tiles if k[2] == kv_bytes] or list(tiles)
    key = min(same, key=lambda k: (abs(k[0] - head_dim), abs(k[1] - block_m)))
    return tiles[key]


def _v_head_dim(head_dim: int) -> int:
    """The value head dim a key's widest head dim stands for: itself, or for a head the kernel takes in
    two chunks (:func:`splitkv.resources.rope_dim`: 576 = 512 + 64), the power of two below it."""
    from .resources import rope_dim

    if head_dim & (head_dim - 1):
        v = 1 << (head_dim.bit_length() - 1)
        if rope_dim(head_dim, v):
            return v
    return head_dim


def _regs_per_thread(table: TunedTable, row: Mapping, kv_bytes: int, page_size: int) -> int:
    """Registers per thread the sweep's compiled kernel of ``row`` used, if its sweep recorded it."""
    if "from_model" not in row or kv_bytes not in (1, 2):
        return row.get("n_regs") or UNKNOWN_REGS_PER_THREAD
    kv_name = "float8_e4m3fn" if kv_bytes == 1 else "bfloat16"
    sweep = table.data.get("paged_tile_sweep" if "page_size" in row else "tile_sweep") or ()
    want = (row["from_model"], kv_name, row.get("page_size", 1), row["block_n"], row["num_warps"], row["num_stages"],
            row.get("k_rows", False))
    for rec in sweep:
        if (rec.get("model"), rec.get("kv_dtype"), rec.get("page_size", 1), rec.get("block_n"), rec.get("num_warps"),
                rec.get("num_stages"), rec.get("k_rows", False)) == want and rec.get("n_regs"):
            return int(rec["n_regs"])
    return UNKNOWN_REGS_PER_THREAD


@functools.lru_cache(maxsize=None)
def _derived_pps(table: TunedTable, head_dim: int, block_m: int, kv_bytes: int, page_size: int) -> int:
    import torch

    from .resources import fit_tile, shared_memory_bytes
    from .tile import TileConfig

    lim = table.limits
    row = table._tile_row(head_dim, block_m, kv_bytes, page_size)
    counts = []
    cfg = TileConfig(block_m, *table.tile(head_dim, block_m, kv_bytes, page_size))
    v_head_dim = _v_head_dim(head_dim)
    kv_dtype = {1: torch.float8_e4m3fn, 2: torch.bfloat16}.get(kv_bytes, torch.float32)
    q_dtype = torch.float32 if kv_bytes > 2 else torch.bfloat16
    if lim.shared_memory_per_block is not None:
        cfg = fit_tile(cfg, head_dim, v_head_dim, kv_dtype, q_dtype, lim.shared_memory_per_block, page_size) or cfg
    if lim.shared_memory_per_sm is not None:
        need = shared_memory_bytes(cfg, head_dim, v_head_dim, kv_dtype, q_dtype, page_size)
        counts.append(lim.shared_memory_per_sm // (need + lim.reserved_shared_memory))
    threads = lim.warp_size * cfg.num_warps
    if lim.regs_per_sm is not None:
        counts.append(lim.regs_per_sm // (_regs_per_thread(table, row, kv_bytes, page_size) * threads))
    if lim.max_threads_per_sm is not None:
        counts.append(lim.max_threads_per_sm // threads)
    if not counts:
        return row["programs_per_sm"]
    return max(1, min(min(counts), MAX_PROGRAMS_PER_SM))


# ---------------------------------------------------------------------------- which table a device gets

_lock = threading.RLock()
_cache: Dict[tuple, TunedTable] = {}
_overrides: Dict[str, TunedTable] = {}
_warned: set = set()
_by_index: Dict[int, TunedTable] = {}  # table_for's, per CUDA index


def clear_cache() -> None:
    """Forget every table read (and the notices given): the next lookup reads the files again."""
    with _lock:
        _cache.clear()
        _by_index.clear()
        _warned.clear()
        _nearest.cache_clear()
        _derived_pps.cache_clear()
        _row.cache_clear()
        device_limits.cache_clear()


@functools.lru_cache(maxsize=None)
def _read(path: str, mtime: float) -> Mapping:
    with open(path) as f:
        return _freeze(json.load(f))


def _load(path: str) -> Mapping:
    return _read(path, os.path.getmtime(path))


def _load_or_warn(path: str) -> Optional[Mapping]:
    """A table file's content, or ``None`` (with a warning) when it cannot be read or lacks ``min_split_tokens``."""
    try:
        data = _load(path)
        int(data["min_split_tokens"])
        return data
    except (OSError, ValueError, KeyError, TypeError) as err:
        warnings.warn(f"splitkv: ignoring the tuned table {path}: {type(err).__name__}: {err}", stacklevel=4)
        return None


def _default_path() -> str:
    """The package's table of :data:`DEFAULT_DEVICE` (a user table of that GPU is for that GPU only)."""
    return os.path.join(PACKAGE_TABLES, normalise_name(DEFAULT_DEVICE) + ".json")


def _notice(name: str, base: str) -> None:
    """Once per device name and process: one line saying the GPU is untuned and how to tune it."""
    if name in _warned or interpreting():
        return
    _warned.add(name)
    target = os.path.join(user_dir(), normalise_name(name) + ".json")
    warnings.warn(f"splitkv: no tuned tile table for {name} (looked for {normalise_name(name)}.json in "
                  f"{user_dir()} and {PACKAGE_TABLES}); using the tile shapes measured on the {DEFAULT_DEVICE} "
                  f"({base}) with programs per SM derived from this GPU's shared memory and registers. "
                  f"To tune for this GPU: python -m splitkv.bench.tune (over ten minutes; writes {target})",
                  stacklevel=4)


def table_named(device_name: str, limits: Optional[DeviceLimits] = None, notice: bool = True) -> TunedTable:
    """The table of a device by name (cached per name, limits and user directory).

    Its own file (:func:`table_path`: the user directory first) if there is
    one: ``measured`` when the file's ``device`` is this name. Otherwise, or
    when the file was not swept on this device, the tile shapes of that file
    or of :data:`DEFAULT_DEVICE`'s table with programs per SM derived from
    ``limits`` (``source`` ``"derived"`` when ``limits`` is given); with
    ``notice``, a warning once per name (:func:`clear_cache` resets it).
    A table installed with :func:`using` for this name comes first.
    """
    key = normalise_name(device_name)
    with _lock:
        if key in _overrides:
            return _overrides[key]
        path = table_path(device_name)
        cache_key = (key, limits, path)
        table = _cache.get(cache_key)
        if table is None:
            data = _load_or_warn(path) if path else None
            if data is None and path is not None and path != os.path.join(PACKAGE_TABLES, key + ".json"):
                path = os.path.join(PACKAGE_TABLES, key + ".json")  # an unreadable user table: the package's
                data = _load(path) if os.path.isfile(path) else None
                path = path if data is not None else None
            measured = data is not None and normalise_name(data.get("device", device_name)) == key
            if measured:
                table = TunedTable.from_json(data, device_name, path, True, limits=limits)
            else:
                base = path or _default_path()
                table = TunedTable.from_json(data if data is not None else _load(base), device_name,
                                             "derived" if limits is not None else base, False, limits=limits,
                                             derived_from=base)
            _cache[cache_key] = table
        if notice and not table.measured:
            _notice(device_name, table.derived_from or table.source)
        return table


def _interpreter_table() -> TunedTable:
    with _lock:
        if "interpreter" in _overrides:
            return _overrides["interpreter"]
        path = _default_path()
        key = ("interpreter", None, path)
        if key not in _cache:
            _cache[key] = TunedTable.from_json(_load(path), "interpreter", path, False, interpreter=True)
        return _cache[key]


def table_for(device=None) -> TunedTable:
    """The tuned table for a device: a ``torch.device`` (or its string, or a CUDA index).

    ``None``, a CPU device, or any device while kernels run through the
    interpreter (``TRITON_INTERPRET=1``): the Triton interpreter's table (the
    default table's answers, :data:`INTERPRETER_MIN_SPLIT_TOKENS`). A CUDA (or ROCm)
    device: :func:`table_named` of its name, with its :class:`DeviceLimits`
    (one warning per process when it has no table of its own). Cached per
    device index: a table file written, or ``$SPLITKV_TUNED_DIR`` changed,
    later in the process is read after :func:`clear_cache`.
    """
    import torch

    if device is None or interpreting():
        return _interpreter_table()
    if isinstance(device, int):
        device = torch.device("cuda", device)
    device = torch.device(device)
    if device.type != "cuda":
        return _interpreter_table()
    index = device.index if device.index is not None else torch.cuda.current_device()
    table = _by_index.get(index)
    if table is None:
        props = torch.cuda.get_device_properties(index)
        name = getattr(props, "name", None) or torch.cuda.get_device_name(index)
        if not name and getattr(torch.version, "hip", None):
            name = str(getattr(props, "gcnArchName", "") or "")
        table = table_named(name or "unknown gpu", device_limits(index))
        with _lock:
            _by_index[index] = table
    return table


@contextlib.contextmanager
def using(table: TunedTable) -> Iterator[TunedTable]:
    """Within the block, ``table`` answers for its device name (``"interpreter"``: for the interpreter).

    For tools that try settings through the whole planner (the sweep in
    ``python -m splitkv.bench.tune``); not thread-safe against plans made
    meanwhile on other threads.
    """
    key = "interpreter" if table.interpreter else normalise_name(table.device_name)
    with _lock:
        before = _overrides.get(key)
        _overrides[key] = table
        _by_index.clear()
    try:
        yield table
    finally:
        with _lock:
            if before is None:
                _overrides.pop(key, None)
            else:
                _overrides[key] = before
            _by_index.clear()


# ---------------------------------------------------------------------------- wrappers over table_for
# Kept for the notebooks; each answers for the current device.


def _current() -> TunedTable:
    """``table_for`` the current CUDA device, or ``table_for(None)`` under the interpreter or without CUDA."""
    if interpreting():
        return table_for(None)
    import torch

    if not torch.cuda.is_available():
        return table_for(None)
    return table_for(torch.device("cuda", torch.cuda.current_device()))


#: Wrapper over :func:`table_for`: the file of :data:`DEFAULT_DEVICE`'s table (the package's H200 table,
#: ``splitkv/tables/nvidia_h200.json``). Use ``table_for(device).source``.
TABLE_PATH = os.path.join(PACKAGE_TABLES, normalise_name(DEFAULT_DEVICE) + ".json")

#: Wrapper over :func:`table_for`: the package's H200 table in the old keyed form
#: (``TunedTable.keyed()``), read-only. Use ``table_for(device)``'s attributes.
TUNED: Mapping = TunedTable.from_json(_load(TABLE_PATH), DEFAULT_DEVICE, TABLE_PATH, True).keyed()


def min_split_tokens() -> int:
    """Wrapper over :func:`table_for`: ``table_for(current device).min_split_tokens()``."""
    return _current().min_split_tokens()


def small_batch_tile(head_dim: int, block_m: int, kv_bytes: int, tiles: int, num_sms: int, prefix_len: int = 0):
    """Wrapper over :func:`table_for`: ``table_for(current device).small_batch_tile(...)``."""
    return _current().small_batch_tile(head_dim, block_m, kv_bytes, tiles, num_sms, prefix_len)
