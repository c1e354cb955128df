"""Context-parallel verify (splitkv.parallel): sharding, the cross-rank merge, real process groups.

* single process: the sharding helpers (a partition of every prefix, the
  mask re-laid for the local prefix length), the merge of shards in float64,
  and whole worlds simulated in one process with the kernel;
* two processes joined by gloo on 127.0.0.1 (CPU, Triton interpreter): one
  spawn runs every case (both shardings, empty shards, tree masks, sinks, the
  plan/run path and the one-call entry, ``dst``), the tests check its results;
* GPU (``gpu`` marker; needs 2 GPUs and a torchrun world of 2, else skipped)::

      torchrun --nproc_per_node 2 -m pytest -p no:cacheprovider tests/test_parallel.py -k gpu

  bf16 parity against the oracle at 64k-256k prefixes, and CUDA-graph capture
  and replay with the NCCL all-gather inside the graph.
"""

import os
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import numpy
import pytest
import torch

from conftest import CUDA, DEVICE, TOLERANCE
from splitkv import VerifySplitKV, verify_attention
from splitkv.parallel import (
    ContextParallelVerify,
    clear_cp_caches,
    cp_verify_attention,
    shard_last_page_len,
    shard_mask,
    shard_owner,
    shard_prefix,
)
from splitkv.parallel import api as cp_api
from splitkv.testing.parallel import (
    launch_local,
    run_cases,
    shard_paged_problem,
    shard_problem,
    simulate_context_parallel,
)
from splitkv.testing import make_problem, paged_problem, reference_for, relative_error
from splitkv.tuning import SMALL_BATCH_MAX_PREFIX

#: LSE budgets (absolute, natural log) against the float64 oracle.
LSE_TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
#: Worst single (token, head) row, relative: a sequence or rank merged wrongly fails here
#: even where the global norm would hide it (empty shards are short sequences).
ROW_TOL = {torch.float32: 5e-4, torch.float16: 5e-3, torch.bfloat16: 4e-2}


def assert_close(out, ref, dtype, what="output"):
    """Finite, and within the dtype's global and worst-row budgets against the oracle."""
    assert torch.isfinite(out).all(), f"{what} holds NaN/inf"
    err = relative_error(out, ref)
    assert err < TOLERANCE[dtype], f"{what}: relative error {err:.2e} exceeds {TOLERANCE[dtype]:.0e}"
    out64, ref64 = out.double(), ref.to(device=out.device, dtype=torch.float64)
    rows = torch.linalg.vector_norm(out64 - ref64, dim=-1) / torch.linalg.vector_norm(ref64, dim=-1)
    worst = rows.max().item()
    assert worst < ROW_TOL[dtype], f"{what}: worst row error {worst:.2e} exceeds {ROW_TOL[dtype]:.0e}"
    return err


def small(prefix_lens, extend_lens=4, dtype=torch.float16, **kw):
    """A small problem on the device the kernels run on (the interpreter's CPU, or the GPU)."""
    kw.setdefault("seed", 0)
    kw.setdefault("device", DEVICE)
    return make_problem(prefix_lens, extend_lens, kw.pop("num_q_heads", 4), kw.pop("num_kv_heads", 2),
                        kw.pop("head_dim", 32), dtype=dtype, **kw)


# ---- Sharding helpers ----------------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("mode,block", [("chunk", None), ("chunk", 8), ("round_robin", 1), ("round_robin", 16)])
def test_shard_prefix_is_a_partition(world, mode, block):
    lens = [0, 1, 7, 16, 17, 100, 333]
    p = small(lens, 1)
    kvp, kvi = p.kv_indptr, p.kv_indices
    owner_seen = {}
    for rank in range(world):
        sh = shard_prefix(kvp, kvi, world, rank, mode, block)
        assert sh.kv_indptr.dtype == torch.int32 and int(sh.kv_indptr[0]) == 0
        assert sh.kv_indices.numel() >= 1 and sh.kv_indices.dtype == kvi.dtype
        assert sh.prefix_lens.tolist() == (sh.kv_indptr[1:] - sh.kv_indptr[:-1]).tolist()
        for b, n in enumerate(lens):
            a, e = int(sh.kv_indptr[b]), int(sh.kv_indptr[b + 1])
            pos = sh.positions[a:e].tolist()
            assert pos == sorted(pos), "local keys stay in prefix order"
            # Each local entry is the global slot of its position.
            glob = kvi[int(kvp[b]):int(kvp[b + 1])]
            assert sh.kv_indices[a:e].tolist() == [int(glob[i]) for i in pos]
            for i in pos:
                assert (b, i) not in owner_seen, "a key on two ranks"
                owner_seen[(b, i)] = rank
            blk = block or (1 if mode == "chunk" else 256)
            if mode == "chunk" and pos:
                assert pos == list(range(pos[0], pos[-1] + 1)), "a chunk is contiguous"
                pages = -(-n // blk)
                assert pos[0] == min(n, (rank * pages // world) * blk)
            if mode == "round_robin":
                assert all((i // blk) % world == rank for i in pos)
    assert len(owner_seen) == sum(lens), "every key on exactly one rank"


def test_shard_prefix_empty_shard_is_padded():
    p = small([5, 0], 1)
    sh = shard_prefix(p.kv_indptr, p.kv_indices, 2, 1, "round_robin", 64)
    assert sh.kv_indptr.tolist() == [0, 0, 0] and sh.kv_indices.numel() == 1 and sh.positions.numel() == 0


def test_shard_prefix_indptr_not_starting_at_zero():
    p = small([30, 12], 1)
    kvi = torch.cat([torch.full((5,), -7, dtype=p.kv_indices.dtype, device=p.kv_indices.device), p.kv_indices])
    kvp = p.kv_indptr + 5
    for rank in range(2):
        a = shard_prefix(kvp, kvi, 2, rank, "chunk")
        b = shard_prefix(p.kv_indptr, p.kv_indices, 2, rank, "chunk")
        assert torch.equal(a.kv_indptr, b.kv_indptr) and torch.equal(a.kv_indices, b.kv_indices)


def test_shard_owner_formula():
    # chunk, P pages over W ranks: rank r holds pages [floor(r P / W), floor((r+1) P / W)).
    for n in range(0, 40):
        for world in (1, 2, 3, 5):
            for block in (1, 3, 8):
                pos = torch.arange(n)
                got = shard_owner(pos, torch.full_like(pos, n), world, "chunk", block).tolist()
                pages = -(-n // block)
                want = [next(r for r in range(world) if (r * pages) // world <= i // block < ((r + 1) * pages) // world)
                        for i in range(n)]
                assert got == want


def test_bad_shard_arguments():
    p = small([10], 1)
    with pytest.raises(ValueError, match="mode"):
        shard_prefix(p.kv_indptr, p.kv_indices, 2, 0, "zigzag")
    with pytest.raises(ValueError, match="block"):
        shard_prefix(p.kv_indptr, p.kv_indices, 2, 0, "chunk", 0)
    with pytest.raises(ValueError, match="rank"):
        shard_prefix(p.kv_indptr, p.kv_indices, 2, 2)


@pytest.mark.parametrize("mode,block", [("chunk", None), ("round_robin", 8)])
def test_shard_mask_keeps_the_local_columns(mode, block):
    p = small([0, 3, 40, 21], [3, 5, 2, 6], mask="tree", seed=3)
    qo, kvp, mp = p.qo_indptr.tolist(), p.kv_indptr.tolist(), p.mask_indptr.tolist()
    for rank in range(3):
        sh = shard_prefix(p.kv_indptr, p.kv_indices, 3, rank, mode, block)
        mask, mptr = shard_mask(p.custom_mask, p.mask_indptr, p.qo_indptr, p.kv_indptr, sh)
        assert mptr.dtype == torch.int64 and int(mptr[0]) == 0 and int(mptr[-1]) == mask.numel()
        for b in range(4):
            n_l, n_g, L = int(sh.prefix_lens[b]), kvp[b + 1] - kvp[b], qo[b + 1] - qo[b]
            glob = p.custom_mask[mp[b]: mp[b] + L * (n_g + L)].view(L, n_g + L)
            loc = mask[int(mptr[b]): int(mptr[b + 1])].view(L, n_l + L)
            pos = sh.positions[int(sh.kv_indptr[b]): int(sh.kv_indptr[b + 1])]
            # The draft block where the kernel reads it: after the *local* prefix.
            assert torch.equal(loc[:, n_l:], glob[:, n_g:])
            assert torch.equal(loc[:, :n_l], glob[:, pos])


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("mode,block", [("chunk", None), ("round_robin", 2)])
@pytest.mark.parametrize("page_size", [5, 16])
def test_paged_shards_hold_every_key_once(page_size, mode, block, world):
    """Whole pages dealt out: local last-page lengths add up to every prefix, and the
    mask re-laid in keys keeps, per row, the global columns of the keys the rank holds."""
    p = small([0, 3, 40, 21, 16], [3, 5, 2, 6, 2], mask="tree", seed=3)
    pp = paged_problem(p, page_size, seed=2)
    qo, mp = p.qo_indptr.tolist(), p.mask_indptr.tolist()
    held = torch.zeros(p.batch_size, dtype=torch.int64)
    for rank in range(world):
        sh = shard_prefix(pp.kv_indptr, pp.kv_indices, world, rank, mode, block)
        last = shard_last_page_len(sh, pp.kv_indptr, pp.kv_last_page_len, page_size)
        mask, mptr = shard_mask(p.custom_mask, p.mask_indptr, p.qo_indptr, pp.kv_indptr, sh,
                                page_size=page_size, kv_last_page_len=pp.kv_last_page_len)
        for b in range(p.batch_size):
            pages = sh.positions[int(sh.kv_indptr[b]): int(sh.kv_indptr[b + 1])].tolist()
            n_glob, n_pages = p.prefix_lens[b], -(-p.prefix_lens[b] // page_size)
            keys = [q * page_size + i for q in pages for i in range(page_size) if q * page_size + i < n_glob]
            n_loc = 0 if not pages else (len(pages) - 1) * page_size + int(last[b])
            assert n_loc == len(keys), (rank, b)
            want = int(pp.kv_last_page_len[b]) if n_pages - 1 in pages else page_size if pages else 0
            assert int(last[b]) == want, (rank, b)
            held[b] += n_loc
            L = qo[b + 1] - qo[b]
            glob = p.custom_mask[mp[b]: mp[b] + L * (n_glob + L)].view(L, n_glob + L)
            loc = mask[int(mptr[b]): int(mptr[b + 1])].view(L, n_loc + L)
            assert torch.equal(loc[:, n_loc:], glob[:, n_glob:])
            assert torch.equal(loc[:, :n_loc], glob[:, keys])
    assert held.tolist() == p.prefix_lens


def test_the_global_mask_is_wrong_for_a_shard():
    """Why shard_mask exists: the kernel offsets mask rows by the local prefix length."""
    p = small([60, 45], [6, 5], dtype=torch.float32, mask="tree", seed=4)
    lp = shard_problem(p, 2, 1, "chunk")
    runner = VerifySplitKV(4, 2, 32, 32, 6, 2, DEVICE)
    ref = reference_for(lp)  # the local keys and the drafts, under the tree
    good = runner(*lp.args(lp.new_output())[:9], custom_mask=lp.custom_mask, mask_indptr=lp.mask_indptr,
                  is_causal=True, sm_scale=lp.sm_scale)
    assert_close(good, ref, torch.float32)
    bad = runner(*lp.args(lp.new_output())[:9], custom_mask=p.custom_mask, mask_indptr=p.mask_indptr,
                 is_causal=True, sm_scale=lp.sm_scale)
    assert relative_error(bad, ref) > 1e-2


# ---- The merge of shards, in one process ---------------------------------------------------------


def _prefix_only_state(lp, attend_draft, sinks):
    """Float64 (o, lse) of a shard: its prefix keys, plus the drafts and sinks only if attend_draft."""
    if attend_draft:
        o, s = reference_for(lp, return_lse=True, sinks=sinks)
    else:
        L = lp.extend_lens
        dev = lp.q_extend.device
        blocks = [torch.cat([torch.ones(l, n, dtype=torch.bool, device=dev),
                             torch.zeros(l, l, dtype=torch.bool, device=dev)], 1).flatten()
                  for n, l in zip(lp.prefix_lens, L)]
        mptr = torch.zeros(len(blocks) + 1, dtype=torch.int64, device=dev)
        mptr[1:] = torch.cumsum(torch.tensor([x.numel() for x in blocks], device=dev), 0)
        o, s = reference_for(lp, return_lse=True, custom_mask=torch.cat(blocks), mask_indptr=mptr, sinks=None)
    empty = torch.isinf(s) | torch.isnan(s)
    return torch.where(empty[..., None], 0.0, o), torch.where(empty, float("-inf"), s)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("mode,block", [("chunk", None), ("round_robin", 8)])
def test_merge_of_shards_is_exact_in_float64(world, mode, block):
    p = small([0, 1, 50, 37], [3, 2, 5, 4], dtype=torch.float32, mask="tree", sinks=True, seed=5)
    ref_o, ref_s = reference_for(p, return_lse=True)
    draft_rank = world - 1
    states = [_prefix_only_state(shard_problem(p, world, r, mode, block), r == draft_rank,
                                 p.sinks if r == draft_rank else None) for r in range(world)]
    o = torch.stack([x[0] for x in states])  # [W, tokens, H, Dv]
    s = torch.stack([x[1] for x in states])  # [W, tokens, H]
    lse = torch.logsumexp(s, 0)
    merged = (torch.exp(s - lse)[..., None] * o).sum(0)
    assert (merged - ref_o).abs().max().item() < 1e-10
    assert (lse - ref_s).abs().max().item() < 1e-10


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("world,mode,block,draft_rank", [
    (1, "chunk", None, 0), (2, "chunk", None, 0), (2, "round_robin", 16, 1), (3, "chunk", 16, 2),
])
def test_simulated_world_matches_oracle(dtype, world, mode, block, draft_rank):
    p = small([0, 1, 70, 130], [3, 2, 5, 4], dtype=dtype, mask="tree", sinks=True, seed=6)
    ref_o, ref_s = reference_for(p, return_lse=True)
    out, lse, o_parts, s_parts = simulate_context_parallel(p, world, mode, block, draft_rank=draft_rank,
                                                           n_splits=2, return_partials=True)
    assert o_parts.shape[1] == world
    assert_close(out, ref_o, dtype)
    assert (lse.double() - ref_s).abs().max().item() < LSE_TOL[dtype]
    # Sequence 0 has no prefix: every rank but the draft rank holds the empty state.
    rows = slice(0, 3)
    for r in range(world):
        assert torch.isinf(s_parts[rows, r]).all() == (r != draft_rank)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("page_size,world,mode,block", [
    (5, 2, "chunk", None), (16, 3, "chunk", None), (16, 2, "round_robin", 2), (4, 3, "round_robin", 1),
])
def test_simulated_paged_world_with_logit_cap_matches_oracle(dtype, page_size, world, mode, block):
    """Paged local pools (whole pages per rank, NaN in every unused page row) and a logit cap,
    with a tree mask, sinks and several slices per shard: the merged world is the oracle."""
    p = small([0, 1, 70, 130, 33], [3, 2, 5, 4, 1], dtype=dtype, mask="tree", sinks=True, seed=8)
    cap = 3.0
    ref_o, ref_s = reference_for(p, return_lse=True, logit_cap=cap)
    out, lse = simulate_context_parallel(p, world, mode, block, draft_rank=world - 1, n_splits=2,
                                         page_size=page_size, logit_cap=cap)
    assert_close(out, ref_o, dtype)
    assert (lse.double() - ref_s).abs().max().item() < LSE_TOL[dtype]
    assert relative_error(out, reference_for(p)) > 10 * TOLERANCE[dtype]  # the cap changed the answer


def test_world_of_one_paged_with_logit_cap():
    """The production entries take a paged local pool and a logit cap; the one-call entry
    rebinds its cached plan to the next step's page table."""
    p = small([90, 5, 0], [4, 3, 2], dtype=torch.float32, mask="tree", sinks=True, seed=9)
    pp = paged_problem(p, 16, seed=3)
    cap = 4.0
    cp = ContextParallelVerify(4, 2, 32, 32, 4, 3, DEVICE, n_splits=3)
    plan = cp.plan(p.q_extend, p.k_extend, p.v_extend, pp.k_pages, pp.v_pages, p.qo_indptr, pp.kv_indptr,
                   pp.kv_indices, custom_mask=p.custom_mask, mask_indptr=p.mask_indptr, is_causal=p.is_causal,
                   sm_scale=p.sm_scale, sinks=p.sinks, logit_cap=cap, kv_last_page_len=pp.kv_last_page_len,
                   check=True)
    out = plan.run(p.q_extend, p.k_extend, p.v_extend, pp.k_pages, pp.v_pages)
    assert_close(out, reference_for(p, logit_cap=cap), torch.float32)
    for seed in (3, 4):  # the second call reuses the cached plan with another page table
        pp = paged_problem(p, 16, seed=seed)
        got = cp_verify_attention(*pp.tensors(p.new_output()), **pp.options(), logit_cap=cap, check=True)
        assert_close(got, reference_for(p, logit_cap=cap), torch.float32)


def test_shard_paged_problem_is_a_paged_problem():
    """shard_paged_problem's local problem runs through the plain split path too."""
    p = small([50, 17], [2, 3], dtype=torch.float32, mask="chain", seed=10)
    pp = paged_problem(p, 8, seed=1)
    local = shard_paged_problem(pp, 2, 1, "chunk")
    assert local.problem.prefix_lens == [50 - 24, 17 - 8]  # pages [3, 7) and [1, 3) of 7 and 3
    out = verify_attention(*local.tensors(local.problem.new_output()), **local.options())
    assert_close(out, reference_for(local.problem.replace(k_buffer=p.k_buffer, v_buffer=p.v_buffer,
                                                          kv_indptr=_token_indptr(p, local.problem.prefix_lens),
                                                          kv_indices=_tail_slots(p, local.problem.prefix_lens))),
                 torch.float32)


def _token_indptr(p, lens):
    indptr = torch.zeros(len(lens) + 1, dtype=p.kv_indptr.dtype, device=p.kv_indptr.device)
    indptr[1:] = torch.cumsum(torch.tensor(lens, device=indptr.device), 0)
    return indptr


def _tail_slots(p, lens):
    """The token-pool slots of the last ``lens[b]`` keys of each sequence (rank 1's chunk)."""
    kvp = p.kv_indptr.tolist()
    return torch.cat([p.kv_indices[kvp[b + 1] - n: kvp[b + 1]] for b, n in enumerate(lens)])


def test_world_of_one_without_distributed():
    p = small([90, 5], [4, 3], dtype=torch.float32, mask="chain", sinks=True, seed=7)
    cp = ContextParallelVerify(4, 2, 32, 32, 4, 2, DEVICE)
    assert (cp.rank, cp.world_size, cp.merges, cp.owns_draft) == (0, 1, True, True)
    plan = cp.plan(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, p.qo_indptr, p.kv_indptr,
                   p.kv_indices, custom_mask=p.custom_mask, mask_indptr=p.mask_indptr, is_causal=p.is_causal,
                   sm_scale=p.sm_scale, sinks=p.sinks, return_lse=True)
    lse = torch.empty(plan.out_shape[:2], dtype=torch.float32, device=DEVICE)
    out = plan.run(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, lse=lse)
    want, want_lse = verify_attention(*p.tensors(p.new_output()), **p.options(), return_lse=True)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)  # the plain split path, same kernel
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-6)
    got = cp_verify_attention(*p.tensors(p.new_output()), **p.options())
    assert_close(got, reference_for(p), torch.float32)


def _cached_plans():
    """This thread's cached one-call plans, least recently used first: ``[(key, plan)]``."""
    return list(cp_api._CACHES.plans.items())


def test_cp_plan_cache_is_per_thread():
    """A plan holds bound metadata and exchange buffers: one thread's is never returned in another."""
    clear_cp_caches()
    p = small([40, 7], [3, 2], dtype=torch.float32, seed=11)
    want = cp_verify_attention(*p.tensors(p.new_output()), **p.options())
    (mine,) = _cached_plans()

    def other_thread():
        out = cp_verify_attention(*p.tensors(p.new_output()), **p.options())
        plans = _cached_plans()
        clear_cp_caches()  # this thread's cache only
        return out, plans

    with ThreadPoolExecutor(1) as pool:
        out, (theirs,) = pool.submit(other_thread).result()
    assert theirs[0] == mine[0] and theirs[1] is not mine[1]  # same signature, its own plan
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    cp_verify_attention(*p.tensors(p.new_output()), **p.options())
    assert [plan for _, plan in _cached_plans()] == [mine[1]]  # this thread's plan survived the other's clear
    clear_cp_caches()


def test_cp_plan_cache_keys_on_the_small_batch_bit():
    """Calls on either side of SMALL_BATCH_MAX_PREFIX (the mean prefix fixes the plan's tile) get two plans.

    The mean prefix is counted as the plan counts it, in ``kv_indices`` entries
    times page rows: with pages of ``2 * SMALL_BATCH_MAX_PREFIX`` rows holding
    one key each, two sequences with one page between them are below it and two
    with a page each above, at two keys' cost under the interpreter.
    """
    clear_cp_caches()
    page = 2 * SMALL_BATCH_MAX_PREFIX
    keys = []
    for lens in ([1, 0], [1, 1], [1, 0]):
        p = small(lens, 2, dtype=torch.float32, seed=12)
        pp = paged_problem(p, page, seed=1, spare_pages=3 - sum(lens))  # pools of one shape: 3 pages
        got = cp_verify_attention(*pp.tensors(p.new_output()), **pp.options())
        assert_close(got, reference_for(p), torch.float32)
        keys.append(_cached_plans()[-1][0])  # the plan just used is the most recent
    assert keys[0] != keys[1] and keys[2] == keys[0]
    assert sum(a != b for a, b in zip(keys[0], keys[1])) == 1  # the signatures differ in that bit only
    assert len(_cached_plans()) == 2
    clear_cp_caches()


def test_bad_runner_arguments():
    with pytest.raises(ValueError, match="draft_rank"):
        ContextParallelVerify(4, 2, 32, 32, 4, 2, DEVICE, draft_rank=1)
    with pytest.raises(ValueError, match="dst"):
        ContextParallelVerify(4, 2, 32, 32, 4, 2, DEVICE, dst=[0, 3])


@pytest.mark.skipif(CUDA, reason="the Triton interpreter's refusal; a GPU runs bfloat16")
def test_the_interpreter_refuses_bfloat16():
    """Its bf16 tl.dot is wrong (triton-lang/triton#11584), so the plan refuses bf16 on the CPU."""
    p = small([10], 4, dtype=torch.bfloat16, device="cpu")
    cp = ContextParallelVerify(4, 2, 32, 32, 4, 1, "cpu")
    with pytest.raises(NotImplementedError, match="bfloat16"):
        cp.plan(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, p.qo_indptr, p.kv_indptr,
                p.kv_indices)


# ---- Two processes, gloo -------------------------------------------------------------------------

HEADS = dict(num_q_heads=4, num_kv_heads=2, head_dim=32)
#: The gloo worlds' processes run CPU tensors through the interpreter, whatever the machine.
INTERPRET = {"TRITON_INTERPRET": "1"}
#: That interpreter needs NumPy < 2.4 (the ``interpreter`` extra); a GPU machine may have a newer one.
gloo_world = pytest.mark.skipif(
    CUDA and tuple(int(x) for x in numpy.__version__.split(".")[:2]) >= (2, 4),
    reason="the gloo world runs the Triton interpreter, which needs NumPy < 2.4 (pip install -e .[interpreter])")
CASES = {
    # name: (case for run_cases, ranks expected to merge)
    "chunk_fp16_causal": dict(problem=dict(prefix_lens=[300, 57], extend_lens=4, dtype=torch.float16, seed=10,
                                           **HEADS)),
    "round_robin_fp32_tree_sinks_empty_shards": dict(
        problem=dict(prefix_lens=[0, 1, 40, 130], extend_lens=[3, 2, 5, 4], dtype=torch.float32, mask="tree",
                     sinks=True, seed=11, **HEADS),
        mode="round_robin", block=16, draft_rank=1),
    "chunk_pages_tree_fp16_forced_splits": dict(
        problem=dict(prefix_lens=[200, 90], extend_lens=[5, 7], dtype=torch.float16, mask="tree", seed=12,
                     **HEADS),
        mode="chunk", block=32, n_splits=3),
    "function_entry_dst1_chain": dict(
        problem=dict(prefix_lens=[70, 9], extend_lens=4, dtype=torch.float16, mask="chain", seed=13, **HEADS),
        entry="function", dst=1),
    "rank1_holds_nothing": dict(
        problem=dict(prefix_lens=[100, 3, 0], extend_lens=[4, 2, 3], dtype=torch.float32, sinks=True, seed=14,
                     **HEADS),
        mode="round_robin", block=256, draft_rank=0),
    "fp32_partials_fp16_io": dict(
        problem=dict(prefix_lens=[150], extend_lens=6, dtype=torch.float16, mask="tree", seed=15, **HEADS),
        partial_dtype=torch.float32, draft_rank=1),
}


@pytest.fixture(scope="module")
def gloo_results():
    """Every case run once by a world of two spawned processes (gloo, 127.0.0.1; CPU tensors through the
    interpreter, on a machine with a GPU too)."""
    results = launch_local(run_cases, 2, list(CASES.values()), timeout_s=300, env=INTERPRET)
    return {name: [results[r][i] for r in range(2)] for i, name in enumerate(CASES)}


@gloo_world
@pytest.mark.parametrize("name", list(CASES))
def test_two_process_gloo(gloo_results, name):
    case = CASES[name]
    p = make_problem(**case["problem"])
    ref_o, ref_s = reference_for(p, return_lse=True)
    dst = case.get("dst")
    merging = [0, 1] if dst is None else [dst]
    by_rank = gloo_results[name]
    # The shards partition every prefix.
    assert [sum(x) for x in zip(*(r["local_prefix_lens"] for r in by_rank))] == p.prefix_lens
    for rank, res in enumerate(by_rank):
        if rank not in merging:
            assert res["out"] is None and res["lse"] is None
            continue
        assert_close(res["out"], ref_o, p.q_extend.dtype, f"rank {rank}")
        assert (res["lse"].double() - ref_s).abs().max().item() < LSE_TOL[p.q_extend.dtype]
    if len(merging) == 2:  # both ranks merged the same gathered states: bitwise equal
        assert torch.equal(by_rank[0]["out"], by_rank[1]["out"])
        assert torch.equal(by_rank[0]["lse"], by_rank[1]["lse"])


def test_launch_local_reports_a_failing_rank():
    bad = dict(problem=dict(prefix_lens=[10], dtype=torch.float32, seed=0, **HEADS), mode="zigzag")
    with pytest.raises(RuntimeError, match="unknown shard mode"):
        launch_local(run_cases, 1, [bad], timeout_s=120, env=INTERPRET)  # one process is enough to see it


@gloo_world
def test_two_process_gloo_empty_state(gloo_results):
    """A rank holding no key (and not the drafts) contributes s = -inf everywhere."""
    rank1 = gloo_results["rank1_holds_nothing"][1]
    assert rank1["local_prefix_lens"] == [0, 0, 0]
    assert torch.isinf(rank1["part_lse"][:9]).all() and (rank1["part_lse"][:9] < 0).all()


# ---- GPU: a torchrun world of two ----------------------------------------------------------------


def _torchrun_pair() -> bool:
    return (CUDA and torch.cuda.device_count() >= 2 and os.environ.get("WORLD_SIZE") == "2"
            and "RANK" in os.environ and "LOCAL_RANK" in os.environ)


needs_two_gpus = pytest.mark.skipif(
    not _torchrun_pair(), reason="needs 2 GPUs under `torchrun --nproc_per_node 2`")


@pytest.fixture(scope="module")
def nccl():
    """The NCCL world of the torchrun processes (rank, world)."""
    import torch.distributed as dist

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if not dist.is_initialized():
        dist.init_process_group("nccl", timeout=timedelta(seconds=300))
    yield dist.get_rank(), dist.get_world_size()
    dist.barrier()
    dist.destroy_process_group()


def _agree(ok: bool, msg: str) -> None:
    """Fail on every rank if any rank failed (no rank is left waiting in a collective)."""
    import torch.distributed as dist

    flag = torch.tensor([0 if ok else 1], device="cuda")
    dist.all_reduce(flag)
    assert ok, msg
    assert int(flag) == 0, "another rank failed (see its output)"


def _merged_matches(out, lse, problem, rank, **features):
    """``(ok, message)``: a rank's merged bf16 output and LSE against the float64 oracle of the
    whole (unsharded) problem; a failure is returned, not raised, for :func:`_agree`."""
    ref_o, ref_s = reference_for(problem, return_lse=True, **features)
    try:
        err = assert_close(out, ref_o, torch.bfloat16, f"rank {rank}")
    except AssertionError as failure:
        return False, str(failure)
    lse_err = (lse.double() - ref_s).abs().max().item()
    return lse_err < LSE_TOL[torch.bfloat16], f"rank {rank}: relative error {err:.2e}, LSE error {lse_err:.2e}"


GPU_CASES = {
    "qwen3-next 256k chunk tree sinks": dict(shape=(16, 2, 256), prefix_lens=[262144], extend_lens=6, mask="tree",
                                             sinks=True, mode="chunk"),
    "llama3-8b 64k+128k+0+7 round_robin": dict(shape=(32, 8, 128), prefix_lens=[65536, 131072, 0, 7],
                                               extend_lens=4, mode="round_robin", block=256),
    "qwen3-32b 128k+64k chunk pages chain draft1 dst0": dict(shape=(64, 8, 128), prefix_lens=[131072, 65536],
                                                             extend_lens=5, mask="chain", mode="chunk", block=64,
                                                             draft_rank=1, dst=0),
    "llama3-8b 200k fp32 partials": dict(shape=(32, 8, 128), prefix_lens=[200000], extend_lens=8, mask="tree",
                                         mode="round_robin", block=1024, partial_dtype=torch.float32),
}


def _gpu_problem(case, seed, dtype=torch.bfloat16):
    h_q, h_kv, d = case["shape"]
    return make_problem(case["prefix_lens"], case["extend_lens"], h_q, h_kv, d, dtype=dtype, device="cuda",
                        mask=case.get("mask", "causal"), sinks=case.get("sinks", False), pool_factor=1.0,
                        seed=seed)


@pytest.mark.parametrize("name", list(GPU_CASES))
@pytest.mark.gpu
@needs_two_gpus
def test_gpu_bf16_parity_long_prefixes(nccl, name):
    rank, world = nccl
    case = GPU_CASES[name]
    p = _gpu_problem(case, seed=20)
    lp = shard_problem(p, world, rank, case["mode"], case.get("block"))
    dst = case.get("dst")
    cp = ContextParallelVerify(p.num_q_heads, p.num_kv_heads, p.head_dim, p.v_head_dim, p.max_len_extend,
                               p.batch_size, "cuda", draft_rank=case.get("draft_rank", 0), dst=dst,
                               partial_dtype=case.get("partial_dtype"))
    plan = cp.plan(lp.q_extend, lp.k_extend, lp.v_extend, lp.k_buffer, lp.v_buffer, lp.qo_indptr, lp.kv_indptr,
                   lp.kv_indices, custom_mask=lp.custom_mask, mask_indptr=lp.mask_indptr, is_causal=lp.is_causal,
                   sm_scale=lp.sm_scale, sinks=lp.sinks, return_lse=True, check=True)
    lse = torch.empty(plan.out_shape[:2], dtype=torch.float32, device="cuda") if plan.merges else None
    res = plan.run(lp.q_extend, lp.k_extend, lp.v_extend, lp.k_buffer, lp.v_buffer, out=lp.new_output(), lse=lse)
    torch.cuda.synchronize()
    del lp
    if plan.merges:
        ok, msg = _merged_matches(res, lse, p, rank)
        print(msg)
    else:
        ok, msg = res is None, f"rank {rank} does not merge but returned {type(res)}"
    _agree(ok, msg)


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("entry", ["plan", "function"])
def test_gpu_graph_capture_and_replay(nccl, entry):
    """Capture kernel + all-gather + merge in one CUDA graph; replay on fresh data in the same buffers."""
    rank, world = nccl
    case = dict(shape=(32, 8, 128), prefix_lens=[65536, 30000, 5, 100000], extend_lens=4, mask="tree")
    p = _gpu_problem(case, seed=30)
    lp = shard_problem(p, world, rank, "chunk")
    out = lp.new_output()
    if entry == "plan":
        cp = ContextParallelVerify(p.num_q_heads, p.num_kv_heads, p.head_dim, p.v_head_dim, p.max_len_extend,
                                   p.batch_size, "cuda")
        plan = cp.plan(lp.q_extend, lp.k_extend, lp.v_extend, lp.k_buffer, lp.v_buffer, lp.qo_indptr,
                       lp.kv_indptr, lp.kv_indices, custom_mask=lp.custom_mask, mask_indptr=lp.mask_indptr,
                       is_causal=lp.is_causal, sm_scale=lp.sm_scale)

        def step():
            plan.run(lp.q_extend, lp.k_extend, lp.v_extend, lp.k_buffer, lp.v_buffer, out=out)
    else:
        def step():
            cp_verify_attention(*lp.tensors(out), **lp.options(), max_bs=8)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: compiles, creates the NCCL communicator, plans
        step()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    import torch.distributed as dist

    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    errors = []
    for seed in (31, 32, 33):
        fresh = _gpu_problem(case, seed=seed)
        lf = shard_problem(fresh, world, rank, "chunk")
        for name in ("q_extend", "k_extend", "v_extend", "k_buffer", "v_buffer", "kv_indices", "custom_mask"):
            getattr(lp, name).copy_(getattr(lf, name))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        try:
            errors.append(assert_close(out, reference_for(fresh), torch.bfloat16, f"replay, seed {seed}"))
        except AssertionError as failure:
            errors.append(str(failure))
        del fresh, lf
    msg = f"rank {rank} ({entry}): replay errors {errors}"
    print(msg)
    _agree(all(isinstance(e, float) for e in errors), msg)


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("page_size,mode,block", [(16, "chunk", None), (64, "round_robin", 32)])
def test_gpu_paged_pool_with_logit_cap(nccl, page_size, mode, block):
    """Paged local pools (whole pages per rank) and a logit cap across two GPUs, bf16, long prefixes."""
    rank, world = nccl
    p = make_problem([131072, 54321, 97], 5, 16, 2, 256, dtype=torch.bfloat16, device="cuda", mask="tree",
                     sinks=True, pool_factor=1.0, seed=40)
    pp = paged_problem(p, page_size, seed=41)
    local = shard_paged_problem(pp, world, rank, mode, block)
    lp = local.problem
    cap = 30.0
    cp = ContextParallelVerify(p.num_q_heads, p.num_kv_heads, p.head_dim, p.v_head_dim, p.max_len_extend,
                               p.batch_size, "cuda")
    plan = cp.plan(lp.q_extend, lp.k_extend, lp.v_extend, local.k_pages, local.v_pages, lp.qo_indptr,
                   local.kv_indptr, local.kv_indices, custom_mask=lp.custom_mask, mask_indptr=lp.mask_indptr,
                   is_causal=lp.is_causal, sm_scale=lp.sm_scale, sinks=lp.sinks, logit_cap=cap,
                   kv_last_page_len=local.kv_last_page_len, return_lse=True, check=True)
    lse = torch.empty(plan.out_shape[:2], dtype=torch.float32, device="cuda")
    out = plan.run(lp.q_extend, lp.k_extend, lp.v_extend, local.k_pages, local.v_pages,
                   out=torch.full_like(lp.new_output(), float("nan")), lse=lse)
    torch.cuda.synchronize()
    ok, msg = _merged_matches(out, lse, p, rank, logit_cap=cap)
    print(msg)
    _agree(ok, msg)
