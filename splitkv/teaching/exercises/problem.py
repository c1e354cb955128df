"""Checkers for notebook 01: the bytes a verify step must read, and Little's law.

* :func:`check_kv_bytes` judges ``kv_bytes(problem) -> int``, the prefix K and
  V bytes of a :class:`splitkv.testing.VerifyProblem`;
* :func:`check_bytes_in_flight` judges ``bytes_in_flight(kv_bytes, time_us,
  latency_ns) -> float``, the bytes a kernel kept in flight on average, by
  Little's law.

The checkers raise an ``AssertionError`` that says what is wrong.
"""

from __future__ import annotations

import math
import random
from typing import Callable

import torch

from . import checks
from ...testing import make_problem

__all__ = ["check_kv_bytes", "check_bytes_in_flight"]


def _expected_bytes_in_flight(kv_bytes: float, time_us: float, latency_ns: float) -> float:
    """Little's law: bytes in flight = bandwidth x latency, with the bandwidth the kernel achieved."""
    return kv_bytes / (time_us * 1e-6) * (latency_ns * 1e-9)


def _kv_hint(p, got: int, want: int) -> str:
    """Why ``got`` might differ from ``want``: the usual slips, recognised by their ratio."""
    g = p.num_q_heads // p.num_kv_heads
    slips = {
        "each KV head is read once, whatever the number of query heads: use H_kv, not H_q": want * g,
        "count K and V: D + Dv per KV head": want * p.head_dim // (p.head_dim + p.v_head_dim),
        "V has v_head_dim columns, which may differ from head_dim": (
            want * 2 * p.head_dim // (p.head_dim + p.v_head_dim)),
        "the draft tokens' K and V come with the queries, not from the pool: count prefix tokens only": (
            want // max(sum(p.prefix_lens), 1) * (sum(p.prefix_lens) + sum(p.extend_lens))),
        "bytes per element are the pool's (k_buffer.element_size()), which may be fp8": (
            want // p.k_buffer.element_size() * p.q_extend.element_size()),
    }
    for hint, slip in slips.items():
        if got == slip and slip != want:
            return hint
    return "bytes = prefix tokens x H_kv x (D + Dv) x bytes per element of the pool"


@checks("problem", "kv_bytes")
def check_kv_bytes(kv_bytes_fn: Callable, seed: int = 0) -> str:
    """Check a learner's ``kv_bytes(problem)`` on random problems (ragged prefixes, D != Dv, fp8 pools)."""
    rng = random.Random(seed)
    shapes = [dict(num_q_heads=4, num_kv_heads=2, head_dim=16),
              dict(num_q_heads=8, num_kv_heads=2, head_dim=16, v_head_dim=8),
              dict(num_q_heads=9, num_kv_heads=3, head_dim=8, dtype=torch.float16, kv_dtype=torch.float8_e4m3fn),
              dict(num_q_heads=2, num_kv_heads=2, head_dim=32, dtype=torch.float32)]
    for shape in shapes:
        prefix = [rng.randint(0, 40) for _ in range(rng.randint(1, 4))]
        drafts = [rng.randint(1, 5) for _ in prefix]
        p = make_problem(prefix, drafts, seed=rng.randrange(1 << 30), **shape)
        want = p.kv_bytes  # the package's own count (VerifyProblem.kv_bytes)
        got = kv_bytes_fn(p)
        if got != want:
            pool = str(p.k_buffer.dtype).replace("torch.", "")
            raise AssertionError(
                f"prefixes {prefix}, H_q = {p.num_q_heads}, H_kv = {p.num_kv_heads}, D = {p.head_dim}, "
                f"Dv = {p.v_head_dim}, {pool} pool: expected {want:,} bytes, got {got}. Hint: {_kv_hint(p, got, want)}")
    return f"passed: kv_bytes is right on {len(shapes)} random problems (ragged, D != Dv, fp8 pool)"


@checks("problem", "bytes_in_flight")
def check_bytes_in_flight(fn: Callable, seed: int = 0) -> str:
    """Check a learner's ``bytes_in_flight(kv_bytes, time_us, latency_ns)`` on random and recorded values."""
    rng = random.Random(seed)
    cases = [(rng.uniform(1e6, 1e9), rng.uniform(5, 5000), rng.uniform(300, 900)) for _ in range(5)]
    cases.append((67_108_864, 36.0, 600.0))  # Llama-3-8B, batch 1, 16k prefix, bf16
    for kv, t_us, lat_ns in cases:
        want = _expected_bytes_in_flight(kv, t_us, lat_ns)
        got = float(fn(kv, t_us, lat_ns))
        if math.isclose(got, want, rel_tol=1e-9):
            continue
        ratio = got / want if want else float("inf")
        power = round(math.log10(abs(ratio))) if ratio and math.isfinite(ratio) else None
        hint = "bytes in flight = (kv_bytes / time) x latency, in seconds on both sides"
        if power and math.isclose(abs(ratio), 10.0 ** power, rel_tol=1e-6):
            hint = f"off by a factor 1e{power}: time is in microseconds (1e-6 s), latency in nanoseconds (1e-9 s)"
        raise AssertionError(f"kv_bytes = {kv:,.0f}, time = {t_us:.1f} us, latency = {lat_ns:.0f} ns: "
                             f"expected {want:,.0f} bytes, got {got:,.0f}. Hint: {hint}")
    return f"passed: bytes_in_flight follows Little's law in {len(cases)} cases"
