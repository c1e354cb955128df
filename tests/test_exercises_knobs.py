"""The checkers of notebook 06b pass their solutions, agree with splitkv.resources and the recorded
H200 sweep, and reject the plausible slips (forgetting V, counting stages wrong, the wrong fp8 element size)."""

import itertools

import pytest
import torch

from splitkv.resources import H200_SHARED_MEMORY, SLACK, shared_memory_bytes
from splitkv.schedule import TileConfig
from splitkv.teaching.exercises import Unsolved, exercise, todo
from splitkv.teaching.exercises.knobs import (SM_SHARED_MEMORY, check_programs_per_sm, check_tile_shared_bytes,
                                              recorded_sweep, simple_case)
from splitkv.teaching.exercises import solution_of

solution_programs_per_sm = solution_of(check_programs_per_sm)
solution_tile_shared_bytes = solution_of(check_tile_shared_bytes)


def test_solution_passes():
    assert check_tile_shared_bytes(solution_tile_shared_bytes).startswith("passed")
    assert check_programs_per_sm(solution_programs_per_sm).startswith("passed")


def test_solution_is_the_package_model_over_the_whole_simple_case():
    checked = 0
    for bm, bn, warps, stages, d, kb in itertools.product((16, 32), (32, 64, 128, 256), (1, 2, 4, 8), (1, 2, 3, 4, 5),
                                                          (32, 64, 128, 256), (1, 2)):
        tile = TileConfig(bm, bn, warps, stages)
        if not simple_case(tile, d):
            continue
        kv = torch.float8_e4m3fn if kb == 1 else torch.bfloat16
        assert solution_tile_shared_bytes(tile, d, kb) == shared_memory_bytes(tile, d, d, kv, torch.bfloat16)
        checked += 1
    assert checked > 500


def test_the_limits():
    assert H200_SHARED_MEMORY == 227 * 1024 and SM_SHARED_MEMORY == 228 * 1024


def test_model_covers_every_compiled_token_pool_tile():
    # The model is at or above what the compiler allocated (plus SLACK at most a little more) on the sweep's tiles.
    from splitkv.testing import MODEL_SHAPES

    for r in recorded_sweep():
        if r.get("page_size", 1) != 1:
            continue
        s = MODEL_SHAPES[r["model"]]
        tile = TileConfig(32 if s.num_q_heads // s.num_kv_heads * 4 > 16 else 16, r["block_n"], r["num_warps"],
                          r["num_stages"], r["k_rows"])
        kv = torch.float8_e4m3fn if r["kv_dtype"].startswith("float8") else torch.bfloat16
        model = shared_memory_bytes(tile, s.head_dim, s.head_dim, kv, torch.bfloat16, max_len_extend=4)
        assert r["shared"] <= model <= r["shared"] + 4 * SLACK, r


def _total(tile, d, kb, q_conv=True, buffers=None, row=2, kb_pool=None, p=True, slack=True):
    q = tile.block_m * d * 2 * (2 if kb == 1 and q_conv else 1)
    buffers = max(1, tile.num_stages - 1) if buffers is None else buffers(tile.num_stages)
    kv = buffers * tile.block_n * row * d * (kb if kb_pool is None else kb_pool)
    return q + kv + (tile.block_m * tile.block_n * 2 if p else 0) + (SLACK if slack else 0)


@pytest.mark.parametrize("wrong, says", [
    (lambda t, d, kb: _total(t, d, kb, row=1), "V row"),                                   # forgot V
    (lambda t, d, kb: _total(t, d, kb, buffers=lambda s: s), "num_stages - 1"),           # one buffer per stage
    (lambda t, d, kb: _total(t, d, kb, buffers=lambda s: s - 1), "still needs one buffer"),  # 0 buffers at 1 stage
    (lambda t, d, kb: _total(t, d, kb, buffers=lambda s: 1), "each pipeline stage"),      # stages ignored
    (lambda t, d, kb: _total(t, d, kb, kb_pool=2), "1-byte elements"),                    # fp8 taken as 2 bytes
    (lambda t, d, kb: _total(t, d, kb, q_conv=False), "converted"),                       # no converted query
    (lambda t, d, kb: _total(t, d, kb, p=False), "P tile"),
    (lambda t, d, kb: _total(t, d, kb, slack=False), "SLACK"),
    (lambda t, d, kb: _total(t, d, kb) / 1024, "not KB"),
])
def test_tile_checker_rejects_plausible_mistakes(wrong, says):
    with pytest.raises(AssertionError, match=says):
        check_tile_shared_bytes(wrong)


def _pps(regs, warps, shared, per_thread=True, sm_shared=SM_SHARED_MEMORY, threads=True):
    t = 32 * warps
    counts = [65536 // (regs * (t if per_thread else warps)), sm_shared // shared] + ([2048 // t] if threads else [])
    return max(1, min(counts + [32]))


@pytest.mark.parametrize("wrong, says", [
    (lambda r, w, s: _pps(r, w, s, per_thread=False), "per thread"),
    (lambda r, w, s: _pps(r, w, s, sm_shared=H200_SHARED_MEMORY), "228 KB"),
    (lambda r, w, s: _pps(r, w, s, threads=False), "2048 threads"),
])
def test_programs_checker_rejects_plausible_mistakes(wrong, says):
    with pytest.raises(AssertionError, match=says):
        check_programs_per_sm(wrong)


def test_an_unwritten_stub_waits_and_hands_on_the_solution(monkeypatch, capsys):
    monkeypatch.delenv("SPLITKV_SOLUTIONS", raising=False)

    def tile_shared_bytes(tile, head_dim, kv_bytes):
        todo("tile_shared_bytes")

    with pytest.raises(Unsolved):
        tile_shared_bytes(None, 0, 0)
    assert exercise(tile_shared_bytes, check_tile_shared_bytes) is solution_tile_shared_bytes
    out = capsys.readouterr().out
    assert out.startswith("waiting:") and "passed" not in out
