"""``torch.compile`` through the public entry: one graph, no recompilation as prefixes grow.

On the CPU the compiler runs with ``backend="aot_eager"`` (the op's kernels run
through the Triton interpreter); the GPU test runs Inductor in its three modes.
"""

import pytest
import torch

import splitkv
from splitkv.testing import make_problem, reference_for

from conftest import DEVICE, assert_close


def model_step(q, k, v, kb, vb, qo, kvp, kvi, scale):
    """A layer's attention as a model writes it: a projection before, a reduction after."""
    q = q * scale
    out, lse = splitkv.verify_attention(q, k, v, None, kb, vb, qo, kvp, kvi, max_len_extend=4, return_lse=True)
    return out.float().sum(-1) + 0.0 * lse, out


def _steps(n=4, seed=0):
    """Problems of growing prefixes on one pool (what a decode loop sees from step to step)."""
    base = make_problem([200, 100], 4, 8, 2, 32, dtype=torch.float32, device=DEVICE, seed=seed, pool_factor=4.0)
    gen = torch.Generator().manual_seed(seed)
    steps = []
    for i in range(n):
        lens = [200 + 13 * i, 100 + 29 * i]
        kvi = torch.randperm(base.k_buffer.shape[0], generator=gen)[: sum(lens)].to(DEVICE, base.kv_indices.dtype)
        kvp = torch.tensor([0, lens[0], sum(lens)], device=DEVICE, dtype=base.kv_indptr.dtype)
        steps.append(base.replace(kv_indices=kvi, kv_indptr=kvp, prefix_lens=lens))
    return steps


def _call(fn, p):
    return fn(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, p.qo_indptr, p.kv_indptr, p.kv_indices,
              1.0)


def test_verify_attention_compiles_in_one_graph_without_recompiling():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model_step, backend=counter, fullgraph=True)
    for p in _steps():
        torch._dynamo.mark_dynamic(p.kv_indices, 0)
        red, out = _call(compiled, p)
        assert_close(out, reference_for(p))
        red_eager, out_eager = _call(model_step, p)
        assert torch.equal(out, out_eager) and torch.equal(red, red_eager)
    assert counter.frame_count == 1, f"compiled {counter.frame_count} times over 4 prefix lengths"


def test_the_op_is_functional_and_keyword_only():
    p = _steps(1)[0]
    out, lse = torch.ops.splitkv.verify_attention(*p.tensors(None)[:3], *p.tensors(None)[4:],
                                                   max_len_extend=4, return_lse=True)
    ref_o, ref_lse = reference_for(p, return_lse=True)
    assert_close(out, ref_o)
    assert torch.allclose(lse.double(), ref_lse.to(lse.device), atol=1e-4)
    with pytest.raises(Exception):  # noqa: B017 - the schema refuses scalars by position
        torch.ops.splitkv.verify_attention(*p.tensors(None)[:3], *p.tensors(None)[4:], None, None, None, None,
                                           None, 4)
    wrapped = splitkv.verify_attention_op(*p.tensors(None)[:3], *p.tensors(None)[4:], max_len_extend=4)
    assert torch.equal(wrapped, out)
