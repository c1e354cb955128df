"""The notebook 04 checkers accept the solutions and reject plausible wrong answers, saying why."""

import pytest

from splitkv.teaching.exercises.one_launch import atomic_add, check_arrive, check_who_merges
from splitkv.teaching.exercises import solution_of

solution_arrive = solution_of(check_arrive)
solution_who_merges = solution_of(check_who_merges)


def arrive_no_reset(counters, tile, n_used):
    # The right test, but the counter is never set back: the next launch starts from n_used.
    return atomic_add(counters, tile, 1) == n_used - 1


def arrive_off_by_one(counters, tile, n_used):
    # Compares the count before the add with n_used: nobody is ever last.
    if atomic_add(counters, tile, 1) == n_used:
        counters[tile] = 0
        return True
    return False


def arrive_first_merges(counters, tile, n_used):
    # The first to arrive merges, before the others have published.
    done = atomic_add(counters, tile, 1)
    if done == n_used - 1:
        counters[tile] = 0
    return done == 0


def arrive_reset_early(counters, tile, n_used):
    # Resets when the first program arrives: the count restarts and never reaches n_used - 1.
    done = atomic_add(counters, tile, 1)
    if done == 0:
        counters[tile] = 0
    return done == n_used - 1


def arrive_returns_count(counters, tile, n_used):
    # Returns the count itself instead of a yes/no answer.
    return atomic_add(counters, tile, 1)


def test_arrive_solution_passes():
    assert check_arrive(solution_arrive).startswith("passed")
    assert check_arrive(solution_arrive, seed=5).startswith("passed")


@pytest.mark.parametrize("wrong, says", [
    (arrive_no_reset, "left there by launch 1"),
    (arrive_off_by_one, "never merged"),
    (arrive_first_merges, "not yet published"),
    (arrive_reset_early, "never merged"),
    (arrive_returns_count, "should return True"),
])
def test_arrive_checker_rejects(wrong, says):
    with pytest.raises(AssertionError, match=says):
        check_arrive(wrong)


def test_who_merges_solution_passes():
    assert check_who_merges(solution_who_merges()).startswith("passed")


@pytest.mark.parametrize("answers, says", [
    (dict(A="last program", B="last program", C="merge programs"), "B .*131072 values"),
    (dict(A="last program", B="merge programs", C="last program"), "C .*BLOCK_M 32"),
    (dict(A="last program", B="merge programs"), "predict each of"),
    (dict(A="the last one", B="merge programs", C="merge programs"), "is not one of"),
])
def test_who_merges_checker_rejects(answers, says):
    with pytest.raises(AssertionError, match=says):
        check_who_merges(answers)


def test_who_merges_accepts_a_function():
    assert check_who_merges(solution_who_merges).startswith("passed")


def arrive_read_then_write(counters, tile, n_used):
    # Not atomic: a plain read, then a write; two programs that read the same count lose an arrival on a GPU.
    done = counters[tile]
    counters[tile] = done + 1
    if done == n_used - 1:
        counters[tile] = 0
        return True
    return False


def arrive_plus_equals(counters, tile, n_used):
    # `+=` is a read and a write too; then the count is read again.
    counters[tile] += 1
    if counters[tile] == n_used:
        counters[tile] = 0
        return True
    return False


@pytest.mark.parametrize("arrive", [arrive_read_then_write, arrive_plus_equals])
def test_arrive_checker_catches_a_non_atomic_count(arrive):
    # In a sequential replay these would count right; the checker names the race instead of passing them.
    with pytest.raises(AssertionError, match=r"two steps.*both read the same count.*atomic_add"):
        check_arrive(arrive)
