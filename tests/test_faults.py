"""The fault contract (:mod:`splitkv.errors`): every report a kernel makes is raised, once, blamed on
the launch that made it, in the thread that launched it (or any thread, for a captured launch).

Reports are written by the kernel into its launch's slot of the device's fault log. Under the
interpreter the kernel has run when the call returns, so the launching call raises; the tests that
need a report still pending (as on a GPU, where the kernel runs later) write it into a slot themselves,
as the kernel does: the code in the slot, then the flag.
"""

import threading

import pytest
import torch

from conftest import CUDA, DEVICE, assert_matches_reference, gpu
from splitkv import VerifyError, VerifySplitKV, check_device_errors, verify_attention, verify_splitkv_fwd
from splitkv.api import _CACHES, clear_caches
from splitkv.errors import EAGER_SLOTS, fault_log, raise_pending_faults
from splitkv.kernels.common import ERR_COUNTERS, ERR_SLOT
from splitkv.schedule import workspace_bytes
from splitkv.testing import make_problem


def _report(slot: int, code: int) -> None:
    """What the kernel does on a fault: the code in its slot, then the log's flag."""
    log = fault_log(DEVICE)
    log.words[slot] = code
    log.words[0] = 1


def _pending_launch(captured: bool = False) -> int:
    """A slot taken as a launch of this thread takes it (``captured``: for a graph's replays)."""
    return fault_log(DEVICE).take_slot(captured)


def _in_thread(fn):
    """Run ``fn`` in a new thread; return what it returned or raised."""
    result = {}

    def run():
        try:
            result["value"] = fn()
        except Exception as err:  # noqa: BLE001 - handed back to the test
            result["error"] = err

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return result


def _problem(**kw):
    return make_problem([150, 70], 3, num_q_heads=4, num_kv_heads=2, head_dim=32, seed=1, device=DEVICE, **kw)


def test_a_report_names_its_sequence_field_and_launch():
    slot = _pending_launch()
    _report(slot, 1 * 16 + ERR_SLOT.value)
    with pytest.raises(VerifyError, match=r"sequence 1: kv_indices .*from launch #\d+ \(eager, thread"):
        raise_pending_faults(DEVICE)
    raise_pending_faults(DEVICE)  # raised once: nothing left


def test_two_pending_reports_are_raised_together_not_one_lost():
    a, b = _pending_launch(), _pending_launch()
    _report(a, ERR_SLOT.value)
    _report(b, 16 + ERR_SLOT.value)
    with pytest.raises(VerifyError) as caught:
        check_device_errors(DEVICE)
    assert "sequence 0" in str(caught.value) and "sequence 1" in str(caught.value)


def test_another_threads_report_is_not_raised_here_but_stays_pending():
    """A call raises its own thread's reports; another thread's wait for that thread or for
    check_device_errors, and are not blamed on this call."""
    slot = _in_thread(_pending_launch)["value"]
    _report(slot, ERR_SLOT.value)
    p = _problem()
    out = verify_attention(*p.tensors(None), **p.options())  # not this thread's fault
    assert_matches_reference(out, p)
    with pytest.raises(VerifyError, match="sequence 0: kv_indices"):
        check_device_errors(DEVICE)


def test_another_threads_pending_report_costs_this_thread_no_scan(monkeypatch):
    """The first call after another thread's report reads the log once and keeps the report for that
    thread; this thread's later calls read no slot, and the launching thread raises its report."""
    from splitkv.errors import FaultLog

    scans, real = [], FaultLog._take_reports
    monkeypatch.setattr(FaultLog, "_take_reports", lambda self, *a: scans.append(1) or real(self, *a))
    other = {}

    def launch_then_wait():
        other["slot"] = _pending_launch()
        other["go"] = threading.Event()
        other["ready"].set()
        other["go"].wait()
        fault_log(DEVICE).raise_pending()

    other["ready"] = threading.Event()
    t = threading.Thread(target=lambda: other.update(result=_capture(launch_then_wait)))
    t.start()
    other["ready"].wait()
    _report(other["slot"], ERR_SLOT.value)
    p = _problem()
    for _ in range(3):
        assert_matches_reference(verify_attention(*p.tensors(None), **p.options()), p)
    assert len(scans) == 1 and fault_log(DEVICE).words[0] == 0
    other["go"].set()
    t.join()
    assert isinstance(other["result"], VerifyError) and "sequence 0: kv_indices" in str(other["result"])
    raise_pending_faults(DEVICE)  # raised once: nothing left


def _capture(fn):
    """What ``fn`` raised, or ``None``."""
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - handed back to the test
        return err
    return None


def test_a_captured_launchs_report_is_raised_by_any_thread():
    slot = _in_thread(lambda: _pending_launch(captured=True))["value"]
    _report(slot, ERR_COUNTERS.value)
    p = _problem()
    with pytest.raises(VerifyError, match=r"merge counters .*captured into a CUDA graph"):
        verify_attention(*p.tensors(None), **p.options())


def test_a_slot_holding_an_unraised_report_is_not_handed_to_another_launch():
    log = fault_log(DEVICE)
    held = log.take_slot(False)
    _report(held, ERR_SLOT.value)
    log.words[0] = 0  # as if a scan had cleared the flag but not reached this slot yet
    taken = {log.take_slot(False) for _ in range(EAGER_SLOTS + 1)}
    assert held not in taken
    with pytest.raises(VerifyError):
        check_device_errors(DEVICE)


def test_an_unchecked_launch_raises_the_counter_fault_it_reports():
    """Counter faults are reported whatever ``check`` says, and raised: an unchecked call does not
    return rows its merge skipped as if they were written."""
    p = _problem()
    shape = (p.num_q_heads, p.num_kv_heads, p.head_dim, p.v_head_dim, p.max_len_extend, p.batch_size)
    need = workspace_bytes(*shape[:2], shape[3], *shape[4:], 4)
    runner = VerifySplitKV(*shape, DEVICE, n_splits=4, workspace=torch.zeros(need, dtype=torch.uint8, device=DEVICE))
    plan = runner.plan(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, p.qo_indptr, p.kv_indptr,
                       p.kv_indices, sm_scale=p.sm_scale)
    assert not plan.checked and plan.n_splits > 1 and plan.fused
    runner._workspace.counters.fill_(1000)  # a workspace that was not zeroed
    with pytest.raises(VerifyError, match="merge counters"):
        plan.run(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, out=p.new_output())
        check_device_errors(DEVICE)


def test_threads_sharing_the_entries_get_exact_outputs_and_their_own_faults():
    """Four threads call verify_attention, one with a bad slot in its second call: each good call is
    exact, and the bad call's fault is raised in its own thread (at a call, or at the thread's final
    read of its pending reports), never in another's. At once on a GPU; one after another under the
    interpreter, which is not thread-safe."""
    good = [_problem() for _ in range(3)]
    kvi = good[0].kv_indices.clone()
    kvi[3] = 10**6
    bad = good[0].replace(kv_indices=kvi)

    def worker(p, faulty):
        raised = 0
        for i in range(3):
            case = bad if faulty and i == 1 else p
            try:
                out = verify_attention(*case.tensors(None), **case.options())
            except VerifyError:
                raised += 1
                continue
            if case is not bad:  # on a GPU the bad call returns before its fault is read; its slot has no oracle
                assert_matches_reference(out, case)
        if CUDA:
            torch.cuda.synchronize()
        try:
            fault_log(DEVICE).raise_pending(scan=True)  # this thread's reports only
        except VerifyError:
            raised += 1
        return raised

    results = {}
    threads = [threading.Thread(target=lambda j=j: results.__setitem__(j, _safe(worker, good[j % 3], j == 3)))
               for j in range(4)]
    for t in threads:
        t.start()
        if not CUDA:
            t.join()
    for t in threads:
        t.join()
    assert results == {0: 0, 1: 0, 2: 0, 3: 1}, results


def _safe(fn, *args):
    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001 - compared in the test
        return err


def test_tree_steps_that_only_change_lengths_reuse_one_plan():
    """An eager engine loop of EAGLE tree steps: prefixes grow and the tree mask's length with them;
    each step rebinds the cached plan (one plan, exact outputs), as causal steps do."""
    clear_caches()
    pool = 1000  # the engine's pool: the same tensor shape every step
    for step, grow in enumerate((0, 5, 9, 40)):
        prefix = [150 + grow, 70 + grow]
        p = make_problem(prefix, 4, num_q_heads=4, num_kv_heads=2, head_dim=32, mask="tree", seed=step,
                         device=DEVICE, pool_factor=(pool - 0.5) / sum(prefix))
        assert p.k_buffer.shape[0] == pool
        out = verify_attention(*p.tensors(None), **p.options())
        assert_matches_reference(out, p)
    assert len(_CACHES.plans) == 1


def test_a_log_in_device_memory_is_read_when_the_host_waits():
    """On the portable path (no host memory mapped into the device) the log lives in device memory:
    a call's flag read sees nothing, and check_device_errors' scan (a copy, which waits) raises and clears."""
    from splitkv.errors import FaultLog

    log = FaultLog(torch.device(DEVICE), mapped=False)
    slot = log.take_slot(False)
    log.words[slot] = 16 + ERR_SLOT.value
    log.words[0] = 1
    log.raise_pending()  # no copy without a scan: nothing raised
    with pytest.raises(VerifyError, match=r"sequence 1: kv_indices .*from launch #1 \(eager"):
        log.raise_pending(scan=True)
    assert int(log.words.count_nonzero()) == 0
    log.raise_pending(scan=True)  # raised once


# --- real concurrency: on a GPU the kernel itself writes the report ------------------------------------

def _drop_in_call(p, out):
    return lambda: verify_splitkv_fwd(*p.args(out), **p.kwargs(), check=True)


@gpu
def test_a_fault_inside_a_captured_graph_is_raised_by_check_device_errors():
    """A checked drop-in captured with good slots; replayed after one slot is moved out of the pool, its
    kernel's report reaches the host at the next check_device_errors, blamed on a captured launch."""
    from splitkv.testing.graphs import capture_graph

    p = _problem()
    out = p.new_output()
    graph = capture_graph(_drop_in_call(p, out))
    graph.replay()
    torch.cuda.synchronize()
    check_device_errors(DEVICE)  # good slots: nothing pending
    assert_matches_reference(out, p)
    good = p.kv_indices[3].item()
    p.kv_indices[3] = 10**6
    graph.replay()
    with pytest.raises(VerifyError, match=r"(?s)kv_indices holds a slot .*outside the pool.*captured"):
        check_device_errors(DEVICE)
    p.kv_indices[3] = good
    graph.replay()
    torch.cuda.synchronize()
    check_device_errors(DEVICE)  # raised once; the graph runs on
    assert_matches_reference(out, p)


@gpu
def test_a_fault_on_one_stream_is_raised_once_beside_good_calls_on_another():
    """Good calls queued on the default stream, then a bad call on a side stream while they run: the good
    outputs are exact and the bad call's report is raised exactly once (by the bad call itself if its kernel
    is done before the call returns, else by check_device_errors)."""
    good, bad = _problem(), _problem()
    bad.kv_indices[3] = 10**6
    outs = [good.new_output() for _ in range(3)]
    for out in outs:
        _drop_in_call(good, out)()
    side = torch.cuda.Stream()
    raised = []

    def counting(call):
        try:
            call()
        except VerifyError as e:
            raised.append(str(e))

    with torch.cuda.stream(side):
        counting(_drop_in_call(bad, bad.new_output()))
    torch.cuda.synchronize()
    counting(lambda: check_device_errors(DEVICE))
    counting(lambda: check_device_errors(DEVICE))
    assert len(raised) == 1 and "outside the pool" in raised[0], raised
    for out in outs:
        assert_matches_reference(out, good)
