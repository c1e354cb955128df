"""The split-KV path against the float64 oracle and against the baseline.

Runs on the CPU through the Triton interpreter (float16/float32) and on a GPU
(bfloat16 too). Outputs are poisoned with NaN before every run, data is drawn
fresh, kv_indices are random slots of a larger pool.
"""

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import (
    DEVICE,
    DTYPES,
    MIN_SPLIT,
    TOLERANCE,
    all_counters_zero,
    assert_close,
    assert_matches_reference,
    concat_problems,
    gate_call,
    last_plan,
    poisoned_workspace_runner,
    prefix_only_mask,
    raises_kernel_fault,
)
from splitkv import (
    VerifyPlan,
    VerifySplitKV,
    can_handle,
    clear_caches,
    decline_reason,
    extend_attention_fwd,
    get_runner,
    verify_attention,
    verify_splitkv_fwd,
    workspace_bytes,
)
from splitkv.schedule import min_split_for, n_used
from splitkv.schedule import (GRID_MERGE_FEW, GRID_MERGE_UNROLL, LAST_PROGRAM, MERGE_PROGRAMS, MERGE_UNROLL,
                              SEPARATE_MERGE, TileConfig, merge_unroll)
from splitkv.testing import make_problem, paged_problem, reference_for, relative_error


def run_split(problem, **kwargs):
    """verify_splitkv_fwd on a NaN-poisoned output; it must accept the call."""
    out = problem.new_output()
    assert verify_splitkv_fwd(*problem.args(out), **problem.kwargs(), **kwargs)
    return out


def run_runner(problem, n_splits, pack_gqa=True, poison_scratch=True):
    """A runner with a forced split count and a caller-owned workspace whose partials are NaN."""
    p = problem
    if poison_scratch:
        runner, _ = poisoned_workspace_runner(p, pack_gqa=pack_gqa, n_splits=n_splits)
    else:
        runner = VerifySplitKV(p.num_q_heads, p.num_kv_heads, p.head_dim, p.v_head_dim,
                               p.max_len_extend, p.batch_size, DEVICE, pack_gqa=pack_gqa, n_splits=n_splits)
    out = p.new_output()
    runner(
        p.q_extend, p.k_extend, p.v_extend, out, p.k_buffer, p.v_buffer,
        p.qo_indptr, p.kv_indptr, p.kv_indices, custom_mask=p.custom_mask, mask_indptr=p.mask_indptr,
        is_causal=p.is_causal, sm_scale=p.sm_scale, k_scale=p.k_scale, v_scale=p.v_scale, sinks=p.sinks,
    )
    assert all_counters_zero()
    return out


def plan_of(runner, p, **kwargs):
    """``runner.plan`` for a problem's tensors."""
    return runner.plan(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, p.qo_indptr, p.kv_indptr,
                       p.kv_indices, custom_mask=p.custom_mask, mask_indptr=p.mask_indptr, is_causal=p.is_causal,
                       sm_scale=p.sm_scale, k_scale=p.k_scale, v_scale=p.v_scale, sinks=p.sinks, **kwargs)


def run_with_lse(plan, p):
    """``(out, lse)`` of a ``return_lse`` plan run on a problem's tensors, into NaN-poisoned buffers."""
    lse = torch.full((p.num_tokens, p.num_q_heads), float("nan"), dtype=torch.float32, device=DEVICE)
    out = plan.run(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, out=p.new_output(), lse=lse)
    return out, lse


def slices_used(plan, p):
    """Prefix slices the kernel uses per sequence under ``plan`` (the mirror, checked in test_occupancy)."""
    block_n = plan.config.block_n
    split_tokens = plan.runner.split_tokens
    return [n_used(n, plan.n_splits, block_n, min_split_for(block_n, MIN_SPLIT), split_tokens=split_tokens)
            for n in p.prefix_lens]


# --- parity with the oracle across the shape space -------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_q_heads,num_kv_heads", [(4, 4), (4, 1), (6, 2), (8, 2)], ids=["mha", "mqa", "group3", "group4"]
)
def test_gqa_ratios(dtype, num_q_heads, num_kv_heads):
    p = make_problem([54, 97], 4, num_q_heads, num_kv_heads, 64, dtype=dtype, device=DEVICE)
    assert_matches_reference(run_split(p), p)


@pytest.mark.parametrize(
    "head_dim,v_head_dim", [(64, 64), (96, 96), (192, 192), (64, 32), (32, 96)]
)
def test_head_dims(head_dim, v_head_dim):
    p = make_problem([54, 33], 3, 4, 2, head_dim, v_head_dim, device=DEVICE)
    assert_matches_reference(run_split(p), p)


@pytest.mark.parametrize("extend_len", [1, 2, 3, 5, 7, 8])
def test_extend_lengths(extend_len):
    p = make_problem([54, 97], extend_len, 6, 2, 32, device=DEVICE)
    assert_matches_reference(run_split(p), p)


def test_ragged_extend_lengths():
    p = make_problem([54, 97, 20], [3, 8, 1], 4, 2, 32, device=DEVICE)
    assert_matches_reference(run_split(p), p)


@pytest.mark.parametrize("n_splits", [1, 3, 7, 64])
def test_short_prefixes_and_empty_splits(n_splits):
    """Prefix 0 and 1 beside long ones: most splits of the short ones get no key."""
    p = make_problem([97, 0, 54, 1], 4, 4, 2, 32, device=DEVICE)
    assert_matches_reference(run_runner(p, n_splits), p)


def test_all_prefixes_empty():
    p = make_problem([0, 0], 5, 4, 2, 32, device=DEVICE)
    assert_matches_reference(run_runner(p, 4), p)


def test_empty_pool():
    """Pools of no rows (nothing cached yet): the drafts attend to each other alone, on every path."""
    p = make_problem([0, 0, 0], [5, 1, 3], 4, 2, 32, device=DEVICE)
    p = p.replace(k_buffer=p.k_buffer[:0], v_buffer=p.v_buffer[:0])
    assert_matches_reference(run_split(p), p)
    assert_matches_reference(run_runner(p, 4), p)
    assert_matches_reference(verify_attention(*p.tensors(None), **p.options()), p)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_index_dtypes(index_dtype):
    p = make_problem([54, 97], 4, 4, 2, 32, index_dtype=index_dtype, device=DEVICE)
    assert_matches_reference(run_split(p), p)


def test_fused_qkv_views():
    """q/k/v as views into one fused projection: row strides are not H * D."""
    p = make_problem([54, 97], 5, 4, 2, 32, fused_qkv=True, device=DEVICE)
    assert not p.q_extend.is_contiguous()
    assert_matches_reference(run_split(p), p)


@pytest.mark.parametrize("mask", ["causal", "chain", "tree", "none"])
def test_draft_masks(mask):
    p = make_problem([54, 97, 5], [5, 7, 3], 4, 2, 32, mask=mask, device=DEVICE)
    assert_matches_reference(run_split(p), p)


def test_kv_scales_and_sinks():
    p = make_problem([54, 97], 4, 4, 2, 32, k_scale=0.5, v_scale=0.25, sinks=True, device=DEVICE)
    assert_matches_reference(run_split(p), p)


@pytest.mark.parametrize("pack_gqa", [True, False], ids=["packed", "per-head"])
def test_packed_and_per_head_layouts(pack_gqa):
    """Both tile layouts compute the same function, through many splits."""
    p = make_problem([54, 97, 1], 3, 6, 2, 32, device=DEVICE)
    assert_matches_reference(run_runner(p, 5, pack_gqa=pack_gqa), p)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 5, 16], ids=["tokens", "pages5", "pages16"])
@pytest.mark.parametrize("k_rows", [False, True], ids=["k-transposed", "k-rows"])
def test_k_tile_layouts(k_rows, page_size, dtype):
    """K loaded as [D, BLOCK_N] or as rows, transposed on chip (``TileConfig.k_rows``):
    the same function, for token and paged pools (pages of 16 hold whole key tiles,
    pages of 5 do not), with a tree mask, sinks and several slices per sequence."""
    p = make_problem([54, 97, 1], [4, 3, 2], 4, 2, 32, dtype=dtype, mask="tree", sinks=True, device=DEVICE, seed=5)
    runner, _ = poisoned_workspace_runner(p, n_splits=5, config=TileConfig(16, 16, 4, 1, k_rows=k_rows))
    kb, vb, kv_indptr, kv_indices, last = p.k_buffer, p.v_buffer, p.kv_indptr, p.kv_indices, None
    if page_size > 1:
        pp = paged_problem(p, page_size, seed=6)
        kb, vb, kv_indptr, kv_indices, last = pp.k_pages, pp.v_pages, pp.kv_indptr, pp.kv_indices, pp.kv_last_page_len
    plan = runner.plan(p.q_extend, p.k_extend, p.v_extend, kb, vb, p.qo_indptr, kv_indptr, kv_indices,
                       custom_mask=p.custom_mask, mask_indptr=p.mask_indptr, is_causal=p.is_causal,
                       sm_scale=p.sm_scale, sinks=p.sinks, kv_last_page_len=last)
    assert plan.config.k_rows is k_rows
    out = plan.run(p.q_extend, p.k_extend, p.v_extend, kb, vb, out=p.new_output())
    assert_matches_reference(out, p)
    assert all_counters_zero()


def test_group_times_drafts_spans_several_row_tiles():
    """MQA with 16 query heads x 7 drafts = 112 rows: two 64-row tiles."""
    p = make_problem([40, 9], 7, 16, 1, 16, device=DEVICE)
    assert_matches_reference(run_split(p), p)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_baseline(dtype):
    """Parity with our extend_attention_fwd, the kernel the split path replaces."""
    p = make_problem([54, 97, 0], 4, 8, 2, 64, dtype=dtype, k_scale=0.5, v_scale=2.0, device=DEVICE)
    base = p.new_output()
    extend_attention_fwd(*p.args(base), **p.kwargs())
    split = run_split(p)
    assert relative_error(split, base) < TOLERANCE[dtype]


# --- outputs and scratch ---------------------------------------------------

def test_user_output_view_written_in_place():
    """o_extend as a strided view: its elements written, its neighbours not."""
    p = make_problem([54, 33], 4, 4, 2, 32, device=DEVICE)
    backing = torch.full((p.num_tokens, p.num_q_heads, 2 * p.v_head_dim), 7.0, dtype=p.q_extend.dtype, device=DEVICE)
    out = backing[:, :, : p.v_head_dim]
    assert verify_splitkv_fwd(*p.args(out), **p.kwargs())
    assert_matches_reference(out, p)
    assert (backing[:, :, p.v_head_dim:] == 7.0).all()


def test_padding_rows_past_the_batch_untouched():
    """Rows past qo_indptr[-1] (padded graph batches) belong to no sequence."""
    p = make_problem([54, 33], 4, 4, 2, 32, device=DEVICE)
    extra = 3
    pad = lambda t: torch.cat([t, torch.randn_like(t[:extra])])  # noqa: E731
    padded = p.replace(
        q_extend=pad(p.q_extend), k_extend=pad(p.k_extend), v_extend=pad(p.v_extend),
        max_len_extend=p.max_len_extend + 2,  # keeps rows <= bs * max_len_extend
    )
    out = torch.full((p.num_tokens + extra, p.num_q_heads, p.v_head_dim), 7.0, dtype=p.q_extend.dtype, device=DEVICE)
    assert verify_splitkv_fwd(*padded.args(out), **padded.kwargs())
    assert_matches_reference(out[: p.num_tokens], p)
    assert (out[p.num_tokens:] == 7.0).all()


def test_workspace_serves_every_batch_up_to_max_bs():
    """One runner with a caller-owned workspace (partials poisoned) serves every bs <= max_bs."""
    p0 = make_problem([54], 4, 4, 2, 32, device=DEVICE)
    runner, ws = poisoned_workspace_runner(p0, max_bs=3, n_splits=4)
    for prefix_lens in ([54], [97, 3], [1, 54, 0]):
        p = make_problem(prefix_lens, 4, 4, 2, 32, device=DEVICE)
        out = p.new_output()
        runner(*p.args(out)[:9], custom_mask=p.custom_mask, mask_indptr=p.mask_indptr, is_causal=p.is_causal,
               sm_scale=p.sm_scale)
        assert_matches_reference(out, p)
        assert all_counters_zero() and int(torch.count_nonzero(runner._workspace.counters)) == 0
    p = make_problem([5] * 4, 4, 4, 2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="max_bs"):
        runner(*p.args(p.new_output())[:9], sm_scale=p.sm_scale)


def test_workspace_too_small_is_refused():
    p = make_problem([54], 4, 4, 2, 32, device=DEVICE)
    need = workspace_bytes(4, 2, 32, 4, 1, 4)
    with pytest.raises(ValueError, match="workspace"):
        VerifySplitKV(4, 2, 32, 32, 4, 1, DEVICE, n_splits=4,
                      workspace=torch.zeros(need // 4 - 1, dtype=torch.float32, device=DEVICE))
    assert p.batch_size == 1


def _meta_args(bs, h_q, h_kv, d, kv_len, L=4):
    """``(tensors, keywords)`` of the gate for meta tensors of these shapes."""
    meta = lambda *shape, dtype=torch.float16: torch.empty(*shape, dtype=dtype, device="meta")  # noqa: E731
    return ((meta(bs * L, h_q, d), meta(bs * L, h_kv, d), meta(bs * L, h_kv, d), meta(1, h_kv, d), meta(1, h_kv, d),
             meta(bs + 1, dtype=torch.int32), meta(bs + 1, dtype=torch.int32), meta(kv_len, dtype=torch.int64)),
            dict(custom_mask=None, is_causal=True, mask_indptr=None, max_len_extend=L))


def _meta_reason(bs, h_q, h_kv, d, kv_len, L=4, **options):
    """``decline_reason`` for :func:`_meta_args`' meta tensors, with ``options``."""
    args, kwargs = _meta_args(bs, h_q, h_kv, d, kv_len, L=L)
    return decline_reason(*args, **kwargs, **options)


def test_launch_limits_declined():
    """Grids past CUDA's limits are declined from shapes alone (meta tensors: no memory, no values)."""
    assert _meta_reason(2, 4, 2, 32, 1000) is None
    assert _meta_reason(2, 4, 2, 32, 2**31).startswith("launch limit")  # 32-bit positions
    # Fixed slices: cdiv(max_prefix_len, 128) > 65535 slices on grid axis 1.
    assert _meta_reason(2, 4, 2, 32, 128 * 65535 + 1, split_tokens=128,
                        max_prefix_len=128 * 65535 + 1).startswith("launch limit")
    assert _meta_reason(2, 4, 2, 32, 128 * 65535, split_tokens=128, max_prefix_len=128 * 65535) is None
    # Tiles on axis 0: 64 KV heads x 1 row block x 2^25 sequences = 2^31.
    assert _meta_reason(2, 64, 64, 32, 1000, L=1, max_bs=2**25).startswith("launch limit")
    assert _meta_reason(2, 64, 64, 32, 1000, L=1, max_bs=2**25 - 1) is None
    assert "multiple of 128" in _meta_reason(2, 4, 2, 32, 1000, split_tokens=100, max_prefix_len=1000)


def test_drop_in_reuses_one_runner_per_shape():
    shapes = dict(num_q_heads=4, num_kv_heads=1, head_dim=16, extend_lens=2, device=DEVICE)
    p = make_problem([30, 30], **shapes)
    run_split(p, max_bs=8)
    runner = get_runner(p.q_extend, p.k_extend, p.v_extend, p.max_len_extend, 8)
    for bs in (1, 3, 8):
        q = make_problem([30] * bs, **shapes)
        run_split(q, max_bs=8)
        assert get_runner(q.q_extend, q.k_extend, q.v_extend, q.max_len_extend, 8) is runner
        assert last_plan().runner is runner


def first_keys(problem, n):
    """The problem cut to the first ``n`` entries of ``kv_indices`` (later sequences lose keys
    first): same pool and tensors' shapes, so the drop-in sees the same signature, as when
    prefixes grow step by step."""
    indptr = problem.kv_indptr.clamp(max=n)
    return problem.replace(kv_indptr=indptr, kv_indices=problem.kv_indices[:n],
                           prefix_lens=(indptr[1:] - indptr[:-1]).tolist())


def test_drop_in_replans_when_prefixes_pass_the_small_launch_limit(monkeypatch):
    """A cached plan keeps its tile while prefixes grow; past SMALL_BATCH_MAX_PREFIX keys
    (where the small-launch tile stops being the faster one) the drop-in plans anew, once."""
    from splitkv import api

    monkeypatch.setattr(api, "SMALL_BATCH_MAX_PREFIX", 100)
    clear_caches()
    full = make_problem([150], 2, 4, 1, 16, device=DEVICE, seed=7)  # one pool; the prefix grows
    plans = []
    for prefix in (60, 90, 101, 150):
        p = first_keys(full, prefix)
        assert_matches_reference(run_split(p), p)
        plans.append(last_plan())
    assert plans[0] is plans[1] and plans[2] is plans[3] and plans[1] is not plans[2]


def test_drop_in_cache_key_counts_the_mean_prefix_as_the_plan_does(monkeypatch):
    """301 keys over 3 sequences are a mean prefix of 100 for the plan (floor), so with a limit
    of 100 the call keeps the plan made at 300 keys rather than planning anew."""
    from splitkv import api

    monkeypatch.setattr(api, "SMALL_BATCH_MAX_PREFIX", 100)
    clear_caches()
    full = make_problem([100, 100, 101], 2, 4, 1, 16, device=DEVICE, seed=9)
    short = first_keys(full, 300)
    assert short.prefix_lens == [100, 100, 100]
    plans = []
    for p in (short, full):
        assert_matches_reference(run_split(p), p)
        plans.append(last_plan())
    assert plans[0] is plans[1]


def test_drop_in_rebinds_from_one_slice_to_several_and_back():
    """A cached plan made for one slice (finished in registers) that a longer prefix rebinds
    to several must merge them, and go back; found on the H200, where 60 keys are one slice."""
    clear_caches()  # the first call must plan afresh
    full = make_problem([150], 2, 4, 1, 16, device=DEVICE, seed=8)  # one pool; the prefix grows
    for prefix in (MIN_SPLIT // 2, 150, MIN_SPLIT // 2):
        p = first_keys(full, prefix)
        assert_matches_reference(run_split(p), p)
        assert last_plan().n_splits == -(-prefix // MIN_SPLIT)


def test_plan_refuses_other_dtypes_and_runs_after_release_only_once_rebound():
    """run() launches with addresses, so it checks what the compiled kernel assumes: the
    inputs' dtypes are the planned ones (the output's is free), and the bound metadata is there."""
    p = make_problem([97, 54], [3, 1], 4, 2, 32, device=DEVICE, seed=11)
    runner = VerifySplitKV(p.num_q_heads, p.num_kv_heads, p.head_dim, p.v_head_dim, p.max_len_extend,
                           p.batch_size, DEVICE, n_splits=3)
    plan = runner.plan(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, p.qo_indptr, p.kv_indptr,
                       p.kv_indices, sm_scale=p.sm_scale)
    layer = (p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer)
    with pytest.raises(ValueError, match="k_buffer is torch.float32, planned torch.float16"):
        plan.run(*layer[:3], p.k_buffer.float(), p.v_buffer, out=p.new_output())
    wide = torch.full(p.new_output().shape, float("nan"), dtype=torch.float32, device=DEVICE)
    assert_matches_reference(plan.run(*layer, out=wide).to(p.q_extend.dtype), p)  # a float32 output is served
    plan.release()
    with pytest.raises(RuntimeError, match="rebind"):
        plan.run(*layer, out=p.new_output())
    plan.rebind(p.qo_indptr, p.kv_indptr, p.kv_indices)
    assert_matches_reference(plan.run(*layer, out=p.new_output()), p)


def test_runner_grows_in_place_and_outgrown_counters_stay():
    """A larger max_bs raises the cached runner's bound (nothing is sized by it); counter arrays
    that are outgrown stay referenced (CUDA graphs captured with them keep valid addresses)."""
    from splitkv import workspace as workspace_mod

    p = make_problem([30], 3, 6, 3, 16, device=DEVICE)
    small = get_runner(p.q_extend, p.k_extend, p.v_extend, 3, max_bs=2)
    big = get_runner(p.q_extend, p.k_extend, p.v_extend, 3, max_bs=64)
    assert big is small and big.max_bs == 64
    assert get_runner(p.q_extend, p.k_extend, p.v_extend, 3, max_bs=5) is big and big.max_bs == 64
    first = workspace_mod.counters(torch.device(DEVICE), 16)
    grown = workspace_mod.counters(torch.device(DEVICE), first.numel() + 1)
    assert grown.numel() >= 2 * first.numel() and not grown.count_nonzero()
    assert any(a is first for a in workspace_mod._OUTGROWN)
    assert workspace_mod.counters(torch.device(DEVICE), 16) is grown  # never shrinks


# --- the gate --------------------------------------------------------------

def test_tensor_scale_declined_leaves_output_untouched():
    """A k_scale held in a tensor would need a device read: declined, nothing written."""
    p = make_problem([54, 33], 4, 4, 2, 32, device=DEVICE)
    out = p.new_output(fill=3.0)
    args = list(p.args(out))
    args[13] = torch.tensor(0.5)
    assert not verify_splitkv_fwd(*args, **p.kwargs())
    assert (out == 3.0).all()


@pytest.mark.parametrize("feature", [dict(logit_cap=30.0), dict(sliding_window_size=128),
                                     dict(xai_temperature_len=64)], ids=["logit_cap", "window", "xai"])
def test_score_features_are_served(feature):
    """Every extend score feature runs on the split path (parity in test_features.py)."""
    p = make_problem([54, 33], 4, 4, 2, 32, device=DEVICE)
    out = p.new_output()
    assert verify_splitkv_fwd(*p.args(out), **p.kwargs(), **feature)
    assert_matches_reference(out, p, **feature)


def test_prefix_custom_mask_declined():
    p = make_problem([54, 33], 4, 4, 2, 32, mask="tree", device=DEVICE)
    out = p.new_output(fill=3.0)
    assert not verify_splitkv_fwd(*p.args(out), **p.kwargs(), skip_prefix_custom_mask=False)
    assert (out == 3.0).all()


def test_max_len_extend_contract():
    """Larger than the real extend is served (ragged); too small is refused by the checked kernel;
    outside [1, 64] is declined."""
    p = make_problem([54, 33], 4, 4, 2, 32, device=DEVICE)
    out = run_split(p.replace(max_len_extend=5))
    assert_matches_reference(out, p)
    # Too small for the drafts: the gate reads shapes only, and 8 draft rows for 2 sequences of at most 3
    # may be a sub-batch's view of longer tensors, so the checked kernel is what refuses it.
    short = p.replace(max_len_extend=3)
    with raises_kernel_fault("more draft tokens than max_len_extend"):
        verify_splitkv_fwd(*short.args(short.new_output()), **short.kwargs(), check=True)
    assert not gate_call(can_handle, p.replace(max_len_extend=0))
    assert not gate_call(can_handle, p.replace(max_len_extend=65))


@pytest.mark.parametrize(
    "breakage",
    ["head_count", "head_dim", "dtype", "output_shape", "device", "index_dtype", "rank"],
)
def test_malformed_input(breakage):
    """The production entry raises ValueError; the drop-in's gate declines."""
    p = make_problem([54, 33], 4, 4, 2, 32, device=DEVICE)
    out = p.new_output()
    if breakage == "head_count":
        p = p.replace(k_buffer=p.k_buffer[:, :1])
    elif breakage == "head_dim":
        p = p.replace(k_extend=p.k_extend[:, :, :16])
    elif breakage == "dtype":
        p = p.replace(k_extend=p.k_extend.float() if p.k_extend.dtype != torch.float32 else p.k_extend.half())
    elif breakage == "output_shape":
        out = out[:, :2]
    elif breakage == "device":
        p = p.replace(kv_indices=p.kv_indices.to("meta"))
    elif breakage == "index_dtype":
        p = p.replace(kv_indices=p.kv_indices.float())
    elif breakage == "rank":
        p = p.replace(q_extend=p.q_extend.flatten(1))
    with pytest.raises(ValueError):
        verify_attention(*p.tensors(out), **p.options())
    assert not verify_splitkv_fwd(*p.args(out), **p.kwargs())
    assert gate_call(decline_reason, p, o_extend=out).startswith("malformed")


def test_gate_reads_no_values():
    """The gate decides on meta tensors, which have shapes and no data."""
    p = make_problem([54, 33], 4, 4, 2, 32, mask="tree", sinks=True, device=DEVICE)
    meta = p.replace(**{
        name: getattr(p, name).to("meta")
        for name in ("q_extend", "k_extend", "v_extend", "k_buffer", "v_buffer", "qo_indptr",
                     "kv_indptr", "kv_indices", "custom_mask", "mask_indptr", "sinks")
    })
    assert gate_call(can_handle, meta, sinks=meta.sinks)


# --- the production entry --------------------------------------------------

@pytest.mark.parametrize("features", [{}, {"logit_cap": 5.0}, {"sliding_window_size": 40}])
def test_verify_attention_is_always_right(features):
    p = make_problem([54, 97], 4, 4, 2, 32, device=DEVICE)
    out = verify_attention(*p.tensors(None), **p.options(), **features)
    assert_matches_reference(out, p, **features)


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's bf16 limit")
def test_bf16_under_the_interpreter_is_refused_not_wrong():
    p = make_problem([54], 4, 4, 2, 32, dtype=torch.bfloat16, device=DEVICE)
    assert gate_call(decline_reason, p).startswith("bfloat16")
    with pytest.raises(NotImplementedError, match="bfloat16"):
        verify_attention(*p.tensors(None), **p.options())


# --- the production path with several slices per sequence ---------------------

#: Prefixes cut into several slices whatever the machine (MIN_SPLIT is 32 under the interpreter).
SLICED = [6 * MIN_SPLIT + 13, 0, 3 * MIN_SPLIT + 1, 5]
#: Extends for SLICED (so the row blocks differ per sequence).
SLICED_EXT = [4, 2, 3, 1]

FEATURES = {
    "sinks-scales": dict(sinks=True, k_scale=0.5, v_scale=2.0),
    "int32-fused": dict(index_dtype=torch.int32, fused_qkv=True),
    "tree-sinks-int32": dict(mask="tree", sinks=True, index_dtype=torch.int32),
    "chain-fused-scales": dict(mask="chain", fused_qkv=True, k_scale=1.5, v_scale=0.5),
    "full-draft-block": dict(mask="none", sinks=True),
}


def strided_output(p, fill=float("nan")):
    """A ``[tokens, H_Q, Dv]`` view with padded rows and heads inside a buffer of 7.0, itself ``fill``."""
    backing = torch.full((p.num_tokens, p.num_q_heads + 1, 2 * p.v_head_dim), 7.0, dtype=p.q_extend.dtype,
                         device=DEVICE)
    out = backing[:, 1:, p.v_head_dim // 2: p.v_head_dim // 2 + p.v_head_dim]
    out.fill_(fill)
    assert not out.is_contiguous()
    return backing, out


def untouched_outside(backing, p):
    mask = torch.ones_like(backing, dtype=torch.bool)
    mask[:, 1:, p.v_head_dim // 2: p.v_head_dim // 2 + p.v_head_dim] = False
    return bool((backing[mask] == 7.0).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("feature", list(FEATURES))
def test_production_path_several_slices(feature, dtype):
    """Drop-in and production entry, several slices per sequence, every feature at once,
    into a strided NaN-poisoned output: oracle parity, nothing written outside, counters at 0."""
    p = make_problem(SLICED, SLICED_EXT, 4, 1, 32, dtype=dtype, device=DEVICE, seed=11, **FEATURES[feature])
    backing, out = strided_output(p)
    assert verify_splitkv_fwd(*p.args(out), **p.kwargs(), check=True)
    plan = last_plan()
    assert isinstance(plan, VerifyPlan) and plan.n_splits >= 2
    assert max(slices_used(plan, p)) >= 2, "no sequence was cut into several slices"
    assert_matches_reference(out, p)
    assert untouched_outside(backing, p)
    assert all_counters_zero()
    backing2, out2 = strided_output(p)
    got = verify_attention(*p.tensors(out2), **p.options())
    assert got is out2 and torch.equal(out2, out)  # the same plan, the same bits
    assert untouched_outside(backing2, p) and all_counters_zero()


@pytest.mark.parametrize("feature", list(FEATURES))
def test_merge_programs_with_every_feature(feature):
    """32-row tiles (8 query heads per KV head x 4 drafts) cut into several slices are merged by
    merge programs in the verify grid: oracle parity with every feature, the LSE too, the bits of
    the second launch, and every counter (tiles, ticket, exit count) back at zero."""
    p = make_problem(SLICED, SLICED_EXT, 8, 1, 32, dtype=torch.float32, device=DEVICE, seed=17, **FEATURES[feature])
    out, lse = verify_attention(*p.tensors(p.new_output()), **p.options(), return_lse=True)
    plan = last_plan()
    assert plan.merge == MERGE_PROGRAMS and plan.fused and max(slices_used(plan, p)) >= 2
    assert plan.grid[1] > plan.n_splits  # the merge programs follow the slices on axis 1
    assert_matches_reference(out, p)
    assert all_counters_zero()
    spread = plan_of(VerifySplitKV(8, 1, 32, 32, p.max_len_extend, p.batch_size, DEVICE, one_launch=False), p,
                     return_lse=True)
    assert spread.merge == SEPARATE_MERGE and spread.n_splits == plan.n_splits
    spread_o, spread_lse = run_with_lse(spread, p)
    assert torch.equal(spread_o, out) and torch.equal(spread_lse, lse)


def test_merge_programs_load_more_slices_per_step_in_long_launches():
    """Past ``GRID_MERGE_FEW`` slices a merge program loads ``GRID_MERGE_UNROLL`` slices per step, every
    other merge ``MERGE_UNROLL``: the order is the same, so are the bits (against the second launch)."""
    few = GRID_MERGE_FEW
    assert merge_unroll(MERGE_PROGRAMS, few + 1) == GRID_MERGE_UNROLL > MERGE_UNROLL
    assert merge_unroll(MERGE_PROGRAMS, few) == merge_unroll(LAST_PROGRAM, 64) == MERGE_UNROLL
    assert merge_unroll(SEPARATE_MERGE, 64) == MERGE_UNROLL
    p = make_problem([12 * MIN_SPLIT + 5, 9 * MIN_SPLIT + 3], [4, 3], 8, 1, 32, dtype=torch.float32,
                     device=DEVICE, seed=21)
    shape = (8, 1, 32, 32, p.max_len_extend, p.batch_size)
    plan = plan_of(VerifySplitKV(*shape, DEVICE, n_splits=12), p)
    assert plan.merge == MERGE_PROGRAMS and plan.step.launch.constexprs["MERGE_UNROLL"] == GRID_MERGE_UNROLL
    assert max(slices_used(plan, p)) > few
    out = plan.run(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, out=p.new_output())
    spread = plan_of(VerifySplitKV(*shape, DEVICE, n_splits=12, one_launch=False), p)
    assert spread.step.merge.constexprs["MERGE_UNROLL"] == MERGE_UNROLL
    ref = spread.run(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, out=p.new_output())
    assert torch.equal(out, ref)
    assert_matches_reference(out, p)
    assert all_counters_zero()


def test_merge_programs_give_way_when_the_kernel_spills(monkeypatch):
    """A plan whose compiled kernel would spill registers with merge programs merges in a second
    launch instead, from its first run on: the runner learns the launcher spills, steps bound from
    then on merge in a second launch (the plan's own step is not changed: its runs take its
    fallback); same bits, counters untouched."""
    from splitkv.launch import Launcher

    p = make_problem(SLICED, SLICED_EXT, 8, 1, 32, sinks=True, device=DEVICE, seed=18)
    shape = (8, 1, 32, 32, p.max_len_extend, p.batch_size)
    plan = plan_of(VerifySplitKV(*shape, DEVICE), p)
    assert plan.merge == MERGE_PROGRAMS and not plan.runner._spilling
    own = plan.step
    monkeypatch.setattr(Launcher, "spills", lambda self, args, grid: True)
    out = plan.run(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, out=p.new_output())
    assert plan.runner._spilling == {own.launch} and plan.step is own
    assert plan.merge == SEPARATE_MERGE and not plan.fused and plan.grid[1] == plan.n_splits
    plan.rebind(p.qo_indptr, p.kv_indptr, p.kv_indices, sinks=p.sinks)
    assert plan.merge == SEPARATE_MERGE and not plan.fused and plan.step.fallback is None
    again = plan.run(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, out=p.new_output())
    stale = plan.run(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, out=p.new_output(), step=own)
    spread = plan_of(VerifySplitKV(*shape, DEVICE, one_launch=False), p)
    ref = spread.run(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, out=p.new_output())
    assert torch.equal(out, ref) and torch.equal(again, ref) and torch.equal(stale, ref)
    assert_matches_reference(out, p)
    assert all_counters_zero()


def test_several_slices_are_really_used():
    """The plan's grid has several slices and long prefixes get several of them."""
    p = make_problem(SLICED, 4, 4, 1, 32, device=DEVICE, seed=12)
    run_split(p)
    plan = last_plan()
    used = slices_used(plan, p)
    assert plan.n_splits >= 3 and used[0] >= 3 and used[2] >= 2 and used[1] == used[3] == 1
    assert plan.scratch_bytes > 0


def _invariance_batch(target, position, size, seed, max_prefix=40):
    rng = random.Random(seed)
    others = [make_problem([rng.randint(0, max_prefix)], [rng.randint(1, target.max_len_extend)],
                           target.num_q_heads, target.num_kv_heads, target.head_dim, dtype=target.q_extend.dtype,
                           device=DEVICE, seed=seed * 1000 + i, index_dtype=target.kv_indices.dtype)
              for i in range(size - 1)]
    return concat_problems(others[:position] + [target] + others[position:], max_len_extend=4)


def test_fixed_slices_batch_invariant():
    """split_tokens=128: a sequence's output is bitwise the same alone and inside batches of 7 and 64
    (other sequences of other lengths, various max_bs)."""
    target = make_problem([300], [3], 2, 1, 16, device=DEVICE, seed=21).replace(max_len_extend=4)
    alone = run_split(target, split_tokens=128, max_prefix_len=300)
    assert_matches_reference(alone, target)
    assert last_plan().n_splits == 3 and slices_used(last_plan(), target) == [3]  # 128 + 128 + 44 keys
    # Bounds past the longest prefix give larger grids (cdiv(max_prefix_len, 128) slices), the same bits.
    for size, position, max_bs, bound in [(7, 3, None, 300), (7, 0, 64, 512), (64, 40, 64, 300),
                                          (64, 63, 100, 2048)]:
        batch = _invariance_batch(target, position, size, seed=size + position)
        out = run_split(batch, split_tokens=128, max_prefix_len=bound, max_bs=max_bs)
        assert last_plan().n_splits == -(-bound // 128)
        q0 = batch.qo_indptr[position].item()
        assert torch.equal(out[q0: q0 + 3], alone), (size, position, max_bs, bound)
        assert all_counters_zero()
    assert_matches_reference(out, batch)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sinks", [False, True])
def test_return_lse_matches_oracle(dtype, sinks):
    p = make_problem(SLICED, [3, 1, 2, 4], 4, 1, 32, dtype=dtype, sinks=sinks, mask="tree", device=DEVICE,
                     seed=31)
    out, lse = verify_attention(*p.tensors(p.new_output()), **p.options(), return_lse=True)
    assert max(slices_used(last_plan(), p)) >= 2
    ref_o, ref_lse = reference_for(p, return_lse=True)
    assert_close(out, ref_o, dtype)
    assert lse.dtype == torch.float32 and lse.shape == (p.num_tokens, p.num_q_heads)
    assert (lse.double() - ref_lse).abs().max().item() < (1e-4 if dtype == torch.float32 else 2e-3)
    # The runner's plan gives the same state, with a forced grid and poisoned partials.
    runner, _ = poisoned_workspace_runner(p, n_splits=5)
    o2, lse2 = run_with_lse(plan_of(runner, p, return_lse=True), p)
    assert_close(o2, ref_o, dtype)
    assert (lse2.double() - ref_lse).abs().max().item() < (1e-4 if dtype == torch.float32 else 2e-3)
    assert all_counters_zero()


def prefix_only_reference(p):
    """The oracle with the draft block hidden (a custom mask with every draft column False)."""
    mask, mask_indptr = prefix_only_mask(p)
    return reference_for(p, custom_mask=mask, mask_indptr=mask_indptr, return_lse=True)


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("n_splits", [None, 4])
def test_prefix_only(sinks, n_splits):
    """attend_draft=False (a context-parallel shard): the oracle over the prefix alone.
    A sequence with no prefix has no key: o = 0 and lse = -inf (or the sink's logit)."""
    p = make_problem(SLICED, [3, 2, 4, 1], 4, 1, 32, dtype=torch.float32, sinks=sinks, device=DEVICE, seed=41)
    if n_splits is None:
        runner = VerifySplitKV(4, 1, 32, 32, p.max_len_extend, p.batch_size, DEVICE)
    else:
        runner, _ = poisoned_workspace_runner(p, n_splits=n_splits)
    plan = plan_of(runner, p, return_lse=True, attend_draft=False)
    assert max(slices_used(plan, p)) >= 2
    out, lse = run_with_lse(plan, p)
    ref_o, ref_lse = prefix_only_reference(p)
    empty = torch.zeros(p.num_tokens, dtype=torch.bool, device=DEVICE)
    empty[p.qo_indptr[1]: p.qo_indptr[2]] = True  # sequence 1 has no prefix
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    if sinks:
        assert torch.allclose(lse[empty].double(), ref_lse[empty], atol=1e-5)
    else:
        assert torch.isneginf(lse[empty]).all() and torch.isnan(ref_o[empty]).all()
    assert_close(out[~empty], ref_o[~empty], torch.float32)
    assert (lse[~empty].double() - ref_lse[~empty]).abs().max().item() < 1e-4
    assert all_counters_zero()


def test_repeated_calls_bitwise_identical():
    p = make_problem(SLICED, SLICED_EXT, 4, 1, 32, mask="tree", sinks=True, device=DEVICE, seed=51)
    first = verify_attention(*p.tensors(p.new_output()), **p.options())
    assert max(slices_used(last_plan(), p)) >= 2
    for _ in range(3):
        assert torch.equal(verify_attention(*p.tensors(p.new_output()), **p.options()), first)
        assert torch.equal(run_split(p), first)
    assert all_counters_zero()


def test_bf16_outputs_publish_bf16_partial_outputs(monkeypatch):
    """A bf16 output's slices publish their partial outputs in bf16, half the bytes to write and merge.

    The scratch keeps its float32 size: the bf16 partial outputs fill the first
    half of their region (the second half stays as the NaN it was poisoned with),
    the partial LSEs stay float32 after it. Every merge mode reads the same bf16
    values in the same order, so the bits agree; the result is within bf16's
    budget of the oracle. The inputs are float16 (the interpreter's bf16 dots are
    wrong); the output buffer alone is bf16.
    """
    from splitkv import workspace

    p = make_problem(SLICED, SLICED_EXT, 4, 1, 32, mask="tree", sinks=True, device=DEVICE, seed=59)
    shape = (4, 1, 32, 32, p.max_len_extend, p.batch_size)
    caught = []
    real_new = workspace.new_partials

    def new_partials(device, nbytes, stream, raw):
        t, _ = real_new(device, nbytes, stream, False)
        caught.append(t.fill_(float("nan")))
        return t, t.data_ptr()

    outs = []
    for one_launch in (True, False):
        plan = plan_of(VerifySplitKV(*shape, DEVICE, n_splits=5, one_launch=one_launch), p)
        out = torch.full((p.num_tokens, 4, 32), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        with monkeypatch.context() as m:
            m.setattr(workspace, "new_partials", new_partials)
            plan.run(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, out=out)
        outs.append(out)
        rows = plan.grid[0] * plan.n_splits * plan.config.block_m
        parts = caught[-1]
        assert torch.isnan(parts[rows * 32 // 2: rows * 32]).all(), "bf16 partials fill half their region"
        published = parts[: rows * 32 // 2].view(torch.bfloat16)
        assert torch.isfinite(published).any() and torch.isfinite(parts[rows * 32:]).any()
    assert_close(outs[0].float(), reference_for(p), torch.bfloat16)
    assert torch.equal(outs[0], outs[1]), "the last program and the second launch merge the same bits"


def test_merge_path_and_shape_invariant_bits(monkeypatch):
    """Every way of merging, in any program shape, gives the same bits.

    The tile's last program, merge programs in the verify grid, and a second
    launch read the slices in the same order with the same per-element
    operations, so the merge mode (which follows the batch and the tile) and
    the merge programs' block shapes never change a result.
    """
    import splitkv.schedule as schedule_module

    p = make_problem(SLICED, SLICED_EXT, 4, 1, 32, mask="tree", sinks=True, device=DEVICE, seed=53)
    shape = (4, 1, 32, 32, p.max_len_extend, p.batch_size)

    def run(one_launch, expect, rows_dv=None, grid_rows_dv=None):
        with monkeypatch.context() as m:
            if expect == MERGE_PROGRAMS:
                m.setattr(schedule_module, "FUSED_MAX_MERGE", 0)  # past what the last program merges alone
            if rows_dv is not None:
                m.setattr(schedule_module, "MERGE_ROWS", rows_dv[0])
                m.setattr(schedule_module, "MERGE_DV", rows_dv[1])
            if grid_rows_dv is not None:
                m.setattr(schedule_module, "GRID_MERGE_ROWS", grid_rows_dv[0])
                m.setattr(schedule_module, "GRID_MERGE_DV", grid_rows_dv[1])
            plan = plan_of(VerifySplitKV(*shape, DEVICE, n_splits=5, one_launch=one_launch), p, return_lse=True)
            assert plan.merge == expect and plan.fused == one_launch and max(slices_used(plan, p)) >= 2
            if expect == MERGE_PROGRAMS:
                assert plan.grid[1] == 5 + schedule_module.merge_chunks(5, plan.config.block_m, 32)
            return run_with_lse(plan, p)

    last_o, last_lse = run(True, LAST_PROGRAM)
    assert_matches_reference(last_o, p)
    for grid_shape in (None, ((2, 2), 32), ((16, 16), 16)):
        o, lse = run(True, MERGE_PROGRAMS, grid_rows_dv=grid_shape)
        assert torch.equal(o, last_o) and torch.equal(lse, last_lse), grid_shape
        assert all_counters_zero(), "merge programs leave the tile, ticket and exit counters at zero"
    for merge_shape in (None, (8, 32), (2, 16), (16, 8)):
        o, lse = run(False, SEPARATE_MERGE, rows_dv=merge_shape)
        assert torch.equal(o, last_o) and torch.equal(lse, last_lse), merge_shape
    assert all_counters_zero()


@pytest.mark.parametrize("n_splits", [None, 3])
def test_caller_workspace_same_bits_as_default(n_splits):
    """splitkv.workspace_bytes + torch.zeros gives the bits of the per-call scratch."""
    p = make_problem(SLICED, SLICED_EXT, 4, 1, 32, sinks=True, device=DEVICE, seed=61)
    shape = (4, 1, 32, 32, p.max_len_extend, p.batch_size)
    ws = torch.zeros(workspace_bytes(4, 1, 32, p.max_len_extend, p.batch_size, n_splits or 64),
                     dtype=torch.uint8, device=DEVICE)
    owned = VerifySplitKV(*shape, DEVICE, workspace=ws, n_splits=n_splits)
    default = VerifySplitKV(*shape, DEVICE, n_splits=n_splits)
    plan = plan_of(owned, p)
    assert plan.n_splits >= 2 and max(slices_used(plan, p)) >= 2
    a = plan.run(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, out=p.new_output())
    b = plan_of(default, p).run(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, out=p.new_output())
    assert torch.equal(a, b)
    assert_matches_reference(a, p)
    assert int(torch.count_nonzero(owned._workspace.counters)) == 0 and all_counters_zero()
    again = plan.run(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, out=p.new_output())
    assert torch.equal(again, a)  # the workspace's counters were left at zero for the next run


def test_counters_back_to_zero_after_every_call():
    p = make_problem(SLICED, SLICED_EXT, 4, 1, 32, device=DEVICE, seed=71)
    calls = [
        lambda: run_split(p),
        lambda: run_split(p, split_tokens=128, max_prefix_len=max(p.prefix_lens)),
        lambda: verify_attention(*p.tensors(None), **p.options(), return_lse=True),
        lambda: run_runner(p, 7),
        lambda: plan_of(VerifySplitKV(4, 1, 32, 32, 4, 5, DEVICE), p, attend_draft=False).run(
            p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer),
    ]
    from splitkv import workspace as workspace_mod

    for call in calls:
        call()
        assert workspace_mod._COUNTERS, "no counters were used"
        assert all_counters_zero()


# --- randomised property test ------------------------------------------------

@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prefix_lens=st.lists(st.integers(0, 150), min_size=1, max_size=3),
    extend_len=st.integers(1, 8),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 3, 5]),
    head_dim=st.sampled_from([16, 48, 64]),
    mask=st.sampled_from(["causal", "tree", "none"]),
    n_splits=st.integers(1, 9),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_random_shapes(prefix_lens, extend_len, kv_heads, group, head_dim, mask, n_splits, seed):
    p = make_problem(
        prefix_lens, extend_len, kv_heads * group, kv_heads, head_dim,
        mask=mask, seed=seed, device=DEVICE,
    )
    assert_matches_reference(run_runner(p, n_splits), p)


def test_counters_for_a_stream_first_seen_inside_a_capture(monkeypatch):
    """No zeroing may be recorded into a graph: a new stream inside a capture takes a
    slice of an arena zeroed earlier, or the plan merges in a second launch."""
    import splitkv.workspace as workspace_mod

    p = make_problem([300, 97], 4, 8, 2, 64, dtype=torch.float32, device=DEVICE, seed=11)
    r = VerifySplitKV(8, 2, 64, 64, 4, 2, DEVICE, n_splits=4)

    def plan():
        return r.plan(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, p.qo_indptr,
                      p.kv_indptr, p.kv_indices, sm_scale=p.sm_scale)

    monkeypatch.setattr(workspace_mod, "_COUNTERS", {})
    monkeypatch.setattr(workspace_mod, "_ARENAS", {})
    monkeypatch.setattr(VerifyPlan, "_captured", lambda self: True)  # what a run asks
    pl = plan()
    assert pl.fused
    merges = []
    real = VerifyPlan._launch_merge
    monkeypatch.setattr(VerifyPlan, "_launch_merge", lambda self, *a: (merges.append(1), real(self, *a)))
    out = pl.run(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer)
    assert merges, "with no arena to cut from inside a capture, the launch must merge in a second launch"
    assert pl.fused, "a decision for that launch only: the plan is unchanged"
    assert not workspace_mod._ARENAS, "nothing may be allocated inside a capture"
    assert_matches_reference(out, p)

    monkeypatch.setattr(VerifyPlan, "_captured", lambda self: False)
    plan().run(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer)  # eager: the arena is made
    arena = next(iter(workspace_mod._ARENAS.values()))[0]
    monkeypatch.setattr(workspace_mod, "_COUNTERS", {})  # a stream never seen before...
    monkeypatch.setattr(VerifyPlan, "_captured", lambda self: True)  # ...inside a capture
    # A captured launch's counters are its own slice, kept in no per-stream table: catch what it was given.
    handed, real_counters = [], workspace_mod.counters
    monkeypatch.setattr(workspace_mod, "counters", lambda *a, **k: handed.append(real_counters(*a, **k)) or handed[-1])
    pl = plan()
    out = pl.run(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer)
    assert pl.fused, "a slice of the zeroed arena serves the new stream"
    assert handed and handed[-1] is not None
    arr = handed[-1]
    assert arr.data_ptr() != arena.data_ptr() and arr.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr()
    assert int(arr.count_nonzero()) == 0
    assert_matches_reference(out, p)


@pytest.mark.parametrize("one_launch", [True, False], ids=["one-launch", "spread-merge"])
@pytest.mark.parametrize("where", ["k", "v"])
def test_nan_in_a_visible_pool_row_propagates(where, one_launch):
    """A NaN key or value the oracle would read makes that sequence's output NaN, as in the oracle
    (never a finite wrong answer); the other sequences stay exact."""
    p = make_problem(SLICED, SLICED_EXT, 4, 2, 32, dtype=torch.float32, device=DEVICE, seed=12)
    ref = reference_for(p)
    bad_seq = 2  # several slices; the NaN sits in its middle slice
    slot = int(p.kv_indices[int(p.kv_indptr[bad_seq]) + SLICED[bad_seq] // 2])
    pool = (p.k_buffer if where == "k" else p.v_buffer).clone()
    pool[slot, 1] = float("nan")  # KV head 1
    q = p.replace(k_buffer=pool) if where == "k" else p.replace(v_buffer=pool)
    if one_launch:
        out = verify_attention(*q.tensors(None), **q.options())
    else:
        spread = plan_of(VerifySplitKV(4, 2, 32, 32, q.max_len_extend, q.batch_size, DEVICE, one_launch=False), q)
        assert spread.merge == SEPARATE_MERGE
        out = spread.run(q.q_extend, q.k_extend, q.v_extend, q.k_buffer, q.v_buffer, out=q.new_output())
    rows = slice(int(p.qo_indptr[bad_seq]), int(p.qo_indptr[bad_seq + 1]))
    assert torch.isnan(out[rows, 2:]).all()  # query heads 2, 3 read KV head 1
    good = torch.ones(out.shape[0], dtype=torch.bool)
    good[rows] = False
    assert relative_error(out[good], ref[good]) < TOLERANCE[torch.float32]
    assert relative_error(out[rows, :2], ref[rows, :2]) < TOLERANCE[torch.float32]


def test_counter_slices_start_on_16_byte_boundaries(monkeypatch):
    """A captured launch's counters are a slice of ``tiles + 2`` ints: each slice is padded so the next
    starts 16-byte aligned, as the launch key assumes of every scratch address."""
    import splitkv.workspace as workspace_mod

    monkeypatch.setattr(workspace_mod, "_ARENAS", {})
    device = torch.device(DEVICE)
    slices = [workspace_mod._arena_slice(device, n) for n in (7, 3, 9, 1)]
    assert all(s.data_ptr() % 16 == 0 for s in slices)
    assert [s.numel() for s in slices] == [8, 4, 12, 4]
