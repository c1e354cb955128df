"""How the benchmarks time a call: CUDA-graph replays, eager calls, host time, and the read bandwidth.

:class:`Timer` times a zero-argument callable in µs three ways:

* :meth:`Timer.graph`: replays of a CUDA graph holding one call, under
  ``triton.testing.do_bench`` (median, L2 flushed between runs);
* :meth:`Timer.eager`: eager calls under ``do_bench`` (launches back to back);
* :meth:`Timer.host`: the time one eager call holds the calling thread.

Host time is measured in the regime a serving engine runs in: the host
enqueues call after call while the GPU works. Calls go back to back in
bursts of 20 (then one untimed synchronisation, so the launch queue never
fills and never blocks a call), each call timed alone; a *round* is the
median over 1000 calls. Timing each call after a synchronisation instead
(the GPU idle as it starts) would also measure the host waking up from the
wait: on a virtual machine that adds tens of µs at rows whose calls keep the
GPU busy for a millisecond or more.

A virtual machine's CPUs need not run at one speed: at the same moment a
fixed pure-Python workload (:func:`cpu_reference_us`) can take 25 µs on some
and 45 µs on others, and a drop-in call's host time follows it. Before each
round the timing thread is therefore pinned to the fastest CPU at that
moment (:func:`fastest_cpu`), and the round records that CPU's reference
time and the slowest CPU's: the host time is the code's cost on the fastest
CPU the machine offered then, and a call on a slow one costs about
``slowest_ref_us / ref_us`` times more.

:func:`measure_read_bandwidth` is the roofline floor's bandwidth, and
:func:`gpu_tag` names a GPU in output file names.
"""

from __future__ import annotations

import os
import re
import statistics
import time
from typing import Callable, List, Optional

import torch

from ..testing.graphs import capture_graph

__all__ = [
    "Timer",
    "cpu_reference_us",
    "fastest_cpu",
    "gpu_tag",
    "host_round",
    "measure_read_bandwidth",
]


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


def measure_read_bandwidth(gib: float = 2.0) -> float:
    """HBM read bandwidth in bytes/s: ``x.sum()`` over ``gib`` GiB of bf16."""
    import triton.testing

    x = torch.randn(int(gib * 2**30) // 2, dtype=torch.bfloat16, device="cuda")
    ms = triton.testing.do_bench(lambda: x.sum(), return_mode="median")
    return x.numel() * 2 / (ms * 1e-3)


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
        host_rounds: host-time rounds per implementation and row (the benchmark keeps the fastest).
        host_burst: calls launched back to back between synchronisations in a round.
        host_pin: pin the timing thread to :func:`fastest_cpu` for each round.
    """

    def __init__(self, warmup_ms: float = 5.0, rep_ms: float = 25.0, host_calls: int = 1000,
                 host_rounds: int = 3, host_burst: int = 20, host_pin: bool = True):
        if host_calls < 1 or host_rounds < 1 or host_burst < 1:
            raise ValueError(f"need host_calls, host_rounds and host_burst >= 1, got {host_calls}, "
                             f"{host_rounds} and {host_burst}")
        self.warmup_ms, self.rep_ms = warmup_ms, rep_ms
        self.host_calls, self.host_rounds = host_calls, host_rounds
        self.host_burst, self.host_pin = host_burst, host_pin
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


def host_round(timer: Timer, fn: Callable, rec: dict) -> None:
    """One more host-time round into ``rec`` (with the timer's CPU pick, where it pinned); ``host_us``: the fastest."""
    rec.setdefault("host_rounds_us", []).append(timer.host(fn))
    if timer.last_host_cpu:
        rec.setdefault("host_cpus", []).append(timer.last_host_cpu)
    rec["host_us"] = min(rec["host_rounds_us"])
