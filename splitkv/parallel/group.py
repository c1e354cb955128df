"""The process group of a context-parallel step: ranks, merging ranks, the all-gather.

Everything that talks to :mod:`torch.distributed` (absent from some builds:
then every step is a world of one rank).
"""

from __future__ import annotations

from typing import Sequence, Tuple, Union

import torch

try:
    import torch.distributed as dist
except ImportError:  # pragma: no cover - builds without distributed
    dist = None

#: Ranks that need a step's output: ``None`` (all), a rank, or a sequence of ranks.
DstType = Union[None, int, Sequence[int]]


def group_info(group) -> Tuple[int, int]:
    """``(rank, world_size)`` in ``group``; ``(0, 1)`` without an initialised process group.

    Raises:
        ValueError: for a ``group`` given while ``torch.distributed`` is not initialised.
    """
    if dist is None or not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialised")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def merging_ranks(dst: DstType, world_size: int) -> Tuple[int, ...]:
    """The sorted ranks ``dst`` names (every rank for ``None``).

    Raises:
        ValueError: for no rank, or a rank outside ``[0, world_size)``.
    """
    if dst is None:
        return tuple(range(world_size))
    ranks = (int(dst),) if isinstance(dst, int) else tuple(sorted({int(r) for r in dst}))
    if not ranks or any(not 0 <= r < world_size for r in ranks):
        raise ValueError(f"dst must name ranks in [0, {world_size}), got {dst!r}")
    return ranks


def all_gather(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    """``all_gather_into_tensor`` (``all_gather_single`` where torch renamed it)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)
