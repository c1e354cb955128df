"""The notebook 02 checkers accept the solutions and reject plausible wrong answers, saying why."""

import pytest
import torch

from splitkv.teaching.exercises.softmax import check_merge, check_tile_step
from splitkv.teaching.exercises import solution_of

solution_merge = solution_of(check_merge)
solution_tile_step = solution_of(check_tile_step)


def _stack(states):
    return torch.stack([o for o, _ in states]), torch.stack([lse for _, lse in states])


def merge_textbook(states):
    # Shifts by the max, but neither guards an all-empty row nor selects: 0 * NaN leaks.
    o, lse = _stack(states)
    m = lse.max(dim=0).values
    w = torch.exp(lse - m)
    return (w[..., None] * o).sum(0) / w.sum(0)[:, None], m + torch.log(w.sum(0))


def merge_select_unguarded(states):
    # Selects, but shifts an all-empty row by -inf: e^(-inf - (-inf)) = NaN.
    o, lse = _stack(states)
    m = lse.max(dim=0).values
    w = torch.exp(lse - m)
    den = w.sum(0)
    num = torch.where(w[..., None] > 0, w[..., None] * o, 0.0).sum(0)
    return num / den[:, None], m + torch.log(den)


def merge_unshifted(states):
    # No running maximum: e^lse overflows for large scores.
    o, lse = _stack(states)
    w = torch.exp(lse)
    o = torch.where(w[..., None] > 0, w[..., None] * o, 0.0).sum(0) / w.sum(0).clamp_min(1e-300)[:, None]
    return o, torch.log(w.sum(0))


def merge_lse_is_max(states):
    # The right o, but the merged lse taken as the largest part's.
    o, _ = solution_merge(states)
    return o, _stack(states)[1].max(dim=0).values


def merge_unnormalised(states):
    # Weights e^(lse_i - m) without dividing by their sum.
    o, lse = _stack(states)
    m = lse.max(dim=0).values
    m = torch.where(torch.isinf(m), 0.0, m)
    w = torch.exp(lse - m)
    return torch.where(w[..., None] > 0, w[..., None] * o, 0.0).sum(0), m + torch.log(w.sum(0))


def merge_guarded_multiply(states):
    # Guards the shift but multiplies: the empty state's NaN o leaks.
    o, lse = _stack(states)
    m = lse.max(dim=0).values
    m = torch.where(torch.isinf(m), 0.0, m)
    w = torch.exp(lse - m)
    den = w.sum(0)
    return (w[..., None] * o).sum(0) / torch.where(den > 0, den, 1.0)[:, None], m + torch.log(den)


def test_merge_solution_passes():
    assert check_merge(solution_merge).startswith("passed")
    assert check_merge(solution_merge, seed=7).startswith("passed")


@pytest.mark.parametrize("wrong, says", [
    (merge_textbook, "rather than multiply"),
    (merge_select_unguarded, "shift by 0 there"),
    (merge_unshifted, "subtract the largest"),
    (merge_lse_is_max, "lse is off"),
    (merge_unnormalised, "o is off"),
    (merge_guarded_multiply, "rather than multiply"),
])
def test_merge_checker_rejects(wrong, says):
    with pytest.raises(AssertionError, match=says):
        check_merge(wrong)


def test_merge_checker_rejects_input_mutation():
    def merge_in_place(states):
        for o, lse in states:
            o.nan_to_num_(0.0)
        return solution_merge(states)

    with pytest.raises(AssertionError, match="modified its input"):
        check_merge(merge_in_place)


def step_no_rescale(m, l, acc, s, v):
    # Rescales l but forgets acc.
    m_new = torch.maximum(m, s.max(dim=1).values)
    shift = torch.where(torch.isinf(m_new), 0.0, m_new)
    alpha = torch.exp(m - shift)
    p = torch.exp(s - shift[:, None])
    return m_new, l * alpha + p.sum(1), acc + p @ v


def step_unguarded(m, l, acc, s, v):
    # The textbook step: e^(-inf - (-inf)) = NaN for rows that have seen nothing.
    m_new = torch.maximum(m, s.max(dim=1).values)
    alpha = torch.exp(m - m_new)
    p = torch.exp(s - m_new[:, None])
    return m_new, l * alpha + p.sum(1), acc * alpha[:, None] + p @ v


def step_stale_max(m, l, acc, s, v):
    # Right l and acc, but hands back the old maximum.
    _, l, acc = solution_tile_step(m, l, acc, s, v)
    return m, l, acc


def test_tile_step_solution_passes():
    assert check_tile_step(solution_tile_step).startswith("passed")
    assert check_tile_step(solution_tile_step, seed=3).startswith("passed")


@pytest.mark.parametrize("wrong, says", [
    (step_no_rescale, "multiply both l and acc"),
    (step_unguarded, "shift by 0"),
    (step_stale_max, "running maximum"),
])
def test_tile_step_checker_rejects(wrong, says):
    with pytest.raises(AssertionError, match=says):
        check_tile_step(wrong)


def test_a_stub_waits_even_inside_the_checker_s_try(monkeypatch, capsys):
    # check_merge turns a crash into an AssertionError; an unwritten stub must still read as waiting.
    from splitkv.teaching.exercises import exercise, todo

    def my_merge(states):
        todo("my_merge")

    monkeypatch.delenv("SPLITKV_SOLUTIONS", raising=False)
    assert exercise(my_merge, check_merge) is solution_merge
    assert capsys.readouterr().out.startswith("waiting: my_merge")
