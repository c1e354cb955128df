"""Exercises of notebook 06: predict a verify call's floor from its shape, and measure a miss against the gather floor.

* :func:`check_floor_us` -- ``floor_us(shape, batch, prefix, bandwidth, kv_bytes=2)``:
  the microseconds a call needs just to stream its prefix K and V once;
* :func:`check_gather_gap` -- ``gather_gap(row)``: how far splitkv's time in a
  benchmark row is from that row's gather floor, as a ratio and in µs.

The checkers compare with every row of the recorded H200 benchmark
(``figures/benchmark_h200.json``) when it is there, and with fresh random
shapes and rows, and say what is wrong.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Callable, List, Optional, Tuple

from splitkv.testing import MODEL_SHAPES
from splitkv.testing.problem import HeadShape

from . import checks

__all__ = ["check_floor_us", "check_gather_gap", "recorded_rows"]


def recorded_rows(path: Optional[Path] = None) -> Tuple[float, List[dict]]:
    """``(read bandwidth in bytes/s, rows)`` of the recorded H200 benchmark, or ``(0.0, [])`` if it is absent."""
    if path is None:
        from splitkv.teaching.lessons import FIGURES

        path = FIGURES / "benchmark_h200.json"
    if not Path(path).exists():
        return 0.0, []
    result = json.loads(Path(path).read_text())
    return result["read_bandwidth"], result["rows"]


def _expected_floor_us(shape: HeadShape, batch: int, prefix: int, bandwidth: float, kv_bytes: int = 2) -> float:
    """µs to read ``batch`` prefixes of ``prefix`` keys once: K and V of every KV head, at ``bandwidth`` bytes/s."""
    nbytes = batch * prefix * shape.num_kv_heads * 2 * shape.head_dim * kv_bytes  # a K and a V row per key and KV head
    return nbytes / bandwidth * 1e6


def _expected_gather_gap(row: dict) -> Tuple[float, float]:
    """splitkv's CUDA-graph time in a benchmark row over its gather floor, and the difference in µs."""
    ours, gather = row["impls"]["splitkv"]["graph"], row["gather_floor_us"]
    return ours / gather, ours - gather


def _floor_hint(got: float, want: float, shape: HeadShape) -> str:
    """A guess at the mistake behind a wrong floor, from the ratio of the answer to the right one."""
    ratio = got / want
    hints = [(0.5, "half the bytes: count both the K row and the V row of every key"),
             (2.0, "twice the bytes: K and V once each, no more"),
             (shape.num_q_heads / shape.num_kv_heads, "the pool holds one K and V row per KV head, not per query head"),
             (1e-6, "the answer looks like seconds: return microseconds"),
             (1e3, "the answer looks like nanoseconds: return microseconds"),
             (8.0, "bytes, not bits")]
    for r, hint in hints:
        if math.isclose(ratio, r, rel_tol=1e-6):
            return f" ({hint})"
    return ""


def _random_shape(rng: random.Random) -> HeadShape:
    kv = rng.choice([1, 2, 4, 8])
    return HeadShape("random", kv * rng.choice([1, 2, 4, 8]), kv, rng.choice([64, 96, 128, 256]))


@checks("performance", "floor_us")
def check_floor_us(fn: Callable[..., float]) -> str:
    """Check ``fn(shape, batch, prefix, bandwidth, kv_bytes=2)``: the floor in µs, on recorded and random shapes."""
    rng = random.Random()
    bandwidth, rows = recorded_rows()
    cases = [(MODEL_SHAPES[r["model"]], r["batch"], r["prefix"], bandwidth,
              1 if r.get("kv_dtype", "bfloat16").startswith("float8") else 2, r["floor_us"]) for r in rows]
    for _ in range(50):
        shape = _random_shape(rng)
        args = (shape, rng.randint(1, 64), rng.randint(1, 1 << 20), rng.uniform(1e12, 8e12), rng.choice([1, 2, 4]))
        cases.append(args + (_expected_floor_us(*args),))
    for shape, batch, prefix, bw, kv_bytes, want in cases:
        got = fn(shape, batch, prefix, bw, kv_bytes)
        if not isinstance(got, (int, float)) or not math.isfinite(got):
            raise AssertionError(f"floor_us returned {got!r}: expected a finite number of µs")
        if not math.isclose(got, want, rel_tol=1e-6):
            raise AssertionError(
                f"floor_us({shape.num_q_heads}/{shape.num_kv_heads} heads x {shape.head_dim}, batch {batch}, prefix "
                f"{prefix}, {bw / 1e12:.2f} TB/s, {kv_bytes}-byte pool) = {got:.4g} µs, expected {want:.4g}"
                + _floor_hint(got, want, shape))
    recorded = f"the {len(rows)} recorded H200 rows and " if rows else ""
    return f"passed: floor_us matches {recorded}{len(cases) - len(rows)} random shapes"


def _random_row(rng: random.Random) -> dict:
    gather = rng.uniform(5.0, 3000.0)
    splitkv = {"graph": gather * rng.uniform(0.9, 3.0), "eager": gather * rng.uniform(0.9, 3.0)}
    return {"gather_floor_us": gather, "floor_us": gather * rng.uniform(0.5, 0.99), "impls": {"splitkv": splitkv}}


@checks("performance", "gather_gap")
def check_gather_gap(fn: Callable[[dict], Tuple[float, float]]) -> str:
    """Check ``fn(row) -> (ratio, excess_us)`` on every recorded row and on random rows."""
    rng = random.Random()
    _, rows = recorded_rows()
    cases = rows + [_random_row(rng) for _ in range(50)]
    for row in cases:
        got = fn(row)
        if not (isinstance(got, tuple) and len(got) == 2):
            raise AssertionError(f"gather_gap returned {got!r}: expected a tuple (ratio, excess_us)")
        (ratio, excess), (want_ratio, want_excess) = got, _expected_gather_gap(row)
        label = f"row {row.get('model', 'random')} bs {row.get('batch', '-')} prefix {row.get('prefix', '-')}"
        if math.isclose(ratio, 1 / want_ratio, rel_tol=1e-9) and not math.isclose(want_ratio, 1.0, rel_tol=1e-9):
            raise AssertionError(f"{label}: the ratio is upside down: splitkv's time over the gather floor")
        sk = row["impls"]["splitkv"]
        if math.isclose(ratio, sk["graph"] / row["floor_us"], rel_tol=1e-9):
            raise AssertionError(f"{label}: that is the ratio to the bandwidth floor (floor_us); use gather_floor_us")
        if math.isclose(ratio, sk["eager"] / row["gather_floor_us"], rel_tol=1e-9) and sk["eager"] != sk["graph"]:
            raise AssertionError(f"{label}: that is the eager time; the benchmark compares CUDA-graph replays (graph)")
        if not math.isclose(ratio, want_ratio, rel_tol=1e-9):
            raise AssertionError(f"{label}: ratio {ratio:.4g}, expected {want_ratio:.4g}")
        if not math.isclose(excess, want_excess, rel_tol=1e-9, abs_tol=1e-9):
            raise AssertionError(f"{label}: excess {excess:.4g} µs, expected {want_excess:.4g} "
                                 "(splitkv's time minus the gather floor)")
    return f"passed: gather_gap matches {len(rows)} recorded rows and {len(cases) - len(rows)} random rows"
