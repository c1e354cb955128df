"""The split chooser against a golden table worked out by hand.

The rule (splitkv/schedule.py), with the defaults programs_per_sm = 2 and
min_split_tokens = 128 passed explicitly so the table does not follow the tuning file:

    base   = batch x head_tiles             slots = 2 x num_sms
    useful = clamp(cdiv(prefix, 128), 1, 64)
    eff(n) = w / ceil(w)  with  w = base x n / slots
    answer = the smallest n <= useful with eff(n) >= 0.95 x max(eff(1..useful))

(with the default ``block_n = 1`` every count's slices hold keys; with the kernel's key
tile the rule weighs each count by its working slices, the last tests below).

Each entry below was computed by hand from that rule; the comment gives the
working. SM counts: 132 (H100/H200), 108 (A100), 78 (H20), 8 (the interpreter's).
"""

import pytest

from splitkv import choose_n_splits
from splitkv.schedule import MAX_SPLITS, fixed_n_splits, min_split_for, n_used, one_wave_n_splits

SMS = (132, 108, 78, 8)

GOLDEN = {
    # (batch, head_tiles, prefix): {num_sms: n_splits}
    (1, 8, 65536): {
        132: 32,  # base 8, 264 slots, useful 64. n = 33 fills 264 exactly (best 1.0); 8n/264 >= 0.95 first at n = 32 (0.970)
        108: 26,  # 216 slots: n = 27 exact; 8n/216 >= 0.95 first at n = 26 (0.963; n = 25 gives 0.926)
        78: 19,  # 156 slots: n = 39 exact; 8n/156 >= 0.95 first at n = 19 (0.974; n = 18 gives 0.923)
        8: 2,  # 16 slots: n = 2 fills them (1.0); n = 1 is 0.5
    },
    (8, 8, 65536): {
        132: 4,  # base 64: n = 4 is 256/264 = 0.970 of one wave (n = 3: 0.727); best 1.0 at n = 33
        108: 10,  # w = 8n/27: no n <= 9 reaches 0.95 (n = 3: 0.889, n = 9: 2.67/3); n = 10: 2.963/3 = 0.988
        78: 7,  # w = 16n/39: n = 7 gives 2.872/3 = 0.957; n = 2, 4, 6 only 0.82
        8: 1,  # w = 4n: every n is whole waves, so the smallest, 1
    },
    (264, 1, 65536): {
        132: 1,  # base 264 = slots: one full wave already
        108: 4,  # w = 11n/9: n = 1..3 give 0.611, 0.815, 0.917; n = 4 gives 4.889/5 = 0.978
        78: 4,  # w = 22n/13: n = 1..3 give 0.846; n = 4 gives 6.769/7 = 0.967
        8: 1,  # w = 16.5n: n = 1 gives 16.5/17 = 0.971 >= 0.95 (best 1.0 at n = 2)
    },
    (1, 8, 1000): {
        132: 8,  # useful = cdiv(1000, 128) = 8: all below one wave, so the most useful, 8 (n = 7 is 0.875 of best)
        108: 8,  # same reasoning: eff grows with n up to useful
        78: 8,  # 64/156 = 0.41 at n = 8, n = 7 only 0.875 of that
        8: 2,  # base 8 on 16 slots: n = 2 fills them
    },
    (1, 2, 0): {s: 1 for s in SMS},  # empty prefix: useful = max(1, 0) = 1
    (1, 1, 127): {s: 1 for s in SMS},  # 127 < 128 keys: one slice only
    (4, 8, 4096): {
        132: 8,  # base 32, useful 32, w = 4n/33: never whole; best 0.970 (n = 8, 16, 24, 32); first is n = 8
        108: 13,  # w = 4n/27: best 1.0 at n = 27; first >= 0.95 is n = 13 (1.926/2 = 0.963)
        78: 14,  # w = 8n/39: best 0.991 (n = 29), threshold 0.942; n = 14 gives 2.872/3 = 0.957 (n = 9: 0.923)
        8: 1,  # w = 2n: whole waves at n = 1
    },
    (2, 8, 300): {
        132: 3,  # useful = cdiv(300, 128) = 3, all within one wave: the most, 3
        108: 3,
        78: 3,
        8: 1,  # base 16 = slots: n = 1 is one full wave
    },
    (1, 1, 1 << 20): {
        132: 61,  # useful capped at MAX_SPLITS = 64; w = n/264, best 64/264; 0.95 of it is reached at n = 61 (60.8)
        108: 61,  # n/216: the same 0.95 x 64 = 60.8 threshold
        78: 61,
        8: 16,  # n/16: n = 16 is one full wave (1.0); n = 15 is 0.9375
    },
}


@pytest.mark.parametrize("num_sms", SMS)
@pytest.mark.parametrize("shape", list(GOLDEN), ids=[f"bs{b}-tiles{t}-prefix{p}" for b, t, p in GOLDEN])
def test_golden_table(shape, num_sms):
    batch, tiles, prefix = shape
    got = choose_n_splits(batch, tiles, prefix, num_sms, programs_per_sm=2, min_split_tokens=128)
    assert got == GOLDEN[shape][num_sms]


def test_prefix_rounding_changes_the_answer_only_every_min_split_tokens():
    """The answer depends on cdiv(prefix, 128): prefixes 897..1024 all ask for 8 slices' worth."""
    answers = {choose_n_splits(1, 8, p, 132, programs_per_sm=2, min_split_tokens=128) for p in range(897, 1025)}
    assert answers == {8}
    assert choose_n_splits(1, 8, 896, 132, programs_per_sm=2, min_split_tokens=128) == 7  # cdiv = 7


@pytest.mark.parametrize("bs", [1, 3, 8, 32, 256])
@pytest.mark.parametrize("tiles", [1, 2, 8, 64])
@pytest.mark.parametrize("prefix", [0, 1, 127, 4096, 65536, 1 << 20])
def test_bounds(bs, tiles, prefix):
    n = choose_n_splits(bs, tiles, prefix, 132, programs_per_sm=2, min_split_tokens=128)
    assert 1 <= n <= MAX_SPLITS
    assert n <= max(1, -(-prefix // 128))  # never more slices than 128-key pieces


def test_fixed_slices():
    # cdiv(max_prefix_len, split_tokens), at least 1
    assert fixed_n_splits(0, 128) == 1
    assert fixed_n_splits(128, 128) == 1
    assert fixed_n_splits(129, 128) == 2
    assert fixed_n_splits(1000, 256) == 4
    with pytest.raises(ValueError):
        fixed_n_splits(100, 0)


@pytest.mark.parametrize("bad", [dict(batch_size=0), dict(head_tiles=0), dict(num_sms=0),
                                 dict(programs_per_sm=0), dict(min_split_tokens=0)])
def test_rejects_nonsense(bad):
    args = dict(batch_size=1, head_tiles=8, prefix_len=4096, num_sms=132, programs_per_sm=2, min_split_tokens=128)
    args.update(bad)
    with pytest.raises(ValueError):
        choose_n_splits(**args)


@pytest.mark.parametrize("block_n", [16, 64, 128])
@pytest.mark.parametrize("bs, tiles, pps", [(1, 1, 1), (1, 2, 2), (1, 8, 2), (2, 8, 2), (8, 2, 2), (32, 8, 2)])
@pytest.mark.parametrize("prefix", [100, 1000, 4096, 4100, 16384, 65536, 200_000])
def test_every_chosen_slice_holds_keys(block_n, bs, tiles, pps, prefix):
    """Slices are whole key tiles, so a count can leave programs idle; the chooser returns counts that do not."""
    min_split = min_split_for(block_n, 128)
    n = choose_n_splits(bs, tiles, prefix, 132, programs_per_sm=pps, min_split_tokens=128, block_n=block_n)
    assert n_used(prefix, n, block_n, min_split) == n
    m = one_wave_n_splits(bs * tiles, prefix, 132, min_split_tokens=128, block_n=block_n)
    assert n_used(prefix, m, block_n, min_split) == m


def test_rounding_to_key_tiles_no_longer_idles_programs():
    """Qwen3-Next at batch 1 (2 tiles of 64-key tiles): 31 slices of a 4096-key prefix round to 192 keys and
    only 22 hold keys; the chooser asks for 32 slices of 128 keys instead, and 64 at 16k (not 61, 52 working)."""
    assert n_used(4096, 31, 64, 128) == 22
    assert choose_n_splits(1, 2, 4096, 132, programs_per_sm=2, min_split_tokens=128, block_n=64) == 32
    assert choose_n_splits(1, 2, 16384, 132, programs_per_sm=2, min_split_tokens=128, block_n=64) == 64
