"""Calls a serving engine might plausibly make wrong: each raises a clear error or gives the right answer.

CPU (the Triton interpreter) where it can show the behaviour; the GPU-only parts
(PDL, hangs on a real device, streams, Inductor) are in ``test_gpu_safety.py``.
"""

import threading

import pytest
import torch

import splitkv
from splitkv import VerifyError, VerifySplitKV, check_device_errors, verify_attention, verify_splitkv_fwd
from splitkv.schedule import TileConfig
from splitkv.schedule import LAST_PROGRAM, MERGE_PROGRAMS
from splitkv.testing import make_problem, paged_problem, reference_for

from conftest import DEVICE, assert_close, last_plan, raises_kernel_fault

F32 = torch.float32


def _problem(prefix=(300, 77), heads=(8, 2), dim=32, **kw):
    return make_problem(list(prefix), 4, heads[0], heads[1], dim, dtype=F32, device=DEVICE, seed=1, **kw)


def _layer(p):
    return p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer


def _meta(p):
    return p.qo_indptr, p.kv_indptr, p.kv_indices


def _runner(p, **kw):
    return VerifySplitKV(p.num_q_heads, p.num_kv_heads, p.head_dim, p.v_head_dim, p.max_len_extend,
                         p.batch_size, DEVICE, **kw)


@pytest.fixture(autouse=True)
def _no_stale_faults():
    """Each test starts and ends with no pending fault in the fault log."""
    try:
        check_device_errors(DEVICE)
    except VerifyError:
        pass
    yield
    check_device_errors(DEVICE)


# --- one argument order -----------------------------------------------------------------

def test_plan_takes_keywords_after_kv_indices():
    p = _problem()
    r = _runner(p)
    with pytest.raises(TypeError):
        r.plan(*_layer(p), *_meta(p), None, True, None)  # the drop-in's order of mask, is_causal, mask_indptr
    plan = r.plan(*_layer(p), *_meta(p), is_causal=True)
    assert_close(plan.run(*_layer(p)), reference_for(p))


@pytest.mark.parametrize("bad", [
    dict(is_causal=None), dict(mask_indptr=True), dict(custom_mask=1), dict(max_len_extend=4.0),
    dict(is_causal=1),
])
def test_drop_in_refuses_wrongly_typed_arguments(bad):
    p = _problem()
    o = p.new_output()
    args = list(p.args(o))
    for name, value in bad.items():
        args[{"custom_mask": 9, "is_causal": 10, "mask_indptr": 11, "max_len_extend": 12}[name]] = value
    with pytest.raises(TypeError, match=next(iter(bad))):
        verify_splitkv_fwd(*args, **p.kwargs())
    assert torch.isnan(o).all(), "a refused call wrote the output"


def test_entries_have_no_positional_options():
    p = _problem()
    with pytest.raises(TypeError):
        verify_attention(*p.tensors(None), None, True, None, 4)
    with pytest.raises(TypeError):
        verify_attention(*p.tensors(None))  # max_len_extend is required
    with pytest.raises(TypeError):
        splitkv.can_handle(*_layer(p), *_meta(p), None, True, None, 4)
    assert splitkv.can_handle(*_layer(p), *_meta(p), max_len_extend=4)


def test_run_returns_the_output_and_fills_lse():
    p = _problem()
    plan = _runner(p).plan(*_layer(p), *_meta(p), return_lse=True)
    lse = torch.full(p.q_extend.shape[:2], float("nan"), dtype=F32, device=DEVICE)
    out = p.new_output()
    assert plan.run(*_layer(p), out=out, lse=lse) is out
    ref_o, ref_lse = reference_for(p, return_lse=True)
    assert_close(out, ref_o)
    assert torch.allclose(lse.double(), ref_lse.to(lse.device), atol=1e-4)
    with pytest.raises(ValueError, match="pass lse"):
        plan.run(*_layer(p))
    with pytest.raises(ValueError, match="without return_lse"):
        _runner(p).plan(*_layer(p), *_meta(p)).run(*_layer(p), lse=lse)


# --- outputs validated on the host ---------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda o: torch.empty(o.shape[0], o.shape[1], 2 * o.shape[2], dtype=o.dtype, device=o.device)[:, :, ::2],
    lambda o: o[:-3],
    lambda o: o.to(torch.int32),
    lambda o: o[None],
])
def test_run_refuses_malformed_outputs(make):
    p = _problem()
    plan = _runner(p).plan(*_layer(p), *_meta(p))
    with pytest.raises(ValueError, match="out must be"):
        plan.run(*_layer(p), out=make(p.new_output()))


@pytest.mark.parametrize("make", [
    lambda shape: torch.empty(shape[0], shape[1] + 1, dtype=F32, device=DEVICE)[:, :-1],  # strided
    lambda shape: torch.empty(shape[0] - 1, shape[1], dtype=F32, device=DEVICE),
    lambda shape: torch.empty(shape, dtype=torch.float16, device=DEVICE),
])
def test_run_refuses_malformed_lse(make):
    p = _problem()
    plan = _runner(p).plan(*_layer(p), *_meta(p), return_lse=True)
    with pytest.raises(ValueError, match="lse must be"):
        plan.run(*_layer(p), lse=make(p.q_extend.shape[:2]))


def test_run_refuses_a_layer_of_other_shapes():
    p = _problem()
    plan = _runner(p).plan(*_layer(p), *_meta(p))
    small = p.k_buffer[: p.k_buffer.shape[0] // 2]
    with pytest.raises(ValueError, match="k_buffer"):
        plan.run(p.q_extend, p.k_extend, p.v_extend, small, p.v_buffer)


# --- the runner's defaults and a caller's workspace ----------------------------------------

def test_runner_device_defaults_to_what_the_machine_has():
    r = VerifySplitKV(8, 2, 32, 32, 4, 2)
    assert r.device.type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("garbage", ["random", "ones"])
def test_a_workspace_of_garbage_is_zeroed_when_bound(garbage):
    p = _problem()
    need = splitkv.workspace_bytes(p.num_q_heads, p.num_kv_heads, p.v_head_dim, p.max_len_extend,
                                   p.batch_size, 3)
    ws = (torch.randint(-2**31, 2**31 - 1, (need // 4,), dtype=torch.int32) if garbage == "random"
          else torch.ones(need // 4, dtype=torch.int32)).to(DEVICE)
    r = _runner(p, workspace=ws, n_splits=3)
    plan = r.plan(*_layer(p), *_meta(p), check=True)
    assert plan.merge == LAST_PROGRAM
    assert_close(plan.run(*_layer(p)), reference_for(p))


def test_corrupted_counters_are_reported_not_silent():
    p = _problem()
    need = splitkv.workspace_bytes(p.num_q_heads, p.num_kv_heads, p.v_head_dim, p.max_len_extend,
                                   p.batch_size, 3)
    ws = torch.zeros(need // 4, dtype=torch.int32, device=DEVICE)
    r = _runner(p, workspace=ws, n_splits=3)
    plan = r.plan(*_layer(p), *_meta(p))
    r._workspace.counters.fill_(7)  # what a second stream sharing the workspace could leave
    with raises_kernel_fault("merge counters"):  # unchecked, and raised all the same
        plan.run(*_layer(p))


@pytest.mark.parametrize("where", ["tile", "ticket"])
def test_merge_programs_stop_waiting_on_corrupted_counters(where, monkeypatch):
    import splitkv.plan as plan_mod

    monkeypatch.setattr(plan_mod, "SPIN_LIMIT", 64)
    p = _problem()
    need = splitkv.workspace_bytes(p.num_q_heads, p.num_kv_heads, p.v_head_dim, p.max_len_extend,
                                   p.batch_size, 3, block_m=32)
    ws = torch.zeros(need // 4, dtype=torch.int32, device=DEVICE)
    r = _runner(p, workspace=ws, n_splits=3, config=TileConfig(32, 16, 4, 1))
    plan = r.plan(*_layer(p), *_meta(p))
    assert plan.merge == MERGE_PROGRAMS
    if where == "tile":
        r._workspace.counters[: plan.grid[0]] = -1000  # the slices can never bring it to n_used
    else:
        r._workspace.counters[plan.grid[0]] = 10**6  # tickets past the grid
    with raises_kernel_fault("merge"):  # the wait is bounded, and its fault raised
        plan.run(*_layer(p))


# --- the checked kernel -------------------------------------------------------------------

def _checked_fault(p, match, **kw):
    with raises_kernel_fault(match):
        verify_attention(*p.tensors(p.new_output()), **{**p.options(), **kw})


def test_checked_kernel_finds_a_slot_outside_the_pool():
    p = _problem()
    kvi = p.kv_indices.clone()
    kvi[300 + 40] = p.k_buffer.shape[0]
    _checked_fault(p.replace(kv_indices=kvi), "sequence 1: kv_indices holds a slot")


def test_checked_kernel_finds_bad_indptrs():
    p = _problem()
    qo = p.qo_indptr.clone()
    qo[1] = qo[2] + 1  # sequence 0 overlaps sequence 1's rows; sequence 1 runs backwards
    _checked_fault(p.replace(qo_indptr=qo), "qo_indptr")
    kvp = p.kv_indptr.clone()
    kvp[2] = p.kv_indices.shape[0] + 5
    _checked_fault(p.replace(kv_indptr=kvp), "sequence 1: kv_indptr")


def test_checked_kernel_finds_too_many_drafts():
    p = make_problem([100, 50], [4, 6], 8, 2, 32, dtype=F32, device=DEVICE, seed=2)
    _checked_fault(p, "sequence 1: more draft tokens than max_len_extend", max_len_extend=5)


def test_checked_kernel_finds_a_mask_out_of_range():
    p = make_problem([60, 40], 4, 8, 2, 32, dtype=F32, device=DEVICE, seed=3, mask="tree")
    mi = p.mask_indptr.clone()
    mi[1] = p.custom_mask.numel() - 3
    _checked_fault(p.replace(mask_indptr=mi), "sequence 1: its custom_mask")


def test_checked_kernel_finds_a_bad_last_page_length():
    pp = paged_problem(make_problem([70, 33], 4, 8, 2, 32, dtype=F32, device=DEVICE, seed=4), 16)
    last = pp.kv_last_page_len.clone()
    last[0] = 17
    with raises_kernel_fault("sequence 0: kv_last_page_len"):
        verify_attention(*pp.tensors(pp.problem.new_output()), **{**pp.options(), "kv_last_page_len": last})


def test_checked_kernel_finds_a_prefix_past_max_prefix_len():
    p = _problem(prefix=(300, 77))
    _checked_fault(p, "sequence 0: its prefix is longer than max_prefix_len", split_tokens=128, max_prefix_len=256)


def test_unchecked_calls_do_not_raise_and_checks_clear():
    p = _problem()
    kvi = p.kv_indices.clone()
    kvi[3] = -1
    bad = p.replace(kv_indices=kvi)
    verify_attention(*bad.tensors(bad.new_output()), **bad.options(), check=False)
    check_device_errors(DEVICE)  # nothing pending: unchecked launches validate nothing
    _checked_fault(bad, "sequence 0")
    check_device_errors(DEVICE)  # raised once, then cleared


def test_the_drop_in_checks_under_splitkv_check(monkeypatch):
    p = _problem()
    kvi = p.kv_indices.clone()
    kvi[3] = 10**7
    bad = p.replace(kv_indices=kvi)
    assert verify_splitkv_fwd(*bad.args(bad.new_output()), **bad.kwargs())  # unchecked: served, bounded
    monkeypatch.setenv("SPLITKV_CHECK", "1")
    with raises_kernel_fault("sequence 0: kv_indices"):
        verify_splitkv_fwd(*bad.args(bad.new_output()), **bad.kwargs())
    monkeypatch.setenv("SPLITKV_CHECK", "full")
    with pytest.raises(ValueError, match=r"kv_indices\[3\]"):
        verify_splitkv_fwd(*bad.args(bad.new_output()), **bad.kwargs())


def test_a_sub_batch_view_is_served():
    """kv_indptr / qo_indptr starting past 0: the second sequence of a batch, seen alone."""
    p = _problem(prefix=(120, 200))
    qo, kvp = p.qo_indptr[1:].contiguous(), p.kv_indptr[1:].contiguous()
    out = p.new_output()
    verify_attention(*_layer(p)[:3], out, *_layer(p)[3:], qo, kvp, p.kv_indices, **p.options())
    ref = reference_for(p)
    rows = slice(int(p.qo_indptr[1]), int(p.qo_indptr[2]))
    assert_close(out[rows], ref[rows])
    with pytest.raises(ValueError, match="sequence 0"):  # "full" accepts the view, and still checks slots
        kvi = p.kv_indices.clone()
        kvi[150] = -5
        verify_attention(*_layer(p)[:3], p.new_output(), *_layer(p)[3:], qo, kvp, kvi, **p.options(),
                         check="full")


# --- plan caches and launch limits ----------------------------------------------------------

def test_a_cached_plan_rechecks_launch_limits(monkeypatch):
    import splitkv.plan as plan_mod
    from splitkv.schedule import launch_limit_reason

    p = _problem(prefix=(300, 77))
    assert verify_splitkv_fwd(*p.args(p.new_output()), **p.kwargs())
    # The same pool and shapes with longer prefixes: the plan comes from the cache.
    slots = torch.randint(0, p.k_buffer.shape[0], (477,), device=DEVICE).to(p.kv_indices.dtype)
    longer = p.replace(kv_indices=slots, kv_indptr=torch.tensor([0, 400, 477], device=DEVICE).to(p.kv_indptr.dtype))
    n_plans = len(splitkv.api._CACHES.plans)
    monkeypatch.setattr(plan_mod, "launch_limit_reason",
                        lambda tiles, n, keys: "launch limit: test" if keys > 400 else launch_limit_reason(tiles, n, keys))
    o = longer.new_output()
    assert verify_splitkv_fwd(*longer.args(o), **longer.kwargs()) is False  # declined, not raised
    assert len(splitkv.api._CACHES.plans) == n_plans
    assert torch.isnan(o).all()


def test_each_thread_has_its_own_plans():
    problems = [_problem(prefix=(100 + 37 * i, 64)) for i in range(4)]  # one signature, other metadata
    errors, plans = [], {}

    def worker(i):
        try:
            for _ in range(3):
                o = problems[i].new_output()
                assert verify_splitkv_fwd(*problems[i].args(o), **problems[i].kwargs())
                assert_close(o, reference_for(problems[i]))
            plans[i] = last_plan()
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    # One after another: the Triton interpreter itself is not thread-safe (the GPU test runs them at once).
    for i in range(4):
        t = threading.Thread(target=worker, args=(i,))
        t.start()
        t.join()
    assert not errors, errors
    assert len({id(plan) for plan in plans.values()}) == 4


# --- batch-invariant scratch ----------------------------------------------------------------

def test_batch_invariant_scratch_follows_the_callers_bound():
    p = _problem(prefix=(300, 77, 20, 5))
    r = _runner(p, split_tokens=128, max_prefix_len=384)
    plan = r.plan(*_layer(p), *_meta(p))
    assert plan.n_splits == 3  # cdiv(384, 128), whatever len(kv_indices) is
    assert_close(plan.run(*_layer(p)), reference_for(p))
    with pytest.raises(ValueError, match="max_prefix_len"):
        _runner(p, split_tokens=128)
    with pytest.raises(ValueError, match="multiple of 128"):
        verify_attention(*p.tensors(None), **p.options(), split_tokens=100, max_prefix_len=384)


def test_workspace_bytes_of_the_batch_invariant_mode_are_bounded():
    # batch 64 x 4k, slices of 1024: four slices' scratch, not the batch's 256k keys' worth
    n = splitkv.workspace_bytes(32, 8, 128, 4, 64, max_splits=4)
    assert n < 64 * 8 * 4 * 16 * 129 * 4 + 64 * 8 * 4 + 64


# --- MLA-like shapes ------------------------------------------------------------------------

@pytest.mark.parametrize("q_heads", [16, 128])
def test_mla_like_shapes_are_served_exactly_or_declined(q_heads):
    p = make_problem([40, 23], 2, q_heads, 1, 576, 512, dtype=F32, device=DEVICE, seed=5)
    reason = splitkv.decline_reason(*_layer(p), *_meta(p), max_len_extend=p.max_len_extend)
    o = p.new_output()
    served = verify_splitkv_fwd(*p.args(o), **p.kwargs())
    assert served == (reason is None)
    if served:
        assert_close(o, reference_for(p))
    else:
        assert "shared memory" in reason and torch.isnan(o).all()
