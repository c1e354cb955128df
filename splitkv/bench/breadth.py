"""``python -m splitkv.bench.breadth``: paged pools and score features against the plain path.

Two questions, each timed as CUDA-graph replays with ``do_bench`` (median,
L2 flushed), bf16, 4 draft tokens, random pool placement, through the
public drop-in ``verify_splitkv_fwd``:

1. Paged pools. For each labelled model (:data:`splitkv.testing.MODEL_SHAPES`)
   at batch 8, prefixes 16k and 64k: the token pool and the same prefixes in
   pages of 16 and 64 tokens (:func:`splitkv.testing.paged_problem`), with
   the achieved share of the measured read bandwidth.
2. Score features. Each of :data:`splitkv.testing.FEATURE_SHAPES` with its
   feature on and off at equal bytes read: the logit cap at the same prefix;
   the sliding window at a 64k prefix against the plain call over the
   window's keys alone, read from the same pool slots (a windowed call reads
   only the window). Same slots, not merely as many: a plain problem drawn at
   the window's length has a pool of a few MB, where the windowed call's
   keys lie scattered over a pool of 600 MB (the benchmarks page has the
   measured difference).

Writes ``figures/benchmark_breadth_<gpu>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch

from ..api import verify_splitkv_fwd
from .timing import Timer, gpu_tag, measure_read_bandwidth
from ..testing import FEATURE_SHAPES, MODEL_SHAPES, make_problem, paged_problem

PAGE_SIZES = (16, 64)
PAGED_PREFIXES = (16384, 65536)
BATCH = 8
DRAFT_TOKENS = 4
WINDOW_PREFIX = 65536


def _call(args, kwargs):
    def run():
        if not verify_splitkv_fwd(*args, **kwargs):
            raise RuntimeError("the split path declined the call")
    return run


def _problem(shape, prefix, seed=0):
    return make_problem([prefix] * BATCH, DRAFT_TOKENS, shape.num_q_heads, shape.num_kv_heads, shape.head_dim,
                        dtype=torch.bfloat16, device="cuda", pool_factor=1.1, seed=seed)


def last_keys(p, n):
    """``p`` with each sequence's prefix cut to its last ``n`` keys, in the same pool slots."""
    if min(p.prefix_lens) < n:
        raise ValueError(f"every prefix needs at least {n} keys, got {min(p.prefix_lens)}")
    bs = p.batch_size
    ends = p.kv_indptr[1:].long()
    entries = (ends[:, None] - n + torch.arange(n, device=ends.device)).reshape(-1)
    return p.replace(kv_indices=p.kv_indices[entries],
                     kv_indptr=torch.arange(bs + 1, device=ends.device, dtype=p.kv_indptr.dtype) * n,
                     prefix_lens=[n] * bs)


def paged_rows(timer, bandwidth, log):
    rows = []
    for model, shape in MODEL_SHAPES.items():
        for prefix in PAGED_PREFIXES:
            p = _problem(shape, prefix)
            row = dict(model=model, batch=BATCH, prefix=prefix, kv_bytes=p.kv_bytes,
                       token_us=timer.graph(_call(p.args(p.new_output()), p.kwargs())))
            for page in PAGE_SIZES:
                pp = paged_problem(p, page, seed=1)
                row[f"page{page}_us"] = timer.graph(_call(pp.args(p.new_output()), pp.kwargs()))
                del pp
            for key in [k for k in row if k.endswith("_us")]:
                row[key.replace("_us", "_pct_bw")] = 100 * p.kv_bytes / (row[key] * 1e-6) / bandwidth
            rows.append(row)
            log(f"{model:>10} bs {BATCH} {prefix:>6}: token {row['token_us']:7.1f} us, "
                + ", ".join(f"page {g} {row[f'page{g}_us']:7.1f} us" for g in PAGE_SIZES))
            del p
            torch.cuda.empty_cache()
    return rows


def feature_rows(timer, log):
    rows = []
    for label, (shape, features) in FEATURE_SHAPES.items():
        window = features.get("sliding_window_size")
        prefixes = (WINDOW_PREFIX,) if window else PAGED_PREFIXES
        for prefix in prefixes:
            p = _problem(shape, prefix)
            on = timer.graph(_call(p.args(p.new_output()), {**p.kwargs(), **features}))
            plain_prefix = window if window else prefix
            q = last_keys(p, window) if window else p
            off = timer.graph(_call(q.args(q.new_output()), q.kwargs()))
            rows.append(dict(shape=label, batch=BATCH, prefix=prefix, features=features, feature_us=on,
                             plain_prefix=plain_prefix, plain_us=off, ratio=on / off))
            log(f"{label:>20} bs {BATCH} {prefix:>6}: with {features} {on:7.1f} us; plain at prefix "
                f"{plain_prefix}: {off:7.1f} us ({on / off:.2f}x)")
            del p, q
            torch.cuda.empty_cache()
    return rows


def format_markdown(result) -> str:
    lines = [f"**Paged pools, bf16, batch {BATCH}, µs per call (graph replays) and % of measured read "
             f"bandwidth ({result['read_bandwidth'] / 1e12:.2f} TB/s)**", "",
             "| model | prefix | KV MB | token pool | " + " | ".join(f"pages of {g}" for g in PAGE_SIZES) + " |",
             "|---|--:|--:|--:|" + "--:|" * len(PAGE_SIZES)]
    for r in result["paged"]:
        cells = [f"{r[f'{k}_us']:.1f} ({r[f'{k}_pct_bw']:.0f} %)" for k in ["token"] + [f"page{g}" for g in PAGE_SIZES]]
        lines.append(f"| {r['model']} | {r['prefix'] // 1024}k | {r['kv_bytes'] / 1e6:.0f} | " + " | ".join(cells) + " |")
    lines += ["", f"**Score features, bf16, batch {BATCH}: the feature on vs the plain call reading the same bytes**", "",
              "| shape | prefix | feature | with feature, µs | plain, µs (keys per sequence) | ratio |", "|---|--:|---|--:|--:|--:|"]
    for r in result["features"]:
        feat = ", ".join(f"{k}={v}" for k, v in r["features"].items())
        lines.append(f"| {r['shape']} | {r['prefix'] // 1024}k | {feat} | {r['feature_us']:.1f} | "
                     f"{r['plain_us']:.1f} ({r['plain_prefix']}) | {r['ratio']:.2f} |")
    lines += ["", f"{result['device']}, {result['date']}, torch {result['torch']}, triton {result['triton']}; "
              f"`python -m splitkv.bench.breadth`, {result['elapsed_s']:.0f} s."]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m splitkv.bench.breadth", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="result JSON (default figures/benchmark_breadth_<gpu>.json)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("the benchmark needs a CUDA GPU")
    import triton

    device = torch.cuda.get_device_name()
    out = args.out or os.path.join("figures", f"benchmark_breadth_{gpu_tag(device)}.json")
    start = time.time()
    log = lambda msg: print(f"[{time.time() - start:6.1f}s] {msg}", flush=True)  # noqa: E731
    timer = Timer()
    bandwidth = measure_read_bandwidth()
    result = dict(device=device, date=datetime.date.today().isoformat(), torch=torch.__version__,
                  triton=triton.__version__, python=platform.python_version(), read_bandwidth=bandwidth,
                  paged=paged_rows(timer, bandwidth, log), features=feature_rows(timer, log))
    result["elapsed_s"] = time.time() - start
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    md = format_markdown(result)
    with open(os.path.splitext(out)[0] + ".md", "w") as f:
        f.write(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
