"""The Triton kernel checkers (notebooks 03-04) accept the stored solutions and reject plausible slips, saying why.

Each slip is the stored solution with one edit, written to a module of its
own (Triton reads a kernel's source from its file), so the tests show the
exact line a learner might get wrong.
"""

import importlib.util
import inspect
import textwrap

import pytest
import torch

import splitkv  # noqa: F401  (sets TRITON_INTERPRET=1 before triton is imported, on a CPU)
import triton
import triton.language as tl

from conftest import DEVICE
from splitkv.teaching.exercises import Unsolved, exercise, is_stub, solution_of, todo
from splitkv.teaching.exercises import kernels as K

# The stored solutions (notebooks/solutions/kernels.py), the kernels each slip below edits.
solution_merge_kernel = solution_of(K.check_merge_kernel)
solution_load_q_tile = solution_of(K.check_load_q)
solution_slice_kernel = solution_of(K.check_slice_kernel)
solution_draft_kernel = solution_of(K.check_draft_kernel)

# Slips that divide by 0, shift by -inf or skip the max shift make NaN and inf on purpose; NumPy (under the
# interpreter) warns about them.
pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered"),
              pytest.mark.filterwarnings("ignore:overflow encountered")]

HEADER = """import triton
import triton.language as tl
from _splitkv_solutions_kernels import tile_step, load_q_tile
"""


#: A slip may read or write out of bounds (an unclamped slice does). Under the interpreter that is a clean
#: failure; on a GPU it is an illegal memory access that kills the CUDA context of the whole test process,
#: so the wrong kernels run only where the kernels are interpreted.
interpreter_only = pytest.mark.skipif(torch.cuda.is_available(),
                                      reason="runs deliberately wrong kernels: interpreter only")


def mutant(tmp_path, kernel, edits, helpers=()):
    """The kernel (and helpers it calls) with each ``(old, new)`` edit applied once; returns the new kernel."""
    source = "\n\n".join(textwrap.dedent(inspect.getsource(f.fn)) for f in (*helpers, kernel))
    for old, new in edits:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    path = tmp_path / f"mutant_{abs(hash(source))}.py"
    path.write_text(HEADER + source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, kernel.fn.__name__)


@pytest.mark.parametrize("check", [K.check_merge_kernel, K.check_load_q, K.check_slice_kernel, K.check_draft_kernel])
def test_solutions_pass(check):
    assert check(solution_of(check)).startswith("passed")
    assert check(solution_of(check), seed=3).startswith("passed")


# --- merge_kernel ---------------------------------------------------------------------------------

MERGE_SLIPS = {
    "no max shift": ([("alpha = tl.exp2(m - shift)", "alpha = tl.full([BLOCK_M], 1.0, tl.float32)"), ("w = tl.exp2(lse - shift)", "w = tl.exp2(lse)"),
                      ("lse2 = m + tl.log2(", "lse2 = tl.log2(")],
                     "large scores.*subtract the running maximum"),
    "multiply, not select": ([("tl.where(w[:, None] > 0, w[:, None] * o, 0.0)", "w[:, None] * o")],
                             "empty parts \\(o = NaN\\).*select"),
    "no guard for m = -inf": ([("shift = tl.where(m_new == float(\"-inf\"), 0.0, m_new)", "shift = m_new")],
                              "empty first parts.*shift by 0 where the running maximum is still -inf"),
    "LSE left in base 2": ([("lse2 * 0.6931471805599453", "lse2")], "lse is in base 2"),
}


@interpreter_only
@pytest.mark.parametrize("slip", MERGE_SLIPS)
def test_merge_kernel_checker_rejects(tmp_path, slip):
    edits, says = MERGE_SLIPS[slip]
    with pytest.raises(AssertionError, match=says):
        K.check_merge_kernel(mutant(tmp_path, solution_merge_kernel, edits))


# --- load_q_tile ----------------------------------------------------------------------------------

LOAD_SLIPS = {
    "no row mask": ([("mask=row_ok[:, None], other=0.0", "")], "expected zeros \\(padding\\).*mask"),
    "KV head not offset": ([("head = kv_head * GROUP + r % GROUP", "head = r % GROUP")],
                           "KV head 1.*kv_head \\* GROUP \\+ r % GROUP"),
    "head-major rows": ([("token = q_start + r // GROUP", "token = q_start + r % n_draft"),
                         ("head = kv_head * GROUP + r % GROUP", "head = kv_head * GROUP + r // n_draft")],
                        "draft-major"),
    "contiguous strides assumed": ([("head[:, None] * stride_qh", "head[:, None] * D")], "with its strides"),
}


@interpreter_only
@pytest.mark.parametrize("slip", LOAD_SLIPS)
def test_load_q_checker_rejects(tmp_path, slip):
    edits, says = LOAD_SLIPS[slip]
    with pytest.raises(AssertionError, match=says):
        K.check_load_q(mutant(tmp_path, solution_load_q_tile, edits))


# --- slice_kernel ---------------------------------------------------------------------------------

SLICE_SLIPS = {
    "no empty-slice guard": ([("acc / tl.where(has, l_i, 1.0)[:, None]", "acc / l_i[:, None]")], "NaN.*l_i = 0"),
    "no gather": ([("slot = tl.load(kv_indices + kv_start + n, mask=n_ok, other=0).to(tl.int64)",
                    "slot = (kv_start + n).to(tl.int64)")], "read contiguously.*kv_indices"),
    "natural-log LSE": ([("m_i + tl.log2(tl.where(has, l_i, 1.0))", "(m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453")],
                        "natural log.*base 2"),
    "slices not whole tiles": ([("split_len = tl.cdiv(tl.cdiv(n_prefix, tl.num_programs(2)), BLOCK_N) * BLOCK_N",
                                 "split_len = tl.cdiv(n_prefix, tl.num_programs(2))")], "whole BLOCK_N tiles"),
    "slice not clamped": ([("hi = tl.minimum(lo + split_len, n_prefix)", "hi = lo + split_len")], "clamp the slice"),
    "no transpose": ([("s = tl.dot(q, tl.trans(k)) * qk_scale", "s = tl.dot(q, k) * qk_scale")],
                     "tl.dot's operands do not fit.*tl.dot\\(q, tl.trans\\(k\\)\\)"),
    "n_parts ignored": ([("part = ((b * tl.num_programs(1) + kv_head) * n_parts + split)",
                          "part = ((b * tl.num_programs(1) + kv_head) * tl.num_programs(2) + split)")],
                        "n_parts"),
}


@interpreter_only
@pytest.mark.parametrize("slip", SLICE_SLIPS)
def test_slice_kernel_checker_rejects(tmp_path, slip):
    edits, says = SLICE_SLIPS[slip]
    with pytest.raises(AssertionError, match=says):
        K.check_slice_kernel(mutant(tmp_path, solution_slice_kernel, edits))


# --- draft_kernel ---------------------------------------------------------------------------------

DRAFT_SLIPS = {
    "causal mask off by one": ([("j[None, :] <= row_l[:, None]", "j[None, :] < row_l[:, None]")],
                               "causal mask.*j <= l"),
    "row index, not draft token": ([("row_l = tl.arange(0, BLOCK_M) // GROUP", "row_l = tl.arange(0, BLOCK_M)")],
                                   "r // GROUP"),
    "tree mask without the prefix columns": ([("+ n_prefix + j[None, :]", "+ j[None, :]")],
                                             "tree mask.*P prefix columns"),
    "tree mask rows L long": ([("row_l[:, None] * (n_prefix + n_draft)", "row_l[:, None] * n_draft")],
                              "tree mask.*P \\+ L long"),
    "tree treated as a chain": ([("    if TREE:", "    if False:")], "tree mask.*read the visibility"),
    # The output is right and only the LSE is wrong: the message must say so, not "o off by".
    "natural-log LSE": ([("m_i + tl.log2(tl.where(has, l_i, 1.0))",
                          "(m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453")],
                        "o is right but lse is in natural log.*base 2"),
    "padding rows not (0, -inf)": ([("tl.log2(tl.where(has, l_i, 1.0)), float(\"-inf\"))",
                                     "tl.log2(tl.where(has, l_i, 1.0)), 0.0)")],
                                   "padding rows.*\\(0, -inf\\).*weigh them 0"),
    # D = 64, BLOCK_M = 32 and BLOCK_L = 16 in the checker: tl.dot(q, k) cannot run, and is named.
    "no transpose": ([("s = tl.dot(q, tl.trans(k)) * qk_scale", "s = tl.dot(q, k) * qk_scale")],
                     "tl.dot's operands do not fit.*tl.dot\\(q, tl.trans\\(k\\)\\)"),
}


@interpreter_only
@pytest.mark.parametrize("slip", DRAFT_SLIPS)
def test_draft_kernel_checker_rejects(tmp_path, slip):
    edits, says = DRAFT_SLIPS[slip]
    with pytest.raises(AssertionError, match=says):
        K.check_draft_kernel(mutant(tmp_path, solution_draft_kernel, edits))


# --- stubs ----------------------------------------------------------------------------------------

@triton.jit
def merge_kernel(Part_O, Part_LSE, O, LSE, n_parts, DV: tl.constexpr, BLOCK_M: tl.constexpr):
    todo("merge_kernel")


def test_kernel_stub_waits(monkeypatch, capsys):
    monkeypatch.delenv("SPLITKV_SOLUTIONS", raising=False)
    assert is_stub(merge_kernel) and not is_stub(solution_merge_kernel)
    with pytest.raises(Unsolved):
        K.check_merge_kernel(merge_kernel)
    assert exercise(merge_kernel, K.check_merge_kernel) is solution_merge_kernel
    printed = capsys.readouterr().out
    assert printed.startswith("waiting: merge_kernel") and "passed" not in printed


def test_switch_runs_the_solution(monkeypatch, capsys):
    monkeypatch.setenv("SPLITKV_SOLUTIONS", "1")
    assert exercise(merge_kernel, K.check_merge_kernel) is solution_merge_kernel
    assert capsys.readouterr().out.startswith("passed")


def test_split_kv_matches_the_oracle():
    from splitkv.testing import make_problem, reference_for, relative_error
    import torch

    for mask in ("causal", "tree"):
        p = make_problem([37, 0, 20], [3, 2, 4], 4, 2, 16, dtype=torch.float32, mask=mask, seed=4, device=DEVICE)
        o, lse = K.split_kv(p, 3, solution_slice_kernel, solution_draft_kernel, solution_merge_kernel)
        ref_o, ref_lse = reference_for(p, return_lse=True)
        assert relative_error(o, ref_o) < K.STATE_TOL and relative_error(lse, ref_lse) < K.STATE_TOL
