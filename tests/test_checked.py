"""Malformed metadata: the checked mode raises, the unchecked kernel stays in bounds.

Every row of TABLE must raise a ValueError naming the bad sequence and field in
checked mode -- ``verify_attention`` (checked by default),
``verify_splitkv_fwd(..., check=True)`` and either entry under
``SPLITKV_CHECK=1`` -- and must run unchecked without a crash and without
touching memory outside its tensors. The unchecked runs happen in a
subprocess (a crash there cannot take pytest down) on guarded tensors: NaN
rows around the pools and draft tensors, poison-slot entries around
``kv_indices``, zero rows around the output (see ``conftest.Guarded``). Under
the interpreter an out-of-bounds load reads real memory, so a stray access
shows up as NaN in the output, a changed guard row, or a crash.
"""

import pytest
import torch

from conftest import build_case, run_unchecked_in_subprocess
from splitkv import verify_attention, verify_splitkv_fwd

BASE = dict(prefix_lens=[40, 30], extend_lens=[6, 4], num_q_heads=4, num_kv_heads=2, head_dim=16, seed=5)


def _case(name, edits=(), problem=None, max_len_extend=None, index_dtype="int64", expect=None, match=""):
    spec = dict(BASE if problem is None else problem, index_dtype=index_dtype)
    return dict(name=name, problem=spec, edits=[list(e) for e in edits], max_len_extend=max_len_extend,
                expect=expect, match=match)


# Sequence 1's prefix starts at kv_indices[40]; position 43 is its fourth key.
TABLE = [
    _case("slot past the pool (int64)", [("kv_indices", 43, ["pool", 1000])], expect="absent",
          match=r"sequence 1: kv_indices\[43\] = \d+ is outside the pool"),
    _case("slot past the pool (int32)", [("kv_indices", 43, ["pool", 1000])], index_dtype="int32",
          expect="absent", match=r"sequence 1: kv_indices\[43\]"),
    _case("slot 10**12 (int64)", [("kv_indices", 43, 10**12)], expect="absent",
          match=r"sequence 1: kv_indices\[43\] = 1000000000000"),
    _case("slot -5 (int64)", [("kv_indices", 5, -5)], expect="absent", match=r"sequence 0: kv_indices\[5\] = -5"),
    _case("slot -5 (int32)", [("kv_indices", 5, -5)], index_dtype="int32", expect="absent",
          match=r"sequence 0: kv_indices\[5\] = -5"),
    # Bounds are checked before a slot is narrowed to the gather's 32-bit offsets: 2**32 + 5 is not slot 5.
    _case("slot 2**32 + 5 (int64)", [("kv_indices", 43, 2**32 + 5)], expect="absent",
          match=r"sequence 1: kv_indices\[43\] = 4294967301"),
    _case("kv_indptr [0, 40, 30]", [("kv_indptr", None, [0, 40, 30])], expect=[0],
          match=r"sequence 1: kv_indptr decreases \(40 -> 30\)"),
    _case("qo_indptr [0, 6, 4]", [("qo_indptr", None, [0, 6, 4])], expect=[0],
          match=r"sequence 1: qo_indptr decreases \(6 -> 4\)"),
    # The gate declines (80 draft rows > 2 x 4): verify_attention must raise, not fall back.
    _case("drafts 40 + 40, max_len_extend 4", problem=dict(BASE, extend_lens=[40, 40]), max_len_extend=4,
          match=r"sequence 0: 40 draft tokens exceed max_len_extend=4"),
    # Served by the gate (41 rows <= 2 x 24): only the checked mode sees sequence 1's 40 drafts.
    _case("drafts [1, 40], max_len_extend 24", problem=dict(BASE, extend_lens=[1, 40]), max_len_extend=24,
          expect=[0], match=r"sequence 1: 40 draft tokens exceed max_len_extend=24"),
]
IDS = [c["name"] for c in TABLE]
DECLINED_BY_GATE = "drafts 40 + 40, max_len_extend 4"


def _args(case):
    p, _, _ = build_case(case)
    return p, p.args(p.new_output(fill=3.0)), p.kwargs()


@pytest.mark.parametrize("case", TABLE, ids=IDS)
def test_verify_attention_checked_by_default(case):
    p, args, kwargs = _args(case)
    with pytest.raises(ValueError, match=case["match"]):
        verify_attention(*args, **kwargs)
    assert (args[3] == 3.0).all(), "the output was written before the check"


_DROP_IN = TABLE


@pytest.mark.parametrize("case", _DROP_IN, ids=IDS)
def test_drop_in_checked(case):
    p, args, kwargs = _args(case)
    with pytest.raises(ValueError, match=case["match"]):
        verify_splitkv_fwd(*args, **kwargs, check=True)
    assert (args[3] == 3.0).all()


@pytest.mark.parametrize("case", _DROP_IN, ids=IDS)
def test_env_checked(case, monkeypatch):
    """SPLITKV_CHECK=1 turns the check on for the drop-in (check=None) and verify_attention(check=None)."""
    monkeypatch.setenv("SPLITKV_CHECK", "1")
    p, args, kwargs = _args(case)
    with pytest.raises(ValueError, match=case["match"]):
        verify_attention(*args, **kwargs, check=None)
    with pytest.raises(ValueError, match=case["match"]):
        verify_splitkv_fwd(*args, **kwargs)
    assert (args[3] == 3.0).all()


def test_env_off_means_unchecked(monkeypatch):
    """Without SPLITKV_CHECK the drop-in does not read values (a bad slot is launched, in bounds)."""
    monkeypatch.delenv("SPLITKV_CHECK", raising=False)
    p, args, kwargs = _args(TABLE[3])  # slot -5: harmless to run in-process, the slot is simply absent
    assert verify_splitkv_fwd(*args, **kwargs)


@pytest.mark.parametrize("value, on", [("1", True), ("yes", True), ("0", False), ("", False), (None, False)])
def test_env_values(value, on, monkeypatch):
    """SPLITKV_CHECK is read as set at the call (the drop-in reads os.environ's own dict): unset, "" and "0" are off."""
    from splitkv.api import _checking

    if value is None:
        monkeypatch.delenv("SPLITKV_CHECK", raising=False)
    else:
        monkeypatch.setenv("SPLITKV_CHECK", value)
    assert _checking(None) is on
    assert _checking(False) is False and _checking(True) is True  # an explicit check= wins


def test_table_is_valid_before_the_edits():
    """Each row's problem is fine without its edit (so the error comes from the edit)."""
    for case in TABLE:
        _, clean, _ = build_case(case)
        if case["name"] in (DECLINED_BY_GATE, "drafts [1, 40], max_len_extend 24"):
            clean = clean.replace(max_len_extend=max(clean.extend_lens))
        out = verify_attention(*clean.args(None), **clean.kwargs())
        assert torch.isfinite(out).all()


def test_unchecked_runs_stay_in_bounds():
    """Every row, unchecked, through verify_attention, the drop-in and a 4-slice runner, in a subprocess:
    exit 0, guards intact, no NaN picked up, counters back at 0, and the rows the
    corruption does not reach equal to the oracle (a bad slot's key counts as absent)."""
    log = run_unchecked_in_subprocess(TABLE)
    assert log.count("verify_attention: ran") == len(TABLE) - 1  # all but the gate-declined row launched
