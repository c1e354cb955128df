"""Score features on the split path: logit cap, sliding window, window offsets, xai temperature.

Each is compared with the float64 oracle (which follows SGLang's
``extend_attention_fwd``) on prefixes cut into several slices, and the oracle
is first shown to change with the feature (a feature the kernel ignored would
otherwise pass). The window test also checks the cost claim: keys before the
window are never read (they are poisoned with NaN in the pool).
"""

import pytest
import torch

from conftest import (
    DEVICE,
    DTYPES,
    MIN_SPLIT,
    TOLERANCE,
    all_counters_zero,
    assert_matches_reference,
    concat_problems,
    gate_call,
    last_plan,
    plan_options,
)
from splitkv import VerifyPlan, VerifySplitKV, decline_reason, verify_attention, verify_splitkv_fwd
from splitkv.testing import make_problem, reference_for, relative_error

#: Prefixes cut into several slices on any machine, one empty, ragged drafts.
PREFIXES = [6 * MIN_SPLIT + 13, 0, 3 * MIN_SPLIT + 1, 5]
EXTENDS = [4, 2, 3, 1]

CASES = {
    "logit_cap": dict(logit_cap=2.0),
    "window": dict(sliding_window_size=MIN_SPLIT + 7),
    "window-1": dict(sliding_window_size=1),
    "window-longer-than-prefix": dict(sliding_window_size=100 * MIN_SPLIT),
    "xai": dict(xai_temperature_len=MIN_SPLIT),
    "everything": dict(logit_cap=2.0, sliding_window_size=2 * MIN_SPLIT + 3, xai_temperature_len=MIN_SPLIT),
}


def _problem(dtype, seed=3, **kwargs):
    kwargs.setdefault("sinks", True)
    return make_problem(PREFIXES, EXTENDS, 4, 2, 32, dtype=dtype, device=DEVICE, seed=seed, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_feature_matches_oracle(case, dtype):
    features = CASES[case]
    p = _problem(dtype, mask="chain")
    if case != "window-longer-than-prefix":
        assert relative_error(reference_for(p, **features), reference_for(p)) > 3 * TOLERANCE[dtype]
    out = p.new_output()
    assert verify_splitkv_fwd(*p.args(out), **p.kwargs(), **features, check=True)
    plan = last_plan()
    assert isinstance(plan, VerifyPlan)
    if features.get("sliding_window_size", 10**9) > MIN_SPLIT:  # a short window needs one slice
        assert plan.n_splits >= 2
    assert_matches_reference(out, p, **features)
    assert all_counters_zero()


@pytest.mark.parametrize("one_launch", [True, False], ids=["one-launch", "spread-merge"])
def test_features_with_tree_and_window_offsets(one_launch):
    """Tree masks whose rows start ``window_kv_offsets[b]`` columns in (junk before them)."""
    p = _problem(torch.float32, mask="tree", seed=5)
    offsets = torch.tensor([3, 0, 7, 1], dtype=torch.int32, device=DEVICE)
    rows = []  # rebuild the mask with `offset` junk columns in front of every row
    for b, (n_pre, n_ext) in enumerate(zip(p.prefix_lens, p.extend_lens)):
        start = int(p.mask_indptr[b])
        width = n_pre + n_ext
        mask_b = p.custom_mask[start:start + n_ext * width].view(n_ext, width)
        junk = torch.randint(0, 2, (n_ext, int(offsets[b])), dtype=mask_b.dtype, device=DEVICE)
        rows.append(torch.cat([junk, mask_b], dim=1).reshape(-1))
    lens = [0] + [r.numel() for r in rows]
    mask_indptr = torch.tensor(lens, device=DEVICE).cumsum(0).to(p.mask_indptr.dtype)
    p = p.replace(custom_mask=torch.cat(rows), mask_indptr=mask_indptr)
    features = dict(window_kv_offsets=offsets, sliding_window_size=MIN_SPLIT + 1, logit_cap=3.0)
    if one_launch:
        out = verify_attention(*p.tensors(None), **p.options(), **features)
    else:
        runner = VerifySplitKV(p.num_q_heads, p.num_kv_heads, p.head_dim, p.v_head_dim, p.max_len_extend,
                               p.batch_size, DEVICE, one_launch=False)
        plan = runner.plan(*p.tensors(None)[:3], *p.tensors(None)[4:], **plan_options(p), **features)
        out = plan.run(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, out=p.new_output())
    assert_matches_reference(out, p, **features)


def test_window_reads_only_the_window():
    """Keys before the window's first key tile are never read: NaN there cannot reach the output."""
    window = MIN_SPLIT + 5
    p = _problem(torch.float32, mask="chain", sinks=False)
    ref = reference_for(p, sliding_window_size=window)
    runner = VerifySplitKV(p.num_q_heads, p.num_kv_heads, p.head_dim, p.v_head_dim, p.max_len_extend,
                           p.batch_size, DEVICE)
    plan = runner.plan(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, p.qo_indptr, p.kv_indptr,
                       p.kv_indices, is_causal=True, sm_scale=p.sm_scale, sliding_window_size=window)
    block_n = plan.config.block_n
    k_pool, v_pool = p.k_buffer.clone(), p.v_buffer.clone()
    poisoned = 0
    for b, n_pre in enumerate(p.prefix_lens):
        first = max(n_pre - window, 0) // block_n * block_n
        slots = p.kv_indices[int(p.kv_indptr[b]):int(p.kv_indptr[b]) + first].long()
        k_pool[slots] = float("nan")
        v_pool[slots] = float("nan")
        poisoned += first
    assert poisoned > 2 * MIN_SPLIT
    out = plan.run(p.q_extend, p.k_extend, p.v_extend, k_pool, v_pool, out=p.new_output())
    assert relative_error(out, ref) < TOLERANCE[torch.float32]


def test_window_slices_cover_only_the_window():
    """The chooser sizes the grid for the window, not for the prefix."""
    p = make_problem([40 * MIN_SPLIT], 4, 4, 2, 32, device=DEVICE, seed=1)
    runner = VerifySplitKV(4, 2, 32, 32, 4, 1, DEVICE)
    args = (p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, p.qo_indptr, p.kv_indptr, p.kv_indices)
    full = runner.plan(*args, sm_scale=p.sm_scale)
    windowed = runner.plan(*args, sm_scale=p.sm_scale, sliding_window_size=MIN_SPLIT)
    assert windowed.n_splits < full.n_splits
    # A window of MIN_SPLIT keys is sized as a prefix of MIN_SPLIT keys: one slice, no merge
    # (its first key tile may start up to BLOCK_N - 1 keys earlier; that program reads them).
    assert windowed.n_splits == 1 and windowed.merge is None


def test_batch_invariant_with_features():
    """Fixed slices (split_tokens) stay bitwise batch-invariant under a window and a cap."""
    features = dict(sliding_window_size=200, logit_cap=4.0, xai_temperature_len=64)
    alone = make_problem([700], 3, 4, 2, 32, device=DEVICE, seed=9)
    other = make_problem([300, 1000], [2, 3], 4, 2, 32, device=DEVICE, seed=10)
    batch = concat_problems([other, alone])
    outs = []
    for prob in (alone, batch):
        out = prob.new_output()
        assert verify_splitkv_fwd(*prob.args(out), **prob.kwargs(), **features, split_tokens=128,
                                  max_prefix_len=max(prob.prefix_lens))  # grids of 6 and 8 slices
        outs.append(out)
    n = alone.num_tokens
    assert torch.equal(outs[0], outs[1][-n:])
    assert_matches_reference(outs[0], alone, **features)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cap,q_gain", [(0.5, 30.0), (50.0, 250.0), (50.0, 1.0)])
def test_logit_cap_saturates_and_stays_exact(cap, q_gain, dtype):
    """Scores far past the cap (|s| >> cap, where 2^(2 s log2e / cap) over- or underflows)
    come out as +-cap, finite; scores well inside a large cap stay nearly linear. No sinks:
    a sink outweighing every capped score by e^50 would leave rows below float16's range."""
    p = _problem(dtype, seed=11, sinks=False)
    p.q_extend.mul_(q_gain)
    scores = torch.einsum("thd,tgd->thg", p.q_extend[:4].double(), p.k_extend[:4].double()) * p.sm_scale
    if q_gain > 1:
        assert scores.abs().max() > 5 * cap  # the test reaches saturation (tanh(5) = 0.99991)
    out = torch.full_like(p.new_output(), float("nan"))
    assert verify_splitkv_fwd(*p.args(out), **p.kwargs(), logit_cap=cap, check=True)
    assert torch.isfinite(out).all()
    assert_matches_reference(out, p, logit_cap=cap)


@pytest.mark.parametrize("features", [dict(logit_cap=3.0), dict(sliding_window_size=50)])
def test_return_lse_with_features(features):
    p = _problem(torch.float32)
    out, lse = verify_attention(*p.tensors(None), **p.options(), **features, return_lse=True)
    ref, ref_lse = reference_for(p, return_lse=True, **features)
    assert relative_error(out, ref) < TOLERANCE[torch.float32]
    assert relative_error(lse, ref_lse) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("bad,match", [
    (dict(xai_temperature_len=1), "xai_temperature_len"),
    (dict(logit_cap=float("inf")), "logit_cap"),
    (dict(logit_cap=-1.0), "logit_cap"),
    (dict(sliding_window_size=2.5), "sliding_window_size"),
    (dict(window_kv_offsets="offsets"), "window_kv_offsets"),
])
def test_bad_feature_values_are_malformed(bad, match):
    p = _problem(torch.float32, mask="tree")
    if "window_kv_offsets" in bad:
        # one entry short: longer is an engine's buffer, of which the batch's entries are read
        bad = dict(window_kv_offsets=torch.zeros(p.batch_size - 1, dtype=torch.int32, device=DEVICE))
    reason = gate_call(decline_reason, p, **bad)
    assert reason.startswith("malformed input") and match in reason
    with pytest.raises(ValueError, match=match):
        verify_attention(*p.tensors(None), **p.options(), **bad)
