"""The checker of notebook 07's exercise passes the solution and rejects plausible wrong answers."""

import math

import pytest

from splitkv.teaching.exercises.parallel import StepModel, check_prefix_for_speedup
from splitkv.teaching.exercises import solution_of

solution_prefix_for_speedup = solution_of(check_prefix_for_speedup)


def test_solution_passes():
    assert check_prefix_for_speedup(solution_prefix_for_speedup).startswith("passed")


def test_break_even_of_two_gpus_is_twice_the_exchange():
    # W = 2, speedup 1: a + x = a + x/2 + c, so the one-GPU read time x is 2c, whatever a.
    m = StepModel(fixed_us=15.0, bandwidth=3.5e12, comm_us=16.0, bytes_per_token=4096)
    p = solution_prefix_for_speedup(m, 2)
    assert p * 4096 / 3.5e12 * 1e6 == pytest.approx(32.0)
    assert m.time_us(p, 1) == pytest.approx(m.time_us(p, 2))
    assert m.speedup(10 * p, 2) > 1 > m.speedup(p / 10, 2)
    assert solution_prefix_for_speedup(m, 2, 2.0) == math.inf


def _tokens(m, read_us):
    return read_us * 1e-6 * m.bandwidth / m.bytes_per_token


@pytest.mark.parametrize("wrong, says", [
    # the fixed cost dropped: right at speedup 1 only
    (lambda m, w, s=1.0: math.inf if s >= w else _tokens(m, s * m.comm_us / (1 - s / w)), "fixed cost"),
    # bytes instead of tokens
    (lambda m, w, s=1.0: solution_prefix_for_speedup(m, w, s) * m.bytes_per_token, "bytes"),
    # no guard for a speedup out of reach: a negative prefix
    (lambda m, w, s=1.0: _tokens(m, ((s - 1) * m.fixed_us + s * m.comm_us) / (1 - s / w)), "inf|>= 0"),
    # the exchange dropped: a break-even of 0 tokens
    (lambda m, w, s=1.0: math.inf if s >= w else _tokens(m, (s - 1) * m.fixed_us / (1 - s / w)), "exchange"),
    # some other slip: the checker says what speedup the answer gives
    (lambda m, w, s=1.0: math.inf if s >= w else 1.7 * solution_prefix_for_speedup(m, w, s), r"model\.speedup"),
    # microseconds taken as seconds
    (lambda m, w, s=1.0: solution_prefix_for_speedup(m, w, s) * 1e6, "1e6"),
])
def test_checker_rejects_wrong_answers(wrong, says):
    with pytest.raises(AssertionError, match=says):
        check_prefix_for_speedup(wrong)


def test_an_unwritten_stub_waits_and_hands_on_the_solution(monkeypatch, capsys):
    # The checker turns a learner's exception into a message, but not the stub's Unsolved: exercise() reports it.
    from splitkv.teaching.exercises import exercise, todo

    monkeypatch.delenv("SPLITKV_SOLUTIONS", raising=False)

    def prefix_for_speedup(model, world_size, speedup=1.0):
        todo("prefix_for_speedup")

    assert exercise(prefix_for_speedup, check_prefix_for_speedup) is solution_prefix_for_speedup
    out = capsys.readouterr().out
    assert out.startswith("waiting:") and "passed" not in out
