"""``python -m splitkv.bench --peers flashinfer,sglang``: splitkv beside the kernels serving engines run (CUDA GPU).

    python -m splitkv.bench --peers flashinfer,sglang --quick     # 6 rows, about 90 s once compiled
    python -m splitkv.bench --peers flashinfer,sglang             # every row (run it in parts: --models)
    python -m splitkv.bench.peers_sweep --peers all --compile-only  # build every kernel the rows need, time nothing
    python -m splitkv.bench.peers_sweep --fetch-wheels             # the peers' wheels into .whl/ (needs PyPI)

The peers (:mod:`splitkv.bench.cuda_peers`): SGLang's Triton
``extend_attention_fwd`` (its verify kernel, on splitkv's own token pool) and
FlashInfer's CUDA kernels -- ``BatchPrefillWithPagedKVCacheWrapper`` with
the fa2 and fa3 backends, ``xqa`` in its speculative mode and, for MLA,
``BatchMLAPagedAttentionWrapper`` -- on the same data laid out in FlashInfer's
paged cache (converted before timing). Beside them: ``splitkv`` on the token
pool (random slots, as the main benchmark) and ``splitkv_paged`` on the same
prefix pages FlashInfer reads (``kv_last_page_len=``).

Rows (:func:`sweep_rows`): Llama-3-8B, Qwen3-32B and Qwen3-Next heads x batch
1, 8, 32 x prefix 1k to 64k, 4 drafts in a causal chain on a bf16 pool in
pages of 16; at prefixes 4k and 64k also fp8 pools, pages of 64 and a tree
of 8 drafts; DeepSeek-V3 MLA (16 and 128 heads, pages of 64, causal). XQA
runs on the rows in pages of 64 (:data:`XQA_ROW_PAGE_SIZES`).

Before a peer is timed on a row its output is checked, in the same run:

1. once per kernel configuration, on a *probe*: the same heads, pool dtype,
   pages, mask and drafts at three short, ragged prefixes, where the drafts
   carry real weight, against the float64 oracle
   (:func:`splitkv.testing.reference_for`);
2. on the row itself, against the oracle where it fits in
   :data:`ORACLE_MAX_BYTES` of float64 scratch, else against splitkv's output
   (``checked_against`` says which).

The budget is the bf16 one of :data:`splitkv.testing.TOLERANCE` and
:data:`~splitkv.testing.ROW_TOLERANCE` (whole output, worst row), or
:data:`FP8_MATH_BUDGET` for a peer that multiplies in e4m3 on an fp8 pool
(XQA on SM90; SGLang's extend kernel, which casts its queries and
probabilities to the pool's dtype). A peer over budget is *refused*: recorded with its error and
not timed. A peer whose library is missing is skipped with one line saying
how to install it.

Timing is the main benchmark's (:class:`splitkv.bench.timing.Timer`): the
median of CUDA-graph replays under ``triton.testing.do_bench``, L2 flushed;
``floor_us`` is the prefix K/V bytes (``VerifyProblem.kv_bytes``; for MLA the
latent rows once) over the read bandwidth measured in the same run.

Results: ``figures/peers_<gpu>.json`` (``_quick`` for ``--quick``, ``_custom``
for a subset; written after every row), ``.md`` beside it and
``peers_<gpu>.png`` (:func:`splitkv.bench.plots.plot_peers`). FlashInfer
compiles each kernel variant with nvcc on first use (minutes for the fa3
templates): set ``FLASHINFER_WORKSPACE_BASE`` to a folder of the checkout
(``.flashinfer/``, ignored by git) and run ``--compile-only`` first.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..testing import MODEL_SHAPES, ROW_TOLERANCE, TOLERANCE, VerifyProblem, make_problem, reference_for
from ..testing import relative_error, tree_mask
from . import cuda_peers
from .cuda_peers import PEERS, FlashInferPaged, flashinfer_layout
from .report import plain_table

__all__ = [
    "FP8_MATH_BUDGET",
    "ORACLE_MAX_BYTES",
    "QUICK_ROWS",
    "Row",
    "check_output",
    "draw_problem",
    "fetch_wheels",
    "format_markdown",
    "main",
    "merge_results",
    "probe_problem",
    "run_row",
    "run_sweep",
    "sweep_rows",
    "to_fp8",
    "worst_row_error",
]

#: Peer-independent implementations timed on every row (splitkv's own entries).
OWN = ("splitkv", "splitkv_paged")
OWN_HELP = {
    "splitkv": "splitkv.verify_splitkv_fwd on the token pool (prefix on random slots), drafts as separate tensors",
    "splitkv_paged": "splitkv.verify_splitkv_fwd on the same prefix pages FlashInfer reads (kv_last_page_len=)",
}
#: The GQA models of the rows (keys of splitkv.testing.MODEL_SHAPES) and the MLA model.
GQA_MODELS = ("llama3-8b", "qwen3-32b", "qwen3-next")
MLA_MODEL = "deepseek-v3"
MLA_DIMS = (576, 512)
#: The sweep's axes.
BATCHES = (1, 8, 32)
PREFIXES = (1024, 4096, 16384, 65536)
VARIANT_PREFIXES = (4096, 65536)
#: (mask, drafts, pool dtype, page size): the main case on every (model, batch, prefix), the variants at
#: VARIANT_PREFIXES.
MAIN_CASE = ("causal", 4, "bfloat16", 16)
VARIANT_CASES = (("causal", 4, "float8_e4m3fn", 16), ("causal", 4, "bfloat16", 64),
                 ("causal", 4, "float8_e4m3fn", 64), ("tree", 8, "bfloat16", 64), ("tree", 8, "float8_e4m3fn", 64))
MLA_HEADS = (16, 128)
MLA_PREFIXES = (4096, 16384, 65536)
MLA_CASE = ("causal", 4, "bfloat16", 64)
#: The one published Hopper MLA verify comparison (hazyresearch's ThunderMLA post, 2025-03-04; H100 SXM: FlashMLA
#: 52 µs, ThunderMLA 41 µs): 16 query heads, 4 drafts, 4 requests with these cached lengths (the prefixes here).
THUNDER_MLA_LENS = (4641, 45118, 1730, 1696)
#: The sweep runs XQA on pages of these sizes only: each page size (with each pool dtype, head shape and draft
#: count) is another kernel build of about a minute.
XQA_ROW_PAGE_SIZES = (64,)
#: fp8 pools: pool = bf16 draw / scale, dequantised by the scale (the main benchmark's scales).
FP8_K_SCALE, FP8_V_SCALE = 0.5, 2.0
#: Budgets (whole output, worst row) of a peer that multiplies in e4m3 on an fp8 pool: e4m3 keeps 3 mantissa bits,
#: and rounding the queries and the probabilities to it moves the output by several %.
FP8_MATH_BUDGET = (1e-1, 2.5e-1)
#: The oracle runs on a row when its float64 scratch per sequence (keys and values repeated per query head) fits.
ORACLE_MAX_BYTES = 24 * 2**30
#: Skip rows whose pool and copies would pass this many bytes.
MEMORY_BUDGET = 60 * 2**30


@dataclass(frozen=True)
class Row:
    """One row: a model's heads x batch x prefix, the drafts and their mask, the pool's dtype and page size."""

    model: str
    heads: int
    batch: int
    prefix: int
    drafts: int
    mask: str
    kv_dtype: str
    page_size: int
    #: ragged prefixes, one per sequence (``batch`` of them; ``prefix`` is then their largest); ``()``: all equal
    lens: Tuple[int, ...] = ()

    @property
    def draw_key(self) -> tuple:
        """Rows with the same key share one draw of the data."""
        return (self.model, self.heads, self.batch, self.prefix, self.drafts, self.mask, self.lens)

    @property
    def prefix_lens(self) -> List[int]:
        """Each sequence's prefix."""
        return list(self.lens) if self.lens else [self.prefix] * self.batch

    @property
    def mla(self) -> bool:
        return self.model == MLA_MODEL

    def dims(self) -> Tuple[int, int, int, int]:
        """(query heads, KV heads, head dim, value head dim)."""
        if self.mla:
            return self.heads, 1, MLA_DIMS[0], MLA_DIMS[1]
        s = MODEL_SHAPES[self.model]
        return s.num_q_heads, s.num_kv_heads, s.head_dim, s.head_dim

    def case(self) -> str:
        """``"bf16 p16 causal4"``: the pool, the page size, the drafts."""
        return (f"{ {'bfloat16': 'bf16', 'float8_e4m3fn': 'fp8'}.get(self.kv_dtype, self.kv_dtype)} p{self.page_size} "
                f"{'tree' if self.mask == 'tree' else 'causal'}{self.drafts}")

    def shape(self) -> str:
        """``"bs8 64k"``, or the ragged prefixes: ``"bs4 4641/45118/1730/1696"``."""
        return shape_text(self.batch, self.prefix, self.lens)

    def label(self) -> str:
        name = f"{self.model} h{self.heads}" if self.mla else self.model
        return f"{name} {self.shape()}"

    def pool_bytes(self) -> int:
        h_q, h_kv, d, dv = self.dims()
        per_token = h_kv * d * 2 if self.mla else h_kv * (d + dv) * 2
        return int(sum(self.prefix_lens) * 1.25) * per_token


def shape_text(batch: int, prefix: int, lens=()) -> str:
    """A row's batch and prefix as the tables print them."""
    if lens:
        return f"bs{batch} " + "/".join(str(n) for n in lens)
    return f"bs{batch} {prefix // 1024}k"


def _shape(r: dict) -> str:
    return shape_text(r["batch"], r["prefix"], r.get("lens") or ())


def thunder_mla_row() -> Row:
    """DeepSeek-V3 MLA at 16 heads, 4 drafts, the ThunderMLA post's 4 ragged requests (:data:`THUNDER_MLA_LENS`)."""
    mask, drafts, dt, ps = MLA_CASE
    lens = THUNDER_MLA_LENS
    return Row(MLA_MODEL, 16, len(lens), max(lens), drafts, mask, dt, ps, lens=lens)


def _gqa(model, batches, prefixes, cases) -> List[Row]:
    s = MODEL_SHAPES[model]
    return [Row(model, s.num_q_heads, b, n, drafts, mask, dt, ps)
            for b in batches for n in prefixes for (mask, drafts, dt, ps) in cases]


def sweep_rows(models: Optional[Sequence[str]] = None, batches: Optional[Sequence[int]] = None,
               prefixes: Optional[Sequence[int]] = None) -> List[Row]:
    """The full sweep's rows, narrowed to ``models`` / ``batches`` / ``prefixes``, within :data:`MEMORY_BUDGET`."""
    rows = []
    for model in GQA_MODELS:
        rows += _gqa(model, BATCHES, PREFIXES, [MAIN_CASE]) + _gqa(model, BATCHES, VARIANT_PREFIXES, VARIANT_CASES)
    mask, drafts, dt, ps = MLA_CASE
    rows += [Row(MLA_MODEL, h, b, n, drafts, mask, dt, ps) for h in MLA_HEADS for b in BATCHES for n in MLA_PREFIXES]
    rows.append(thunder_mla_row())
    rows = [r for r in rows if 3 * r.pool_bytes() <= MEMORY_BUDGET]
    return [r for r in rows if (models is None or r.model in models) and (batches is None or r.batch in batches)
            and (prefixes is None or r.prefix in prefixes)]


def _quick_rows() -> List[Row]:
    s = MODEL_SHAPES["llama3-8b"]
    rows = [Row("llama3-8b", s.num_q_heads, 8, 65536, d, m, dt, ps)
            for (m, d, dt, ps) in (MAIN_CASE,) + VARIANT_CASES[:2] + VARIANT_CASES[3:]]
    mask, drafts, dt, ps = MLA_CASE
    return rows + [Row(MLA_MODEL, h, 8, 4096, drafts, mask, dt, ps) for h in MLA_HEADS] + [thunder_mla_row()]


#: ``--quick``: Llama-3-8B at batch 8 x 64k (bf16 and fp8 in pages of 16; in pages of 64 bf16 causal and the
#: trees of 8 on bf16 and fp8, where XQA runs its speculative mode with the tree's bit mask), DeepSeek-V3 MLA at
#: 16 and 128 heads, batch 8 x 4k, and the ThunderMLA row. FlashInfer builds 7 kernel modules for them.
QUICK_ROWS = _quick_rows()


# ---- Problems ---------------------------------------------------------------------------------------

def _tree_parents(n: int, gen: torch.Generator) -> List[int]:
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


def draw_problem(row: Row, device="cuda", seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> VerifyProblem:
    """The row's problem with a ``dtype`` pool (bf16 in the sweep), drawn on ``device`` (a 64k x 32 pool takes
    long to draw on the host).

    Equal prefixes (or the row's ragged ``lens``) on random slots of a pool 1.25 times their size; drafts
    causal, or one random tree per sequence (``custom_mask`` in
    :func:`splitkv.testing.make_problem`'s layout); for MLA one KV head of 576
    whose first 512 columns are the values (views, as
    :mod:`splitkv.bench.mla` draws them).
    """
    h_q, h_kv, d, dv = row.dims()
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    bs, n_ext = row.batch, row.drafts
    lens = row.prefix_lens
    n_tok, keys = bs * n_ext, sum(lens)
    pool = max(int(keys * 1.25), keys + 1)
    q = randn(n_tok, h_q, d)
    if row.mla:
        k_ext, k_buf = randn(n_tok, 1, d), randn(pool, 1, d)
        v_ext, v_buf = k_ext[..., :dv], k_buf[..., :dv]
    else:
        k_ext, v_ext = randn(n_tok, h_kv, d), randn(n_tok, h_kv, dv)
        k_buf, v_buf = randn(pool, h_kv, d), randn(pool, h_kv, dv)
    custom_mask = mask_indptr = None
    if row.mask == "tree":
        host = torch.Generator().manual_seed(seed)
        blocks = []
        for n_pre in lens:
            rows = torch.ones(n_ext, n_pre + n_ext, dtype=torch.bool)
            rows[:, n_pre:] = tree_mask(_tree_parents(n_ext, host))
            blocks.append(rows.flatten())
        custom_mask = torch.cat(blocks).to(device)
        mask_indptr = torch.tensor([0] + [n_ext * (n + n_ext) for n in lens], dtype=torch.int64,
                                   device=device).cumsum(0)

    def indptr(ns):
        return torch.tensor([0] + list(ns), dtype=torch.int64, device=device).cumsum(0).to(torch.int32)

    return VerifyProblem(
        q_extend=q, k_extend=k_ext, v_extend=v_ext, k_buffer=k_buf, v_buffer=v_buf, qo_indptr=indptr([n_ext] * bs),
        kv_indptr=indptr(lens), kv_indices=torch.randperm(pool, generator=gen, device=device)[:keys],
        custom_mask=custom_mask, mask_indptr=mask_indptr, is_causal=True, max_len_extend=n_ext, k_scale=1.0,
        v_scale=1.0, sm_scale=1.0 / math.sqrt(d), sinks=None, prefix_lens=list(lens), extend_lens=[n_ext] * bs)


def to_fp8(p: VerifyProblem, k_scale: float = FP8_K_SCALE, v_scale: float = FP8_V_SCALE) -> VerifyProblem:
    """The problem with an fp8 e4m3 pool (``pool / scale``, dequantised by ``scale``); an MLA pool stays one
    tensor (values a view of the keys) and takes one scale."""
    fp8 = torch.float8_e4m3fn
    if cuda_peers.is_mla(p):
        k = (p.k_buffer / k_scale).to(fp8)
        return p.replace(k_buffer=k, v_buffer=k[..., : p.v_head_dim], k_scale=float(k_scale), v_scale=float(k_scale))
    return p.replace(k_buffer=(p.k_buffer / k_scale).to(fp8), v_buffer=(p.v_buffer / v_scale).to(fp8),
                     k_scale=float(k_scale), v_scale=float(v_scale))


def probe_problem(row: Row, device="cuda", seed: int = 1, dtype: torch.dtype = torch.bfloat16) -> VerifyProblem:
    """A short problem with the row's heads, pool dtype, mask and drafts: three ragged prefixes (a few pages and
    a partial one, a fraction of a page, one page) where the drafts weigh in the softmax; MLA: two equal ones."""
    ps = row.page_size
    if row.mla:
        small = Row(row.model, row.heads, 2, 3 * ps + 5, row.drafts, row.mask, "bfloat16", ps)
        p = draw_problem(small, device, seed, dtype)
    else:
        h_q, h_kv, d, dv = row.dims()
        p = make_problem([3 * ps + 5, 7, ps], row.drafts, h_q, h_kv, d, dv, dtype=dtype, device=device,
                         mask="tree" if row.mask == "tree" else "causal", seed=seed)
    return to_fp8(p) if row.kv_dtype.startswith("float8") else p


def prefix_bytes(p: VerifyProblem) -> int:
    """Bytes of prefix K and V a correct kernel reads at least once (MLA: the latent rows once)."""
    if cuda_peers.is_mla(p):
        return sum(p.prefix_lens) * p.head_dim * p.k_buffer.element_size()
    return p.kv_bytes


# ---- Checking -----------------------------------------------------------------------------------------

def worst_row_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest ``||out_row - ref_row|| / ||ref_row||`` over (token, head) rows, in float64 (``inf`` on NaN)."""
    out = out.to(torch.float64)
    ref = ref.to(device=out.device, dtype=torch.float64)
    if not torch.isfinite(out).all():
        return float("inf")
    num = torch.linalg.vector_norm(out - ref, dim=-1)
    den = torch.linalg.vector_norm(ref, dim=-1).clamp_min(1e-30)
    return (num / den).max().item()


def budget(name: str, p: VerifyProblem) -> Tuple[float, float]:
    """(whole output, worst row) budget of implementation ``name`` on ``p``."""
    if name in PEERS and PEERS[name].fp8_math and p.k_buffer.dtype != p.q_extend.dtype:
        return FP8_MATH_BUDGET
    return TOLERANCE[p.q_extend.dtype], ROW_TOLERANCE[p.q_extend.dtype]


def check_output(out: torch.Tensor, ref: torch.Tensor, limits: Tuple[float, float]) -> dict:
    """``{"rel_err", "row_err", "ok"}``: ``out`` against ``ref`` within ``limits`` (whole output, worst row)."""
    rel, row = relative_error(out, ref), worst_row_error(out, ref)
    return dict(rel_err=rel, row_err=row, ok=bool(rel <= limits[0] and row <= limits[1]))


def sweep_skip(name: str, row: Row) -> Optional[str]:
    """Why the sweep leaves peer ``name`` out of ``row`` although the kernel could run it (``None``: it runs it)."""
    if name == "flashinfer_xqa" and row.page_size not in XQA_ROW_PAGE_SIZES:
        return (f"xqa is run on the rows in pages of {'/'.join(map(str, XQA_ROW_PAGE_SIZES))} only (each page size "
                "is another kernel build)")
    return None


def oracle_fits(p: VerifyProblem) -> bool:
    """Whether :func:`splitkv.testing.reference_for` fits :data:`ORACLE_MAX_BYTES` of scratch on ``p``."""
    longest = max(n + m for n, m in zip(p.prefix_lens, p.extend_lens))
    return 2 * longest * p.num_q_heads * (p.head_dim + p.v_head_dim) * 8 <= ORACLE_MAX_BYTES


# ---- One row ------------------------------------------------------------------------------------------

def _err(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"[:400]


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _own_impl(name: str, p: VerifyProblem, fl: Optional[FlashInferPaged], out: torch.Tensor) -> Callable:
    from .. import verify_splitkv_fwd

    if name == "splitkv":
        args, kw = p.args(out), p.kwargs()
    else:
        args, kw = fl.prefix.args(out), fl.prefix.kwargs()
    return lambda: verify_splitkv_fwd(*args, **kw, max_bs=p.batch_size)


def _make(name: str, p: VerifyProblem, fl: Optional[FlashInferPaged], out: torch.Tensor) -> Callable:
    if name in OWN:
        return _own_impl(name, p, fl, out)
    return cuda_peers.build_peer(name, p, out, fl)


def _needs_layout(name: str) -> bool:
    return name == "splitkv_paged" or (name in PEERS and PEERS[name].paged)


def _run_checked(name: str, p: VerifyProblem, fl, ref: torch.Tensor, limits) -> Tuple[Callable, torch.Tensor, dict]:
    """Build ``name``, run it once, check its output: (callable, output, the check's record)."""
    out = p.new_output()
    fn = _make(name, p, fl, out)
    if fn() is False:
        raise RuntimeError("verify_splitkv_fwd declined the call (returned False)")
    _sync(out.device)
    return fn, out, check_output(out, ref, limits)


def probe(name: str, row: Row, cache: dict, device="cuda", dtype: torch.dtype = torch.bfloat16) -> dict:
    """Check peer ``name`` once per kernel configuration on :func:`probe_problem` against the oracle (cached in
    ``cache``): ``{"rel_err", "row_err", "ok"}`` or ``{"error"}``, with ``seconds`` (includes any compile)."""
    key = (name, row.dims(), row.kv_dtype, row.page_size, row.mask, row.drafts)
    if key in cache:
        return cache[key]
    t0 = time.perf_counter()
    try:
        p = probe_problem(row, device, dtype=dtype)
        fl = flashinfer_layout(p, row.page_size) if _needs_layout(name) else None
        ref = reference_for(fl.stored_problem() if fl is not None and name in PEERS else p)
        _, _, rec = _run_checked(name, p, fl, ref, budget(name, p))
    except Exception as err:
        rec = dict(error=_err(err))
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    cache[key] = rec
    return rec


def run_row(row: Row, p: VerifyProblem, impls: Sequence[str], timer, bandwidth: float, probes: dict,
            eager: bool = False, gather_floor: bool = False) -> dict:
    """Check, then time, every implementation on one row's problem; a failure, skip or refusal is recorded.

    Returns the row record: the row's fields, ``kv_bytes``, ``floor_us`` and
    per implementation ``graph`` (µs; ``eager`` too with ``eager``), ``gbps``,
    ``rel_err`` / ``row_err`` and ``checked_against``, ``probe``; or
    ``skipped`` / ``refused`` / ``error``. With ``gather_floor``, also
    ``gather_floor_us``: the main benchmark's gather floor on the token pool
    (:func:`splitkv.bench.floors.search_gather_floor`, its reduced grid).
    """
    t_row = time.perf_counter()
    kv_bytes = prefix_bytes(p)
    rec = dict(asdict(row), case=row.case(), kv_bytes=kv_bytes, floor_us=kv_bytes / bandwidth * 1e6, impls={})
    layout: Dict[str, FlashInferPaged] = {}
    refs: Dict[str, Optional[torch.Tensor]] = {}
    outs: Dict[str, torch.Tensor] = {}

    def fl_() -> FlashInferPaged:
        if "fl" not in layout:
            layout["fl"] = flashinfer_layout(p, row.page_size)
        return layout["fl"]

    def reference(stored: bool) -> Tuple[Optional[torch.Tensor], str]:
        target = fl_().stored_problem() if stored else p
        key = "stored" if stored and target is not p else "token"
        if key not in refs:
            refs[key] = reference_for(target) if oracle_fits(p) else None
        if refs[key] is not None:
            return refs[key], "oracle"
        return outs.get("splitkv"), "splitkv"

    for name in impls:
        r = rec["impls"][name] = {}
        if name in PEERS:
            why = (cuda_peers.unavailable(name) or sweep_skip(name, row)
                   or cuda_peers.skip_reason(name, p, row.page_size))
            if why:
                r["skipped"] = why
                continue
        pr = probe(name, row, probes, p.q_extend.device, p.q_extend.dtype)
        r["probe"] = pr
        if not pr.get("ok"):
            r["refused" if "error" not in pr else "error"] = (
                f"probe: {pr['error']}" if "error" in pr else
                f"probe off the oracle: rel err {pr['rel_err']:.2e}, worst row {pr['row_err']:.2e} "
                f"(budget {budget(name, p)[0]:g} / {budget(name, p)[1]:g})")
            continue
        try:
            fl = fl_() if _needs_layout(name) else None
            ref, against = reference(stored=name in PEERS and fl is not None)
            if ref is None and name != "splitkv":
                raise RuntimeError("no reference: the oracle does not fit this row and splitkv has no output")
            if ref is None:  # splitkv itself where the oracle does not fit: its probe is its check
                out = p.new_output()
                fn = _make(name, p, fl, out)
                if fn() is False:
                    raise RuntimeError("verify_splitkv_fwd declined the call (returned False)")
                _sync(out.device)
                chk, against = dict(rel_err=None, row_err=None, ok=bool(torch.isfinite(out).all())), "probe only"
            else:
                fn, out, chk = _run_checked(name, p, fl, ref, budget(name, p))
        except Exception as err:
            r["error"] = _err(err)
            continue
        r.update(rel_err=chk["rel_err"], row_err=chk["row_err"], checked_against=against)
        if not chk["ok"] and chk["rel_err"] is None:
            r["refused"] = "output holds NaN or inf"
            continue
        if not chk["ok"]:
            lim = budget(name, p)
            r["refused"] = (f"output off the {against}: rel err {chk['rel_err']:.2e}, worst row {chk['row_err']:.2e} "
                            f"(budget {lim[0]:g} / {lim[1]:g})")
            continue
        outs[name] = out
        for mode in ("graph", "eager") if eager else ("graph",):
            try:
                r[mode] = getattr(timer, mode)(fn)
            except Exception as err:
                r[mode] = None
                r[f"{mode}_error"] = _err(err)
        if not r.get("graph") and "eager" not in r:  # no graph (capture failed): eager calls, marked in the tables
            try:
                r["eager"] = timer.eager(fn)
            except Exception as err:
                r["eager"] = None
                r["eager_error"] = _err(err)
        best = min([t for t in (r.get("graph"), r.get("eager")) if t] or [0]) or None
        if best:
            r["gbps"] = kv_bytes / (best * 1e-6) / 1e9
    if gather_floor:
        try:
            from .floors import REDUCED_GRID, search_gather_floor

            v = None if cuda_peers.is_mla(p) else p.v_buffer  # MLA: the values are the keys' first columns
            found = search_gather_floor(p.k_buffer, v, p.kv_indices, timer.graph, **REDUCED_GRID)
            rec["gather_floor_us"], rec["gather_floor_config"] = found["us"], found["config"]
        except Exception as err:
            rec["gather_floor_error"] = _err(err)
    ours = rec["impls"].get("splitkv", {}).get("graph")
    for name, r in rec["impls"].items():
        if name != "splitkv" and r.get("graph") and ours:
            r["over_splitkv"] = r["graph"] / ours
    layout.clear()
    refs.clear()
    outs.clear()
    rec["elapsed_s"] = time.perf_counter() - t_row
    return rec


# ---- The sweep ----------------------------------------------------------------------------------------

def _header(impls, timer, bandwidth: float, quick: bool) -> dict:
    import triton

    libs = {}
    for lib in ("flashinfer", "sglang"):
        if any(PEERS[n].library == lib for n in impls if n in PEERS):
            libs[lib] = cuda_peers.library_version(lib)
    try:
        from .sglang_extend import find_sources

        sgl_source = find_sources()[1]["source"] if "sglang" in libs and libs["sglang"] else None
    except Exception:
        sgl_source = None
    return dict(
        device=torch.cuda.get_device_name(),
        num_sms=torch.cuda.get_device_properties(0).multi_processor_count,
        torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
        date=datetime.date.today().isoformat(), read_bandwidth=bandwidth, quick=quick,
        libraries=libs, sglang_source=os.path.basename(sgl_source) if sgl_source else None,
        implementations={n: (OWN_HELP[n] if n in OWN else PEERS[n].help) for n in impls},
        fp8_scales=dict(k_scale=FP8_K_SCALE, v_scale=FP8_V_SCALE),
        budgets=dict(bf16=[TOLERANCE[torch.bfloat16], ROW_TOLERANCE[torch.bfloat16]], fp8_math=list(FP8_MATH_BUDGET)),
        oracle_max_bytes=ORACLE_MAX_BYTES,
        timing=dict(warmup_ms=timer.warmup_ms, rep_ms=timer.rep_ms, method="CUDA-graph replays, do_bench median, "
                    "L2 flushed"),
        elapsed_s=0.0, rows=[],
    )


def _save(result: dict, path: Optional[str]) -> None:
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def run_sweep(rows: Sequence[Row], peers: Sequence[str], *, out_path: Optional[str] = None, timer=None,
              eager: bool = False, quick: bool = False, progress: bool = True, gather_floor: bool = True,
              device="cuda", dtype: torch.dtype = torch.bfloat16, command: Optional[str] = None) -> dict:
    """Every row with splitkv's two entries and ``peers``; the result record (written to ``out_path`` per row).

    ``device`` and ``dtype`` (the queries' and the pool's before fp8) are the
    GPU and bf16 in the benchmark; tests run the same path on the CPU.
    """
    from .timing import Timer, measure_read_bandwidth

    timer = timer or Timer()
    start = time.perf_counter()
    impls = list(OWN) + list(peers)
    bandwidth = measure_read_bandwidth()
    result = _header(impls, timer, bandwidth, quick)
    result["command"] = command
    for name in peers:
        why = cuda_peers.unavailable(name)
        if why:
            print(why, flush=True)
    probes: dict = {}
    groups: Dict[tuple, List[Row]] = {}
    for row in rows:
        groups.setdefault(row.draw_key, []).append(row)
    done = 0
    for key, members in groups.items():
        t_setup = time.perf_counter()
        base = draw_problem(members[0], device, dtype=dtype)
        setup_s = time.perf_counter() - t_setup
        for row in members:
            t_setup = time.perf_counter()
            p = to_fp8(base) if row.kv_dtype.startswith("float8") else base
            setup_s += time.perf_counter() - t_setup
            rec = run_row(row, p, impls, timer, bandwidth, probes, eager=eager, gather_floor=gather_floor)
            rec["setup_s"] = setup_s
            setup_s = 0.0
            result["rows"].append(rec)
            done += 1
            result["elapsed_s"] = time.perf_counter() - start
            if progress:
                print(_row_line(done, len(rows), rec, result["elapsed_s"]), flush=True)
            _save(result, out_path)
            del p
        del base
        torch.cuda.empty_cache()
    result["probes"] = [dict(peer=k[0], dims=list(k[1]), kv_dtype=k[2], page_size=k[3], mask=k[4], drafts=k[5], **v)
                        for k, v in probes.items()]
    result["elapsed_s"] = time.perf_counter() - start
    _save(result, out_path)
    return result


def _probe_targets(rows: Sequence[Row], peers: Sequence[str], device="cuda"):
    """(peer, row) of each probe the rows need, the first row of each kernel configuration."""
    seen = set()
    for name in peers:
        for row in rows:
            key = (name, row.dims(), row.kv_dtype, row.page_size, row.mask, row.drafts)
            if key in seen or sweep_skip(name, row):
                continue
            seen.add(key)
            if cuda_peers.skip_reason(name, probe_problem(row, device), row.page_size):
                continue
            yield name, row


def prebuild(rows: Sequence[Row], peers: Sequence[str], rounds: int = 3, build: Optional[Callable] = None,
             log_path: Optional[str] = None, device="cuda", meanwhile: Optional[Callable[[], None]] = None) -> dict:
    """Build every FlashInfer module the rows' probes need, all at once (:func:`cuda_peers.build_flashinfer_specs`)
    instead of one after another on first use.

    Each round runs the probes with the module builds stubbed
    (:func:`cuda_peers.collecting_flashinfer_specs`): a probe stops at the
    first module it lacks, which is recorded; then all recorded modules are
    built in one parallel ninja call. Rounds repeat while a probe finds
    another missing module (at most ``rounds``). ``build(specs)`` replaces
    the ninja call (tests). ``meanwhile()`` runs during the first ninja call
    (or at once when nothing is to be built). Returns ``{"modules",
    "failed", "seconds", "rounds"}``.
    """
    fi = [n for n in peers if n in PEERS and PEERS[n].library == "flashinfer" and not cuda_peers.unavailable(n)]
    summary = dict(modules=[], failed=[], seconds=0.0, rounds=0)
    pending = [meanwhile] if meanwhile is not None else []

    def run_pending():
        while pending:
            pending.pop()()

    if not fi:
        run_pending()
        return summary
    build = build or (lambda specs, meanwhile=None: cuda_peers.build_flashinfer_specs(
        specs, log_path=log_path, meanwhile=meanwhile))
    tried = set()
    for _ in range(rounds):
        with cuda_peers.collecting_flashinfer_specs() as needed:
            for name, row in _probe_targets(rows, fi, device):
                probe(name, row, {}, device)  # stops at the first missing module, recorded in `needed`
        new = {k: v for k, v in needed.items() if k not in tried}
        if not new:
            break
        tried.update(new)
        summary["rounds"] += 1
        print(f"building {len(new)} FlashInfer modules in one ninja call: {', '.join(sorted(new))}", flush=True)
        res = build(list(new.values()), meanwhile=run_pending) or {}
        summary["seconds"] += res.get("seconds", 0.0)
        summary["modules"] += res.get("built", list(new))
        summary["failed"] += res.get("failed", [])
        print(f"  built {len(res.get('built', new))}, failed {len(res.get('failed', []))} in "
              f"{res.get('seconds', 0.0):.0f} s" + (f" (log {res['log']})" if res.get("failed") else ""), flush=True)
    run_pending()
    return summary


def compile_only(rows: Sequence[Row], peers: Sequence[str], own: bool = False, parallel: bool = True,
                 log_path: Optional[str] = None) -> List[dict]:
    """Run each probe the rows need (this builds every kernel variant they use); times nothing.

    With ``parallel``, FlashInfer's modules are first built all at once (:func:`prebuild`), and splitkv's own
    probes (with ``own``) and the Triton peers' run meanwhile; then every probe runs and is printed.
    """
    probes: dict = {}
    triton_side = ([n for n in OWN] if own else []) + [n for n in peers if PEERS[n].library != "flashinfer"]

    def probe_and_say(name, row):
        before = len(probes)
        rec = probe(name, row, probes)
        if len(probes) > before:
            state = "ok" if rec.get("ok") else rec.get("error") or f"refused (rel err {rec['rel_err']:.2e})"
            print(f"{name:<16} {row.case():<18} {row.dims()}: {rec['seconds']:.1f} s, {state}", flush=True)

    def triton_probes():
        for name in triton_side:
            if name in PEERS and cuda_peers.unavailable(name):
                continue
            for row in rows:
                if name in PEERS and (sweep_skip(name, row)
                                      or cuda_peers.skip_reason(name, probe_problem(row), row.page_size)):
                    continue
                probe_and_say(name, row)

    if parallel:
        t0 = time.perf_counter()
        res = prebuild(rows, peers, log_path=log_path, meanwhile=triton_probes)
        print(f"prebuilt {len(res['modules'])} FlashInfer modules ({len(res['failed'])} failed) in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
    else:
        triton_probes()
    for name in peers:
        why = cuda_peers.unavailable(name)
        if why:
            print(why, flush=True)
            continue
        for row in rows:
            if sweep_skip(name, row):
                continue
            if cuda_peers.skip_reason(name, probe_problem(row), row.page_size):
                continue
            probe_and_say(name, row)
    return [dict(peer=k[0], dims=list(k[1]), kv_dtype=k[2], page_size=k[3], mask=k[4], drafts=k[5], **v)
            for k, v in probes.items()]


def merge_results(parts: Sequence[dict]) -> dict:
    """One result from runs made in parts (one per ``--models``): rows in order, elapsed seconds added, each
    row's floor at the first part's read bandwidth.

    Raises:
        ValueError: on no parts, parts from different devices or software, or a row measured twice.
    """
    if not parts:
        raise ValueError("nothing to merge")
    first = parts[0]
    for key in ("device", "torch", "triton", "libraries"):
        if any(p.get(key) != first.get(key) for p in parts[1:]):
            raise ValueError(f"the parts differ in {key}: they are not one benchmark")
    merged = {k: v for k, v in first.items() if k not in ("rows", "probes")}
    merged["rows"], seen = [], set()
    merged["implementations"] = {}
    for part in parts:
        merged["implementations"].update(part["implementations"])
        for row in part["rows"]:
            key = tuple(row[f] for f in ("model", "heads", "batch", "prefix", "drafts", "mask", "kv_dtype",
                                         "page_size")) + tuple(row.get("lens") or ())
            if key in seen:
                raise ValueError(f"row {key} is in more than one part")
            seen.add(key)
            row = dict(row, floor_us=row["kv_bytes"] / first["read_bandwidth"] * 1e6)
            merged["rows"].append(row)
    merged["probes"] = [pr for part in parts for pr in part.get("probes", [])]
    merged["elapsed_s"] = sum(p["elapsed_s"] for p in parts)
    merged["read_bandwidth_runs"] = [p["read_bandwidth"] for p in parts]
    merged["date"] = " and ".join(dict.fromkeys(p["date"] for p in parts))
    return merged


# ---- Text ---------------------------------------------------------------------------------------------

_LABEL = {"splitkv": "splitkv", "splitkv_paged": "splitkv paged", "sglang_extend": "SGLang extend",
          "flashinfer_fa2": "FlashInfer fa2", "flashinfer_fa3": "FlashInfer fa3", "flashinfer_xqa": "FlashInfer xqa",
          "flashinfer_mla": "FlashInfer MLA"}


def _us(x) -> str:
    return "–" if not x else f"{x:.1f}" if x < 1000 else f"{x:.0f}"


def _cell(rec: Optional[dict]) -> str:
    if rec is None:
        return "–"
    if rec.get("graph"):
        return _us(rec["graph"])
    if rec.get("eager") and rec.get("graph_error"):
        return _us(rec["eager"]) + " *"
    for key, word in (("refused", "refused"), ("skipped", "skip"), ("error", "fail"), ("graph_error", "fail")):
        if rec.get(key):
            return word
    return "–"


def _ratio_cell(rec: Optional[dict]) -> str:
    if rec and rec.get("over_splitkv"):
        return f"{rec['over_splitkv']:.2f}"
    cell = _cell(rec)
    return "–" if cell[0].isdigit() else cell


def _floor_ratio(r: dict) -> str:
    ours, floor = r["impls"].get("splitkv", {}).get("graph"), r.get("gather_floor_us")
    return f"{ours / floor:.2f}" if ours and floor else "–"


def _row_line(i: int, n: int, rec: dict, total_s: float) -> str:
    parts = [f"{_LABEL.get(k, k)} {_cell(v)}" for k, v in rec["impls"].items()]
    label = f"{rec['model']} {_shape(rec)} {rec['case']}"
    return f"[{i:>3}/{n}] {label:<36} " + ", ".join(parts) + f"; total {total_s:.0f} s"


def _present(rows: List[dict], names: Sequence[str]) -> List[str]:
    return [n for n in names if any(n in r["impls"] for r in rows)]


def _tables(result: dict) -> List[Tuple[str, List[str], List[List[str]]]]:
    def order(r):  # model, then case, then batch and prefix
        model = GQA_MODELS.index(r["model"]) if r["model"] in GQA_MODELS else len(GQA_MODELS)
        return model, r.get("case", ""), r.get("heads", 0), r["batch"], r["prefix"]

    rows = sorted(result["rows"], key=order)
    gqa = [r for r in rows if r["model"] != MLA_MODEL]
    mla = [r for r in rows if r["model"] == MLA_MODEL]
    order = list(OWN) + list(PEERS)
    tables = []
    if gqa:
        names = _present(gqa, [n for n in order if n != "flashinfer_mla"])
        peers = [n for n in names if n != "splitkv"]
        tables.append(("Verify attention, µs per call (median of CUDA-graph replays)",
                       ["shape", "case", "floor"] + [_LABEL.get(n, n) for n in names],
                       [[f"{r['model']} {_shape(r)}", r["case"], _us(r["floor_us"])]
                        + [_cell(r["impls"].get(n)) for n in names] for r in gqa]))
        tables.append(("Each implementation's time ÷ splitkv's (above 1: splitkv is faster); splitkv ÷ the gather "
                       "floor", ["shape", "case"] + [_LABEL.get(n, n) for n in peers] + ["splitkv ÷ gather floor"],
                       [[f"{r['model']} {_shape(r)}", r["case"]]
                        + [_ratio_cell(r["impls"].get(n)) for n in peers] + [_floor_ratio(r)] for r in gqa]))
    if mla:
        names = _present(mla, [n for n in order if n not in ("flashinfer_fa2", "flashinfer_fa3", "flashinfer_xqa")])
        peers = [n for n in names if n != "splitkv"]
        tables.append(("DeepSeek-V3 MLA (576 / 512, one latent head), µs per call (CUDA-graph replays) and ÷ splitkv",
                       ["shape", "case", "floor"] + [_LABEL.get(n, n) for n in names] + [f"{_LABEL.get(n, n)} ÷" for n in peers
                                                                                   if n != "splitkv_paged"],
                       [[f"h{r['heads']} {_shape(r)}", r["case"], _us(r["floor_us"])]
                        + [_cell(r["impls"].get(n)) for n in names]
                        + [_ratio_cell(r["impls"].get(n)) for n in peers if n != "splitkv_paged"] for r in mla]))
    return tables


def _problems(result: dict) -> List[str]:
    seen: Dict[Tuple[str, str, str], List[str]] = {}
    for r in result["rows"]:
        where = f"{r['model']} {_shape(r)} {r['case']}"
        for name, rec in r["impls"].items():
            for key in ("refused", "skipped", "error", "graph_error"):
                if rec.get(key):
                    word = {"refused": "refused", "skipped": "skipped"}.get(key, "failed")
                    seen.setdefault((_LABEL.get(name, name), word, str(rec[key]).splitlines()[0][:200]),
                                    []).append(where)
    return [f"{name} {word} at {', '.join(places)}: {why}" for (name, word, why), places in seen.items()]


def _footer(result: dict) -> List[str]:
    libs = result.get("libraries", {})
    lib_text = ", ".join(f"{k} {v or 'not available'}" for k, v in libs.items())
    b = result["budgets"]
    lines = [
        f"{result['device']} ({result.get('num_sms', '?')} SMs), measured read bandwidth "
        f"{result['read_bandwidth'] / 1e12:.2f} TB/s, torch {result['torch']}, triton {result['triton']}"
        + (f", {lib_text}" if lib_text else "") + f", {result['date']}. µs = median of triton.testing.do_bench "
        f"(L2 flushed, rep {result['timing']['rep_ms']:g} ms) over CUDA-graph replays of one call; plans, "
        "layout conversions and checks are outside the timed region.",
        "case = pool dtype, page size, drafts (causalN: a chain of N; treeN: a random tree of N, FlashInfer's custom "
        f"mask); fp8 = e4m3 with k_scale {result['fp8_scales']['k_scale']}, v_scale "
        f"{result['fp8_scales']['v_scale']}. floor = prefix K+V bytes / measured read bandwidth; gather floor = "
        "the fastest bare kernel gathering the same rows through the same kv_indices (splitkv.bench.floors, "
        "reduced grid). Every timed output was checked first: against the float64 oracle (whole output / worst "
        f"row within {b['bf16'][0]:g} / {b['bf16'][1]:g}; {b['fp8_math'][0]:g} / {b['fp8_math'][1]:g} for the "
        "peers that multiply in e4m3 on fp8 pools: XQA, SGLang's extend kernel) at a short probe of the same "
        "configuration and at the row, or against splitkv's output where the oracle does not fit; refused = over "
        "that budget (not timed), skip = not run at this shape, fail = raised; * = eager calls (do_bench, "
        "launches back to back) where capturing a CUDA graph failed.",
    ]
    problems = _problems(result)
    if problems:
        lines.append("Refusals, failures and skips: " + "; ".join(problems) + ".")
    return lines


def format_table(result: dict) -> str:
    """The results as plain-text tables and the footer."""
    out = []
    for title, head, body in _tables(result):
        out += plain_table(title, head, body, left=2)
    return "\n".join(out + _footer(result))


def format_markdown(result: dict) -> str:
    """The results as Markdown tables (at most 9 columns, bold captions) and the footer."""
    out = []
    for title, head, body in _tables(result):
        out += [f"**{title}**", "", "| " + " | ".join(head) + " |", "|---|---|" + "--:|" * (len(head) - 2)]
        out += ["| " + " | ".join(cells) + " |" for cells in body] + [""]
    return "\n".join(out + ["\n\n".join(_footer(result))])


# ---- Who is fastest -------------------------------------------------------------------------------------

def _best_time(rec: Optional[dict]) -> Optional[float]:
    """An implementation's time at a row: its CUDA-graph time (``None``: not timed, or eager calls only)."""
    return (rec or {}).get("graph") or None


def row_ranking(r: dict) -> List[Tuple[str, float]]:
    """``[(name, µs)]`` of the implementations timed (CUDA graphs) at row record ``r``, fastest first."""
    timed = [(n, _best_time(rec)) for n, rec in r["impls"].items()]
    return sorted([(n, t) for n, t in timed if t], key=lambda nt: nt[1])


def fastest(result: dict) -> List[dict]:
    """Row by row: ``{"row", "case", "fastest", "us", "runner_up", "runner_up_us", "margin", "splitkv_us",
    "splitkv_rank", "best_peer", "best_peer_us", "peer_over_splitkv", "splitkv_over_gather_floor"}`` (``margin``
    = runner-up ÷ fastest; ``peer_over_splitkv`` = the fastest peer's time ÷ splitkv's, below 1 where a peer
    wins). splitkv is its token-pool entry; ``splitkv_paged`` counts as splitkv's too, never as a peer."""
    out = []
    for r in result["rows"]:
        ranking = row_ranking(r)
        if not ranking:
            continue
        names = [n for n, _ in ranking]
        ours = _best_time(r["impls"].get("splitkv"))
        peers = [(n, t) for n, t in ranking if n not in OWN]
        floor = r.get("gather_floor_us")
        out.append(dict(
            row=f"{r['model']}{' h' + str(r['heads']) if r['model'] == MLA_MODEL else ''} {_shape(r)}",
            case=r.get("case", ""), fastest=ranking[0][0], us=ranking[0][1],
            runner_up=ranking[1][0] if len(ranking) > 1 else None,
            runner_up_us=ranking[1][1] if len(ranking) > 1 else None,
            margin=ranking[1][1] / ranking[0][1] if len(ranking) > 1 else None,
            splitkv_us=ours, splitkv_rank=names.index("splitkv") + 1 if "splitkv" in names else None,
            best_peer=peers[0][0] if peers else None, best_peer_us=peers[0][1] if peers else None,
            peer_over_splitkv=peers[0][1] / ours if peers and ours else None,
            splitkv_over_gather_floor=ours / floor if ours and floor else None))
    return out


def not_fastest(result: dict) -> List[dict]:
    """The rows of :func:`fastest` where a peer is faster than splitkv (token pool) or splitkv has no time."""
    return [f for f in fastest(result)
            if f["splitkv_us"] is None or (f["best_peer_us"] is not None and f["best_peer_us"] < f["splitkv_us"])]


def _name(n: Optional[str]) -> str:
    return _LABEL.get(n, n) if n else "–"


def fastest_markdown(result: dict) -> str:
    """The row-by-row table of who is fastest, then the rows where splitkv is not, as Markdown."""
    rows = fastest(result)
    lines = ["**Fastest per row** (CUDA-graph µs; margin = runner-up ÷ fastest; best peer ÷ splitkv below 1: "
             "the peer is faster)", "",
             "| row | case | fastest | µs | runner-up | margin | best peer | best peer ÷ splitkv |",
             "|---|---|---|--:|---|--:|---|--:|"]
    for f in rows:
        margin = f"{f['margin']:.2f}" if f["margin"] else "–"
        ratio = f"{f['peer_over_splitkv']:.2f}" if f["peer_over_splitkv"] else "–"
        lines.append(f"| {f['row']} | {f['case']} | {_name(f['fastest'])} | {_us(f['us'])} | "
                     f"{_name(f['runner_up'])} | {margin} | {_name(f['best_peer'])} | {ratio} |")
    lines += ["", "**Where splitkv is not the fastest**", ""]
    losses = not_fastest(result)
    if not losses:
        lines.append(f"Nowhere: splitkv (token pool) is at least as fast as every timed peer on all {len(rows)} "
                     "rows.")
    for f in losses:
        if f["splitkv_us"] is None:
            lines.append(f"- {f['row']} {f['case']}: splitkv has no time (see the refusals above); fastest "
                         f"{_name(f['fastest'])} {_us(f['us'])} µs.")
            continue
        floor = (f"; splitkv ÷ gather floor {f['splitkv_over_gather_floor']:.2f}"
                 if f["splitkv_over_gather_floor"] else "")
        lines.append(f"- {f['row']} {f['case']}: {_name(f['best_peer'])} {_us(f['best_peer_us'])} µs against "
                     f"splitkv's {_us(f['splitkv_us'])} µs (splitkv {f['splitkv_us'] / f['best_peer_us']:.2f}× "
                     f"its time{floor}).")
    return "\n".join(lines)


def provenance(result: dict) -> str:
    """One line: GPU, date, software, command."""
    libs = ", ".join(f"{k} {v}" for k, v in result.get("libraries", {}).items() if v)
    cmd = result.get("command") or "python -m splitkv.bench --peers flashinfer,sglang"
    return (f"Measured on {result['device']} ({result.get('num_sms', '?')} SMs), {result['date']}, torch "
            f"{result['torch']}, triton {result['triton']}" + (f", {libs}" if libs else "")
            + f"; {len(result['rows'])} rows; command: `{cmd}`.")


#: The markers in docs/benchmarks.md between which :func:`update_docs` writes the results.
DOCS_BEGIN = "<!-- peers-results:begin (written by python -m splitkv.bench.peers_sweep --report) -->"
DOCS_END = "<!-- peers-results:end -->"


def docs_block(result: dict, json_path: str) -> str:
    """The results block of the benchmarks page: provenance, the tables (the .md beside the JSON, included as a
    snippet from ``figures/``, as the page includes its other tables), the plot, who is fastest row by row and
    where splitkv is not."""
    stem = os.path.splitext(os.path.basename(json_path))[0]
    return "\n".join([
        DOCS_BEGIN, "", provenance(result) + f" Data: [`figures/{stem}.json`](figures/{stem}.json).", "",
        f'--8<-- "figures/{stem}.md"', "",
        f"![Each implementation's time ÷ splitkv's per row, {result['device']}](figures/{stem}.png)", "",
        fastest_markdown(result), "", DOCS_END])


def update_docs(docs_path: str, block: str) -> None:
    """Replace the text between :data:`DOCS_BEGIN` and :data:`DOCS_END` in ``docs_path`` by ``block``.

    Raises:
        ValueError: when the page lacks the markers.
    """
    with open(docs_path) as f:
        text = f.read()
    begin, end = text.find(DOCS_BEGIN), text.find(DOCS_END)
    if begin < 0 or end < begin:
        raise ValueError(f"{docs_path} has no {DOCS_BEGIN!r} ... {DOCS_END!r} block")
    with open(docs_path, "w") as f:
        f.write(text[:begin] + block + text[end + len(DOCS_END):])


def report(json_path: str, docs: Optional[str] = None, figures: Optional[str] = None) -> dict:
    """Regenerate a result's .md and plot from its JSON, print who is fastest and where splitkv is not, and
    with ``docs`` write the results block of that page (no GPU needed)."""
    with open(json_path) as f:
        result = json.load(f)
    _write(result, json_path, figures)
    print(provenance(result))
    print(fastest_markdown(result))
    if docs:
        if os.path.basename(os.path.dirname(os.path.abspath(json_path))) != "figures":
            print(f"warning: {json_path} is not in figures/: the page includes figures/ files", file=sys.stderr)
        update_docs(docs, docs_block(result, json_path))
        print("wrote the results block of", docs)
    return result


# ---- Wheels -------------------------------------------------------------------------------------------

#: What ``--fetch-wheels`` downloads: (requirement, wheel file pattern).
WHEELS = (
    (f"flashinfer-python=={cuda_peers.FLASHINFER_VERSION}", "flashinfer_python-*.whl"),
    (f"apache-tvm-ffi=={cuda_peers.TVM_FFI_VERSION}", "apache_tvm_ffi-*.whl"),
    ("sglang==0.5.10.post1", "sglang-*.whl"),
)
#: The GPU machines' platform: CPython 3.12 on manylinux x86-64.
WHEEL_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
                   "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")


def wheel_commands(folder: str = ".whl", python: str = sys.executable) -> List[List[str]]:
    """The ``pip download`` commands that put the peers' wheels (CPython 3.12, x86-64 Linux) into ``folder``."""
    plat = [a for p in WHEEL_PLATFORMS for a in ("--platform", p)]
    return [[python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
             "--implementation", "cp", *plat, "-d", folder, req] for req, _ in WHEELS]


def fetch_wheels(folder: str = ".whl") -> int:
    """Download the peers' wheels into ``folder`` (needs PyPI); returns pip's worst exit status."""
    worst = 0
    for cmd in wheel_commands(folder):
        print("+", " ".join(cmd), flush=True)
        worst = max(worst, subprocess.call(cmd))
    return worst


# ---- Command line -------------------------------------------------------------------------------------

def parser(prog: str = "python -m splitkv.bench.peers_sweep") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="peers:\n" + "".join(f"  {n:<16} {p.help}\n" for n, p in PEERS.items())
                                 + "groups: " + ", ".join(f"{g} ({', '.join(v)})" for g, v in PEER_GROUPS_HELP))
    ap.add_argument("--peers", default="all", metavar="LIST",
                    help="comma-separated peers or groups: flashinfer, sglang, all, or peer names (default: all)")
    ap.add_argument("--quick", action="store_true", help=f"the {len(QUICK_ROWS)} quick rows (about 90 s compiled)")
    ap.add_argument("--models", nargs="+", choices=list(GQA_MODELS) + [MLA_MODEL], metavar="MODEL",
                    help=f"rows of these models only, of {', '.join(GQA_MODELS + (MLA_MODEL,))}")
    ap.add_argument("--batches", nargs="+", type=int, metavar="N", help="rows of these batch sizes only")
    ap.add_argument("--prefixes", nargs="+", type=int, metavar="TOKENS", help="rows of these prefixes only")
    ap.add_argument("--out", default=None, metavar="PATH",
                    help="result JSON (default figures/peers_<gpu>.json, _quick / _custom for subsets); .md beside it")
    ap.add_argument("--figures", default=None, metavar="DIR", help="folder of the plot, '' for none (default: "
                    "the JSON's folder)")
    ap.add_argument("--rep-ms", type=float, default=25.0, metavar="MS", help="do_bench measuring time (default 25)")
    ap.add_argument("--eager", action="store_true", help="also time eager calls")
    ap.add_argument("--no-gather-floor", action="store_true", help="skip the gather-floor search (about 1 s a row)")
    ap.add_argument("--compile-only", action="store_true",
                    help="run each kernel configuration's probe (builds every kernel the rows use); time nothing")
    ap.add_argument("--list", action="store_true", help="print the rows and exit")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="merge result files of a run made in parts, write "
                    "its tables and plot (no GPU needed)")
    ap.add_argument("--fetch-wheels", nargs="?", const=".whl", default=None, metavar="DIR",
                    help="download the peers' wheels for the GPU machines (CPython 3.12, x86-64) into DIR "
                         "(default .whl) and exit")
    ap.add_argument("--no-prebuild", action="store_true",
                    help="with --compile-only: build FlashInfer's modules one by one on first use, not all at once")
    ap.add_argument("--jit-log", default=None, metavar="PATH", help="with --compile-only: ninja's output here")
    ap.add_argument("--install-jit", nargs="*", default=None, metavar="ARCHIVE",
                    help="unpack FlashInfer module archives (of --pack-jit) into FlashInfer's AOT folder, so that "
                         "those modules load without nvcc (missing files are passed over), and copy the modules "
                         "built in its JIT folder there too; then exit")
    ap.add_argument("--pack-jit", default=None, metavar="PATH",
                    help="write FlashInfer's built modules (JIT and AOT folders) to PATH (.tar.gz; parts of at "
                         "most --pack-max-mib each: PATH, then -2, -3 ...), copy the JIT-built ones into the AOT "
                         "folder (so they load without ninja), and exit")
    ap.add_argument("--pack-max-mib", type=float, default=15.0, metavar="MIB",
                    help="largest uncompressed part of --pack-jit (default 15: a file the GPU call brings back)")
    ap.add_argument("--report", default=None, metavar="JSON",
                    help="regenerate a result's .md and plot, print who is fastest per row and where splitkv is "
                         "not (no GPU needed); with --docs also the results block of that page")
    ap.add_argument("--docs", default=None, metavar="PAGE", help="with --report: the page to write (between the "
                    "peers-results markers), e.g. docs/benchmarks.md")
    return ap


PEER_GROUPS_HELP = [(g, v) for g, v in cuda_peers.PEER_GROUPS.items() if g != "all"]


def _rows(args) -> Tuple[List[Row], str]:
    if args.quick:
        rows = QUICK_ROWS
        rows = [r for r in rows if (args.models is None or r.model in args.models)]
        return rows, "quick"
    subset = any(x is not None for x in (args.models, args.batches, args.prefixes))
    return sweep_rows(args.models, args.batches, args.prefixes), "custom" if subset else ""


def _write(result: dict, out: str, figures: Optional[str]) -> None:
    with open(os.path.splitext(out)[0] + ".md", "w") as f:
        f.write(format_markdown(result) + "\n")
    print(format_table(result))
    folder = os.path.dirname(out) if figures is None else figures
    if folder or figures is None:
        from .plots import plot_peers

        stem = os.path.basename(os.path.splitext(out)[0])
        print("wrote", plot_peers(result, os.path.join(folder or ".", stem + ".png")))


def main(argv=None, prog: str = "python -m splitkv.bench.peers_sweep"):
    args = parser(prog).parse_args(argv)
    if args.fetch_wheels is not None:
        return fetch_wheels(args.fetch_wheels)
    if args.report:
        report(args.report, args.docs, args.figures)
        return 0
    if args.install_jit is not None:
        names = []
        for archive in args.install_jit:
            if os.path.isfile(archive):
                try:
                    import tvm_ffi

                    def verify(path):
                        cuda_peers.check_driver_link(path)
                        tvm_ffi.load_module(path)
                except ImportError:
                    verify = cuda_peers.check_driver_link
                names += cuda_peers.install_jit_cache(archive, verify=verify)
        from flashinfer.jit import env

        adopted = cuda_peers.adopt_jit_builds(str(env.FLASHINFER_JIT_DIR), str(env.FLASHINFER_AOT_DIR))
        print(f"installed {len(names)} prebuilt FlashInfer modules" + (f": {', '.join(names)}" if names else "")
              + (f"; {len(adopted)} built here before: {', '.join(adopted)}" if adopted else ""))
        return 0
    if args.pack_jit:
        from flashinfer.jit import env

        cuda_peers.adopt_jit_builds(str(env.FLASHINFER_JIT_DIR), str(env.FLASHINFER_AOT_DIR))  # load without ninja
        parts = cuda_peers.pack_jit_cache(args.pack_jit, str(env.FLASHINFER_JIT_DIR), str(env.FLASHINFER_AOT_DIR),
                                          max_bytes=int(args.pack_max_mib * 2**20))
        for path, names in parts:
            print(f"{path}: {os.path.getsize(path) / 2**20:.1f} MiB, {len(names)} modules ({', '.join(names)})")
        if not parts:
            print("no built FlashInfer module to pack")
        return 0
    if args.merge:
        parts = []
        for path in args.merge:
            with open(path) as f:
                parts.append(json.load(f))
        result = merge_results(parts)
        from .timing import gpu_tag

        out = args.out or os.path.join("figures", f"peers_{gpu_tag(result['device'])}.json")
        _save(result, out)
        print(f"merged {len(parts)} runs ({len(result['rows'])} rows) into {out}")
        _write(result, out, args.figures)
        return 0
    try:
        peers = cuda_peers.resolve_peers(args.peers)
    except ValueError as err:
        sys.exit(str(err))
    rows, variant = _rows(args)
    if args.list:
        for r in rows:
            print(f"{r.label():<28} {r.case()}")
        print(f"{len(rows)} rows")
        return 0
    if not torch.cuda.is_available():
        sys.exit("the peers benchmark needs a CUDA GPU (--list, --merge and --fetch-wheels do not)")
    if args.compile_only:
        t0 = time.perf_counter()
        compile_only(rows, peers, own=True, parallel=not args.no_prebuild, log_path=args.jit_log)
        print(f"compiled in {time.perf_counter() - t0:.0f} s")
        return 0
    from .timing import Timer, gpu_tag

    out = args.out or os.path.join("figures", f"peers_{gpu_tag(torch.cuda.get_device_name())}"
                                   f"{'_' + variant if variant else ''}.json")
    print(f"{torch.cuda.get_device_name()}: {len(rows)} rows, peers {', '.join(peers) or 'none'}; writing {out}",
          flush=True)
    result = run_sweep(rows, peers, out_path=out, timer=Timer(rep_ms=args.rep_ms), eager=args.eager,
                       quick=args.quick, gather_floor=not args.no_gather_floor,
                       command=" ".join([prog] + list(sys.argv[1:] if argv is None else argv)))
    _write(result, out, args.figures)
    print(f"total {result['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
