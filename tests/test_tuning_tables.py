"""Tuned tables per GPU (:mod:`splitkv.tuning`): the H200's answers unchanged, the user directory read
first and written by the sweep, an untuned GPU's programs per SM from its own properties, read-only
tables, safe file names. No GPU: devices are faked with small property objects."""

import dataclasses
import functools
import itertools
import json
import os
import re
import tomllib
import warnings
from types import SimpleNamespace

import pytest
import torch

from splitkv import tuning
from splitkv.bench import tune

H200 = "NVIDIA H200"
#: torch.cuda.get_device_properties of an H200 (the fields the tables read), and of GPUs with less shared memory.
H200_PROPS = dict(name=H200, multi_processor_count=132, shared_memory_per_multiprocessor=233472,
                  shared_memory_per_block_optin=232448, shared_memory_per_block=49152, regs_per_multiprocessor=65536,
                  warp_size=32, max_threads_per_multi_processor=2048)
A100_PROPS = dict(H200_PROPS, name="NVIDIA A100-SXM4-80GB", multi_processor_count=108,
                  shared_memory_per_multiprocessor=167936, shared_memory_per_block_optin=166912)
RTX4090_PROPS = dict(H200_PROPS, name="NVIDIA GeForce RTX 4090", multi_processor_count=128,
                     shared_memory_per_multiprocessor=102400, shared_memory_per_block_optin=101376,
                     max_threads_per_multi_processor=1536)
#: A ROCm build's properties: no opt-in figure, no registers, 64-thread wavefronts (torch.version.hip set).
MI300_PROPS = dict(name="AMD Instinct MI300X", multi_processor_count=304, shared_memory_per_block=65536,
                   warp_size=64, gcnArchName="gfx942:sramecc+:xnack-")


@pytest.fixture(autouse=True)
def _fresh(tmp_path, monkeypatch):
    """An empty user table directory, tables read afresh, and GPU rules (no interpreter) unless a test says."""
    monkeypatch.setenv(tuning.TUNED_DIR_ENV, str(tmp_path / "user"))
    monkeypatch.setattr(tuning, "interpreting", lambda: False)
    tuning.clear_cache()
    yield
    tuning.clear_cache()


# ---------------------------------------------------------------------------- the old rules, for comparison
# A copy of splitkv/tuning.py's module functions before the tables moved (as of 2026-12-04), reading the
# H200 table's JSON: the new objects must give the same answers for the H200 (and under the interpreter).


class OldRules:
    def __init__(self, path):
        with open(path) as f:
            table = json.load(f)
        table["tiles"] = {(r["head_dim"], r["block_m"], r["kv_bytes"]): r for r in table["tiles"]}
        table["paged_tiles"] = {(r["head_dim"], r["block_m"], r["kv_bytes"], r["page_size"]): r
                                for r in table.get("paged_tiles", [])}
        table["small_batch_tiles"] = {(r["head_dim"], r["block_m"], r["kv_bytes"]): r
                                      for r in table.get("small_batch_tiles", [])}
        self.TUNED = table
        self.DEFAULT_TILES = {
            (576, block_m, kv_bytes): dict(head_dim=576, block_m=block_m, kv_bytes=kv_bytes, block_n=64,
                                           num_warps=8, num_stages=2, k_rows=False, programs_per_sm=1,
                                           measured=kv_bytes == 2)
            for kv_bytes in (1, 2) for block_m in (32, 64)}
        self._nearest = functools.lru_cache(maxsize=None)(self._nearest_uncached)

    def _nearest_uncached(self, head_dim, block_m, kv_bytes):
        tiles = self.TUNED["tiles"]
        if (head_dim, block_m, kv_bytes) in tiles:
            return tiles[(head_dim, block_m, kv_bytes)]
        if (head_dim, block_m, kv_bytes) in self.DEFAULT_TILES:
            return self.DEFAULT_TILES[(head_dim, block_m, kv_bytes)]
        same = [k for k in tiles if k[2] == kv_bytes] or list(tiles)
        key = min(same, key=lambda k: (abs(k[0] - head_dim), abs(k[1] - block_m)))
        return tiles[key]

    def paged_tile_row(self, head_dim, block_m, kv_bytes, page_size):
        if page_size <= 1:
            return None
        rows = [(key[3], row) for key, row in self.TUNED["paged_tiles"].items()
                if key[:3] == (head_dim, block_m, kv_bytes) and key[3] <= page_size]
        return max(rows, key=lambda r: r[0])[1] if rows else None

    def _tile_row(self, head_dim, block_m, kv_bytes, page_size):
        return self.paged_tile_row(head_dim, block_m, kv_bytes, page_size) or self._nearest(head_dim, block_m,
                                                                                           kv_bytes)

    def tuned_tile(self, head_dim, block_m, kv_bytes, page_size=1):
        if kv_bytes > 2:
            block_n, warps, stages, _ = self.tuned_tile(head_dim, block_m, 2, page_size)
            return max(16, block_n // 2), warps, min(stages, 2), self.k_rows(head_dim, block_m, kv_bytes, page_size)
        row = self._tile_row(head_dim, block_m, kv_bytes, page_size)
        return row["block_n"], row["num_warps"], row["num_stages"], self.k_rows(head_dim, block_m, kv_bytes,
                                                                                 page_size)

    def k_rows(self, head_dim, block_m, kv_bytes, page_size=1):
        row = self.paged_tile_row(head_dim, block_m, kv_bytes, page_size) or self.TUNED["tiles"].get(
            (head_dim, block_m, kv_bytes))
        return bool(row is not None and row.get("k_rows", False))

    def programs_per_sm(self, head_dim, block_m, kv_bytes, page_size=1):
        return self._tile_row(head_dim, block_m, kv_bytes, page_size)["programs_per_sm"]

    def min_split_tokens(self, interpreting):
        return 32 if interpreting else self.TUNED["min_split_tokens"]

    def small_batch_tile(self, head_dim, block_m, kv_bytes, tiles, num_sms, prefix_len=0):
        if tiles * 8 > num_sms or prefix_len > 16384:
            return None
        row = self.TUNED["small_batch_tiles"].get((head_dim, block_m, kv_bytes))
        if row is None:
            return None
        return row["block_n"], row["num_warps"], row["num_stages"], self.k_rows(head_dim, block_m, kv_bytes)


HEAD_DIMS = (32, 64, 80, 96, 128, 160, 192, 256, 320, 512, 576, 1024)
BLOCK_MS = (16, 32, 64)
KV_BYTES = (1, 2, 4)
PAGE_SIZES = (1, 8, 16, 32, 64, 128)


def _grid():
    return itertools.product(HEAD_DIMS, BLOCK_MS, KV_BYTES, PAGE_SIZES)


def _same_answers(table, old):
    for hd, bm, kb, ps in _grid():
        key = (hd, bm, kb, ps)
        assert table.tile(hd, bm, kb, ps) == old.tuned_tile(hd, bm, kb, ps), key
        assert table.programs_per_sm(hd, bm, kb, ps) == old.programs_per_sm(hd, bm, kb, ps), key
        assert table.k_rows(hd, bm, kb, ps) == old.k_rows(hd, bm, kb, ps), key
        new_row, old_row = table.paged_tile_row(hd, bm, kb, ps), old.paged_tile_row(hd, bm, kb, ps)
        assert (new_row is None and old_row is None) or dict(new_row) == old_row, key
    for hd, bm, kb in itertools.product(HEAD_DIMS, BLOCK_MS, KV_BYTES):
        for tiles, sms, prefix in itertools.product((1, 2, 8, 16, 17, 33), (66, 132), (0, 4096, 16384, 16385)):
            assert table.small_batch_tile(hd, bm, kb, tiles, sms, prefix) == \
                old.small_batch_tile(hd, bm, kb, tiles, sms, prefix), (hd, bm, kb, tiles, sms, prefix)


def test_the_h200_table_moved_unchanged_and_ships_with_the_package():
    assert tuning.TABLE_PATH == os.path.join(tuning.PACKAGE_TABLES, "nvidia_h200.json")
    assert not os.path.exists(os.path.join(os.path.dirname(tuning.__file__), "tuned_h200.json"))
    with open(tuning.TABLE_PATH) as f:
        data = json.load(f)
    assert data["device"] == H200 and data["min_split_tokens"] == 128 and len(data["tiles"]) == 6
    with open(os.path.join(os.path.dirname(os.path.dirname(tuning.__file__)), "pyproject.toml"), "rb") as f:
        package_data = tomllib.load(f)["tool"]["setuptools"]["package-data"]["splitkv"]
    assert "tables/*.json" in package_data


def test_the_h200_gets_the_old_answers():
    """Every key of the grid (head dims, rows, pool bytes, page sizes, small launches): the H200's table object
    answers as the old module functions did, and so does the interpreter's, and so do the kept wrappers."""
    old = OldRules(tuning.TABLE_PATH)
    table = tuning.table_named(H200, tuning.DeviceLimits.from_properties(SimpleNamespace(**H200_PROPS), hip=False))
    assert (table.device_name, table.source, table.measured) == (H200, tuning.TABLE_PATH, True)
    assert table.min_split_tokens() == old.min_split_tokens(False) == 128
    _same_answers(table, old)
    interp = tuning.table_for(None)
    assert interp is tuning.table_for(torch.device("cpu")) and interp.interpreter
    assert interp.min_split_tokens() == old.min_split_tokens(True) == 32
    _same_answers(interp, old)
    # One row answers as the separate lookups did (the interpreter's table, on any machine).
    for hd, bm, kb, ps in _grid():
        row = interp.row(hd, bm, kb, ps)
        assert (row.block_n, row.num_warps, row.num_stages, row.k_rows) == old.tuned_tile(hd, bm, kb, ps)
        assert row.programs_per_sm == old.programs_per_sm(hd, bm, kb, ps)
    if torch.cuda.is_available():
        return  # the kept wrappers below answer for this GPU's table there
    assert tuning.small_batch_tile(128, 16, 2, 1, 132, 4096) == old.small_batch_tile(128, 16, 2, 1, 132, 4096)
    assert tuning.TUNED["tiles"].keys() == old.TUNED["tiles"].keys()
    assert tuning.TUNED["min_split_tokens"] == old.TUNED["min_split_tokens"]


# ---------------------------------------------------------------------------- where tables are read and written


def test_the_user_directory_is_read_first(tmp_path, monkeypatch):
    """A table in $SPLITKV_TUNED_DIR under the device's name wins over the package's; the package's file
    is not touched."""
    with open(tuning.TABLE_PATH, "rb") as f:
        shipped = f.read()
    data = json.loads(shipped)
    data["min_split_tokens"] = 64
    data["tiles"][0]["block_n"] = 16
    user = tmp_path / "user"
    user.mkdir()
    (user / "nvidia_h200.json").write_text(json.dumps(data))
    table = tuning.table_named(H200)
    assert table.source == str(user / "nvidia_h200.json") and table.measured
    assert table.min_split_tokens() == 64
    row = data["tiles"][0]
    assert table.tile(row["head_dim"], row["block_m"], row["kv_bytes"])[0] == 16
    assert tuning.table_path(H200) == str(user / "nvidia_h200.json")
    with open(tuning.TABLE_PATH, "rb") as f:
        assert f.read() == shipped
    # Elsewhere, the package's table.
    monkeypatch.setenv(tuning.TUNED_DIR_ENV, str(tmp_path / "other"))
    assert tuning.table_named(H200).source == tuning.TABLE_PATH


def test_an_unreadable_user_table_is_skipped_with_a_warning(tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    (user / "nvidia_h200.json").write_text("{not json")
    (user / "nvidia_a100_sxm4_80gb.json").write_text(json.dumps({"device": "NVIDIA A100-SXM4-80GB"}))
    with pytest.warns(UserWarning, match="ignoring the tuned table"):
        table = tuning.table_named(H200)
    assert table.source == tuning.TABLE_PATH and table.measured
    with pytest.warns(UserWarning, match="ignoring the tuned table"):
        table = tuning.table_named("NVIDIA A100-SXM4-80GB", _limits(A100_PROPS), notice=False)
    assert table.source == "derived" and table.derived_from == tuning.TABLE_PATH
    # The interpreter's table is the package's, whatever the user directory holds.
    assert tuning.table_for(None).source == tuning.TABLE_PATH


def test_the_user_directory_defaults_to_a_per_user_cache(monkeypatch, tmp_path):
    monkeypatch.delenv(tuning.TUNED_DIR_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tuning.user_dir() == str(tmp_path / "xdg" / "splitkv" / "tuned")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert tuning.user_dir() == os.path.join(os.path.expanduser("~"), ".cache", "splitkv", "tuned")


def test_the_sweep_writes_the_user_table_which_is_then_read(tmp_path):
    """``tune``'s writer, with a stand-in sweep result: the user directory, under the normalised name; the
    package's tables are left alone, and this process reads the new table at once."""
    shipped = sorted(os.listdir(tuning.PACKAGE_TABLES))
    name = "NVIDIA A100-SXM4-80GB"
    result = json.loads(open(tuning.TABLE_PATH).read())
    result.update(device=name, min_split_tokens=256)
    for row in result["tiles"]:
        row["programs_per_sm"] = 3
    limits = tuning.DeviceLimits.from_properties(SimpleNamespace(**A100_PROPS), hip=False)
    with pytest.warns(UserWarning, match="no tuned tile table"):
        before = tuning.table_named(name, limits)
    assert before.source == "derived" and not before.measured
    path = tune.save(result, name)
    assert path == str(tmp_path / "user" / "nvidia_a100_sxm4_80gb.json") == tune.default_out_path(name)
    assert sorted(os.listdir(tuning.PACKAGE_TABLES)) == shipped
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        after = tuning.table_named(name, limits)
    assert (after.source, after.measured, after.min_split_tokens()) == (path, True, 256)
    assert after.programs_per_sm(128, 16, 2) == 3
    assert json.loads(open(path).read()) == result
    # --out elsewhere; --replace now means the default (never the package's file).
    parse = tune._parser().parse_args
    assert tune.out_path(parse([]), name) == path == tune.out_path(parse(["--replace"]), name)
    assert tune.out_path(parse(["--out", "t.json"]), name) == "t.json"
    with pytest.raises(SystemExit):
        parse(["--out", "t.json", "--replace"])


def test_the_sweeps_help_says_where_it_writes(capsys):
    with pytest.raises(SystemExit):
        tune._parser().parse_args(["--help"])
    text = "".join(capsys.readouterr().out.split())  # argparse wraps lines, at hyphens too
    assert tuning.TUNED_DIR_ENV in text and "~/.cache/splitkv/tuned" in text
    assert os.path.join(tuning.user_dir(), "<gpu>.json") in text
    assert "user table directory" in tune.__doc__ and tuning.TUNED_DIR_ENV in tune.__doc__
    assert "user table directory" in tuning.__doc__ and "bench.tune" in tuning.__doc__


# ---------------------------------------------------------------------------- an untuned GPU


def _limits(props, hip=False):
    return tuning.DeviceLimits.from_properties(SimpleNamespace(**props), hip=hip)


def _keys(table):
    """Every row's key with its page size (token-pool rows, paged rows, MLA's defaults, float32 pools)."""
    keys = [k + (1,) for k in table.tiles] + list(table.paged_tiles) + [k + (1,) for k in tuning.DEFAULT_TILES]
    return keys + [(hd, bm, 4, 1) for hd, bm, _ in table.tiles]


def test_with_the_h200s_properties_the_derived_counts_are_the_measured_ones():
    """The derivation checked against the sweep: from an H200's properties it gives the programs per SM the
    sweep's compiled kernels allowed, for every row."""
    h200 = tuning.table_named(H200)
    twin = tuning.table_named("NVIDIA H200 twin", _limits(H200_PROPS), notice=False)
    assert twin.source == "derived" and not twin.measured and twin.derived_from == tuning.TABLE_PATH
    for key in _keys(h200):
        assert twin.tile(*key) == h200.tile(*key)
        assert twin.programs_per_sm(*key) == h200.programs_per_sm(*key), key


@pytest.mark.parametrize("props", [A100_PROPS, RTX4090_PROPS])
def test_an_untuned_gpu_derives_programs_per_sm_from_its_own_properties(props):
    """Less shared memory per SM: never more programs than the H200's, fewer for some tiles; the tile shapes
    stay the H200's; one warning that says how to tune."""
    h200 = tuning.table_named(H200)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tables = [tuning.table_named(props["name"], _limits(props)) for _ in range(3)]
    assert all(t is tables[0] for t in tables)
    table = tables[0]
    notices = [w for w in caught if "splitkv.bench.tune" in str(w.message)]
    assert len(notices) == 1
    text = str(notices[0].message)
    assert "\n" not in text and props["name"] in text and tune.default_out_path(props["name"]) in text
    assert (table.device_name, table.source, table.measured) == (props["name"], "derived", False)
    fewer = 0
    for key in _keys(h200):
        assert table.tile(*key) == h200.tile(*key)
        assert 1 <= table.programs_per_sm(*key) <= h200.programs_per_sm(*key), key
        fewer += table.programs_per_sm(*key) < h200.programs_per_sm(*key)
    assert fewer > 0
    assert table.min_split_tokens() == h200.min_split_tokens()


def test_shared_memory_per_sm_sets_the_count():
    """Halving an SM's shared memory (registers and threads unlimited) never raises the count, and a GPU that
    holds one tile's worth gets one program."""
    big = dict(H200_PROPS, regs_per_multiprocessor=None, max_threads_per_multi_processor=None, name="big")
    small = dict(big, shared_memory_per_multiprocessor=233472 // 2, name="small")
    tiny = dict(big, shared_memory_per_multiprocessor=60000, shared_memory_per_block_optin=60000, name="tiny")
    tb, ts, tt = (tuning.table_named(p["name"], _limits(p), notice=False) for p in (big, small, tiny))
    for key in _keys(tb):
        assert ts.programs_per_sm(*key) <= tb.programs_per_sm(*key)
        assert tt.programs_per_sm(*key) == 1
    assert any(ts.programs_per_sm(*k) < tb.programs_per_sm(*k) for k in _keys(tb))


def test_a_rocm_gpu_works_from_its_own_property_names(monkeypatch):
    """torch.version.hip set: no opt-in or register figures, 64-thread wavefronts, no NVIDIA reserve."""
    monkeypatch.setattr(torch.version, "hip", "6.2.0", raising=False)
    limits = tuning.DeviceLimits.from_properties(SimpleNamespace(**MI300_PROPS))
    assert limits.hip and limits.warp_size == 64 and limits.regs_per_sm is None
    assert limits.shared_memory_per_block == limits.shared_memory_per_sm == 65536
    assert limits.reserved_shared_memory == 0
    table = tuning.table_named(MI300_PROPS["name"], limits, notice=False)
    for key in _keys(table):
        assert table.programs_per_sm(*key) >= 1
    # A properties object with nothing the tables read: the row's own count.
    bare = tuning.table_named("bare gpu", tuning.DeviceLimits.from_properties(SimpleNamespace()), notice=False)
    assert bare.programs_per_sm(128, 16, 2) == tuning.table_named(H200).programs_per_sm(128, 16, 2)


@pytest.mark.parametrize("props, untuned", [(A100_PROPS, True), (H200_PROPS, False), (MI300_PROPS, True)])
def test_table_for_a_cuda_device_reads_its_name_and_properties(monkeypatch, props, untuned):
    """``table_for(torch.device("cuda", i))`` with torch.cuda faked: the device's own table, or a derived one
    with one warning per process; cached."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(**props))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: props["name"])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tables = [tuning.table_for(torch.device("cuda", 0)), tuning.table_for("cuda"), tuning.table_for(0),
                  tuning._current()]
    assert all(t is tables[0] for t in tables)
    assert tables[0].device_name == props["name"] and tables[0].measured is not untuned
    assert len([w for w in caught if "splitkv.bench.tune" in str(w.message)]) == int(untuned)
    # The wrappers answer for the current device.
    assert tuning.small_batch_tile(128, 16, 2, 1, 132, 4096) == tables[0].small_batch_tile(128, 16, 2, 1, 132, 4096)
    assert tuning.min_split_tokens() == 128


def test_under_the_interpreter_there_is_no_notice(monkeypatch):
    monkeypatch.setattr(tuning, "interpreting", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tuning.table_named("NVIDIA A100-SXM4-80GB", _limits(A100_PROPS))
    # While kernels run through the interpreter, every device plans with the interpreter's table.
    assert tuning.table_for("cuda:0").min_split_tokens() == tuning.INTERPRETER_MIN_SPLIT_TOKENS


# ---------------------------------------------------------------------------- read-only tables, names


def test_a_table_cannot_be_mutated():
    table = tuning.table_named(H200)
    with pytest.raises(dataclasses.FrozenInstanceError):
        table.split_tokens = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        table.measured = False
    key = next(iter(table.tiles))
    with pytest.raises(TypeError):
        table.tiles[key] = {}
    with pytest.raises(TypeError):
        table.tiles[key]["block_n"] = 16
    with pytest.raises(TypeError):
        table.small_batch_tiles[(1, 2, 3)] = {}
    with pytest.raises(TypeError):
        table.data["tile_sweep"][0]["us"] = 0.0
    with pytest.raises(TypeError):
        tuning.TUNED["min_split_tokens"] = 1
    with pytest.raises(TypeError):
        tuning.DEFAULT_TILES[(576, 64, 2)]["block_n"] = 16
    # Its JSON form is a copy: editing it changes nothing.
    data = table.to_json()
    data["tiles"][0]["block_n"] = 16
    data["min_split_tokens"] = 1
    assert table.tiles[key]["block_n"] != 16 and table.min_split_tokens() == 128


def test_a_new_table_is_installed_for_its_device_only_within_using():
    h200 = tuning.table_named(H200)
    data = h200.to_json()
    data["min_split_tokens"] = 512
    trial = tuning.TunedTable.from_json(data, H200, "sweep", True)
    with tuning.using(trial):
        assert tuning.table_named(H200) is trial and trial.min_split_tokens() == 512
    assert tuning.table_named(H200) is h200


@pytest.mark.skipif(torch.cuda.is_available(), reason="installs an interpreter table: CPU only")
def test_replace_makes_a_new_table_and_using_installs_it_for_the_interpreter():
    """``replace`` leaves the table as it was; an interpreter table under ``using`` answers for the wrappers."""
    monkey_key = (128, 16, 2)
    base = tuning.table_for(None)
    before = base.small_batch_tile(*monkey_key, 1, 132, 4096)
    trial = base.replace(small_batch_tiles={monkey_key: dict(block_n=64, num_warps=8, num_stages=2)})
    assert trial.interpreter and trial.source == base.source and trial.tiles == base.tiles
    assert base.small_batch_tile(*monkey_key, 1, 132, 4096) == before
    assert trial.small_batch_tile(*monkey_key, 1, 132, 4096)[:3] == (64, 8, 2)
    with tuning.using(trial):
        assert tuning.table_for(None) is trial
        assert tuning.small_batch_tile(*monkey_key, 1, 132, 4096)[:3] == (64, 8, 2)
    assert tuning.table_for(None) is base
    assert base.replace(min_split_tokens=256, measured=True).split_tokens == 256
    # Rows given as lists are keyed from their fields.
    rows = [dict(head_dim=64, block_m=16, kv_bytes=2, block_n=32, num_warps=4, num_stages=1)]
    assert base.replace(small_batch_tiles=rows).small_batch_tiles.keys() == {(64, 16, 2)}


@pytest.mark.parametrize("name, stem", [
    ("NVIDIA H200", "nvidia_h200"),
    ("NVIDIA A100-SXM4-80GB", "nvidia_a100_sxm4_80gb"),
    ("NVIDIA GeForce RTX 4090", "nvidia_geforce_rtx_4090"),
    ("AMD Instinct MI300X / gfx942:sramecc+:xnack-", "amd_instinct_mi300x_gfx942_sramecc_xnack"),
    ("../../etc/passwd", "etc_passwd"),
    ("  Ünïcode GPU\t(TM) ", "n_code_gpu_tm"),
    ("", "unknown_gpu"),
    ("///", "unknown_gpu"),
])
def test_odd_names_normalise_to_safe_file_names(name, stem):
    assert tuning.normalise_name(name) == stem
    assert re.fullmatch(r"[a-z0-9]+(_[a-z0-9]+)*", stem)


def test_a_long_name_is_cut():
    stem = tuning.normalise_name("GPU " * 200)
    assert len(stem) <= 100 and re.fullmatch(r"[a-z0-9_]+", stem) and not stem.endswith("_")


# ---------------------------------------------------------------------------- the plan reads the device's own table


def _plan_tile(table, props, head_dim=128, group=4, batch=8, prefix=4096):
    from splitkv.schedule import DeviceFacts, VerifyParams, plan_tile

    p = VerifyParams(8 * group, 8, head_dim, head_dim, 4, batch, torch.bfloat16, torch.bfloat16)
    facts = DeviceFacts(props["multi_processor_count"], props["shared_memory_per_block_optin"], False)
    return p, plan_tile(p, facts, table, prefix)


def test_a_tuned_gpus_plan_takes_tile_and_programs_per_sm_from_one_row_of_its_own_table(tmp_path):
    """A user table for another GPU whose every tile row says (32 keys, 8 warps, 3 stages, 3 programs per SM):
    its plans take that tile and that count, where the H200's table gives another tile."""
    data = tuning.table_named(H200).to_json()
    for row in data["tiles"] + data["paged_tiles"]:
        row.update(block_n=32, num_warps=8, num_stages=3, programs_per_sm=3)
    data.update(device=A100_PROPS["name"], small_batch_tiles=[])
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "nvidia_a100_sxm4_80gb.json").write_text(json.dumps(data))
    table = tuning.table_named(A100_PROPS["name"], _limits(A100_PROPS))
    assert table.measured and table.source.startswith(str(tmp_path / "user"))
    p, tile = _plan_tile(table, A100_PROPS)
    key = (128, tile.config.block_m, 2)
    cfg = tile.config
    assert (cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.k_rows) == (32, 8, 3, table.tiles[key].get("k_rows", False))
    assert tile.programs_per_sm == 3
    _, h200_tile = _plan_tile(tuning.table_named(H200), A100_PROPS)
    assert h200_tile.config != cfg
    assert h200_tile.programs_per_sm == tuning.table_named(H200).tiles[key]["programs_per_sm"]


#: A GPU with 64 KB of shared memory per SM and block: the H200's head-dim-256 tiles do not fit it.
SMALL_PROPS = dict(RTX4090_PROPS, name="small gpu", shared_memory_per_multiprocessor=65536,
                   shared_memory_per_block_optin=65536)


@pytest.mark.parametrize("props, head_dim", [(RTX4090_PROPS, 128), (SMALL_PROPS, 256)])
def test_an_untuned_gpus_plan_gets_a_tile_that_fits_its_shared_memory(props, head_dim):
    """A GPU without a table: its plan shrinks the H200's tile until the shared-memory model says it fits the
    GPU's, and counts the programs per SM derived from the GPU's own limits."""
    from splitkv.resources import shared_memory_bytes
    from splitkv.schedule import TileConfig

    table = tuning.table_named(props["name"], _limits(props), notice=False)
    assert not table.measured
    p, tile = _plan_tile(table, props, head_dim=head_dim)
    limit = props["shared_memory_per_block_optin"]
    assert shared_memory_bytes(tile.config, head_dim, head_dim, p.kv_dtype, p.q_dtype, 1, 4) <= limit
    row = table.row(head_dim, tile.config.block_m, 2)
    tuned = TileConfig(tile.config.block_m, row.block_n, row.num_warps, row.num_stages, row.k_rows)
    fits = shared_memory_bytes(tuned, head_dim, head_dim, p.kv_dtype, p.q_dtype, 1, 4) <= limit
    assert (tile.config == tuned) == fits and fits == (props is RTX4090_PROPS)
    assert tile.programs_per_sm == table.programs_per_sm(head_dim, tile.config.block_m, 2)
    assert 1 <= tile.programs_per_sm <= tuning.table_named(H200).programs_per_sm(head_dim, tile.config.block_m, 2)
