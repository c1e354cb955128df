"""The baseline extend kernel against the float64 oracle.

Every output starts poisoned with NaN, so a row the kernel forgets to write
fails :func:`assert_matches_reference`. Shapes are small: on a CPU-only
machine the kernel runs through the Triton interpreter.
"""

import pytest
import torch
from conftest import DEVICE, DTYPES, TOLERANCE, assert_matches_reference, gpu
from hypothesis import given, settings
from hypothesis import strategies as st

from splitkv.extend import MAX_HEAD_DIM, extend_attention_fwd
from splitkv.testing import make_problem
from splitkv.testing import reference_for, relative_error

# The interpreter evaluates both sides of tl.where and the padded rows of a
# tile in numpy, which warns about log2(0) and 0 / 0 it then discards.
pytestmark = [
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
]

#: Short and empty prefixes inside a batch of longer ones.
PREFIXES = [54, 0, 97, 1]


def run(problem, o=None, **kwargs):
    """Run the kernel on ``problem`` into ``o`` (a NaN-poisoned fresh one by default)."""
    o = problem.new_output() if o is None else o
    extend_attention_fwd(*problem.args(o), **{**problem.kwargs(), **kwargs})
    return o


def check(problem, **kwargs):
    """Run the kernel and compare with the oracle under the same keyword arguments."""
    return assert_matches_reference(run(problem, **kwargs), problem, **kwargs)


def with_prefix_mask(problem, seed=0):
    """``problem`` with a custom mask that also hides parts of the prefix.

    Even rows lose every prefix key below position 40 (whole key tiles), odd
    rows a random half of the prefix. The draft block keeps the problem's own
    mask, so every row still sees its own token.
    """
    assert problem.custom_mask is not None
    gen = torch.Generator().manual_seed(seed)
    blocks, offsets = [], problem.mask_indptr.tolist()
    for b, (n_pre, n_ext) in enumerate(zip(problem.prefix_lens, problem.extend_lens)):
        rows = problem.custom_mask[offsets[b] : offsets[b + 1]].view(n_ext, n_pre + n_ext).cpu().clone()
        rows[0::2, : min(40, n_pre)] = False
        rows[1::2, :n_pre] = torch.rand(rows[1::2, :n_pre].shape, generator=gen) < 0.5
        blocks.append(rows.flatten())
    return problem.replace(custom_mask=torch.cat(blocks).to(problem.custom_mask.device))


def with_kv_offsets(problem, offsets, seed=0):
    """``problem`` with mask rows widened by ``offsets[b]`` leading junk columns.

    Returns the new problem and the ``window_kv_offsets`` tensor; the junk is
    random, so a kernel that reads it instead of skipping it fails.
    """
    gen = torch.Generator().manual_seed(seed)
    ptr = problem.mask_indptr.tolist()
    blocks = []
    for b, (n_pre, n_ext) in enumerate(zip(problem.prefix_lens, problem.extend_lens)):
        rows = problem.custom_mask[ptr[b] : ptr[b + 1]].view(n_ext, n_pre + n_ext).cpu()
        junk = torch.rand(n_ext, offsets[b], generator=gen) < 0.5
        blocks.append(torch.cat([junk, rows], dim=1).flatten())
    lens = torch.tensor([0] + [blk.numel() for blk in blocks]).cumsum(0)
    device = problem.custom_mask.device
    widened = problem.replace(
        custom_mask=torch.cat(blocks).to(device), mask_indptr=lens.to(device=device, dtype=torch.int64)
    )
    return widened, torch.tensor(offsets, dtype=torch.int32, device=device)


# ---------------------------------------------------------------- shapes ----


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim,v_head_dim", [(64, 64), (96, 96), (64, 32)])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 4), (4, 1), (6, 2)])
def test_head_configurations(num_q_heads, num_kv_heads, head_dim, v_head_dim, dtype):
    """MHA, MQA and GQA-3; a non-power-of-two head and a smaller value head."""
    p = make_problem(
        PREFIXES, 5, num_q_heads, num_kv_heads, head_dim, v_head_dim,
        dtype=dtype, device=DEVICE, mask="tree", seed=1,
    )
    check(p)


@pytest.mark.parametrize("extend_lens", [1, 3, 5, 7, 8, [1, 8, 3, 5]], ids=str)
@pytest.mark.parametrize("mask", ["causal", "chain", "tree", "none"])
def test_masks_and_draft_lengths(mask, extend_lens):
    p = make_problem(PREFIXES, extend_lens, 2, 1, 64, device=DEVICE, mask=mask, seed=2)
    check(p)


@pytest.mark.parametrize("window", [-1, 20])
@pytest.mark.parametrize("mask", ["causal", "tree", "none"])
def test_several_query_blocks(mask, window):
    """More draft rows than one BLOCK_M tile: later tiles, the causal cut-off
    and the per-tile start of the sliding window."""
    p = make_problem([33, 70], [70, 19], 2, 1, 64, device=DEVICE, mask=mask, seed=3)
    check(p, sliding_window_size=window)


@pytest.mark.parametrize("fused_qkv", [False, True])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_index_dtype_and_fused_qkv(index_dtype, fused_qkv):
    """int32/int64 slots; q/k/v as strided views into one fused projection."""
    p = make_problem(
        PREFIXES, 4, 4, 2, 64, device=DEVICE, mask="tree",
        index_dtype=index_dtype, fused_qkv=fused_qkv, seed=4,
    )
    assert p.q_extend.is_contiguous() != fused_qkv
    check(p)


def test_default_and_custom_sm_scale():
    p = make_problem(PREFIXES, 4, 2, 1, 96, device=DEVICE, seed=5)
    check(p.replace(sm_scale=None))
    check(p.replace(sm_scale=0.3))


# ---------------------------------------------------------- the options ----


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kv_scales(dtype):
    p = make_problem(PREFIXES, 5, 4, 2, 64, dtype=dtype, device=DEVICE, k_scale=0.5, v_scale=0.25, seed=6)
    check(p)


def test_kv_scales_as_cpu_tensors():
    p = make_problem(PREFIXES, 3, 2, 1, 64, device=DEVICE, k_scale=0.5, v_scale=0.25, seed=7)
    o = p.new_output()
    args = list(p.args(o))
    args[13], args[14] = torch.tensor(0.5), torch.tensor([0.25])
    extend_attention_fwd(*args, **p.kwargs())
    assert_matches_reference(o, p)


def test_fp8_pool():
    """A float8 token pool, upcast in the kernel and dequantised by the scales."""
    p = make_problem(
        PREFIXES, 5, 4, 2, 64, device=DEVICE, kv_dtype=torch.float8_e4m3fn,
        mask="tree", k_scale=0.5, v_scale=0.25, seed=8,
    )
    check(p)


@pytest.mark.parametrize("mask", ["chain", "tree"])
def test_custom_mask_on_prefix(mask):
    """skip_prefix_custom_mask=False: the mask hides prefix keys too."""
    p = with_prefix_mask(make_problem(PREFIXES, 5, 4, 2, 64, device=DEVICE, mask=mask, seed=9))
    check(p, skip_prefix_custom_mask=False)
    # ...and with the default the same mask leaves the prefix alone.
    check(p)


def test_fully_masked_rows_match_oracle():
    """A row that sees nothing is NaN (0 / 0), or 0 with a sink, like the oracle."""
    p = make_problem([40, 0], 3, 2, 1, 64, device=DEVICE, mask="chain", seed=10)
    mask = p.custom_mask.clone()
    mask[: 40 + 3] = False  # sequence 0, draft row 0: prefix and drafts hidden
    p = p.replace(custom_mask=mask)
    for sinks in (None, torch.randn(2, device=DEVICE)):
        out = run(p, skip_prefix_custom_mask=False, sinks=sinks).double()
        ref = reference_for(p, skip_prefix_custom_mask=False, sinks=sinks)
        dead = torch.isnan(ref)
        assert dead.any() == (sinks is None)
        assert torch.equal(torch.isnan(out), dead)
        if sinks is not None:
            assert (out[0] == 0).all()
        assert relative_error(out[~dead], ref[~dead]) < TOLERANCE[p.q_extend.dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_logit_cap(dtype):
    p = make_problem(PREFIXES, 5, 4, 2, 64, dtype=dtype, device=DEVICE, mask="tree", seed=11)
    # Scores of a few units, so that the cap changes the answer well beyond
    # the tolerance (bf16's included).
    p = p.replace(sm_scale=0.25)
    assert relative_error(reference_for(p, logit_cap=5.0), reference_for(p)) > 3 * TOLERANCE[dtype]
    check(p, logit_cap=5.0)


@pytest.mark.parametrize("window", [40, 2])
@pytest.mark.parametrize("mask", ["causal", "tree", "none"])
def test_sliding_window(mask, window):
    """W=40 cuts the 97-token prefix mid-tile; W=2 reaches into the drafts."""
    p = make_problem([97, 30, 0, 64], 6, 2, 1, 64, device=DEVICE, mask=mask, seed=12)
    check(p, sliding_window_size=window)


def test_sliding_window_with_prefix_mask():
    p = with_prefix_mask(make_problem([97, 30, 0, 64], 5, 2, 1, 64, device=DEVICE, mask="tree", seed=13))
    check(p, sliding_window_size=40, skip_prefix_custom_mask=False)


@pytest.mark.parametrize("mask", ["causal", "tree"])
def test_sinks(mask):
    p = make_problem(PREFIXES, 5, 4, 2, 64, device=DEVICE, mask=mask, sinks=True, seed=14)
    check(p)


def test_xai_temperature():
    """len=50 lies inside the batch: some rows are rescaled, some are not."""
    p = make_problem(PREFIXES, 5, 4, 2, 64, dtype=torch.float32, device=DEVICE, seed=15)
    assert relative_error(reference_for(p, xai_temperature_len=50), reference_for(p)) > 1e-2
    check(p, xai_temperature_len=50)


@pytest.mark.parametrize("skip_prefix", [True, False])
def test_window_kv_offsets(skip_prefix):
    base = make_problem(PREFIXES, 5, 2, 1, 64, device=DEVICE, mask="tree", seed=16)
    p, offsets = with_kv_offsets(with_prefix_mask(base), [3, 0, 5, 1])
    check(p, window_kv_offsets=offsets, skip_prefix_custom_mask=skip_prefix)


def test_window_kv_offsets_ignored_without_custom_mask():
    p = make_problem(PREFIXES, 3, 2, 1, 64, device=DEVICE, seed=17)
    offsets = torch.tensor([3, 0, 5, 1], dtype=torch.int32, device=DEVICE)
    assert_matches_reference(run(p, window_kv_offsets=offsets), p)


def test_everything_at_once():
    """All options together, GQA-3, a 96-wide head, int32 slots, fp32."""
    base = make_problem(
        [97, 0, 61, 1], [5, 2, 7, 3], 6, 2, 96, dtype=torch.float32, device=DEVICE,
        mask="tree", index_dtype=torch.int32, k_scale=0.5, v_scale=0.25, sinks=True, seed=18,
    )
    p, offsets = with_kv_offsets(with_prefix_mask(base), [2, 4, 0, 1])
    check(
        p, window_kv_offsets=offsets, skip_prefix_custom_mask=False, logit_cap=5.0,
        sliding_window_size=40, xai_temperature_len=50,
    )


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    prefix_lens=st.lists(st.integers(0, 80), min_size=1, max_size=3),
    extend_len=st.integers(1, 9),
    heads=st.sampled_from([(2, 2), (2, 1), (3, 1)]),
    mask=st.sampled_from(["causal", "chain", "tree", "none"]),
    window=st.sampled_from([-1, 1, 17]),
    seed=st.integers(0, 2**16),
)
def test_random_problems(prefix_lens, extend_len, heads, mask, window, seed):
    p = make_problem(prefix_lens, extend_len, *heads, 32, device=DEVICE, mask=mask, seed=seed)
    check(p, sliding_window_size=window)


# ----------------------------------------------------- output and errors ----


def test_output_view_into_larger_tensor():
    """A strided o_extend: only the view is written, its surroundings are not."""
    p = make_problem(PREFIXES, 4, 4, 2, 64, 32, device=DEVICE, mask="tree", seed=19)
    big = torch.full((p.num_tokens + 1, p.num_q_heads + 2, 48), 7.0, dtype=p.q_extend.dtype, device=DEVICE)
    o = big[1:, 1 : p.num_q_heads + 1, 8:40]
    o.fill_(float("nan"))
    run(p, o)
    assert_matches_reference(o, p)
    untouched = torch.ones_like(big, dtype=torch.bool)
    untouched[1:, 1 : p.num_q_heads + 1, 8:40] = False
    assert (big[untouched] == 7.0).all()


def test_nothing_to_do():
    p = make_problem([5], 1, 2, 1, 64, device=DEVICE, seed=20)
    o = p.new_output()
    extend_attention_fwd(*p.args(o)[:12], 0)  # max_len_extend = 0: no launch
    assert torch.isnan(o).all()


#: (position in the argument list, what to put there given the old value).
MALFORMED = {
    "kv_heads_not_dividing_q_heads": (1, lambda k: k[:, :1].repeat(1, 3, 1)),
    "v_dtype": (2, lambda v: v.float()),
    "o_shape": (3, lambda o: o[:, :, :-1]),
    "o_dtype": (3, lambda o: o.float()),
    "max_len_extend_negative": (12, lambda n: -1),
    "k_scale_on_device": (13, lambda s: torch.tensor(0.5, device="meta")),
    "v_scale_two_values": (14, lambda s: torch.tensor([0.5, 0.5])),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_inputs_raise_value_error(case):
    p = make_problem([5, 3], 2, 4, 2, 64, device=DEVICE, mask="tree", seed=21)
    args = list(p.args(p.new_output()))
    position, replace = MALFORMED[case]
    args[position] = replace(args[position])
    with pytest.raises(ValueError):
        extend_attention_fwd(*args, **p.kwargs())


@pytest.mark.parametrize(
    "kwargs",
    [
        {"xai_temperature_len": 1},
        {"window_kv_offsets": torch.zeros(3, dtype=torch.int32)},  # batch is 2
        {"window_kv_offsets": torch.zeros(2, dtype=torch.float32)},
    ],
    ids=["xai_len_1", "offsets_length", "offsets_dtype"],
)
def test_bad_options_raise_value_error(kwargs):
    p = make_problem([5, 3], 2, 2, 1, 64, device=DEVICE, mask="tree", seed=22)
    kwargs = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    with pytest.raises(ValueError):
        run(p, **kwargs)


def test_head_dim_too_large_is_not_implemented():
    d = MAX_HEAD_DIM + 32
    p = make_problem([3], 1, 1, 1, d, device=DEVICE, seed=23)
    with pytest.raises(NotImplementedError, match="head_dim"):
        run(p)


# ---------------------------------------------------------------- GPU ----


@gpu
@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("shape", [(16, 2, 256), (32, 8, 128)], ids=["qwen3-next", "llama3-8b"])
def test_real_size_on_gpu(shape, kv_dtype):
    """Model-sized heads, ~4k-token prefixes, a tree of 8 drafts, bf16 activations."""
    h_q, h_kv, d = shape
    p = make_problem(
        [4096, 3001, 4500, 17], 8, h_q, h_kv, d, dtype=torch.bfloat16, kv_dtype=kv_dtype,
        device=DEVICE, mask="tree", k_scale=0.5 if kv_dtype else 1.0, sinks=True, seed=24,
    )
    check(p)
    check(p, sliding_window_size=1000, logit_cap=30.0)
