"""The notebook 03 checkers accept the solutions and reject plausible wrong answers, saying why."""

import pytest
import torch

import splitkv  # noqa: F401  (sets TRITON_INTERPRET=1 before triton is imported, on a CPU)
import triton
import triton.language as tl

from splitkv.teaching.exercises.splitting import check_latency_fit, check_slicing, check_tile_step
from splitkv.teaching.exercises import solution_of

solution_fit_latency = solution_of(check_latency_fit)
solution_slicing = solution_of(check_slicing)
solution_tile_step = solution_of(check_tile_step)

SWEEP = [(1, 314.0), (2, 158.7), (4, 90.5), (8, 55.3), (16, 40.5)]


# --- tile_step ---------------------------------------------------------------------------------

@triton.jit
def step_acc_not_rescaled(m_i, l_i, acc, s, v):
    m_new = tl.maximum(m_i, tl.max(s, 1))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - shift)
    p = tl.exp2(s - shift[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), acc + tl.dot(p.to(v.dtype), v)


@triton.jit
def step_sum_not_rescaled(m_i, l_i, acc, s, v):
    m_new = tl.maximum(m_i, tl.max(s, 1))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - shift)
    p = tl.exp2(s - shift[:, None])
    return m_new, l_i + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def step_natural_exp(m_i, l_i, acc, s, v):
    m_new = tl.maximum(m_i, tl.max(s, 1))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - shift)
    p = tl.exp(s - shift[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def step_unguarded(m_i, l_i, acc, s, v):
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


def test_tile_step_solution_passes():
    assert check_tile_step(solution_tile_step).startswith("passed")
    assert check_tile_step(solution_tile_step, seed=5).startswith("passed")


@pytest.mark.parametrize("wrong, says", [
    (step_acc_not_rescaled, "rescale the old acc by alpha"),
    (step_sum_not_rescaled, "the row sums l_i are wrong"),
    (step_natural_exp, "so exp2, not exp"),
    (step_unguarded, "shift by 0 where the new maximum is -inf"),
])
@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the unguarded step's NaN, in NumPy
def test_tile_step_checker_rejects(wrong, says):
    with pytest.raises(AssertionError, match=says):
        check_tile_step(wrong)


# --- slicing -----------------------------------------------------------------------------------

def cdiv(a, b):
    return -(-a // b)


def slicing_not_rounded(P, n_splits, block_n, min_split):
    # The even share without rounding to whole key tiles.
    split_len = max(cdiv(P, n_splits), min_split)
    return split_len, max(1, cdiv(P, split_len))


def slicing_no_min(P, n_splits, block_n, min_split):
    split_len = cdiv(cdiv(P, n_splits), block_n) * block_n
    return split_len, max(1, cdiv(P, split_len)) if split_len else 1


def slicing_all_used(P, n_splits, block_n, min_split):
    # Every slice of the grid counted as used.
    return max(cdiv(cdiv(P, n_splits), block_n) * block_n, min_split), n_splits


def slicing_empty_zero(P, n_splits, block_n, min_split):
    split_len = max(cdiv(cdiv(P, n_splits), block_n) * block_n, min_split)
    return split_len, cdiv(P, split_len)


def test_slicing_solution_passes():
    assert check_slicing(solution_slicing).startswith("passed")
    assert solution_slicing(4100, 32, 128, 128) == (256, 17)


@pytest.mark.parametrize("wrong, says", [
    (slicing_not_rounded, "P = 4100, n_splits = 32.*whole BLOCK_N tiles"),
    (slicing_no_min, "never shorter than min_split"),
    (slicing_all_used, "n_used = cdiv"),
    (slicing_empty_zero, "an empty prefix still gets one program"),
])
def test_slicing_checker_rejects(wrong, says):
    with pytest.raises(AssertionError, match=says):
        check_slicing(wrong)


# --- the latency fit ---------------------------------------------------------------------------

def fit_linear_in_n(n, t):
    # t = a + b n: the wrong axis.
    design = torch.stack([torch.ones_like(n), n], dim=1)
    return tuple(torch.linalg.lstsq(design, t[:, None]).solution.flatten().tolist())


def fit_two_points(n, t):
    # Through the first and last points only.
    x = 1.0 / n
    b = ((t[0] - t[-1]) / (x[0] - x[-1])).item()
    return (t[-1] - b * x[-1]).item(), b


def fit_swapped(n, t):
    # numpy.polyfit's order (slope first) taken as (a, b).
    return tuple(reversed(solution_fit_latency(n, t)))


def fit_no_intercept(n, t):
    x = 1.0 / n
    return 0.0, ((x * t).sum() / (x * x).sum()).item()


def test_latency_solution_passes():
    assert check_latency_fit(solution_fit_latency, SWEEP).startswith("passed")
    a, b = solution_fit_latency(torch.tensor([1.0, 2, 4, 8, 16]), torch.tensor([314.0, 158.7, 90.5, 55.3, 40.5]))
    assert 18 < a < 19 and 292 < b < 293


@pytest.mark.parametrize("wrong, says", [
    (fit_linear_in_n, "straight line in x = 1 / n"),
    (fit_two_points, "use every point"),
    (fit_swapped, "a the constant term"),
    (fit_no_intercept, "straight line in x = 1 / n"),
])
def test_latency_checker_rejects(wrong, says):
    with pytest.raises(AssertionError, match=says):
        check_latency_fit(wrong, SWEEP)


def test_a_triton_stub_waits(monkeypatch, capsys):
    from splitkv.teaching.exercises import Unsolved, exercise, todo

    @triton.jit
    def tile_step(m_i, l_i, acc, s, v):
        todo("tile_step")

    with pytest.raises(Unsolved):
        check_tile_step(tile_step)
    monkeypatch.delenv("SPLITKV_SOLUTIONS", raising=False)
    assert exercise(tile_step, check_tile_step) is solution_tile_step
    assert capsys.readouterr().out.startswith("waiting: tile_step")
