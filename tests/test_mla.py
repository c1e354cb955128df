"""MLA verify (DeepSeek-V3/R1, Kimi-K2) on the split path: one KV head, a head of ``Dv + rope``, V a view of K.

DeepSeek's target-verify step calls the attention with q and k of head dim
576 (512 latent + 64 rope), v of 512, one KV head, and the value pool the
first 512 columns of the key pool (``v_buffer = k_buffer[..., :512]``). The
kernel takes such a head in two chunks (``ROPE_DIM``) and, where V is such a
view, loads each latent row once for both dots (``KV_SHARED``,
``DRAFT_SHARED``): see "MLA" in :mod:`splitkv.kernels.verify`.

Under the interpreter (float16/float32) the cases run at 576/512 and at a
smaller analogue, 80 = 64 + 16 / 64, against the float64 oracle, on token
and paged pools, causal and tree masks, 1 to 8 drafts, fp8 pools, the three
merge modes and the checked mode. The GPU tests at the end take DeepSeek-V3's
shapes (16 and 128 query heads, bf16 and fp8, batch 1 and 8, 4k prefixes).
"""

import dataclasses
from unittest import mock

import pytest
import torch

from conftest import (DEVICE, DTYPES, MIN_SPLIT, TOLERANCE, all_counters_zero, assert_close,
                      assert_matches_reference, gate_call, gpu, plan_options, poisoned_workspace_runner,
                      raises_kernel_fault)
from splitkv import VerifySplitKV, decline_reason, extend_attention_fwd, schedule, verify_attention
from splitkv.bench import mla as bench_mla
from splitkv.resources import H200_SHARED_MEMORY, shared_memory_bytes, shares_rows
from splitkv.schedule import LAST_PROGRAM, MERGE_PROGRAMS, SEPARATE_MERGE, TileConfig
from splitkv.testing import make_problem, paged_problem, reference_for, relative_error
from splitkv.testing.problem import MODEL_SHAPES

#: (head dim, value head dim): DeepSeek's, and an analogue the interpreter runs faster.
MLA = (576, 512)
SMALL = (80, 64)
DIMS = [SMALL, MLA]
#: Several slices per sequence under the interpreter, one empty prefix, ragged drafts up to 8.
PREFIXES = [4 * MIN_SPLIT + 13, 0, 2 * MIN_SPLIT + 1, 5]
EXTENDS = [4, 2, 8, 1]


def mla_problem(dims=SMALL, heads=16, prefixes=PREFIXES, extends=EXTENDS, *, shared=True, shared_draft=True,
                device=DEVICE, **kwargs):
    """A problem with one KV head whose V pool (``shared``) and draft V (``shared_draft``) are views of K's
    first ``Dv`` columns, as MLA's are; otherwise separate tensors holding the same values."""
    d, dv = dims
    p = make_problem(prefixes, extends, heads, 1, d, dv, device=device, **kwargs)
    v_buffer, v_extend = p.k_buffer[..., :dv], p.k_extend[..., :dv]
    return p.replace(v_buffer=v_buffer if shared else v_buffer.clone(),
                     v_extend=v_extend if shared_draft else v_extend.clone())


def paged_mla(p, page_size, shared=True):
    """``p``'s prefixes in NaN-poisoned pages, the value pages a view of the key pages (or a copy)."""
    pp = paged_problem(p, page_size, seed=1)
    v_pages = pp.k_pages[..., :p.v_head_dim]
    return dataclasses.replace(pp, v_pages=v_pages if shared else v_pages.clone())


def plan_for(runner, p, **kwargs):
    return runner.plan(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, p.qo_indptr, p.kv_indptr,
                       p.kv_indices, custom_mask=p.custom_mask, mask_indptr=p.mask_indptr, is_causal=p.is_causal,
                       sm_scale=p.sm_scale, k_scale=p.k_scale, v_scale=p.v_scale, sinks=p.sinks, **kwargs)


def run_plan(plan, p, lse=None):
    return plan.run(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, out=p.new_output(), lse=lse)


def runner_for(p, **kwargs):
    return VerifySplitKV(p.num_q_heads, 1, p.head_dim, p.v_head_dim, p.max_len_extend, p.batch_size, DEVICE,
                         **kwargs)


# --- the layout: two chunks, one load -------------------------------------------

def test_plan_takes_the_head_in_two_chunks_and_v_from_k():
    """576 = 512 + 64 and 80 = 64 + 16 are two chunks; V views of K are detected in the pools and the
    drafts apart; a power-of-two head, and a head that is no such sum, stay one chunk."""
    for dims, rope in ((MLA, 64), (SMALL, 16)):
        p = mla_problem(dims, 16, [40], [4], seed=1)
        plan = plan_for(runner_for(p), p)
        assert plan._constexprs["ROPE_DIM"] == rope
        assert plan.kv_shared and plan.draft_shared
        assert plan._constexprs["KV_SHARED"] and plan._constexprs["DRAFT_SHARED"]
    p = mla_problem(SMALL, 16, [40], [4], shared_draft=False, seed=1)  # SGLang's contiguous v_extend
    plan = plan_for(runner_for(p), p)
    assert plan.kv_shared and not plan.draft_shared
    p = mla_problem(SMALL, 16, [40], [4], shared=False, seed=1)
    plan = plan_for(runner_for(p), p)
    assert not plan.kv_shared and plan.draft_shared
    for d, dv in ((64, 64), (72, 64), (96, 96)):
        p = make_problem([40], 4, 4, 1, d, dv, device=DEVICE, seed=1)
        plan = plan_for(VerifySplitKV(4, 1, d, dv, 4, 1, DEVICE), p)
        assert plan._constexprs["ROPE_DIM"] == 0 and not plan.kv_shared


def test_shares_rows_needs_the_same_rows():
    k = torch.randn(10, 1, 80)
    assert shares_rows(k, k[..., :64])
    assert not shares_rows(k, k[..., :64].clone())  # same values, other storage
    assert not shares_rows(k, k[..., 16:])  # other columns
    assert not shares_rows(k, k[1:, :, :64])  # other rows
    assert not shares_rows(k, k.view(5, 2, 1, 80)[:, 0, :, :64])  # every other row: other strides


# --- rows per tile: a batch-1 launch is cut in two ----------------------------------

def test_only_a_one_tile_launch_is_cut():
    """On 132 SMs, MLA at batch 1 (one tile of 64 rows, at most 64 slices) takes two tiles of 32; a second
    sequence, 128 heads, or any GQA model of the benchmark keeps its rows."""
    def block(heads, kv_heads, batch, drafts=4):
        rows = schedule.block_m_for(heads // kv_heads * drafts)
        return schedule.launch_block_m(rows, lambda b: batch * schedule.head_tiles(heads, kv_heads, drafts, b), 132)

    assert block(16, 1, 1) == 32 and block(16, 1, 2) == 64 and block(128, 1, 1) == 64
    assert block(16, 1, 1, drafts=1) == 16  # 16 rows are the floor
    for s in MODEL_SHAPES.values():
        assert block(s.num_q_heads, s.num_kv_heads, 1) == schedule.block_m_for(s.num_q_heads // s.num_kv_heads * 4)


def test_a_cut_launch_matches_the_oracle_and_a_small_workspace_keeps_its_rows():
    """The batch-1 plan runs 32-row tiles (two per sequence) and matches the oracle; a batch-2 plan of the
    same runner keeps 64 rows. A caller's workspace sized for one 64-row tile has too few counters for
    the cut, so its plan keeps 64 rows, and is just as exact."""
    one, two = (mla_problem(SMALL, 16, [3 * MIN_SPLIT + 5] * n, [4] * n, dtype=torch.float32, seed=17)
                for n in (1, 2))
    runner = VerifySplitKV(16, 1, *SMALL, 4, 2, DEVICE, num_sms=132)
    plan = plan_for(runner, one)
    assert (plan.config.block_m, plan.tile.tiles, plan._constexprs["M_BLOCKS"]) == (32, 2, 2) and plan.n_splits > 1
    assert_matches_reference(run_plan(plan, one), one)
    assert plan_for(runner, two).config.block_m == 64
    small_ws, _ = poisoned_workspace_runner(one, max_bs=1, num_sms=132)
    plan = plan_for(small_ws, one)
    assert plan.config.block_m == 64
    assert_matches_reference(run_plan(plan, one), one)


# --- parity with the oracle -----------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask", ["causal", "tree"])
@pytest.mark.parametrize("dims", DIMS, ids=["80-64", "576-512"])
def test_token_pool_matches_oracle(dims, mask, dtype):
    """Token pool, V a view of K: 16 query heads x up to 8 drafts = 128 rows (two row blocks of 64),
    several slices per sequence; the gate serves it and the NaN-poisoned output is fully written."""
    p = mla_problem(dims, dtype=dtype, mask=mask, seed=2, sinks=True)
    assert gate_call(decline_reason, p) is None
    out = verify_attention(*p.tensors(p.new_output()), **p.options())
    assert_matches_reference(out, p)
    assert all_counters_zero()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("dims", DIMS, ids=["80-64", "576-512"])
def test_paged_pool_matches_oracle(dims, page_size, dtype):
    """Pages of 16 and 64 (SGLang's MLA page size), V pages a view of the K pages; every unused page
    row is NaN, so a read past a sequence's last key shows."""
    p = mla_problem(dims, dtype=dtype, mask="tree", seed=3)
    pp = paged_mla(p, page_size)
    assert gate_call(decline_reason, pp, kv_last_page_len=pp.kv_last_page_len) is None
    out = verify_attention(*pp.tensors(p.new_output()), **pp.options())
    assert_matches_reference(out, p)
    assert all_counters_zero()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("paged", [False, True], ids=["token", "paged"])
def test_view_and_copy_agree(paged, dtype):
    """V as a view of K (one load) and V as a separate copy (two loads) give the oracle's answer and each
    other's, whichever of the pools and the drafts shares."""
    outs = []
    for shared, shared_draft in ((True, True), (False, False), (True, False)):
        p = mla_problem(SMALL, dtype=dtype, mask="tree", seed=4, shared=shared, shared_draft=shared_draft)
        q = paged_mla(p, 16, shared) if paged else p
        out = verify_attention(*q.tensors(p.new_output()), **q.options())
        assert_matches_reference(out, p)
        outs.append(out)
    for out in outs[1:]:
        assert relative_error(out, outs[0]) < TOLERANCE[dtype] / 10


@pytest.mark.parametrize("k_rows", [False, True], ids=["k-transposed", "k-rows"])
def test_two_chunks_with_separate_values_and_gqa(k_rows):
    """A head of 48 = 32 + 16 with its own V (the layout of a 192 = 128 + 64 head) and two query heads
    per KV head, with K loaded either way."""
    p = make_problem(PREFIXES, EXTENDS, 4, 2, 48, 32, dtype=torch.float32, device=DEVICE, mask="tree", seed=5)
    runner = VerifySplitKV(4, 2, 48, 32, p.max_len_extend, p.batch_size, DEVICE,
                           config=TileConfig(16, 16, 4, 1, k_rows))
    plan = plan_for(runner, p)
    assert plan._constexprs["ROPE_DIM"] == 16 and not plan.kv_shared and plan.config.k_rows is k_rows
    assert_matches_reference(run_plan(plan, p), p)


def test_score_features():
    """Logit cap, sliding window, xai temperature and sinks on the two-chunk path."""
    features = dict(logit_cap=2.0, sliding_window_size=MIN_SPLIT + 7, xai_temperature_len=MIN_SPLIT)
    p = mla_problem(SMALL, dtype=torch.float32, mask="chain", seed=6, sinks=True)
    assert relative_error(reference_for(p, **features), reference_for(p)) > 3 * TOLERANCE[torch.float32]
    out = verify_attention(*p.tensors(p.new_output()), **p.options(), **features)
    assert_matches_reference(out, p, **features)


def test_context_parallel_shards():
    """Two context-parallel ranks (the prefix cut between them, one rank without the draft block),
    merged: the oracle's output and LSE."""
    from splitkv.testing.parallel import simulate_context_parallel

    p = mla_problem(SMALL, dtype=torch.float32, mask="tree", seed=15, sinks=True)
    out, lse = simulate_context_parallel(p, 2)
    ref, ref_lse = reference_for(p, return_lse=True)
    assert_close(out, ref)
    assert relative_error(lse, ref_lse) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dims", DIMS, ids=["80-64", "576-512"])
def test_fp8_pool_with_scales(dims):
    """An e4m3 pool (V its view, so one scale pair on one buffer: K's and V's scales still apply apart),
    float16 queries."""
    p = mla_problem(dims, dtype=torch.float16, kv_dtype=torch.float8_e4m3fn, k_scale=0.5, v_scale=0.25,
                    mask="tree", seed=7)
    assert p.v_buffer.dtype == torch.float8_e4m3fn and shares_rows(p.k_buffer, p.v_buffer)
    out = verify_attention(*p.tensors(p.new_output()), **p.options())
    assert_matches_reference(out, p)


@pytest.mark.parametrize("mode", [LAST_PROGRAM, MERGE_PROGRAMS, SEPARATE_MERGE],
                         ids=["last-program", "merge-programs", "second-launch"])
def test_merge_modes_and_lse(mode):
    """Every way of merging a tile's slices, with the LSE written, against the oracle's output and LSE
    (4 heads x 4 drafts: a 16-row tile, which its last program may merge alone)."""
    p = mla_problem(SMALL, 4, extends=[4, 2, 3, 1], dtype=torch.float32, mask="tree", seed=8, sinks=True)
    ref, ref_lse = reference_for(p, return_lse=True)
    with mock.patch.object(schedule, "FUSED_MAX_MERGE", 0 if mode == MERGE_PROGRAMS else 10**9):
        plan = plan_for(runner_for(p, n_splits=4, one_launch=mode != SEPARATE_MERGE), p, return_lse=True)
        assert plan.merge == mode
        lse = torch.full((p.num_tokens, p.num_q_heads), float("nan"), dtype=torch.float32, device=DEVICE)
        out = run_plan(plan, p, lse)
    assert_close(out, ref)
    assert relative_error(lse, ref_lse) < TOLERANCE[torch.float32]
    assert all_counters_zero()


def test_nan_poisoned_scratch():
    """Partials poisoned with NaN in a caller-owned workspace: every slot the merge reads was written."""
    p = mla_problem(SMALL, dtype=torch.float32, seed=9)
    runner, _ = poisoned_workspace_runner(p, n_splits=4)
    plan = plan_for(runner, p)
    assert plan.n_splits == 4 and plan.kv_shared
    assert_matches_reference(run_plan(plan, p), p)


def test_checked_mode_reports_a_slot_outside_the_pool():
    p = mla_problem(SMALL, dtype=torch.float32, seed=10)
    indices = p.kv_indices.clone()
    indices[PREFIXES[0] + 3] = p.k_buffer.shape[0] + 1000  # sequence 2's fourth key (sequence 1 has none)
    with raises_kernel_fault(r"sequence 2: kv_indices holds a slot \(or page id\) outside the pool"):
        verify_attention(*p.replace(kv_indices=indices).tensors(p.new_output()), **p.options(), check=True)


def test_a_plan_made_on_views_refuses_separate_values():
    """A plan that reads V from K's rows refuses a run whose V is another tensor of the same layout."""
    p = mla_problem(SMALL, dtype=torch.float32, seed=11)
    plan = plan_for(runner_for(p), p)
    other = torch.randn_like(p.k_buffer)[..., :p.v_head_dim]  # same shape and strides, other storage
    with pytest.raises(ValueError, match="reads V from K's rows"):
        plan.run(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, other, out=p.new_output())


def test_the_drop_in_plans_again_for_a_copy_of_v():
    """The drop-in's cached plan for V viewing K is not reused for a V of the same shape and strides
    in other storage (which that plan would refuse)."""
    from splitkv import verify_splitkv_fwd

    def strided_copy(view):  # the same values, shape and strides as the view, another tensor's storage
        whole = torch.full(view.shape[:-1] + (p.head_dim,), float("nan"), dtype=view.dtype, device=view.device)
        whole[..., :p.v_head_dim] = view
        return whole[..., :p.v_head_dim]

    for shared in (True, False, True):
        p = mla_problem(SMALL, dtype=torch.float32, seed=12)
        if not shared:
            p = p.replace(v_buffer=strided_copy(p.v_buffer), v_extend=strided_copy(p.v_extend))
        out = p.new_output()
        verify_splitkv_fwd(*p.args(out), **p.kwargs())
        assert_matches_reference(out, p)


# --- the extend baseline ---------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask", ["causal", "tree"])
@pytest.mark.parametrize("dims", DIMS, ids=["80-64", "576-512"])
def test_extend_baseline_takes_the_head_in_two_chunks(dims, mask, dtype):
    """The extend baseline serves MLA heads too (latent and rope chunks, no padding to 1024), so the split
    path has a serial peer and a fallback at these shapes: same oracle, same tolerance."""
    p = mla_problem(dims, dtype=dtype, mask=mask, seed=15, sinks=True)
    out = p.new_output()
    extend_attention_fwd(*p.args(out), **p.kwargs())
    assert_matches_reference(out, p)


def test_a_declined_mla_call_falls_back_to_the_extend_baseline():
    """A tree mask over the prefix (which the split path declines) at MLA's shape: ``verify_attention``
    runs the extend baseline, and the answer is the oracle's."""
    p = mla_problem(SMALL, 4, [70, 9], [4, 3], dtype=torch.float32, mask="tree", seed=18)
    assert gate_call(decline_reason, p, skip_prefix_custom_mask=False).startswith("custom mask on the prefix")
    out = verify_attention(*p.tensors(p.new_output()), **p.options(), skip_prefix_custom_mask=False)
    assert_matches_reference(out, p, skip_prefix_custom_mask=False)


def test_extend_baseline_declines_a_wider_latent():
    """Two chunks of at most 512 + a power of two; one padded chunk of at most 256."""
    p = mla_problem((1024 + 64, 1024), 2, [8], [2], dtype=torch.float32, seed=1)
    with pytest.raises(NotImplementedError, match="512"):
        extend_attention_fwd(*p.args(p.new_output()), **p.kwargs())


# --- the gate and the H200's shared memory ----------------------------------------

@pytest.mark.parametrize("shared", [True, False], ids=["view", "copy"])
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float8_e4m3fn], ids=["16-bit", "fp8"])
def test_gate_serves_deepseek_shapes_within_the_h200_limit(kv_dtype, shared, monkeypatch):
    """With the H200's 227 KB, DeepSeek-V3's 16 heads x 4 drafts (one 64-row tile) are served in 16-bit
    and fp8 pools, V a view or a copy. Padded to one 1024-wide chunk the fp8 pool had no tile at all."""
    monkeypatch.setattr(schedule, "device_shared_memory", lambda device: H200_SHARED_MEMORY)
    p = mla_problem(MLA, 16, [100], [4], dtype=torch.float16, kv_dtype=kv_dtype, shared=shared, seed=12)
    assert gate_call(decline_reason, p) is None
    smallest = TileConfig(64, 16, 4, 1)
    assert shared_memory_bytes(smallest, *MLA, torch.float8_e4m3fn, torch.bfloat16, rope=0) > H200_SHARED_MEMORY


# --- the benchmark's rows and arithmetic (CPU) ----------------------------------------

def test_bench_rows_and_arithmetic():
    rows = bench_mla.ROWS
    assert len(rows) == len(set(rows)) == 18
    assert {h for h, _, _ in rows} == {16, 128} and {b for _, b, _ in rows} == {1, 8, 32}
    assert {n for _, _, n in rows} == {4096, 16384, 65536}
    assert set(bench_mla.QUICK_ROWS) <= set(rows)
    p = bench_mla.mla_problem(4, 2, 24, device="cpu", dtype=torch.float32, drafts=3)
    assert (p.head_dim, p.v_head_dim, p.num_kv_heads) == (576, 512, 1)
    assert shares_rows(p.k_buffer, p.v_buffer) and shares_rows(p.k_extend, p.v_extend)
    assert bench_mla.latent_bytes(p) == 2 * 24 * 576 * 4
    # Per query row and visible key 2 x (576 + 512) flops: 4 heads x 2 sequences x (3 x 24 + 1 + 2 + 3) pairs.
    assert bench_mla.flops(p) == 2 * 1088 * 4 * 2 * (3 * 24 + 6)


class _CallTimer:
    """A benchmark timer that only calls: each timing runs ``fn`` once and reports 10 µs."""

    def graph(self, fn):
        fn()
        return 10.0


def test_bench_row_wiring():
    """One row on a tiny CPU problem with a timer that only calls: splitkv, the extend baseline and SDPA
    run and agree, and the table shows them."""
    p = bench_mla.mla_problem(4, 2, 40, device=DEVICE, dtype=torch.float32)
    row = bench_mla.bench_row(p, _CallTimer(), bandwidth=1e12, impls=("splitkv", "extend", "sdpa"))
    ours, extend, sdpa = (row["impls"][name] for name in ("splitkv", "extend", "sdpa"))
    assert ours["us"] == extend["us"] == sdpa["us"] == 10.0 and ours["kv_shared"]
    assert max(extend["rel_diff_vs_splitkv"], sdpa["rel_diff_vs_splitkv"]) < TOLERANCE[torch.float32]
    assert row["floor_us"] == pytest.approx(bench_mla.latent_bytes(p) / 1e12 * 1e6)
    assert ours["tflops"] == pytest.approx(bench_mla.flops(p) / 10e-6 / 1e12)
    md = bench_mla.format_markdown(dict(device="cpu", read_bandwidth=1e12, rows=[row]))
    assert "| 4 | 2 | 0k |" in md and "| 10.0 | 10.0 |" in md


def test_bench_fp8_row_wiring():
    """``--fp8``'s row: the cache quantised once (values still a view of it, one byte per element), splitkv
    timed on both caches of the draw and its outputs compared, the table's fp8 columns."""
    p = bench_mla.mla_problem(4, 2, 40, device=DEVICE, dtype=torch.float16)
    q = bench_mla.fp8_latent(p)
    assert q.k_buffer.dtype == torch.float8_e4m3fn and shares_rows(q.k_buffer, q.v_buffer)
    assert q.k_scale == q.v_scale == bench_mla.FP8_SCALE
    assert 2 * bench_mla.latent_bytes(q) == bench_mla.latent_bytes(p)
    row = bench_mla.bench_row(q, _CallTimer(), bandwidth=1e12, impls=bench_mla.FP8_IMPLS, bf16=p)
    assert row["kv_dtype"] == "float8_e4m3fn" and row["bf16_us"] == 10.0 and row["fp8_over_bf16"] == 1.0
    # e4m3 keeps 3 mantissa bits: the two caches' outputs differ by a few per cent, not more.
    assert 1e-4 < row["rel_diff_vs_bf16"] < 0.1
    assert row["impls"]["extend"]["rel_diff_vs_splitkv"] < TOLERANCE[torch.float16]
    md = bench_mla.format_markdown(dict(device="cpu", read_bandwidth=1e12, rows=[row]))
    assert "fp8 ÷ bf16" in md and "| 10.0 | 1.00 | 10.0 |" in md


# --- GPU: DeepSeek-V3's shapes ---------------------------------------------------------

@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 64], ids=["token", "pages-64"])
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("heads", [16, 128])
def test_deepseek_v3_on_the_gpu(heads, kv_dtype, batch, page_size):
    """16 and 128 query heads, bf16 queries, bf16 or fp8 pools (V a view of K), 4k prefixes, 4 drafts:
    the gate serves it, the plan's tile fits (32-64 keys), the output matches the oracle."""
    p = mla_problem(MLA, heads, [4096 + 37 * b for b in range(batch)], 4, dtype=torch.bfloat16,
                    kv_dtype=kv_dtype, k_scale=0.7, v_scale=0.7, seed=13)
    q = paged_mla(p, page_size) if page_size > 1 else p
    paged = {"kv_last_page_len": q.kv_last_page_len} if page_size > 1 else {}
    assert gate_call(decline_reason, q, **paged) is None
    t = q.tensors(None)
    plan = runner_for(p).plan(*t[:3], *t[4:], **plan_options(q))
    assert plan.kv_shared and plan.config.block_n >= 32 and plan.config.num_warps == 8
    assert_matches_reference(plan.run(*t[:3], *t[4:6], out=p.new_output()), p)


@gpu
@pytest.mark.gpu
def test_deepseek_v3_copy_of_v_on_the_gpu():
    """The same shapes with V a separate copy: a smaller tile, the same answer."""
    p = mla_problem(MLA, 16, [4096] * 8, 4, dtype=torch.bfloat16, shared=False, seed=14)
    out = verify_attention(*p.tensors(p.new_output()), **p.options())
    assert_matches_reference(out, p)



@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_deepseek_v3_extend_baseline_on_the_gpu(kv_dtype):
    """The extend baseline at DeepSeek-V3's 576/512 (two chunks, V a view of K): it matches the oracle,
    and the split path matches it."""
    p = mla_problem(MLA, 16, [4096, 1000], [4, 3], dtype=torch.bfloat16, kv_dtype=kv_dtype, k_scale=0.7,
                    v_scale=0.7, seed=16)
    base = p.new_output()
    extend_attention_fwd(*p.args(base), **p.kwargs())
    assert_matches_reference(base, p)
    ours = verify_attention(*p.tensors(p.new_output()), **p.options())
    assert relative_error(ours, base) < 2 * TOLERANCE[torch.bfloat16]
