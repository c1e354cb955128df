"""Checkers for notebook 04: the tile counter of the one-launch merge, and who merges.

* :func:`check_arrive` judges ``arrive(counters, tile, n_used) -> bool``: what
  a slice's program does once its partial state is in scratch. It bumps its
  tile's counter, says whether it arrived last (and so merges), and if so sets
  the counter back to 0. The checker replays
  launches of a small grid in plain Python, the programs' steps interleaved in
  random orders as a GPU might run them, on one counter array shared by the
  launches, as the kernel's is.
* :func:`check_who_merges` judges predictions of
  :func:`splitkv.schedule.merge_mode` for the shapes of :data:`MERGE_SHAPES`.

The checkers raise an ``AssertionError`` that says what is wrong.
"""

from __future__ import annotations

import random
from typing import Callable, Dict, List, Optional

from . import checks
from ... import schedule
from ...testing import MODEL_SHAPES

__all__ = ["atomic_add", "check_arrive", "replay",
           "MERGE_SHAPES", "MERGER_NAMES", "check_who_merges"]


def atomic_add(counters: List[int], i: int, value: int) -> int:
    """``counters[i] += value`` in one indivisible step; returns the value *before* the add, as ``tl.atomic_add`` does."""
    old = list.__getitem__(counters, i)
    list.__setitem__(counters, i, old + value)
    return old


class _SharedCounters(list):
    """The replay's counter array: it notes every plain read, and every plain write of a non-zero value.

    On a GPU a plain read and a later write are two steps, and another program
    of the tile may run between them; only :func:`atomic_add` is one step.
    """

    def __init__(self, values):
        super().__init__(values)
        self.plain = []

    def __getitem__(self, i):
        self.plain.append(("read", i))
        return super().__getitem__(i)

    def __setitem__(self, i, value):
        if value != 0:
            self.plain.append(("write", i))
        super().__setitem__(i, value)


# --- replaying launches -------------------------------------------------------------------------

#: Slices in use per tile of the replayed grid: tiles with one slice never touch their counter.
_N_USED = [4, 2, 1, 3, 5, 2]


def _interleave(programs: list, rng: random.Random) -> list:
    """Each program's two steps, publish then arrive, interleaved at random with the other programs'."""
    pending = {p: ["publish", "arrive"] for p in programs}
    events = []
    while pending:
        p = rng.choice(sorted(pending))
        events.append((p, pending[p].pop(0)))
        if not pending[p]:
            del pending[p]
    return events


def replay(arrive: Callable, n_used: List[int], counters: List[int], rng: random.Random) -> Dict[int, list]:
    """One launch: run every (tile, slice) program's steps in a random order; return each tile's merges.

    A merge is recorded as the set of the tile's slices published when the
    program that ``arrive`` declared last would start merging.
    """
    programs = [(t, s) for t, n in enumerate(n_used) if n > 1 for s in range(n)]
    published = {t: set() for t in range(len(n_used))}
    merges: Dict[int, list] = {t: [] for t in range(len(n_used))}
    for (tile, s), step in _interleave(programs, rng):
        if step == "publish":
            published[tile].add(s)
            continue
        if isinstance(counters, _SharedCounters):
            counters.plain.clear()
        last = arrive(counters, tile, n_used[tile])
        if isinstance(counters, _SharedCounters) and counters.plain:
            raise AssertionError(
                f"arrive updates the counter in two steps: it {' then '.join(k for k, _ in counters.plain[:2])}s "
                f"counters[{counters.plain[0][1]}] outside atomic_add. On a GPU two programs of tile {tile} can both "
                f"read the same count k before either writes; both write k + 1, one arrival is lost, and no "
                f"program sees n_used - 1 (the tile is never merged) or two see it. Hint: count with atomic_add, "
                f"which reads and adds in one indivisible step (tl.atomic_add on the GPU), and use the count it "
                f"returns; the only plain write is the merging program's reset to 0")
        if not isinstance(last, bool):
            raise AssertionError(f"arrive should return True (this program merges) or False, got {last!r}")
        if last:
            merges[tile].append(set(published[tile]))
    return merges


def _launch_problem(merges: Dict[int, list], n_used: List[int], start: List[int], launch: int) -> Optional[str]:
    """What went wrong in one replayed launch, or ``None``."""
    for tile, n in enumerate(n_used):
        if n == 1:
            continue
        if not merges[tile]:
            if start[tile] != 0:
                return (f"launch {launch}: tile {tile} (n_used {n}) was never merged. Its counter started at "
                        f"{start[tile]}, left there by launch {launch - 1}, so the counts this launch returned ran "
                        f"{start[tile]}..{start[tile] + n - 1} and no program saw {n - 1}: the tile's output is "
                        f"whatever the buffer held. Hint: the program that merges sets the counter back to 0")
            return (f"launch {launch}: tile {tile} (n_used {n}) was never merged: no program was declared last. "
                    f"Hint: atomic_add returns the count before the add, so the last of {n} programs sees {n - 1}, "
                    f"provided nothing else changes the counter during the launch")
        if len(merges[tile]) > 1:
            return (f"launch {launch}: tile {tile} (n_used {n}) was merged {len(merges[tile])} times: "
                    f"exactly one program may be the last")
        missing = sorted(set(range(n)) - merges[tile][0])
        if missing:
            return (f"launch {launch}: tile {tile} was merged while slices {missing} of {n} were not yet published: "
                    f"its merge would read scratch nobody wrote. Hint: only the program that sees n_used - 1 "
                    f"is sure the others are done")
    return None


@checks("one_launch", "arrive")
def check_arrive(arrive: Callable, seed: int = 0, orders: int = 20, launches: int = 3) -> str:
    """Replay ``launches`` launches on shared counters, in ``orders`` random interleavings; explain any failure."""
    rng = random.Random(seed)
    for _ in range(orders):
        counters = _SharedCounters([0] * len(_N_USED))
        for launch in range(1, launches + 1):
            start = list(counters)
            problem = _launch_problem(replay(arrive, _N_USED, counters, rng), _N_USED, start, launch)
            if problem:
                raise AssertionError(problem)
        if any(counters):
            raise AssertionError(f"after {launches} launches the counters are {counters}, not all 0: the next "
                                 f"launch, or a CUDA-graph replay, would start from them. Hint: the program "
                                 f"that merges sets its tile's counter back to 0")
    return (f"passed: {orders} random orders x {launches} launches on shared counters; every tile merged once, "
            f"after all its slices, and every counter back at 0")


# --- who merges ----------------------------------------------------------------------------------

#: The names a prediction may use, for each :func:`splitkv.schedule.merge_mode` result.
MERGER_NAMES = {None: "nobody", schedule.LAST_PROGRAM: "last program",
                schedule.MERGE_PROGRAMS: "merge programs", schedule.SEPARATE_MERGE: "second launch"}


def _shape(model: str, batch: int, n_splits: int, drafts: int = 4, one_launch: bool = True) -> dict:
    """A launch's merge-mode inputs for a model at ``batch`` sequences of ``drafts`` draft tokens."""
    s = MODEL_SHAPES[model]
    block_m = schedule.block_m_for(s.group * drafts)
    tiles = batch * schedule.head_tiles(s.num_q_heads, s.num_kv_heads, drafts, block_m)
    return dict(model=s.name, batch=batch, n_splits=n_splits, tiles=tiles, block_m=block_m,
                v_head_dim=s.head_dim, one_launch=one_launch)


#: The launches to predict: A, B and C, 4 draft tokens each, one launch allowed.
MERGE_SHAPES = {
    "A": _shape("llama3-8b", 1, 16),
    "B": _shape("llama3-8b", 1, 64),
    "C": _shape("qwen3-32b", 8, 4),
}


def _why(shape: dict) -> str:
    """The numbers that decide a shape's merge mode."""
    values = shape["n_splits"] * shape["block_m"] * shape["v_head_dim"]
    return (f"n_splits x BLOCK_M x Dv = {shape['n_splits']} x {shape['block_m']} x {shape['v_head_dim']} = {values} "
            f"values (FUSED_MAX_MERGE = {schedule.FUSED_MAX_MERGE}), BLOCK_M {shape['block_m']} "
            f"(FUSED_MAX_BLOCK_M = {schedule.FUSED_MAX_BLOCK_M})")


@checks("one_launch", "who_merges")
def check_who_merges(predictions) -> str:
    """Compare predictions (``{"A": "last program", ...}``, or a function returning them) with
    :func:`splitkv.schedule.merge_mode`."""
    if callable(predictions):
        predictions = predictions()
    names = set(MERGER_NAMES.values())
    if set(predictions) != set(MERGE_SHAPES):
        raise AssertionError(f"predict each of {sorted(MERGE_SHAPES)}, got keys {sorted(predictions)}")
    for key, shape in MERGE_SHAPES.items():
        got = predictions[key]
        if got not in names:
            raise AssertionError(f"{key}: {got!r} is not one of {sorted(names)}")
        want = MERGER_NAMES[schedule.merge_mode(shape["n_splits"], shape["tiles"], shape["block_m"],
                                                shape["v_head_dim"], shape["one_launch"])]
        if got != want:
            raise AssertionError(f"{key} ({shape['model']}, batch {shape['batch']}, {shape['n_splits']} slices): "
                                 f"the answer is {want!r}, not {got!r}. The numbers: {_why(shape)}")
    return f"passed: all {len(MERGE_SHAPES)} predictions match splitkv.schedule.merge_mode"
