"""The sweep's table (``splitkv/tuned_h200.json``) and how ``python -m splitkv.bench.tune`` updates it.

The sweep itself needs a GPU; here its table-keeping is checked with a
stand-in sweep, and the committed table against the models it must cover.
"""

import json
import warnings

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


def test_the_sweep_writes_a_new_file_unless_told_to_replace():
    """By default ``tuned_<gpu>.json`` in the working directory; the package's table only with --replace."""
    parse = tune._parser().parse_args
    assert tune.out_path(parse([]), "NVIDIA A100-SXM4-80GB") == "tuned_a100.json"
    assert tune.out_path(parse([]), "NVIDIA H200") == "tuned_h200.json" != tuning.TABLE_PATH
    assert tune.out_path(parse(["--out", "t.json"]), "NVIDIA H200") == "t.json"
    assert tune.out_path(parse(["--replace", "--small-batch"]), "NVIDIA H200") == tuning.TABLE_PATH
    with pytest.raises(SystemExit):
        parse(["--out", "t.json", "--replace"])


def test_a_partial_sweep_updates_the_output_file_or_the_packages_table(tmp_path):
    assert tune.base_path(str(tmp_path / "new.json")) == tuning.TABLE_PATH
    existing = tmp_path / "tuned_a100.json"
    existing.write_text("{}")
    assert tune.base_path(str(existing)) == str(existing)


@pytest.mark.parametrize("interpreting, name, warns", [(False, "NVIDIA A100-SXM4-80GB", True),
                                                       (False, "NVIDIA H200", False),
                                                       (True, "NVIDIA A100-SXM4-80GB", False)])
def test_a_gpu_without_a_tuned_table_gets_one_notice(monkeypatch, interpreting, name, warns):
    """The table's entries serve as defaults; one warning line, once per process, says how to tune."""
    monkeypatch.setattr(tuning, "_untuned_checked", False)
    monkeypatch.setattr(tuning, "interpreting", lambda: interpreting)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = [tuning._tile_row(128, 16, 2, 1) for _ in range(3)]
    assert all(r is rows[0] for r in rows)
    notices = [w for w in caught if "splitkv.bench.tune" in str(w.message)]
    assert len(notices) == (1 if warns else 0)
    if warns:
        text = str(notices[0].message)
        assert "\n" not in text and name in text and "python -m splitkv.bench.tune --replace" in text
