"""Solutions to notebook 02's exercises (PyTorch)."""

from typing import Sequence, Tuple

import torch

State = Tuple[torch.Tensor, torch.Tensor]


def merge(states: Sequence[State]) -> State:
    """Merge states over disjoint key sets: ``lse = log sum_i e^lse_i``, ``o = sum_i e^(lse_i - lse) o_i``."""
    o = torch.stack([o_i for o_i, _ in states])          # [S, M, Dv]
    lse = torch.stack([lse_i for _, lse_i in states])    # [S, M]
    m = lse.max(dim=0).values
    m = torch.where(torch.isinf(m), 0.0, m)              # a row with every state empty: shift by 0
    w = torch.exp(lse - m)                               # 0 for an empty state
    den = w.sum(dim=0)
    num = torch.where(w[..., None] > 0, w[..., None] * o, 0.0).sum(dim=0)  # select: 0 * NaN would be NaN
    return num / torch.where(den > 0, den, 1.0)[:, None], m + torch.log(den)


def tile_step(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor,
                       s: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One online-softmax step: fold scores ``s [M, N]`` (``-inf`` = masked) and values ``v [N, Dv]`` in.

    ``m [M]`` is the running row maximum, ``l [M]`` the running sum of
    ``e^(s - m)`` and ``acc [M, Dv]`` the unnormalised output; both are
    rescaled by ``alpha = e^(m - m_new)`` when the maximum grows.
    """
    m_new = torch.maximum(m, s.max(dim=1).values)
    shift = torch.where(torch.isinf(m_new), 0.0, m_new)  # a row that has seen nothing yet
    alpha = torch.exp(m - shift)
    p = torch.exp(s - shift[:, None])
    return m_new, l * alpha + p.sum(dim=1), acc * alpha[:, None] + p @ v
