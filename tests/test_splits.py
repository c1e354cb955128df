"""The split chooser: bounds, wave quantisation, static-shape purity."""

import pytest

from splitkv import choose_n_splits
from splitkv.splits import MAX_SPLITS, MIN_SPLIT_TOKENS, PROGRAMS_PER_SM


@pytest.mark.parametrize("bs", [1, 3, 8, 32, 256])
@pytest.mark.parametrize("tiles", [1, 2, 8, 64])
@pytest.mark.parametrize("prefix", [0, 1, 127, 4096, 65536, 1 << 20])
def test_bounds(bs, tiles, prefix):
    n = choose_n_splits(bs, tiles, prefix, 132)
    assert 1 <= n <= MAX_SPLITS
    assert n == 1 or prefix // n >= MIN_SPLIT_TOKENS  # no slice shorter than the minimum


def test_a_full_batch_gets_one_split():
    assert choose_n_splits(PROGRAMS_PER_SM * 132, 1, 1 << 20, 132) == 1


def test_avoids_a_ragged_last_wave():
    """64 programs per split on 264 slots: 4 splits (0.97 of one wave), not 9 (2.2 waves)."""
    n = choose_n_splits(8, 8, 65536, 132)
    waves = 8 * 8 * n / (PROGRAMS_PER_SM * 132)
    assert waves / -(-waves // 1) > 0.9


def test_more_splits_for_longer_prefixes_and_smaller_batches():
    assert choose_n_splits(1, 2, 1024, 132) <= choose_n_splits(1, 2, 65536, 132)
    assert choose_n_splits(32, 8, 65536, 132) <= choose_n_splits(1, 8, 65536, 132)


def test_rejects_nonsense():
    with pytest.raises(ValueError):
        choose_n_splits(0, 8, 4096, 132)
