"""Solutions to notebook 03's Python exercises (its kernels are in kernels.py)."""

from typing import Tuple

import torch

from splitkv.schedule import cdiv


def slicing(prefix_len: int, n_splits: int, block_n: int, min_split: int) -> Tuple[int, int]:
    """``(split_len, n_used)``: slices of whole key tiles, at least ``min_split`` keys, at least one slice."""
    split_len = max(cdiv(cdiv(prefix_len, n_splits), block_n) * block_n, min_split)
    n_used = max(1, cdiv(prefix_len, split_len))
    return split_len, n_used


def fit_latency(n: torch.Tensor, t: torch.Tensor) -> Tuple[float, float]:
    """Least-squares ``(a, b)`` of ``t = a + b / n``: a straight line in ``x = 1 / n``."""
    n, t = torch.as_tensor(n, dtype=torch.float64), torch.as_tensor(t, dtype=torch.float64)
    design = torch.stack([torch.ones_like(n), 1.0 / n], dim=1)
    a, b = torch.linalg.lstsq(design, t[:, None]).solution.flatten().tolist()
    return a, b
