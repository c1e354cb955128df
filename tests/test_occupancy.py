"""splitkv.occupancy: the plain-Python mirror of the kernels' work split.

Pure-Python checks of the rules, plus one interpreter (or GPU) launch of the
partials kernel confirming that the slices the mirror calls empty are exactly
those the kernel writes with ``lse = -inf``.
"""

import math

import pytest
import torch

from conftest import DEVICE
from splitkv import VerifySplitKV
from splitkv.testing import make_problem
from splitkv.occupancy import (
    cdiv,
    extend_programs,
    head_tiles,
    partials_programs,
    prefix_bytes_read,
    schedule,
    split_keys,
    split_len,
    split_ranges,
    waves,
)
from splitkv.partials import split_kv_partials


@pytest.mark.parametrize("prefix", [0, 1, 15, 16, 17, 100, 255, 4096, 5000])
@pytest.mark.parametrize("n_splits", [1, 2, 3, 8])
@pytest.mark.parametrize("block_n", [16, 64])
def test_split_ranges_partition_the_prefix(prefix, n_splits, block_n):
    ranges = split_ranges(prefix, n_splits, block_n)
    assert len(ranges) == n_splits
    assert split_len(prefix, n_splits, block_n) % block_n == 0
    pos = 0
    for lo, hi in ranges:
        assert lo == pos and lo <= hi  # contiguous, in order
        if hi > lo:
            assert lo % block_n == 0  # slices start on a key tile
        pos = hi
    assert pos == prefix
    # Empty slices can only trail the non-empty ones.
    keys = [hi - lo for lo, hi in ranges]
    assert keys == sorted(keys, key=lambda k: k == 0)


def test_split_keys_example():
    # 300 keys in 8 slices of 64-key tiles: 38 -> 64 keys a slice, 3 slices empty.
    assert split_keys([300], 8, 64) == [[64, 64, 64, 64, 44, 0, 0, 0]]
    assert split_keys([0], 3, 16) == [[0, 0, 0]]


@pytest.mark.parametrize("pack_gqa", [True, False])
@pytest.mark.parametrize("hq,hkv,ext", [(4, 2, 4), (8, 1, 4), (16, 2, 4), (64, 8, 8), (4, 4, 1)])
def test_head_tiles_matches_runner(hq, hkv, ext, pack_gqa):
    runner = VerifySplitKV(hq, hkv, 64, 64, ext, 2, DEVICE, pack_gqa=pack_gqa)
    assert head_tiles(hq, hkv, ext, runner.config.block_m, pack_gqa) == runner.head_tiles


@pytest.mark.parametrize("pack_gqa", [True, False])
def test_partials_programs_cover_every_key_once_per_tile(pack_gqa):
    prefix, ext, hq, hkv, n_splits = [300, 0, 77], [4, 2, 3], 8, 2, 5
    progs = partials_programs(prefix, ext, hq, hkv, n_splits, block_m=16, block_n=16, pack_gqa=pack_gqa)
    tiles = head_tiles(hq, hkv, max(ext), 16, pack_gqa)
    assert len(progs) == len(prefix) * tiles * (n_splits + 1)
    assert [p.index for p in progs] == list(range(len(progs)))
    for b, p_len in enumerate(prefix):
        live = {(p.head_tile, p.m_block) for p in progs if p.seq == b and p.rows > 0}
        assert live
        for tile, m in live:
            mine = [p for p in progs if (p.seq, p.head_tile, p.m_block) == (b, tile, m)]
            assert sum(p.prefix_keys for p in mine) == p_len
            assert [p.draft_keys for p in mine if p.split == n_splits] == [ext[b]]
    group = hq // hkv
    packed = prefix_bytes_read(
        partials_programs(prefix, ext, hq, hkv, n_splits, block_m=16, block_n=16), 64, 64, 2
    )
    assert packed == sum(prefix) * hkv * 128 * 2  # each KV byte read once
    if not pack_gqa:
        assert prefix_bytes_read(progs, 64, 64, 2) == group * packed


def test_row_tiles_past_the_drafts_do_nothing():
    # GROUP 8 x 4 drafts = 32 rows in 16-row tiles: 2 live tiles; 1 draft -> 1.
    progs = partials_programs([64, 64], [4, 1], 8, 1, 2, block_m=16, block_n=16)
    live = sorted({(p.seq, p.m_block) for p in progs if p.rows > 0})
    assert live == [(0, 0), (0, 1), (1, 0)]
    assert all(p.keys == 0 for p in progs if p.rows == 0)


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


def test_mirror_matches_the_kernel():
    """Slices the mirror calls empty are exactly those the kernel stores as lse = -inf."""
    p = make_problem([70, 0, 5], [3, 2, 4], 4, 2, 32, device=DEVICE, seed=3)
    n_splits = 4
    runner = VerifySplitKV(4, 2, 32, 32, p.max_len_extend, p.batch_size, DEVICE, n_splits=n_splits)
    part_o, part_lse = runner.scratch()
    part_lse.fill_(float("nan"))
    split_kv_partials(
        p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer,
        p.qo_indptr, p.kv_indptr, p.kv_indices, p.custom_mask, p.mask_indptr, p.is_causal,
        part_o, part_lse, batch_size=p.batch_size, max_len_extend=p.max_len_extend,
        n_splits=n_splits, sm_scale=p.sm_scale, k_scale=1.0, v_scale=1.0, config=runner.config,
    )
    lse = part_lse[: p.num_tokens * 4 * (n_splits + 1)].view(p.num_tokens, 4, n_splits + 1).cpu()
    assert not torch.isnan(lse).any(), "a slot the kernel owns was not written"
    keys = split_keys(p.prefix_lens, n_splits, runner.config.block_n)
    starts = p.qo_indptr.tolist()
    for b, row in enumerate(keys):
        seq = lse[starts[b] : starts[b + 1]]
        for s, k in enumerate(row):
            assert torch.isneginf(seq[:, :, s]).all() == (k == 0), (b, s, k)
        assert torch.isfinite(seq[:, :, n_splits]).all()  # the draft block always has keys
