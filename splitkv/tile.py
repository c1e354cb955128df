"""A verify launch's tile shape: :class:`TileConfig`."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TileConfig"]


@dataclass(frozen=True, repr=False)
class TileConfig:
    """Launch shape of the verify kernel (performance only, never results).

    Attributes:
        block_m: query rows per tile (a power of two, at least 16).
        block_n: prefix keys per loop step.
        num_warps: warps per program.
        num_stages: software-pipelining depth of the key loop.
        k_rows: load K tiles as ``[BLOCK_N, D]`` rows and transpose them for
            the dot (else load them as ``[D, BLOCK_N]``); see :mod:`splitkv.kernels.verify`.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    k_rows: bool = False

    def __post_init__(self):
        object.__setattr__(self, "k_rows", bool(self.k_rows))

    def __repr__(self):
        rows = ", k_rows=True" if self.k_rows else ""
        return (f"TileConfig(block_m={self.block_m}, block_n={self.block_n}, "
                f"num_warps={self.num_warps}, num_stages={self.num_stages}{rows})")
