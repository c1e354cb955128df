"""splitkv.teaching.occupancy: the plain-Python mirror of the kernels' work split.

Two kinds of checks:

* the rules on hand-worked examples (golden values computed from the kernel's
  documented formulas, not from the functions under test);
* the mirror against the REAL kernel: a launch with a caller-owned workspace
  whose partials are poisoned with NaN shows which (tile, slice) programs
  published a partial, and the float64 attention over the keys the mirror
  assigns to each slice must equal what that program wrote.
"""

import math

import pytest
import torch

from conftest import (
    DEVICE,
    MIN_SPLIT,
    all_counters_zero,
    assert_matches_reference,
    partials_views,
    poisoned_workspace_runner,
    scratch_views,
)
from splitkv import VerifySplitKV
from splitkv import workspace
from splitkv.schedule import LAST_PROGRAM, MERGE_PROGRAMS, SEPARATE_MERGE, block_m_for
from splitkv.teaching.occupancy import (
    cdiv,
    extend_programs,
    merge_mode,
    merge_programs,
    head_tiles,
    min_split_for,
    n_used,
    gpu_launch,
    prefix_bytes_read,
    schedule,
    scratch_bytes,
    split_keys,
    split_len,
    split_ranges,
    verify_programs,
    waves,
)
from splitkv.testing import make_problem

LOG2E = 1.0 / math.log(2.0)


# --- the slicing rule ----------------------------------------------------------

@pytest.mark.parametrize("prefix", [0, 1, 15, 16, 17, 100, 255, 4096, 5000])
@pytest.mark.parametrize("n_splits", [1, 2, 3, 8])
@pytest.mark.parametrize("block_n,min_split", [(16, 0), (16, 32), (64, 128)])
def test_split_ranges_partition_the_prefix(prefix, n_splits, block_n, min_split):
    ranges = split_ranges(prefix, n_splits, block_n, min_split)
    used = n_used(prefix, n_splits, block_n, min_split)
    step = split_len(prefix, n_splits, block_n, min_split)
    assert len(ranges) == n_splits and 1 <= used <= n_splits
    assert step % block_n == 0 and step >= min_split
    pos = 0
    for s, (lo, hi) in enumerate(ranges[:used]):
        assert lo == pos == s * step and lo <= hi  # contiguous, in order, on key tiles
        assert hi - lo == step or s == used - 1  # only the last used slice is short
        assert hi > lo or prefix == 0
        pos = hi
    assert pos == prefix
    assert all(r == (prefix, prefix) for r in ranges[used:])  # programs that exit


def test_split_rule_worked_examples():
    # 300 keys, 8 slices of 64-key tiles, no minimum: cdiv(300, 8) = 38 -> 64 keys a
    # slice, cdiv(300, 64) = 5 used, 3 programs exit.
    assert split_keys([300], 8, 64, 0) == [[64, 64, 64, 64, 44, 0, 0, 0]]
    # The same with min_split 128: max(64, 128) = 128 -> cdiv(300, 128) = 3 used.
    assert split_keys([300], 8, 64, 128) == [[128, 128, 44, 0, 0, 0, 0, 0]]
    # A short prefix in a ragged batch is not over-split: 40 keys, 8 slices,
    # min_split 32 -> max(roundup(5, 16), 32) = 32 -> 2 used.
    assert split_keys([40], 8, 16, 32) == [[32, 8, 0, 0, 0, 0, 0, 0]]
    # Empty prefix: one used slice (it does the draft block), no keys.
    assert n_used(0, 3, 16, 32) == 1 and split_keys([0], 3, 16, 32) == [[0, 0, 0]]
    # Fixed slices: 128 keys whatever n_splits (batch-invariant).
    assert split_keys([300], 8, 16, split_tokens=128) == [[128, 128, 44, 0, 0, 0, 0, 0]]
    assert split_keys([300], 3, 64, 0, split_tokens=128) == [[128, 128, 44]]
    # Fixed slices in a grid too small for them (the host never plans this): 520 keys
    # need 5 slices of 128 but the grid has 4, so the kernel falls back to
    # roundup(cdiv(520, 4), 128) = 256 and uses all 4 (the last has no prefix key).
    assert split_keys([520], 4, 128, split_tokens=128) == [[256, 256, 8, 0]]
    assert n_used(520, 4, 128, split_tokens=128) == 4


def test_min_split_for():
    assert min_split_for(16, 32) == 32
    assert min_split_for(64, 100) == 128
    assert min_split_for(128, 0) == 0
    from splitkv.tuning import TUNED

    assert min_split_for(16) == cdiv(TUNED["min_split_tokens"], 16) * 16  # the GPU's, by default


@pytest.mark.parametrize(
    "args,expected",
    [
        # (H_Q, H_KV, L, BLOCK_M, pack) -> KV heads x cdiv(GROUP x L, BLOCK_M), or H_Q x cdiv(L, BLOCK_M)
        ((4, 2, 4, 16, True), 2 * 1),  # GROUP 2 x 4 = 8 rows, one block
        ((16, 2, 4, 16, True), 2 * 2),  # 8 x 4 = 32 rows in 16-row blocks
        ((64, 8, 8, 64, True), 8 * 1),  # 8 x 8 = 64 rows
        ((16, 1, 7, 64, True), 1 * 2),  # 16 x 7 = 112 rows
        ((64, 8, 8, 16, False), 64 * 1),  # one query head a tile, 8 rows
        ((4, 4, 20, 16, False), 4 * 2),
    ],
)
def test_head_tiles_worked_examples(args, expected):
    assert head_tiles(*args) == expected


# --- programs of a launch --------------------------------------------------------

@pytest.mark.parametrize("pack_gqa", [True, False])
@pytest.mark.parametrize("min_split", [0, 32])
def test_verify_programs_cover_every_key_once_per_tile(pack_gqa, min_split):
    prefix, ext, hq, hkv, n_splits = [300, 0, 77, 20], [4, 2, 3, 1], 8, 2, 5
    progs = verify_programs(prefix, ext, hq, hkv, n_splits, block_m=16, block_n=16, pack_gqa=pack_gqa,
                            min_split=min_split)
    tiles = head_tiles(hq, hkv, max(ext), 16, pack_gqa)
    assert len(progs) == len(prefix) * tiles * n_splits
    assert [p.index for p in progs] == list(range(len(progs)))
    # program_id(0) (the tile) varies fastest: the first batch x tiles programs are slice 0.
    assert {p.split for p in progs[: len(prefix) * tiles]} == {0}
    for b, p_len in enumerate(prefix):
        used = n_used(p_len, n_splits, 16, min_split)
        live = {(p.head_tile, p.m_block) for p in progs if p.seq == b and p.rows > 0}
        assert live
        for tile, m in live:
            mine = [p for p in progs if (p.seq, p.head_tile, p.m_block) == (b, tile, m)]
            assert sum(p.prefix_keys for p in mine) == p_len
            assert [p.split for p in mine if p.draft_keys] == [used - 1]  # the draft block, once
            assert [p.draft_keys for p in mine if p.draft_keys] == [ext[b]]
            assert all(p.rows == 0 and p.keys == 0 for p in mine if p.split >= used)  # exit at once
            assert all(p.writes_partial == (used > 1) for p in mine if p.rows)
    group = hq // hkv
    packed = prefix_bytes_read(
        verify_programs(prefix, ext, hq, hkv, n_splits, block_m=16, block_n=16, min_split=min_split), 64, 64, 2
    )
    assert packed == sum(prefix) * hkv * 128 * 2  # each KV byte read once
    if not pack_gqa:
        assert prefix_bytes_read(progs, 64, 64, 2) == group * packed


def test_prefix_only_launch_has_no_draft_keys():
    progs = verify_programs([100, 0], [3, 2], 4, 2, 3, block_m=16, block_n=16, min_split=32, attend_draft=False)
    assert all(p.draft_keys == 0 for p in progs)
    assert sum(p.prefix_keys for p in progs) == 100 * 2


def test_row_blocks_past_the_drafts_do_nothing():
    # GROUP 8 x 4 drafts = 32 rows in 16-row blocks: 2 live blocks; 1 draft -> 1.
    progs = verify_programs([64, 64], [4, 1], 8, 1, 2, block_m=16, block_n=16, min_split=32)
    live = sorted({(p.seq, p.m_block) for p in progs if p.rows > 0})
    assert live == [(0, 0), (0, 1), (1, 0)]
    assert all(p.keys == 0 for p in progs if p.rows == 0)


def test_scratch_bytes_worked_example():
    # Sequence 0: 100 keys, min_split 32, 4 slices -> split_len max(roundup(25, 16), 32) = 32,
    # n_used 4: 4 programs publish 16-row partials of Dv + 1 = 9 floats; the merger reads
    # 4 partials x 3 live rows. Sequence 1: 10 keys -> one slice, no scratch.
    progs = verify_programs([100, 10], [3, 2], 1, 1, 4, block_m=16, block_n=16, min_split=32)
    written, read = scratch_bytes(progs, 8, 16)
    assert written == 4 * 16 * 9 * 4
    assert read == 4 * 3 * 9 * 4


def test_merge_programs_worked_example():
    # The last program merges while it reads at most 65536 floats (n_splits x BLOCK_M x Dv):
    # 102 x 16 x 40 = 65280 fits, 103 x 16 x 40 = 65920 does not: merge programs in the grid.
    assert merge_mode(102, 2, 16, 40) == LAST_PROGRAM and merge_mode(103, 2, 16, 40) == MERGE_PROGRAMS
    assert merge_mode(2, 2, 32, 40) == MERGE_PROGRAMS  # 32-row tiles: never the last program
    assert merge_mode(2, 2, 16, 40, one_launch=False) == SEPARATE_MERGE and merge_mode(1, 2, 16, 40) is None
    # 103 slices: merge programs of 8 rows x 64 columns after the 2 x 103 slice programs.
    # Sequence 0: 100 keys -> split_len max(roundup(1, 16), 32) = 32 -> 4 slices; its tile has
    # 3 live rows (1 head x 3 drafts), all in row chunk 0; Dv 40 -> one column chunk.
    # Sequence 1: 10 keys -> one slice, finished by its slice program: its merge programs exit.
    progs = merge_programs([100, 10], [3, 2], 1, 1, 103, block_m=16, block_n=16, v_head_dim=40, min_split=32)
    assert len(progs) == 2 * 2 * 1 and all(m.in_verify_grid for m in progs)  # tiles x row chunks x column chunks
    live = [(m.seq, m.row_chunk, m.col_chunk, m.rows, m.columns, m.slices) for m in progs if m.rows]
    assert live == [(0, 0, 0, 3, 40, 4)]
    assert [m.index for m in progs] == list(range(206, 210)) and progs[1].seq == 1  # tickets; the tile fastest
    verify = verify_programs([100, 10], [3, 2], 1, 1, 103, block_m=16, block_n=16, min_split=32)
    assert scratch_bytes(verify, 40, 16, progs) == (4 * 16 * 41 * 4, 3 * 4 * 41 * 4)
    # A second launch (one_launch=False): 4-row x 32-column blocks, Dv 40 -> column chunks of 32 and 8.
    progs = merge_programs([100, 10], [3, 2], 1, 1, 103, block_m=16, block_n=16, v_head_dim=40, min_split=32,
                           one_launch=False)
    assert len(progs) == 2 * 4 * 2 and not any(m.in_verify_grid for m in progs)
    live = [(m.seq, m.row_chunk, m.col_chunk, m.rows, m.columns, m.slices) for m in progs if m.rows]
    assert live == [(0, 0, 0, 3, 32, 4), (0, 0, 1, 3, 8, 4)]
    assert [m.index for m in progs] == list(range(16)) and progs[1].seq == 1  # the tile varies fastest
    assert scratch_bytes(verify, 40, 16, progs) == (4 * 16 * 41 * 4, 3 * 4 * (33 + 9) * 4)
    assert merge_programs([100, 10], [3, 2], 1, 1, 9, block_m=16, block_n=16, v_head_dim=40) == []


def test_extend_programs():
    progs = extend_programs([100, 7], [3, 20], 4, block_m=16)
    assert len(progs) == 2 * 4 * cdiv(20, 16)
    for p in progs:
        if p.rows:
            assert p.prefix_keys == [100, 7][p.seq]
    # Sequence 0 has 3 drafts: its second row tile returns at once.
    assert all(p.rows == 0 for p in progs if p.seq == 0 and p.m_block == 1)
    assert sorted({p.draft_keys for p in progs if p.seq == 1 and p.rows}) == [16, 20]


def test_waves_and_schedule():
    assert waves(132, 132) == 1 and waves(133, 132) == 2 and waves(1056, 132, 4) == 2
    placement, makespan = schedule([1.0] * 10, num_sms=4)
    assert [sm for sm, _, _ in placement[:4]] == [0, 1, 2, 3]  # first wave spreads out
    assert makespan == math.ceil(10 / 4)
    # Uneven work: the long program bounds the launch however many SMs idle.
    _, makespan = schedule([100.0] + [1.0] * 7, num_sms=8)
    assert makespan == 100.0


# --- the mirror against the kernel -------------------------------------------------

def _slice_state(p, b, h, lo, hi, with_draft):
    """Float64 ``(o [L, Dv], lse2 [L])`` of query head ``h`` of sequence ``b`` over
    prefix keys ``[lo, hi)`` (and the draft block if ``with_draft``)."""
    f64 = torch.float64
    group = p.num_q_heads // p.num_kv_heads
    g = h // group
    q0, q1 = p.qo_indptr[b].item(), p.qo_indptr[b + 1].item()
    k0 = p.kv_indptr[b].item()
    slots = p.kv_indices[k0 + lo: k0 + hi].long()
    q = p.q_extend[q0:q1, h].to(f64)
    scores = [q @ p.k_buffer[slots, g].to(f64).T * (p.sm_scale * p.k_scale)]
    values = [p.v_buffer[slots, g].to(f64) * p.v_scale]
    if with_draft:
        s = q @ p.k_extend[q0:q1, g].to(f64).T * p.sm_scale
        n = q1 - q0
        s = s.masked_fill(~torch.tril(torch.ones(n, n, dtype=torch.bool, device=s.device)), float("-inf"))
        scores.append(s)
        values.append(p.v_extend[q0:q1, g].to(f64))
    s = torch.cat(scores, 1)
    lse = torch.logsumexp(s, 1)
    o = torch.softmax(s, 1) @ torch.cat(values)
    return o, lse * LOG2E


def _run_default_scratch_poisoned(plan, p, monkeypatch):
    """Run ``plan`` with its default per-call scratch, catching that scratch and poisoning it with NaN."""
    caught = []
    size = plan.grid[0] * plan.n_splits * plan.config.block_m * (p.v_head_dim + 1)
    real_new = workspace.new_partials

    def new_partials(device, nbytes, stream, raw):
        t, address = real_new(device, nbytes, stream, False)  # a tensor, whatever the run asked for
        assert t.dtype == torch.float32 and t.shape == (size,) and address == t.data_ptr()
        caught.append(t.fill_(float("nan")))
        return t, address

    with monkeypatch.context() as m:
        m.setattr(workspace, "new_partials", new_partials)
        out = plan.run(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, out=p.new_output())
    assert len(caught) == 1, "the run did not allocate its partials as expected"
    return out, caught[0]


def _check_against_kernel(p, pack_gqa=True, max_splits=None, monkeypatch=None, **runner_kwargs):
    """Launch with NaN-poisoned partials; compare what was written with the mirror."""
    if monkeypatch is None:  # a caller-owned workspace
        runner, ws = poisoned_workspace_runner(p, pack_gqa=pack_gqa, max_splits=max_splits, **runner_kwargs)
    else:  # the default per-call scratch, caught as it is allocated
        runner = VerifySplitKV(p.num_q_heads, p.num_kv_heads, p.head_dim, p.v_head_dim, p.max_len_extend,
                               p.batch_size, DEVICE, pack_gqa=pack_gqa, **runner_kwargs)
    plan = runner.plan(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, p.qo_indptr, p.kv_indptr,
                       p.kv_indices, custom_mask=p.custom_mask, mask_indptr=p.mask_indptr, is_causal=p.is_causal,
                       sm_scale=p.sm_scale, k_scale=p.k_scale, v_scale=p.v_scale)
    if monkeypatch is None:
        out = plan.run(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, out=p.new_output())
        part_o, part_lse = scratch_views(runner, plan, ws)
    else:
        out, parts = _run_default_scratch_poisoned(plan, p, monkeypatch)
        part_o, part_lse = partials_views(plan, parts)
    assert_matches_reference(out, p)
    cfg = plan.config
    min_split = min_split_for(cfg.block_n, MIN_SPLIT)
    split_tokens = runner_kwargs.get("split_tokens")
    progs = verify_programs(p.prefix_lens, p.extend_lens, p.num_q_heads, p.num_kv_heads, plan.n_splits,
                            block_m=cfg.block_m, block_n=cfg.block_n, pack_gqa=pack_gqa,
                            max_len_extend=p.max_len_extend, min_split=min_split, split_tokens=split_tokens)
    assert len(progs) == plan.grid[0] * plan.grid[1]
    part_o, part_lse = part_o.cpu(), part_lse.cpu()
    written = ~torch.isnan(part_lse)  # [tiles, n_splits, BLOCK_M]
    tiles = plan.grid[0]
    expected = torch.zeros(tiles, plan.n_splits, dtype=torch.bool)
    for q in progs:
        tile = q.index % tiles
        assert q.split == q.index // tiles
        expected[tile, q.split] = q.writes_partial
    # Exactly the programs the mirror says publish a partial wrote one (whole BLOCK_M rows).
    assert torch.equal(written.all(-1), expected), (written.all(-1), expected)
    assert torch.equal(written.any(-1), expected)
    assert written.sum().item() * (p.v_head_dim + 1) * 4 == scratch_bytes(progs, p.v_head_dim, cfg.block_m)[0]
    assert expected.any(), "no tile was cut into several slices: the test proves nothing"
    # Each published partial is the attention over the keys the mirror gives its slice.
    hpt = p.num_q_heads // p.num_kv_heads if pack_gqa else 1
    for q in progs:
        if not q.writes_partial:
            continue
        tile = q.index % tiles
        lo, hi = split_ranges(p.prefix_lens[q.seq], plan.n_splits, cfg.block_n, min_split,
                              split_tokens=split_tokens)[q.split]
        for r in range(q.rows):
            row = q.m_block * cfg.block_m + r
            token, h = row // hpt, q.head_tile * hpt + row % hpt
            o_ref, lse_ref = _slice_state(p, q.seq, h, lo, hi, q.draft_keys > 0)
            got_lse = part_lse[tile, q.split, r].item()
            assert abs(got_lse - lse_ref[token].item()) < 1e-3, (q, r, got_lse, lse_ref[token].item())
            got_o = part_o[tile, q.split, r].double()
            err = (got_o - o_ref[token].cpu()).norm() / o_ref[token].cpu().norm()
            assert err < 1e-3, (q, r, err.item())
    return plan


@pytest.mark.parametrize("n_splits", [1, 3, 7])
def test_mirror_matches_the_kernel_adaptive(n_splits):
    """Ragged prefixes: some cut into several slices, short ones into one, programs past n_used exit."""
    long = 4 * MIN_SPLIT + 22
    p = make_problem([long, 0, MIN_SPLIT + 5, 5, 3 * MIN_SPLIT], [3, 2, 4, 1, 2], 4, 2, 32,
                     dtype=torch.float32, device=DEVICE, seed=3)
    if n_splits == 1:
        runner, _ = poisoned_workspace_runner(p, n_splits=1)
        plan = runner.plan(*p.args(None)[:3], *p.args(None)[4:9], sm_scale=p.sm_scale)
        assert plan.scratch_bytes == 0  # one slice: every tile finishes in registers
        return
    _check_against_kernel(p, n_splits=n_splits)


def test_mirror_matches_the_kernel_per_head_layout():
    p = make_problem([3 * MIN_SPLIT + 7, 20], [2, 3], 4, 2, 16, dtype=torch.float32, device=DEVICE, seed=4)
    _check_against_kernel(p, pack_gqa=False, n_splits=4)


def test_mirror_matches_the_kernel_several_row_blocks():
    """GROUP 8 x 5 drafts = 40 rows: three 16-row blocks, or one 64-row block on the GPU."""
    p = make_problem([2 * MIN_SPLIT + 9, 3], [5, 2], 8, 1, 16, dtype=torch.float32, device=DEVICE, seed=5)
    from splitkv.schedule import TileConfig

    _check_against_kernel(p, n_splits=3, config=TileConfig(16, 16, 4, 1))


def test_mirror_matches_the_kernel_default_scratch(monkeypatch):
    """The same with the runner's own per-call partials (caught as allocated, poisoned)."""
    p = make_problem([3 * MIN_SPLIT + 7, 0, MIN_SPLIT - 1], [2, 3, 4], 4, 2, 16, dtype=torch.float32,
                     device=DEVICE, seed=7)
    _check_against_kernel(p, n_splits=5, monkeypatch=monkeypatch)


@pytest.mark.parametrize("n_splits,dv", [(33, 128), (4, 40)])
def test_spread_merge_matches_the_mirror(n_splits, dv):
    """With one_launch=False the verify kernel leaves the rows of multi-slice tiles to a second
    launch: skipping that launch leaves exactly the rows the mirror's merge programs own
    unwritten; running it completes the output."""
    p = make_problem([5 * MIN_SPLIT + 3, 0, MIN_SPLIT + 1, 9], [3, 2, 4, 1], 4, 2, dv, dtype=torch.float32,
                     device=DEVICE, seed=8)
    runner = VerifySplitKV(4, 2, dv, dv, p.max_len_extend, p.batch_size, DEVICE, n_splits=n_splits,
                           one_launch=False)
    plan = runner.plan(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, p.qo_indptr, p.kv_indptr,
                       p.kv_indices, sm_scale=p.sm_scale)
    cfg = plan.config
    kw = dict(block_m=cfg.block_m, block_n=cfg.block_n, min_split=min_split_for(cfg.block_n, MIN_SPLIT))
    merge = merge_programs(p.prefix_lens, p.extend_lens, 4, 2, n_splits, v_head_dim=dv, one_launch=False, **kw)
    assert merge and not plan.fused and plan.merge == SEPARATE_MERGE
    grids = []

    class MergeSkipped:  # stands for the merge launcher: records its grid, launches nothing
        def __call__(self, grid, args, stream=None, key=None):
            grids.append(grid)

        def run_ptrs(self, key, grid, args, stream):
            self(grid, args)
            return True

    skipped = plan.step._replace(merge=MergeSkipped())  # the verify kernel alone
    out = plan.run(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, out=p.new_output(), step=skipped)
    assert len(grids) == 1 and grids[0][0] * grids[0][1] * grids[0][2] == len(merge)
    assert torch.equal(torch.isnan(out).cpu(), _merged_cells(merge, p, cfg.block_m, dv, n_splits))
    out = plan.run(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, out=p.new_output())
    assert_matches_reference(out, p)


def _merged_cells(merge, p, block_m, dv, n_splits):
    """[tokens, H_Q, Dv] booleans: the output cells the mirror's merge programs write (2 heads per tile),
    for the runner's block shapes (``GRID_MERGE_*`` in the verify grid, ``MERGE_*`` in a second launch)."""
    from splitkv import schedule

    in_grid = merge[0].in_verify_grid
    chunk_rows = schedule.grid_merge_rows(n_splits) if in_grid else schedule.MERGE_ROWS
    width = min(schedule.GRID_MERGE_DV if in_grid else schedule.MERGE_DV, 1 << (dv - 1).bit_length())
    cells = torch.zeros(p.num_tokens, 4, dv, dtype=torch.bool)
    for m in merge:
        for r in range(m.row_chunk * chunk_rows, m.row_chunk * chunk_rows + m.rows):
            row = m.m_block * block_m + r
            start = m.col_chunk * width
            cells[p.qo_indptr[m.seq].item() + row // 2, m.head_tile * 2 + row % 2, start: start + m.columns] = True
    return cells


def test_merge_programs_in_the_verify_grid_match_the_mirror(monkeypatch):
    """Past the last program's limit, merge programs join the verify grid: the grid's axis 1 holds the
    slices and then each tile's merge blocks, the mirror lists as many, and together they cover every
    row of every multi-slice tile; the result equals the oracle and leaves every counter at zero."""
    import splitkv.schedule as schedule_module

    monkeypatch.setattr(schedule_module, "FUSED_MAX_MERGE", 0)
    p = make_problem([5 * MIN_SPLIT + 3, 0, MIN_SPLIT + 1, 9], [3, 2, 4, 1], 4, 2, 40, dtype=torch.float32,
                     device=DEVICE, seed=9)
    runner = VerifySplitKV(4, 2, 40, 40, p.max_len_extend, p.batch_size, DEVICE, n_splits=4)
    plan = runner.plan(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, p.qo_indptr, p.kv_indptr,
                       p.kv_indices, sm_scale=p.sm_scale)
    cfg = plan.config
    kw = dict(block_m=cfg.block_m, block_n=cfg.block_n, min_split=min_split_for(cfg.block_n, MIN_SPLIT))
    merge = merge_programs(p.prefix_lens, p.extend_lens, 4, 2, 4, v_head_dim=40, **kw)
    assert plan.merge == MERGE_PROGRAMS and plan.fused and merge and all(m.in_verify_grid for m in merge)
    tiles = plan.grid[0]
    assert plan.grid[1] == 4 + len(merge) // tiles and [m.index for m in merge] == list(range(tiles * 4, tiles * plan.grid[1]))
    verify = verify_programs(p.prefix_lens, p.extend_lens, 4, 2, 4, **kw)
    multi = torch.zeros(p.num_tokens, 4, 40, dtype=torch.bool)  # cells of tiles cut into several slices
    for v in verify:
        if v.split == 0 and v.n_used > 1:
            for row in range(v.m_block * cfg.block_m, v.m_block * cfg.block_m + v.rows):
                multi[p.qo_indptr[v.seq].item() + row // 2, v.head_tile * 2 + row % 2] = True
    assert multi.any() and torch.equal(_merged_cells(merge, p, cfg.block_m, 40, 4), multi)
    out = plan.run(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, out=p.new_output())
    assert_matches_reference(out, p)
    assert all_counters_zero()


def test_mirror_matches_the_kernel_fixed_slices(monkeypatch):
    """split_tokens=128: 300 keys -> slices of 128, 128, 44; 129 -> 128, 1; 128 and 0 -> one slice."""
    p = make_problem([300, 0, 129, 128], [2, 3, 1, 2], 4, 2, 16, dtype=torch.float32, device=DEVICE, seed=6)
    grid = cdiv(300, 128)  # the fixed-slice grid: cdiv(max_prefix_len, split_tokens), the longest prefix here
    assert [n_used(n, grid, 16, split_tokens=128) for n in p.prefix_lens] == [3, 1, 2, 1]
    plan = _check_against_kernel(p, split_tokens=128, max_prefix_len=300, monkeypatch=monkeypatch)
    assert plan.n_splits == grid


def test_fixed_slices_with_a_workspace():
    p = make_problem([300, 0, 129, 128], [2, 3, 1, 2], 4, 2, 16, dtype=torch.float32, device=DEVICE, seed=6)
    # A bound past the longest prefix (the batch's total keys): slices past each sequence's n_used idle.
    bound = p.kv_indices.shape[0]
    plan = _check_against_kernel(p, split_tokens=128, max_prefix_len=bound, max_splits=cdiv(bound, 128))
    assert plan.n_splits == cdiv(bound, 128)


def _h200_runner(s, max_bs, table=None):
    """A runner for head shape ``s`` that plans as on an H200 (132 SMs, its shared memory and table)
    wherever the test runs: the schedule's facts and table are the runner's to hold."""
    from splitkv import VerifySplitKV, tuning
    from splitkv.resources import H200_SHARED_MEMORY
    from splitkv.schedule import DeviceFacts

    r = VerifySplitKV(s.num_q_heads, s.num_kv_heads, s.head_dim, s.head_dim, 4, max_bs, DEVICE, num_sms=132)
    r.facts = DeviceFacts(132, H200_SHARED_MEMORY, False)
    r.table = tuning.table_named(tuning.DEFAULT_DEVICE) if table is None else table
    return r


def test_gpu_launch_is_what_the_runner_launches_on_a_gpu():
    """The notebooks' any-machine view of a GPU launch agrees with the runner under GPU rules."""
    from splitkv.testing import MODEL_SHAPES

    for s in MODEL_SHAPES.values():
        for bs, prefix in ((1, 4096), (8, 16384), (32, 65536)):
            for page_size in (1, 16, 64):
                g = gpu_launch(s.num_q_heads, s.num_kv_heads, s.head_dim, bs, prefix, num_sms=132,
                               page_size=page_size)
                r = _h200_runner(s, bs)
                assert r.config(torch.bfloat16, bs, prefix, page_size) == g.cfg
                assert r.head_tiles == g.head_tiles
                assert r.n_splits(bs, prefix, page_size=page_size) == g.n_splits


def test_paged_pools_take_the_paged_sweeps_tile():
    """A paged pool takes the paged sweep's row of the largest swept page size not above its own
    (tile and programs per SM); a token pool, and pages smaller than every swept size, keep the
    token pool's tile."""
    from splitkv import tuning
    from splitkv.testing import MODEL_SHAPES

    for s in MODEL_SHAPES.values():
        token = gpu_launch(s.num_q_heads, s.num_kv_heads, s.head_dim, 8, 65536)
        for page_size, swept in ((1, None), (8, None), (16, 16), (32, 16), (64, 64), (128, 64)):
            g = gpu_launch(s.num_q_heads, s.num_kv_heads, s.head_dim, 8, 65536, page_size=page_size)
            if swept is None:
                assert (g.cfg, g.programs_per_sm) == (token.cfg, token.programs_per_sm)
                continue
            row = tuning.TUNED["paged_tiles"][(s.head_dim, g.cfg.block_m, 2, swept)]
            assert (g.cfg.block_n, g.cfg.num_warps, g.cfg.num_stages, g.cfg.k_rows, g.programs_per_sm) == (
                row["block_n"], row["num_warps"], row["num_stages"], row["k_rows"], row["programs_per_sm"])


def test_small_launches_take_one_wave():
    """With a small-batch tile in the table, batch 1 of an 8-KV-head model gets num_sms // tiles slices
    and that tile (runner and mirror alike); batch 8, and prefixes past SMALL_BATCH_MAX_PREFIX, keep
    the usual schedule."""
    from splitkv import tuning
    from splitkv.testing import MODEL_SHAPES

    s = MODEL_SHAPES["llama3-8b"]
    key = (s.head_dim, block_m_for(s.num_q_heads // s.num_kv_heads * 4), 2)
    table = tuning.table_named(tuning.DEFAULT_DEVICE).replace(
        small_batch_tiles={key: dict(block_n=64, num_warps=4, num_stages=3)})
    r = _h200_runner(s, 8, table)
    longest = tuning.SMALL_BATCH_MAX_PREFIX
    for bs, prefix, small in ((1, 4096, True), (2, longest, True), (1, 256, True), (8, 4096, False),
                              (1, longest + 1, False), (2, 65536, False)):
        g = gpu_launch(s.num_q_heads, s.num_kv_heads, s.head_dim, bs, prefix, num_sms=132, table=table)
        cfg = r.config(torch.bfloat16, bs, prefix)
        assert cfg == g.cfg and r.n_splits(bs, prefix) == g.n_splits
        tiles = bs * r.head_tiles
        if small:
            assert (cfg.block_n, cfg.num_stages) == (64, 3)
            assert g.n_splits == min(132 // tiles, cdiv(prefix, table.min_split_tokens()))
        else:
            assert (cfg.block_n, cfg.num_stages) != (64, 3)
            assert tiles * tuning.SMALL_BATCH_SMS_PER_TILE > 132 or prefix > longest


def test_k_tile_layout_per_head_dim_and_pool():
    """K tiles load as rows exactly where the sweep's table says so for the launch's own key,
    whichever schedule (small launch or not) the batch gets; keys the sweep did not measure
    (Gemma-2's 16-row tiles of head dim 256, float32 pools) load K as [D, BLOCK_N]."""
    from splitkv import tuning
    from splitkv.testing import MODEL_SHAPES

    measured = {key: row["k_rows"] for key, row in tuning.TUNED["tiles"].items()}
    for s in MODEL_SHAPES.values():
        for kv_bytes in (2, 1):
            for bs in (1, 8, 64):
                cfg = gpu_launch(s.num_q_heads, s.num_kv_heads, s.head_dim, bs, 16384, kv_bytes=kv_bytes).cfg
                assert cfg.k_rows is measured[(s.head_dim, cfg.block_m, kv_bytes)], (s, kv_bytes, bs)
    gemma2 = gpu_launch(16, 8, 256, 8, 16384).cfg
    assert gemma2.block_m == 16 and (256, 16, 2) not in measured and not gemma2.k_rows
    assert not gpu_launch(16, 2, 256, 8, 16384, kv_bytes=4).cfg.k_rows
