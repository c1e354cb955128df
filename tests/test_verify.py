"""The split-KV path against the float64 oracle and against the baseline.

Runs on the CPU through the Triton interpreter (float16/float32) and on a GPU
(bfloat16 too). Outputs are poisoned with NaN before every run, data is drawn
fresh, kv_indices are random slots of a larger pool.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import DEVICE, DTYPES, TOLERANCE, assert_matches_reference
from splitkv import (
    VerifySplitKV,
    can_handle,
    decline_reason,
    extend_attention_fwd,
    verify_attention,
    verify_splitkv_fwd,
)
from splitkv.testing import make_problem, relative_error


def run_split(problem, **kwargs):
    """verify_splitkv_fwd on a NaN-poisoned output; it must accept the call."""
    out = problem.new_output()
    assert verify_splitkv_fwd(*problem.args(out), **problem.kwargs(), **kwargs)
    return out


def run_runner(problem, n_splits, pack_gqa=True, poison_scratch=True):
    """The runner with a forced split count, its scratch poisoned with NaN."""
    p = problem
    runner = VerifySplitKV(
        p.num_q_heads, p.num_kv_heads, p.head_dim, p.v_head_dim,
        p.max_len_extend, p.batch_size, DEVICE, pack_gqa=pack_gqa, n_splits=n_splits,
    )
    if poison_scratch:
        for buf in runner.scratch():
            buf.fill_(float("nan"))
    out = p.new_output()
    runner(
        p.q_extend, p.k_extend, p.v_extend, out, p.k_buffer, p.v_buffer,
        p.qo_indptr, p.kv_indptr, p.kv_indices, p.custom_mask, p.mask_indptr, p.is_causal,
        sm_scale=p.sm_scale, k_scale=p.k_scale, v_scale=p.v_scale, sinks=p.sinks,
    )
    return out


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


def test_runner_scratch_fixed_across_batch_sizes():
    """One runner serves every bs <= max_bs from the same scratch addresses."""
    runner = VerifySplitKV(4, 2, 32, 32, 4, max_bs=3, device=DEVICE)
    addresses = [t.data_ptr() for t in runner.scratch()]
    for prefix_lens in ([54], [97, 3], [1, 54, 0]):
        p = make_problem(prefix_lens, 4, 4, 2, 32, device=DEVICE)
        out = p.new_output()
        runner(*p.args(out)[:9], p.custom_mask, p.mask_indptr, p.is_causal, sm_scale=p.sm_scale)
        assert_matches_reference(out, p)
        assert [t.data_ptr() for t in runner.scratch()] == addresses
    p = make_problem([5] * 4, 4, 4, 2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="max_bs"):
        runner(*p.args(p.new_output())[:9], sm_scale=p.sm_scale)


def test_runner_refuses_scratch_past_32_bit_offsets():
    with pytest.raises(ValueError, match="2\\^31"):
        VerifySplitKV(128, 1, 256, 256, 64, max_bs=8192, device=DEVICE)


def test_drop_in_reuses_one_runner_per_shape():
    from splitkv.api import _RUNNERS

    shapes = dict(num_q_heads=4, num_kv_heads=1, head_dim=16, extend_lens=2, device=DEVICE)
    run_split(make_problem([30, 30], **shapes), max_bs=8)
    count = len(_RUNNERS)
    for bs in (1, 3, 8):
        run_split(make_problem([30] * bs, **shapes), max_bs=8)
    assert len(_RUNNERS) == count


def test_outgrown_runner_is_kept_alive():
    """A larger max_bs replaces the cached runner; the old scratch stays allocated
    (CUDA graphs captured with it keep valid addresses)."""
    from splitkv.api import _RETIRED, get_runner

    p = make_problem([30], 3, 6, 3, 16, device=DEVICE)
    small = get_runner(p.q_extend, p.k_extend, p.v_extend, 3, max_bs=2)
    small.scratch()
    big = get_runner(p.q_extend, p.k_extend, p.v_extend, 3, max_bs=64)
    assert big is not small and big.capacity > small.capacity
    assert any(r is small for r in _RETIRED)
    assert get_runner(p.q_extend, p.k_extend, p.v_extend, 3, max_bs=5) is big


# --- the gate --------------------------------------------------------------

DECLINED = {
    "logit_cap": dict(logit_cap=30.0),
    "sliding_window": dict(sliding_window_size=128),
    "xai_temperature": dict(xai_temperature_len=64),
    "tensor_k_scale": dict(k_scale=torch.tensor(0.5)),
}


@pytest.mark.parametrize("feature", list(DECLINED))
def test_declined_features_leave_output_untouched(feature):
    p = make_problem([54, 33], 4, 4, 2, 32, device=DEVICE)
    out = p.new_output(fill=3.0)
    args = list(p.args(out))
    kwargs = dict(p.kwargs())
    if feature == "tensor_k_scale":
        args[13] = DECLINED[feature]["k_scale"]
    else:
        kwargs.update(DECLINED[feature])
    assert not verify_splitkv_fwd(*args, **kwargs)
    assert (out == 3.0).all()


def test_prefix_custom_mask_declined():
    p = make_problem([54, 33], 4, 4, 2, 32, mask="tree", device=DEVICE)
    out = p.new_output(fill=3.0)
    assert not verify_splitkv_fwd(*p.args(out), **p.kwargs(), skip_prefix_custom_mask=False)
    assert (out == 3.0).all()


def test_max_len_extend_contract():
    """Larger than the real extend is served (ragged); too small is declined."""
    p = make_problem([54, 33], 4, 4, 2, 32, device=DEVICE)
    out = run_split(p.replace(max_len_extend=5))
    assert_matches_reference(out, p)
    assert not can_handle(*_gate_args(p.replace(max_len_extend=3)))
    assert not can_handle(*_gate_args(p.replace(max_len_extend=0)))
    assert not can_handle(*_gate_args(p.replace(max_len_extend=65)))


def _gate_args(p):
    a = p.args(None)
    return a[:3] + a[4:13]


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
        verify_attention(*p.args(out), **p.kwargs())
    assert not verify_splitkv_fwd(*p.args(out), **p.kwargs())
    assert decline_reason(*_gate_args(p), o_extend=out).startswith("malformed")


def test_gate_reads_no_values():
    """The gate decides on meta tensors, which have shapes and no data."""
    p = make_problem([54, 33], 4, 4, 2, 32, mask="tree", sinks=True, device=DEVICE)
    meta = p.replace(**{
        name: getattr(p, name).to("meta")
        for name in ("q_extend", "k_extend", "v_extend", "k_buffer", "v_buffer", "qo_indptr",
                     "kv_indptr", "kv_indices", "custom_mask", "mask_indptr", "sinks")
    })
    assert can_handle(*_gate_args(meta), sinks=meta.sinks)


# --- the production entry --------------------------------------------------

@pytest.mark.parametrize("features", [{}, {"logit_cap": 5.0}, {"sliding_window_size": 40}])
def test_verify_attention_is_always_right(features):
    p = make_problem([54, 97], 4, 4, 2, 32, device=DEVICE)
    out = verify_attention(*p.args(None), **p.kwargs(), **features)
    assert_matches_reference(out, p, **features)


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's bf16 limit")
def test_bf16_under_the_interpreter_is_refused_not_wrong():
    p = make_problem([54], 4, 4, 2, 32, dtype=torch.bfloat16, device=DEVICE)
    assert decline_reason(*_gate_args(p)).startswith("bfloat16")
    with pytest.raises(NotImplementedError, match="bfloat16"):
        verify_attention(*p.args(None), **p.kwargs())


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
