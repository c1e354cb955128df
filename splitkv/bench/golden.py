"""Bit-exact outputs: a fixed set of verify problems from fixed seeds, each output hashed (needs a CUDA GPU).

    python -m splitkv.bench.golden --write figures/golden_h100.json   # record this code's outputs
    python -m splitkv.bench.golden --check figures/golden_h100.json   # compare with a record

The problems are the benchmark's models at batch 1, 8 and 32 and prefixes of 1k and 16k keys
(causal chains and trees, bf16 and fp8 token pools), paged pools with pages of 16 and 64, and
MLA heads (576-wide latent keys, values a view of them, 16 query heads). Each is drawn on the
GPU from a seed derived from its name, run once through the drop-in and once more to check that
the output repeats bit for bit, and recorded as the SHA-256 of its output's bytes.

A split count depends on the GPU's SM count and its tuned table, so a record holds for one GPU
name only. A change that moves the arithmetic shows as a changed hash: it must say so and
rewrite the record on purpose (``--write``), never by accident.

The file uses only torch and the drop-in :func:`splitkv.verify_splitkv_fwd` (whose signature is
``extend_attention_fwd``'s), and runs as a plain script too (``python splitkv/bench/golden.py``),
so the same problems can hash another checkout of the package: put that checkout first on
``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import sys
import zlib
from dataclasses import dataclass
from typing import Dict, Iterator, Optional

import torch

#: (query heads, KV heads, head dim, value head dim) of the benchmark's models, and MLA's.
HEADS = {
    "qwen3-next": (16, 2, 256, 256),
    "llama3-8b": (32, 8, 128, 128),
    "qwen3-32b": (64, 8, 128, 128),
    "mla16": (16, 1, 576, 512),
}
DRAFTS = 4
#: A tree of four drafts: token 1 and 2 children of the root, token 3 a child of token 1.
TREE_PARENTS = (-1, 0, 0, 1)
FP8_SCALE = 0.25
POOL_FACTOR = 1.25


@dataclass(frozen=True)
class Case:
    """One problem of the set: a model's heads, batch, prefix, mask, pool dtype and page size (1: token pool)."""

    model: str
    batch: int
    prefix: int
    mask: str  # "causal" or "tree"
    kv: str  # "bf16" or "fp8"
    page: int = 1

    @property
    def name(self) -> str:
        pool = "token" if self.page == 1 else f"pages{self.page}"
        return f"{self.model}/bs{self.batch}/p{self.prefix}/{self.mask}/{self.kv}/{pool}"


def cases() -> Iterator[Case]:
    """The fixed problem set, in a fixed order."""
    for model in ("qwen3-next", "llama3-8b", "qwen3-32b"):
        for batch in (1, 8, 32):
            for prefix in (1024, 16384):
                for mask in ("causal", "tree"):
                    for kv in ("bf16", "fp8"):
                        yield Case(model, batch, prefix, mask, kv)
    for page in (16, 64):
        for prefix in (1024, 16384):
            for kv in ("bf16", "fp8"):
                yield Case("llama3-8b", 8, prefix, "causal", kv, page)
    for batch in (1, 8):
        for prefix in (1024, 16384):
            for kv in ("bf16", "fp8"):
                yield Case("mla16", batch, prefix, "causal", kv)


def _indptr(lengths, device, dtype=torch.int32):
    out = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    out[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    return out.to(device=device, dtype=dtype)


def _tree_rows(prefix: int) -> torch.Tensor:
    """One sequence's mask rows ``[drafts, prefix + drafts]``: every prefix key, then the tree's ancestors."""
    rows = torch.ones(DRAFTS, prefix + DRAFTS, dtype=torch.bool)
    sees = torch.eye(DRAFTS, dtype=torch.bool)
    for i, parent in enumerate(TREE_PARENTS):
        if parent >= 0:
            sees[i] |= sees[parent]
    rows[:, prefix:] = sees
    return rows


def draw(case: Case, device="cuda", dtype=torch.bfloat16):
    """``(positional arguments, keywords)`` of the drop-in for ``case``, drawn from its name's seed.

    ``dtype`` is the queries', drafts' and output's (and a non-fp8 pool's): bf16 on the GPU; the CPU's
    tests use float16, since the Triton interpreter's bf16 dot is wrong."""
    hq, hkv, d, dv = HEADS[case.model]
    gen = torch.Generator(device=device).manual_seed(zlib.crc32(case.name.encode()))
    n_tok, keys = case.batch * DRAFTS, case.batch * case.prefix
    kv_dtype = torch.float8_e4m3fn if case.kv == "fp8" else dtype
    scale = FP8_SCALE if case.kv == "fp8" else 1.0

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)

    def pool_of(x):
        return (x / scale).to(kv_dtype)

    mla = case.model == "mla16"
    q = randn(n_tok, hq, d).to(dtype)
    k_ext = randn(n_tok, hkv, d).to(dtype)
    v_ext = k_ext[..., :dv] if mla else randn(n_tok, hkv, dv).to(dtype)
    keywords = {"sm_scale": d ** -0.5}
    if case.page == 1:
        slots = max(int(keys * POOL_FACTOR), keys + 1)
        k_buf = pool_of(randn(slots, hkv, d))
        v_buf = k_buf[..., :dv] if mla else pool_of(randn(slots, hkv, dv))
        indices = torch.randperm(slots, generator=gen, device=device)[:keys].to(torch.int32)
        kv_indptr = _indptr([case.prefix] * case.batch, device)
    else:
        pages_per_seq = -(-case.prefix // case.page)
        n_pages = pages_per_seq * case.batch + 4
        k_buf = pool_of(randn(n_pages, case.page, hkv, d))
        v_buf = pool_of(randn(n_pages, case.page, hkv, dv))
        indices = torch.randperm(n_pages, generator=gen, device=device)[:pages_per_seq * case.batch]
        indices = indices.to(torch.int32)
        kv_indptr = _indptr([pages_per_seq] * case.batch, device)
        last = case.prefix - (pages_per_seq - 1) * case.page
        keywords["kv_last_page_len"] = torch.full((case.batch,), last, dtype=torch.int32, device=device)
    custom_mask = mask_indptr = None
    if case.mask == "tree":
        rows = _tree_rows(case.prefix).flatten()
        custom_mask = rows.repeat(case.batch).to(device)
        mask_indptr = _indptr([rows.numel()] * case.batch, device, torch.int64)
    out = torch.full((n_tok, hq, dv), float("nan"), dtype=dtype, device=device)
    args = (q, k_ext, v_ext, out, k_buf, v_buf, _indptr([DRAFTS] * case.batch, device), kv_indptr, indices,
            custom_mask, True, mask_indptr, DRAFTS, scale, scale)
    return args, keywords


def digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (its dtype and shape are the case's)."""
    return hashlib.sha256(t.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def run_case(case: Case, device="cuda", dtype=torch.bfloat16) -> Dict[str, object]:
    """The case's output hash, whether the drop-in served it, whether a second run repeated it bit for bit and
    whether the output is finite."""
    from splitkv import verify_splitkv_fwd

    args, keywords = draw(case, device, dtype)
    out = args[3]
    served = bool(verify_splitkv_fwd(*args, **keywords))
    first = digest(out)
    out.fill_(float("nan"))
    verify_splitkv_fwd(*args, **keywords)
    again = digest(out)
    return {"sha256": first, "served": served, "repeats": first == again, "finite": bool(out.isfinite().all())}


def record(device="cuda") -> Dict[str, object]:
    """Every case's result, with the device and library versions."""
    results = {}
    for case in cases():
        results[case.name] = run_case(case, device)
        torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
            "triton": _version("triton"), "date": datetime.date.today().isoformat(), "cases": results}


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except ImportError:
        return "-"


def compare(new: Dict, golden: Dict) -> Dict[str, list]:
    """Names of cases that ``new`` reproduces bit for bit, that differ, that ``golden`` lacks, and that
    ``new`` did not serve, repeat or keep finite (each a problem on its own)."""
    old = golden["cases"]
    verdict = {"equal": [], "differ": [], "new": [], "unserved": [], "unrepeatable": [], "nonfinite": []}
    for name, result in new["cases"].items():
        if name not in old:
            verdict["new"].append(name)
        elif result["sha256"] == old[name]["sha256"]:
            verdict["equal"].append(name)
        else:
            verdict["differ"].append(name)
        for flag, bad in (("served", "unserved"), ("repeats", "unrepeatable"), ("finite", "nonfinite")):
            if not result[flag]:
                verdict[bad].append(name)
    return verdict


def passed(verdict: Dict[str, list]) -> bool:
    """Every case equal to the record and served, repeatable and finite."""
    return not any(verdict[k] for k in ("differ", "new", "unserved", "unrepeatable", "nonfinite"))


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m splitkv.bench.golden", description=__doc__.split("\n\n")[0])
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--write", metavar="JSON", help="record this code's outputs in JSON")
    what.add_argument("--check", metavar="JSON", help="compare this code's outputs with the record in JSON")
    ap.add_argument("--out", metavar="JSON", help="with --check: also write this run's record and verdict here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    new = record()
    if args.write:
        with open(args.write, "w") as f:
            json.dump(new, f, indent=1, sort_keys=True)
        print(f"golden: {len(new['cases'])} outputs of {new['device']} recorded in {args.write}")
        return 0
    with open(args.check) as f:
        golden = json.load(f)
    verdict = compare(new, golden)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**new, "verdict": verdict, "golden": args.check}, f, indent=1, sort_keys=True)
    counts = ", ".join(f"{k} {len(v)}" for k, v in verdict.items())
    print(f"golden: {counts} (against {args.check}, {golden['device']}, {golden['date']})")
    for name in verdict["differ"][:20]:
        print(f"  differs: {name}")
    return 0 if passed(verdict) else 1


if __name__ == "__main__":
    sys.exit(main())
