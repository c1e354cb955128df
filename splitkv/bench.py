"""Benchmark: verify attention against every peer and two floors (needs a CUDA GPU).

    python -m splitkv.bench                 # the full sweep, ~9 minutes on an H200
    python -m splitkv.bench --quick         # a 4-row smoke run, < 1 minute
    python -m splitkv.bench --models llama3-8b --batches 8 --prefixes 16384

For each shape (a labelled model's heads x batch x prefix, 4 draft tokens,
random ``kv_indices``), once with a bf16 KV pool and once with an fp8 (e4m3)
pool, every implementation is replayed from a CUDA graph and timed with
``triton.testing.do_bench`` (median, L2 flushed between runs). Each row has
two floors:

* ``floor_us``: the prefix K/V bytes over the HBM read bandwidth measured in
  the same run (``x.sum()`` over 2 GiB, contiguous);
* ``gather_floor_us``: the best time of a bare Triton kernel that only gathers
  and sums the same K/V rows through the same ``kv_indices``
  (:mod:`splitkv.floor`), over a small grid of launch settings.

Implementations:

* ``splitkv``  -- this package's drop-in (GQA-packed split-KV, adaptive splits);
* ``splitkv_invariant`` -- the same with ``split_tokens=1024`` (and
  ``max_prefix_len`` the row's prefix): fixed-size splits, so a sequence's
  output does not depend on its batch;
* ``seed``     -- the seed's layout: one program per query head, fixed 4/8/16
  splits by prefix length, 32-key tiles, no pipelining (same kernels, other
  launch parameters);
* ``extend``   -- the baseline prefill kernel :func:`splitkv.extend_attention_fwd`;
* ``flex``     -- ``torch.compile(flex_attention)`` (its decode path) with a
  block mask, on a dense copy of each sequence's KV (the copy is not timed);
* ``sdpa``     -- ``torch.nn.functional.scaled_dot_product_attention`` with a
  boolean mask, on the same dense copy.

fp8 rows run ``splitkv``, ``splitkv_invariant`` and ``extend`` (the others
have no fp8 pool). Every implementation is timed as CUDA-graph replays and
as eager calls (``do_bench``, launches back to back).

``host_us`` is the time one eager call holds the calling thread, in the
regime a serving engine runs in: the host enqueues call after call while the
GPU works. Calls go back to back in bursts of 20 (then one untimed
synchronisation, so the launch queue never fills and never blocks a call),
each call timed alone; a *round* is the median over 1000 calls. Timing each
call after a synchronisation instead (the GPU idle as it starts) measured
the host waking up from the wait as well: on the H200's virtual machine
that added tens of µs (up to 75) at rows whose calls keep the GPU busy for
a millisecond or more (2026-12-01).

That machine's 16 virtual CPUs do not run at one speed: at the same moment
a fixed pure-Python workload (:func:`cpu_reference_us`) takes about 25 µs
on some and 45 µs on others, and a drop-in call's host time follows it
(25-29 µs against 38-49 µs; no steal time was counted). Before each round
the timing thread is therefore pinned to the fastest CPU at that moment
(:func:`fastest_cpu`), and the row records that CPU's reference time and
the slowest CPU's (``host_cpus``): ``host_us`` is the code's cost on the
fastest CPU the machine offered then, and a call on a slow one costs about
``slowest_ref_us / ref_us`` times more. Each implementation gets one round
in its turn and more at the end of the row, and ``host_us`` is the fastest
round (every round is kept in ``host_rounds_us``).

Results go to ``figures/benchmark_<gpu>.json`` (device, versions, date, every
row; written after every row) and ``.md``, and plots into ``figures/`` (see
:mod:`splitkv.plots`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .api import verify_splitkv_fwd
from .extend import extend_attention_fwd
from .floor import search_gather_floor
from .kernel import TileConfig
from .runner import VerifySplitKV
from .testing.graphs import capture_graph
from .testing.problem import MODEL_SHAPES, VerifyProblem, make_problem
from .testing.reference import relative_error

__all__ = [
    "BENCH_BATCHES",
    "BENCH_PREFIXES",
    "IMPLEMENTATIONS",
    "KV_DTYPES",
    "Timer",
    "cpu_reference_us",
    "fastest_cpu",
    "run_benchmark",
    "bench_row",
    "format_table",
    "format_markdown",
    "gpu_tag",
    "plan_run",
    "main",
]

#: Batch sizes of the sweep.
BENCH_BATCHES = (1, 8, 32)
#: Prefix lengths of the sweep (tokens per sequence).
BENCH_PREFIXES = (1024, 4096, 16384, 65536)
#: The ``--quick`` smoke run: (models, batches, prefixes), with both pools.
QUICK = (("llama3-8b",), (1, 8), (4096,))
#: The implementations timed, in table order.
IMPLEMENTATIONS = ("splitkv", "splitkv_invariant", "seed", "extend", "flex", "sdpa")
#: One line per implementation (``--help``, the JSON record).
IMPL_HELP = {
    "splitkv": "this package's drop-in verify_splitkv_fwd (GQA-packed split-KV, adaptive splits)",
    "splitkv_invariant": "the same with split_tokens=1024 (fixed-size splits: batch-invariant output)",
    "seed": "the seed's layout on the same kernels: a program per query head, 4/8/16 splits, 32-key tiles",
    "extend": "the baseline prefill kernel extend_attention_fwd (one program per query tile and head)",
    "flex": "torch.compile(flex_attention) with a block mask, on a dense K/V copy (copy not timed)",
    "sdpa": "torch scaled_dot_product_attention with a boolean mask, on the same dense copy",
}
#: KV-pool dtypes: every shape runs once per pool.
KV_DTYPES = ("bfloat16", "float8_e4m3fn")
#: The implementations that read an fp8 pool.
FP8_IMPLEMENTATIONS = ("splitkv", "splitkv_invariant", "extend")
#: fp8 rows' dequantisation scales (Python floats): pool = bf16 pool / scale.
FP8_K_SCALE, FP8_V_SCALE = 0.5, 2.0
#: ``split_tokens`` of the batch-invariant implementation.
INVARIANT_SPLIT_TOKENS = 1024
#: Implementations also timed eagerly with do_bench (every one).
EAGER_IMPLS = IMPLEMENTATIONS
#: Implementations whose host time per eager call is measured.
HOST_IMPLS = ("splitkv", "extend", "flex", "sdpa")
#: Peers' host time is measured only where a call's graph time is below this
#: (µs): above it 1000 calls cost seconds and time the GPU, not the host.
HOST_MAX_GRAPH_US = 500.0
#: FlexAttention's Triton template failed to compile (32-bit offsets) with a
#: dense K of 2^31 elements or more (llama3-8b and qwen3-32b, bs 32 x 64k, in
#: the 2026-11-30 H200 run): such shapes are skipped for flex.
FLEX_MAX_ELEMENTS = 2**31
#: Draft tokens per sequence (a causal chain).
DRAFT_TOKENS = 4
#: Skip shapes whose pool would exceed this many bytes (KV + dense copies).
MEMORY_BUDGET = 60 * 2**30


def seed_n_splits(prefix_len: int) -> int:
    """The seed's split rule: 4 below 4k tokens, 8 below 8k, else 16."""
    return 4 if prefix_len < 4096 else 8 if prefix_len < 8192 else 16


def gpu_tag(device_name: str) -> str:
    """A short file tag for a GPU: ``"NVIDIA H200"`` -> ``"h200"``.

    The first word with a digit, lower case, after dropping vendor words
    (``"NVIDIA H100 80GB HBM3"`` -> ``"h100"``, ``"NVIDIA A100-SXM4-80GB"`` ->
    ``"a100"``); ``RTX``/``GTX`` keep their model number
    (``"NVIDIA GeForce RTX 4090"`` -> ``"rtx4090"``).
    """
    vendor = {"nvidia", "geforce", "tesla", "quadro", "amd", "radeon", "instinct", "intel"}
    words = [w for w in re.findall(r"[a-z0-9]+", device_name.lower()) if w not in vendor]
    for i, word in enumerate(words):
        if word in ("rtx", "gtx") and i + 1 < len(words):
            return word + words[i + 1]
        if any(c.isdigit() for c in word):
            return word
    return "-".join(words) or "gpu"


def default_out_path(tag: str, variant: str = "") -> str:
    """``figures/benchmark_<tag>[_<variant>].json``."""
    return os.path.join("figures", f"benchmark_{tag}{'_' + variant if variant else ''}.json")


def measure_read_bandwidth(gib: float = 2.0) -> float:
    """HBM read bandwidth in bytes/s: ``x.sum()`` over ``gib`` GiB of bf16."""
    import triton.testing

    x = torch.randn(int(gib * 2**30) // 2, dtype=torch.bfloat16, device="cuda")
    ms = triton.testing.do_bench(lambda: x.sum(), return_mode="median")
    return x.numel() * 2 / (ms * 1e-3)


def fp8_problem(p: VerifyProblem, k_scale: float = FP8_K_SCALE, v_scale: float = FP8_V_SCALE) -> VerifyProblem:
    """The same problem with an fp8 (e4m3) pool: ``pool / scale``, dequantised by ``scale``.

    Queries, draft K/V and outputs stay in ``p``'s dtype. The dequantised pool
    approximates ``p``'s, so the fp8 output is comparable with the bf16 one.
    (Cast on the device: drawing a second pool on the host would double the
    sweep's set-up time.)
    """
    fp8 = torch.float8_e4m3fn
    return p.replace(
        k_buffer=(p.k_buffer / k_scale).to(fp8),
        v_buffer=(p.v_buffer / v_scale).to(fp8),
        k_scale=float(k_scale),
        v_scale=float(v_scale),
    )


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


def skip_reason(name: str, p: VerifyProblem) -> Optional[str]:
    """Why implementation ``name`` is not run on ``p`` (``None``: it is)."""
    if name == "flex":
        dense = p.batch_size * p.num_kv_heads * (p.prefix_lens[0] + p.extend_lens[0]) * p.head_dim
        if dense >= FLEX_MAX_ELEMENTS:
            return (f"dense K of {dense / 2**30:.1f} Gi elements: flex's Triton template failed to compile "
                    "at >= 2^31 (32-bit offsets) in the 2026-11-30 H200 run")
    return None


def make_impl(name: str, p: VerifyProblem, out: torch.Tensor, dense: Optional[dict] = None) -> Callable:
    """A zero-argument callable running implementation ``name``, writing ``out``.

    The drop-in implementations return ``verify_splitkv_fwd``'s result
    (``False``: declined, nothing written); the others return ``None``.
    ``dense`` caches the dense K/V copy that ``flex`` and ``sdpa`` share.
    """
    args, kw = p.args(out), p.kwargs()
    if name == "splitkv":
        return lambda: verify_splitkv_fwd(*args, **kw, max_bs=p.batch_size)
    if name == "splitkv_invariant":
        return lambda: verify_splitkv_fwd(*args, **kw, max_bs=p.batch_size, split_tokens=INVARIANT_SPLIT_TOKENS,
                                          max_prefix_len=max(p.prefix_lens))
    if name == "seed":
        seed = VerifySplitKV(
            p.num_q_heads, p.num_kv_heads, p.head_dim, p.v_head_dim, p.max_len_extend,
            p.batch_size, out.device, pack_gqa=False, n_splits=seed_n_splits(p.prefix_lens[0]),
            config=TileConfig(16, 32, 4, 1),
        )
        return lambda: seed(*args[:9], sm_scale=p.sm_scale)
    if name == "extend":
        return lambda: extend_attention_fwd(*args, **kw)
    if name not in ("flex", "sdpa"):
        raise ValueError(f"unknown implementation {name!r}")
    # The dense peers: [B, H, S, D] views of a dense copy of each sequence's KV.
    dense = {} if dense is None else dense
    if "kv" not in dense:
        dense["kv"] = _dense_kv(p)
    k, v = dense["kv"]
    bs, n_pre, n_ext = p.batch_size, p.prefix_lens[0], p.extend_lens[0]
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


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Timer:
    """How the benchmark times a zero-argument callable (µs).

    Args:
        warmup_ms: ``do_bench`` warm-up time per timing.
        rep_ms: ``do_bench`` measuring time per timing (caps the GPU time a
            timing costs: about ``warmup_ms + rep_ms`` plus 6 calls).
        host_calls: eager calls per host-time round (:meth:`host`).
        host_rounds: host-time rounds per implementation and row (see the module docstring).
        host_burst: calls launched back to back between synchronisations in a round.
        host_pin: pin the timing thread to :func:`fastest_cpu` for each round.
    """

    def __init__(self, warmup_ms: float = 5.0, rep_ms: float = 25.0, host_calls: int = 1000,
                 host_rounds: int = 3, host_burst: int = 20, host_pin: bool = True):
        if host_calls < 1 or host_rounds < 1 or host_burst < 1:
            raise ValueError(f"need host_calls, host_rounds and host_burst >= 1, got {host_calls}, "
                             f"{host_rounds} and {host_burst}")
        self.warmup_ms, self.rep_ms = warmup_ms, rep_ms
        self.host_calls, self.host_rounds, self.host_burst, self.host_pin = host_calls, host_rounds, host_burst, host_pin
        #: :func:`fastest_cpu`'s pick for the last host round (``None``: not pinned)
        self.last_host_cpu: Optional[dict] = None

    def _bench(self, fn) -> float:
        import triton.testing

        return 1e3 * triton.testing.do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median")

    def eager(self, fn: Callable) -> float:
        """Median µs of eager calls (``do_bench``: launches back to back, L2 flushed)."""
        fn()
        _sync()
        return self._bench(fn)

    def graph(self, fn: Callable) -> float:
        """Median µs of replays of a CUDA graph holding one call of ``fn``."""
        fn()  # compile / warm up
        _sync()
        graph = capture_graph(fn)
        try:
            return self._bench(graph.replay)
        finally:
            _sync()
            del graph

    def host(self, fn: Callable) -> float:
        """One host-time round: µs one eager call holds the calling thread, the median over ``host_calls`` calls.

        Calls run back to back in bursts of ``host_burst``, each burst followed
        by an untimed synchronisation; every call is timed alone, from its
        start to its return. With ``host_pin``, the thread runs pinned to
        :func:`fastest_cpu` (its pick is left in ``last_host_cpu``). The
        median shrugs off calls that the host interrupted.
        """
        fn()
        _sync()
        pick = fastest_cpu() if self.host_pin else None
        allowed = os.sched_getaffinity(0) if pick else None
        times: List[float] = []
        try:
            if pick:
                os.sched_setaffinity(0, {pick["cpu"]})
            while len(times) < self.host_calls:
                for _ in range(min(self.host_burst, self.host_calls - len(times))):
                    start = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - start)
                _sync()
        finally:
            if pick:
                os.sched_setaffinity(0, allowed)
        self.last_host_cpu = pick
        return statistics.median(times) * 1e6


def cpu_reference_us(calls: int = 30) -> float:
    """µs of a fixed pure-Python workload (``sum(range(2000))``) on the calling thread, median of ``calls``:
    how fast the CPU it runs on is right now (the drop-in's host path is pure Python plus a launch)."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        sum(range(2000))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def fastest_cpu() -> Optional[dict]:
    """The CPU, among those this thread may run on, where :func:`cpu_reference_us` is fastest now.

    Returns ``{"cpu", "ref_us", "slowest_ref_us"}`` (the pick, its reference
    time, the slowest CPU's), or ``None`` where threads cannot be pinned (not
    Linux). The thread's CPU set is left as it was.
    """
    if not hasattr(os, "sched_setaffinity"):
        return None
    allowed = os.sched_getaffinity(0)
    refs = {}
    try:
        for cpu in sorted(allowed):
            os.sched_setaffinity(0, {cpu})
            refs[cpu] = cpu_reference_us()
    finally:
        os.sched_setaffinity(0, allowed)
    cpu = min(refs, key=refs.get)
    return dict(cpu=cpu, ref_us=round(refs[cpu], 2), slowest_ref_us=round(max(refs.values()), 2))


def _host_round(timer: Timer, fn: Callable, rec: dict) -> None:
    """One more host-time round into ``rec`` (with the timer's CPU pick, where it pinned); ``host_us``: the fastest."""
    rec.setdefault("host_rounds_us", []).append(timer.host(fn))
    if timer.last_host_cpu:
        rec.setdefault("host_cpus", []).append(timer.last_host_cpu)
    rec["host_us"] = min(rec["host_rounds_us"])


def _err(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"[:300]


def _declined_message(p: VerifyProblem, out: torch.Tensor) -> str:
    try:
        from .gate import decline_reason

        t = p.tensors(out)
        reason = decline_reason(*t[:3], *t[4:], **p.options(), o_extend=out)
    except Exception:  # the gate's signature is not this module's business
        reason = None
    return f"verify_splitkv_fwd declined the call (returned False){': ' + reason if reason else ''}"


def _ratio(a, b) -> Optional[float]:
    return a / b if a and b else None


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
    bf16_row: Optional[dict] = None,
    bf16_out: Optional[torch.Tensor] = None,
) -> Tuple[dict, Dict[str, torch.Tensor]]:
    """Time ``impls`` and the gather floor on one problem; returns (row, outputs).

    Args:
        p: the problem (its pool dtype is the row's ``kv_dtype``).
        shape: ``{"model", "batch", "prefix"}``.
        impls: implementations to run, in order (``splitkv`` first for the ratios).
        timer: the :class:`Timer`.
        bandwidth: measured read bandwidth, bytes/s (for ``floor_us``).
        eager_impls: also timed eagerly with ``do_bench``.
        host_impls: host time per eager call measured (``splitkv`` always, the
            others where their graph time is at most :data:`HOST_MAX_GRAPH_US`),
            one round in their turn and ``timer.host_rounds - 1`` more at the end of the row.
        gather_floor: run the gather-floor search.
        bf16_row: for an fp8 row, the bf16 row of the same shape (``fp8_over_bf16``).
        bf16_out: for an fp8 row, the bf16 splitkv output (``rel_diff_vs_bf16``).

    Returns:
        The row record and each implementation's output.
    """
    t_row = time.perf_counter()
    kv_dtype = str(p.k_buffer.dtype).replace("torch.", "")
    row = dict(shape, kv_dtype=kv_dtype, k_scale=p.k_scale, v_scale=p.v_scale,
               kv_bytes=p.kv_bytes, floor_us=p.kv_bytes / bandwidth * 1e6, impls={})
    outs, dense = {}, {}
    host_fns = {}  # implementations with a host time: more rounds at the end of the row
    for name in impls:
        rec: dict = {}
        row["impls"][name] = rec
        reason = skip_reason(name, p)
        if reason:
            rec["skipped"] = reason
            continue
        out = p.new_output()
        try:
            fn = make_impl(name, p, out, dense)
            if fn() is False:
                raise RuntimeError(_declined_message(p, out))
        except Exception as err:  # a peer that cannot run here is reported, not fatal
            rec["graph"] = None
            rec["error"] = _err(err)
            continue
        modes = ("eager", "graph") if name in eager_impls else ("graph",)
        for mode in modes:
            try:
                rec[mode] = getattr(timer, mode)(fn)
            except Exception as err:
                rec[mode] = None
                rec[f"{mode}_error"] = _err(err)
        graph_us = rec.get("graph")
        if name in host_impls:
            if name == "splitkv" or (graph_us and graph_us <= HOST_MAX_GRAPH_US):
                try:
                    _host_round(timer, fn, rec)
                    host_fns[name] = fn
                except Exception as err:
                    rec["host_us"] = None
                    rec["host_error"] = _err(err)
            else:
                rec["host_us"] = None
                rec["host_skipped"] = (f"graph time {graph_us:.0f} us > {HOST_MAX_GRAPH_US:.0f} us: device-bound"
                                       if graph_us else "no graph time")
        best = best_time(rec)
        if best:
            rec["gbps"] = p.kv_bytes / (best * 1e-6) / 1e9
            rec["pct_bw"] = 100 * p.kv_bytes / (best * 1e-6) / bandwidth
            outs[name] = out
        fn = None  # drop the closure (flex/sdpa hold the dense K/V copy; host_fns keeps it for small shapes)
    if "splitkv" in outs:
        for name, out in outs.items():
            row["impls"][name]["rel_diff_vs_splitkv"] = relative_error(out, outs["splitkv"])
        if bf16_out is not None:
            row["impls"]["splitkv"]["rel_diff_vs_bf16"] = relative_error(outs["splitkv"], bf16_out)
    dense.clear()

    if gather_floor:
        found = search_gather_floor(p.k_buffer, p.v_buffer, p.kv_indices, timer.graph)
        row["gather_floor_us"] = found["us"]
        row["gather_floor_config"] = found["config"]
        row["gather_floor_trials"] = found["trials"]
        if found["errors"]:
            row["gather_floor_errors"] = found["errors"]
    for _ in range(getattr(timer, "host_rounds", 1) - 1):
        for name, fn in host_fns.items():
            _host_round(timer, fn, row["impls"][name])
    host_fns.clear()
    ours = row["impls"].get("splitkv", {}).get("graph")
    row["splitkv_over_floor"] = _ratio(ours, row["floor_us"])
    row["splitkv_over_gather_floor"] = _ratio(ours, row.get("gather_floor_us"))
    row["invariant_over_splitkv"] = _ratio(row["impls"].get("splitkv_invariant", {}).get("graph"), ours)
    if bf16_row is not None:
        row["fp8_over_bf16"] = _ratio(ours, bf16_row["impls"].get("splitkv", {}).get("graph"))
    row["elapsed_s"] = time.perf_counter() - t_row
    return row, outs


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


def _row_line(i: int, n: int, row: dict, total_s: float) -> str:
    ours = row["impls"].get("splitkv", {})
    g = ours.get("graph")
    text = f"[{i:>2}/{n}] {_shape(row):<22} {_dtype_label(row):>4}: splitkv "
    text += f"{g:8.1f} us" if g else "  failed  "
    for key, label in (("splitkv_over_floor", "floor"), ("splitkv_over_gather_floor", "gather floor")):
        if row.get(key):
            text += f", {row[key]:.2f}x {label}"
    return text + f"; row {row['elapsed_s'] + row.get('setup_s', 0):.1f} s, total {total_s:.0f} s"


def run_benchmark(models=tuple(MODEL_SHAPES), batches=BENCH_BATCHES, prefixes=BENCH_PREFIXES,
                  impls=IMPLEMENTATIONS, kv_dtypes=KV_DTYPES, progress=True, out_path=None,
                  timer: Optional[Timer] = None, gather_floor: bool = True) -> dict:
    """Time every implementation on every shape and pool; return the result record.

    With ``out_path`` the record is also written there after every row.
    """
    import triton

    timer = timer or Timer()
    start = time.perf_counter()
    bandwidth = measure_read_bandwidth()
    shapes = bench_shapes(models, batches, prefixes)
    rows: List[dict] = []
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
                    host_max_graph_us=HOST_MAX_GRAPH_US, eager_impls=list(EAGER_IMPLS)),
        elapsed_s=0.0,
        rows=rows,
    )
    n_rows = len(shapes) * len(kv_dtypes)

    def done(row):
        rows.append(row)
        result["elapsed_s"] = time.perf_counter() - start
        if progress:
            print(_row_line(len(rows), n_rows, row, result["elapsed_s"]), flush=True)
        if out_path:
            with open(out_path, "w") as f:
                json.dump(result, f, indent=1)

    for shape in shapes:
        s = MODEL_SHAPES[shape["model"]]
        t_setup = time.perf_counter()
        p = make_problem(
            [shape["prefix"]] * shape["batch"], DRAFT_TOKENS, s.num_q_heads, s.num_kv_heads,
            s.head_dim, dtype=torch.bfloat16, device="cuda", pool_factor=1.25, seed=0,
        )
        setup_s = time.perf_counter() - t_setup
        bf16_row, bf16_out = None, None
        if "bfloat16" in kv_dtypes:
            row, outs = bench_row(p, shape, impls, timer, bandwidth, gather_floor=gather_floor)
            row["setup_s"] = setup_s
            bf16_row, bf16_out = row, outs.get("splitkv")
            done(row)
            del outs
        if "float8_e4m3fn" in kv_dtypes:
            t_setup = time.perf_counter()
            q = fp8_problem(p)
            fp8_setup_s = time.perf_counter() - t_setup
            row, outs = bench_row(q, shape, [i for i in impls if i in FP8_IMPLEMENTATIONS], timer, bandwidth,
                                  gather_floor=gather_floor, bf16_row=bf16_row, bf16_out=bf16_out)
            row["setup_s"] = fp8_setup_s if bf16_row else setup_s + fp8_setup_s
            done(row)
            del q, outs
        del p, bf16_out
        torch.cuda.empty_cache()
    result["elapsed_s"] = time.perf_counter() - start
    if out_path:
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)
    return result


def best_time(rec: dict) -> Optional[float]:
    """The better of an implementation's eager and graph times (µs), if any."""
    times = [t for t in (rec.get("eager"), rec.get("graph")) if t]
    return min(times) if times else None


# ---- Tables -------------------------------------------------------------------------------------

#: Column labels of the implementations in the tables.
_LABEL = {"splitkv": "splitkv", "splitkv_invariant": "invariant", "seed": "seed", "extend": "extend",
          "flex": "flex", "sdpa": "sdpa"}


def _shape(r: dict) -> str:
    """The row's label; ``†`` marks a row carried over from another run (``carried_from``, see the footer)."""
    prefix = r["prefix"]
    label = f"{r['model']} bs{r['batch']} {prefix // 1024 if prefix % 1024 == 0 else prefix / 1024:g}k"
    return label + " †" if r.get("carried_from") else label


def _dtype_label(r: dict) -> str:
    return "fp8" if r.get("kv_dtype", "bfloat16").startswith("float8") else "bf16"


def _us(x) -> str:
    return "–" if not x else f"{x:.1f}" if x < 1000 else f"{x:.0f}"


def _x(x) -> str:
    return "–" if not x else f"{x:.2f}"


def _graph(r: dict, name: str) -> Optional[float]:
    return r["impls"].get(name, {}).get("graph")


def _failed(rec: dict, key: str) -> bool:
    return bool(rec.get("error") or rec.get(f"{key}_error"))


def _time_cell(r: dict, name: str, key: str = "graph") -> str:
    """µs of one implementation, or ``fail`` / ``skip`` / ``–`` (not run)."""
    rec = r["impls"].get(name)
    if rec is None:
        return "–"
    if rec.get("skipped"):
        return "skip"
    if rec.get(key):
        return _us(rec[key])
    return "fail" if _failed(rec, key) else "–"


def _host_method(timing: dict) -> str:
    """How ``host_us`` was measured, from the result's ``timing`` (older results: back-to-back batches)."""
    calls, batches = timing.get("host_calls", 1000), timing.get("host_batches", 1)
    if "host_burst" in timing:
        return (f"calls back to back in bursts of {timing['host_burst']} (synchronised between bursts, untimed), "
                f"each call timed alone, the median over {calls} calls per round"
                + (", the thread pinned to the fastest CPU at the time" if timing.get("host_pin") else "")
                + f", the fastest of {timing['host_rounds']} rounds (one in the implementation's turn, the rest at "
                "the end of the row)")
    if "host_rounds" in timing:
        return (f"each call timed alone with the GPU idle as it starts, the median over {calls} calls per round, "
                f"the fastest of {timing['host_rounds']} rounds (one in the implementation's turn, the rest at "
                "the end of the row)")
    if batches == 1:
        return f"mean over {calls} back-to-back calls, synchronised before and after only"
    return (f"median over {batches} batches of the mean of {calls // batches} back-to-back calls "
            "(synchronised before and after each batch only)")


def _host_cell(r: dict, name: str) -> str:
    rec = r["impls"].get(name)
    if rec is None:
        return "–"
    if rec.get("host_us"):
        return _us(rec["host_us"])
    if rec.get("skipped") or rec.get("host_skipped"):
        return "skip"
    return "fail" if (rec.get("error") or rec.get("host_error")) else "–"


def _slowest_round_cell(r: dict) -> str:
    """splitkv's slowest host-time round (older results kept one measurement: ``–``)."""
    rounds = r["impls"].get("splitkv", {}).get("host_rounds_us")
    return _us(max(rounds)) if rounds else "–"


def _cpu_ref_cell(r: dict) -> str:
    """For splitkv's fastest host round: the reference workload's µs on the CPU it ran on / on the slowest CPU
    (:func:`fastest_cpu`); ``–`` for unpinned results."""
    rec = r["impls"].get("splitkv", {})
    rounds, cpus = rec.get("host_rounds_us"), rec.get("host_cpus")
    if not rounds or not cpus or len(cpus) != len(rounds):
        return "–"
    pick = cpus[rounds.index(min(rounds))]
    return f"{pick['ref_us']:.0f} / {pick['slowest_ref_us']:.0f}"


def _speedup_cell(r: dict, name: str) -> str:
    """Peer graph time / splitkv graph time; ``fail`` / ``skip`` where the peer has none."""
    ours = r["impls"].get("splitkv", {}).get("graph")
    cell = _time_cell(r, name)
    if cell in ("fail", "skip", "–"):
        return cell
    return _x(_ratio(r["impls"][name]["graph"], ours))


def _tables(result: dict) -> List[Tuple[str, List[str], List[List[str]]]]:
    """The report as (title, header, rows) tables, at most 9 columns each."""
    rows = result["rows"]
    bf16 = [r for r in rows if _dtype_label(r) == "bf16"]
    fp8 = [r for r in rows if _dtype_label(r) == "fp8"]
    present = [n for n in IMPLEMENTATIONS if any(n in r["impls"] for r in rows)]
    peers = [n for n in present if n not in ("splitkv", "splitkv_invariant")]
    has_inv = "splitkv_invariant" in present
    tables = []
    if bf16:
        tables.append((
            "Time per call, µs (median of CUDA-graph replays), bf16 KV pool",
            ["shape", "floor", "gather floor"] + [_LABEL[n] for n in present],
            [[_shape(r), _us(r.get("floor_us")), _us(r.get("gather_floor_us"))]
             + [_time_cell(r, n) for n in present] for r in bf16],
        ))
        tables.append((
            "Ratios, bf16 KV pool (graph replays): splitkv ÷ each floor, batch-invariant ÷ adaptive splitkv, "
            "speedup vs each peer (peer ÷ splitkv)",
            ["shape", "÷ floor", "÷ gather floor"] + (["invariant ÷ splitkv"] if has_inv else [])
            + [f"vs {_LABEL[n]}" for n in peers],
            [[_shape(r), _x(r.get("splitkv_over_floor") or _ratio(_graph(r, "splitkv"), r.get("floor_us"))),
              _x(r.get("splitkv_over_gather_floor"))]
             + ([_x(r.get("invariant_over_splitkv"))] if has_inv else [])
             + [_speedup_cell(r, n) for n in peers] for r in bf16],
        ))
        eager = [n for n in present if any(r["impls"].get(n, {}).get("eager") for r in bf16)]
        if eager:
            tables.append((
                "Eager calls, bf16 KV pool, µs per call (do_bench, launches back to back)",
                ["shape"] + [_LABEL[n] for n in eager],
                [[_shape(r)] + [_time_cell(r, n, "eager") for n in eager] for r in bf16],
            ))
        host = [n for n in HOST_IMPLS if n in present]
        if any(r["impls"].get(n, {}).get("host_us") for r in bf16 for n in host):
            pinned = any(r["impls"].get("splitkv", {}).get("host_cpus") for r in bf16)
            tables.append((
                "Host time per eager call, bf16 KV pool, µs: the time a call holds the calling thread "
                "(fastest round; splitkv's slowest round beside it"
                + ("; CPU ref: the reference workload's µs on the CPU of splitkv's fastest round / on the "
                   "slowest CPU then" if pinned else "") + ")",
                ["shape", "splitkv", "splitkv, slowest round"] + (["CPU ref"] if pinned else [])
                + [_LABEL[n] for n in host if n != "splitkv"],
                [[_shape(r), _host_cell(r, "splitkv"), _slowest_round_cell(r)]
                 + ([_cpu_ref_cell(r)] if pinned else [])
                 + [_host_cell(r, n) for n in host if n != "splitkv"] for r in bf16],
            ))
    if fp8:
        scales = result.get("fp8_scales", {})
        fp8_impls = [n for n in FP8_IMPLEMENTATIONS if any(n in r["impls"] for r in fp8)]
        tables.append((
            f"fp8 KV pool (e4m3, k_scale {scales.get('k_scale', FP8_K_SCALE)}, "
            f"v_scale {scales.get('v_scale', FP8_V_SCALE)}; bf16 queries and output): µs (graph replays), ratios",
            ["shape", "floor", "gather floor"] + [_LABEL[n] for n in fp8_impls]
            + ["÷ gather floor", "fp8 ÷ bf16"] + (["vs extend"] if "extend" in fp8_impls else []),
            [[_shape(r), _us(r.get("floor_us")), _us(r.get("gather_floor_us"))]
             + [_time_cell(r, n) for n in fp8_impls]
             + [_x(r.get("splitkv_over_gather_floor")), _x(r.get("fp8_over_bf16"))]
             + ([_speedup_cell(r, "extend")] if "extend" in fp8_impls else []) for r in fp8],
        ))
    return tables


def _problems(result: dict) -> List[str]:
    """One line per distinct failure or skip reason, with where it happened."""
    seen: Dict[Tuple[str, str, str], List[str]] = {}
    for r in result["rows"]:
        where = f"{_shape(r)} {_dtype_label(r)}"
        for name, rec in r["impls"].items():
            for key, value in rec.items():
                if value and (key == "error" or key.endswith("_error") or key == "skipped"):
                    kind = "skipped" if key == "skipped" else "failed"
                    what = f"{name}" if key in ("error", "skipped") else f"{name} ({key[:-6]})"
                    seen.setdefault((kind, what, str(value).splitlines()[0][:160]), []).append(where)
        if r.get("gather_floor_us") is None and "gather_floor_config" in r:
            seen.setdefault(("failed", "gather floor", "every launch setting failed"), []).append(where)
    return [f"{what} {kind} at {', '.join(places)}: {reason}" for (kind, what, reason), places in seen.items()]


def _footer(result: dict) -> List[str]:
    bw = result["read_bandwidth"] / 1e12
    t = result.get("timing", {})
    lines = [
        f"{result['device']} ({result.get('num_sms', '?')} SMs), measured read bandwidth {bw:.2f} TB/s, "
        f"torch {result['torch']}, triton {result['triton']}, {result['date']}; "
        f"{result['draft_tokens']} draft tokens per sequence (causal chain), random kv_indices. "
        f"µs = median of triton.testing.do_bench (L2 flushed"
        + (f", rep {t['rep_ms']:g} ms" if t.get("rep_ms") else "") + ") over CUDA-graph replays.",
        "floor = prefix K+V bytes / measured read bandwidth; gather floor = best time of a bare kernel that "
        "only gathers and sums the same K/V rows through the same kv_indices (splitkv.floor), over a grid "
        "of launch settings; invariant = splitkv with split_tokens="
        f"{result.get('invariant_split_tokens', INVARIANT_SPLIT_TOKENS)} (batch-invariant); host = "
        + ("wall time per eager call, " if "host_rounds" not in t else "time a call holds the calling thread, ")
        + _host_method(t) + " (measured for "
        f"peers only where their graph time is at most {t.get('host_max_graph_us', HOST_MAX_GRAPH_US):.0f} µs); "
        "fail = the implementation raised, skip = not run at this shape.",
    ]
    carried = sorted({r["carried_from"] for r in result["rows"] if r.get("carried_from")})
    if carried:
        lines.append("† not measured in this run; carried over from " + "; ".join(carried) + ".")
    problems = _problems(result)
    if problems:
        lines.append("Failures and skips: " + "; ".join(problems) + ".")
    return lines


def format_table(result: dict) -> str:
    """The results as plain-text tables (µs, ratios, host times, fp8 pool) and a footer."""
    out = []
    for title, head, body in _tables(result):
        widths = [max(len(x) for x in col) for col in zip(head, *body)]
        fmt = lambda cells: "  ".join(  # noqa: E731
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        )
        out += [title, fmt(head), "-" * len(fmt(head))] + [fmt(c) for c in body] + [""]
    return "\n".join(out + _footer(result))


def format_markdown(result: dict) -> str:
    """The results as Markdown tables of at most 9 columns, each with a bold caption, and a footer."""
    out = []
    for title, head, body in _tables(result):
        out += [f"**{title}**", "", "| " + " | ".join(head) + " |", "|---|" + "--:|" * (len(head) - 1)]
        out += ["| " + " | ".join(cells) + " |" for cells in body] + [""]
    return "\n".join(out + ["\n\n".join(_footer(result))])


# ---- Command line -------------------------------------------------------------------------------

_DESCRIPTION = """\
Benchmark split-KV verify attention against its peers and two floors.

Needs a CUDA GPU. On a CPU-only machine run `python -m splitkv demo` instead
(the same kernels through the Triton interpreter, at small shapes).

For every shape (a model's heads x batch x prefix tokens; 4 draft tokens per
sequence, random kv_indices) and KV pool (bf16, and fp8 e4m3 with k_scale 0.5,
v_scale 2.0), each implementation is replayed from a CUDA graph and timed with
triton.testing.do_bench (median µs, L2 flushed). Per row: floor_us (prefix KV
bytes / measured read bandwidth), gather_floor_us (a bare kernel gathering the
same K/V rows, best of up to 17 launch settings), their ratios to splitkv, eager
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
"""


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
    ap.add_argument("--quick", action="store_true",
                    help=f"smoke run: {QUICK[0][0]}, batches {' '.join(map(str, QUICK[1]))}, prefix "
                         f"{QUICK[2][0]} tokens, both pools (4 rows, < 1 minute)")
    ap.add_argument("--out", default=None, metavar="PATH",
                    help="result JSON path; the .md goes beside it (default: figures/benchmark_<gpu>.json, "
                         "with _quick or _custom for --quick and subsets)")
    ap.add_argument("--figures", default="figures", metavar="DIR",
                    help="folder for the plots, '' for none (default: figures)")
    ap.add_argument("--rep-ms", type=float, default=25.0, metavar="MS",
                    help="do_bench measuring time per timing, milliseconds (default: 25)")
    ap.add_argument("--host-calls", type=int, default=1000, metavar="N",
                    help="eager calls per host-time round, each timed alone (default: 1000)")
    ap.add_argument("--host-unpinned", action="store_true",
                    help="time host rounds on whatever CPU the thread runs on (default: pinned to the fastest CPU "
                         "at the time; see the module docstring)")
    ap.add_argument("--no-gather-floor", action="store_true", help="skip the gather-floor search")
    return ap


def plan_run(argv, device_name: str) -> dict:
    """What a command line asks for on a GPU called ``device_name`` (parsed, defaults filled in).

    Returns:
        ``run_benchmark``'s arguments (``models``, ``batches``, ``prefixes``,
        ``impls``, ``kv_dtypes``, ``gather_floor``), the :class:`Timer`
        settings (``timer``), and the output paths: ``out`` (JSON), ``md``,
        ``figures`` (folder or ``""``) and ``plot_tag`` (``roofline_<tag>.png``).
    """
    args = _parser().parse_args(argv)
    subset = any(x is not None for x in (args.models, args.batches, args.prefixes, args.impls, args.kv_dtypes))
    models, batches, prefixes = QUICK if args.quick else (tuple(MODEL_SHAPES), BENCH_BATCHES, BENCH_PREFIXES)
    out = args.out or default_out_path(gpu_tag(device_name), "quick" if args.quick else "custom" if subset else "")
    stem = os.path.splitext(out)[0]
    return dict(
        models=tuple(args.models or models),
        batches=tuple(args.batches or batches),
        prefixes=tuple(args.prefixes or prefixes),
        impls=tuple(args.impls or IMPLEMENTATIONS),
        kv_dtypes=tuple(args.kv_dtypes or KV_DTYPES),
        gather_floor=not args.no_gather_floor,
        timer=dict(rep_ms=args.rep_ms, host_calls=args.host_calls, host_pin=not args.host_unpinned),
        out=out,
        md=stem + ".md",
        figures=args.figures,
        plot_tag=os.path.basename(stem).removeprefix("benchmark_"),
    )


def main(argv=None):
    """The ``python -m splitkv.bench`` command line."""
    if not torch.cuda.is_available():
        _parser().parse_args(argv)  # --help works anywhere
        sys.exit("the benchmark needs a CUDA GPU (on a CPU, run `python -m splitkv demo`)")
    device = torch.cuda.get_device_name()
    run = plan_run(argv, device)
    if os.path.dirname(run["out"]):
        os.makedirs(os.path.dirname(run["out"]), exist_ok=True)
    print(f"{device}: writing {run['out']} and {run['md']}", flush=True)
    result = run_benchmark(run["models"], run["batches"], run["prefixes"], run["impls"],
                           kv_dtypes=run["kv_dtypes"], out_path=run["out"], timer=Timer(**run["timer"]),
                           gather_floor=run["gather_floor"])
    with open(run["md"], "w") as f:
        f.write(format_markdown(result) + "\n")
    print(format_table(result))
    if run["figures"]:
        from .plots import plot_benchmark

        for path in plot_benchmark(result, run["figures"], tag=run["plot_tag"]):
            print("wrote", path)
    print(f"total {result['elapsed_s']:.0f} s")


if __name__ == "__main__":
    main()
