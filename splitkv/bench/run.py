"""Benchmark: verify attention against every peer and two floors (needs a CUDA GPU).

    python -m splitkv.bench                 # the full sweep, ~9 minutes on an H200
    python -m splitkv.bench --quick         # a 4-row smoke run, < 1 minute
    python -m splitkv.bench --small         # splitkv against its floors on 21 small rows, writes nothing
    python -m splitkv.bench --models llama3-8b --batches 8 --prefixes 16384

For each shape (a labelled model's heads x batch x prefix, 4 draft tokens,
random ``kv_indices``), once with a bf16 KV pool and once with an fp8 (e4m3)
pool, every implementation (:mod:`splitkv.bench.peers`) is replayed from a
CUDA graph and timed with ``triton.testing.do_bench`` (median, L2 flushed
between runs; :mod:`splitkv.bench.timing`). Each row has two floors:

* ``floor_us``: the prefix K/V bytes over the HBM read bandwidth measured in
  the same run (``x.sum()`` over 2 GiB, contiguous);
* ``gather_floor_us``: the best time of a bare Triton kernel that only gathers
  and sums the same K/V rows through the same ``kv_indices``
  (:mod:`splitkv.bench.floors`), over a small grid of launch settings.

Every implementation is also timed as eager calls (``do_bench``, launches
back to back), and ``host_us`` is the time one eager call holds the calling
thread (:meth:`splitkv.bench.timing.Timer.host`): one round in each
implementation's turn and more at the end of the row, the fastest kept
(every round is in ``host_rounds_us``).

``--small`` times ``splitkv`` alone on bf16 pools, graph replays only, with a
reduced gather-floor grid (:data:`splitkv.bench.floors.REDUCED_GRID`), and
prints each row's time against its gather floor and its share of the read
bandwidth (:func:`splitkv.bench.report.format_small`).

Results go to ``figures/benchmark_<gpu>.json`` (device, versions, date, every
row; written after every row) and ``.md`` (:mod:`splitkv.bench.report`), and
plots into ``figures/`` (:mod:`splitkv.bench.plots`).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import sys
import textwrap
import time
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from ..testing.problem import MODEL_SHAPES, VerifyProblem, make_problem
from ..testing.reference import relative_error
from .floors import REDUCED_GRID, search_gather_floor
from .peers import (EAGER_IMPLS, FP8_IMPLEMENTATIONS, FP8_K_SCALE, FP8_V_SCALE, HOST_IMPLS, HOST_MAX_GRAPH_US,
                    IMPL_HELP, IMPLEMENTATIONS, INVARIANT_SPLIT_TOKENS, declined_message, fp8_problem, make_impl,
                    skip_reason)
from .report import default_out_path, format_markdown, format_small, format_table, ratio, row_line
from .timing import Timer, gpu_tag, host_round, measure_read_bandwidth

__all__ = [
    "BENCH_BATCHES",
    "BENCH_PREFIXES",
    "KV_DTYPES",
    "QUICK",
    "SMALL",
    "bench_row",
    "bench_shapes",
    "best_time",
    "main",
    "merge_results",
    "plan_run",
    "run_benchmark",
    "small_shapes",
]

#: Batch sizes of the sweep.
BENCH_BATCHES = (1, 8, 32)
#: Prefix lengths of the sweep (tokens per sequence).
BENCH_PREFIXES = (1024, 4096, 16384, 65536)
#: The ``--quick`` smoke run: (models, batches, prefixes), with both pools.
QUICK = (("llama3-8b",), (1, 8), (4096,))
#: The ``--small`` rows: (models, batches, prefixes), then each model at batch 1 x ``long_prefix``; bf16 only.
SMALL = dict(models=("llama3-8b", "qwen3-32b", "qwen3-next"), batches=(1, 8), prefixes=(1024, 4096, 16384),
             long_prefix=65536)
#: KV-pool dtypes: every shape runs once per pool.
KV_DTYPES = ("bfloat16", "float8_e4m3fn")
#: Draft tokens per sequence (a causal chain).
DRAFT_TOKENS = 4
#: Skip shapes whose pool would exceed this many bytes (KV + dense copies).
MEMORY_BUDGET = 60 * 2**30


def bench_shapes(models, batches, prefixes) -> List[dict]:
    """The (model, batch, prefix) rows of a sweep that fit :data:`MEMORY_BUDGET`."""
    rows = []
    for model in models:
        s = MODEL_SHAPES[model]
        for bs in batches:
            for prefix in prefixes:
                kv = bs * prefix * s.num_kv_heads * 2 * s.head_dim * 2
                if 3 * kv > MEMORY_BUDGET:  # pool + dense K/V copies
                    continue
                rows.append(dict(model=model, batch=bs, prefix=prefix))
    return rows


def small_shapes(models=None, batches=None, prefixes=None) -> List[dict]:
    """The ``--small`` rows (:data:`SMALL`), model by model, narrowed to ``models``/``batches``/``prefixes``."""
    rows = []
    for model in SMALL["models"]:
        rows += bench_shapes([model], SMALL["batches"], SMALL["prefixes"])
        rows += bench_shapes([model], [1], [SMALL["long_prefix"]])
    return [r for r in rows if (models is None or r["model"] in models) and (batches is None or r["batch"] in batches)
            and (prefixes is None or r["prefix"] in prefixes)]


# ---- One row --------------------------------------------------------------------------------------

def best_time(rec: dict) -> Optional[float]:
    """The better of an implementation's eager and graph times (µs), if any."""
    times = [t for t in (rec.get("eager"), rec.get("graph")) if t]
    return min(times) if times else None


def _err(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"[:300]


def _host_first_round(name: str, fn, rec: dict, timer: Timer) -> bool:
    """The host-time round in the implementation's turn; ``True`` if it gets more at the end of the row.

    ``splitkv`` always; a peer only where its graph time is at most
    :data:`HOST_MAX_GRAPH_US` (above it the calls time the GPU, not the host).
    """
    graph_us = rec.get("graph")
    if name != "splitkv" and not (graph_us and graph_us <= HOST_MAX_GRAPH_US):
        rec["host_us"] = None
        rec["host_skipped"] = (f"graph time {graph_us:.0f} us > {HOST_MAX_GRAPH_US:.0f} us: device-bound"
                               if graph_us else "no graph time")
        return False
    try:
        host_round(timer, fn, rec)
        return True
    except Exception as err:
        rec["host_us"] = None
        rec["host_error"] = _err(err)
        return False


def _time_impl(name: str, p: VerifyProblem, timer: Timer, bandwidth: float, dense: dict,
               eager: bool, host: bool) -> Tuple[dict, Optional[torch.Tensor], Optional[object]]:
    """Run and time one implementation on ``p``: (its record, its output or ``None``, its callable if
    it gets more host rounds). A failure or a skip is recorded, never raised."""
    rec: dict = {}
    reason = skip_reason(name, p)
    if reason:
        rec["skipped"] = reason
        return rec, None, None
    out = p.new_output()
    try:
        fn = make_impl(name, p, out, dense)
        if fn() is False:
            raise RuntimeError(declined_message(p, out))
    except Exception as err:  # a peer that cannot run here is reported, not fatal
        rec["graph"] = None
        rec["error"] = _err(err)
        return rec, None, None
    for mode in ("eager", "graph") if eager else ("graph",):
        try:
            rec[mode] = getattr(timer, mode)(fn)
        except Exception as err:
            rec[mode] = None
            rec[f"{mode}_error"] = _err(err)
    more_host = host and _host_first_round(name, fn, rec, timer)
    best = best_time(rec)
    if best:
        rec["gbps"] = p.kv_bytes / (best * 1e-6) / 1e9
        rec["pct_bw"] = 100 * p.kv_bytes / (best * 1e-6) / bandwidth
    return rec, out if best else None, fn if more_host else None


def _gather_floor(row: dict, p: VerifyProblem, timer: Timer, grid: Optional[dict]) -> None:
    """The gather-floor search into ``row`` (``grid``: :func:`search_gather_floor`'s narrowing, if any)."""
    found = search_gather_floor(p.k_buffer, p.v_buffer, p.kv_indices, timer.graph, **(grid or {}))
    row["gather_floor_us"] = found["us"]
    row["gather_floor_config"] = found["config"]
    row["gather_floor_trials"] = found["trials"]
    if found["errors"]:
        row["gather_floor_errors"] = found["errors"]


def _ratios(row: dict, bf16_row: Optional[dict]) -> None:
    """splitkv ÷ each floor, invariant ÷ splitkv and (fp8 rows) fp8 ÷ bf16, into ``row``."""
    ours = row["impls"].get("splitkv", {}).get("graph")
    row["splitkv_over_floor"] = ratio(ours, row["floor_us"])
    row["splitkv_over_gather_floor"] = ratio(ours, row.get("gather_floor_us"))
    row["invariant_over_splitkv"] = ratio(row["impls"].get("splitkv_invariant", {}).get("graph"), ours)
    if bf16_row is not None:
        row["fp8_over_bf16"] = ratio(ours, bf16_row["impls"].get("splitkv", {}).get("graph"))


def bench_row(
    p: VerifyProblem,
    shape: dict,
    impls: Sequence[str],
    timer: Timer,
    bandwidth: float,
    *,
    eager_impls: Sequence[str] = EAGER_IMPLS,
    host_impls: Sequence[str] = HOST_IMPLS,
    gather_floor: bool = True,
    floor_grid: Optional[dict] = None,
    bf16_row: Optional[dict] = None,
    bf16_out: Optional[torch.Tensor] = None,
) -> Tuple[dict, Dict[str, torch.Tensor]]:
    """Time ``impls`` and the gather floor on one problem; returns (row, outputs).

    Args:
        p: the problem (its pool dtype is the row's ``kv_dtype``).
        shape: ``{"model", "batch", "prefix"}``.
        impls: implementations to run, in order (``splitkv`` first for the ratios).
        timer: the :class:`~splitkv.bench.timing.Timer`.
        bandwidth: measured read bandwidth, bytes/s (for ``floor_us``).
        eager_impls: also timed eagerly with ``do_bench``.
        host_impls: host time per eager call measured (``splitkv`` always, the
            others where their graph time is at most :data:`HOST_MAX_GRAPH_US`),
            one round in their turn and ``timer.host_rounds - 1`` more at the end of the row.
        gather_floor: run the gather-floor search.
        floor_grid: narrows that search (:data:`splitkv.bench.floors.REDUCED_GRID`); ``None``: the full one.
        bf16_row: for an fp8 row, the bf16 row of the same shape (``fp8_over_bf16``).
        bf16_out: for an fp8 row, the bf16 splitkv output (``rel_diff_vs_bf16``).

    Returns:
        The row record and each implementation's output.
    """
    t_row = time.perf_counter()
    row = dict(shape, kv_dtype=str(p.k_buffer.dtype).replace("torch.", ""), k_scale=p.k_scale, v_scale=p.v_scale,
               kv_bytes=p.kv_bytes, floor_us=p.kv_bytes / bandwidth * 1e6, impls={})
    outs, dense, host_fns = {}, {}, {}  # dense: flex's and sdpa's K/V copy; host_fns: more rounds at the end
    for name in impls:
        rec, out, fn = _time_impl(name, p, timer, bandwidth, dense, name in eager_impls, name in host_impls)
        row["impls"][name] = rec
        if out is not None:
            outs[name] = out
        if fn is not None:
            host_fns[name] = fn
    if "splitkv" in outs:
        for name, out in outs.items():
            row["impls"][name]["rel_diff_vs_splitkv"] = relative_error(out, outs["splitkv"])
        if bf16_out is not None:
            row["impls"]["splitkv"]["rel_diff_vs_bf16"] = relative_error(outs["splitkv"], bf16_out)
    dense.clear()
    if gather_floor:
        _gather_floor(row, p, timer, floor_grid)
    for _ in range(getattr(timer, "host_rounds", 1) - 1):
        for name, fn in host_fns.items():
            host_round(timer, fn, row["impls"][name])
    host_fns.clear()
    _ratios(row, bf16_row)
    row["elapsed_s"] = time.perf_counter() - t_row
    return row, outs


# ---- The sweep ------------------------------------------------------------------------------------

def _result_header(impls, kv_dtypes, timer: Timer, bandwidth: float, eager_impls, floor_grid) -> dict:
    """The result record without rows: device, versions, date, bandwidth, settings."""
    import triton

    result = dict(
        device=torch.cuda.get_device_name(),
        num_sms=torch.cuda.get_device_properties(0).multi_processor_count,
        torch=torch.__version__,
        triton=triton.__version__,
        python=platform.python_version(),
        date=datetime.date.today().isoformat(),
        read_bandwidth=bandwidth,
        draft_tokens=DRAFT_TOKENS,
        dtype="bfloat16",
        kv_dtypes=list(kv_dtypes),
        fp8_scales=dict(k_scale=FP8_K_SCALE, v_scale=FP8_V_SCALE),
        invariant_split_tokens=INVARIANT_SPLIT_TOKENS,
        implementations={n: IMPL_HELP[n] for n in impls},
        timing=dict(warmup_ms=timer.warmup_ms, rep_ms=timer.rep_ms, host_calls=timer.host_calls,
                    host_rounds=timer.host_rounds, host_burst=timer.host_burst, host_pin=timer.host_pin,
                    host_method="bursts of calls, each timed alone",
                    host_max_graph_us=HOST_MAX_GRAPH_US, eager_impls=list(eager_impls)),
        elapsed_s=0.0,
        rows=[],
    )
    if floor_grid:
        result["gather_floor_grid"] = {k: list(v) for k, v in floor_grid.items()}
    return result


def _shape_rows(shape: dict, impls, kv_dtypes, timer: Timer, bandwidth: float, **row_kw) -> Iterator[dict]:
    """One shape's rows: its bf16 pool, then its fp8 pool (from the same draw), each with ``setup_s``."""
    s = MODEL_SHAPES[shape["model"]]
    t_setup = time.perf_counter()
    p = make_problem(
        [shape["prefix"]] * shape["batch"], DRAFT_TOKENS, s.num_q_heads, s.num_kv_heads,
        s.head_dim, dtype=torch.bfloat16, device="cuda", pool_factor=1.25, seed=0,
    )
    setup_s = time.perf_counter() - t_setup
    bf16_row, bf16_out = None, None
    if "bfloat16" in kv_dtypes:
        row, outs = bench_row(p, shape, impls, timer, bandwidth, **row_kw)
        row["setup_s"] = setup_s
        bf16_row, bf16_out = row, outs.get("splitkv")
        del outs
        yield row
    if "float8_e4m3fn" in kv_dtypes:
        t_setup = time.perf_counter()
        q = fp8_problem(p)
        fp8_setup_s = time.perf_counter() - t_setup
        row, outs = bench_row(q, shape, [i for i in impls if i in FP8_IMPLEMENTATIONS], timer, bandwidth,
                              bf16_row=bf16_row, bf16_out=bf16_out, **row_kw)
        row["setup_s"] = fp8_setup_s if bf16_row else setup_s + fp8_setup_s
        del q, outs
        yield row


def _save(result: dict, out_path: Optional[str]) -> None:
    if out_path:
        os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)


#: What every part of a merged result must share (see :func:`merge_results`).
_MERGE_SAME = ("device", "num_sms", "torch", "triton", "python", "draft_tokens", "dtype", "fp8_scales",
               "invariant_split_tokens", "implementations", "timing")


def merge_results(parts: Sequence[dict]) -> dict:
    """One result record from runs made in parts (for instance one per ``--models``), in the order given.

    The rows follow one another, the elapsed seconds add up, and every floor
    is taken at the first part's read bandwidth, as one run's would be: each
    later row's ``floor_us``, ``splitkv_over_floor`` and ``pct_bw`` are scaled
    by the ratio of the two bandwidths (``read_bandwidth_runs`` keeps every
    part's). The pools and the dates of the parts are joined.

    Raises:
        ValueError: on no parts, parts that differ in a setting of ``_MERGE_SAME``,
            or a row (model, batch, prefix, pool) measured twice.
    """
    if not parts:
        raise ValueError("nothing to merge")
    first = parts[0]
    for key in _MERGE_SAME:
        if any(p.get(key) != first.get(key) for p in parts[1:]):
            raise ValueError(f"the parts differ in {key}: they are not one benchmark")
    merged = {key: copy.deepcopy(value) for key, value in first.items() if key != "rows"}
    merged["rows"], seen = [], set()
    for part in parts:
        scale = part["read_bandwidth"] / first["read_bandwidth"]
        for row in copy.deepcopy(part["rows"]):
            key = (row["model"], row["batch"], row["prefix"], row["kv_dtype"])
            if key in seen:
                raise ValueError(f"row {key} is in more than one part")
            seen.add(key)
            row["floor_us"] *= scale
            if row.get("splitkv_over_floor") is not None:
                row["splitkv_over_floor"] /= scale
            for rec in row["impls"].values():
                if rec.get("pct_bw") is not None:
                    rec["pct_bw"] *= scale
            merged["rows"].append(row)
    merged["kv_dtypes"] = list(dict.fromkeys(d for p in parts for d in p["kv_dtypes"]))
    merged["elapsed_s"] = sum(p["elapsed_s"] for p in parts)
    merged["read_bandwidth_runs"] = [p["read_bandwidth"] for p in parts]
    merged["date"] = " and ".join(dict.fromkeys(p["date"] for p in parts))
    return merged


def run_benchmark(models=tuple(MODEL_SHAPES), batches=BENCH_BATCHES, prefixes=BENCH_PREFIXES,
                  impls=IMPLEMENTATIONS, kv_dtypes=KV_DTYPES, progress=True, out_path=None,
                  timer: Optional[Timer] = None, gather_floor: bool = True, *,
                  shapes: Optional[Sequence[dict]] = None, floor_grid: Optional[dict] = None,
                  eager_impls: Sequence[str] = EAGER_IMPLS, host_impls: Sequence[str] = HOST_IMPLS) -> dict:
    """Time every implementation on every shape and pool; return the result record.

    ``shapes`` (``{"model", "batch", "prefix"}`` rows) replaces the product of
    ``models`` x ``batches`` x ``prefixes``; ``floor_grid``, ``eager_impls``
    and ``host_impls`` are :func:`bench_row`'s. With ``out_path`` the record
    is also written there after every row.
    """
    timer = timer or Timer()
    start = time.perf_counter()
    bandwidth = measure_read_bandwidth()
    shapes = list(shapes) if shapes is not None else bench_shapes(models, batches, prefixes)
    result = _result_header(impls, kv_dtypes, timer, bandwidth, eager_impls, floor_grid)
    n_rows = len(shapes) * len(kv_dtypes)
    row_kw = dict(gather_floor=gather_floor, floor_grid=floor_grid, eager_impls=eager_impls, host_impls=host_impls)
    for shape in shapes:
        for row in _shape_rows(shape, impls, kv_dtypes, timer, bandwidth, **row_kw):
            result["rows"].append(row)
            result["elapsed_s"] = time.perf_counter() - start
            if progress:
                print(row_line(len(result["rows"]), n_rows, row, result["elapsed_s"]), flush=True)
            _save(result, out_path)
        torch.cuda.empty_cache()
    result["elapsed_s"] = time.perf_counter() - start
    _save(result, out_path)
    return result


# ---- Command line -------------------------------------------------------------------------------


def _k(prefix: int) -> str:
    return f"{prefix // 1024}k"


_SMALL_ROWS = (f"{', '.join(SMALL['models'])}, each at batch {' and '.join(map(str, SMALL['batches']))} x "
               f"prefix {'/'.join(map(_k, SMALL['prefixes']))} and at batch 1 x {_k(SMALL['long_prefix'])}")
_SMALL_GRID = (f"tokens per program {'/'.join(map(str, REDUCED_GRID['tokens_per_program']))}, "
               f"{'/'.join(map(str, REDUCED_GRID['num_warps']))} warps: 9 or 10 settings instead of 17 or 18")

_SMALL_HELP = textwrap.fill(
    "--small: splitkv alone on bf16 pools, graph replays only (no eager or host times), on the rows "
    + _SMALL_ROWS + f" ({len(small_shapes())} rows). Prints each row's splitkv time, its gather floor, their "
    "ratio, the roofline floor and splitkv's % of the measured read bandwidth. The gather floor is searched "
    f"over a reduced grid ({_SMALL_GRID}), so it can sit a few % above the full search's. Writes no file "
    "unless --out is given (then the JSON and .md there; plots only with --figures). About a minute on an "
    "H200, most of it compiling kernels and drawing K/V pools. --models, --batches and --prefixes narrow "
    "its rows; --impls and --kv-dtypes replace its defaults (splitkv; bfloat16).", width=78)

_DESCRIPTION = """\
Benchmark split-KV verify attention against its peers and two floors.

Needs a CUDA GPU. On a CPU-only machine run `python -m splitkv demo` instead
(the same kernels through the Triton interpreter, at small shapes).

For every shape (a model's heads x batch x prefix tokens; 4 draft tokens per
sequence, random kv_indices) and KV pool (bf16, and fp8 e4m3 with k_scale 0.5,
v_scale 2.0), each implementation is replayed from a CUDA graph and timed with
triton.testing.do_bench (median µs, L2 flushed). Per row: floor_us (prefix KV
bytes / measured read bandwidth), gather_floor_us (a bare kernel gathering the
same K/V rows, best of up to 18 launch settings), their ratios to splitkv, eager
times, the host µs of one eager call (median of 1000 calls made back to back in
bursts, each timed alone, on the fastest CPU at the time; fastest of 3 rounds),
and fp8 / bf16.
"""

_EPILOG = """\
implementations:
""" + "".join(f"  {n:<18} {IMPL_HELP[n]}\n" for n in IMPLEMENTATIONS) + """\
  (fp8 rows run splitkv, splitkv_invariant and extend only)

output: figures/benchmark_<gpu>.json and .md (<gpu> from the device name:
"NVIDIA H200" -> h200, so another GPU never overwrites the H200 files),
figures/roofline_<gpu>.png and speedup_<gpu>.png. --quick and custom subsets
write benchmark_<gpu>_quick / benchmark_<gpu>_custom instead; --out overrides.

time: the full default sweep (36 shapes x 2 pools = 72 rows) takes about
9 minutes on an H200 (about 1.5 of them drawing random K/V pools on the host,
about 2 compiling FlexAttention once per shape, and about 1.5 the host-time
rounds, whose bursts wait for the GPU); every row prints its elapsed seconds.
--quick (4 rows) takes under a minute.

""" + _SMALL_HELP + "\n"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m splitkv.bench", description=_DESCRIPTION, epilog=_EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=list(MODEL_SHAPES), metavar="MODEL",
                    help=f"model head configurations, of {', '.join(MODEL_SHAPES)} (default: all)")
    ap.add_argument("--batches", nargs="+", type=int, metavar="N",
                    help=f"batch sizes, sequences per call (default: {' '.join(map(str, BENCH_BATCHES))})")
    ap.add_argument("--prefixes", nargs="+", type=int, metavar="TOKENS",
                    help=f"prefix lengths, tokens per sequence (default: {' '.join(map(str, BENCH_PREFIXES))})")
    ap.add_argument("--impls", nargs="+", choices=IMPLEMENTATIONS, metavar="IMPL",
                    help=f"implementations, of {', '.join(IMPLEMENTATIONS)} (default: all)")
    ap.add_argument("--kv-dtypes", nargs="+", choices=KV_DTYPES, metavar="DTYPE",
                    help=f"KV-pool dtypes, of {', '.join(KV_DTYPES)} (default: both)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true",
                      help=f"smoke run: {QUICK[0][0]}, batches {' '.join(map(str, QUICK[1]))}, prefix "
                           f"{QUICK[2][0]} tokens, both pools (4 rows, < 1 minute)")
    mode.add_argument("--small", action="store_true",
                      help=f"splitkv against its floors on {len(small_shapes())} small bf16 rows, reduced "
                           "gather-floor grid, no files (see below)")
    ap.add_argument("--out", default=None, metavar="PATH",
                    help="result JSON path; the .md goes beside it (default: figures/benchmark_<gpu>.json, "
                         "with _quick or _custom for --quick and subsets; --small: none)")
    ap.add_argument("--figures", default=None, metavar="DIR",
                    help="folder for the plots, '' for none (default: figures; --small: none)")
    ap.add_argument("--rep-ms", type=float, default=25.0, metavar="MS",
                    help="do_bench measuring time per timing, milliseconds (default: 25)")
    ap.add_argument("--host-calls", type=int, default=1000, metavar="N",
                    help="eager calls per host-time round, each timed alone (default: 1000)")
    ap.add_argument("--host-unpinned", action="store_true",
                    help="time host rounds on whatever CPU the thread runs on (default: pinned to the fastest CPU "
                         "at the time; see splitkv.bench.timing)")
    ap.add_argument("--no-gather-floor", action="store_true", help="skip the gather-floor search")
    ap.add_argument("--peers", default=None, metavar="LIST",
                    help="instead: splitkv beside serving engines' kernels (FlashInfer, SGLang's extend kernel), "
                         "e.g. --peers flashinfer,sglang [--quick]; its own options: python -m splitkv.bench "
                         "--peers all --help (see splitkv.bench.peers_sweep)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="no timing (no GPU needed): write one result from the result files of a run made in "
                         "parts (for instance one per --models), in the order given, with its tables and plots "
                         "(default paths as for the full sweep; --out and --figures apply)")
    return ap


def _plan_rows(args) -> dict:
    """The rows, implementations and timings a parsed command line asks for."""
    if args.small:
        return dict(shapes=small_shapes(args.models, args.batches, args.prefixes), models=SMALL["models"],
                    batches=SMALL["batches"], prefixes=SMALL["prefixes"] + (SMALL["long_prefix"],),
                    impls=tuple(args.impls or ("splitkv",)), kv_dtypes=tuple(args.kv_dtypes or ("bfloat16",)),
                    eager_impls=(), host_impls=(), floor_grid=REDUCED_GRID)
    models, batches, prefixes = QUICK if args.quick else (tuple(MODEL_SHAPES), BENCH_BATCHES, BENCH_PREFIXES)
    models, batches, prefixes = (tuple(args.models or models), tuple(args.batches or batches),
                                 tuple(args.prefixes or prefixes))
    return dict(shapes=bench_shapes(models, batches, prefixes), models=models, batches=batches, prefixes=prefixes,
                impls=tuple(args.impls or IMPLEMENTATIONS), kv_dtypes=tuple(args.kv_dtypes or KV_DTYPES),
                eager_impls=EAGER_IMPLS, host_impls=HOST_IMPLS, floor_grid=None)


def plan_run(argv, device_name: str) -> dict:
    """What a command line asks for on a GPU called ``device_name`` (parsed, defaults filled in).

    Returns:
        ``run_benchmark``'s arguments (``shapes``, the ``models``, ``batches``
        and ``prefixes`` they come from, ``impls``, ``kv_dtypes``,
        ``gather_floor``, ``floor_grid``, ``eager_impls``, ``host_impls``),
        the :class:`~splitkv.bench.timing.Timer` settings (``timer``),
        ``small`` (the ``--small`` report), and the output paths: ``out``
        (JSON) and ``md`` (``None``: no files), ``figures`` (folder or ``""``)
        and ``plot_tag`` (``roofline_<tag>.png``).
    """
    return _plan(_parser().parse_args(argv), device_name)


def _plan(args: argparse.Namespace, device_name: str) -> dict:
    """:func:`plan_run` of parsed arguments."""
    subset = any(x is not None for x in (args.models, args.batches, args.prefixes, args.impls, args.kv_dtypes))
    variant = "small" if args.small else "quick" if args.quick else "custom" if subset else ""
    default = default_out_path(gpu_tag(device_name), variant)
    figures = args.figures if args.figures is not None else "" if args.small else "figures"
    return dict(
        _plan_rows(args),
        gather_floor=not args.no_gather_floor,
        timer=dict(rep_ms=args.rep_ms, host_calls=args.host_calls, host_pin=not args.host_unpinned),
        small=args.small,
        **_outputs(args.out or (None if args.small else default), default, figures),
    )


def _outputs(out: Optional[str], default: str, figures: str) -> dict:
    """Where a result goes: ``out`` (the JSON; ``None``: no files), ``md`` beside it, the plots'
    ``figures`` folder and ``plot_tag`` (from ``out``'s name, else from ``default``'s)."""
    stem = os.path.splitext(out or default)[0]
    return dict(out=out, md=stem + ".md" if out else None, figures=figures,
                plot_tag=os.path.basename(stem).removeprefix("benchmark_"))


def _report(result: dict, run: dict) -> None:
    """Print the tables, write the .md and the plots where asked."""
    if run["md"]:
        with open(run["md"], "w") as f:
            f.write(format_markdown(result) + "\n")
    if run["small"]:
        print(format_small(result))
        if set(run["impls"]) != {"splitkv"}:
            print("\n" + format_table(result))
    else:
        print(format_table(result))
    if run["figures"]:
        from .plots import plot_benchmark

        for path in plot_benchmark(result, run["figures"], tag=run["plot_tag"]):
            print("wrote", path)
    print(f"total {result['elapsed_s']:.0f} s")


def _merge_main(args) -> None:
    """``--merge``: one result file, its tables and plots, from the parts' files."""
    parts = []
    for path in args.merge:
        with open(path) as f:
            parts.append(json.load(f))
    result = merge_results(parts)
    out = args.out or default_out_path(gpu_tag(result["device"]))
    _save(result, out)
    print(f"merged {len(parts)} runs ({len(result['rows'])} rows) into {out}")
    _report(result, dict(_outputs(out, out, "figures" if args.figures is None else args.figures), small=False))


def main(argv=None):
    """The ``python -m splitkv.bench`` command line."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a == "--peers" or a.startswith("--peers=") for a in argv):  # the peers sweep has its own options
        from .peers_sweep import main as peers_main

        return peers_main(argv, prog="python -m splitkv.bench")
    args = _parser().parse_args(argv)  # --help works anywhere
    if args.merge:
        return _merge_main(args)
    if not torch.cuda.is_available():
        sys.exit("the benchmark needs a CUDA GPU (on a CPU, run `python -m splitkv demo`)")
    device = torch.cuda.get_device_name()
    run = _plan(args, device)
    print(f"{device}: " + (f"writing {run['out']} and {run['md']}" if run["out"] else "writing no files"), flush=True)
    result = run_benchmark(shapes=run["shapes"], impls=run["impls"], kv_dtypes=run["kv_dtypes"],
                           out_path=run["out"], timer=Timer(**run["timer"]), gather_floor=run["gather_floor"],
                           floor_grid=run["floor_grid"], eager_impls=run["eager_impls"],
                           host_impls=run["host_impls"])
    _report(result, run)


if __name__ == "__main__":
    main()
