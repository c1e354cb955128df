"""Record the verify kernel's shared memory, compiled for Hopper: ``splitkv/shared_memory_sm90.json``.

``python -m splitkv.bench.record_resources`` compiles ``_verify_kernel`` for sm_90
(``triton.compile`` with a ``GPUTarget``: no GPU needed) at each point of
:func:`sample_points` and writes the compiled kernels' ``metadata.shared``
(and the buffers its TTGIR allocates) under the running Triton's version,
keeping the other versions' rows. The table is what
:func:`splitkv.resources.shared_memory_bytes` was calibrated against, and
what ``tests/test_resources.py`` checks that it never under-estimates.
Compiles run in worker processes with ``TRITON_INTERPRET=0`` (the kernel's
``@triton.jit`` reads it at import).
``--workers N`` (default: every CPU), ``--limit N`` (the first N points).
The whole grid takes about a minute on 16 CPUs, ten on 2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Dict, List

__all__ = ["TABLE_PATH", "sample_points", "compile_shared", "record"]

#: Where the recorded table lives.
TABLE_PATH = os.path.join(os.path.dirname(os.path.dirname(__file__)), "shared_memory_sm90.json")

#: Triton's pointer types of the pools' and queries' dtypes.
PTR_TYPES = {"bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "fp8e4nv", "float32": "fp32"}
#: The kernel's pointer arguments: "q" (the query's dtype), "kv" (the pool's) or a fixed type.
_POINTERS = {"Q": "q", "K_Ext": "q", "V_Ext": "q", "K_Buf": "kv", "V_Buf": "kv", "O": "q", "LSE_Out": "fp32",
             "qo_indptr": "i32", "kv_indptr": "i32", "kv_indices": "i32", "Last_Page_Len": "i32", "Mask": "u8",
             "mask_indptr": "i32", "Mask_Offsets": "i32", "Sinks": "fp32", "Part_O": "fp32", "Counters": "i32",
             "Err": "i32"}
_FLOATS = ("qk_scale_prefix", "qk_scale_draft", "v_scale", "cap2")

#: (head_dim, v_head_dim) pairs sampled: the brief's dims, MLA's 576/512 among them.
HEAD_DIMS = [(64, 64), (128, 128), (192, 128), (256, 256), (512, 512), (576, 512)]
KV_DTYPES = ["bfloat16", "float16", "float8_e4m3fn", "float32"]


def _pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


def _point(d, dv, bm, bn, warps, stages, k_rows, kv, page=1, merge=1, q=None, drafts=4, features=False) -> Dict:
    """One compiled configuration. ``q``: the query dtype (default: the pool's, bf16 for fp8 pools);
    ``drafts``: ``max_len_extend``; ``features``: every optional score feature and check on."""
    q = q or ("bfloat16" if kv == "float8_e4m3fn" else kv)
    return dict(head_dim=d, v_head_dim=dv, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages,
                k_rows=k_rows, kv_dtype=kv, q_dtype=q, page_size=page, merge=merge, max_len_extend=drafts,
                features=features)


def _plausible(p: Dict) -> bool:
    """Whether a random point is a tile anyone would launch: its fp32 accumulator and scores fit a
    thread's registers (at most 128 and 64 per thread), no float32 pool past head dim 256. Others spill
    massively and take minutes to compile (576/512 at 64 rows x 128 keys in float32: over ten)."""
    threads = 32 * p["num_warps"]
    return (p["block_m"] * _pow2(p["v_head_dim"]) <= 128 * threads and p["block_m"] * p["block_n"] <= 64 * threads
            and (p["kv_dtype"] != "float32" or p["head_dim"] <= 256))


def sample_points(seed: int = 0, size: int = 156) -> List[Dict]:
    """The compiled grid: sweeps along each axis around the H200's tuned tiles, then seeded random points.

    Every head-dim pair x stages 1-4; BLOCK_N 16-128 at head dims 128 and 256;
    8 warps; every pool dtype (fp8 with bf16 and with fp16 queries); pages of
    16 and 64 (every way the kernel gathers a page); MLA's 576/512 at 64 rows;
    64-row tiles (wgmma); ``MERGE_PROGRAMS``, ``SEPARATE_MERGE`` and every score feature on; longer
    drafts; then random points of the whole product up to ``size``.
    """
    bf, f8 = "bfloat16", "float8_e4m3fn"
    pts = [_point(d, dv, 32, 32, 4, s, False, bf) for d, dv in HEAD_DIMS for s in (1, 2, 3, 4)]
    pts += [_point(d, d, 32, bn, 4, s, True, bf) for d in (128, 256) for bn in (16, 32, 64, 128) for s in (2, 3)]
    pts += [_point(d, d, bm, bn, 8, 3, False, bf) for d, bm in ((128, 16), (256, 32)) for bn in (64, 128)]
    for kv, q in ((bf, None), ("float16", None), (f8, None), (f8, "float16"), ("float32", None)):
        pts += [_point(d, d, bm, bn, 4, s, False, kv, q=q) for d, bm, bn, s in
                ((128, 16, 128, 3), (256, 32, 64, 3), (128, 32, 64, 2))]
    pts += [_point(128, 128, 16, bn, 4, 3, False, bf, page) for page, bns in ((16, (16, 32, 64, 128)),
                                                                              (64, (16, 64, 128))) for bn in bns]
    pts += [_point(128, 128, 16, 128, 4, 3, False, f8, 16), _point(256, 256, 32, 64, 4, 2, True, f8, 64),
            _point(576, 512, 64, 16, 4, 2, False, bf, 64)]
    pts += [_point(128, 128, 64, bn, 4, s, False, bf) for bn in (32, 64, 128) for s in (1, 2, 3, 4)]
    pts += [_point(128, 128, 64, 64, 8, s, True, bf) for s in (2, 3)]
    pts += [_point(256, 256, 64, 64, 4, s, True, bf) for s in (2, 3)]
    pts += [_point(576, 512, 64, bn, 4, s, False, bf) for bn in (16, 32, 64) for s in (1, 2, 3)]
    pts += [_point(576, 512, 64, 16, 4, s, False, f8) for s in (1, 2)]
    pts += [_point(576, 512, bm, 16, 4, 2, False, bf) for bm in (16, 32)]
    pts += [_point(256, 256, 32, 64, 4, 3, True, bf, merge=2), _point(128, 128, 32, 128, 4, 3, False, f8, merge=2),
            _point(128, 128, 16, 128, 4, 2, True, bf, merge=0),
            _point(256, 256, 32, 64, 4, 3, True, bf, features=True),
            _point(128, 128, 16, 64, 4, 3, False, f8, 16, features=True)]
    pts += [_point(d, d, bm, bn, 4, 3, False, bf, drafts=n) for d, bm, bn in ((128, 32, 64), (256, 64, 128))
            for n in (32, 64)]
    rng = random.Random(seed)
    while len(pts) < size:
        d, dv = rng.choice(HEAD_DIMS)
        p = _point(d, dv, rng.choice((16, 32, 64)), rng.choice((16, 32, 64, 128)), rng.choice((4, 8)),
                   rng.choice((1, 2, 3, 4)), rng.random() < 0.5, rng.choice(KV_DTYPES), rng.choice((1, 1, 16, 64)))
        if p not in pts and _plausible(p):
            pts.append(p)
    return pts


def _constexprs(p: Dict) -> Dict:
    """The kernel's constexprs at point ``p``, derived as ``VerifyPlan`` derives them (``GROUP x drafts`` rows)."""
    group, on = max(1, p["block_m"] // p["max_len_extend"]), p["features"]
    return dict(
        NUM_Q_HEADS=group * 2, GROUP=group, HEADS_PER_TILE=group, M_BLOCKS=1,
        HEAD_DIM=p["head_dim"], V_HEAD_DIM=p["v_head_dim"], BLOCK_M=p["block_m"], BLOCK_N=p["block_n"],
        BLOCK_N_DRAFT=max(16, min(p["block_n"], _pow2(p["max_len_extend"]))),
        BLOCK_D=_pow2(p["head_dim"]), BLOCK_DV=_pow2(p["v_head_dim"]),
        K_ROWS=p["k_rows"], PAGE_SIZE=p["page_size"], OFFSETS_32=not on, SPLIT_TOKENS=0, USE_MASK=on,
        HAS_MASK_OFFSETS=on, IS_CAUSAL=True, HAS_WINDOW=on, HAS_LOGIT_CAP=on, HAS_XAI_TEMP=on,
        ATTEND_DRAFT=True, HAS_SINKS=on, WRITE_LSE=on, MERGE_UNROLL=4, MERGE=p["merge"],
        MERGE_ROWS=16, MERGE_DV=min(64, _pow2(p["v_head_dim"])), USE_PDL=p["merge"] == 0,
        DOT_PRECISION="ieee" if p["q_dtype"] == "float32" else None,
        DOT_F16=p["kv_dtype"] == "float8_e4m3fn" and p["q_dtype"] == "bfloat16", CHECK=on,
        ROPE_DIM=p.get("rope_dim", 0), KV_SHARED=p.get("kv_shared", False), DRAFT_SHARED=p.get("kv_shared", False))


def _signature(fn, p: Dict):
    """Triton's signature and divisibility attributes: pointers and strides 16-aligned, as the plan's are."""
    sig, attrs = {}, {}
    for i, param in enumerate(fn.params):
        name = param.name
        if param.is_constexpr:
            sig[name] = "constexpr"
        elif name in _POINTERS:
            kind = _POINTERS[name]
            sig[name] = "*" + {"q": PTR_TYPES[p["q_dtype"]], "kv": PTR_TYPES[p["kv_dtype"]]}.get(kind, kind)
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32" if name in _FLOATS else "i32"
            if name.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def compile_shared(p: Dict) -> Dict:
    """Compile ``_verify_kernel`` for sm_90 at point ``p``: the point plus ``shared`` (bytes), the
    shared-memory buffers the compiler allocated (``allocs``, from the TTGIR) and the compile's seconds."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ..kernels.verify import _verify_kernel

    sig, attrs = _signature(_verify_kernel, p)
    src = ASTSource(fn=_verify_kernel, signature=sig, constexprs=_constexprs(p), attrs=attrs)
    start = time.time()
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": p["num_warps"], "num_stages": p["num_stages"]})
    allocs = re.findall(r"local_alloc[^\n]*->\s*!ttg\.memdesc<([0-9x]+x[a-zA-Z0-9]+)", kernel.asm["ttgir"])
    return dict(p, shared=int(kernel.metadata.shared), allocs=" ".join(allocs),
                seconds=round(time.time() - start, 1))


def _load(path: str) -> Dict:
    if not os.path.exists(path):
        return {"source": "python -m splitkv.bench.record_resources", "target": "cuda sm_90", "by_triton": {}}
    with open(path) as f:
        return json.load(f)


def record(points: List[Dict], workers: int, path: str = TABLE_PATH) -> Dict:
    """Compile ``points`` in ``workers`` processes; write their rows under this Triton's version in ``path``."""
    import triton

    os.environ["TRITON_INTERPRET"] = "0"  # inherited by the workers, read by the kernel's @triton.jit
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    start = time.time()
    # The largest tiles (slowest compiles) first, so that no worker is left with them at the end.
    order = sorted(range(len(points)), key=lambda i: -_pow2(points[i]["head_dim"]) * points[i]["block_m"])
    rows = [None] * len(points)
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        for n, (i, row) in enumerate(zip(order, pool.map(compile_shared, [points[i] for i in order])), 1):
            rows[i] = row
            print(f"{n:4d}/{len(points)} {row}", flush=True)
    table = _load(path)
    import torch

    table["by_triton"][triton.__version__] = dict(
        date=datetime.date.today().isoformat(), compiles=len(rows), seconds=round(time.time() - start),
        host=f"{os.cpu_count()} CPUs, {workers} workers, torch {torch.__version__}",
        rows=[{k: v for k, v in r.items() if k != "seconds"} for r in rows])
    _write(table, path)
    return table


def _write(table: Dict, path: str) -> None:
    """The table as JSON, one row a line."""
    lines = ["{"]
    for key, value in table.items():
        if key != "by_triton":
            lines.append(f" {json.dumps(key)}: {json.dumps(value)},")
    lines.append(' "by_triton": {')
    for n, (version, entry) in enumerate(table["by_triton"].items()):
        lines.append(f"  {json.dumps(version)}: {{")
        lines += [f"   {json.dumps(k)}: {json.dumps(v)}," for k, v in entry.items() if k != "rows"]
        lines.append('   "rows": [')
        lines += [f"    {json.dumps(r)}{',' if i + 1 < len(entry['rows']) else ''}" for i, r in enumerate(entry["rows"])]
        lines.append("   ]")
        lines.append("  }" + ("," if n + 1 < len(table["by_triton"]) else ""))
    lines += [" }", "}"]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--limit", type=int, default=None, help="compile only the first N points (a trial: the tests expect the whole grid)")
    parser.add_argument("--out", default=TABLE_PATH)
    args = parser.parse_args()
    record(sample_points()[: args.limit], args.workers, args.out)


if __name__ == "__main__":
    main()
