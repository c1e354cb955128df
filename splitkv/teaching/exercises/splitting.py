"""Checkers for notebook 03: the slice kernel's online-softmax step, the slicing rule, the latency model.

* :func:`check_tile_step` judges a ``@triton.jit`` function
  ``tile_step(m_i, l_i, acc, s, v) -> (m_i, l_i, acc)``: one online-softmax
  update over a tile of base-2 scores, as the notebook's slice kernel calls it;
* :func:`check_slicing` judges ``slicing(prefix_len, n_splits, block_n,
  min_split) -> (split_len, n_used)``, the kernel's rule for cutting a prefix
  (the same rule as :func:`splitkv.schedule.slicing`);
* :func:`check_latency_fit` judges ``fit_latency(n, t) -> (a, b)``, the least-
  squares fit of ``t = a + b / n`` to a split-count sweep.

Each runs the learner's function on fresh inputs and the tricky cases, and
raises an ``AssertionError`` that names what is wrong and hints at the fix.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence, Tuple

import torch
import triton
import triton.language as tl

from . import Unsolved, checks, is_stub
from .. import lessons
from ...schedule import cdiv
from ...schedule import slicing as _kernel_slicing
from ...testing import relative_error

__all__ = ["check_tile_step", "check_slicing", "check_latency_fit"]


# --- the online-softmax step, in Triton --------------------------------------------------------

@triton.jit
def _step_probe(S, V, M_Out, L_Out, Acc_Out, n_tiles, STEP: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DV: tl.constexpr):
    """Run ``STEP`` over ``n_tiles`` tiles of scores ``S [n_tiles, BLOCK_M, BLOCK_N]`` and values
    ``V [n_tiles * BLOCK_N, DV]`` from the empty state; store the final ``(m, l, acc)``."""
    r = tl.arange(0, BLOCK_M)
    n = tl.arange(0, BLOCK_N)
    dv = tl.arange(0, DV)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV], tl.float32)
    for t in range(n_tiles):
        s = tl.load(S + (t * BLOCK_M + r)[:, None] * BLOCK_N + n[None, :])
        v = tl.load(V + (t * BLOCK_N + n)[:, None] * DV + dv[None, :])
        m_i, l_i, acc = STEP(m_i, l_i, acc, s, v)
    tl.store(M_Out + r, m_i)
    tl.store(L_Out + r, l_i)
    tl.store(Acc_Out + r[:, None] * DV + dv[None, :], acc)


_ROWS, _KEYS, _DV = 16, 16, 16
_RESCALE_L = ("l_i: rescale the old sum by alpha = 2^(m_old - m_new), then add the row sums of the new weights "
              "2^(s - m_new); the scores are in base 2, so exp2, not exp")
_RESCALE_ACC = "acc: rescale the old acc by alpha, row by row, then add the new weights times v (a tl.dot)"
_EMPTY = ("a row that has seen no visible key keeps m = -inf, and 2^(-inf - (-inf)) is NaN: "
          "shift by 0 where the new maximum is -inf")
_SHIFT = "exponentiate s - m_new (2^s alone overflows float32 for s > 128)"


def _step_cases(seed: int):
    """(description, hint, scores [tiles, rows, keys] float32 with -inf, values float16)."""
    gen = torch.Generator().manual_seed(seed)
    cases = []
    tiles = 4
    # Every row's scores sorted ascending across tiles: the maximum grows at every step.
    s = torch.randn(_ROWS, tiles * _KEYS, generator=gen).sort(dim=1).values * 3
    cases.append(("a maximum that grows from tile to tile", _RESCALE_ACC, s))
    # Rows that see nothing yet (row 0, tile 0), nothing at all (row 2), only the last tile (row 5).
    s = torch.randn(_ROWS, tiles * _KEYS, generator=gen) * 2
    s[0, :_KEYS] = float("-inf")
    s[2] = float("-inf")
    s[5, :-_KEYS] = float("-inf")
    s[7, torch.randperm(tiles * _KEYS, generator=gen)[:40]] = float("-inf")
    cases.append(("rows that see no key in the first tiles, or none at all", _EMPTY, s))
    # Scores near 200 in base 2: 2^s overflows float32 unless the step subtracts the maximum.
    s = 200 + torch.randn(_ROWS, tiles * _KEYS, generator=gen) * 4
    cases.append(("large scores (2^s overflows float32)", _SHIFT, s))
    out = []
    for desc, hint, scores in cases:
        v = torch.randn(tiles * _KEYS, _DV, generator=gen).half()
        tiled = scores.view(_ROWS, tiles, _KEYS).transpose(0, 1).contiguous()  # [tiles, rows, keys]
        out.append((desc, hint, tiled, v))
    return out


def _run_step(step_fn, s: torch.Tensor, v: torch.Tensor):
    """The final ``(m, l, acc)`` of ``step_fn`` over the tiles of ``s`` (run on :data:`lessons.DEVICE`)."""
    dev = lessons.DEVICE
    m = torch.full((_ROWS,), float("nan"), device=dev)
    l = torch.full((_ROWS,), float("nan"), device=dev)
    acc = torch.full((_ROWS, _DV), float("nan"), device=dev)
    _step_probe[(1,)](s.to(dev), v.to(dev), m, l, acc, s.shape[0], STEP=step_fn,
                      BLOCK_M=_ROWS, BLOCK_N=_KEYS, DV=_DV)
    return m.cpu().double(), l.cpu().double(), acc.cpu().double()


@checks("kernels", "tile_step")
def check_tile_step(step_fn, seed: int = 0) -> str:
    """Check a learner's ``@triton.jit`` ``tile_step(m_i, l_i, acc, s, v)`` against float64.

    The checker starts every row empty (``m = -inf``, ``l = 0``, ``acc = 0``),
    feeds four tiles of base-2 scores (``-inf`` where hidden) and float16
    values, and compares the final state, normalised, with a float64 softmax
    over all the scores: ``o`` within the float16 budget, ``lse`` within 1e-4.

    Raises:
        AssertionError: naming the first case where the state is wrong.
    """
    if is_stub(step_fn):
        raise Unsolved("write tile_step in your_kernels.py: replace its todo(...) line by your code")
    ln2 = math.log(2.0)
    cases = _step_cases(seed)
    for desc, hint, s, v in cases:
        try:
            m, l, acc = _run_step(step_fn, s, v)
        except Unsolved:  # a stub: the exercise waits
            raise
        except Exception as e:  # a crash is a wrong answer too; say where
            raise AssertionError(f"{desc}: tile_step raised {type(e).__name__}: {e}") from e
        scores = s.transpose(0, 1).reshape(_ROWS, -1).double()  # [rows, all keys], base 2
        top = scores.max(dim=1).values
        empty = torch.isinf(top)
        if torch.isnan(l).any() or torch.isnan(acc).any():
            raise AssertionError(f"{desc}: NaN in l_i or acc. Hint: {_EMPTY if empty.any() else hint}")
        if not torch.equal(m, top):
            raise AssertionError(f"{desc}: m_i should end as each row's largest score, "
                                 f"{[round(x, 2) for x in top.tolist()[:4]]}..., got "
                                 f"{[round(x, 2) for x in m.tolist()[:4]]}...: m_new = tl.maximum(m_i, tl.max(s, 1))")
        if (l[empty] != 0).any() or (acc[empty] != 0).any():
            raise AssertionError(f"{desc}: a row that sees no key should keep l_i = 0 and acc = 0. Hint: {_EMPTY}")
        if torch.isinf(l).any() or torch.isinf(acc).any():
            raise AssertionError(f"{desc}: l_i or acc overflowed to inf. Hint: {_SHIFT}")
        lse_want = torch.logsumexp(scores * ln2, dim=1) / ln2  # base 2
        seen = ~empty
        lse_got = m[seen] + torch.log2(l[seen])
        lse_err = (lse_got - lse_want[seen]).abs().max().item()
        if not lse_err < 1e-4:
            raise AssertionError(f"{desc}: the row sums l_i are wrong (log2 of the softmax denominator off by "
                                 f"up to {lse_err:.2g}). Hint: {_RESCALE_L}")
        probs = torch.softmax(scores[seen] * ln2, dim=1)
        o_want = probs @ v.double()
        o_got = acc[seen] / l[seen, None]
        err = relative_error(o_got, o_want)
        budget = lessons.TOLERANCE[torch.float16]
        if not err < budget:
            raise AssertionError(f"{desc}: the output acc / l_i is off (relative error {err:.2g}, budget "
                                 f"{budget:g}). Hint: {_RESCALE_ACC}")
    return f"passed: tile_step over {len(cases)} cases of 4 tiles matches a float64 softmax, empty rows included"


# --- the slicing rule ----------------------------------------------------------------------------

_TILES = "round the even share cdiv(P, n_splits) up to whole BLOCK_N tiles, then take at least min_split"
_USED = "n_used = cdiv(P, split_len): the slices that get keys; the rest of the grid's slices would be empty"
_ONE = "an empty prefix still gets one program (it does the draft block): n_used = max(1, ...)"
_MIN = "a slice is never shorter than min_split keys: split_len = max(rounded share, min_split)"

#: (prefix_len, n_splits, block_n, min_split): short and long prefixes, an empty one, min_split that binds
_SLICING_CASES = [
    (4100, 32, 128, 128), (4096, 32, 128, 128), (4100, 8, 128, 128), (300, 8, 128, 128), (1000, 32, 128, 128),
    (100, 8, 128, 128), (4100, 8, 64, 1024), (65536, 64, 128, 2048), (0, 8, 128, 128), (77, 5, 16, 0),
    (16384, 16, 128, 128),
]


def _slicing_hint(P: int, min_split: int, got: Tuple[int, int], want: Tuple[int, int]) -> str:
    """What the learner most likely missed, from how ``got`` differs from ``want``."""
    if got[0] == want[0]:
        return _ONE if P == 0 else _USED
    if got[0] < min_split:
        return _MIN
    return _TILES


@checks("splitting", "slicing")
def check_slicing(slicing_fn: Callable[[int, int, int, int], Tuple[int, int]]) -> str:
    """Check a learner's ``slicing(prefix_len, n_splits, block_n, min_split) -> (split_len, n_used)``.

    Compared with the kernel's own rule (:func:`splitkv.schedule.slicing`) on
    short and long prefixes, an empty one, and ``min_split`` that binds.

    Raises:
        AssertionError: naming the first case where the answer is wrong.
    """
    for P, n, block_n, min_split in _SLICING_CASES:
        case = f"P = {P}, n_splits = {n}, BLOCK_N = {block_n}, min_split = {min_split}"
        want = _kernel_slicing(P, n, block_n, min_split)
        try:
            got = slicing_fn(P, n, block_n, min_split)
        except Unsolved:  # a stub: the exercise waits
            raise
        except Exception as e:
            hint = _ONE if P == 0 else _TILES
            raise AssertionError(f"{case}: slicing raised {type(e).__name__}: {e}. Hint: {hint}") from e
        if not (isinstance(got, tuple) and len(got) == 2):
            raise AssertionError(f"{case}: slicing should return a pair (split_len, n_used), got {got!r}")
        got = tuple(int(x) for x in got)
        if got != want:
            raise AssertionError(f"{case}: expected (split_len, n_used) = {want}, got {got}. "
                                 f"Hint: {_slicing_hint(P, min_split, got, want)}")
    return f"passed: slicing matches the kernel's rule in {len(_SLICING_CASES)} cases, P = 4100 in 32 slices included"


# --- the latency model ---------------------------------------------------------------------------

def _expected_fit_latency(n: torch.Tensor, t: torch.Tensor) -> Tuple[float, float]:
    """Least-squares ``(a, b)`` of ``t = a + b / n``: a straight line in ``x = 1 / n``."""
    n, t = torch.as_tensor(n, dtype=torch.float64), torch.as_tensor(t, dtype=torch.float64)
    design = torch.stack([torch.ones_like(n), 1.0 / n], dim=1)
    a, b = torch.linalg.lstsq(design, t[:, None]).solution.flatten().tolist()
    return a, b


_LINE = "t = a + b / n is a straight line in x = 1 / n: fit t against x, with a the constant term"
_LSQ = "use every point: least squares over all (1 / n, t), e.g. torch.linalg.lstsq or numpy.polyfit(1 / n, t, 1)"


@checks("splitting", "fit_latency")
def check_latency_fit(fit_fn: Callable[[torch.Tensor, torch.Tensor], Tuple[float, float]],
                      sweep: Sequence[Tuple[float, float]] = (), seed: int = 0) -> str:
    """Check a learner's ``fit_latency(n, t) -> (a, b)`` (float64 tensors in, two floats out).

    Cases: exact data from a known model, noisy data at irregular ``n``, and
    ``sweep`` (pairs ``(n, t)``, e.g. the measured H200 sweep), each compared
    with the least-squares answer to 1e-6.

    Raises:
        AssertionError: naming the first case where the fit is wrong.
    """
    gen = torch.Generator().manual_seed(seed)
    n1 = torch.tensor([1.0, 2, 4, 8, 16], dtype=torch.float64)
    n2 = torch.tensor([1.0, 2, 3, 5, 6, 9, 12, 16], dtype=torch.float64)
    a0, b0 = 5 + 20 * torch.rand((), generator=gen).item(), 100 + 300 * torch.rand((), generator=gen).item()
    noise = torch.randn(len(n2), generator=gen, dtype=torch.float64) * 3
    cases = [(f"exact data from t = {a0:.2f} + {b0:.2f} / n", _LINE, n1, a0 + b0 / n1),
             ("noisy data at irregular n", _LSQ, n2, a0 + b0 / n2 + noise)]
    if sweep:
        ns, ts = zip(*sweep)
        cases.append(("the measured sweep", _LSQ, torch.tensor(ns, dtype=torch.float64),
                      torch.tensor(ts, dtype=torch.float64)))
    for desc, hint, n, t in cases:
        want = _expected_fit_latency(n, t)
        try:
            got = fit_fn(n.clone(), t.clone())
        except Unsolved:  # a stub: the exercise waits
            raise
        except Exception as e:
            raise AssertionError(f"{desc}: fit_latency raised {type(e).__name__}: {e}") from e
        try:
            a, b = (float(x) for x in got)
        except (TypeError, ValueError):
            raise AssertionError(f"{desc}: fit_latency should return two numbers (a, b), got {got!r}") from None
        if not (math.isclose(a, want[0], rel_tol=1e-6, abs_tol=1e-6) and math.isclose(b, want[1], rel_tol=1e-6)):
            raise AssertionError(f"{desc}: expected (a, b) = ({want[0]:.3f}, {want[1]:.3f}), got ({a:.3f}, {b:.3f}). "
                                 f"Hint: {hint}")
    return f"passed: fit_latency gives the least-squares (a, b) in {len(cases)} cases"
