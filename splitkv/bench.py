"""Benchmark: verify attention against every peer, at the memory-bandwidth roofline.

    python -m splitkv.bench                      # full sweep (GPU)
    python -m splitkv.bench --models llama3-8b --batches 8 --prefixes 16384

For each shape (a labelled model's heads x batch x prefix, 4 draft tokens,
random ``kv_indices``) every implementation is timed with
``triton.testing.do_bench`` (median, L2 flushed between runs), eagerly and as
CUDA-graph replays. The floor is the prefix K/V bytes over the HBM read
bandwidth, which is measured in the same run (``x.sum()`` over 2 GiB).

Implementations:

* ``splitkv``  -- this package (GQA-packed split-KV, adaptive splits);
* ``seed``     -- the seed's layout: one program per query head, fixed 4/8/16
  splits by prefix length, 32-key tiles, no pipelining (same kernels, other
  launch parameters);
* ``extend``   -- the baseline prefill kernel :func:`splitkv.extend_attention_fwd`;
* ``flex``     -- ``torch.compile(flex_attention)`` (its decode path) with a
  block mask, on a dense copy of each sequence's KV (the copy is not timed);
* ``sdpa``     -- ``torch.nn.functional.scaled_dot_product_attention`` with a
  boolean mask, on the same dense copy.

Results go to a JSON file (device, versions, date, every row) and plots into
``figures/`` (see :mod:`splitkv.plots`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from typing import Callable, List, Optional

import torch

from .api import verify_splitkv_fwd
from .extend import extend_attention_fwd
from .testing.problem import MODEL_SHAPES, VerifyProblem, make_problem
from .testing.reference import relative_error
from .runner import VerifySplitKV
from .partials import TileConfig

__all__ = ["BENCH_BATCHES", "BENCH_PREFIXES", "IMPLEMENTATIONS", "run_benchmark", "format_table", "format_markdown", "main"]

#: Batch sizes of the sweep.
BENCH_BATCHES = (1, 8, 32)
#: Prefix lengths of the sweep (tokens per sequence).
BENCH_PREFIXES = (1024, 4096, 16384, 65536)
#: The implementations timed, in table order.
IMPLEMENTATIONS = ("splitkv", "seed", "extend", "flex", "sdpa")
#: Draft tokens per sequence (a causal chain).
DRAFT_TOKENS = 4
#: Skip shapes whose pool would exceed this many bytes (KV + dense copies).
MEMORY_BUDGET = 60 * 2**30


def seed_n_splits(prefix_len: int) -> int:
    """The seed's split rule: 4 below 4k tokens, 8 below 8k, else 16."""
    return 4 if prefix_len < 4096 else 8 if prefix_len < 8192 else 16


def measure_read_bandwidth(gib: float = 2.0) -> float:
    """HBM read bandwidth in bytes/s: ``x.sum()`` over ``gib`` GiB of bf16."""
    import triton.testing

    x = torch.randn(int(gib * 2**30) // 2, dtype=torch.bfloat16, device="cuda")
    ms = triton.testing.do_bench(lambda: x.sum(), return_mode="median")
    return x.numel() * 2 / (ms * 1e-3)


def _dense_kv(p: VerifyProblem):
    """Each sequence's [prefix | drafts] K and V as dense [B, H_KV, S, D] (equal prefixes)."""
    bs, n_pre, n_ext = p.batch_size, p.prefix_lens[0], p.extend_lens[0]
    slots = p.kv_indices.long().view(bs, n_pre)
    k = torch.cat([p.k_buffer[slots], p.k_extend.view(bs, n_ext, *p.k_extend.shape[1:])], 1)
    v = torch.cat([p.v_buffer[slots], p.v_extend.view(bs, n_ext, *p.v_extend.shape[1:])], 1)
    return k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()


def _draft_visibility(n_pre: int, n_ext: int, device) -> torch.Tensor:
    """[L, prefix + L] bool: the whole prefix, then the causal draft block."""
    vis = torch.ones(n_ext, n_pre + n_ext, dtype=torch.bool, device=device)
    vis[:, n_pre:] = torch.tril(vis[:, n_pre:])
    return vis


def make_impl(name: str, p: VerifyProblem, out: torch.Tensor) -> Callable:
    """A zero-argument callable running implementation ``name``, writing ``out``."""
    args, kw = p.args(out), p.kwargs()
    if name == "splitkv":
        return lambda: verify_splitkv_fwd(*args, **kw, max_bs=p.batch_size)
    if name == "seed":
        seed = VerifySplitKV(
            p.num_q_heads, p.num_kv_heads, p.head_dim, p.v_head_dim, p.max_len_extend,
            p.batch_size, out.device, pack_gqa=False, n_splits=seed_n_splits(p.prefix_lens[0]),
            config=TileConfig(16, 32, 4, 1),
        )
        return lambda: seed(*args[:9], sm_scale=p.sm_scale)
    if name == "extend":
        return lambda: extend_attention_fwd(*args, **kw)
    # The dense peers: [B, H, S, D] views of a dense copy of each sequence's KV.
    bs, n_pre, n_ext = p.batch_size, p.prefix_lens[0], p.extend_lens[0]
    k, v = _dense_kv(p)
    q = p.q_extend.view(bs, n_ext, p.num_q_heads, p.head_dim).transpose(1, 2)
    dense_out = out.view(bs, n_ext, p.num_q_heads, p.v_head_dim)
    if name == "flex":
        return _flex_impl(q, k, v, dense_out, n_pre, p.sm_scale)
    vis = _draft_visibility(n_pre, n_ext, out.device)

    def sdpa():
        o = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=vis, scale=p.sm_scale, enable_gqa=True
        )
        dense_out.copy_(o.transpose(1, 2))

    return sdpa


_FLEX = None


def _flex_impl(q, k, v, dense_out, n_pre, sm_scale):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    global _FLEX
    if _FLEX is None:
        # One compile per shape: raise dynamo's limits, or later shapes fall
        # back to an unfused path many times slower.
        import torch._dynamo

        torch._dynamo.config.recompile_limit = 1024
        torch._dynamo.config.cache_size_limit = 1024
        _FLEX = torch.compile(flex_attention, dynamic=False)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx < n_pre) | (kv_idx - n_pre <= q_idx)

    bs, _, n_ext, _ = q.shape
    block_mask = create_block_mask(mask_mod, bs, None, n_ext, k.shape[2], device=q.device)

    def flex():
        o = _FLEX(q, k, v, block_mask=block_mask, scale=sm_scale, enable_gqa=True)
        dense_out.copy_(o.transpose(1, 2))

    return flex


def _time(fn: Callable, graph: bool) -> Optional[float]:
    """Median µs of ``fn`` (eager) or of replays of a CUDA graph of it."""
    import triton.testing

    fn()  # compile / warm up
    torch.cuda.synchronize()
    if graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    else:
        run = fn
    return 1e3 * triton.testing.do_bench(run, warmup=10, rep=50, return_mode="median")


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


def run_benchmark(models=tuple(MODEL_SHAPES), batches=BENCH_BATCHES, prefixes=BENCH_PREFIXES,
                  impls=IMPLEMENTATIONS, graph=True, progress=True, out_path=None) -> dict:
    """Time every implementation on every shape; return the result record.

    With ``out_path`` the record is also written there after every shape.
    """
    import triton

    bandwidth = measure_read_bandwidth()
    shapes = bench_shapes(models, batches, prefixes)
    try:
        from tqdm import tqdm

        it = tqdm(shapes, desc="verify shapes", disable=not progress, file=sys.stdout)
    except ImportError:  # pragma: no cover - tqdm ships with the dev extra
        it = shapes
    rows = []
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
        rows=rows,
    )
    for shape in it:
        s = MODEL_SHAPES[shape["model"]]
        p = make_problem(
            [shape["prefix"]] * shape["batch"], DRAFT_TOKENS, s.num_q_heads, s.num_kv_heads,
            s.head_dim, dtype=torch.bfloat16, device="cuda", pool_factor=1.25, seed=0,
        )
        floor_us = p.kv_bytes / bandwidth * 1e6
        outs = {}
        row = dict(shape, kv_bytes=p.kv_bytes, floor_us=floor_us, impls={})
        for name in impls:
            out = p.new_output()
            fn = make_impl(name, p, out)
            rec = {}
            for mode in ("eager", "graph") if graph else ("eager",):
                try:
                    us = _time(fn, graph=(mode == "graph"))
                except Exception as err:  # a peer that cannot run here is reported, not fatal
                    rec[mode] = None
                    rec[f"{mode}_error"] = f"{type(err).__name__}: {err}"[:200]
                    continue
                rec[mode] = us
            outs[name] = out
            best = min([t for t in (rec.get("eager"), rec.get("graph")) if t], default=None)
            if best:
                rec["gbps"] = p.kv_bytes / (best * 1e-6) / 1e9
                rec["pct_bw"] = 100 * p.kv_bytes / (best * 1e-6) / bandwidth
            row["impls"][name] = rec
        if "splitkv" in outs:
            for name, out in outs.items():
                row["impls"][name]["rel_diff_vs_splitkv"] = relative_error(out, outs["splitkv"])
        rows.append(row)
        if out_path:
            with open(out_path, "w") as f:
                json.dump(result, f, indent=1)
        del p, outs
        torch.cuda.empty_cache()
    return result


def best_time(rec: dict) -> Optional[float]:
    """The better of an implementation's eager and graph times (µs), if any."""
    times = [t for t in (rec.get("eager"), rec.get("graph")) if t]
    return min(times) if times else None


def format_table(result: dict) -> str:
    """The final table: µs (eager/graph), GB/s, % of read bandwidth, speedups."""
    impls = [i for i in IMPLEMENTATIONS if any(i in r["impls"] for r in result["rows"])]
    head = f"{'model':<11}{'bs':>4}{'prefix':>7}{'floor':>8}"
    head += "".join(f"{name + ' us(e/g)':>20}" for name in impls)
    head += f"{'GB/s':>7}{'%BW':>6}" + "".join(f"{'x' + n:>9}" for n in impls if n != "splitkv")
    lines = [head]
    for r in result["rows"]:
        line = f"{r['model']:<11}{r['batch']:>4}{r['prefix'] // 1024:>6}k{r['floor_us']:>8.1f}"
        for name in impls:
            rec = r["impls"].get(name, {})
            e, g = rec.get("eager"), rec.get("graph")
            cell = f"{e:.1f}" if e else "-"
            cell += "/" + (f"{g:.1f}" if g else "-")
            line += f"{cell:>20}"
        ours = r["impls"].get("splitkv", {})
        line += f"{ours.get('gbps', 0):>7.0f}{ours.get('pct_bw', 0):>6.1f}"
        t_ours = best_time(ours)
        for name in impls:
            if name == "splitkv":
                continue
            t = best_time(r["impls"].get(name, {}))
            line += f"{(t / t_ours if t and t_ours else float('nan')):>9.2f}"
        lines.append(line)
    bw = result["read_bandwidth"] / 1e12
    lines.append(f"{result['device']}, read bandwidth {bw:.2f} TB/s, torch {result['torch']}, "
                 f"triton {result['triton']}, {result['date']}; speedup = peer time / splitkv time (best of eager, graph)")
    return "\n".join(lines)


def format_markdown(result: dict) -> str:
    """The results as a Markdown table (graph-replay and eager µs, GB/s, speedups)."""
    impls = [i for i in IMPLEMENTATIONS if any(i in r["impls"] for r in result["rows"])]
    peers = [i for i in impls if i != "splitkv"]
    head = ["model", "batch", "prefix", "KV MB", "floor µs", "splitkv µs graph / eager", "GB/s", "% of read BW"]
    head += [f"{n} µs graph / eager" for n in peers] + [f"speedup vs {n} (graph / eager)" for n in peers]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def us(rec):
        g, e = rec.get("graph"), rec.get("eager")
        return f"{g:.1f} / {e:.1f}" if g and e else (f"- / {e:.1f}" if e else "-")

    def ratio(a, b):
        return f"{a / b:.2f}" if a and b else "-"

    for r in result["rows"]:
        ours = r["impls"]["splitkv"]
        cells = [r["model"], str(r["batch"]), f"{r['prefix'] // 1024}k", f"{r['kv_bytes'] / 1e6:.0f}",
                 f"{r['floor_us']:.1f}", us(ours), f"{ours.get('gbps', 0):.0f}", f"{ours.get('pct_bw', 0):.1f}"]
        cells += [us(r["impls"].get(n, {})) for n in peers]
        for n in peers:
            rec = r["impls"].get(n, {})
            cells.append(f"{ratio(rec.get('graph'), ours.get('graph'))} / {ratio(rec.get('eager'), ours.get('eager'))}")
        lines.append("| " + " | ".join(cells) + " |")
    bw = result["read_bandwidth"] / 1e12
    lines.append("")
    lines.append(f"{result['device']} ({result['num_sms']} SMs), measured read bandwidth {bw:.2f} TB/s, "
                 f"torch {result['torch']}, triton {result['triton']}, {result['date']}; bf16, "
                 f"{result['draft_tokens']} draft tokens, random kv_indices, L2 flushed; "
                 "µs = median of triton.testing.do_bench; GB/s and % use the best of graph and eager; "
                 "speedup = peer time / splitkv time in the same mode.")
    return "\n".join(lines)


def main(argv=None):
    """The ``python -m splitkv.bench`` command line."""
    ap = argparse.ArgumentParser(prog="python -m splitkv.bench", description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODEL_SHAPES), choices=list(MODEL_SHAPES))
    ap.add_argument("--batches", nargs="+", type=int, default=list(BENCH_BATCHES))
    ap.add_argument("--prefixes", nargs="+", type=int, default=list(BENCH_PREFIXES))
    ap.add_argument("--impls", nargs="+", default=list(IMPLEMENTATIONS), choices=IMPLEMENTATIONS)
    ap.add_argument("--no-graph", action="store_true", help="time eager launches only")
    ap.add_argument("--out", default="figures/benchmark_h200.json", help="result JSON path")
    ap.add_argument("--figures", default="figures", help="folder for the plots ('' for none)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("the benchmark needs a CUDA GPU (on a CPU, run `python -m splitkv demo`)")
    result = run_benchmark(args.models, args.batches, args.prefixes, args.impls,
                           graph=not args.no_graph, out_path=args.out)
    with open(args.out.rsplit(".", 1)[0] + ".md", "w") as f:
        f.write(format_markdown(result) + "\n")
    print(format_table(result))
    if args.figures:
        from .plots import plot_benchmark

        for path in plot_benchmark(result, args.figures):
            print("wrote", path)


if __name__ == "__main__":
    main()
