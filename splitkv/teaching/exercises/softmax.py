"""Checkers for notebook 02: the LSE merge of attention states, and the online-softmax step.

An *attention state* of query rows over a key set is ``(o [M, Dv], lse [M])``:
the normalised output and the natural-log log-sum-exp of the scores. A row
that sees no key has ``lse = -inf`` and an undefined ``o``.

* :func:`check_merge` judges ``merge(states) -> (o, lse)``, the exact merge of
  states over disjoint key sets;
* :func:`check_tile_step` judges ``tile_step(m, l, acc, s, v) -> (m, l, acc)``,
  one online-softmax update over a tile of keys.

Both run the learner's function on fresh random data and on the tricky cases
(empty states holding NaN, rows that see nothing, scores large enough to
overflow ``exp``, irregular tile sizes), compare with the float64 reference
(:func:`splitkv.teaching.lessons.attend`) and raise an ``AssertionError``
that names what is wrong.
"""

from __future__ import annotations

from typing import Callable, List, Sequence, Tuple

import torch

from . import Unsolved, checks
from ..lessons import attend

__all__ = ["finish", "check_merge", "check_tile_step"]

State = Tuple[torch.Tensor, torch.Tensor]

# float64 results of exact formulas agree to about 1e-13 relative to their magnitude; 1e-9 leaves room for any
# sound order and for the reference's own last digits, and still catches every slip (errors of 1e-3 and more).
_ATOL = 1e-9


def finish(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor) -> State:
    """The state ``(o, lse)`` after the last tile: ``o = acc / l``, ``lse = m + log l``; ``(0, -inf)`` if ``l = 0``."""
    has = l > 0
    o = acc / torch.where(has, l, 1.0)[:, None]
    return o, torch.where(has, m + torch.log(torch.where(has, l, 1.0)), float("-inf"))


# --- comparing ----------------------------------------------------------------------------------

def _compare(what: str, got: State, want: State, case: str, hint: str) -> None:
    """Raise an AssertionError naming the first way ``got`` differs from ``want``, with ``hint``."""
    try:
        _differences(what, got, want, case)
    except AssertionError as e:
        raise AssertionError(f"{e}. Hint: {hint}") from None


def _differences(what: str, got: State, want: State, case: str) -> None:
    """Raise an AssertionError naming the first way ``got`` differs from ``want``."""
    if not (isinstance(got, tuple) and len(got) == 2):
        raise AssertionError(f"{what} should return a pair (o, lse), got {type(got).__name__}")
    o, lse = (torch.as_tensor(x) for x in got)
    o_ref, lse_ref = want
    for name, x, ref in (("o", o, o_ref), ("lse", lse, lse_ref)):
        if tuple(x.shape) != tuple(ref.shape):
            raise AssertionError(f"{case}: {name} has shape {tuple(x.shape)}, expected {tuple(ref.shape)}")
    o, lse = o.double(), lse.double()
    if torch.isnan(o).any() or torch.isnan(lse).any():
        raise AssertionError(f"{case}: the result holds NaN")
    if torch.isinf(o).any():
        raise AssertionError(f"{case}: o holds inf (an exponential overflowed?)")
    empty = torch.isinf(lse_ref)
    if not torch.equal(torch.isneginf(lse), empty):
        raise AssertionError(f"{case}: lse should be -inf exactly for the rows that see no key "
                             f"(rows {empty.nonzero().flatten().tolist()}), got {lse.tolist()}")
    # Relative to the magnitudes compared: float64 rounding scales with them.
    lse_err = ((lse[~empty] - lse_ref[~empty]).abs() / (1 + lse_ref[~empty].abs())).max().item() if (~empty).any() else 0.0
    if lse_err > _ATOL:
        raise AssertionError(f"{case}: lse is off by up to {lse_err:.2g}")
    if empty.any() and o[empty].abs().max().item() != 0.0:
        raise AssertionError(f"{case}: a row that sees no key should get o = 0")
    o_err = (o - o_ref).abs().max().item() / max(1.0, o_ref.abs().max().item())
    if o_err > _ATOL:
        raise AssertionError(f"{case}: o is off by up to {o_err:.2g}")


def _keys(gen: torch.Generator, rows: int, sizes: Sequence[int], d: int, dv: int, scale: float):
    """Random queries and key sets: ``q [rows, d]``, then ``(k [n, d], v [n, dv])`` for each size."""
    q = torch.randn(rows, d, generator=gen, dtype=torch.float64) * scale
    sets = [(torch.randn(n, d, generator=gen, dtype=torch.float64),
             torch.randn(n, dv, generator=gen, dtype=torch.float64)) for n in sizes]
    return q, sets


def _union(q, sets, visible=None) -> State:
    """The reference: one pass over all keys of ``sets``."""
    k = torch.cat([k for k, _ in sets])
    v = torch.cat([v for _, v in sets])
    return attend(q, k, v, visible)


# --- merge ------------------------------------------------------------------------------------

_WEIGHTS = "the weights e^(lse_i - lse) sum to 1 and lse = log sum_i e^(lse_i)"
_SHIFT = "subtract the largest lse_i before exponentiating, so every weight is at most 1"
_SELECT = "an empty state weighs 0 whatever its o: select (where w > 0) rather than multiply, as 0 * NaN = NaN"
_ALL_EMPTY = ("where every state of a row is empty the largest lse is -inf, and e^(-inf - (-inf)) is NaN: "
              "shift by 0 there; such a row gets o = 0, lse = -inf")


def _merge_cases(seed: int) -> List[Tuple[str, str, List[State], State]]:
    """(description, hint, states, expected) for the merge checker, fresh data from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for desc, hint, rows, sizes, scale in (
            ("two key sets", _WEIGHTS, 5, [7, 12], 0.3),
            ("one key set (merge of one state)", _WEIGHTS, 3, [9], 0.3),
            ("seven key sets of irregular sizes", _WEIGHTS, 4, [1, 16, 3, 40, 2, 5, 11], 0.3),
            ("large scores (lse near 1000: e^lse overflows)", _SHIFT, 3, [6, 6, 6], 400.0)):
        q, sets = _keys(gen, rows, sizes, 8, 6, scale)
        cases.append((desc, hint, [attend(q, k, v) for k, v in sets], _union(q, sets)))

    # An empty key set between two others: lse = -inf and an undefined o (NaN, as scratch may hold).
    q, sets = _keys(gen, 4, [5, 0, 8], 8, 6, 0.3)
    states = [attend(q, k, v) for k, v in sets]
    states[1] = (torch.full_like(states[1][0], float("nan")), states[1][1])
    cases.append(("an empty state (lse = -inf, o = NaN) between two others", _SELECT, states, _union(q, sets)))

    # Rows that see nothing at all: row 1 in every state, row 3 in the first state only.
    q, sets = _keys(gen, 4, [6, 9], 8, 6, 0.3)
    seen = [torch.ones(4, n, dtype=torch.bool) for n in (6, 9)]
    seen[0][1] = seen[1][1] = False
    seen[0][3] = False
    states = []
    for (k, v), vis in zip(sets, seen):
        o, lse = attend(q, k, v, vis)
        states.append((torch.where(torch.isinf(lse)[:, None], float("nan"), o), lse))
    cases.append(("row 1 sees no key in any state, row 3 none in the first (their o are NaN)", _ALL_EMPTY,
                  states, _union(q, sets, torch.cat(seen, dim=1))))
    return cases


@checks("softmax", "merge")
def check_merge(merge_fn: Callable[[Sequence[State]], State], seed: int = 0) -> str:
    """Check a learner's ``merge(states) -> (o, lse)`` against one pass over all keys (float64).

    Raises:
        AssertionError: naming the first case where the result is wrong.
    """
    cases = _merge_cases(seed)
    for desc, hint, states, want in cases:
        saved = [(o.clone(), lse.clone()) for o, lse in states]
        try:
            got = merge_fn(states)
        except Unsolved:  # a stub: the exercise waits
            raise
        except Exception as e:  # a crash is a wrong answer too; say where
            raise AssertionError(f"{desc}: merge raised {type(e).__name__}: {e}") from e
        _compare("merge", got, want, desc, hint)
        if not all(torch.allclose(x, y, rtol=0, atol=0, equal_nan=True)
                   for state, copy in zip(states, saved) for x, y in zip(state, copy)):
            raise AssertionError(f"{desc}: merge modified its input states")
    return f"passed: merge matches one pass over all keys in {len(cases)} cases, empty states and overflow included"


# --- the online-softmax step ------------------------------------------------------------------

_RESCALE = "when the maximum grows from m to m_new, multiply both l and acc by alpha = e^(m - m_new)"
_EMPTY_ROW = "a row that has seen no visible key keeps m = -inf, l = 0, acc = 0: shift by 0 there"
_STEP_SHIFT = "exponentiate s - m_new, never s itself"


def _tile_cases(seed: int):
    """(description, hint, q, keys, values, visible, tile sizes) for the tile-step checker."""
    gen = torch.Generator().manual_seed(seed)
    cases = []
    # Scores that grow from tile to tile force a rescale at every step.
    q, [(k, v)] = _keys(gen, 4, [40], 8, 6, 0.5)
    order = (q @ k.T).mean(0).argsort()
    cases.append(("a maximum that grows from tile to tile", _RESCALE, q, k[order], v[order], None, [16, 16, 8]))
    # Irregular tiles; row 0 sees nothing in the first tile, row 2 nothing at all.
    q, [(k, v)] = _keys(gen, 4, [29], 8, 6, 0.5)
    vis = torch.ones(4, 29, dtype=torch.bool)
    vis[0, :16] = False
    vis[2] = False
    cases.append(("row 0 sees no key in the first tile, row 2 none at all", _EMPTY_ROW, q, k, v, vis,
                  [16, 5, 7, 1]))
    # Scores near 1000: e^s overflows (even in float64) unless the step subtracts the running maximum.
    q, [(k, v)] = _keys(gen, 3, [24], 8, 6, 400.0)
    cases.append(("large scores (e^s overflows)", _STEP_SHIFT, q, k, v, None, [8, 8, 8]))
    return cases


@checks("softmax", "tile_step")
def check_tile_step(step_fn: Callable, seed: int = 0) -> str:
    """Check a learner's ``tile_step(m, l, acc, s, v) -> (m, l, acc)`` over whole key sequences.

    The checker starts every row at ``m = -inf``, ``l = 0``, ``acc = 0``, feeds
    the tiles of each case in order, turns the result into ``(o, lse)`` with
    :func:`finish` and compares it with one pass over all keys.

    Raises:
        AssertionError: naming the first case where the result is wrong.
    """
    cases = _tile_cases(seed)
    for desc, hint, q, k, v, vis, sizes in cases:
        s_all = q @ k.T
        if vis is not None:
            s_all = s_all.masked_fill(~vis, float("-inf"))
        rows = len(q)
        m = torch.full((rows,), float("-inf"), dtype=torch.float64)
        l = torch.zeros(rows, dtype=torch.float64)
        acc = torch.zeros(rows, v.shape[1], dtype=torch.float64)
        start = 0
        for i, n in enumerate(sizes):
            s, vt = s_all[:, start:start + n], v[start:start + n]
            try:
                m, l, acc = step_fn(m, l, acc, s, vt)
            except Unsolved:  # a stub: the exercise waits
                raise
            except Exception as e:
                raise AssertionError(f"{desc}: tile_step raised {type(e).__name__} on tile {i}: {e}") from e
            top = s_all[:, :start + n].max(dim=1).values
            if not torch.equal(torch.as_tensor(m).double(), top):
                want, got = ([round(x, 3) for x in t.tolist()] for t in (top, torch.as_tensor(m)))
                raise AssertionError(f"{desc}: after tile {i}, m should be the running maximum of the scores "
                                     f"seen so far, {want}; got {got}")
            if torch.isnan(torch.as_tensor(l)).any() or torch.isnan(torch.as_tensor(acc)).any():
                raise AssertionError(f"{desc}: NaN in l or acc after tile {i}: a row that has seen no visible "
                                     f"key has m = -inf, and e^(-inf - (-inf)) is NaN; shift by 0 there")
            start += n
        _compare("tile_step", finish(m, l, acc), attend(q, k, v, vis), desc, hint)
    return f"passed: tile_step over {len(cases)} tilings matches one pass over all keys"
