"""Benchmark: context-parallel verify, one GPU against a torchrun world (needs CUDA GPUs).

    torchrun --nproc_per_node 2 -m splitkv.bench.parallel            # the sweep, ~3 minutes on 2x H200
    torchrun --nproc_per_node 2 -m splitkv.bench.parallel --quick    # 2 rows, < 1 minute
    python -m splitkv.bench.parallel                                  # 1 GPU: the single-GPU times only

For every shape (a labelled model's heads x batch x prefix tokens, 4 causal
draft tokens per sequence, bf16, random ``kv_indices`` into a pool exactly the
size of the prefixes) every rank draws the same global problem on its GPU, then:

* ``single_us``: the whole prefix on one GPU (:class:`splitkv.VerifySplitKV`,
  every rank times its own copy, rank 0's is reported);
* the rank keeps only its shard (:func:`splitkv.testing.parallel.shard_problem`,
  contiguous chunks by default) in a pool of its own, and the
  context-parallel step (:class:`splitkv.parallel.ContextParallelVerify`) is
  timed whole (``cp_us``: local kernel + all-gather + merge) and by stage:
  ``local_us`` (the local kernel), ``allgather_us``, ``merge_us`` and
  ``comm_us`` (all-gather + merge in one graph);
* ``speedup = single_us / cp_us``, ``comm_share = comm_us / cp_us``, and
  ``err_vs_single``, the relative difference of the two outputs (bf16 both).

Every time is the median over CUDA-graph replays, measured as
``triton.testing.do_bench`` measures (a 256 MB L2 flush before each replay,
CUDA events around it, the median), except that the number of replays is
agreed by all ranks (do_bench picks its own per process, which would leave one
rank waiting in an all-gather the other never starts), and a row reports the
largest median over ranks.

Targets (reported, not asserted): speedup >= 1.8x where each GPU's share of the
KV read is >= 1 GB; all-gather + merge <= 15 µs per call at batch 8.

Results: ``figures/benchmark_cp_<gpu>x<world>.json`` (device, versions, date,
every row; rewritten after each row) and ``.md``, and
``figures/benchmark_cp_<gpu>x<world>.png`` (speedup against the per-GPU KV
bytes, and the communication time per row).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
from typing import Callable, List, Optional, Sequence

import torch

from ..parallel import ContextParallelVerify
from ..testing.graphs import capture_graph
from ..testing.parallel import shard_problem
from ..plan import VerifySplitKV
from ..testing.problem import MODEL_SHAPES, VerifyProblem
from ..testing.reference import relative_error
from .timing import gpu_tag

__all__ = [
    "CP_BATCHES",
    "CP_PREFIXES",
    "LockstepTimer",
    "gpu_problem",
    "bench_cp_row",
    "run_cp_benchmark",
    "format_cp_markdown",
    "plot_cp_benchmark",
    "main",
]

#: Batch sizes of the sweep.
CP_BATCHES = (1, 8)
#: Prefix lengths of the sweep (tokens per sequence): 128k, 512k, 1M.
CP_PREFIXES = (131072, 524288, 1048576)
#: ``--quick``: (models, batches, prefixes).
QUICK = (("llama3-8b",), (1, 8), (131072,))
#: Draft tokens per sequence (a causal chain), as in :mod:`splitkv.bench`.
DRAFT_TOKENS = 4
#: Targets reported per row.
SPEEDUP_TARGET = 1.8
SPEEDUP_MIN_BYTES_PER_GPU = 1e9
COMM_TARGET_US = 15.0
COMM_TARGET_BATCH = 8
#: A shape runs only if its peak memory fits this share of the smallest free memory over ranks.
MEMORY_SHARE = 0.85


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def gpu_problem(model: str, batch: int, prefix: int, seed: int = 0, draft: int = DRAFT_TOKENS) -> VerifyProblem:
    """A bf16 verify problem drawn on the current GPU (the same on every rank for a seed).

    Unlike :func:`splitkv.testing.make_problem` (which draws on the host, for
    any device) it draws on the GPU: a 1M-token batch of 8 is 34 GB of K/V.
    The pool holds exactly the prefixes, at random slots (``randperm``).
    """
    s = MODEL_SHAPES[model]
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    bf16, dev = torch.bfloat16, "cuda"
    n_tok, total = batch * draft, batch * prefix

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=bf16, device=dev)

    q = randn(n_tok, s.num_q_heads, s.head_dim)
    k = randn(n_tok, s.num_kv_heads, s.head_dim)
    v = randn(n_tok, s.num_kv_heads, s.head_dim)
    k_buffer = randn(total, s.num_kv_heads, s.head_dim)
    v_buffer = randn(total, s.num_kv_heads, s.head_dim)
    kv_indices = torch.randperm(total, generator=g, device=dev)
    ar = torch.arange(batch + 1, device=dev, dtype=torch.int64)
    return VerifyProblem(
        q_extend=q, k_extend=k, v_extend=v, k_buffer=k_buffer, v_buffer=v_buffer,
        qo_indptr=(ar * draft).to(torch.int32), kv_indptr=(ar * prefix).to(torch.int32), kv_indices=kv_indices,
        custom_mask=None, mask_indptr=None, is_causal=True, max_len_extend=draft, k_scale=1.0, v_scale=1.0,
        sm_scale=1.0 / math.sqrt(s.head_dim), sinks=None, prefix_lens=[prefix] * batch, extend_lens=[draft] * batch,
    )


def kv_bytes(model: str, batch: int, prefix: int) -> int:
    """Prefix K+V bytes of a shape (bf16)."""
    s = MODEL_SHAPES[model]
    return batch * prefix * s.num_kv_heads * 2 * s.head_dim * 2


class LockstepTimer:
    """Median µs of CUDA-graph replays, with the same number of replays on every rank.

    Args:
        rep_ms: about how long the measured replays take (sets their number).
        min_reps, max_reps: bounds on that number.
        warmup: replays before measuring.
    """

    def __init__(self, rep_ms: float = 100.0, min_reps: int = 10, max_reps: int = 200, warmup: int = 3):
        self.rep_ms, self.min_reps, self.max_reps, self.warmup = rep_ms, min_reps, max_reps, warmup
        self.flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")  # as do_bench: clears L2

    @staticmethod
    def agree_max(x: float) -> float:
        """The largest ``x`` over the ranks (``x`` itself in a world of one)."""
        dist = _dist()
        if dist is None:
            return x
        t = torch.tensor([x], dtype=torch.float64, device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    @staticmethod
    def capture(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
        """A CUDA graph of one call of ``fn`` (warmed up eagerly on a side stream first)."""
        fn()
        torch.cuda.synchronize()
        return capture_graph(fn)

    def replay_us(self, graph: torch.cuda.CUDAGraph) -> float:
        """Median µs per replay of ``graph``, the largest over ranks."""
        for _ in range(self.warmup):
            graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        estimate_ms = self.agree_max(start.elapsed_time(end) / 3)
        reps = int(min(self.max_reps, max(self.min_reps, self.rep_ms / max(estimate_ms, 1e-3))))
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            self.flush.zero_()
            starts[i].record()
            graph.replay()
            ends[i].record()
        torch.cuda.synchronize()
        times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
        median_ms = times[len(times) // 2] if reps % 2 else 0.5 * (times[reps // 2 - 1] + times[reps // 2])
        return self.agree_max(median_ms * 1e3)

    def time(self, fn: Callable[[], object]) -> float:
        """Capture ``fn`` and time its replays (µs)."""
        graph = self.capture(fn)
        try:
            return self.replay_us(graph)
        finally:
            torch.cuda.synchronize()
            del graph


def _free_bytes() -> float:
    free = float(torch.cuda.mem_get_info()[0])
    dist = _dist()
    if dist is None:
        return free
    t = torch.tensor([free], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return float(t.item())


def bench_cp_row(model: str, batch: int, prefix: int, timer: LockstepTimer, *, mode: str = "chunk",
                 block: Optional[int] = None, seed: int = 0) -> dict:
    """Time one shape on one GPU and context-parallel over the world; returns the row."""
    dist = _dist()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist else (0, 1)
    t_row = time.perf_counter()
    total = kv_bytes(model, batch, prefix)
    row = dict(model=model, batch=batch, prefix=prefix, kv_gb=total / 1e9, kv_gb_per_gpu=total / world / 1e9)
    # Peak: the global pool, the local pool and one gather of it (K and V).
    need = total * (1 + 2 / world) + 2**30
    free = _free_bytes()
    if need > MEMORY_SHARE * free:
        row["skipped"] = f"needs {need / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free"
        return row
    p = gpu_problem(model, batch, prefix, seed)
    lp = shard_problem(p, world, rank, mode, block) if world > 1 else None
    torch.cuda.synchronize()
    row["setup_s"] = time.perf_counter() - t_row

    # One GPU, the whole prefix.
    runner = VerifySplitKV(p.num_q_heads, p.num_kv_heads, p.head_dim, p.v_head_dim, p.max_len_extend, batch, "cuda")
    plan1 = runner.plan(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, p.qo_indptr, p.kv_indptr,
                        p.kv_indices, sm_scale=p.sm_scale)
    out1 = p.new_output()
    row["n_splits_single"] = plan1.n_splits
    row["single_us"] = timer.time(lambda: plan1.run(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer,
                                                    out=out1))
    del plan1, p
    torch.cuda.empty_cache()
    if lp is None:
        row["elapsed_s"] = time.perf_counter() - t_row
        return row

    # The world: each rank its shard.
    cp = ContextParallelVerify(lp.num_q_heads, lp.num_kv_heads, lp.head_dim, lp.v_head_dim, lp.max_len_extend,
                               batch, "cuda")
    # The host checks at plan time (metadata values, every rank's draft shapes: check="full"); the plan timed
    # launches the unchecked kernel, as the one-GPU plan does (check=True would time the checked variant).
    cp.plan(lp.q_extend, lp.k_extend, lp.v_extend, lp.k_buffer, lp.v_buffer, lp.qo_indptr, lp.kv_indptr,
            lp.kv_indices, sm_scale=lp.sm_scale, check="full")
    plan = cp.plan(lp.q_extend, lp.k_extend, lp.v_extend, lp.k_buffer, lp.v_buffer, lp.qo_indptr, lp.kv_indptr,
                   lp.kv_indices, sm_scale=lp.sm_scale, check=False)
    out = lp.new_output()
    args = (lp.q_extend, lp.k_extend, lp.v_extend, lp.k_buffer, lp.v_buffer)
    row["n_splits_local"] = plan.local.n_splits
    row["local_prefix"] = lp.prefix_lens[0]
    row["comm_bytes_per_rank"] = plan.comm_bytes
    row["cp_us"] = timer.time(lambda: plan.run(*args, out=out))
    err = relative_error(out, out1)
    row["local_us"] = timer.time(lambda: plan.run_local(*args))
    row["allgather_us"] = timer.time(plan.exchange)
    row["merge_us"] = timer.time(lambda: plan.merge(out))
    row["comm_us"] = timer.time(lambda: (plan.exchange(), plan.merge(out)))
    row["err_vs_single"] = LockstepTimer.agree_max(err)
    row["speedup"] = row["single_us"] / row["cp_us"]
    row["comm_share"] = row["comm_us"] / row["cp_us"]
    row["speedup_target_applies"] = row["kv_gb_per_gpu"] * 1e9 >= SPEEDUP_MIN_BYTES_PER_GPU
    row["comm_target_applies"] = batch == COMM_TARGET_BATCH
    del plan, cp, lp, out, out1
    torch.cuda.empty_cache()
    row["elapsed_s"] = time.perf_counter() - t_row
    return row


def _row_line(i: int, n: int, row: dict, total_s: float) -> str:
    head = f"[{i:>2}/{n}] {row['model']:<10} bs {row['batch']:>2} {row['prefix'] // 1024:>5}k"
    if row.get("skipped"):
        return f"{head}: skipped ({row['skipped']})"
    text = f"{head}: 1 GPU {row['single_us']:9.1f} us"
    if row.get("cp_us"):
        text += (f", CP {row['cp_us']:9.1f} us ({row['speedup']:.2f}x; all-gather {row['allgather_us']:.1f} us, "
                 f"merge {row['merge_us']:.1f} us, comm {row['comm_us']:.1f} us = {100 * row['comm_share']:.1f}%), "
                 f"err {row['err_vs_single']:.1e}")
    return text + f"; row {row['elapsed_s']:.1f} s, total {total_s:.0f} s"


def run_cp_benchmark(models=tuple(MODEL_SHAPES), batches=CP_BATCHES, prefixes=CP_PREFIXES, *, mode="chunk",
                     block=None, timer: Optional[LockstepTimer] = None, out_path: Optional[str] = None,
                     progress: bool = True) -> dict:
    """Every shape, on one GPU and over the world; the result record (written by rank 0 after each row)."""
    import triton

    dist = _dist()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist else (0, 1)
    timer = timer or LockstepTimer()
    start = time.perf_counter()
    rows: List[dict] = []
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # pragma: no cover - no NCCL in this build
        nccl = None
    result = dict(
        device=torch.cuda.get_device_name(), num_gpus=world, torch=torch.__version__, triton=triton.__version__,
        nccl=nccl, python=platform.python_version(), date=datetime.date.today().isoformat(),
        dtype="bfloat16", draft_tokens=DRAFT_TOKENS, shard_mode=mode, shard_block=block,
        timing=dict(method="CUDA-graph replays, L2 flushed, median; replays agreed across ranks; max over ranks",
                    rep_ms=timer.rep_ms, min_reps=timer.min_reps, max_reps=timer.max_reps),
        targets=dict(speedup=SPEEDUP_TARGET, speedup_min_gb_per_gpu=SPEEDUP_MIN_BYTES_PER_GPU / 1e9,
                     comm_us=COMM_TARGET_US, comm_batch=COMM_TARGET_BATCH),
        elapsed_s=0.0, rows=rows,
    )
    shapes = [(m, b, pl) for m in models for b in batches for pl in prefixes]
    for model, batch, prefix in shapes:
        row = bench_cp_row(model, batch, prefix, timer, mode=mode, block=block)
        rows.append(row)
        result["elapsed_s"] = time.perf_counter() - start
        if rank == 0:
            if progress:
                print(_row_line(len(rows), len(shapes), row, result["elapsed_s"]), flush=True)
            if out_path:
                with open(out_path, "w") as f:
                    json.dump(result, f, indent=1)
    result["summary"] = summarize(result)
    if rank == 0 and out_path:
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)
    return result


def summarize(result: dict) -> dict:
    """How many rows meet the two targets (where they apply)."""
    rows = [r for r in result["rows"] if r.get("cp_us")]
    sp = [r for r in rows if r.get("speedup_target_applies")]
    cm = [r for r in rows if r.get("comm_target_applies")]
    return dict(
        speedup_rows=len(sp), speedup_met=sum(r["speedup"] >= SPEEDUP_TARGET for r in sp),
        comm_rows=len(cm), comm_met=sum(r["comm_us"] <= COMM_TARGET_US for r in cm),
        best_speedup=max((r["speedup"] for r in rows), default=None),
        max_err_vs_single=max((r["err_vs_single"] for r in rows), default=None),
    )


def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def format_cp_markdown(result: dict) -> str:
    """The result as a markdown table with its header and target summary."""
    w = result["num_gpus"]
    lines = [
        f"# Context-parallel verify: 1 vs {w} GPUs" if w > 1 else "# Context-parallel verify: the 1-GPU baseline",
        "",
        f"{result['device']} x {w}, torch {result['torch']}, triton {result['triton']}, NCCL {result['nccl']}, "
        f"{result['date']}. bf16, {result['draft_tokens']} causal drafts per sequence, prefixes sharded by "
        f"`{result['shard_mode']}`. Times: median µs of CUDA-graph replays (L2 flushed), largest over ranks.",
        "",
        "| model | bs | prefix | KV GB/GPU | 1 GPU µs | CP µs | speedup | local µs | all-gather µs | merge µs "
        "| comm µs | comm share | err vs 1 GPU |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in result["rows"]:
        head = f"| {r['model']} | {r['batch']} | {r['prefix'] // 1024}k | {r['kv_gb_per_gpu']:.2f} "
        if r.get("skipped"):
            lines.append(head + f"| skipped: {r['skipped']} |" + " |" * 8)
            continue
        share = "-" if r.get("comm_share") is None else f"{100 * r['comm_share']:.1f}%"
        lines.append(head + f"| {_f(r.get('single_us'), '.1f')} | {_f(r.get('cp_us'), '.1f')} "
                     f"| {_f(r.get('speedup'), '.2f')} | {_f(r.get('local_us'), '.1f')} "
                     f"| {_f(r.get('allgather_us'), '.1f')} | {_f(r.get('merge_us'), '.1f')} "
                     f"| {_f(r.get('comm_us'), '.1f')} | {share} | {_f(r.get('err_vs_single'), '.1e')} |")
    s = result.get("summary") or summarize(result)
    lines += [
        "",
        f"* speedup >= {SPEEDUP_TARGET}x where each GPU reads >= 1 GB of KV: {s['speedup_met']} of "
        f"{s['speedup_rows']} rows;",
        f"* all-gather + merge <= {COMM_TARGET_US:.0f} µs at batch {COMM_TARGET_BATCH}: {s['comm_met']} of "
        f"{s['comm_rows']} rows;",
        f"* largest relative difference from the one-GPU output: {_f(s['max_err_vs_single'], '.1e')}.",
        f"* total {result['elapsed_s']:.0f} s.",
    ]
    return "\n".join(lines)


def plot_cp_benchmark(result: dict, path: str) -> Optional[str]:
    """Speedup against the per-GPU KV bytes, and the communication time per row; returns the path."""
    from matplotlib.figure import Figure

    rows = [r for r in result["rows"] if r.get("cp_us")]
    if not rows:
        return None
    colors = {m: c for m, c in zip(MODEL_SHAPES, ("tab:red", "tab:blue", "tab:green", "tab:purple"))}
    markers = {1: "o", 8: "s"}
    sizes = {m: s for m, s in zip(MODEL_SHAPES, (110, 60, 20, 40))}  # models of equal KV bytes overlap: nest them
    fig = Figure(figsize=(13, 4.6))
    ax0, ax1 = fig.subplots(1, 2)
    for r in rows:
        ax0.scatter(r["kv_gb_per_gpu"], r["speedup"], color=colors.get(r["model"], "gray"),
                    marker=markers.get(r["batch"], "^"), s=sizes.get(r["model"], 40), zorder=3)
    for m, c in colors.items():
        if any(r["model"] == m for r in rows):
            ax0.scatter([], [], color=c, label=m)
    for b, mk in markers.items():
        ax0.scatter([], [], color="gray", marker=mk, label=f"batch {b}")
    ax0.axhline(SPEEDUP_TARGET, color="black", ls="--", lw=1, label=f"target {SPEEDUP_TARGET}x")
    ax0.axhline(result["num_gpus"], color="gray", ls=":", lw=1, label=f"ideal {result['num_gpus']}x")
    ax0.axvline(SPEEDUP_MIN_BYTES_PER_GPU / 1e9, color="gray", ls="-.", lw=1, label="1 GB per GPU")
    ax0.set_xscale("log")
    ax0.set_xlabel("prefix K+V bytes per GPU (GB, log)")
    ax0.set_ylabel("speedup over one GPU (graph replays)")
    ax0.set_title(f"Context-parallel verify, {result['device']} x {result['num_gpus']}")
    ax0.legend(fontsize=7, loc="lower right")
    labels = [f"{r['model']}\nbs{r['batch']} {r['prefix'] // 1024}k" for r in rows]
    x = range(len(rows))
    ag = [r["allgather_us"] for r in rows]
    mg = [r["merge_us"] for r in rows]
    ax1.bar(x, ag, color="tab:orange", label="all-gather (alone)")
    ax1.bar(x, mg, bottom=ag, color="tab:cyan", label="merge (alone)")
    ax1.scatter(x, [r["comm_us"] for r in rows], color="black", marker="_", s=120, zorder=3,
                label="all-gather + merge (one graph)")
    ax1.axhline(COMM_TARGET_US, color="black", ls="--", lw=1, label=f"{COMM_TARGET_US:.0f} µs target (batch 8)")
    ax1.set_xticks(list(x))
    ax1.set_xticklabels(labels, rotation=90, fontsize=6)
    ax1.set_ylabel("µs per call")
    ax1.set_title("communication and merge per call")
    ax1.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


_EPILOG = """\
run on 2 GPUs:   torchrun --nproc_per_node 2 -m splitkv.bench.parallel
run on 1 GPU:    python -m splitkv.bench.parallel   (the single-GPU times only)

output: figures/benchmark_cp_<gpu>x<world>.json and .md, figures/benchmark_cp_<gpu>x<world>.png
(--quick and subsets add _quick / _custom; --out overrides).

time: the default sweep (3 models x batches 1, 8 x prefixes 128k, 512k, 1M = 18 rows) takes about
3 minutes on 2 H200s (drawing up to 34 GB of K/V per row on each GPU, compiling, ~6 graphs a row).
"""


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m splitkv.bench.parallel", description=__doc__.split("\n\n")[0],
                                 epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=list(MODEL_SHAPES), metavar="MODEL",
                    help=f"of {', '.join(MODEL_SHAPES)} (default: all)")
    ap.add_argument("--batches", nargs="+", type=int, metavar="N",
                    help=f"default: {' '.join(map(str, CP_BATCHES))}")
    ap.add_argument("--prefixes", nargs="+", type=int, metavar="TOKENS",
                    help=f"default: {' '.join(map(str, CP_PREFIXES))}")
    ap.add_argument("--mode", choices=("chunk", "round_robin"), default="chunk", help="prefix sharding")
    ap.add_argument("--block", type=int, default=None, help="sharding block in tokens (see shard_prefix)")
    ap.add_argument("--quick", action="store_true", help="llama3-8b, batches 1 and 8, 128k (2 rows)")
    ap.add_argument("--rep-ms", type=float, default=100.0, help="measured replays per timing, in ms (default 100)")
    ap.add_argument("--out", default=None, help="result JSON path (the .md and .png go beside it)")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The command line (every torchrun rank runs it; rank 0 prints and writes)."""
    args = _parser().parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("the context-parallel benchmark needs CUDA GPUs")
    # NVLink SHARP (multicast) is not needed for a two-rank all-gather; keep it off unless asked for.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        import torch.distributed as dist
        from datetime import timedelta

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl", timeout=timedelta(seconds=600))
        rank = dist.get_rank()
    else:
        rank = 0
    subset = any(x is not None for x in (args.models, args.batches, args.prefixes))
    models, batches, prefixes = QUICK if args.quick else (tuple(MODEL_SHAPES), CP_BATCHES, CP_PREFIXES)
    models, batches, prefixes = args.models or models, args.batches or batches, args.prefixes or prefixes
    tag = f"{gpu_tag(torch.cuda.get_device_name())}x{world}"
    variant = "_quick" if args.quick else "_custom" if subset else ""
    out = args.out or os.path.join("figures", f"benchmark_cp_{tag}{variant}.json")
    if rank == 0:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        print(f"{torch.cuda.get_device_name()} x {world}: writing {out}", flush=True)
    result = run_cp_benchmark(models, batches, prefixes, mode=args.mode, block=args.block,
                              timer=LockstepTimer(rep_ms=args.rep_ms), out_path=out)
    if rank == 0:
        stem = out.rsplit(".", 1)[0]
        with open(stem + ".md", "w") as f:
            f.write(format_cp_markdown(result) + "\n")
        print(format_cp_markdown(result))
        fig = plot_cp_benchmark(result, stem + ".png")
        if fig:
            print("wrote", fig)
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
