"""``python -m splitkv.bench.tune``: the GPU sweep behind the tuned tables (``splitkv/tables/*.json``).

Three sweeps, all timed as CUDA-graph replays with ``triton.testing.do_bench``
(median, L2 flushed), bf16 queries, 4 draft tokens, random ``kv_indices``:

1. Tiles. For each labelled model's head shape and each pool dtype (bf16,
   fp8 e4m3) at batch 8, prefixes 16k and 64k (bandwidth-bound shapes),
   every ``BLOCK_N x stages x K layout`` in the grid below; the one
   with the lowest geometric-mean time is kept, with the programs per SM that
   its compiled kernel's registers and shared memory allow (the split
   chooser's ``programs_per_sm``). The K layout (``TileConfig.k_rows``) is
   swept with the rest because it changes what else fits: on the H200 with
   K loaded as rows, Qwen3-Next's bf16 tile of 64 keys fits a third pipeline
   stage without spilling (2026-12-01). ``--tiles-only KV_DTYPE``
   runs this sweep alone for one pool dtype, after a change that concerns
   only that dtype, and keeps the rest of the table.

   The same sweep on paged pools (pages of 16 and 64 keys, the breadth
   benchmark's) fills ``paged_tiles``, with a fourth pipeline stage in the
   grid: a page is contiguous rows, which the compiler buffers differently
   from scattered slots, so the token pool's tile need not be the paged
   pool's. ``--paged KV_DTYPE`` runs it alone.
2. Slice length. With those tiles, the shortest slice the adaptive chooser
   may use (``min_split_tokens``), at the small shapes where it matters
   (batch 1 and 8, prefixes 4k and 16k, the three models); the value with the
   lowest geometric-mean time wins.
3. Small launches (``--small-batch`` runs this one alone and keeps the rest
   of the table). At batch 1, prefixes 4k and 16k, each model's tiles
   (``BLOCK_N x warps x stages``) under the one-wave schedule
   (:func:`splitkv.schedule.one_wave_n_splits`) against the usual schedule
   with the throughput tile; a tile enters ``small_batch_tiles`` only if its
   geometric-mean time beats the usual schedule's by more than 3 %.

Every measurement is written to the table's ``sweep`` lists, so the choice
can be checked. Sweep 1 took about 80 s per pool dtype on an H200
(2026-12-01), its paged form 290-310 s; a full run of the three sweeps takes over ten minutes.

Where the table goes: by default the **user table directory**
(:func:`splitkv.tuning.user_dir`: ``$SPLITKV_TUNED_DIR``, else
``$XDG_CACHE_HOME/splitkv/tuned``, else ``~/.cache/splitkv/tuned``), as
``<name>.json`` with ``<name>`` the device name normalised by
:func:`splitkv.tuning.normalise_name` (``"NVIDIA H200"`` -> ``nvidia_h200.json``).
:func:`splitkv.tuning.table_for` reads that directory before the package's
``splitkv/tables/``, so from then on every launch on a GPU of that name uses
the new table; the package's installed files are never written. ``--out PATH``
writes elsewhere instead (for instance ``splitkv/tables/<name>.json`` in a
checkout, to ship a table with the package). ``--replace`` is kept for old
command lines and now means the default. ``--tiles-only``, ``--paged`` and
``--small-batch`` update one part of a table and keep the rest: of the output
file when it exists, else of the table this GPU reads now (its own, or the
package's default table, :data:`splitkv.tuning.DEFAULT_DEVICE`'s).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import time
from typing import Optional

import torch

from .. import tuning
from ..plan import VerifySplitKV
from ..schedule import TileConfig, block_m_for, rows_per_tile
from ..testing import MODEL_SHAPES, make_problem, paged_problem
from .breadth import PAGE_SIZES
from .timing import Timer

BLOCK_NS = (32, 64, 128)
#: Sweep 1 (tiles): 8 warps lost to 4 for every model and pool dtype in the sweep of
#: 2026-11-30 (by 4-84 %: Qwen3-Next bf16 145.3 vs 116.1 us, Llama-3-8B 150.3 vs 143.8).
WARPS = (4,)
#: Sweep 3 (small launches, one program per SM) tries both.
SMALL_BATCH_WARPS = (4, 8)
STAGES = (2, 3)
#: Paged pools: a page's contiguous rows compile to another pipeline than scattered slots
#: (more shared memory per stage), so a fourth stage is tried too; it never won on the H200 (2026-12-01).
PAGED_STAGES = (2, 3, 4)
K_ROWS = (False, True)
TILE_PREFIXES = (16384, 65536)
MIN_SPLITS = (64, 128, 256, 512)
KV_DTYPES = {"bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn}


def graph_time_us(fn) -> float:
    """Median µs of CUDA-graph replays of ``fn``, timed as the benchmark times them."""
    return Timer(warmup_ms=5.0, rep_ms=30.0).graph(fn)


def programs_per_sm_of(kernel, num_warps: int) -> int:
    """Programs one SM holds, from a compiled kernel's registers and shared memory."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    smem_sm = getattr(props, "shared_memory_per_multiprocessor", 233472)
    regs = max(1, kernel.n_regs) * 32 * num_warps
    by_regs = 65536 // regs
    by_smem = smem_sm // max(1, kernel.metadata.shared)
    by_threads = 2048 // (32 * num_warps)
    return max(1, min(by_regs, by_smem, by_threads, 32))


def _problem(model, bs, prefix, kv_dtype):
    s = MODEL_SHAPES[model]
    scales = dict(k_scale=0.5, v_scale=2.0) if kv_dtype != torch.bfloat16 else {}
    return make_problem([prefix] * bs, 4, s.num_q_heads, s.num_kv_heads, s.head_dim, dtype=torch.bfloat16,
                        kv_dtype=kv_dtype, device="cuda", pool_factor=1.25, seed=0, **scales)


def _timed_plan(p, **runner_kwargs):
    """A plan of problem ``p`` (a token-pool problem or a :class:`~splitkv.testing.PagedProblem`) and its run."""
    base = getattr(p, "problem", p)
    out = base.new_output()
    q, k, v, _, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices = p.args(out)[:9]
    runner = VerifySplitKV(base.num_q_heads, base.num_kv_heads, base.head_dim, base.v_head_dim,
                           base.max_len_extend, base.batch_size, "cuda", **runner_kwargs)
    plan = runner.plan(q, k, v, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask=base.custom_mask,
                       mask_indptr=base.mask_indptr, is_causal=base.is_causal, sm_scale=base.sm_scale, k_scale=base.k_scale,
                       v_scale=base.v_scale, kv_last_page_len=getattr(p, "kv_last_page_len", None))
    run = lambda: plan.run(q, k, v, k_buffer, v_buffer, out=out)  # noqa: E731
    return plan, run


def sweep_tiles(log, kv_dtypes=KV_DTYPES, page_size=1):
    """Sweep 1 on a token pool (``page_size`` 1) or on pages of ``page_size`` keys: table rows and every timing."""
    rows, sweep = [], []
    stages_grid = STAGES if page_size == 1 else PAGED_STAGES
    layout = "token pool" if page_size == 1 else f"pages of {page_size}"
    for model, s in MODEL_SHAPES.items():
        block_m = block_m_for(rows_per_tile(s.group, 4))
        for kv_name, kv_dtype in kv_dtypes.items():
            problems = [_problem(model, 8, prefix, kv_dtype) for prefix in TILE_PREFIXES]
            if page_size > 1:
                problems = [paged_problem(p, page_size, seed=1) for p in problems]
            best = None
            for bn in BLOCK_NS:
                if bn * s.head_dim > 128 * 128:
                    continue  # K and V tiles past the register file: spills
                for warps in WARPS:
                    for stages in stages_grid:
                        for k_rows in K_ROWS:
                            cfg = TileConfig(block_m, bn, warps, stages, k_rows)
                            try:
                                timed = [_timed_plan(p, config=cfg) for p in problems]
                                times = [graph_time_us(run) for _, run in timed]
                                args_kernel = next(iter(timed[0][0]._launch._compiled.values()), None)
                            except Exception as err:  # out of resources: not a candidate
                                log(f"{model} {kv_name} {layout} {cfg}: {type(err).__name__}")
                                continue
                            del timed
                            us = math.exp(sum(map(math.log, times)) / len(times))
                            pps = programs_per_sm_of(args_kernel, warps) if args_kernel is not None else 1
                            rec = dict(model=model, kv_dtype=kv_name, page_size=page_size, block_n=bn, num_warps=warps,
                                       num_stages=stages, k_rows=k_rows, us=us,
                                       us_by_prefix=dict(zip(map(str, TILE_PREFIXES), times)),
                                       n_regs=args_kernel.n_regs, n_spills=args_kernel.n_spills,
                                       shared=args_kernel.metadata.shared, programs_per_sm=pps)
                            sweep.append(rec)
                            log(f"{model:>10} {kv_name:>13} {layout} BLOCK_N {bn:>3} warps {warps} stages {stages} "
                                f"k_rows {k_rows:d}: " + " / ".join(f"{t:7.1f}" for t in times)
                                + f" us  regs {rec['n_regs']} spills {rec['n_spills']} -> {pps}/SM")
                            if best is None or us < best["us"]:
                                best = rec
            paged = {"page_size": page_size} if page_size > 1 else {}
            rows.append(dict(head_dim=s.head_dim, block_m=block_m, kv_bytes=1 if "float8" in kv_name else 2, **paged,
                             block_n=best["block_n"], num_warps=best["num_warps"], num_stages=best["num_stages"],
                             k_rows=best["k_rows"], programs_per_sm=best["programs_per_sm"], from_model=model,
                             us=best["us"], date=datetime.date.today().isoformat()))
            del problems
            torch.cuda.empty_cache()
    return rows, sweep


def sweep_paged_tiles(log, kv_dtypes=KV_DTYPES):
    """Sweep 1 on paged pools, one row per (model, pool dtype, page size in :data:`PAGE_SIZES`)."""
    rows, sweep = [], []
    for page_size in PAGE_SIZES:
        r, s = sweep_tiles(log, kv_dtypes, page_size)
        rows += r
        sweep += s
    return rows, sweep


def current_table() -> "tuning.TunedTable":
    """The table the planner reads on the current GPU (:func:`splitkv.tuning.table_for`)."""
    return tuning.table_for(torch.device("cuda", torch.cuda.current_device()))


def sweep_table(data: dict, **changes) -> "tuning.TunedTable":
    """The table a sweep plans with: ``data`` (a table file's content) with ``changes``, for the current GPU.

    Install it with :func:`splitkv.tuning.using` (the tables themselves are
    read-only). ``measured`` when ``data``'s ``device`` is this GPU's name:
    then its rows' programs per SM count, else the GPU's own derived ones.
    """
    current = current_table()
    data = dict(data, **changes)
    measured = tuning.normalise_name(data.get("device", "")) == tuning.normalise_name(current.device_name)
    return tuning.TunedTable.from_json(data, current.device_name, "sweep", measured, limits=current.limits,
                                       derived_from=None if measured else current.derived_from)


def sweep_min_split(log, data: dict):
    """Sweep 2 with the tiles of ``data`` (a table file's content): the best ``min_split_tokens``,
    the geometric mean per value, and every timing."""
    results = {}
    sweep = []
    for ms in MIN_SPLITS:
        logs = []
        with tuning.using(sweep_table(data, min_split_tokens=ms)):
            for model in MODEL_SHAPES:
                for bs, prefix in ((1, 4096), (1, 16384), (8, 4096), (8, 16384)):
                    p = _problem(model, bs, prefix, torch.bfloat16)
                    plan, run = _timed_plan(p)
                    us = graph_time_us(run)
                    sweep.append(dict(min_split_tokens=ms, model=model, batch=bs, prefix=prefix, us=us,
                                      n_splits=plan.n_splits))
                    logs.append(math.log(us))
                    log(f"min_split {ms:>4} {model:>10} bs {bs} prefix {prefix:>6}: {us:7.1f} us "
                        f"({plan.n_splits} slices)")
        results[ms] = math.exp(sum(logs) / len(logs))
    best = min(results, key=results.get)
    return best, results, sweep


def sweep_small_batch(log, data: dict):
    """Sweep 3 with the tiles of ``data`` (a table file's content): the one-wave tile per model where it
    beats the usual schedule, and every timing."""
    rows, sweep = [], []
    prefixes = (4096, 16384)
    for model, s in MODEL_SHAPES.items():
        block_m = block_m_for(rows_per_tile(s.group, 4))
        key = dict(head_dim=s.head_dim, block_m=block_m, kv_bytes=2)
        others = [r for r in data.get("small_batch_tiles", [])
                  if (r["head_dim"], r["block_m"], r["kv_bytes"]) != tuple(key.values())]
        problems = [_problem(model, 1, prefix, torch.bfloat16) for prefix in prefixes]
        with tuning.using(sweep_table(data, small_batch_tiles=others)):
            usual = [graph_time_us(_timed_plan(p)[1]) for p in problems]
        base = math.exp(sum(map(math.log, usual)) / len(usual))
        log(f"{model:>10} small batch, usual schedule: {usual[0]:6.1f} / {usual[1]:6.1f} us")
        best = None
        for bn in BLOCK_NS:
            if bn * s.head_dim > 128 * 128:
                continue
            for warps in SMALL_BATCH_WARPS:
                for stages in STAGES:
                    trial = others + [dict(key, block_n=bn, num_warps=warps, num_stages=stages)]
                    try:
                        with tuning.using(sweep_table(data, small_batch_tiles=trial)):
                            times = [graph_time_us(_timed_plan(p)[1]) for p in problems]
                    except Exception as err:  # out of resources: not a candidate
                        log(f"{model} BLOCK_N {bn} warps {warps} stages {stages}: {type(err).__name__}")
                        continue
                    mean = math.exp(sum(map(math.log, times)) / len(times))
                    sweep.append(dict(model=model, block_n=bn, num_warps=warps, num_stages=stages,
                                      us=dict(zip(map(str, prefixes), times)),
                                      usual_us=dict(zip(map(str, prefixes), usual))))
                    log(f"{model:>10} one wave, BLOCK_N {bn:>3} warps {warps} stages {stages}: "
                        f"{times[0]:6.1f} / {times[1]:6.1f} us")
                    if mean < 0.97 * base and (best is None or mean < best[0]):
                        best = (mean, bn, warps, stages)
        if best is not None:
            rows.append(dict(head_dim=s.head_dim, block_m=block_m, kv_bytes=2, block_n=best[1], num_warps=best[2],
                             num_stages=best[3], from_model=model, us=best[0], usual_us=base))
    return rows, sweep


def _read_table(path):
    with open(path) as f:
        return json.load(f)


def _partial(table, part, device_name):
    """Note in ``table`` that ``part`` was swept on ``device_name`` (its ``device`` stays the full sweep's)."""
    table.setdefault("partial_sweeps", []).append(dict(part=part, device=device_name,
                                                       date=datetime.date.today().isoformat()))
    return table


def _small_batch_only(path, log):
    """Sweep 3 alone; the table's other entries are kept."""
    table = _read_table(path)
    rows, sweep = sweep_small_batch(log, table)
    table.update(small_batch_tiles=rows, small_batch_sweep=sweep,
                 small_batch_date=datetime.date.today().isoformat())
    return table


def _tiles_only(path, kv_name, log, paged=False):
    """Sweep 1 for one pool dtype, on the token pool or (``paged``) on paged pools; the rest is kept."""
    table = _read_table(path)
    kv = {kv_name: KV_DTYPES[kv_name]}
    rows, sweep = sweep_paged_tiles(log, kv) if paged else sweep_tiles(log, kv)
    rows_key, sweep_key = ("paged_tiles", "paged_tile_sweep") if paged else ("tiles", "tile_sweep")
    kv_bytes = {r["kv_bytes"] for r in rows}
    table[rows_key] = [r for r in table.get(rows_key, []) if r["kv_bytes"] not in kv_bytes] + rows
    table[sweep_key] = [r for r in table.get(sweep_key, []) if r["kv_dtype"] != kv_name] + sweep
    return table


def _tile_summary(row):
    return (row["from_model"], row["kv_bytes"], row.get("page_size", 1), row["block_n"], row["num_warps"],
            row["num_stages"], row["k_rows"])


def _write_table(path, table):
    """Write ``table`` to ``path`` whole (through a temporary file beside it), making its directory."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def default_out_path(device_name: str) -> str:
    """``<user table directory>/<normalised device name>.json``: the file :func:`splitkv.tuning.table_for`
    reads first for that GPU (:func:`splitkv.tuning.user_dir`); never the package's."""
    return os.path.join(tuning.user_dir(), tuning.normalise_name(device_name) + ".json")


def out_path(args, device_name: str) -> str:
    """The table a run writes: ``--out``, else :func:`default_out_path` (``--replace`` too, now)."""
    return args.out or default_out_path(device_name)


def base_path(out: str, device_name: str) -> str:
    """The table a partial sweep updates: the output file when it exists, else the one this GPU reads now
    (:func:`splitkv.tuning.table_path`: its own, user directory first), else the package's default table."""
    if os.path.exists(out):
        return out
    return tuning.table_path(device_name) or tuning.table_path(tuning.DEFAULT_DEVICE) or tuning.TABLE_PATH


def save(table: dict, device_name: str, out: Optional[str] = None) -> str:
    """Write a sweep's table (``out``, default :func:`default_out_path`) and return its path.

    The tables read so far in this process are forgotten
    (:func:`splitkv.tuning.clear_cache`), so that later launches here read the new one.
    """
    path = out or default_out_path(device_name)
    _write_table(path, table)
    tuning.clear_cache()
    return path


def _how_to_use(out: str, device_name: str) -> str:
    """The last line of a run: whether launches on this GPU will read ``out``."""
    if os.path.abspath(out) == os.path.abspath(default_out_path(device_name)):
        return (f"launches on a {device_name} read {out} from now on (the user table directory, "
                f"${tuning.TUNED_DIR_ENV} to move it; the package's tables are left as they are)")
    return (f"launches read {default_out_path(device_name)} (then the package's splitkv/tables/); to use {out}, "
            f"copy it there or set ${tuning.TUNED_DIR_ENV} to a directory holding it as "
            f"{tuning.normalise_name(device_name)}.json")


def _parser() -> argparse.ArgumentParser:
    where_to = os.path.join(tuning.user_dir(), "<gpu>.json")
    ap = argparse.ArgumentParser(
        prog="python -m splitkv.bench.tune", description=__doc__.split("\n")[0],
        epilog=f"Where it writes: {where_to} by default, <gpu> the device name normalised "
               f"(\"NVIDIA H200\" -> nvidia_h200): the user table directory, ${tuning.TUNED_DIR_ENV} "
               "(default $XDG_CACHE_HOME/splitkv/tuned, else ~/.cache/splitkv/tuned), which every launch on a GPU "
               "of that name reads before the package's splitkv/tables/. The package's installed files are never "
               "written; --out PATH writes elsewhere.")
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--out", metavar="PATH",
                       help=f"table to write instead of the user table (default: {where_to})")
    where.add_argument("--replace", action="store_true",
                       help="kept for old command lines: the default now (the user table, which launches read "
                            "first); the package's table is not overwritten")
    ap.add_argument("--small-batch", action="store_true",
                    help="run sweep 3 alone and update the table's small_batch_tiles")
    ap.add_argument("--tiles-only", choices=sorted(KV_DTYPES), metavar="KV_DTYPE",
                    help="run sweep 1 alone for this pool dtype (one of %(choices)s) and update its tiles")
    ap.add_argument("--paged", choices=sorted(KV_DTYPES), metavar="KV_DTYPE",
                    help="run sweep 1 on paged pools alone for this pool dtype and update its paged tiles")
    return ap


def main(argv=None):
    args = _parser().parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the sweep needs a CUDA GPU")
    import triton

    index = torch.cuda.current_device()
    name = current_table().device_name
    out = out_path(args, name)
    start = time.time()
    log = lambda msg: print(f"[{time.time() - start:6.1f}s] {msg}", flush=True)  # noqa: E731
    log(f"writing {out} (the package's tables are left as they are)")
    if args.tiles_only or args.paged:
        paged = args.paged is not None
        base = base_path(out, name)
        log(f"updating the table of {base}")
        table = _tiles_only(base, args.paged or args.tiles_only, log, paged)
        _partial(table, "paged_tiles" if paged else "tiles", name)
        save(table, name, out)
        key = "paged_tiles" if paged else "tiles"
        log(f"wrote {out}: {key} {[_tile_summary(r) for r in table[key]]}")
        log(_how_to_use(out, name))
        return
    if args.small_batch:
        base = base_path(out, name)
        log(f"updating the table of {base}")
        table = _partial(_small_batch_only(base, log), "small_batch_tiles", name)
        save(table, name, out)
        log(f"wrote {out}: small_batch_tiles {[(r['from_model'], r['block_n'], r['num_warps'], r['num_stages']) for r in table['small_batch_tiles']]}")
        log(_how_to_use(out, name))
        return
    tiles, tile_sweep = sweep_tiles(log)
    paged_tiles, paged_sweep = sweep_paged_tiles(log)
    # Sweeps 2 and 3 plan with the new tiles, as measured on this GPU.
    swept = dict(current_table().to_json(), device=name, tiles=tiles, paged_tiles=paged_tiles)
    best_ms, by_ms, split_sweep = sweep_min_split(log, swept)
    small_rows, small_sweep = sweep_small_batch(log, dict(swept, min_split_tokens=best_ms))
    table = dict(
        source="python -m splitkv.bench.tune",
        device=name,
        num_sms=torch.cuda.get_device_properties(index).multi_processor_count,
        date=datetime.date.today().isoformat(),
        torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
        min_split_tokens=best_ms,
        min_split_geomean_us={str(k): v for k, v in by_ms.items()},
        tiles=tiles,
        tile_sweep=tile_sweep,
        paged_tiles=paged_tiles,
        paged_tile_sweep=paged_sweep,
        split_sweep=split_sweep,
        small_batch_tiles=small_rows,
        small_batch_sweep=small_sweep,
    )
    save(table, name, out)
    log(f"wrote {out}: min_split_tokens {best_ms}; tiles {[_tile_summary(r) for r in tiles]}; "
        f"paged tiles {[_tile_summary(r) for r in paged_tiles]}")
    log(_how_to_use(out, name))


if __name__ == "__main__":
    main()
