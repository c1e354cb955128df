"""Solutions to notebook 04's Python exercises."""

from typing import Dict, List

from splitkv.teaching.exercises.one_launch import atomic_add


def arrive(counters: List[int], tile: int, n_used: int) -> bool:
    """Count this slice as published; the program that sees ``n_used - 1`` is the last: it resets and merges."""
    done = atomic_add(counters, tile, 1)  # slices published before this one
    if done == n_used - 1:  # every slice of the tile is in scratch
        counters[tile] = 0  # ready for the next launch, without a memset
        return True
    return False


def who_merges() -> Dict[str, str]:
    """The predictions, by the rule: one slice -> nobody; BLOCK_M <= 16 and few partial values -> last program."""
    return {"A": "last program",    # 16 x 16 x 128 = 32768 values, BLOCK_M 16
            "B": "merge programs",  # 64 x 16 x 128 = 131072 values: too many for one program
            "C": "merge programs"}  # BLOCK_M 32: a tall tile merges faster spread
