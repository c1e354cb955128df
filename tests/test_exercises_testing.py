"""The notebook 05 checker accepts a good test, rejects weak ones saying which bug escaped,
and its planted kernels really are wrong while the real one is right."""

import pytest
import torch

from splitkv.teaching.exercises.testing import PLANTED, check_test, real_kernel
from splitkv.teaching.lessons import DEVICE
from splitkv.testing import TOLERANCE, make_problem, reference_for, relative_error
from splitkv.teaching.exercises import solution_of

solution_test = solution_of(check_test)


def _problem(prefix, drafts, seed=3):
    return make_problem(prefix, drafts, num_q_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float16,
                        device=DEVICE, seed=seed)


def _close(kernel, p, out):
    kernel(p, out)
    assert relative_error(out, reference_for(p)) < TOLERANCE[p.q_extend.dtype]


def weak_aligned_without_empty_prefix(kernel):
    # Whole key tiles only (multiples of every key tile, 16 to 128) and no empty prefix: two bugs never show.
    p = _problem([256, 128], [4, 3])
    _close(kernel, p, p.new_output())


def weak_zero_queries(kernel):
    # Every score 0: the softmax scale changes nothing.
    p = _problem([150, 37, 0], [4, 3, 2])
    p = p.replace(q_extend=torch.zeros_like(p.q_extend))
    _close(kernel, p, p.new_output())


def weak_too_tight(kernel):
    # A float16 result judged by a float64 budget: fails the right kernel too.
    p = _problem([150, 37, 0], [4, 3, 2])
    out = p.new_output()
    kernel(p, out)
    assert relative_error(out, reference_for(p)) < 1e-9


def weak_crashes(kernel):
    # Fails by TypeError, not by assertion, on any kernel that leaves NaN.
    p = _problem([150, 37, 0], [4, 3, 2])
    out = p.new_output()
    kernel(p, out)
    assert relative_error(out, reference_for(p)) < TOLERANCE[p.q_extend.dtype] or None + 1


def test_solution_passes():
    assert check_test(solution_test).startswith("passed")


@pytest.mark.parametrize("weak, says", [
    (weak_aligned_without_empty_prefix, "skips a partial key tile passed it.*skips empty prefixes passed it"),
    (weak_zero_queries, "forgets the softmax scale passed it"),
    (weak_too_tight, "fails the correct kernel"),
    (weak_crashes, "raised TypeError"),
])
def test_checker_rejects(weak, says):
    with pytest.raises(AssertionError, match=says):
        check_test(weak)


def test_planted_kernels_are_wrong_and_the_real_one_right():
    p = _problem([150, 37, 0], [4, 3, 2], seed=11)
    ref = reference_for(p)
    out = p.new_output()
    real_kernel(p, out)
    assert relative_error(out, ref) < TOLERANCE[torch.float16]
    for name, kernel in PLANTED.items():
        out = p.new_output()
        kernel(p, out)
        assert relative_error(out, ref) > 10 * TOLERANCE[torch.float16], name


def test_an_unwritten_stub_waits_and_hands_on_the_solution(monkeypatch, capsys):
    from splitkv.teaching.exercises import exercise, todo

    monkeypatch.delenv("SPLITKV_SOLUTIONS", raising=False)

    def my_test(kernel):
        todo("my_test")

    assert solution_of(check_test) is solution_test
    assert exercise(my_test, check_test) is solution_test
    out = capsys.readouterr().out
    assert out.startswith("waiting:") and "passed" not in out
