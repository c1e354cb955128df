"""Solutions to notebook 06's exercises."""

from typing import Tuple

from splitkv.testing.problem import HeadShape


def floor_us(shape: HeadShape, batch: int, prefix: int, bandwidth: float, kv_bytes: int = 2) -> float:
    """µs to read ``batch`` prefixes of ``prefix`` keys once: K and V of every KV head, at ``bandwidth`` bytes/s."""
    nbytes = batch * prefix * shape.num_kv_heads * 2 * shape.head_dim * kv_bytes  # a K and a V row per key and KV head
    return nbytes / bandwidth * 1e6


def gather_gap(row: dict) -> Tuple[float, float]:
    """splitkv's CUDA-graph time in a benchmark row over its gather floor, and the difference in µs."""
    ours, gather = row["impls"]["splitkv"]["graph"], row["gather_floor_us"]
    return ours / gather, ours - gather
