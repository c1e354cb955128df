"""splitkv.resources: the shared-memory model of the verify kernel, and the tile that fits.

No compiling here: the model is checked against ``splitkv/shared_memory_sm90.json``
(kernels compiled for sm_90 by ``python -m splitkv.bench.record_resources``) and against
the compiled kernels' shared memory that the H200 sweep recorded in ``tables/nvidia_h200.json``.
"""

import json

import pytest
import torch

from splitkv.schedule import TileConfig, block_m_for, tile_config
from splitkv.bench.record_resources import HEAD_DIMS, KV_DTYPES, TABLE_PATH, sample_points
from splitkv.resources import (H200_SHARED_MEMORY, device_shared_memory, fit_tile, rope_dim, shared_memory_bytes,
                               shared_memory_reason, tile_candidates)
from splitkv.testing import MODEL_SHAPES
from splitkv.tuning import TABLE_PATH as TUNED_PATH

LIMIT = H200_SHARED_MEMORY
DRAFTS = 4  # draft tokens per sequence in the shapes below: rows per tile = group x 4
BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


def _recorded():
    with open(TABLE_PATH) as f:
        return json.load(f)["by_triton"]


def _rows():
    return [(version, row) for version, table in _recorded().items() for row in table["rows"]]


def _model(row, q_dtype=None):
    """The model at a compiled row, in the layout it was compiled in (the recorded table's: one padded chunk)."""
    cfg = TileConfig(row["block_m"], row["block_n"], row["num_warps"], row["num_stages"], row["k_rows"])
    return shared_memory_bytes(cfg, row["head_dim"], row["v_head_dim"], row["kv_dtype"],
                               q_dtype or row["q_dtype"], row.get("page_size", 1), row.get("max_len_extend", 4),
                               kv_shared=row.get("kv_shared", False), rope=row.get("rope_dim", 0))


def _tuned():
    with open(TUNED_PATH) as f:
        return json.load(f)


#: The tuned models' (head dim, BLOCK_M) in the sweep's rows.
SWEPT = {name: (shape.head_dim, block_m_for(shape.group * DRAFTS)) for name, shape in MODEL_SHAPES.items()}


def test_recorded_table_covers_the_grid():
    """Both Triton versions are recorded, each over the whole sampled grid (every axis the brief names)."""
    recorded = _recorded()
    assert {"3.6.0", "3.9.0"} <= set(recorded)
    points = sample_points()
    assert 60 <= len(points) <= 160
    for table in recorded.values():
        rows = table["rows"]
        assert len(rows) == len(points)
        assert {(r["head_dim"], r["v_head_dim"]) for r in rows} == set(HEAD_DIMS)
        assert {r["kv_dtype"] for r in rows} == set(KV_DTYPES)
        assert {r["num_stages"] for r in rows} == {1, 2, 3, 4}
        assert {r["num_warps"] for r in rows} == {4, 8}
        assert {r["block_n"] for r in rows} == {16, 32, 64, 128}
        assert {r["page_size"] for r in rows} == {1, 16, 64}
        assert {r["k_rows"] for r in rows} == {True, False}
        assert {r["merge"] for r in rows} == {0, 1, 2}


def test_model_never_underestimates_a_compiled_kernel():
    """The model is at least every compiled kernel's shared memory, in every recorded Triton version."""
    under = [(v, r, _model(r)) for v, r in _rows() if _model(r) < r["shared"]]
    assert not under, under[:3]


def test_model_never_underestimates_the_h200_sweep():
    """...and at least what the H200 sweep's compiled kernels (Triton 3.6) needed, token and paged pools."""
    tuned = _tuned()
    for row in tuned["tile_sweep"] + tuned["paged_tile_sweep"]:
        d, bm = SWEPT[row["model"]]
        full = dict(row, head_dim=d, v_head_dim=d, block_m=bm, q_dtype="bfloat16")
        assert _model(full) >= row["shared"], row


def test_model_is_close_for_the_tuned_tiles():
    """Within 15 % of the compiled kernel for every tile the H200 table serves (token and paged pools)."""
    tuned = _tuned()
    for table, sweep in (("tiles", "tile_sweep"), ("paged_tiles", "paged_tile_sweep")):
        for tile in tuned[table]:
            kv = "bfloat16" if tile["kv_bytes"] == 2 else "float8_e4m3fn"
            keys = ("block_n", "num_warps", "num_stages", "k_rows", "page_size")
            measured = [r for r in tuned[sweep] if SWEPT[r["model"]] == (tile["head_dim"], tile["block_m"])
                        and r["kv_dtype"] == kv and all(r.get(k, 1) == tile.get(k, 1) for k in keys)]
            assert len(measured) == 1, tile
            model = _model(dict(tile, v_head_dim=tile["head_dim"], kv_dtype=kv, q_dtype="bfloat16"))
            assert measured[0]["shared"] <= model <= 1.15 * measured[0]["shared"], (tile, model)


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("kv_dtype", [BF16, FP8])
@pytest.mark.parametrize("name", sorted(MODEL_SHAPES))
def test_fit_tile_keeps_the_tuned_tiles(name, kv_dtype, page_size):
    """The tuned model shapes' tiles fit the H200 as they are."""
    shape = MODEL_SHAPES[name]
    d = shape.head_dim
    cfg = tile_config(d, d, shape.group * DRAFTS, kv_bytes=kv_dtype.itemsize, page_size=page_size)
    assert fit_tile(cfg, d, d, kv_dtype, BF16, LIMIT, page_size) == cfg
    assert shared_memory_reason(cfg, d, d, kv_dtype, BF16, LIMIT, page_size) is None


#: The two-chunk layout (``ROPE_DIM``) compiled for sm_90 with Triton 3.9.0: ``compile_shared`` of
#: ``dict(_point(D, Dv, BLOCK_M, BLOCK_N, warps, stages, False, pool, page, merge, q=queries,
#: features=features), rope_dim=D - Dv, kv_shared=kv_shared)`` (:mod:`splitkv.bench.record_resources`,
#: 4 drafts), and the shared memory it reported.
CHUNKED_COMPILED = [
    # (D, Dv, BLOCK_M, BLOCK_N, warps, stages, pool, queries, page, merge, features, kv_shared, bytes)
    (576, 512, 64, 32, 8, 1, "bfloat16", "bfloat16", 1, 1, False, True, 131072),
    (576, 512, 64, 32, 8, 2, "bfloat16", "bfloat16", 1, 1, False, True, 147584),
    (576, 512, 64, 64, 8, 1, "bfloat16", "bfloat16", 1, 1, False, True, 147456),
    (576, 512, 64, 64, 8, 2, "bfloat16", "bfloat16", 1, 1, False, True, 221440),
    (576, 512, 64, 32, 8, 1, "bfloat16", "bfloat16", 1, 1, False, False, 143360),
    (576, 512, 64, 32, 8, 2, "bfloat16", "bfloat16", 1, 1, False, False, 213120),
    (576, 512, 64, 64, 8, 1, "bfloat16", "bfloat16", 1, 1, False, False, 212992),
    (576, 512, 64, 64, 8, 2, "bfloat16", "bfloat16", 16, 1, False, True, 221200),
    (576, 512, 64, 64, 8, 2, "bfloat16", "bfloat16", 64, 1, False, True, 221184),
    (576, 512, 64, 64, 8, 2, "bfloat16", "bfloat16", 1, 1, True, True, 221440),
    (576, 512, 64, 64, 8, 2, "bfloat16", "bfloat16", 1, 2, False, True, 221440),
    (576, 512, 64, 64, 8, 2, "bfloat16", "bfloat16", 1, 0, False, True, 221440),
    (576, 512, 64, 32, 8, 1, "float8_e4m3fn", "bfloat16", 1, 1, False, True, 131072),
    (576, 512, 64, 32, 8, 2, "float8_e4m3fn", "bfloat16", 1, 1, False, True, 131072),
    (576, 512, 64, 64, 8, 1, "float8_e4m3fn", "bfloat16", 1, 1, False, True, 147456),
    (576, 512, 64, 64, 8, 2, "float8_e4m3fn", "bfloat16", 1, 1, False, True, 184576),
    (576, 512, 64, 32, 8, 1, "float8_e4m3fn", "bfloat16", 1, 1, False, False, 143360),
    (576, 512, 64, 32, 8, 2, "float8_e4m3fn", "bfloat16", 1, 1, False, False, 178304),
    (576, 512, 64, 64, 8, 1, "float8_e4m3fn", "bfloat16", 1, 1, False, False, 212992),
    (576, 512, 64, 64, 8, 2, "float8_e4m3fn", "bfloat16", 16, 1, False, True, 184336),
    (576, 512, 64, 64, 8, 2, "float8_e4m3fn", "bfloat16", 64, 1, False, True, 184320),
    (576, 512, 64, 64, 8, 2, "float8_e4m3fn", "bfloat16", 1, 1, True, True, 184576),
    (576, 512, 64, 64, 8, 2, "float8_e4m3fn", "bfloat16", 1, 2, False, True, 184576),
    (576, 512, 64, 64, 8, 2, "float8_e4m3fn", "bfloat16", 1, 0, False, True, 184576),
    (576, 512, 64, 32, 8, 2, "float8_e4m3fn", "bfloat16", 64, 1, False, True, 131072),
    (576, 512, 64, 64, 4, 2, "bfloat16", "bfloat16", 1, 1, False, True, 221440),
    (576, 512, 64, 64, 8, 2, "float8_e4m3fn", "float16", 1, 1, False, True, 184576),
    (576, 512, 64, 16, 8, 1, "float32", "float32", 1, 1, False, True, 184576),
    (576, 512, 64, 32, 8, 1, "float32", "float32", 1, 1, False, True, 221440),
    (576, 512, 64, 16, 8, 2, "float32", "float32", 1, 1, False, True, 188736),
    (576, 512, 64, 16, 8, 1, "float32", "float32", 1, 1, False, False, 217088),
    (192, 128, 16, 128, 4, 2, "bfloat16", "bfloat16", 1, 1, False, False, 92160),
    (192, 128, 32, 64, 4, 3, "bfloat16", "bfloat16", 1, 1, False, False, 58368),
    (192, 128, 16, 128, 4, 2, "float8_e4m3fn", "bfloat16", 1, 1, False, False, 51200),
    (80, 64, 64, 32, 4, 2, "bfloat16", "bfloat16", 1, 1, False, True, 20608),
]


def test_model_never_underestimates_the_chunked_kernels():
    """At or above every compiled two-chunk kernel (MLA's 576/512, 192/128, 80/64), and within 40 % of
    the MLA tiles the plan picks from (64 rows, 8 warps, bf16 or fp8 pools, 32-64 keys, 1-2 stages)."""
    for d, dv, bm, bn, warps, stages, pool, queries, page, merge, features, shared, compiled in CHUNKED_COMPILED:
        cfg = TileConfig(bm, bn, warps, stages)
        model = shared_memory_bytes(cfg, d, dv, pool, queries, page, DRAFTS, kv_shared=shared)
        assert model >= compiled, (d, bm, bn, warps, stages, pool, page, merge, features, shared, model, compiled)
        if (d, bm, warps) == (576, 64, 8) and pool != "float32":
            assert model <= 1.4 * compiled, (bn, stages, pool, page, shared, model, compiled)


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("q_heads", [16, 128])
@pytest.mark.parametrize("kv_dtype", [BF16, FP8])
def test_mla_gets_a_real_tile(q_heads, kv_dtype, page_size):
    """MLA (576 = 512 + 64 / 512, one KV head, 64-row tiles) in two chunks: its default tile (64 keys, two
    stages, 8 warps) fits the H200 as it is with V a view of K, bf16 and fp8 pools alike; with V a pool of
    its own a smaller tile does (32-64 keys, 1-2 stages). Padded to one 1024-wide chunk, as the kernel
    took it before, the fp8 pool had no tile at all, and bf16 only 32 keys in one stage."""
    cfg = tile_config(576, 512, q_heads * DRAFTS, kv_bytes=kv_dtype.itemsize, page_size=page_size)
    assert (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages) == (64, 64, 8, 2)
    assert fit_tile(cfg, 576, 512, kv_dtype, BF16, LIMIT, page_size, kv_shared=True) == cfg
    alone = fit_tile(cfg, 576, 512, kv_dtype, BF16, LIMIT, page_size)
    assert 32 <= alone.block_n <= 64 and alone.num_stages in (1, 2) and alone.num_warps == 8
    assert shared_memory_bytes(alone, 576, 512, kv_dtype, BF16, page_size) <= LIMIT
    padded = [t for t in tile_candidates(cfg)
              if shared_memory_bytes(t, 576, 512, kv_dtype, BF16, page_size, rope=0) <= LIMIT]
    assert [(t.block_n, t.num_stages) for t in padded] == ([] if kv_dtype == FP8 else [(32, 1), (16, 2), (16, 1)])


def test_rope_dim():
    """Two chunks where the head is Dv plus a power of two (both at least 16) and not a power of two itself."""
    pairs = ((576, 512), (192, 128), (80, 64), (320, 256), (96, 64))
    assert [rope_dim(d, dv) for d, dv in pairs] == [64, 64, 16, 64, 32]
    assert [rope_dim(d, dv) for d, dv in ((128, 128), (512, 512), (96, 96), (72, 64), (576, 576), (64, 32))] == [0] * 6


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("kv_dtype, q_dtype", [(BF16, BF16), (torch.float16, torch.float16), (FP8, BF16),
                                               (torch.float32, torch.float32)])
@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (192, 128), (256, 256), (512, 512)])
def test_head_dims_up_to_512_get_a_fitting_tile(dims, kv_dtype, q_dtype, page_size):
    """Up to head dim 512 every group size gets a tile within the limit: the table's own when it
    fits, else the first smaller candidate that does (BLOCK_M, warps and the K layout kept)."""
    d, dv = dims
    for group in (1, 4, 8, 16, 32):
        cfg = tile_config(d, dv, group * DRAFTS, kv_bytes=kv_dtype.itemsize, page_size=page_size)
        tile = fit_tile(cfg, d, dv, kv_dtype, q_dtype, LIMIT, page_size)
        assert tile is not None, (dims, group, cfg)
        fits = [t for t in tile_candidates(cfg)
                if shared_memory_bytes(t, d, dv, kv_dtype, q_dtype, page_size) <= LIMIT]
        assert tile == fits[0]
        assert (tile.block_m, tile.num_warps, tile.k_rows) == (cfg.block_m, cfg.num_warps, cfg.k_rows)
        assert tile.block_n <= cfg.block_n


def test_candidates_order():
    """Fewer stages first, then half the keys; down to 16 keys in one stage."""
    cfg = TileConfig(64, 64, 4, 3, True)
    got = [(t.block_n, t.num_stages) for t in tile_candidates(cfg)]
    assert got == [(64, 3), (64, 2), (64, 1), (32, 3), (32, 2), (32, 1), (16, 3), (16, 2), (16, 1)]
    assert all(t.block_m == 64 and t.num_warps == 4 and t.k_rows for t in tile_candidates(cfg))


def test_model_grows_with_the_tile():
    """More keys per step never need less shared memory (the search's premise)."""
    for d, dv in HEAD_DIMS:
        for kv, q in ((BF16, BF16), (FP8, BF16), (torch.float32, torch.float32)):
            for stages in (1, 2, 3, 4):
                sizes = [shared_memory_bytes(TileConfig(32, bn, 4, stages), d, dv, kv, q) for bn in (16, 32, 64, 128)]
                assert sizes == sorted(sizes)


def test_no_limit_and_the_cpu():
    """``limit=None`` keeps the tile; the CPU (the interpreter) has no shared-memory limit."""
    cfg = TileConfig(64, 64, 4, 3)
    assert fit_tile(cfg, 576, 512, BF16, BF16, None) == cfg
    assert shared_memory_reason(cfg, 576, 512, BF16, BF16, None) is None
    assert device_shared_memory("cpu") is None
    if not torch.cuda.is_available():
        assert device_shared_memory() is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_device_limit():
    """On a GPU, the device's opt-in per-block limit (232448 on the H200)."""
    props = torch.cuda.get_device_properties(0)
    assert device_shared_memory("cuda:0") == props.shared_memory_per_block_optin
    if "H200" in props.name or "H100" in props.name:
        assert device_shared_memory(torch.device("cuda", 0)) == H200_SHARED_MEMORY


def test_record_points_are_what_the_table_holds():
    """The recorded rows are :func:`sample_points` (same order), so a re-record replaces like with like."""
    keys = list(sample_points()[0])
    for table in _recorded().values():
        assert [{k: r[k] for k in keys} for r in table["rows"]] == sample_points()

