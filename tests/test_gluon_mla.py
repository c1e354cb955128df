"""The Gluon MLA verify kernel for sm_90 (:mod:`splitkv.gluon_mla`) on a GPU: against the float64 oracle and
the ``tl`` kernel.

Every test here needs an sm_90 GPU and a Triton the kernel compiles on; elsewhere they are skipped with
:func:`splitkv.gluon_mla.unavailable_reason`. The shapes are DeepSeek-V3's (576 = 512 + 64, one KV head, V a
view of K) at 16 and 128 query heads, small prefixes: ragged batches, an empty prefix, a prefix shorter than
a key tile, one and several slices per sequence (the verify kernel's merge), every tile of
:data:`splitkv.gluon_mla.TILES`, causal, all-visible and tree-masked drafts, token pools and pages of 16
and 64 (NaN in every row no prefix uses), fp8 e4m3 latent caches with scales, the LSE, slots outside the
pool, and a CUDA-graph replay.
Under compute-sanitizer (memcheck, racecheck) run them one process at a time.
"""

import pytest
import torch

from conftest import TOLERANCE, assert_close, assert_matches_reference
from splitkv import verify_attention
from splitkv.gluon_mla import TILES, decline_reason, gluon_mla_verify, unavailable_reason
from splitkv.testing import make_problem, paged_problem, reference_for, relative_error

WHY = unavailable_reason() if torch.cuda.is_available() else "no CUDA device"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(WHY is not None, reason=f"Gluon MLA kernel: {WHY}")]

D, DV = 576, 512
#: Ragged: a long prefix (several slices), an empty one, one shorter than a key tile, one not a whole tile.
PREFIXES = [3000, 0, 5, 1001]
EXTENDS = [4, 2, 1, 3]


def mla(heads, prefixes=PREFIXES, extends=EXTENDS, mask="causal", seed=0, **kwargs):
    """A bf16 MLA problem: one KV head, V pools views of K's first 512 columns."""
    p = make_problem(prefixes, extends, heads, 1, D, DV, dtype=torch.bfloat16, device="cuda", mask=mask,
                     seed=seed, **kwargs)
    return p.replace(v_buffer=p.k_buffer[..., :DV], v_extend=p.k_extend[..., :DV])


def run(p, out=None, **kwargs):
    out = p.new_output() if out is None else out
    return gluon_mla_verify(p.q_extend, p.k_extend, p.v_extend, out, p.k_buffer, p.v_buffer, p.qo_indptr,
                            p.kv_indptr, p.kv_indices, p.max_len_extend, custom_mask=p.custom_mask,
                            mask_indptr=p.mask_indptr, is_causal=p.is_causal, sm_scale=p.sm_scale,
                            k_scale=p.k_scale, v_scale=p.v_scale, **kwargs)


def run_paged(p, page_size, **kwargs):
    """``p`` with its prefixes in NaN-poisoned pages, the value pages a view of the key pages."""
    pp = paged_problem(p, page_size, seed=1)
    return run(p.replace(k_buffer=pp.k_pages, v_buffer=pp.k_pages[..., :DV], kv_indptr=pp.kv_indptr,
                         kv_indices=pp.kv_indices), kv_last_page_len=pp.kv_last_page_len, **kwargs)


@pytest.mark.parametrize("n_splits", [None, 1, 7])
@pytest.mark.parametrize("tile", TILES, ids=[f"{n}x{s}{'-overlap' if o else ''}" for n, s, o in TILES])
@pytest.mark.parametrize("heads", [16, 128])
def test_matches_oracle_and_the_tl_kernel(heads, tile, n_splits):
    p = mla(heads)
    assert decline_reason(*p.tensors(p.new_output())[:6], p.kv_indices) is None
    out = run(p, tile=tile, n_splits=n_splits)
    assert_matches_reference(out, p)
    tl_out = verify_attention(*p.tensors(p.new_output()), **p.options())
    assert relative_error(out, tl_out) < 2 * TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("heads", [16, 128])
def test_every_draft_visible(heads, overlap):
    p = mla(heads, mask="none", seed=1)
    assert_matches_reference(run(p, tile=(32, 3, overlap)), p)


@pytest.mark.parametrize("tile", [(32, 3, False), (64, 2, False), (32, 4, True)], ids=["32x3", "64x2", "32x4-overlap"])
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("heads", [16, 128])
def test_paged_pool(heads, page_size, tile):
    p = mla(heads, seed=6)
    assert_matches_reference(run_paged(p, page_size, tile=tile, n_splits=3), p)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("paged", [False, True], ids=["token", "pages-64"])
@pytest.mark.parametrize("heads", [16, 128])
def test_tree_mask(heads, paged, overlap):
    p = mla(heads, [700, 0, 1500], [6, 3, 8], mask="tree", seed=7)
    out = run_paged(p, 64, tile=(32, 3, overlap)) if paged else run(p, tile=(32, 3, overlap))
    assert_matches_reference(out, p)
    tl_out = verify_attention(*p.tensors(p.new_output()), **p.options())
    assert relative_error(out, tl_out) < 2 * TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("tile", [(32, 3, False), (32, 4, False), (64, 2, False)], ids=["32x3", "32x4", "64x2"])
@pytest.mark.parametrize("paged", [False, True], ids=["token", "pages-64"])
@pytest.mark.parametrize("heads", [16, 128])
def test_fp8_latent_cache(heads, paged, tile):
    """An e4m3 latent cache with its scale (values still a view of it), bf16 queries and drafts: widened to
    bf16 on chip, exactly; against the oracle on the same fp8 values and against the tl kernel."""
    p = mla(heads, seed=8, kv_dtype=torch.float8_e4m3fn, k_scale=0.7, v_scale=0.7)
    out = run_paged(p, 64, tile=tile, n_splits=3) if paged else run(p, tile=tile, n_splits=3)
    assert_matches_reference(out, p)
    tl_out = verify_attention(*p.tensors(p.new_output()), **p.options())
    assert relative_error(out, tl_out) < 2 * TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("n_splits", [1, 5])
def test_lse(n_splits):
    p = mla(16, seed=2)
    lse = torch.full((p.num_tokens, p.num_q_heads), float("nan"), device="cuda")
    out = run(p, lse=lse, n_splits=n_splits)
    ref_out, ref_lse = reference_for(p, return_lse=True)
    assert_close(out, ref_out, torch.bfloat16)
    assert torch.allclose(lse.double(), ref_lse.double().to(lse.device), atol=1e-2, rtol=1e-3)


@pytest.mark.parametrize("overlap", [False, True])
def test_long_prefix_many_slices(overlap):
    """DeepSeek-V3 at 128 heads, 4 drafts, 16k and 9k prefixes: several slices per sequence, 8 row blocks."""
    p = mla(128, [16384, 9000], [4, 4], seed=3, pool_factor=1.2)
    assert_matches_reference(run(p, tile=(32, 4, overlap)), p)


@pytest.mark.parametrize("overlap", [False, True])
def test_slots_outside_the_pool_are_absent(overlap):
    """A slot outside ``[0, pool_tokens)`` is never read: the key counts as absent (the oracle on the
    prefix without those keys)."""
    p = mla(16, [700], [4], seed=4, index_dtype=torch.int32)
    bad = torch.tensor([3, 64, 65, 400, 699], device="cuda")
    kvi = p.kv_indices.clone()
    kvi[bad[:3]] = -1
    kvi[bad[3:]] = p.k_buffer.shape[0] + 5
    keep = torch.ones(700, dtype=torch.bool, device="cuda")
    keep[bad] = False
    kept = p.replace(kv_indices=p.kv_indices[keep], prefix_lens=[700 - len(bad)],
                     kv_indptr=torch.tensor([0, 700 - len(bad)], device="cuda", dtype=p.kv_indptr.dtype))
    out = run(p.replace(kv_indices=kvi), n_splits=3, tile=(32, 3, overlap))
    assert_matches_reference(out, kept)


def test_cuda_graph_replay():
    """Nothing is read on the host: the call captures, and a replay on new queries gives their answer."""
    p = mla(16, [2048, 512], [4, 4], seed=5)
    out = p.new_output()
    run(p, out)  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(p, out)
    p.q_extend.copy_(torch.randn_like(p.q_extend))
    graph.replay()
    torch.cuda.synchronize()
    assert_matches_reference(out, p)
