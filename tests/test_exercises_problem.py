"""The notebook 01 checkers accept the solutions and reject plausible wrong answers, saying why."""

import pytest

from splitkv.teaching.exercises.problem import check_bytes_in_flight, check_kv_bytes
from splitkv.teaching.exercises import solution_of

solution_bytes_in_flight = solution_of(check_bytes_in_flight)
solution_kv_bytes = solution_of(check_kv_bytes)


def test_solutions_pass():
    assert check_kv_bytes(solution_kv_bytes).startswith("passed")
    assert check_kv_bytes(solution_kv_bytes, seed=5).startswith("passed")
    assert check_bytes_in_flight(solution_bytes_in_flight).startswith("passed")


@pytest.mark.parametrize("wrong, says", [
    (lambda p: sum(p.prefix_lens) * p.num_q_heads * (p.head_dim + p.v_head_dim) * p.k_buffer.element_size(),
     "use H_kv"),
    (lambda p: sum(p.prefix_lens) * p.num_kv_heads * p.head_dim * p.k_buffer.element_size(), "count K and V"),
    (lambda p: sum(p.prefix_lens) * p.num_kv_heads * 2 * p.head_dim * p.k_buffer.element_size(), "v_head_dim"),
    (lambda p: sum(p.prefix_lens) * p.num_kv_heads * (p.head_dim + p.v_head_dim) * 2, "fp8"),
    (lambda p: (sum(p.prefix_lens) + sum(p.extend_lens)) * p.num_kv_heads * (p.head_dim + p.v_head_dim)
     * p.k_buffer.element_size(), "prefix tokens only"),
])
def test_kv_bytes_checker_rejects(wrong, says):
    with pytest.raises(AssertionError, match=says):
        check_kv_bytes(wrong)


@pytest.mark.parametrize("wrong, says", [
    (lambda kv, t_us, lat_ns: kv / t_us * lat_ns, "factor 1e3"),
    (lambda kv, t_us, lat_ns: kv / (t_us * 1e-6) / (lat_ns * 1e-9), "in seconds on both sides"),
])
def test_bytes_in_flight_checker_rejects(wrong, says):
    with pytest.raises(AssertionError, match=says):
        check_bytes_in_flight(wrong)


def test_a_stub_waits_and_hands_on_the_solution(monkeypatch, capsys):
    from splitkv.teaching.exercises import exercise, is_stub, todo

    def kv_bytes(p):
        todo("kv_bytes")

    monkeypatch.delenv("SPLITKV_SOLUTIONS", raising=False)
    assert is_stub(kv_bytes) and not is_stub(solution_kv_bytes)
    assert exercise(kv_bytes, check_kv_bytes) is solution_kv_bytes
    printed = capsys.readouterr().out
    assert printed.startswith("waiting: kv_bytes") and "passed" not in printed
    monkeypatch.setenv("SPLITKV_SOLUTIONS", "1")
    assert exercise(kv_bytes, check_kv_bytes) is solution_kv_bytes
    assert "passed" in capsys.readouterr().out


@pytest.mark.parametrize("check", [check_kv_bytes, check_bytes_in_flight])
def test_checkers_know_their_solution(check):
    assert check(solution_of(check)).startswith("passed")
