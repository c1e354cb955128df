"""The H200's table (``splitkv/tables/nvidia_h200.json``) and how ``python -m splitkv.bench.tune`` updates tables.

The sweep itself needs a GPU; here its table-keeping is checked with a
stand-in sweep, and the committed table against the models it must cover.
Where tables are read and written, and untuned GPUs: ``tests/test_tuning_tables.py``.
"""

import json
import warnings
from types import SimpleNamespace

import pytest
import torch

from splitkv import tuning
from splitkv.bench import tune
from splitkv.bench.breadth import PAGE_SIZES
from splitkv.schedule import block_m_for, rows_per_tile
from splitkv.testing import MODEL_SHAPES


#: What a table row copies from the sweep record it was chosen from.
TILE_FIELDS = ("block_n", "num_warps", "num_stages", "k_rows", "programs_per_sm")


def _committed():
    with open(tuning.TABLE_PATH) as f:
        return json.load(f)


def _model_keys():
    """(head dim, BLOCK_M) of every labelled model at 4 draft tokens."""
    return [(s.head_dim, block_m_for(rows_per_tile(s.group, 4))) for s in MODEL_SHAPES.values()]


def _chosen_from(row, sweep):
    """The sweep records ``row`` was chosen among: its model, pool dtype and (paged rows) page size."""
    kv_name = "float8_e4m3fn" if row["kv_bytes"] == 1 else "bfloat16"
    records = [r for r in sweep if (r["model"], r["kv_dtype"], r.get("page_size", 1))
               == (row["from_model"], kv_name, row.get("page_size", 1))]
    best = min(records, key=lambda r: r["us"])
    assert {f: row[f] for f in TILE_FIELDS} == {f: best[f] for f in TILE_FIELDS}, row
    return records


def test_committed_table_has_one_tile_per_model_and_pool_dtype():
    keys = [(r["head_dim"], r["block_m"], r["kv_bytes"]) for r in _committed()["tiles"]]
    assert len(keys) == len(set(keys))
    for head_dim, block_m in _model_keys():
        for kv_bytes in (1, 2):
            assert (head_dim, block_m, kv_bytes) in keys


def test_committed_paged_tiles_cover_every_model_and_page_size():
    """Paged rows for every model and pool dtype at every page size the breadth benchmark times."""
    keys = [(r["head_dim"], r["block_m"], r["kv_bytes"], r["page_size"]) for r in _committed()["paged_tiles"]]
    assert len(keys) == len(set(keys))
    for head_dim, block_m in _model_keys():
        for kv_bytes in (1, 2):
            for page_size in PAGE_SIZES:
                assert (head_dim, block_m, kv_bytes, page_size) in keys


def test_committed_paged_tiles_are_the_sweeps_fastest():
    """Each paged row is the fastest record of its (model, pool dtype, page size) in ``paged_tile_sweep``,
    over a grid with a fourth pipeline stage."""
    table = _committed()
    for row in table["paged_tiles"]:
        records = _chosen_from(row, table["paged_tile_sweep"])
        assert {r["num_stages"] for r in records} == set(tune.PAGED_STAGES)


def test_committed_tiles_are_the_sweeps_fastest():
    """Each tile row is the fastest record of its (model, pool dtype) in ``tile_sweep``, K layout included."""
    table = _committed()
    for row in table["tiles"]:
        records = _chosen_from(row, table["tile_sweep"])
        assert {r["k_rows"] for r in records} == {False, True}


def test_tiles_only_replaces_one_pool_dtype_and_keeps_the_rest(tmp_path, monkeypatch):
    table = _committed()
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table))

    def fake_sweep(log, kv_dtypes):
        assert list(kv_dtypes) == ["float8_e4m3fn"]
        rows = [dict(r, block_n=16, us=1.0) for r in table["tiles"] if r["kv_bytes"] == 1]
        return rows, [dict(model="m", kv_dtype="float8_e4m3fn", us=1.0)]

    monkeypatch.setattr(tune, "sweep_tiles", fake_sweep)
    new = tune._tiles_only(str(path), "float8_e4m3fn", lambda msg: None)
    by_bytes = lambda t, b: sorted((r["head_dim"], r["block_m"], r["block_n"]) for r in t["tiles"]  # noqa: E731
                                   if r["kv_bytes"] == b)
    assert by_bytes(new, 2) == by_bytes(table, 2)
    assert {r["block_n"] for r in new["tiles"] if r["kv_bytes"] == 1} == {16}
    assert len(new["tiles"]) == len(table["tiles"])
    assert [r for r in new["tile_sweep"] if r["kv_dtype"] == "bfloat16"] == \
        [r for r in table["tile_sweep"] if r["kv_dtype"] == "bfloat16"]
    assert [r for r in new["tile_sweep"] if r["kv_dtype"] == "float8_e4m3fn"] == \
        [dict(model="m", kv_dtype="float8_e4m3fn", us=1.0)]
    for key in ("min_split_tokens", "small_batch_tiles", "split_sweep"):
        assert new[key] == table[key]


def test_paged_only_replaces_one_pool_dtypes_paged_rows(tmp_path, monkeypatch):
    table = _committed()
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table))
    new_row = dict(head_dim=256, block_m=32, kv_bytes=2, page_size=16, block_n=16, from_model="m", us=1.0)

    def fake_sweep(log, kv_dtypes):
        assert list(kv_dtypes) == ["bfloat16"]
        return [new_row], [dict(model="m", kv_dtype="bfloat16", page_size=16, us=1.0)]

    monkeypatch.setattr(tune, "sweep_paged_tiles", fake_sweep)
    new = tune._tiles_only(str(path), "bfloat16", lambda msg: None, paged=True)
    assert [r for r in new["paged_tiles"] if r["kv_bytes"] == 2] == [new_row]
    assert [r for r in new["paged_tiles"] if r["kv_bytes"] != 2] == \
        [r for r in table["paged_tiles"] if r["kv_bytes"] != 2]
    assert [r for r in new["paged_tile_sweep"] if r["kv_dtype"] != "bfloat16"] == \
        [r for r in table["paged_tile_sweep"] if r["kv_dtype"] != "bfloat16"]
    for key in ("tiles", "tile_sweep", "min_split_tokens", "small_batch_tiles", "split_sweep"):
        assert new[key] == table[key]


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """An empty user table directory, tables read afresh."""
    monkeypatch.setenv(tuning.TUNED_DIR_ENV, str(tmp_path / "user"))
    tuning.clear_cache()
    yield tmp_path / "user"
    tuning.clear_cache()


def test_the_sweep_writes_the_user_table_never_the_packages(user_dir):
    """By default ``<user dir>/<normalised name>.json`` (``--replace`` too, now); ``--out`` elsewhere."""
    parse = tune._parser().parse_args
    assert tune.out_path(parse([]), "NVIDIA A100-SXM4-80GB") == str(user_dir / "nvidia_a100_sxm4_80gb.json")
    assert tune.out_path(parse([]), "NVIDIA H200") == str(user_dir / "nvidia_h200.json") != tuning.TABLE_PATH
    assert tune.out_path(parse(["--out", "t.json"]), "NVIDIA H200") == "t.json"
    assert tune.out_path(parse(["--replace", "--small-batch"]), "NVIDIA H200") == str(user_dir / "nvidia_h200.json")
    with pytest.raises(SystemExit):
        parse(["--out", "t.json", "--replace"])


def test_a_partial_sweep_updates_the_output_file_or_the_table_the_gpu_reads(tmp_path, user_dir):
    """The output file when it exists; else the GPU's own table (user directory first); else the H200's."""
    assert tune.base_path(str(tmp_path / "new.json"), "NVIDIA A100-SXM4-80GB") == tuning.TABLE_PATH
    assert tune.base_path(str(tmp_path / "new.json"), "NVIDIA H200") == tuning.TABLE_PATH
    existing = tmp_path / "mine.json"
    existing.write_text("{}")
    assert tune.base_path(str(existing), "NVIDIA A100-SXM4-80GB") == str(existing)
    user_dir.mkdir()
    (user_dir / "nvidia_a100_sxm4_80gb.json").write_text("{}")
    assert tune.base_path(str(tmp_path / "new.json"), "NVIDIA A100-SXM4-80GB") == \
        str(user_dir / "nvidia_a100_sxm4_80gb.json")


def test_the_sweep_plans_with_read_only_tables_installed_for_the_gpu(monkeypatch, user_dir):
    """Sweep 3 with stand-in plans: the usual schedule is timed without the key's small-batch row, each
    candidate with its own, nothing stays installed after; and ``sweep_table`` is measured only for a
    table swept on this GPU."""
    monkeypatch.setattr(tuning, "interpreting", lambda: False)
    name = "NVIDIA H200"
    monkeypatch.setattr(tune, "current_table", lambda: tuning.table_named(name))
    data = tuning.table_named(name).to_json()
    assert tune.sweep_table(data).measured
    assert not tune.sweep_table(data, device="NVIDIA A100-SXM4-80GB").measured
    seen = []

    def fake_plan(p, **kw):
        table = tuning.table_named(name)
        row = table.small_batch_tiles.get(p)
        seen.append((p, None if row is None else (row["block_n"], row["num_warps"], row["num_stages"])))
        return None, lambda: 50.0 if seen[-1][1] == (64, 8, 3) else 100.0

    monkeypatch.setattr(tune, "_problem", lambda model, bs, prefix, kv: (tune.MODEL_SHAPES[model].head_dim,
                                                                         block_m_for(rows_per_tile(
                                                                             tune.MODEL_SHAPES[model].group, 4)), 2))
    monkeypatch.setattr(tune, "_timed_plan", fake_plan)
    monkeypatch.setattr(tune, "graph_time_us", lambda run: run())
    before = tuning.table_named(name)
    rows, sweep = tune.sweep_small_batch(lambda msg: None, data)
    assert tuning.table_named(name) is before
    assert {(r["block_n"], r["num_warps"], r["num_stages"]) for r in rows} == {(64, 8, 3)}
    assert len(rows) == len(MODEL_SHAPES)
    usual = [tile for key, tile in seen if tile is None]
    assert len(usual) == 2 * len(MODEL_SHAPES)  # two prefixes per model, timed without the key's row
    assert (64, 8, 3) in {tile for _, tile in seen}


def test_a_partial_sweep_notes_the_gpu_it_ran_on():
    table = tune._partial({"device": "NVIDIA H200"}, "tiles", "NVIDIA A100-SXM4-80GB")
    assert table["device"] == "NVIDIA H200"
    assert [(r["part"], r["device"]) for r in table["partial_sweeps"]] == [("tiles", "NVIDIA A100-SXM4-80GB")]


@pytest.mark.parametrize("interpreting, name, warns", [(False, "NVIDIA A100-SXM4-80GB", True),
                                                       (False, "NVIDIA H200", False),
                                                       (True, "NVIDIA A100-SXM4-80GB", False)])
def test_a_gpu_without_a_tuned_table_gets_one_notice(monkeypatch, user_dir, interpreting, name, warns):
    """The H200's tile shapes serve as defaults; one warning line, once per process, says how to tune."""
    monkeypatch.setattr(tuning, "interpreting", lambda: interpreting)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: SimpleNamespace(
        name=name, multi_processor_count=108, shared_memory_per_multiprocessor=167936,
        shared_memory_per_block_optin=166912, regs_per_multiprocessor=65536, warp_size=32,
        max_threads_per_multi_processor=2048))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = [tuning.table_for(torch.device("cuda", 0)).tile(128, 16, 2, 1) for _ in range(3)]
        tuning.small_batch_tile(128, 16, 2, 1, 108, 4096)
    assert all(r == rows[0] for r in rows)
    notices = [w for w in caught if "splitkv.bench.tune" in str(w.message)]
    assert len(notices) == (1 if warns else 0)
    if warns:
        text = str(notices[0].message)
        assert "\n" not in text and name in text and "python -m splitkv.bench.tune" in text
        assert str(user_dir / "nvidia_a100_sxm4_80gb.json") in text
