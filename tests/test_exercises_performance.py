"""The checkers of notebook 06's exercises pass the solutions and reject plausible wrong answers."""

import pytest

from splitkv.teaching.exercises.performance import check_floor_us, check_gather_gap, recorded_rows
from splitkv.testing import MODEL_SHAPES
from splitkv.teaching.exercises import solution_of

solution_floor_us = solution_of(check_floor_us)
solution_gather_gap = solution_of(check_gather_gap)


def test_floor_solution_passes_and_reproduces_the_recorded_floors():
    assert check_floor_us(solution_floor_us).startswith("passed")
    bandwidth, rows = recorded_rows()
    for r in rows:
        kv_bytes = 1 if r["kv_dtype"].startswith("float8") else 2
        assert solution_floor_us(MODEL_SHAPES[r["model"]], r["batch"], r["prefix"], bandwidth, kv_bytes) == \
            pytest.approx(r["floor_us"], rel=1e-9)


@pytest.mark.parametrize("wrong, says", [
    (lambda s, b, p, bw, kb=2: b * p * s.num_kv_heads * s.head_dim * kb / bw * 1e6, "K row and the V row"),
    (lambda s, b, p, bw, kb=2: b * p * s.num_q_heads * 2 * s.head_dim * kb / bw * 1e6, "KV head"),
    (lambda s, b, p, bw, kb=2: b * p * s.num_kv_heads * 2 * s.head_dim * kb / bw, "seconds"),
    (lambda s, b, p, bw, kb=2: b * p * s.num_kv_heads * 2 * s.head_dim * 2 / bw * 1e6, "expected"),
])
def test_floor_checker_rejects_wrong_answers(wrong, says):
    with pytest.raises(AssertionError, match=says):
        check_floor_us(wrong)


def test_gather_gap_solution_passes():
    assert check_gather_gap(solution_gather_gap).startswith("passed")


@pytest.mark.parametrize("wrong, says", [
    (lambda r: (r["gather_floor_us"] / r["impls"]["splitkv"]["graph"],
                r["impls"]["splitkv"]["graph"] - r["gather_floor_us"]), "upside down"),
    (lambda r: (r["impls"]["splitkv"]["graph"] / r["floor_us"],
                r["impls"]["splitkv"]["graph"] - r["floor_us"]), "bandwidth floor"),
    (lambda r: (r["impls"]["splitkv"]["eager"] / r["gather_floor_us"],
                r["impls"]["splitkv"]["eager"] - r["gather_floor_us"]), "eager"),
    (lambda r: (r["impls"]["splitkv"]["graph"] / r["gather_floor_us"],
                r["gather_floor_us"] - r["impls"]["splitkv"]["graph"]), "excess"),
    (lambda r: r["impls"]["splitkv"]["graph"] / r["gather_floor_us"], "tuple"),
])
def test_gather_gap_checker_rejects_wrong_answers(wrong, says):
    with pytest.raises(AssertionError, match=says):
        check_gather_gap(wrong)


@pytest.mark.parametrize("checker, solution", [(check_floor_us, solution_floor_us),
                                               (check_gather_gap, solution_gather_gap)])
def test_an_unwritten_stub_waits_and_hands_on_the_solution(monkeypatch, capsys, checker, solution):
    from splitkv.teaching.exercises import exercise, todo

    monkeypatch.delenv("SPLITKV_SOLUTIONS", raising=False)

    def stub(*args, **kwargs):
        todo("it")

    assert solution_of(checker) is solution
    assert exercise(stub, checker) is solution
    out = capsys.readouterr().out
    assert out.startswith("waiting:") and "passed" not in out
