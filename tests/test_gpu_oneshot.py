"""GPU-only checks of the one-launch design at real sizes.

CUDA-graph replay while prefix lengths change under a fixed-size kv_indices
buffer (to 0, to longer than at capture), a caller-owned workspace under
graphs, two streams at once, bitwise repeatability over 100 calls, a launch
of more than 65536 tiles, fp8 e5m2 pools, pools whose row stride exceeds
H_KV x D, pools past 2^31 elements (64-bit gather offsets), and a
10,000-replay stress run with changing batch composition (GPU memory flat,
sampled outputs against the oracle).

Skipped without CUDA. Run on the H200 with ``pytest -m gpu``.
"""

import dataclasses
import gc
import random

import pytest
import torch

from conftest import CUDA, all_counters_zero, assert_close, assert_matches_reference, gpu, last_plan
from splitkv import VerifySplitKV, verify_splitkv_fwd, workspace_bytes
from splitkv.schedule import LAST_PROGRAM, MERGE_PROGRAMS, SEPARATE_MERGE
from splitkv.testing import MODEL_SHAPES, make_problem, paged_problem, reference_attention, reference_for
from splitkv.testing.graphs import capture_graph

pytestmark = [gpu, pytest.mark.gpu]

BF16 = torch.bfloat16


def model_problem(model, prefix_lens, extend=4, **kwargs):
    s = MODEL_SHAPES[model]
    kwargs.setdefault("dtype", BF16)
    return make_problem(prefix_lens, extend, s.num_q_heads, s.num_kv_heads, s.head_dim, device="cuda", **kwargs)


def cumsum_indptr(lens, like):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=like.dtype)


def oracle(p, qo, kv, idx):
    """The float64 oracle for the problem's data with other metadata tensors."""
    return reference_attention(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, qo, kv, idx,
                               p.custom_mask, p.is_causal, p.mask_indptr, k_scale=p.k_scale, v_scale=p.v_scale,
                               sm_scale=p.sm_scale, sinks=p.sinks)


# --- graphs: lengths change between replays ------------------------------------

#: Per replay, the prefix lengths; the kv_indices buffer holds 24000 slots (6000 a sequence at capture).
REPLAY_LENGTHS = {
    4: [
        [6000, 6000, 6000, 6000],  # as captured
        [0, 0, 0, 0],  # every prefix empty
        [0, 24000, 0, 0],  # one sequence four times longer than at capture
        [1, 5, 23000, 994],
        [128, 129, 0, 7],
        [6000, 6000, 6000, 6000],  # back again
    ],
    1: [[24000], [0], [1], [129], [23999], [24000]],
}
#: (model, batch): Llama-3-8B at batch 4 merges in its tiles' last programs; Qwen3-32B at
#: batch 1 has 16 slices of 32-row tiles, merged by merge programs in the same grid (and, with
#: ``one_launch=False``, by the second launch, PDL included).
REPLAY_CASES = [("llama3-8b", 4), ("qwen3-32b", 1)]


def _replay_problem(model, bs):
    p = model_problem(model, [24000 // bs] * bs, sinks=True, pool_factor=1.25)
    return p.replace(kv_indptr=p.kv_indptr.clone(), kv_indices=p.kv_indices.clone())


def _check_replays(p, graph, out):
    slots = torch.randperm(p.k_buffer.shape[0], device="cuda")[: p.kv_indices.shape[0]].to(p.kv_indices.dtype)
    for i, lens in enumerate(REPLAY_LENGTHS[p.batch_size]):
        p.kv_indptr.copy_(cumsum_indptr(lens, p.kv_indptr))
        if i % 2:
            p.kv_indices.copy_(slots.roll(i * 997))  # new slots too, same buffer
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, oracle(p, p.qo_indptr, p.kv_indptr, p.kv_indices), BF16, f"replay {i} {lens}")
        assert all_counters_zero()


@pytest.mark.parametrize("model,bs", REPLAY_CASES)
def test_graph_replay_as_prefix_lengths_change(model, bs):
    p = _replay_problem(model, bs)
    out = p.new_output()
    graph = capture_graph(lambda: verify_splitkv_fwd(*p.args(out), **p.kwargs(), max_bs=bs))
    _check_replays(p, graph, out)


@pytest.mark.parametrize("one_launch", [True, False])
@pytest.mark.parametrize("model,bs", REPLAY_CASES)
def test_graph_replay_with_a_caller_workspace(model, bs, one_launch):
    p = _replay_problem(model, bs)
    ws = torch.zeros(workspace_bytes(p.num_q_heads, p.num_kv_heads, p.v_head_dim, p.max_len_extend, bs),
                     dtype=torch.uint8, device="cuda")
    runner = VerifySplitKV(p.num_q_heads, p.num_kv_heads, p.head_dim, p.v_head_dim, p.max_len_extend, bs, "cuda",
                           workspace=ws, one_launch=one_launch)
    plan = runner.plan(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, p.qo_indptr, p.kv_indptr,
                       p.kv_indices, sm_scale=p.sm_scale, sinks=p.sinks)
    assert plan.n_splits > 1
    out = p.new_output()
    graph = capture_graph(lambda: plan.run(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, out=out))
    _check_replays(p, graph, out)
    assert int(torch.count_nonzero(runner._workspace.counters)) == 0


# --- concurrency and repeatability ------------------------------------------------

@pytest.mark.parametrize("model,merge", [("llama3-8b", LAST_PROGRAM), ("qwen3-32b", MERGE_PROGRAMS)])
def test_two_streams_at_once_bitwise(model, merge):
    """Two problems on two streams, interleaved 30 times: each result bitwise equal to a lone run
    (tiles merged by their last program, and by merge programs waiting on tickets and counters)."""
    problems = [model_problem(model, [30000, 20000, 0, 3000], seed=1),
                model_problem(model, [25000, 1, 17000, 9000], seed=2)]
    alone = []
    for p in problems:
        out = p.new_output()
        assert verify_splitkv_fwd(*p.args(out), **p.kwargs())
        assert last_plan().merge == merge
        alone.append(out)
    torch.cuda.synchronize()
    for o, p in zip(alone, problems):
        assert_matches_reference(o, p)
    streams = [torch.cuda.Stream() for _ in problems]
    outs = [[p.new_output() for _ in range(30)] for p in problems]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    for i in range(30):
        for p, s, o in zip(problems, streams, outs):
            with torch.cuda.stream(s):
                assert verify_splitkv_fwd(*p.args(o[i]), **p.kwargs())
    torch.cuda.synchronize()
    for o, ref in zip(outs, alone):
        for x in o:
            assert torch.equal(x, ref)
    assert all_counters_zero()


@pytest.mark.parametrize("prefix_lens", [[20000, 3000, 0, 9000], [60000]], ids=["batch4", "one-long"])
def test_bitwise_identical_over_100_calls(prefix_lens):
    """The merge reads slices in a fixed order whichever program finishes last (and the
    spread merge, for many slices, likewise): 100 calls, one bit pattern."""
    p = model_problem("qwen3-32b", prefix_lens, sinks=True, mask="tree")
    first = p.new_output()
    assert verify_splitkv_fwd(*p.args(first), **p.kwargs())
    outs = []
    for _ in range(100):
        o = p.new_output()
        assert verify_splitkv_fwd(*p.args(o), **p.kwargs())
        outs.append(o)
    torch.cuda.synchronize()
    assert_matches_reference(first, p)
    for o in outs:
        assert torch.equal(o, first)
    assert all_counters_zero()


@pytest.mark.parametrize("one_launch", [True, False])
@pytest.mark.parametrize("n_splits", [4, 64])
def test_fused_and_spread_merge_paths(n_splits, one_launch):
    """Forced grids merged in the kernel and in a second launch, partials poisoned with NaN."""
    p = model_problem("llama3-8b", [40000, 0, 300, 12000], sinks=True)
    need = workspace_bytes(p.num_q_heads, p.num_kv_heads, p.v_head_dim, p.max_len_extend, 4, n_splits)
    ws = torch.full((need // 4,), float("nan"), dtype=torch.float32, device="cuda")
    counter_bytes = workspace_bytes(p.num_q_heads, p.num_kv_heads, p.v_head_dim, p.max_len_extend, 4, 0)
    ws[: counter_bytes // 4] = 0  # counters zero, partials NaN
    runner = VerifySplitKV(p.num_q_heads, p.num_kv_heads, p.head_dim, p.v_head_dim, p.max_len_extend, 4, "cuda",
                           n_splits=n_splits, workspace=ws, one_launch=one_launch)
    out = p.new_output()
    plan = runner.plan(*p.args(out)[:3], *p.args(out)[4:9], sm_scale=p.sm_scale, sinks=p.sinks)
    # 4 slices of 16-row tiles: the last program merges; 64: merge programs in the same grid.
    assert plan.merge == (SEPARATE_MERGE if not one_launch else LAST_PROGRAM if n_splits == 4 else MERGE_PROGRAMS)
    plan.run(*p.args(out)[:3], *p.args(out)[4:6], out=out)
    torch.cuda.synchronize()
    assert_matches_reference(out, p)
    assert int(torch.count_nonzero(runner._workspace.counters)) == 0


# --- sizes and layouts ------------------------------------------------------------

def test_more_than_65536_tiles():
    """32 query / 32 KV heads x 2050 sequences = 65600 tiles on grid axis 0 (past 65535), short
    prefixes and three long ones at the end, so the highest tiles merge several slices."""
    bs = 2050
    rng = random.Random(0)
    prefix = [rng.randint(0, 64) for _ in range(bs - 3)] + [3000, 5000, 700]
    p = make_problem(prefix, 4, 32, 32, 64, dtype=BF16, device="cuda", pool_factor=1.1, seed=3)
    runner = VerifySplitKV(32, 32, 64, 64, 4, bs, "cuda", n_splits=4)
    plan = runner.plan(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, p.qo_indptr, p.kv_indptr,
                       p.kv_indices, sm_scale=p.sm_scale)
    assert plan.grid[0] == bs * 32 >= 65536
    out = plan.run(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, out=p.new_output())
    ref = reference_for(p)
    torch.cuda.synchronize()
    assert_close(out, ref, BF16)
    assert_close(out[-5000:], ref[-5000:], BF16, "the last tiles")
    drop_in = p.new_output()
    assert verify_splitkv_fwd(*p.args(drop_in), **p.kwargs(), max_bs=bs)
    torch.cuda.synchronize()
    assert_close(drop_in, ref, BF16, "drop-in")
    assert all_counters_zero()


@pytest.mark.parametrize("kv_dtype,merge", [(BF16, MERGE_PROGRAMS), (torch.float8_e4m3fn, SEPARATE_MERGE)])
def test_merge_programs_only_where_the_kernel_keeps_its_registers(kv_dtype, merge):
    """Qwen3-Next at batch 1 / 16k: 32-row tiles of many slices. The bf16 kernel with merge programs
    spills nothing and keeps them; the fp8 one spills with them, so its plan merges in a second
    launch. Either way the bits are those of one_launch=False and the result the oracle's."""
    p = model_problem("qwen3-next", [16000], kv_dtype=kv_dtype, k_scale=0.7, v_scale=1.3, sinks=True)
    out = p.new_output()
    assert verify_splitkv_fwd(*p.args(out), **p.kwargs())
    assert last_plan().merge == merge and last_plan().n_splits > 8
    runner = VerifySplitKV(p.num_q_heads, p.num_kv_heads, p.head_dim, p.v_head_dim, p.max_len_extend, 1, "cuda",
                           one_launch=False)
    layer = (p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer)
    spread = runner.plan(*layer, p.qo_indptr, p.kv_indptr, p.kv_indices, sm_scale=p.sm_scale, k_scale=p.k_scale,
                         v_scale=p.v_scale, sinks=p.sinks).run(*layer, out=p.new_output())
    torch.cuda.synchronize()
    assert torch.equal(out, spread)
    assert_matches_reference(out, p)
    assert all_counters_zero()


@pytest.mark.parametrize("model", ["llama3-8b", "qwen3-next"])
def test_fp8_e5m2_pool(model):
    p = model_problem(model, [9000, 77, 0, 3000], kv_dtype=torch.float8_e5m2, k_scale=0.7, v_scale=1.3,
                      sinks=True)
    out = p.new_output()
    assert verify_splitkv_fwd(*p.args(out), **p.kwargs())
    torch.cuda.synchronize()
    assert_matches_reference(out, p)


@pytest.mark.parametrize("layout", ["padded-dim", "interleaved-heads"])
def test_non_contiguous_pool(layout):
    """Pools as views whose row stride exceeds H_KV x D (a padded or interleaved cache)."""
    p = model_problem("llama3-8b", [9000, 130, 0, 4000], sinks=True)
    pool, h, d = p.k_buffer.shape

    def strided(t):
        if layout == "padded-dim":
            big = torch.full((pool, h, d + 64), float("nan"), dtype=t.dtype, device="cuda")
            view = big[:, :, :d]
        else:
            big = torch.full((pool, 2 * h, d), float("nan"), dtype=t.dtype, device="cuda")
            view = big[:, ::2]
        view.copy_(t)
        assert view.stride(0) > h * d and view.stride(2) == 1
        return view

    q = p.replace(k_buffer=strided(p.k_buffer), v_buffer=strided(p.v_buffer))
    out = q.new_output()
    assert verify_splitkv_fwd(*q.args(out), **q.kwargs())
    torch.cuda.synchronize()
    assert_matches_reference(out, p)


@pytest.mark.parametrize("page_size", [1, 16], ids=["token-pool", "pages-of-16"])
def test_pool_past_2_31_elements(page_size):
    """Pools of 2^21 + 2^16 slots x 8 KV heads x 128 (2.2 G elements, 4.4 GB each, NaN): past 32-bit
    offsets, so the plan gathers with 64-bit ones; the problem's rows are copied to the pool's end,
    where a wrapped 32-bit offset would read NaN or another row."""
    p = model_problem("llama3-8b", [5000, 0, 777, 3000], sinks=True, pool_factor=1.0)
    src = paged_problem(p, page_size, seed=2) if page_size > 1 else p
    small_k = src.k_pages if page_size > 1 else src.k_buffer
    small_v = src.v_pages if page_size > 1 else src.v_buffer
    entries = (2**21 + 2**16) // page_size
    shift = entries - small_k.shape[0]

    def big(t):
        out = torch.full((entries, *t.shape[1:]), float("nan"), dtype=t.dtype, device="cuda")
        out[shift:] = t
        return out

    kb, vb = big(small_k), big(small_v)
    indices = src.kv_indices.to(torch.int64) + shift
    if page_size > 1:
        q = dataclasses.replace(src, k_pages=kb, v_pages=vb, kv_indices=indices)
    else:
        q = src.replace(k_buffer=kb, v_buffer=vb, kv_indices=indices)
    out = p.new_output()
    assert verify_splitkv_fwd(*q.args(out), **q.kwargs())
    assert not last_plan().offsets_32
    torch.cuda.synchronize()
    assert_matches_reference(out, p)
    del kb, vb, q
    torch.cuda.empty_cache()


# --- stress ----------------------------------------------------------------------

def test_stress_10000_graph_replays():
    """Graphs for batch sizes 1, 3, 8 and 16 over shared buffers, 10,000 replays with random
    composition (prefixes 0..4096 within a fixed kv_indices buffer, ragged drafts, fresh
    slots): GPU memory stays flat and sampled replays match the oracle."""
    s = MODEL_SHAPES["llama3-8b"]
    L, per_seq, max_bs = 4, 2048, 16
    gen = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to("cuda", BF16)

    pool_tokens = max_bs * per_seq + 4096
    q_all = randn(max_bs * L, s.num_q_heads, s.head_dim)
    k_all, v_all = randn(max_bs * L, s.num_kv_heads, s.head_dim), randn(max_bs * L, s.num_kv_heads, s.head_dim)
    kb, vb = randn(pool_tokens, s.num_kv_heads, s.head_dim), randn(pool_tokens, s.num_kv_heads, s.head_dim)
    sm_scale = s.head_dim ** -0.5
    graphs = {}
    for bs in (1, 3, 8, 16):
        g = dict(bs=bs, q=q_all[: bs * L], k=k_all[: bs * L], v=v_all[: bs * L],
                 qo=torch.arange(0, bs * L + 1, L, dtype=torch.int32, device="cuda"),
                 kv=torch.arange(0, bs * per_seq + 1, per_seq, dtype=torch.int32, device="cuda"),
                 idx=torch.randperm(pool_tokens, device="cuda")[: bs * per_seq],
                 out=torch.zeros(bs * L, s.num_q_heads, s.head_dim, dtype=BF16, device="cuda"))
        args = (g["q"], g["k"], g["v"], g["out"], kb, vb, g["qo"], g["kv"], g["idx"], None, True, None, L, 1.0, 1.0)
        g["graph"] = capture_graph(lambda args=args: verify_splitkv_fwd(*args, sm_scale=sm_scale, max_bs=max_bs))
        graphs[bs] = g

    def check(g):
        n = int(g["qo"][-1])
        if n == 0:  # every sequence of this replay had 0 drafts
            return
        ref = reference_attention(g["q"], g["k"], g["v"], kb, vb, g["qo"], g["kv"], g["idx"], sm_scale=sm_scale)
        assert_close(g["out"][:n], ref[:n], BF16, f"bs {g['bs']}")
        del ref

    rng = random.Random(1)
    for g in graphs.values():
        g["graph"].replay()
    check(graphs[16])  # the oracle's first call allocates its own workspaces: before the baseline
    torch.cuda.synchronize()
    gc.collect()
    baseline = torch.cuda.memory_allocated()
    samples = []
    for it in range(10_000):
        g = graphs[rng.choice([1, 3, 8, 16])]
        bs = g["bs"]
        lens = [rng.choice([0, rng.randint(1, 64), rng.randint(1, 4096)]) for _ in range(bs)]
        total, cap = sum(lens), bs * per_seq
        if total > cap:
            lens = [n * cap // total for n in lens]
        drafts = [0 if rng.random() < 0.05 else rng.randint(1, L) for _ in range(bs)]
        g["qo"].copy_(cumsum_indptr(drafts, g["qo"]))
        g["kv"].copy_(cumsum_indptr(lens, g["kv"]))
        if it % 7 == 0:
            g["idx"].copy_(torch.randperm(pool_tokens, device="cuda")[: bs * per_seq])
        g["graph"].replay()
        if it % 1000 == 999:
            torch.cuda.synchronize()
            gc.collect()
            samples.append(torch.cuda.memory_allocated())
            check(g)
            assert all_counters_zero()
    torch.cuda.synchronize()
    gc.collect()
    samples.append(torch.cuda.memory_allocated())
    assert max(samples) - baseline <= 1 << 20, (baseline, samples)
    assert samples[-1] - samples[0] <= 1 << 16, samples


def test_counters_first_allocated_inside_a_capture(monkeypatch):
    """Warm-up on another stream (the PyTorch-docs pattern), two graphs captured on a fresh
    stream sharing a pool that held garbage; replay the second graph first, then the first.
    Captured launches take counters of their own from the arena zeroed before the capture
    (none are allocated inside it, nor shared with the capture stream's eager calls), so they
    merge in the verify launch: no captured launch falls back to a second merge launch."""
    from splitkv import workspace as workspace_mod
    from splitkv.plan import VerifyPlan

    separated, real = [], VerifyPlan._launch_merge
    monkeypatch.setattr(VerifyPlan, "_launch_merge", lambda self, *a: separated.append(1) or real(self, *a))

    p = model_problem("llama3-8b", [6000] * 4)
    stream = torch.cuda.Stream()
    g0 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g0, stream=stream):
        junk = torch.full((1 << 14,), 12345, dtype=torch.int32, device="cuda")
        del junk
    g0.replay()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        assert verify_splitkv_fwd(*p.args(p.new_output()), **p.kwargs(), max_bs=4)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    outs = [p.new_output(), p.new_output()]
    graphs = [torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()]
    for g, o in zip(graphs, outs):
        with torch.cuda.graph(g, stream=stream, pool=g0.pool()):
            verify_splitkv_fwd(*p.args(o), **p.kwargs(), max_bs=4)
    torch.cuda.synchronize()
    key = (torch.cuda.current_device(), stream.cuda_stream)
    assert key not in workspace_mod._COUNTERS, "a capture took the stream's eager counters"
    assert last_plan().fused and not separated, "the captures fell back to a second merge launch"
    graphs[1].replay()
    graphs[0].replay()
    torch.cuda.synchronize()
    assert_matches_reference(outs[1], p)
    assert_matches_reference(outs[0], p)


def test_cuda_is_there():
    assert CUDA
