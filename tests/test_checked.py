"""Malformed metadata: the checked modes raise, the unchecked kernel stays in bounds.

Every row of TABLE must raise a ValueError naming the bad sequence and field in
both checked modes -- ``check=True`` (the kernel's checks: a
:class:`splitkv.VerifyError` with the field's :data:`splitkv.errors.FIELDS`
message, row ``kernel``) and ``check="full"`` (the synchronous host check,
before anything is written: row ``match``) -- through ``verify_attention``
(checked by default), ``verify_splitkv_fwd(..., check=...)`` and the drop-in
under ``SPLITKV_CHECK=1`` / ``full`` -- and must run unchecked without a crash and without
touching memory outside its tensors. The unchecked runs happen in a
subprocess (a crash there cannot take pytest down) on guarded tensors: NaN
rows around the pools and draft tensors, poison-slot entries around
``kv_indices``, zero rows around the output (see ``conftest.Guarded``). Under
the interpreter an out-of-bounds load reads real memory, so a stray access
shows up as NaN in the output, a changed guard row, or a crash.
"""

import contextlib

import pytest
import torch

from conftest import build_case, raises_kernel_fault, run_unchecked_in_subprocess
from splitkv import verify_attention, verify_splitkv_fwd
from splitkv.options import check_from_env

BASE = dict(prefix_lens=[40, 30], extend_lens=[6, 4], num_q_heads=4, num_kv_heads=2, head_dim=16, seed=5)


def _case(name, edits=(), problem=None, max_len_extend=None, index_dtype="int64", expect=None, match="",
          kernel=""):
    spec = dict(BASE if problem is None else problem, index_dtype=index_dtype)
    return dict(name=name, problem=spec, edits=[list(e) for e in edits], max_len_extend=max_len_extend,
                expect=expect, match=match, kernel=kernel)


# What the kernel's checks report (splitkv.errors.FIELDS), after the sequence.
SLOT = r"kv_indices holds a slot \(or page id\) outside the pool"
DRAFTS = r"more draft tokens than max_len_extend"


# Sequence 1's prefix starts at kv_indices[40]; position 43 is its fourth key.
TABLE = [
    _case("slot past the pool (int64)", [("kv_indices", 43, ["pool", 1000])], expect="absent",
          match=r"sequence 1: kv_indices\[43\] = \d+ is outside the pool", kernel=rf"sequence 1: {SLOT}"),
    _case("slot past the pool (int32)", [("kv_indices", 43, ["pool", 1000])], index_dtype="int32",
          expect="absent", match=r"sequence 1: kv_indices\[43\]", kernel=rf"sequence 1: {SLOT}"),
    _case("slot 10**12 (int64)", [("kv_indices", 43, 10**12)], expect="absent",
          match=r"sequence 1: kv_indices\[43\] = 1000000000000", kernel=rf"sequence 1: {SLOT}"),
    _case("slot -5 (int64)", [("kv_indices", 5, -5)], expect="absent", match=r"sequence 0: kv_indices\[5\] = -5",
          kernel=rf"sequence 0: {SLOT}"),
    _case("slot -5 (int32)", [("kv_indices", 5, -5)], index_dtype="int32", expect="absent",
          match=r"sequence 0: kv_indices\[5\] = -5", kernel=rf"sequence 0: {SLOT}"),
    # Bounds are checked before a slot is narrowed to the gather's 32-bit offsets: 2**32 + 5 is not slot 5.
    _case("slot 2**32 + 5 (int64)", [("kv_indices", 43, 2**32 + 5)], expect="absent",
          match=r"sequence 1: kv_indices\[43\] = 4294967301", kernel=rf"sequence 1: {SLOT}"),
    _case("kv_indptr [0, 40, 30]", [("kv_indptr", None, [0, 40, 30])], expect=[0],
          match=r"sequence 1: kv_indptr decreases \(40 -> 30\)",
          kernel=r"sequence 1: kv_indptr decreases or points outside kv_indices"),
    _case("qo_indptr [0, 6, 4]", [("qo_indptr", None, [0, 6, 4])], expect=[0],
          match=r"sequence 1: qo_indptr decreases \(6 -> 4\)",
          kernel=r"sequence 1: qo_indptr decreases or points outside the draft rows of q_extend"),
    # 80 draft rows for 2 sequences of at most 4: the gate serves it (reading shapes only, it cannot tell
    # these tensors from a sub-batch's view of longer ones); both sequences' drafts are too many, and the
    # kernel reports one of them.
    _case("drafts 40 + 40, max_len_extend 4", problem=dict(BASE, extend_lens=[40, 40]), max_len_extend=4,
          match=r"sequence 0: 40 draft tokens exceed max_len_extend=4", kernel=rf"sequence [01]: {DRAFTS}"),
    # Served by the gate (41 rows <= 2 x 24): only the checked mode sees sequence 1's 40 drafts.
    _case("drafts [1, 40], max_len_extend 24", problem=dict(BASE, extend_lens=[1, 40]), max_len_extend=24,
          expect=[0], match=r"sequence 1: 40 draft tokens exceed max_len_extend=24", kernel=rf"sequence 1: {DRAFTS}"),
]
IDS = [c["name"] for c in TABLE]
#: Rows whose max_len_extend is below their drafts (the clean problem needs a larger one).
SHORT_MAX_LEN_EXTEND = ("drafts 40 + 40, max_len_extend 4", "drafts [1, 40], max_len_extend 24")

#: The checked modes: the kernel's checks (``True``), and the synchronous host check (``"full"``).
CHECKS = pytest.mark.parametrize("check", [True, "full"], ids=["kernel", "full"])


@contextlib.contextmanager
def _expect(case, check):
    """A checked call of ``case`` raises: the kernel's VerifyError (on a GPU once the device is done), or the
    host check's ValueError, at the call."""
    if check == "full":
        with pytest.raises(ValueError, match=case["match"]):
            yield
        return
    with raises_kernel_fault(case["kernel"]):
        yield


def _untouched_unless_kernel(out, check):
    """The synchronous check runs before anything is written; the kernel's checks, as it runs."""
    if check == "full":
        assert (out == 3.0).all(), "the output was written before the check"


def _args(case):
    p, _, _ = build_case(case)
    return p, p.args(p.new_output(fill=3.0)), p.kwargs()


@pytest.mark.parametrize("case", TABLE, ids=IDS)
def test_verify_attention_checked_by_default(case):
    """verify_attention's default is the kernel's checks."""
    p, _, _ = _args(case)
    out = p.new_output(fill=3.0)
    with _expect(case, True):
        verify_attention(*p.tensors(out), **p.options())


@pytest.mark.parametrize("case", TABLE, ids=IDS)
def test_verify_attention_checked_full(case):
    p, _, _ = _args(case)
    out = p.new_output(fill=3.0)
    with _expect(case, "full"):
        verify_attention(*p.tensors(out), **p.options(), check="full")
    assert (out == 3.0).all(), "the output was written before the check"


_DROP_IN = TABLE


@CHECKS
@pytest.mark.parametrize("case", _DROP_IN, ids=IDS)
def test_drop_in_checked(case, check):
    p, args, kwargs = _args(case)
    with _expect(case, check):
        verify_splitkv_fwd(*args, **kwargs, check=check)
    _untouched_unless_kernel(args[3], check)


@CHECKS
@pytest.mark.parametrize("case", _DROP_IN, ids=IDS)
def test_env_checked(case, check, monkeypatch):
    """SPLITKV_CHECK=1 (the kernel's checks) or =full turns the check on for the drop-in (check=None);
    verify_attention, checked by default, does not read it."""
    monkeypatch.setenv("SPLITKV_CHECK", "1" if check is True else "full")
    p, args, kwargs = _args(case)
    with _expect(case, True):
        verify_attention(*p.tensors(p.new_output(fill=3.0)), **p.options())
    with _expect(case, check):
        verify_splitkv_fwd(*args, **kwargs)
    _untouched_unless_kernel(args[3], check)


def test_env_off_means_unchecked(monkeypatch):
    """Without SPLITKV_CHECK the drop-in does not read values (a bad slot is launched, in bounds)."""
    monkeypatch.delenv("SPLITKV_CHECK", raising=False)
    p, args, kwargs = _args(TABLE[3])  # slot -5: harmless to run in-process, the slot is simply absent
    assert verify_splitkv_fwd(*args, **kwargs)


@pytest.mark.parametrize("value, mode", [
    ("1", True), ("true", True), ("ON", True), ("yes", True), ("full", "full"),
    ("0", False), ("false", False), ("off", False), ("no", False), ("", False), (None, False),
])
def test_env_values(value, mode, monkeypatch):
    """SPLITKV_CHECK is read as set at the call: 0/false/off/no (or unset) off, 1/true/on/yes on, full."""
    if value is None:
        monkeypatch.delenv("SPLITKV_CHECK", raising=False)
    else:
        monkeypatch.setenv("SPLITKV_CHECK", value)
    assert check_from_env() == mode and type(check_from_env()) is type(mode)
    # An explicit check= wins: slot -5 (harmless to run in-process, the slot is simply absent).
    p, args, kwargs = _args(TABLE[3])
    assert verify_splitkv_fwd(*args, **kwargs, check=False)
    with _expect(TABLE[3], True):
        verify_splitkv_fwd(*args, **kwargs, check=True)


@pytest.mark.parametrize("value", ["2", "maybe", "fulll"])
def test_env_values_that_mean_nothing_are_an_error(value, monkeypatch):
    monkeypatch.setenv("SPLITKV_CHECK", value)
    p, args, kwargs = _args(TABLE[3])
    with pytest.raises(ValueError, match="SPLITKV_CHECK"):
        verify_splitkv_fwd(*args, **kwargs)


def test_table_is_valid_before_the_edits():
    """Each row's problem is fine without its edit (so the error comes from the edit)."""
    for case in TABLE:
        _, clean, _ = build_case(case)
        if case["name"] in SHORT_MAX_LEN_EXTEND:
            clean = clean.replace(max_len_extend=max(clean.extend_lens))
        out = verify_attention(*clean.tensors(None), **clean.options())
        assert torch.isfinite(out).all()


def test_unchecked_runs_stay_in_bounds():
    """Every row, unchecked, through verify_attention, the drop-in and a 4-slice runner, in a subprocess:
    exit 0, guards intact, no NaN picked up, counters back at 0, and the rows the
    corruption does not reach equal to the oracle (a bad slot's key counts as absent)."""
    log = run_unchecked_in_subprocess(TABLE)
    # Every row launched: the gate declines none (80 draft rows for 2 x 4 may be a sub-batch's view).
    assert log.count("verify_attention: ran") == len(TABLE)
