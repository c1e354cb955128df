"""merge_state / merge_states: attention over a key set cut into disjoint parts,
computed part by part and merged, equals attention over the whole set.

Part states come from the float64 oracle and from the kernel itself
(``return_lse`` on sub-problems: prefix slices with ``attend_draft=False``, and
the draft block); the whole comes from the float64 oracle.
"""

import math
import random

import pytest
import torch

from conftest import DEVICE, DTYPES, assert_close, prefix_only_mask, with_prefix_parts
from splitkv import VerifySplitKV, merge_state, merge_states
from splitkv.testing import make_problem, reference_for


def random_cuts(prefix_lens, n_parts, seed):
    """Per sequence, ``n_parts`` contiguous ``(lo, hi)`` ranges covering its prefix (empty ones included)."""
    rng = random.Random(seed)
    cuts = []
    for n in prefix_lens:
        inner = sorted(rng.randint(0, n) for _ in range(n_parts - 1))
        edges = [0] + inner + [n]
        cuts.append([(edges[j], edges[j + 1]) for j in range(n_parts)])
    return [[cuts[b][j] for b in range(len(prefix_lens))] for j in range(n_parts)]  # [part][sequence]


def oracle_prefix_state(p):
    """Float64 ``(o, lse)`` over the prefix alone (no key: o = NaN, lse = -inf)."""
    mask, mask_indptr = prefix_only_mask(p)
    return reference_for(p, custom_mask=mask, mask_indptr=mask_indptr, return_lse=True)


def oracle_draft_state(p):
    """Float64 ``(o, lse)`` over the draft block alone."""
    empty = with_prefix_parts(p, [(0, 0)] * p.batch_size)
    return reference_for(empty, return_lse=True)


def stack_states(states, dtype):
    v = torch.stack([o.to(dtype) for o, _ in states], 1)
    s = torch.stack([lse.to(torch.float32) for _, lse in states], 1)
    return v, s


@pytest.mark.parametrize("n_parts", [2, 3, 5])
@pytest.mark.parametrize("mask", ["causal", "tree"])
def test_oracle_parts_merge_to_the_whole(n_parts, mask):
    """Float64 oracle states of disjoint parts (empty ones have o = NaN, lse = -inf: never read)."""
    p = make_problem([100, 37, 0, 64], [3, 1, 2, 4], 4, 2, 16, dtype=torch.float32, mask=mask, device=DEVICE,
                     seed=n_parts)
    states = [oracle_prefix_state(with_prefix_parts(p, part)) for part in random_cuts(p.prefix_lens, n_parts, 1)]
    states.append(oracle_draft_state(p))
    assert any(torch.isnan(o).any() for o, _ in states), "no empty part: the test proves less than it says"
    v, s = stack_states(states, torch.float32)
    out, lse = merge_states(v, s)
    ref_o, ref_lse = reference_for(p, return_lse=True)
    assert_close(out, ref_o, torch.float32, "merged output")
    assert (lse.double() - ref_lse).abs().max().item() < 1e-5


def _state(plan, sub):
    """``(out, lse)`` of a return_lse plan on a sub-problem, into NaN-poisoned buffers."""
    lse = torch.full((sub.num_tokens, sub.num_q_heads), float("nan"), dtype=torch.float32, device=DEVICE)
    out = plan.run(sub.q_extend, sub.k_extend, sub.v_extend, sub.k_buffer, sub.v_buffer, out=sub.new_output(),
                   lse=lse)
    return out, lse


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("draft_with_last", [True, False])
def test_kernel_parts_merge_to_the_whole(dtype, draft_with_last):
    """Kernel states (return_lse) of prefix slices and the draft block, merged, against the whole."""
    p = make_problem([150, 37, 0, 90], [3, 1, 2, 4], 4, 2, 32, dtype=dtype, device=DEVICE, seed=7)
    runner = VerifySplitKV(4, 2, 32, 32, p.max_len_extend, p.batch_size, DEVICE)
    parts = random_cuts(p.prefix_lens, 3, 2)
    states = []
    for j, part in enumerate(parts):
        sub = with_prefix_parts(p, part)
        last = j == len(parts) - 1
        plan = runner.plan(sub.q_extend, sub.k_extend, sub.v_extend, sub.k_buffer, sub.v_buffer, sub.qo_indptr,
                           sub.kv_indptr, sub.kv_indices, sm_scale=sub.sm_scale, return_lse=True,
                           attend_draft=draft_with_last and last)
        states.append(_state(plan, sub))
    if not draft_with_last:
        sub = with_prefix_parts(p, [(0, 0)] * p.batch_size)
        plan = runner.plan(sub.q_extend, sub.k_extend, sub.v_extend, sub.k_buffer, sub.v_buffer, sub.qo_indptr,
                           sub.kv_indptr, sub.kv_indices, sm_scale=sub.sm_scale, return_lse=True)
        states.append(_state(plan, sub))
    assert any(torch.isneginf(lse).any() for _, lse in states)  # some part of some sequence is empty
    v = torch.stack([o for o, _ in states], 1)
    s = torch.stack([lse for _, lse in states], 1)
    out, lse = merge_states(v, s)
    assert out.dtype == dtype
    ref_o, ref_lse = reference_for(p, return_lse=True)
    assert_close(out, ref_o, dtype, "merged kernel states")
    assert (lse.double() - ref_lse).abs().max().item() < (1e-4 if dtype == torch.float32 else 2e-3)


def _random_states(n_tok=5, n=4, heads=3, dim=24, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(n_tok, n, heads, dim, generator=gen).to(DEVICE, dtype)
    s = (torch.randn(n_tok, n, heads, generator=gen) * 3).to(DEVICE)
    return v, s


def _oracle_merge(v, s):
    v, s = v.double(), s.double()
    lse = torch.logsumexp(s, 1)
    w = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[:, None])
    out = torch.where(w[..., None] > 0, w[..., None] * v, 0.0).sum(1)
    return torch.where(torch.isneginf(lse)[..., None], 0.0, out), lse


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_states_against_float64(dtype):
    v, s = _random_states(dtype=dtype)
    out, lse = merge_states(v, s)
    ref_o, ref_lse = _oracle_merge(v, s)
    assert_close(out, ref_o, dtype)
    assert (lse.double() - ref_lse).abs().max().item() < 1e-5


def test_merge_state_is_merge_states_of_two():
    v, s = _random_states(n=2)
    out, lse = merge_state(v[:, 0], s[:, 0], v[:, 1], s[:, 1])
    out2, lse2 = merge_states(v, s)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


def test_merge_is_associative_and_commutative():
    v, s = _random_states(n=3)
    ab = merge_state(v[:, 0], s[:, 0], v[:, 1], s[:, 1])
    abc = merge_state(*ab, v[:, 2], s[:, 2])
    cba = merge_state(v[:, 2], s[:, 2], *merge_state(v[:, 1], s[:, 1], v[:, 0], s[:, 0]))
    direct = merge_states(v, s)
    for got in (abc, cba):
        assert torch.allclose(got[0], direct[0], rtol=1e-5, atol=1e-6)
        assert torch.allclose(got[1], direct[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("where", [0, 2, 3])
def test_empty_parts_weigh_zero(where):
    """A state with lse = -inf changes nothing (bitwise), and its v (NaN here) is never read."""
    v, s = _random_states(n=3)
    base = merge_states(v, s)
    v_e = torch.cat([v[:, :where], torch.full_like(v[:, :1], float("nan")), v[:, where:]], 1)
    s_e = torch.cat([s[:, :where], torch.full_like(s[:, :1], float("-inf")), s[:, where:]], 1)
    got = merge_states(v_e, s_e)
    assert torch.equal(got[0], base[0]) and torch.equal(got[1], base[1])


def test_all_empty_gives_zero_and_minus_inf():
    v = torch.full((4, 3, 2, 8), float("nan"), device=DEVICE)
    s = torch.full((4, 3, 2), float("-inf"), device=DEVICE)
    out, lse = merge_states(v, s)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()
    # Mixed: rows whose states are all empty next to rows that have keys.
    v2, s2 = _random_states(n_tok=4, n=3, heads=2, dim=8)
    s2[1] = float("-inf")
    v2[1] = float("nan")
    out, lse = merge_states(v2, s2)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()
    ref_o, ref_lse = _oracle_merge(v2[[0, 2, 3]], s2[[0, 2, 3]])
    assert_close(out[[0, 2, 3]], ref_o, torch.float32)


def test_non_contiguous_inputs_and_outputs():
    """v and s as permuted views ([n, tokens, ...] storage), out as a strided view: same bits."""
    v, s = _random_states(n_tok=6, n=4, heads=3, dim=20)
    v_t = v.permute(1, 0, 2, 3).contiguous().permute(1, 0, 2, 3)  # [tokens, n, heads, dim] view of [n, ...]
    s_t = s.permute(1, 0, 2).contiguous().permute(1, 0, 2)
    assert not v_t.is_contiguous() and not s_t.is_contiguous() and torch.equal(v_t, v)
    backing = torch.full((6, 3, 40), 7.0, device=DEVICE)
    out = backing[:, :, 10:30]
    got, lse = merge_states(v_t, s_t, out=out)
    assert got is out
    ref, ref_lse = merge_states(v, s)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    assert (backing[:, :, :10] == 7.0).all() and (backing[:, :, 30:] == 7.0).all()
    # A head-dim slice of a wider tensor (row strides larger than the dim).
    wide = torch.cat([v, torch.full_like(v, float("nan"))], -1)[..., :20]
    assert torch.equal(merge_states(wide, s)[0], ref)


def test_rejects_bad_input():
    v, s = _random_states()
    with pytest.raises(ValueError):
        merge_states(v, s.double())
    with pytest.raises(ValueError):
        merge_states(v, s[:, :2])
    with pytest.raises(ValueError):
        merge_states(v[..., ::2], s)  # non-unit last stride
    with pytest.raises(ValueError):
        merge_state(v[:, 0], s[:, 0], v[:, 1, :2], s[:, 1, :2])


def test_lse_convention_is_natural_log():
    """One key per part: each state's lse is that key's score, and the merge is a softmax."""
    scores = torch.tensor([[[0.5]], [[-1.0]], [[2.0]]], device=DEVICE).permute(1, 0, 2)  # [1, 3, 1]
    vals = torch.eye(3, device=DEVICE)[None, :, None, :]  # [1, 3, 1, 3]
    out, lse = merge_states(vals, scores)
    w = torch.softmax(scores[0, :, 0].double(), 0)
    assert torch.allclose(out[0, 0].double(), w, atol=1e-6)
    assert abs(lse.item() - math.log(sum(math.exp(x) for x in (0.5, -1.0, 2.0)))) < 1e-6
