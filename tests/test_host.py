"""The host layer's contracts: a plan is not changed by running it, steps bind apart from plans, a
plan may be shared by threads, and a kernel that cannot be compiled for the device is declined."""

import threading

import pytest
import torch
import triton

from conftest import CUDA, DEVICE, assert_matches_reference, last_plan
from splitkv import VerifySplitKV, can_handle, decline_reason, verify_attention, verify_splitkv_fwd
from splitkv.api import _CACHES, clear_caches
from splitkv.gate import Decline
from splitkv.plan import Step, VerifyPlan
from splitkv.resources import OutOfDeviceResources
from splitkv.testing import make_problem


def _problem(prefix=(150, 70), seed=1, **kw):
    return make_problem(list(prefix), 3, num_q_heads=4, num_kv_heads=2, head_dim=32, seed=seed, device=DEVICE, **kw)


def _plan(p):
    runner = VerifySplitKV(p.num_q_heads, p.num_kv_heads, p.head_dim, p.v_head_dim, p.max_len_extend, 4, DEVICE)
    return runner.plan(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, p.qo_indptr, p.kv_indptr,
                       p.kv_indices, sm_scale=p.sm_scale, custom_mask=p.custom_mask, mask_indptr=p.mask_indptr)


def _layer(p):
    return p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer


def test_running_a_plan_changes_nothing_in_it():
    p = _problem(mask="tree")
    plan = _plan(p)
    before = {name: value for name, value in vars(plan).items()}
    snapshot = {name: (value if isinstance(value, (int, float, bool, str, tuple, type(None))) else id(value))
                for name, value in before.items()}
    for _ in range(2):
        assert_matches_reference(plan.run(*_layer(p), out=p.new_output()), p)
    after = {name: (value if isinstance(value, (int, float, bool, str, tuple, type(None))) else id(value))
             for name, value in vars(plan).items()}
    assert after == snapshot
    assert plan.runner._spilling == set()  # nothing learned off the GPU


def test_binding_and_running_assign_no_attribute_of_a_plan(monkeypatch):
    """bind() and run(), and the drop-in's warm calls (which bind and run a cached plan), with new lengths
    each time: no attribute of the plan is assigned (only rebind() replaces the plan's own step)."""
    clear_caches()
    p = _problem(prefix=(160, 96), seed=6)
    plan = _plan(p)
    assert verify_splitkv_fwd(*p.args(p.new_output()), **p.kwargs())
    cached = last_plan()
    assigned = []
    monkeypatch.setattr(VerifyPlan, "__setattr__",
                        lambda self, name, value: assigned.append(name) or object.__setattr__(self, name, value))
    for i, lens in enumerate([(200, 120), (40, 24), (200, 120)]):
        other = _reprefixed(p, lens, seed=10 + i)
        step = plan.bind(other.qo_indptr, other.kv_indptr, other.kv_indices)
        assert_matches_reference(plan.run(*_layer(other), out=other.new_output(), step=step), other)
        assert_matches_reference(plan.run(*_layer(p), out=p.new_output()), p)
        o = other.new_output()
        assert verify_splitkv_fwd(*other.args(o), **other.kwargs())
        assert_matches_reference(o, other)
    assert last_plan() is cached
    assert assigned == []
    plan.rebind(p.qo_indptr, p.kv_indptr, p.kv_indices)
    assert assigned == ["step"]


def _reprefixed(base, lens, seed):
    """``base`` with other prefixes of ``lens`` keys on random slots of the same pool (same signature)."""
    g = torch.Generator().manual_seed(seed)
    kvi = torch.randperm(base.k_buffer.shape[0], generator=g)[: sum(lens)].to(device=DEVICE,
                                                                               dtype=base.kv_indices.dtype)
    kvp = torch.tensor([0, lens[0], sum(lens)], device=DEVICE, dtype=base.kv_indptr.dtype)
    return base.replace(kv_indices=kvi, kv_indptr=kvp, prefix_lens=list(lens))


def test_a_step_binds_without_touching_the_plan():
    """``bind`` returns a step for other metadata (here longer prefixes); the plan's own step is
    untouched, and each step runs exactly."""
    p = _problem(prefix=(160, 96), seed=2)
    plan = _plan(p)
    own = plan.step
    longer = _reprefixed(p, (200, 120), seed=3)
    step = plan.bind(longer.qo_indptr, longer.kv_indptr, longer.kv_indices)
    assert isinstance(step, Step) and plan.step is own and step.kv_len == 320
    assert_matches_reference(plan.run(*_layer(longer), out=longer.new_output(), step=step), longer)
    assert_matches_reference(plan.run(*_layer(p), out=p.new_output()), p)


def test_threads_sharing_one_plan_bind_their_own_steps():
    """Four threads share one plan, each with its own metadata (its own prefixes of the same pool):
    each binds a step and runs it; every output is exact. At once on a GPU; one after another under
    the interpreter, which is not thread-safe."""
    base = _problem(prefix=(160, 96), seed=4)
    plan = _plan(base)
    results, threads = {}, []

    def worker(i):
        try:
            mine = _reprefixed(base, (160 - 16 * i, 96 + 8 * i), seed=i)
            step = plan.bind(mine.qo_indptr, mine.kv_indptr, mine.kv_indices)
            for _ in range(2):
                assert_matches_reference(plan.run(*_layer(mine), out=mine.new_output(), step=step), mine)
            results[i] = True
        except Exception as err:  # noqa: BLE001 - reported below
            results[i] = err

    for i in range(4):
        threads.append(threading.Thread(target=worker, args=(i,)))
        threads[-1].start()
        if not CUDA:
            threads[-1].join()
    for t in threads:
        t.join()
    assert results == {i: True for i in range(4)}, results


def test_threads_sharing_a_plan_see_their_own_steps_values():
    """Two threads share a plan, each binds a step of other lengths (a different split count); each reads
    the plan's n_splits after the other has bound: its own step's, and the plan's own step is untouched.
    The threads bind in turn (events), then run one after another (the interpreter is not thread-safe)."""
    base = _problem(prefix=(160, 96), seed=7)
    plan = _plan(base)
    own = plan.n_splits
    problems = [_reprefixed(base, (300, 200), seed=8), _reprefixed(base, (20, 12), seed=9)]
    bound, read, seen, steps = [threading.Event() for _ in problems], threading.Event(), {}, {}

    def worker(i):
        mine = problems[i]
        steps[i] = plan.bind(mine.qo_indptr, mine.kv_indptr, mine.kv_indices)
        bound[i].set()
        read.wait()
        seen[i] = (plan.n_splits, plan.grid, plan.merge)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for i, t in enumerate(threads):
        t.start()
        bound[i].wait()
    read.set()
    for t in threads:
        t.join()
    want = {i: (steps[i].split.n_splits, steps[i].split.grid, steps[i].split.merge) for i in range(2)}
    assert want[0][0] != want[1][0]  # the two threads' steps differ, so a shared memo would show
    assert seen == want and plan.n_splits == own == plan.step.split.n_splits
    for i, mine in enumerate(problems):
        assert_matches_reference(plan.run(*_layer(mine), out=mine.new_output(), step=steps[i]), mine)


def test_a_compile_that_runs_out_of_resources_declines(monkeypatch):
    """Where the shared-memory model under-estimates a tile, Triton's compile raises OutOfResources
    after the gate accepted the call. Every entry declines instead: the drop-in returns False having
    written nothing (later calls of the signature decline at once), can_handle says no from then on,
    verify_attention falls back to the baseline, a plan's run raises the split path's decline
    (NotImplementedError), and so does context parallelism."""
    from splitkv import resources
    from splitkv.launch import Launcher
    from splitkv.parallel import cp_verify_attention

    monkeypatch.setattr(resources, "_REFUSED", {})
    clear_caches()
    calls = []

    def out_of_resources(self, *args, **kwargs):
        calls.append(1)
        raise triton.OutOfResources(300000, 232448, "shared memory")

    p = _problem()
    plan = _plan(p)  # made before the compile fails: its run declines too
    assert can_handle(*p.tensors(None)[:3], *p.tensors(None)[4:], **p.options())
    monkeypatch.setattr(Launcher, "__call__", out_of_resources)
    o = p.new_output()
    assert verify_splitkv_fwd(*p.args(o), **p.kwargs()) is False
    assert torch.isnan(o).all()
    assert verify_splitkv_fwd(*p.args(o), **p.kwargs()) is False and len(calls) == 1  # declined from the cache
    cached = last_plan()
    assert isinstance(cached, Decline) and cached.reason.startswith("resources")
    assert not can_handle(*p.tensors(None)[:3], *p.tensors(None)[4:], **p.options())
    assert decline_reason(*p.tensors(None)[:3], *p.tensors(None)[4:], **p.options()).startswith("resources")
    clear_caches()
    out = verify_attention(*p.tensors(None), **p.options())
    assert_matches_reference(out, p)  # the baseline
    with pytest.raises(OutOfDeviceResources, match="resources"):
        plan.run(*_layer(p), out=p.new_output())
    assert issubclass(OutOfDeviceResources, NotImplementedError)
    with pytest.raises(NotImplementedError, match="resources"):
        cp_verify_attention(*p.tensors(None), **p.options())


def test_plan_and_bind_refuse_keywords_that_are_not_theirs():
    """plan() takes the option list but the runner's own limits; bind() and rebind() take the
    metadata tensors by name and nothing else."""
    p = _problem()
    plan = _plan(p)
    runner = plan.runner
    with pytest.raises(TypeError, match="max_len_extend: fixed by the runner"):
        runner.plan(*_layer(p), p.qo_indptr, p.kv_indptr, p.kv_indices, max_len_extend=3)
    with pytest.raises(TypeError):
        runner.plan(*_layer(p), p.qo_indptr, p.kv_indptr, p.kv_indices, no_such_option=1)
    for fn in (plan.bind, plan.rebind):
        with pytest.raises(TypeError, match="metadata tensors"):
            fn(p.qo_indptr, p.kv_indptr, p.kv_indices, is_causal=False)


def test_a_cold_call_plans_its_tile_once(monkeypatch):
    """The gate's tile is the plan's: a new signature plans its tile once, for the drop-in and for
    verify_attention; a plan made apart from the gate plans its own."""
    import splitkv.gate
    import splitkv.plan

    calls = []

    def counted(fn):
        def plan_tile(*args, **kw):
            calls.append(1)
            return fn(*args, **kw)
        return plan_tile

    for module in (splitkv.gate, splitkv.plan):
        monkeypatch.setattr(module, "plan_tile", counted(module.plan_tile))
    clear_caches()
    p = _problem(seed=5)
    assert verify_splitkv_fwd(*p.args(p.new_output()), **p.kwargs()) and len(calls) == 1
    verify_attention(*p.tensors(None), **dict(p.options(), check=True))
    assert len(calls) == 2  # another signature (checked): its own gate, its own tile
    _plan(p)
    assert len(calls) == 3


def test_the_plan_cache_drops_the_least_recently_used(monkeypatch):
    """Past PLAN_CACHE_SIZE signatures a new one drops the signature used longest ago, not the oldest made:
    a plan in use stays cached."""
    import splitkv.api as api

    monkeypatch.setattr(api, "PLAN_CACHE_SIZE", 2)
    clear_caches()
    p = _problem()

    def call(i):  # signatures that differ in their softmax scale
        assert verify_splitkv_fwd(*p.args(p.new_output()), **dict(p.kwargs(), sm_scale=p.sm_scale * (1 + i)))
        return last_plan()

    first, second = call(0), call(1)
    assert call(0) is first  # used again: now the most recent
    third = call(2)  # drops the second, used longest ago
    plans = [entry[0] for entry in _CACHES.plans.values()]
    assert len(plans) == 2 and first in plans and third in plans and second not in plans
