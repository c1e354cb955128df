"""Paged pools on the split path: ``[pages, page_size, H_KV, D]`` read natively.

Every case lays a token-pool problem's prefixes out in random pages
(:func:`splitkv.testing.paged_problem`), with every unused page row poisoned
with NaN (a read past a sequence's last used row reaches the output), and
compares with the float64 oracle of the original problem.
"""

import dataclasses

import pytest
import torch

from conftest import (DEVICE, DTYPES, MIN_SPLIT, all_counters_zero, assert_matches_reference, gate_call, last_plan,
                      plan_options)
from splitkv import VerifyPlan, VerifySplitKV, clear_caches, decline_reason, verify_attention, verify_splitkv_fwd
from splitkv import schedule
from splitkv.schedule import pool_offsets_32
from splitkv.testing import make_problem, paged_problem

#: Several slices per sequence, one empty prefix, a prefix shorter than a page, ragged drafts.
PREFIXES = [6 * MIN_SPLIT + 13, 0, 3 * MIN_SPLIT + 1, 5]
EXTENDS = [4, 2, 3, 1]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 3, 4, 16, 64])
def test_paged_matches_oracle(page_size, dtype):
    """Page sizes below the key tile (one index load per key; per page where pages divide the tile),
    equal to it and above it (one index load per tile)."""
    p = make_problem(PREFIXES, EXTENDS, 4, 2, 32, dtype=dtype, device=DEVICE, seed=2, mask="tree", sinks=True)
    pp = paged_problem(p, page_size, seed=1)
    out = p.new_output()
    assert verify_splitkv_fwd(*pp.args(out), **pp.kwargs(), check=True)
    plan = last_plan()
    assert isinstance(plan, VerifyPlan) and plan.page_size == page_size and plan.n_splits >= 2
    assert_matches_reference(out, p)
    assert all_counters_zero()


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("page_size", [1, 3, 4, 16])
def test_64_bit_gather_offsets_give_the_same_bits(page_size, index_dtype, monkeypatch):
    """Pools past 2^31 elements gather with 64-bit offsets (``OFFSETS_32``): forced here on a small
    pool, every index-load branch (per key, per page, per tile) gives the 32-bit path's bits."""
    p = make_problem(PREFIXES, EXTENDS, 4, 2, 32, dtype=DTYPES[0], device=DEVICE, seed=6, index_dtype=index_dtype)
    pp = paged_problem(p, page_size, seed=3) if page_size > 1 else p
    outs = []
    for limit in (schedule.OFFSETS_32_LIMIT, 0):
        monkeypatch.setattr(schedule, "OFFSETS_32_LIMIT", limit)
        clear_caches()
        out = p.new_output()
        assert verify_splitkv_fwd(*pp.args(out), **pp.kwargs())
        assert last_plan().offsets_32 == (limit > 0)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert_matches_reference(outs[1], p)


def test_offset_width_follows_the_pool_extent():
    """32-bit offsets exactly while the pool's last element lies below 2^31 (shapes only: meta tensors)."""
    # Llama-3-8B rows (8 x 128 = 1024 elements): 2^21 slots end at element 2^31 - 1.
    assert pool_offsets_32(torch.empty(2**21, 8, 128, device="meta"))
    assert not pool_offsets_32(torch.empty(2**21 + 1, 8, 128, device="meta"))
    # Pages of 16 of such rows, and a pool strided inside a fused K/V buffer (its stride counts, not its width).
    assert pool_offsets_32(torch.empty(2**17, 16, 8, 128, device="meta"))
    assert not pool_offsets_32(torch.empty(2**17 + 1, 16, 8, 128, device="meta"))
    fused = torch.empty(2**20 + 1, 2, 8, 128, device="meta")
    assert not pool_offsets_32(fused[:, 0])
    assert pool_offsets_32(fused[: 2**20, 0])


@pytest.mark.parametrize("one_launch", [True, False], ids=["one-launch", "spread-merge"])
def test_paged_with_features_and_scales(one_launch):
    features = dict(sliding_window_size=2 * MIN_SPLIT + 5, logit_cap=3.0)
    p = make_problem(PREFIXES, EXTENDS, 4, 1, 32, dtype=torch.float32, device=DEVICE, seed=4, mask="chain",
                     k_scale=0.5, v_scale=2.0, index_dtype=torch.int32, fused_qkv=True)
    pp = paged_problem(p, 16, seed=2)
    if one_launch:
        out, lse = verify_attention(*pp.tensors(None), **pp.options(), **features, return_lse=True)
    else:
        runner = VerifySplitKV(4, 1, 32, 32, p.max_len_extend, p.batch_size, DEVICE, one_launch=False)
        t = pp.tensors(None)
        plan = runner.plan(*t[:3], *t[4:], **plan_options(pp), **features, return_lse=True)
        lse = torch.full((p.num_tokens, p.num_q_heads), float("nan"), dtype=torch.float32, device=DEVICE)
        out = plan.run(t[0], t[1], t[2], t[4], t[5], out=p.new_output(), lse=lse)
    assert_matches_reference(out, p, **features)
    from splitkv.testing import reference_for, relative_error

    assert relative_error(lse, reference_for(p, return_lse=True, **features)[1]) < 1e-4


def _padded(pp, num_pages):
    """``pp`` with its page pools grown to ``num_pages`` (NaN pages): every step sees one pool shape."""
    def grow(pages):
        pad = torch.full((num_pages - pages.shape[0], *pages.shape[1:]), float("nan"), dtype=pages.dtype,
                         device=pages.device)
        return torch.cat([pages, pad])

    return pp.__class__(**{**pp.__dict__, "k_pages": grow(pp.k_pages), "v_pages": grow(pp.v_pages)})


def test_paged_plan_rebinds_across_steps():
    """One plan, three steps with other page tables and lengths in one pool (as graph replays see them)."""
    shapes = dict(num_q_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float32, device=DEVICE)
    steps = [_padded(paged_problem(make_problem(prefixes, 3, seed=seed, **shapes), 16, seed=seed), 64)
             for seed, prefixes in ((1, [200, 90]), (2, [150, 33]), (3, [17, 210]))]
    runner = VerifySplitKV(4, 2, 32, 32, 3, 2, DEVICE)
    a = steps[0].args(None)
    plan = runner.plan(a[0], a[1], a[2], a[4], a[5], a[6], a[7], a[8], sm_scale=steps[0].problem.sm_scale,
                       kv_last_page_len=steps[0].kv_last_page_len)
    for pq in steps:
        b = pq.args(None)
        plan.rebind(b[6], b[7], b[8], kv_last_page_len=pq.kv_last_page_len)
        out = plan.run(b[0], b[1], b[2], b[4], b[5], out=pq.problem.new_output())
        assert_matches_reference(out, pq.problem)


def test_paged_fallback_runs_the_baseline_on_the_token_view():
    """A call the split path declines (custom mask on the prefix) still works on a paged pool."""
    p = make_problem([54, 97], 3, 4, 2, 32, dtype=torch.float32, device=DEVICE, seed=6, mask="tree")
    pp = paged_problem(p, 16, seed=3)
    kw = dict(pp.options(), skip_prefix_custom_mask=False)
    assert gate_call(decline_reason, pp, skip_prefix_custom_mask=False,
                     kv_last_page_len=pp.kv_last_page_len).startswith("custom mask")
    out = verify_attention(*pp.tensors(None), **kw)
    assert_matches_reference(out, p, skip_prefix_custom_mask=False)


def _with(pp, field, edit):
    """``pp`` with one tensor field cloned and edited (or replaced by ``edit``'s result)."""
    value = getattr(pp, field).clone()
    edited = edit(value)  # edits in place (returns None) or returns a new tensor
    return dataclasses.replace(pp, **{field: value if edited is None else edited})


def _set(index, value):
    def edit(t):
        t[index] = value
    return edit


#: name -> (field, edit, message, malformed shape?): value corruptions the checked mode
#: catches, shape errors every entry refuses.
BAD_PAGED = {
    "page_out_of_pool": ("kv_indices", _set(1, 10**6), "outside the pool", False),
    "last_len_too_long": ("kv_last_page_len", _set(1, 17), "kv_last_page_len", False),
    "last_len_zero": ("kv_last_page_len", _set(1, 0), "kv_last_page_len", False),
    "three_d_pool": ("k_pages", lambda t: t.flatten(0, 1), "4-D", True),
    "page_size_mismatch": ("v_pages", lambda t: t[:, :8], "same positive number", True),
    "last_len_shape": ("kv_last_page_len", lambda t: t[:1], "batch_size", True),
}


@pytest.mark.parametrize("case", list(BAD_PAGED))
def test_bad_paged_calls(case):
    """Checked (by the kernel, the default, and by the host, check="full"), every case raises naming the
    field; unchecked, value corruptions run without a crash (the kernel clamps: nothing outside the
    pages is read) and shape errors are declined."""
    field, edit, match, shape = BAD_PAGED[case]
    p = make_problem([54, 97], 3, 4, 2, 32, dtype=torch.float32, device=DEVICE, seed=7)
    pp = _with(paged_problem(p, 16, seed=4), field, edit)
    for check in (True, "full"):
        with pytest.raises(ValueError, match=match):
            verify_attention(*pp.tensors(None), **pp.options(), check=check)
    out = p.new_output()
    assert verify_splitkv_fwd(*pp.args(out), **pp.kwargs(), check=False) is not shape
