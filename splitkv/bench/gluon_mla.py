"""``python -m splitkv.bench.gluon_mla``: the Gluon MLA kernel against the ``tl`` MLA kernel (needs an sm_90 GPU).

    python -m splitkv.bench.gluon_mla             # the go / no-go rows, every Gluon tile (about a minute)
    python -m splitkv.bench.gluon_mla --quick     # the 128-head row, the default tile only
    python -m splitkv.bench.gluon_mla --fp8       # an fp8 e4m3 latent cache (the tiles without OVERLAP)

DeepSeek-V3 verify (576 = 512 + 64, one KV head, V a view of K, 4 drafts in a
causal chain, bf16, a token pool with the prefix on random slots:
:func:`splitkv.bench.mla.mla_problem`) at batch 8 and a 16k prefix, 128 query
heads (the compute-bound regime) and 16 (the memory-bound one). Each row times
the split path's plan (the ``tl`` kernel, as ``python -m splitkv.bench.mla``
does) and :func:`splitkv.gluon_mla.gluon_mla_verify` with each tile of
:data:`splitkv.gluon_mla.TILES`, all as CUDA-graph replays with the L2 flushed
(median), and prints µs, TFLOPS (``2 x (576 + 512)`` flops per query row and
visible key), GB/s (the prefix's latent bytes over the time) and ``tl µs ÷
Gluon µs``; each Gluon output is compared with the ``tl`` kernel's.

Go / no-go: the best Gluon tile must be at least :data:`GO_SPEEDUP` times
faster than the ``tl`` kernel on the 128-head row. The result goes to
``figures/gluon_mla_<gpu>.json`` (``gluon_mla_fp8_<gpu>.json`` with ``--fp8``,
the cache quantised as :func:`splitkv.bench.mla.fp8_latent` does, GB/s
counting one byte per element).
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

from ..gluon_mla import DEFAULT_TILE, TILES, gluon_mla_verify, unavailable_reason
from ..testing.reference import relative_error
from .mla import _splitkv, flops, fp8_latent, latent_bytes, mla_problem
from .timing import Timer, gpu_tag

__all__ = ["ROWS", "GO_ROW", "GO_SPEEDUP", "bench_row", "verdict", "main"]

#: ``(query heads, batch, prefix)``: the go / no-go row first.
ROWS = [(128, 8, 16384), (16, 8, 16384)]
GO_ROW = ROWS[0]
#: The Gluon kernel goes on if it is at least this many times faster than ``tl`` on :data:`GO_ROW`.
GO_SPEEDUP = 1.3


def _gluon(p, out, tile):
    return lambda: gluon_mla_verify(p.q_extend, p.k_extend, p.v_extend, out, p.k_buffer, p.v_buffer, p.qo_indptr,
                                    p.kv_indptr, p.kv_indices, p.max_len_extend, is_causal=True,
                                    sm_scale=p.sm_scale, k_scale=p.k_scale, v_scale=p.v_scale, tile=tile)


def bench_row(heads: int, batch: int, prefix: int, timer: Timer, tiles=TILES, fp8: bool = False) -> dict:
    """One row: the ``tl`` plan and every Gluon tile, timed and compared (a tile that fails is recorded)."""
    p = mla_problem(heads, batch, prefix)
    if fp8:
        p = fp8_latent(p)
    nbytes, work = latent_bytes(p), flops(p)
    row = dict(heads=heads, batch=batch, prefix=prefix, latent_mb=nbytes / 1e6, flops=work, impls={})

    def record(name, us, **extra):
        row["impls"][name] = dict(us=us, tflops=work / (us * 1e-6) / 1e12, gbps=nbytes / (us * 1e-6) / 1e9, **extra)

    tl_out = p.new_output()
    rec: dict = {}
    record("tl", timer.graph(_splitkv(p, tl_out, rec)), config=rec.get("config"), n_splits=rec.get("n_splits"))
    for tile in tiles:
        name = f"gluon {tile[0]}x{tile[1]}{' overlap' if tile[2] else ''}"
        out = p.new_output()
        try:
            us = timer.graph(_gluon(p, out, tile))
        except Exception as err:  # a tile that does not compile or launch here is recorded, not fatal
            row["impls"][name] = dict(error=f"{type(err).__name__}: {err}"[:300])
            continue
        record(name, us, rel_diff_vs_tl=relative_error(out, tl_out), speedup=row["impls"]["tl"]["us"] / us)
    return row


def verdict(row: dict) -> str:
    """The go / no-go line for the :data:`GO_ROW` row."""
    best = max((r["speedup"] for r in row["impls"].values() if "speedup" in r), default=0.0)
    go = "GO" if best >= GO_SPEEDUP else "NO-GO"
    return f"{go}: best Gluon tile {best:.2f}x the tl kernel at heads {row['heads']}, batch {row['batch']}, " \
           f"prefix {row['prefix']} (threshold {GO_SPEEDUP}x)"


def _print_row(row: dict) -> None:
    print(f"heads {row['heads']}, batch {row['batch']}, prefix {row['prefix']} ({row['latent_mb']:.0f} MB latent):")
    for name, r in row["impls"].items():
        if "error" in r:
            print(f"  {name:<20} failed: {r['error']}")
            continue
        extra = f"  tl/gluon {r['speedup']:.2f}x  rel diff {r['rel_diff_vs_tl']:.1e}" if "speedup" in r else \
            f"  ({r.get('config')}, {r.get('n_splits')} slices)"
        print(f"  {name:<20} {r['us']:9.1f} µs {r['tflops']:7.1f} TFLOPS {r['gbps']:7.0f} GB/s{extra}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m splitkv.bench.gluon_mla", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the go / no-go row and the default tile only")
    ap.add_argument("--fp8", action="store_true", help="an fp8 e4m3 latent cache")
    ap.add_argument("--out", default=None, help="result JSON (default figures/gluon_mla[_fp8]_<gpu>.json)")
    args = ap.parse_args(argv)
    why = unavailable_reason()
    if why:
        sys.exit(f"the Gluon MLA kernel cannot run here: {why}")
    import triton

    device = torch.cuda.get_device_name()
    start = time.time()
    timer = Timer()
    result = dict(device=device, date=datetime.date.today().isoformat(), torch=torch.__version__,
                  triton=triton.__version__, python=platform.python_version(),
                  command=" ".join(["python -m splitkv.bench.gluon_mla"]
                                   + [f for f, on in (("--quick", args.quick), ("--fp8", args.fp8)) if on]), rows=[])
    rows, tiles = ([GO_ROW], [DEFAULT_TILE]) if args.quick else (ROWS, TILES)
    if args.fp8:
        tiles = [t for t in tiles if not t[2]]
    for heads, batch, prefix in rows:
        row = bench_row(heads, batch, prefix, timer, tiles, args.fp8)
        result["rows"].append(row)
        _print_row(row)
        torch.cuda.empty_cache()
    result["verdict"] = verdict(result["rows"][0])
    result["elapsed_s"] = time.time() - start
    out = args.out or os.path.join("figures", f"gluon_mla{'_fp8' if args.fp8 else ''}_{gpu_tag(device)}.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{device}, triton {triton.__version__}: {result['verdict']} ({result['elapsed_s']:.0f} s; {out})")


if __name__ == "__main__":
    main()
