"""GPU-only checks at real sizes: bf16, the labelled model shapes, long prefixes,
CUDA-graph capture and replay, two streams at once, fp8 pools.

Skipped without CUDA. Run on the H200 with ``pytest -m gpu``.
"""

import pytest
import torch

from conftest import CUDA, TOLERANCE, assert_matches_reference, gpu
from splitkv import VerifySplitKV, extend_attention_fwd, verify_splitkv_fwd, workspace_bytes
from splitkv.launch import Launcher
from splitkv.testing import MODEL_SHAPES, make_problem, reference_for, relative_error

pytestmark = [gpu, pytest.mark.gpu]

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def model_problem(model, prefix_lens, extend=4, **kwargs):
    s = MODEL_SHAPES[model]
    return make_problem(prefix_lens, extend, s.num_q_heads, s.num_kv_heads, s.head_dim, device="cuda", **kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", list(MODEL_SHAPES))
@pytest.mark.parametrize(
    "prefix_lens", [[1024, 4097, 0, 1], [16384, 333], [65536]], ids=["mixed", "16k", "64k"]
)
def test_model_shapes_match_oracle_and_baseline(model, prefix_lens, dtype):
    p = model_problem(model, prefix_lens, dtype=dtype)
    out = p.new_output()
    assert verify_splitkv_fwd(*p.args(out), **p.kwargs())
    assert_matches_reference(out, p)
    base = p.new_output()
    extend_attention_fwd(*p.args(base), **p.kwargs())
    assert relative_error(base, reference_for(p)) < TOLERANCE[dtype]


@pytest.mark.parametrize("extend", [1, 3, 5, 8, 16])
@pytest.mark.parametrize("mask", ["causal", "tree"])
def test_extend_lengths_and_trees_bf16(extend, mask):
    p = model_problem("qwen3-32b", [4000, 97, 1], extend, dtype=torch.bfloat16, mask=mask, sinks=True)
    out = p.new_output()
    assert verify_splitkv_fwd(*p.args(out), **p.kwargs())
    assert_matches_reference(out, p)


@pytest.mark.parametrize("head_dim,v_head_dim", [(96, 96), (192, 128)])
def test_odd_head_dims_bf16(head_dim, v_head_dim):
    p = make_problem([3000, 54], 4, 12, 4, head_dim, v_head_dim, dtype=torch.bfloat16, device="cuda", fused_qkv=False)
    out = p.new_output()
    assert verify_splitkv_fwd(*p.args(out), **p.kwargs())
    assert_matches_reference(out, p)


def test_fp8_pool_with_scales():
    p = model_problem("llama3-8b", [5000, 77], dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn,
                      k_scale=0.7, v_scale=1.3)
    out = p.new_output()
    assert verify_splitkv_fwd(*p.args(out), **p.kwargs())
    assert_matches_reference(out, p)


@pytest.mark.parametrize("model", ["llama3-8b", "qwen3-next"])
def test_fp8_pool_with_bf16_queries_beyond_float16_range(model):
    """bf16 queries meet fp8 keys in float16 dots: a query tile past float16's range (65504)
    is divided by a power of two first, so nothing overflows (scores stay moderate: the
    keys are scaled down as much)."""
    p = model_problem(model, [3000, 77], dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn,
                      k_scale=2e-5, v_scale=1.3, seed=5)
    p = p.replace(q_extend=p.q_extend * 5e4, k_extend=p.k_extend * 2e-5)
    assert p.q_extend.abs().max() > 65504
    out = p.new_output()
    assert verify_splitkv_fwd(*p.args(out), **p.kwargs())
    assert_matches_reference(out, p)


def _poisoned_runner(p, **kwargs):
    """A runner on a caller-owned workspace whose partials are NaN (0xFF bytes), counters 0."""
    nbytes = workspace_bytes(p.num_q_heads, p.num_kv_heads, p.v_head_dim, p.max_len_extend, 16,
                             pack_gqa=kwargs.get("pack_gqa", True))
    ws = torch.full((nbytes,), 0xFF, dtype=torch.uint8, device="cuda")
    runner = VerifySplitKV(p.num_q_heads, p.num_kv_heads, p.head_dim, p.v_head_dim,
                           p.max_len_extend, 16, "cuda", workspace=ws, **kwargs)
    runner._workspace.counters.zero_()
    assert torch.isnan(runner._workspace.partials).all()
    return runner


def _run(runner, p, out):
    return runner(*p.args(out)[:9], custom_mask=p.custom_mask, mask_indptr=p.mask_indptr, is_causal=p.is_causal,
                  sm_scale=p.sm_scale, k_scale=p.k_scale, v_scale=p.v_scale, sinks=p.sinks)


@pytest.mark.parametrize("pack_gqa", [True, False])
def test_nan_poisoned_scratch(pack_gqa):
    p = model_problem("qwen3-next", [20000, 0, 3, 9000], dtype=torch.bfloat16)
    runner = _poisoned_runner(p, pack_gqa=pack_gqa)
    out = p.new_output()
    _run(runner, p, out)
    assert_matches_reference(out, p)


def test_cuda_graph_capture_then_replay_with_new_data():
    """Capture once; replay after writing fresh inputs into the same buffers."""
    p = model_problem("qwen3-32b", [8192, 8000, 5, 7000], dtype=torch.bfloat16)
    out = p.new_output()
    args = p.args(out)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up compiles the kernels outside capture
        assert verify_splitkv_fwd(*args, **p.kwargs(), max_bs=8)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert verify_splitkv_fwd(*args, **p.kwargs(), max_bs=8)
    for _ in range(3):
        fresh = model_problem("qwen3-32b", p.prefix_lens, dtype=torch.bfloat16)
        for name in ("q_extend", "k_extend", "v_extend", "k_buffer", "v_buffer", "kv_indices"):
            getattr(p, name).copy_(getattr(fresh, name))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches_reference(out, fresh)


def test_two_streams_at_once():
    """The same shape on two streams concurrently: per-stream scratch, no race."""
    problems = [model_problem("llama3-8b", [30000, 20000], dtype=torch.bfloat16) for _ in range(2)]
    outs = [p.new_output() for p in problems]
    refs = [reference_for(p) for p in problems]
    streams = [torch.cuda.Stream() for _ in problems]
    for p, s in zip(problems, streams):  # warm-up
        with torch.cuda.stream(s):
            verify_splitkv_fwd(*p.args(p.new_output()), **p.kwargs())
    torch.cuda.synchronize()
    for _ in range(20):
        for p, o, s in zip(problems, outs, streams):
            with torch.cuda.stream(s):
                assert verify_splitkv_fwd(*p.args(o), **p.kwargs())
    torch.cuda.synchronize()
    for o, ref, p in zip(outs, refs, problems):
        assert relative_error(o, ref) < TOLERANCE[p.q_extend.dtype]


@pytest.mark.parametrize("model,one_launch", [("llama3-8b", True), ("qwen3-32b", True), ("qwen3-32b", False)],
                         ids=["last-program", "merge-programs", "second-launch"])
def test_default_partials_are_a_raw_block_freed_after_the_launches(model, one_launch, monkeypatch):
    """Once its launches are compiled, a plan's default partials are a raw block of the caching
    allocator on the current stream, freed once after the launches. Here the block is a NaN-filled
    tensor: the output must not depend on what the block held."""
    import splitkv.launch as launch_module

    p = model_problem(model, [2000, 517], dtype=torch.bfloat16)
    runner = VerifySplitKV(p.num_q_heads, p.num_kv_heads, p.head_dim, p.v_head_dim, 4, 2, "cuda",
                           n_splits=4, one_launch=one_launch)
    plan = runner.plan(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, p.qo_indptr, p.kv_indptr,
                       p.kv_indices, sm_scale=p.sm_scale)
    first = plan.run(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, out=p.new_output())  # compiles
    blocks, freed = {}, []

    def raw_alloc(nbytes, stream):
        assert nbytes == plan.scratch_bytes and stream == torch.cuda.current_stream().cuda_stream
        t = torch.full((nbytes // 4,), float("nan"), device="cuda")
        blocks[t.data_ptr()] = t
        return t.data_ptr()

    monkeypatch.setattr(launch_module, "_RAW_ALLOC", raw_alloc)
    monkeypatch.setattr(launch_module, "_RAW_DELETE", freed.append)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        again = plan.run(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, out=p.new_output())
    torch.cuda.synchronize()
    assert len(blocks) == 1 and freed == list(blocks)
    assert not torch.isnan(next(iter(blocks.values()))).all()  # the slices wrote their partials there
    assert_matches_reference(again, p)
    assert torch.equal(again, first)


def test_cuda_is_there():
    assert CUDA


@pytest.mark.parametrize("n_splits,one_launch", [(1, True), (4, True), (4, False)],
                         ids=["one-slice", "merged-in-kernel", "spread-merge"])
def test_plan_launches_with_addresses_and_checks_devices(n_splits, one_launch, monkeypatch):
    """After its first launch a plan hands the launcher addresses, not tensors
    (``Launcher.run_ptrs``), so it checks devices itself: a CPU tensor is refused,
    never read as a device address, and the plan still serves after."""
    p = model_problem("llama3-8b", [2000, 517], dtype=torch.bfloat16)
    runner = VerifySplitKV(p.num_q_heads, p.num_kv_heads, p.head_dim, p.v_head_dim, 4, 2, "cuda",
                           n_splits=n_splits, one_launch=one_launch)
    plan = runner.plan(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, p.qo_indptr, p.kv_indptr,
                       p.kv_indices, sm_scale=p.sm_scale)
    assert plan.fused == (one_launch and n_splits > 1 or n_splits == 1)
    with pytest.raises(ValueError, match="device"):
        plan.run(p.q_extend.cpu(), p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, out=p.new_output())
    with pytest.raises(ValueError, match="device"):
        plan.run(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, out=p.new_output().cpu())
    with pytest.raises(ValueError, match="device"):
        plan.rebind(p.qo_indptr, p.kv_indptr, p.kv_indices.cpu())
    first = plan.run(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, out=p.new_output())
    assert_matches_reference(first, p)

    def no_tensors(*args, **kwargs):
        raise AssertionError("a launch after the first took the tensor path")

    monkeypatch.setattr(Launcher, "__call__", no_tensors)
    again = plan.run(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, out=p.new_output())
    assert torch.equal(again, first)


# --- breadth: score features and paged pools at real sizes ---------------------

@pytest.mark.parametrize("features", [dict(logit_cap=30.0), dict(sliding_window_size=4096),
                                      dict(sliding_window_size=127, logit_cap=50.0), dict(xai_temperature_len=8192)],
                         ids=["cap", "window-4k", "window-127-cap", "xai"])
@pytest.mark.parametrize("model", list(MODEL_SHAPES))
def test_score_features_bf16(model, features):
    p = model_problem(model, [16384, 5000, 0, 333], dtype=torch.bfloat16, mask="tree", sinks=True)
    out = p.new_output()
    assert verify_splitkv_fwd(*p.args(out), **p.kwargs(), **features)
    assert_matches_reference(out, p, **features)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("page_size", [1, 16, 64, 128])
@pytest.mark.parametrize("model", list(MODEL_SHAPES))
def test_paged_pools_bf16(model, page_size, kv_dtype):
    from splitkv.testing import paged_problem

    scales = dict(k_scale=0.7, v_scale=1.3) if kv_dtype != torch.bfloat16 else {}
    p = model_problem(model, [16384, 4097, 1, 0], dtype=torch.bfloat16, kv_dtype=kv_dtype, sinks=True, **scales)
    pp = paged_problem(p, page_size, seed=1)
    out = p.new_output()
    assert verify_splitkv_fwd(*pp.args(out), **pp.kwargs(), check=True)
    assert_matches_reference(out, p)


def test_paged_graph_replay_with_new_page_tables():
    """Captured once, replayed with other page tables, last-page lengths and draft counts in place."""
    from splitkv.testing import paged_problem
    from splitkv.testing.graphs import capture_graph

    s = MODEL_SHAPES["llama3-8b"]
    shape = dict(num_q_heads=s.num_q_heads, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                 dtype=torch.bfloat16, device="cuda")
    first = paged_problem(make_problem([9000, 5000], 4, seed=1, **shape), 16, seed=1, spare_pages=600)
    pool_pages = first.k_pages.shape[0]
    a = first.args(first.problem.new_output())
    out = a[3]
    pages, last = first.kv_indices.clone(), first.kv_last_page_len.clone()
    qo, kvp = first.problem.qo_indptr.clone(), first.kv_indptr.clone()
    args = list(a)
    args[6], args[7], args[8] = qo, kvp, pages
    kw = dict(first.kwargs(), kv_last_page_len=last)
    graph = capture_graph(lambda: verify_splitkv_fwd(*args, **kw))
    for seed, prefixes in ((2, [5000, 8000]), (3, [1, 9000])):
        spare = pool_pages - sum(-(-n // 16) for n in prefixes)  # same pool shape as the captured one
        nxt = paged_problem(make_problem(prefixes, [4, 2], seed=seed, **shape), 16, seed=seed, spare_pages=spare)
        n_pages = nxt.kv_indices.shape[0]
        assert n_pages <= pages.shape[0] and nxt.k_pages.shape == first.k_pages.shape
        # Same tensors as captured: copy the new layout into the pool and tables.
        first.k_pages.copy_(nxt.k_pages)
        first.v_pages.copy_(nxt.v_pages)
        pages[:n_pages].copy_(nxt.kv_indices)
        kvp.copy_(nxt.kv_indptr)
        last.copy_(nxt.kv_last_page_len)
        qo.copy_(nxt.problem.qo_indptr)
        for t, src in ((args[0], nxt.problem.q_extend), (args[1], nxt.problem.k_extend),
                       (args[2], nxt.problem.v_extend)):
            t[: src.shape[0]].copy_(src)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        rows = nxt.problem.num_tokens
        assert relative_error(out[:rows], reference_for(nxt.problem)) < TOLERANCE[torch.bfloat16]
