"""``python -m splitkv.bench.mla``: MLA verify (DeepSeek-V3/R1, Kimi-K2) on the split path (needs a CUDA GPU).

    python -m splitkv.bench.mla            # 18 rows
    python -m splitkv.bench.mla --quick    # 2 rows, under a minute
    python -m splitkv.bench.mla --fp8      # the same rows with an fp8 e4m3 latent cache (also with --tiles)
    python -m splitkv.bench.mla --tiles    # the tile sweep: BLOCK_N x warps x stages on SWEEP_ROWS

DeepSeek-V3's attention verifies its MTP drafts with multi-head latent
attention: one KV head whose key is 576 wide (512 latent + 64 rope) and
whose value is the latent itself, so the value pool is a view of the key
pool (``v_buffer = k_buffer[..., :512]``, likewise the draft block). Rows:
16 query heads (one rank of eight) and 128 (one rank), batch 1, 8 and 32,
prefixes 4k, 16k and 64k, 4 draft tokens (a causal chain), bf16, a token
pool with the prefix on random slots. Columns:

* latent cache MB: the prefix rows, ``batch x prefix x 576 x 2`` bytes;
* read floor: that cache read once at the read bandwidth measured in the
  same run (``x.sum()`` over 2 GiB);
* gather floor: the fastest bare Triton kernel that gathers the same rows
  through the same slots, each once (:mod:`splitkv.bench.floors`, values
  read with the keys; the benchmark's reduced search grid);
* splitkv µs, timed through a plan (:meth:`splitkv.VerifySplitKV.plan`,
  then ``run``), and its share of the read bandwidth (floor / time);
* TFLOPS: ``2 x (576 + 512)`` flops per (query row, visible key), query rows
  being heads x drafts, visible keys the prefix and the causal drafts;
* peers: :func:`splitkv.extend_attention_fwd` (the extend baseline: one
  program per query head walks the whole prefix, the head in the same two
  chunks), FlexAttention (compiled, as the main benchmark runs it) and
  ``scaled_dot_product_attention``, both on a dense copy of each sequence's
  keys (the copy is not timed; SDPA is skipped where its scores would not
  fit). Each peer's output is compared with splitkv's (``rel_diff_vs_splitkv``);
  one that fails is recorded with its error.

With ``--fp8`` the latent cache is stored in fp8 e4m3: the bf16 draw
divided by :data:`FP8_SCALE` and dequantised by it, one scale for keys and
values since they are the same bytes (``v_buffer`` stays a view of
``k_buffer``); queries, drafts and the output stay bf16. Each row times
splitkv on both pools of the same draw (``fp8 ÷ bf16``, and the relative
difference of the two outputs) beside the extend baseline; the floors count
one byte per element. The dense peers are not run: they would read a
dequantised copy, not the fp8 cache.

Every time is the median of CUDA-graph replays with the L2 flushed
(the benchmark's ``Timer``). Results go to ``figures/benchmark_mla_<gpu>.json``
and ``.md`` (``benchmark_mla_fp8_<gpu>`` with ``--fp8``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from typing import Callable, Dict, List, Optional

import torch

from ..extend import extend_attention_fwd
from ..plan import VerifySplitKV
from ..schedule import TileConfig
from ..testing.problem import VerifyProblem
from ..testing.reference import relative_error

from .floors import REDUCED_GRID, search_gather_floor
from .peers import make_impl, skip_reason
from .timing import Timer, gpu_tag, measure_read_bandwidth

__all__ = ["LATENT_DIM", "ROPE_DIM", "HEAD_DIM", "ROWS", "QUICK_ROWS", "FP8_SCALE", "mla_problem", "fp8_latent",
           "latent_bytes", "flops_per_byte", "flops", "bench_row", "sweep_tiles", "format_markdown", "main"]

#: DeepSeek-V3's latent (the value) and rope widths; a key is both.
LATENT_DIM, ROPE_DIM = 512, 64
HEAD_DIM = LATENT_DIM + ROPE_DIM
#: Query heads per rank: 128 (one rank), 16 (one of eight).
HEADS = (16, 128)
BATCHES = (1, 8, 32)
PREFIXES = (4096, 16384, 65536)
DRAFT_TOKENS = 4
#: The sweep's rows, ``(query heads, batch, prefix)``.
ROWS = [(h, b, n) for h in HEADS for b in BATCHES for n in PREFIXES]
QUICK_ROWS = [(16, 8, 4096), (128, 8, 4096)]
#: The tile sweep's rows: each regime at a small and a large launch.
SWEEP_ROWS = [(16, 1, 16384), (16, 8, 16384), (128, 1, 16384), (128, 8, 16384)]
#: The tile sweep's grid, ``(BLOCK_N, warps, stages)``; BLOCK_M is 64 (the 64 x 512 accumulator).
SWEEP_TILES = [(n, w, s) for n in (32, 64) for w in (4, 8) for s in (1, 2)] + [(32, 8, 3)]
#: The SDPA peer materialises scores of this many elements at most (its masked path is not fused).
SDPA_MAX_SCORES = 2**31
#: Dequantisation scale of the fp8 latent cache, keys and values alike (``--fp8``).
FP8_SCALE = 0.5
#: What ``--fp8`` runs on each row's fp8 cache (splitkv also on the bf16 cache of the same draw).
FP8_IMPLS = ("splitkv", "extend")


def mla_problem(heads: int, batch: int, prefix: int, *, device="cuda", dtype=torch.bfloat16,
                drafts: int = DRAFT_TOKENS, pool_factor: float = 1.1, seed: int = 0) -> VerifyProblem:
    """A DeepSeek-V3 verify step drawn on ``device``: one KV head of 576, values a view of the keys.

    The pool holds ``pool_factor`` times the batch's prefix keys, the prefixes
    on random slots; the drafts attend causally. Drawn on the device itself
    (a 64k x 32 pool would take long to draw on the host).
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    n_tok, keys = batch * drafts, batch * prefix
    pool = max(int(keys * pool_factor), keys + 1)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    k_ext, k_buf = randn(n_tok, 1, HEAD_DIM), randn(pool, 1, HEAD_DIM)
    indptr = lambda n: torch.arange(0, (batch + 1) * n, n, device=device, dtype=torch.int32)  # noqa: E731
    return VerifyProblem(
        q_extend=randn(n_tok, heads, HEAD_DIM), k_extend=k_ext, v_extend=k_ext[..., :LATENT_DIM],
        k_buffer=k_buf, v_buffer=k_buf[..., :LATENT_DIM], qo_indptr=indptr(drafts), kv_indptr=indptr(prefix),
        kv_indices=torch.randperm(pool, generator=gen, device=device)[:keys], custom_mask=None, mask_indptr=None,
        is_causal=True, max_len_extend=drafts, k_scale=1.0, v_scale=1.0, sm_scale=HEAD_DIM ** -0.5, sinks=None,
        prefix_lens=[prefix] * batch, extend_lens=[drafts] * batch)


def fp8_latent(p: VerifyProblem, scale: float = FP8_SCALE) -> VerifyProblem:
    """``p`` with its latent cache in fp8 e4m3 (``k_buffer / scale``), the value pool still a view of it.

    One scale serves keys and values, since they are the same stored bytes;
    the drafts and queries keep ``p``'s dtype.
    """
    latent = (p.k_buffer / scale).to(torch.float8_e4m3fn)
    return p.replace(k_buffer=latent, v_buffer=latent[..., :p.v_head_dim], k_scale=float(scale),
                     v_scale=float(scale))


def latent_bytes(p: VerifyProblem) -> int:
    """Bytes of the prefix's latent cache (576-wide rows, values included): what any kernel reads at least."""
    return sum(p.prefix_lens) * p.num_kv_heads * p.head_dim * p.k_buffer.element_size()


def flops_per_byte(heads: int, drafts: int = DRAFT_TOKENS, element_size: int = 2) -> float:
    """Arithmetic intensity of the prefix: ``2 (D + Dv)`` flops per (query row, key), ``heads x drafts``
    rows per key, over the bytes of one ``D``-wide latent row (read once for both dots)."""
    return 2 * (HEAD_DIM + LATENT_DIM) * heads * drafts / (HEAD_DIM * element_size)


def flops(p: VerifyProblem) -> int:
    """``2 (D + Dv)`` flops per (query row, visible key): every prefix key, and the causal draft keys."""
    pairs = sum(n * pre + n * (n + 1) // 2 for pre, n in zip(p.prefix_lens, p.extend_lens))
    return 2 * (p.head_dim + p.v_head_dim) * p.num_q_heads * pairs


def _splitkv(p: VerifyProblem, out: torch.Tensor, rec: dict, config: Optional[TileConfig] = None) -> Callable:
    """The split path through a plan (made once, as an engine makes it per step); its tile goes into ``rec``."""
    runner = VerifySplitKV(p.num_q_heads, p.num_kv_heads, p.head_dim, p.v_head_dim, p.max_len_extend,
                           p.batch_size, out.device, config=config)
    plan = runner.plan(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, p.qo_indptr, p.kv_indptr,
                       p.kv_indices, is_causal=True, sm_scale=p.sm_scale, k_scale=p.k_scale, v_scale=p.v_scale)
    run = lambda: plan.run(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, out=out)  # noqa: E731
    run()  # the first run settles who merges: a kernel that would spill with merge programs merges in a second launch
    rec.update(config=repr(plan.config), n_splits=plan.n_splits, merge=plan.merge, kv_shared=plan.kv_shared)
    return run


def _extend(p: VerifyProblem, out: torch.Tensor, rec: dict) -> Callable:
    args, kw = p.args(out), p.kwargs()
    return lambda: extend_attention_fwd(*args, **kw)


def _sdpa(p: VerifyProblem, out: torch.Tensor, rec: dict) -> Optional[Callable]:
    """SDPA on a dense ``[B, 1, prefix + L, D]`` copy of each sequence's keys, causal over the drafts."""
    bs, n_pre, n_ext = p.batch_size, p.prefix_lens[0], p.extend_lens[0]
    if bs * p.num_q_heads * n_ext * (n_pre + n_ext) > SDPA_MAX_SCORES:
        rec["skipped"] = f"scores of more than {SDPA_MAX_SCORES} elements"
        return None
    slots = p.kv_indices.long().view(bs, n_pre)
    k = torch.cat([p.k_buffer[slots], p.k_extend.view(bs, n_ext, 1, p.head_dim)], 1).transpose(1, 2).contiguous()
    q = p.q_extend.view(bs, n_ext, p.num_q_heads, p.head_dim).transpose(1, 2)
    dense_out = out.view(bs, n_ext, p.num_q_heads, p.v_head_dim)
    visible = torch.ones(n_ext, n_pre + n_ext, dtype=torch.bool, device=out.device)
    visible[:, n_pre:] = torch.tril(visible[:, n_pre:])
    v = k[..., :p.v_head_dim]  # the values are the latent columns, as in the pool

    def sdpa():
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=p.sm_scale,
                                                             enable_gqa=True)
        dense_out.copy_(o.transpose(1, 2))

    return sdpa


def _flex(p: VerifyProblem, out: torch.Tensor, rec: dict) -> Optional[Callable]:
    """FlexAttention on a dense copy, as the main benchmark runs it (:mod:`splitkv.bench.peers`)."""
    reason = skip_reason("flex", p)
    if reason:
        rec["skipped"] = reason
        return None
    return make_impl("flex", p, out)


IMPLS = {"splitkv": _splitkv, "extend": _extend, "flex": _flex, "sdpa": _sdpa}


def bench_row(p: VerifyProblem, timer: Timer, bandwidth: float, impls=tuple(IMPLS),
              bf16: Optional[VerifyProblem] = None) -> dict:
    """Time ``impls`` on one problem; the row's record (times in µs, floors, TFLOPS, errors).

    ``bf16``: for an fp8 problem, the bf16 problem it was quantised from; splitkv
    is timed on it too (``bf16_us``, ``fp8_over_bf16``, ``rel_diff_vs_bf16``).
    """
    nbytes = latent_bytes(p)
    row = dict(heads=p.num_q_heads, batch=p.batch_size, prefix=p.prefix_lens[0], drafts=p.extend_lens[0],
               kv_dtype=str(p.k_buffer.dtype).replace("torch.", ""), latent_mb=nbytes / 1e6,
               floor_us=nbytes / bandwidth * 1e6, flops=flops(p), impls={})
    gather = search_gather_floor(p.k_buffer, None, p.kv_indices, timer.graph, **REDUCED_GRID)
    row.update(gather_floor_us=gather["us"], gather_config=gather["config"])
    outs: Dict[str, torch.Tensor] = {}
    for name in impls:
        make = IMPLS[name]
        rec: dict = row["impls"].setdefault(name, {})
        out = p.new_output()
        try:
            fn = make(p, out, rec)
            if fn is None:
                continue
            rec["us"] = timer.graph(fn)
        except NotImplementedError as err:  # a peer that does not serve this head
            rec["skipped"] = str(err)[:300]
            continue
        except Exception as err:  # a peer that cannot run here is reported, not fatal
            rec["error"] = f"{type(err).__name__}: {err}"[:300]
            continue
        fn = None  # drop the closure (the dense copy)
        rec["pct_bw"] = 100 * row["floor_us"] / rec["us"]
        rec["tflops"] = row["flops"] / (rec["us"] * 1e-6) / 1e12
        outs[name] = out
    for name, out in outs.items():
        if name != "splitkv" and "splitkv" in outs:
            row["impls"][name]["rel_diff_vs_splitkv"] = relative_error(out, outs["splitkv"])
    if bf16 is not None and "splitkv" in outs:
        out = bf16.new_output()
        row["bf16_us"] = timer.graph(_splitkv(bf16, out, {}))
        row["fp8_over_bf16"] = row["impls"]["splitkv"]["us"] / row["bf16_us"]
        row["rel_diff_vs_bf16"] = relative_error(outs["splitkv"], out)
    return row


def sweep_tiles(timer: Timer, fp8: bool = False) -> List[dict]:
    """Time every tile of :data:`SWEEP_TILES` on every row of :data:`SWEEP_ROWS` (a tile that does not
    compile is recorded with its error); the geometric-mean winner is what ``splitkv.tuning`` should hold.
    ``fp8``: on the fp8 latent cache (:func:`fp8_latent`)."""
    records = []
    for heads, batch, prefix in SWEEP_ROWS:
        p = mla_problem(heads, batch, prefix)
        if fp8:
            p = fp8_latent(p)
        for block_n, warps, stages in SWEEP_TILES:
            rec = dict(heads=heads, batch=batch, prefix=prefix, block_n=block_n, num_warps=warps,
                       num_stages=stages)
            try:
                fn = _splitkv(p, p.new_output(), rec, TileConfig(64, block_n, warps, stages))
                rec["us"] = timer.graph(fn)
            except Exception as err:  # out of shared memory or registers: recorded, not fatal
                rec["error"] = f"{type(err).__name__}: {err}"[:200]
            print(rec, flush=True)
            records.append(rec)
        del p
        torch.cuda.empty_cache()
    return records


def _cell(rec: dict, key: str, fmt: str) -> str:
    if key in rec:
        return format(rec[key], fmt)
    if "error" in rec:
        return "out of memory" if rec["error"].startswith("OutOfMemoryError") else "failed"
    return "n/a" if "skipped" in rec else "-"


def format_markdown(result: dict) -> str:
    """The rows as a Markdown table under one provenance line (GPU, date, command, read bandwidth).

    An fp8 run (rows with ``bf16_us``) shows the bf16 cache's time and the ratio in place of the dense peers.
    """
    fp8 = any("bf16_us" in r for r in result["rows"])
    tiles = {r["impls"].get("splitkv", {}).get("config") for r in result["rows"]}
    tile = f" Tile: {tiles.pop()}." if len(tiles) == 1 and None not in tiles else ""
    pool = f"fp8 e4m3 latent cache (scale {FP8_SCALE}), bf16 queries" if fp8 else "bf16"
    peers = "bf16 cache µs | fp8 ÷ bf16 | extend µs" if fp8 else "extend µs | flex µs | sdpa µs"
    lines = [f"{result['device']}, {result.get('date', '-')}, `{result.get('command', 'python -m splitkv.bench.mla')}`"
             f": DeepSeek-V3 (576 = 512 + 64, one KV head, values a view of the keys), {DRAFT_TOKENS} drafts, "
             f"{pool}, token pool; read bandwidth {result['read_bandwidth'] / 1e9:.0f} GB/s; CUDA-graph replays, "
             f"median.{tile}", "",
             "| heads | batch | prefix | latent MB | read floor µs | gather floor µs | splitkv µs | ÷ gather floor "
             f"| % read bw | TFLOPS | slices | {peers} |",
             "|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in result["rows"]:
        ours, ext, flex, sdpa = (r["impls"].get(n, {}) for n in ("splitkv", "extend", "flex", "sdpa"))
        gather = r.get("gather_floor_us")
        ratio = f"{ours['us'] / gather:.2f}" if gather and "us" in ours else "-"
        if fp8:
            tail = (f"{_cell(r, 'bf16_us', '.1f')} | {_cell(r, 'fp8_over_bf16', '.2f')} "
                    f"| {_cell(ext, 'us', '.1f')}")
        else:
            tail = f"{_cell(ext, 'us', '.1f')} | {_cell(flex, 'us', '.1f')} | {_cell(sdpa, 'us', '.1f')}"
        lines.append(f"| {r['heads']} | {r['batch']} | {r['prefix'] // 1024}k | {r['latent_mb']:.1f} "
                     f"| {r['floor_us']:.1f} | {format(gather, '.1f') if gather else '-'} "
                     f"| {_cell(ours, 'us', '.1f')} | {ratio} | {_cell(ours, 'pct_bw', '.0f')} "
                     f"| {_cell(ours, 'tflops', '.0f')} | {ours.get('n_splits', '-')} | {tail} |")
    return "\n".join(lines)


def _write(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m splitkv.bench.mla", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"rows {QUICK_ROWS} only")
    ap.add_argument("--tiles", action="store_true", help="the tile sweep alone (SWEEP_ROWS x SWEEP_TILES)")
    ap.add_argument("--fp8", action="store_true", help="an fp8 e4m3 latent cache (splitkv and extend; bf16 beside)")
    ap.add_argument("--out", default=None,
                    help="result JSON (default figures/benchmark_mla_<gpu>.json, benchmark_mla_fp8_<gpu>.json)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("the benchmark needs a CUDA GPU")
    import triton

    device = torch.cuda.get_device_name()
    fp8_tag = "_fp8" if args.fp8 else ""
    out = args.out or os.path.join("figures", f"benchmark_mla{fp8_tag}_{gpu_tag(device)}.json")
    start = time.time()
    timer = Timer()
    flags = [flag for flag, on in (("--quick", args.quick), ("--tiles", args.tiles), ("--fp8", args.fp8)) if on]
    result = dict(device=device, date=datetime.date.today().isoformat(), torch=torch.__version__,
                  command=" ".join(["python -m splitkv.bench.mla", *flags]),
                  triton=triton.__version__, python=platform.python_version(),
                  read_bandwidth=measure_read_bandwidth(), rows=[])
    if args.tiles:
        result["tile_sweep"] = sweep_tiles(timer, args.fp8)
        _write(args.out or os.path.join("figures", f"mla_tiles{fp8_tag}_{gpu_tag(device)}.json"), result)
        return
    rows = QUICK_ROWS if args.quick else ROWS
    for i, (heads, batch, prefix) in enumerate(rows, 1):
        p = mla_problem(heads, batch, prefix)
        if args.fp8:
            row = bench_row(fp8_latent(p), timer, result["read_bandwidth"], FP8_IMPLS, bf16=p)
        else:
            row = bench_row(p, timer, result["read_bandwidth"])
        result["rows"].append(row)
        del p
        torch.cuda.empty_cache()
        ours = result["rows"][-1]["impls"]["splitkv"]
        print(f"[{time.time() - start:6.1f}s] {i}/{len(rows)} heads {heads} batch {batch} prefix {prefix}: "
              f"splitkv {ours.get('us', ours.get('error'))}", flush=True)
        result["elapsed_s"] = time.time() - start
        _write(out, result)  # after every row: a run cut short keeps what it measured
    md = format_markdown(result)
    with open(os.path.splitext(out)[0] + ".md", "w") as f:
        f.write(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
