"""Solution to notebook 07's exercise."""

import math

from splitkv.teaching.exercises.parallel import StepModel


def prefix_for_speedup(model: StepModel, world_size: int, speedup: float = 1.0) -> float:
    """Prefix tokens at which ``model.speedup(P, world_size) == speedup`` (``math.inf`` when it never gets there).

    With ``x = P b / B`` the one-GPU read time, ``a + x = s (a + x / W + c)``
    gives ``x = ((s - 1) a + s c) / (1 - s / W)``; the speedup only tends to
    ``W`` as ``x`` grows, so ``s >= W`` is out of reach.
    """
    if speedup >= world_size:
        return math.inf
    read_us = ((speedup - 1) * model.fixed_us + speedup * model.comm_us) / (1 - speedup / world_size)
    return max(0.0, read_us) * 1e-6 * model.bandwidth / model.bytes_per_token
