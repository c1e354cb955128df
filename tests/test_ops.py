"""The custom ops under torch.compile: one graph, no break, right numbers, no recompiles."""

import pytest
import torch

import splitkv
from splitkv.testing import make_problem, reference_for

from conftest import assert_matches_reference, DEVICE


def _problem(prefixes, seed=0, dtype=torch.float32):
    return make_problem(prefixes, 4, 8, 2, 64, dtype=dtype, device=DEVICE, seed=seed)


def _layer(p):
    """A model-like function: a projection, the op, another projection."""

    def fn(q, k, v, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices):
        out, lse = splitkv.verify_attention_op(
            q * 1.0, k, v, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
            max_len_extend=p.max_len_extend, return_lse=True,
        )
        return out + 0.0, lse

    return fn


def _inputs(p):
    return (p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, p.qo_indptr, p.kv_indptr, p.kv_indices)


def test_op_matches_the_oracle_eagerly():
    p = _problem([0, 33, 97])
    out, lse = _layer(p)(*_inputs(p))
    assert_matches_reference(out, p)
    ref_o, ref_lse = reference_for(p, return_lse=True)
    assert (lse.double() - ref_lse).abs().max() < 1e-4


def test_fullgraph_compile_no_break_no_recompile():
    torch._dynamo.reset()
    p = _problem([40, 97], seed=1)
    fn = torch.compile(_layer(p), backend="aot_eager", fullgraph=True)
    kv = p.kv_indices
    torch._dynamo.mark_dynamic(kv, 0)
    out, _ = fn(*_inputs(p))
    assert_matches_reference(out, p)
    # Same shapes but other prefix lengths and a longer kv_indices: no recompilation.
    p2 = _problem([130, 7], seed=2)
    p2.kv_indices = p2.kv_indices  # a new, longer index array
    torch._dynamo.mark_dynamic(p2.kv_indices, 0)
    with torch._dynamo.config.patch(error_on_recompile=True):
        out2, _ = fn(*_inputs(p2))
    assert_matches_reference(out2, p2)


def test_fullgraph_compile_paged_pool_and_features():
    """Paged pools and score features go through the op too, in one graph."""
    from splitkv.testing import paged_problem

    torch._dynamo.reset()
    p = _problem([54, 97], seed=4)
    pp = paged_problem(p, 16, seed=2)
    features = dict(logit_cap=3.0, sliding_window_size=40)

    def fn(q, k, v, k_pages, v_pages, qo_indptr, kv_indptr, page_ids, last):
        return splitkv.verify_attention_op(q * 1.0, k, v, k_pages, v_pages, qo_indptr, kv_indptr, page_ids,
                                           max_len_extend=p.max_len_extend, kv_last_page_len=last, **features)

    a = pp.args(None)
    out = torch.compile(fn, backend="aot_eager", fullgraph=True)(*a[:3], *a[4:9], pp.kv_last_page_len)
    assert_matches_reference(out, p, **features)


def test_merge_states_op_compiles():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    v = torch.randn(5, 3, 4, 16, generator=g).to(DEVICE)
    s = torch.randn(5, 3, 4, generator=g).to(DEVICE)
    fn = torch.compile(lambda v, s: splitkv.merge_states_op(v * 1.0, s), backend="aot_eager", fullgraph=True)
    out, lse = fn(v, s)
    w = torch.softmax(s.double(), dim=1)
    ref = (w[..., None] * v.double()).sum(1)
    assert (out.double() - ref).abs().max() < 1e-5
    assert (lse.double() - torch.logsumexp(s.double(), 1)).abs().max() < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_inductor_reduce_overhead_on_gpu():
    torch._dynamo.reset()
    p = make_problem([4096, 1000, 0], 4, 32, 8, 128, dtype=torch.bfloat16, device="cuda", seed=3)
    fn = torch.compile(_layer(p), mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up, record, replay
        out, _ = fn(*_inputs(p))
    torch.cuda.synchronize()
    assert_matches_reference(out.clone(), p)
