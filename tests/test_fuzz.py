"""Randomised: valid problems against the oracle, corrupted metadata against the checked mode.

* Valid problems over prefix lengths 0..N (several slices for the long ones),
  1..16 drafts, GQA ratios 1/2/3/4, odd head dims, both index dtypes, chains,
  trees and full draft blocks, sinks, k/v scales, fused-QKV views, adaptive and
  fixed slices, with and without the LSE, with a logit cap, a sliding window or
  an xai temperature, in a token pool or in pages of 5 or 16 tokens: the
  production entry must match the float64 oracle (global norm and worst row).
* Corruptions of kv_indices, kv_indptr, qo_indptr and mask_indptr that are
  invalid by construction: both checked modes (the kernel's, ``check=True``,
  and the synchronous host check, ``check="full"``) must raise a ValueError
  naming the field; unchecked, a batch of them runs in a subprocess (see test_checked.py)
  and must stay in bounds.

Shapes are small and example counts low: the interpreter is slow and CI has two cores.
"""

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from conftest import (
    DEVICE,
    DTYPES,
    MIN_SPLIT,
    assert_close,
    assert_matches_reference,
    build_case,
    last_plan,
    raises_kernel_fault,
    run_unchecked_in_subprocess,
)
from splitkv import verify_attention, verify_splitkv_fwd
from splitkv.testing import make_problem, paged_problem, reference_for

#: Longest prefix drawn: several slices under the adaptive chooser (MIN_SPLIT is 32 on the CPU).
MAX_PREFIX = 4 * MIN_SPLIT + 10

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
                derandomize=True)


@st.composite
def valid_problems(draw):
    bs = draw(st.integers(1, 3))
    lengths = st.one_of(st.integers(0, MAX_PREFIX), st.integers(MAX_PREFIX // 2, MAX_PREFIX))
    prefix = draw(st.lists(lengths, min_size=bs, max_size=bs))
    extend = draw(st.lists(st.integers(1, 16), min_size=bs, max_size=bs))
    kv_heads = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 3, 4]))
    head_dim = draw(st.sampled_from([40, 72, 96, 16]))
    v_head_dim = draw(st.sampled_from([head_dim, head_dim, 24]))
    fused = v_head_dim == head_dim and draw(st.booleans())
    return dict(
        prefix_lens=prefix, extend_lens=extend, num_q_heads=kv_heads * group, num_kv_heads=kv_heads,
        head_dim=head_dim, v_head_dim=v_head_dim, fused_qkv=fused,
        dtype=draw(st.sampled_from(DTYPES)),
        index_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        mask=draw(st.sampled_from(["causal", "chain", "tree", "none"])),
        sinks=draw(st.booleans()),
        k_scale=draw(st.sampled_from([1.0, 0.5])), v_scale=draw(st.sampled_from([1.0, 1.5])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


FEATURES = st.one_of(
    st.just({}), st.just({}),
    st.builds(lambda cap: {"logit_cap": cap}, st.sampled_from([1.0, 5.0])),
    st.builds(lambda w: {"sliding_window_size": w}, st.integers(1, MAX_PREFIX)),
    st.builds(lambda n: {"xai_temperature_len": n}, st.integers(2, MAX_PREFIX)),
)


@settings(max_examples=24, **SETTINGS)
@given(spec=valid_problems(), split_tokens=st.sampled_from([None, None, 128]), return_lse=st.booleans(),
       features=FEATURES, page_size=st.sampled_from([None, None, 5, 16]))
def test_random_valid_problems(spec, split_tokens, return_lse, features, page_size):
    p = make_problem(device=DEVICE, **spec)
    out = p.new_output()
    inputs = p if page_size is None else paged_problem(p, page_size, seed=spec["seed"] % 1000)
    bound = dict(max_prefix_len=max(max(p.prefix_lens), 1)) if split_tokens else {}
    result = verify_attention(*inputs.tensors(out), **inputs.options(), split_tokens=split_tokens, **bound,
                              return_lse=return_lse, **features)
    event(f"grid slices: {last_plan().n_splits}")
    if return_lse:
        result, lse = result
        ref_o, ref_lse = reference_for(p, return_lse=True, **features)
        assert_close(result, ref_o, p.q_extend.dtype)
        tol = 1e-4 if p.q_extend.dtype == torch.float32 else 2e-3
        assert (lse.double() - ref_lse).abs().max().item() < tol
    else:
        assert result is out
        assert_matches_reference(out, p, **features)


# --- corruptions ------------------------------------------------------------------

#: Corruption kind -> the field the synchronous check's message (check="full") must name.
KINDS = {
    "slot": "kv_indices",
    "kv_indptr_decreases": "kv_indptr",
    "kv_indptr_start": r"kv_indptr\[0\]",
    "kv_indptr_end": r"kv_indptr\[-1\]",
    "qo_indptr_decreases": "qo_indptr",
    "qo_indptr_start": r"qo_indptr\[0\]",
    "qo_indptr_end": r"qo_indptr\[-1\]",
    "too_many_drafts": "max_len_extend",
    "mask_indptr": "mask_indptr",
}
#: The same for the kernel's checks (check=True; splitkv.errors.FIELDS, which name the field, not the entry).
#: A corrupted qo_indptr entry also lengthens a neighbouring sequence's drafts past max_len_extend, and the
#: kernel reports one of a call's faults: either names what the corruption broke.
_QO = r"qo_indptr|more draft tokens than max_len_extend"
KERNEL_KINDS = {**KINDS, "kv_indptr_start": "kv_indptr", "kv_indptr_end": "kv_indptr",
                "qo_indptr_decreases": _QO, "qo_indptr_start": _QO, "qo_indptr_end": _QO}
#: With a tree mask, a corrupted indptr also moves a sequence's mask rows (their size follows its prefix
#: and draft counts) past custom_mask: the kernel may report that fault of the corruption instead.
_MASK_RUNS_OUT = "its custom_mask rows"


@st.composite
def corrupted_cases(draw):
    """A JSON case (see conftest.build_case) whose metadata is invalid by construction."""
    bs = draw(st.integers(2, 3))
    prefix = draw(st.lists(st.integers(0, 70), min_size=bs, max_size=bs))
    extend = draw(st.lists(st.integers(1, 6), min_size=bs, max_size=bs))
    index_dtype = draw(st.sampled_from(["int32", "int64"]))
    mask = draw(st.sampled_from(["causal", "tree"]))
    problem = dict(prefix_lens=prefix, extend_lens=extend, num_q_heads=4, num_kv_heads=2, head_dim=16,
                   index_dtype=index_dtype, mask=mask, seed=draw(st.integers(0, 2**31 - 1)))
    kinds = [k for k in KINDS if (k != "slot" or sum(prefix) > 0) and (k != "mask_indptr" or mask == "tree")
             and (k != "too_many_drafts" or max(extend) > 1)]  # one draft each fits any max_len_extend
    kind = draw(st.sampled_from(kinds))
    kv = [0]
    for n in prefix:
        kv.append(kv[-1] + n)
    qo = [0]
    for n in extend:
        qo.append(qo[-1] + n)
    d = draw(st.integers(1, 50))
    b = draw(st.integers(1, bs))
    edits, max_len_extend, expect = [], None, None
    if kind == "slot":
        values = [["abs", -1], ["abs", -(2**31)], ["pool", 0], ["pool", d], ["abs", 2**31 - 1]]
        if index_dtype == "int64":
            values += [["abs", 2**40], ["abs", -(2**40)]]
        edits = [["kv_indices", draw(st.integers(0, sum(prefix) - 1)), draw(st.sampled_from(values))]]
        expect = "absent"
    elif kind == "kv_indptr_decreases":
        kv[b] = kv[b - 1] - d
        edits = [["kv_indptr", None, kv]]
    elif kind == "kv_indptr_start":  # negative: a positive start is a sub-batch's view, which is valid
        kv[0] = -d
        edits = [["kv_indptr", None, kv]]
    elif kind == "kv_indptr_end":
        edits = [["kv_indptr", bs, ["kv_len", d]]]
    elif kind == "qo_indptr_decreases":
        qo[b] = qo[b - 1] - d
        edits = [["qo_indptr", None, qo]]
    elif kind == "qo_indptr_start":  # negative, as for kv_indptr
        qo[0] = -d
        edits = [["qo_indptr", None, qo]]
    elif kind == "qo_indptr_end":
        edits = [["qo_indptr", bs, ["tokens", d]]]
    elif kind == "too_many_drafts":
        max_len_extend = max(1, max(extend) - draw(st.integers(1, 3)))  # the gate serves it if rows allow
    elif kind == "mask_indptr":
        size = extend[b - 1] * (prefix[b - 1] + extend[b - 1])
        edits = [["mask_indptr", b - 1, draw(st.sampled_from([["abs", -d], ["mask_len", d - size]]))]]
    name = f"{kind} {problem['prefix_lens']}/{problem['extend_lens']} {index_dtype} {mask} {edits} {max_len_extend}"
    return dict(name=name, problem=problem, edits=edits, max_len_extend=max_len_extend, expect=expect,
                match=KINDS[kind], kernel=KERNEL_KINDS[kind] + (
                    f"|{_MASK_RUNS_OUT}" if mask == "tree" and "indptr" in kind and kind != "mask_indptr" else ""))


@settings(max_examples=40, **SETTINGS)
@given(case=corrupted_cases())
def test_corruptions_raise_when_checked(case):
    p, clean, _ = build_case(case)
    with raises_kernel_fault(case["kernel"]):  # checked by default: the kernel's checks
        verify_attention(*p.tensors(p.new_output()), **p.options())
    with pytest.raises(ValueError, match=case["match"]):
        verify_attention(*p.tensors(p.new_output()), **p.options(), check="full")
    # The gate reads shapes only (more rows than batch_size x max_len_extend may be a sub-batch's view),
    # so the drop-in plans every case and its checks see it.
    with raises_kernel_fault(case["kernel"]):
        verify_splitkv_fwd(*p.args(p.new_output()), **p.kwargs(), check=True)
    with pytest.raises(ValueError, match=case["match"]):
        verify_splitkv_fwd(*p.args(p.new_output()), **p.kwargs(), check="full")


@settings(max_examples=2, **SETTINGS)
@given(cases=st.lists(corrupted_cases(), min_size=10, max_size=10))
def test_corruptions_stay_in_bounds_unchecked(cases):
    for i, case in enumerate(cases):
        case["name"] = f"#{i} {case['name']}"
    run_unchecked_in_subprocess(cases)
