"""GPU-only safety checks: PDL ordering, bounded waits, streams, threads, Inductor, MLA shapes,
and the fault log written from the device.

Skipped without CUDA. Run on the H200 with ``pytest -m gpu``.
"""

import subprocess
import sys
import textwrap
import threading

import pytest
import torch
import triton
import triton.language as tl

import splitkv
from conftest import CUDA, assert_close, gpu, raises_kernel_fault
from splitkv import VerifySplitKV, check_device_errors, verify_attention, verify_splitkv_fwd
from splitkv.schedule import LAST_PROGRAM, MERGE_PROGRAMS, SEPARATE_MERGE
from splitkv.testing import MODEL_SHAPES, make_problem, reference_for

pytestmark = [gpu, pytest.mark.gpu]


def model_problem(model, prefix_lens, extend=4, **kwargs):
    s = MODEL_SHAPES[model]
    return make_problem(prefix_lens, extend, s.num_q_heads, s.num_kv_heads, s.head_dim, device="cuda",
                        dtype=torch.bfloat16, **kwargs)


def _layer(p):
    return p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer


def _meta(p):
    return p.qo_indptr, p.kv_indptr, p.kv_indices


if CUDA:
    @triton.jit
    def _late_writer(Dst, Src, n, spin, BLOCK: tl.constexpr):
        """Lets its dependents launch at once, then spends ``spin`` steps before writing ``Dst``."""
        tl.extra.cuda.gdc_launch_dependents()
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], tl.float32)
        for _ in range(spin):
            acc = acc * 0.999 + 1.0
        x = tl.load(Src + offs, mask=offs < n)
        tl.store(Dst + offs, x + (acc * 0.0).to(x.dtype), mask=offs < n)


def _write_late(dst, src):
    n = dst.numel()
    _late_writer[(triton.cdiv(n, 1024),)](dst, src, n, 200000, BLOCK=1024, launch_pdl=True)


def _entries():
    """(name, problem, call(p, q) -> out) for every entry and launch path."""
    def plan_path(p, **runner_kw):
        plan = VerifySplitKV(p.num_q_heads, p.num_kv_heads, p.head_dim, p.v_head_dim, p.max_len_extend,
                             p.batch_size, "cuda", **runner_kw).plan(*_layer(p), *_meta(p))
        return plan, lambda q: plan.run(q, *_layer(p)[1:])

    def drop_in(p, q):
        o = p.new_output()
        assert verify_splitkv_fwd(*p.replace(q_extend=q).args(o), **p.kwargs())
        return o

    cases = []
    llama = model_problem("llama3-8b", [4096, 777])
    cases.append(("drop-in", llama, drop_in))
    cases.append(("verify_attention", llama,
                  lambda p, q: verify_attention(q, *p.tensors(None)[1:], **p.options())))
    cases.append(("op", llama, lambda p, q: torch.ops.splitkv.verify_attention(
        q, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, *_meta(p), max_len_extend=p.max_len_extend)[0]))
    for name, p, kw, mode in [
        ("one slice", model_problem("llama3-8b", [100, 60]), {}, None),
        ("last program", llama, dict(n_splits=4), LAST_PROGRAM),
        ("merge programs", model_problem("qwen3-32b", [4096, 777]), dict(n_splits=8), MERGE_PROGRAMS),
        ("second launch", llama, dict(n_splits=4, one_launch=False), SEPARATE_MERGE),
    ]:
        plan, run = plan_path(p, **kw)
        assert plan.merge == mode, (name, plan.merge)
        cases.append((name, p, lambda p, q, run=run: run(q)))
    return cases


def test_no_launch_reads_q_before_its_predecessor_ends():
    """A predecessor that triggers its dependents at once and writes q late (the PDL contract allows it)."""
    for name, p, call in _entries():
        ref = reference_for(p)
        src = p.q_extend.clone()
        wrong = 0
        for _ in range(20):
            q = torch.zeros_like(src)
            _write_late(q, src)
            out = call(p, q)
            torch.cuda.synchronize()
            wrong += not torch.isfinite(out).all() or (out.double() - ref.to(out.device)).norm() > 2e-2 * ref.norm()
        assert wrong == 0, f"{name}: {wrong} of 20 calls read q before it was written"


def test_a_merge_wait_on_corrupted_counters_ends(tmp_path):
    """Merge programs whose slices can never publish give up (a fault, no hang): in a child process."""
    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent("""
        import sys, time, torch
        sys.path.insert(0, "tests")
        import splitkv, splitkv.plan as R
        from splitkv.schedule import TileConfig
        from test_gpu_safety import model_problem, _layer, _meta
        R.SPIN_LIMIT = 1 << 16
        p = model_problem("qwen3-32b", [4096, 777])
        need = splitkv.workspace_bytes(p.num_q_heads, p.num_kv_heads, p.v_head_dim, p.max_len_extend, 2, 8)
        ws = torch.zeros(need // 4, dtype=torch.int32, device="cuda")
        r = splitkv.VerifySplitKV(p.num_q_heads, p.num_kv_heads, p.head_dim, p.v_head_dim, 4, 2, "cuda",
                                  workspace=ws, n_splits=8)
        plan = r.plan(*_layer(p), *_meta(p))
        if plan.merge != R.MERGE_PROGRAMS:  # this GPU's tile leaves no registers for merge programs
            print("NO MERGE PROGRAMS", plan.merge)
            sys.exit(0)
        r._workspace.counters[: plan.grid[0]] = -10**6
        t = time.perf_counter()
        try:  # the run itself raises the fault if its kernel has finished when it looks
            plan.run(*_layer(p))
            torch.cuda.synchronize()
            splitkv.check_device_errors()
            print("NO FAULT")
        except splitkv.VerifyError as e:
            print("FAULT", e, round(time.perf_counter() - t, 2))
    """))
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    if "NO MERGE PROGRAMS" in res.stdout:
        pytest.skip(f"this GPU's plan merges in a second launch ({res.stdout.split()[-1]}): no merge program waits")
    assert "FAULT" in res.stdout and "merge" in res.stdout, res.stdout + res.stderr


def test_a_graph_replayed_on_another_stream_beside_eager_calls():
    """Counters of a captured launch are its own: replay on stream B while stream A runs eagerly."""
    p = model_problem("llama3-8b", [4096, 777])
    ref = reference_for(p)
    r = VerifySplitKV(p.num_q_heads, p.num_kv_heads, p.head_dim, p.v_head_dim, 4, 2, "cuda", n_splits=8)
    plan = r.plan(*_layer(p), *_meta(p))
    assert plan.merge == LAST_PROGRAM
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    g_out = p.new_output()
    with torch.cuda.stream(a):
        plan.run(*_layer(p), out=g_out)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=a):
            plan.run(*_layer(p), out=g_out)
    outs = [p.new_output() for _ in range(50)]
    torch.cuda.synchronize()
    with torch.cuda.stream(b):
        for _ in range(50):
            graph.replay()
    with torch.cuda.stream(a):
        for o in outs:
            plan.run(*_layer(p), out=o)
    torch.cuda.synchronize()
    assert_close(g_out, ref)
    for o in outs:
        assert_close(o, ref)
    check_device_errors()


def test_threads_share_no_plan():
    problems = [model_problem("llama3-8b", [2048 + 64 * i, 999]) for i in range(4)]
    refs = [reference_for(p) for p in problems]
    errors = []

    def worker(i):
        try:
            with torch.cuda.stream(torch.cuda.Stream()):
                for _ in range(30):
                    o = problems[i].new_output()
                    assert verify_splitkv_fwd(*problems[i].args(o), **problems[i].kwargs())
                    torch.cuda.current_stream().synchronize()
                    assert_close(o, refs[i])
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:2]


def test_the_fault_log_is_written_from_the_device():
    p = model_problem("llama3-8b", [4096, 777])
    kvi = p.kv_indices.clone()
    kvi[4096 + 5] = 10**8
    bad = p.replace(kv_indices=kvi)
    with raises_kernel_fault("sequence 1: kv_indices"):
        verify_attention(*bad.tensors(None), **bad.options())
    out = verify_attention(*p.tensors(None), **p.options())  # nothing pending any more
    assert_close(out, reference_for(p))


def _model(q, k, v, kb, vb, qo, kvp, kvi):
    out, lse = splitkv.verify_attention(q * 1.0, k, v, None, kb, vb, qo, kvp, kvi, max_len_extend=4,
                                        return_lse=True)
    return out * 2.0, lse


@pytest.mark.parametrize("mode", ["default", "fullgraph", "reduce-overhead"])
def test_inductor_compiles_the_public_entry(mode):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    base = model_problem("llama3-8b", [4096, 4096], pool_factor=3.0)
    kwargs = {"fullgraph": True} if mode == "fullgraph" else {"mode": mode} if mode != "default" else {}
    compiled = torch.compile(_model, **kwargs)
    for i in range(5):
        lens = [4096 + 100 * i, 2000 + 333 * i]
        kvi = torch.randperm(base.k_buffer.shape[0], device="cuda")[: sum(lens)].to(base.kv_indices.dtype)
        kvp = torch.tensor([0, lens[0], sum(lens)], device="cuda", dtype=base.kv_indptr.dtype)
        p = base.replace(kv_indices=kvi, kv_indptr=kvp, prefix_lens=lens)
        torch._dynamo.mark_dynamic(p.kv_indices, 0)
        args = (*_layer(p)[:3], *_layer(p)[3:], *_meta(p))
        out, lse = compiled(*args)
        eager_out, eager_lse = _model(*args)
        assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse), f"{mode}, step {i}"
        assert_close(out / 2.0, reference_for(p))
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 1, f"{mode}: {graphs} graphs compiled over 5 prefix lengths"


@pytest.mark.parametrize("q_heads", [16, 128])
@pytest.mark.parametrize("dims", [(576, 512), (512, 512), (192, 128)])
def test_wide_heads_are_served_exactly_or_declined(q_heads, dims):
    kv_heads = 1 if dims == (576, 512) else 8
    p = make_problem([4096, 1000], 4, q_heads, kv_heads, dims[0], dims[1], dtype=torch.bfloat16, device="cuda",
                     seed=0)
    reason = splitkv.decline_reason(*_layer(p), *_meta(p), max_len_extend=4)
    o = p.new_output()
    served = verify_splitkv_fwd(*p.args(o), **p.kwargs())
    assert served == (reason is None), reason
    if served:
        assert_close(o, reference_for(p))
    else:
        assert "shared memory" in reason
