"""The benchmark's CPU-testable pieces: the gather-floor kernel and its search,
the GPU tag, the row assembly (fake timers), the tables, the plots and the CLI."""

import copy
import json
import math
import os
import re
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from conftest import CUDA, DEVICE

from splitkv.bench import breadth, floors, peers, report, run, timing
from splitkv.bench.floors import FloorConfig, gather_sum, search_gather_floor
from splitkv.testing import make_problem


# ---- The gather-floor kernel ---------------------------------------------------------------------

def _pools(dtype, n_tokens=97, pool=300, h_kv=2, d=64, dv=64, index_dtype=torch.int64, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(pool, h_kv, d, generator=g).to(device=DEVICE, dtype=dtype)
    v = torch.randn(pool, h_kv, dv, generator=g).to(device=DEVICE, dtype=dtype)
    idx = torch.randperm(pool, generator=g)[:n_tokens].to(device=DEVICE, dtype=index_dtype)
    return k, v, idx


def _reference_partials(k, v, idx, tokens_per_program):
    """Per-program sums in float64: program (chunk c, head h) at h * n_chunks + c."""
    rows_k, rows_v = k[idx.long()].double(), v[idx.long()].double()
    chunks = torch.split(torch.arange(idx.shape[0]), tokens_per_program)
    return torch.stack([
        rows_k[c, h].sum() + rows_v[c, h].sum() for h in range(k.shape[1]) for c in chunks
    ])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("config", [FloorConfig(16, 32, 4, 1), FloorConfig(32, 64, 2, 3), FloorConfig(64, 512)],
                         ids=["16x32", "32x64", "64x512"])
def test_gather_sum_matches_torch(dtype, config):
    """97 tokens (a partial last tile and chunk), random slots, 2 KV heads, head_dim 64."""
    k, v, idx = _pools(dtype)
    out = gather_sum(k, v, idx, config)
    ref = _reference_partials(k, v, idx, config.tokens_per_program)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    scale = (k[idx.long()].double().abs().sum() + v[idx.long()].double().abs().sum()).item()
    assert torch.allclose(out.double().cpu(), ref.cpu(), rtol=0, atol=1e-6 * scale)
    assert abs(out.double().sum().item() - ref.sum().item()) < 1e-6 * scale


def test_gather_sum_odd_head_dims_int32_fp8():
    """Non-power-of-two head dims (masked columns), int32 slots and an fp8 pool."""
    k, v, idx = _pools(torch.float16, n_tokens=45, h_kv=3, d=40, dv=24, index_dtype=torch.int32, seed=1)
    ref = _reference_partials(k, v, idx, 32)
    assert torch.allclose(gather_sum(k, v, idx, FloorConfig(16, 32)).double().cpu(), ref.cpu(), atol=1e-3)
    k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    ref8 = _reference_partials(k8.float(), v8.float(), idx, 32)
    assert torch.allclose(gather_sum(k8, v8, idx, FloorConfig(16, 32)).double().cpu(), ref8.cpu(), atol=1e-3)


def test_gather_sum_of_keys_alone():
    """``v_buffer=None`` (values a view of the keys, MLA): each K row read once, summed once."""
    k, v, idx = _pools(torch.float32, n_tokens=45, h_kv=1, d=40, dv=24, seed=2)
    ref = _reference_partials(k, k[..., :0], idx, 32)
    assert torch.allclose(gather_sum(k, None, idx, FloorConfig(16, 32)).double().cpu(), ref.cpu(), atol=1e-4)
    # One KV head: reading "every head of a token" is the same read.
    together = gather_sum(k, None, idx, FloorConfig(16, 32), heads_together=True)
    assert torch.allclose(together.double().cpu(), ref.cpu(), atol=1e-4)


def test_gather_sum_reads_wide_rows_in_chunks():
    """A 576-wide row (MLA's latent) is five loads of 128 columns, the last one masked: the same sum."""
    k, _, idx = _pools(torch.float32, n_tokens=21, h_kv=1, d=576, dv=8, seed=3)
    assert floors.chunk_width(576) == floors.MAX_BLOCK_C == 128 and floors.chunk_width(40, 24) == 64
    ref = _reference_partials(k, k[..., :0], idx, 16)
    assert torch.allclose(gather_sum(k, None, idx, FloorConfig(16, 16)).double().cpu(), ref.cpu(), atol=1e-3)
    # Whole rows per load (the search's third round): one 1024-column load per row, the same sum.
    assert floors.row_width(576) == 1024
    whole = gather_sum(k, None, idx, FloorConfig(16, 16, block_c=1024))
    assert torch.allclose(whole.double().cpu(), ref.cpu(), atol=1e-3)


def test_gather_sum_rejects_bad_input():
    k, v, idx = _pools(torch.float32, n_tokens=8, pool=16)
    with pytest.raises(ValueError, match="multiple of block_n"):
        gather_sum(k, v, idx, FloorConfig(32, 48))
    with pytest.raises(ValueError, match="unit last stride"):
        gather_sum(k.transpose(1, 2), v, idx)
    with pytest.raises(ValueError, match="power of two"):
        gather_sum(k, v, idx, FloorConfig(16, 32, block_c=96))
    with pytest.raises(ValueError, match="float32 elements"):
        gather_sum(k, v, idx, FloorConfig(16, 32), out=torch.empty(3, device=DEVICE))


def test_floor_configs_prune_registers():
    """The grid keeps valid settings only; wide heads lose the big tiles."""
    narrow, wide = floors.floor_configs(128, 128), floors.floor_configs(256, 256)
    assert len(narrow) > len(wide) > 0
    for cfgs, d in ((narrow, 128), (wide, 256)):
        assert all(c.tokens_per_program % c.block_n == 0 for c in cfgs)
        # The 128-column float32 accumulator and one step's bf16 K and V rows (2 x d x 2 bytes), per thread.
        assert all(c.block_n * (128 + d) <= floors.MAX_ACC_REGISTERS * 32 * c.num_warps for c in cfgs)
    assert FloorConfig(64, 128, 4, 3) in narrow and FloorConfig(64, 128, 4, 3) not in wide
    # Narrower elements leave room for more rows in flight: fp8 256-dim heads take 64-slot tiles.
    assert floors.fits_registers(FloorConfig(64, 128, 4, 3), 256, 256, element_size=1)
    assert not floors.fits_registers(FloorConfig(64, 128, 4, 3), 256, 256, element_size=2)


def _record_settings(monkeypatch):
    """``floors.gather_sum`` made to record each setting it runs (the kernel still runs, under the
    interpreter); returns the list it appends to."""
    seen, real = [], floors.gather_sum

    def spy(k_, v_, idx_, config, out=None, **kw):
        seen.append(config)
        return real(k_, v_, idx_, config, out, **kw)

    monkeypatch.setattr(floors, "gather_sum", spy)
    return seen


def test_search_gather_floor_two_rounds(monkeypatch):
    """Round 1 over (BLOCK_N, tokens), round 2 over (warps, stages) at the winner; failures skipped."""
    k, v, idx = _pools(torch.float32, n_tokens=40, pool=64)
    calls = _record_settings(monkeypatch)

    def fake_time(fn):
        fn()  # runs the kernel for real (interpreter)
        cfg = calls[-1]
        if cfg.block_n == 64:
            raise RuntimeError("out of resources")
        # Fastest: BLOCK_N 32, 128 tokens; then 2 warps, 1 stage.
        return (abs(cfg.block_n - 32) + abs(cfg.tokens_per_program - 128) / 8 + 1
                - (cfg.num_warps == 2) * 0.1 - (cfg.num_stages == 1) * 0.05)

    found = search_gather_floor(k, v, idx, fake_time)
    assert found["config"] == dict(block_n=32, tokens_per_program=128, num_warps=2, num_stages=1, block_c=0)
    assert math.isclose(found["us"], 1 - 0.15)
    # 64-wide rows are one chunk already: no third round.
    assert len(found["trials"]) == len(calls) == 14 + 3
    assert all(key.startswith("64/") for key in found["errors"])
    assert all(t[5] is None for t in found["trials"] if t[0] == 64)


@pytest.mark.parametrize("whole_wins", [True, False], ids=["whole-rows", "chunks"])
def test_search_gather_floor_tries_whole_rows(whole_wins, monkeypatch):
    """Rows wider than one chunk (256 columns): a third round times round 2's winner with whole rows
    per load, and keeps it only where it is faster."""
    k, v, idx = _pools(torch.float32, n_tokens=40, pool=64, h_kv=1, d=256, dv=256)
    seen = _record_settings(monkeypatch)

    def fake_time(fn):
        fn()
        return 5.0 - (seen[-1].block_c > 0) * (1 if whole_wins else -1)

    found = search_gather_floor(k, v, idx, fake_time, **floors.REDUCED_GRID)
    # fp32 rows this wide fit the registers at 16-slot tiles only: 3 + 1 chunked settings, then whole rows.
    assert [c.block_c for c in seen] == [0] * 4 + [256]
    assert seen[-1] == replace(seen[0], block_c=256)  # every chunked setting tied: round 1's first won
    assert found["config"]["block_c"] == (256 if whole_wins else 0)
    assert found["trials"][-1][4] == 256


def test_search_gather_floor_reduced_grid():
    """The --small grid: 8 first-round settings (BLOCK_N x 32/128/512 tokens, 4 warps, 3 stages), then 1 stage."""
    k, v, idx = _pools(torch.float32, n_tokens=40, pool=64)
    seen = []

    def fake_time(fn):
        fn()
        seen.append(len(seen))
        return 10.0 - len(seen)  # the last setting timed is the fastest

    found = search_gather_floor(k, v, idx, fake_time, **floors.REDUCED_GRID)
    settings = [tuple(t[:5]) for t in found["trials"]]
    assert len(settings) == len(set(settings)) == len(seen) == 9
    assert {s[1] for s in settings} == {32, 128, 512} and {s[2] for s in settings} == {4}
    assert settings[-1][3] == 1 and all(s[3] == 3 for s in settings[:-1])
    assert found["config"]["num_stages"] == 1 and math.isclose(found["us"], 1.0)


# ---- GPU tag, output path ------------------------------------------------------------------------

@pytest.mark.parametrize("name, tag", [
    ("NVIDIA H200", "h200"),
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA GeForce RTX 4090", "rtx4090"),
    ("NVIDIA B200", "b200"),
    ("NVIDIA GH200 480GB", "gh200"),
    ("Tesla V100-SXM2-16GB", "v100"),
    ("AMD Instinct MI300X", "mi300x"),
])
def test_gpu_tag(name, tag):
    assert timing.gpu_tag(name) == tag


def test_default_out_path():
    assert report.default_out_path("h100") == os.path.join("figures", "benchmark_h100.json")
    assert report.default_out_path("h200", "quick") == os.path.join("figures", "benchmark_h200_quick.json")


def test_plan_run_paths_and_defaults():
    """The full default sweep writes benchmark_<gpu>; --quick and subsets never overwrite it."""
    full = run.plan_run([], "NVIDIA H200")
    assert full["out"] == os.path.join("figures", "benchmark_h200.json")
    assert full["md"] == os.path.join("figures", "benchmark_h200.md") and full["plot_tag"] == "h200"
    assert full["models"] == tuple(run.MODEL_SHAPES) and full["batches"] == run.BENCH_BATCHES
    assert full["prefixes"] == run.BENCH_PREFIXES and full["impls"] == peers.IMPLEMENTATIONS
    assert full["kv_dtypes"] == run.KV_DTYPES and full["gather_floor"]
    assert full["timer"] == dict(rep_ms=25.0, host_calls=1000, host_pin=True)
    assert len(run.bench_shapes(full["models"], full["batches"], full["prefixes"])) == 36
    assert run.plan_run([], "NVIDIA H100 80GB HBM3")["out"] == os.path.join("figures", "benchmark_h100.json")
    quick = run.plan_run(["--quick"], "NVIDIA H200")
    assert quick["out"].endswith("benchmark_h200_quick.json") and quick["plot_tag"] == "h200_quick"
    assert len(run.bench_shapes(quick["models"], quick["batches"], quick["prefixes"])) * 2 == 4
    one = run.plan_run(["--models", "llama3-8b", "--batches", "8", "--prefixes", "16384"], "NVIDIA H200")
    assert one["out"].endswith("benchmark_h200_custom.json") and one["batches"] == (8,)
    mine = run.plan_run(["--out", "/tmp/x/run.json", "--figures", "", "--rep-ms", "10"], "NVIDIA H200")
    assert (mine["out"], mine["md"]) == ("/tmp/x/run.json", "/tmp/x/run.md")
    assert (mine["figures"], mine["plot_tag"]) == ("", "run")
    assert mine["timer"]["rep_ms"] == 10.0
    assert not run.plan_run(["--host-unpinned"], "NVIDIA H200")["timer"]["host_pin"]


def _small_help_rows(text: str) -> list:
    """The rows ``--help`` says ``--small`` runs, read back from its sentence."""
    text = " ".join(text.split())
    m = re.search(r"--small: .*? on the rows ([\w\-, ]+), each at batch ([\d and]+) x prefix ([\dk/]+) "
                  r"and at batch 1 x (\d+)k \((\d+) rows\)", text)
    assert m, "the --help text names --small's rows"
    models = m.group(1).split(", ")
    batches = [int(b) for b in m.group(2).split(" and ")]
    prefixes = [int(x[:-1]) * 1024 for x in m.group(3).split("/")]
    rows = []
    for model in models:
        rows += [dict(model=model, batch=b, prefix=x) for b in batches for x in prefixes]
        rows.append(dict(model=model, batch=1, prefix=int(m.group(4)) * 1024))
    assert len(rows) == int(m.group(5))
    return rows


def test_small_rows_are_what_the_help_says():
    small = run.plan_run(["--small"], "NVIDIA H200")
    assert small["shapes"] == _small_help_rows(run._parser().format_help())
    assert len(small["shapes"]) == 21 and {r["model"] for r in small["shapes"]} == {"llama3-8b", "qwen3-32b",
                                                                                   "qwen3-next"}
    assert {(r["batch"], r["prefix"]) for r in small["shapes"]} == {
        (b, x) for b in (1, 8) for x in (1024, 4096, 16384)} | {(1, 65536)}
    assert small["small"] and small["impls"] == ("splitkv",) and small["kv_dtypes"] == ("bfloat16",)
    assert small["eager_impls"] == () and small["host_impls"] == () and small["gather_floor"]
    assert small["floor_grid"] == floors.REDUCED_GRID
    assert (small["out"], small["md"], small["figures"]) == (None, None, "")  # writes nothing
    kept = run.plan_run(["--small", "--out", "/tmp/s/small.json"], "NVIDIA H200")
    assert (kept["out"], kept["md"], kept["figures"]) == ("/tmp/s/small.json", "/tmp/s/small.md", "")
    assert run.plan_run(["--small", "--figures", "figs"], "NVIDIA H200")["figures"] == "figs"
    narrow = run.plan_run(["--small", "--models", "qwen3-next", "--prefixes", "65536"], "NVIDIA H200")
    assert narrow["shapes"] == [dict(model="qwen3-next", batch=1, prefix=65536)]
    full = run.plan_run([], "NVIDIA H200")
    assert not full["small"] and full["floor_grid"] is None and full["host_impls"] == peers.HOST_IMPLS
    with pytest.raises(SystemExit):
        run.plan_run(["--small", "--quick"], "NVIDIA H200")


def test_small_mode_end_to_end_on_cpu(monkeypatch, tmp_path, capsys):
    """``main(["--small"])`` with fake timers on the interpreter: splitkv only, graph times only, the
    reduced gather-floor grid, the ratio and the share of the read bandwidth printed, no file written."""
    from splitkv.testing import HeadShape

    cpu_problem = run.make_problem

    def make(*args, **kw):  # the interpreter: float32 on the CPU, not bf16 on a GPU
        return cpu_problem(*args, **dict(kw, dtype=torch.float32, device=DEVICE))

    class SmallTimer(FakeTimer):
        def __init__(self, **settings):
            super().__init__()
            self.settings = settings

        def eager(self, fn):
            raise AssertionError("--small times graph replays only")

        def host(self, fn):
            raise AssertionError("--small measures no host time")

    monkeypatch.setattr(run, "make_problem", make)
    monkeypatch.setattr(run, "MODEL_SHAPES", {"tiny": HeadShape("tiny", 4, 2, 64)})
    monkeypatch.setattr(run, "SMALL", dict(models=("tiny",), batches=(1, 2), prefixes=(32,), long_prefix=96))
    monkeypatch.setattr(run, "measure_read_bandwidth", lambda: 1e12)
    monkeypatch.setattr(run, "Timer", SmallTimer)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    if not CUDA:  # the benchmark asks the GPU for these; on a GPU the plans read the real properties
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda *a: type("P", (), {"multi_processor_count": 132}))
    monkeypatch.chdir(tmp_path)
    run.main(["--small"])
    assert list(tmp_path.iterdir()) == []  # nothing written, no figures/ folder
    text = capsys.readouterr().out
    assert "writing no files" in text and "splitkv against its floors" in text
    labels = [report._shape(dict(model="tiny", batch=b, prefix=x)) for b, x in ((1, 32), (2, 32), (1, 96))]
    table = [line for line in text.splitlines() if line.startswith("tiny ")]
    assert [line.split("  ")[0] for line in table] == labels
    for line in table:  # pool, splitkv µs, gather floor µs, ÷ gather floor, floor µs, % read bw
        cells = line[len(labels[0]):].split()
        assert cells[:4] == ["bf16", "40.0", "40.0", "1.00"] and cells[-1] == "%", line
    assert sum(line.startswith("[") for line in text.splitlines()) == 3  # a progress line per row
    assert "reduced grid of launch settings (tokens per program 32/128/512, num warps 4)" in text


# ---- One row, assembled with fake timers (the wiring of every implementation) ---------------------

class FakeTimer(timing.Timer):
    """Runs each callable once (checking it works) and returns a fixed time per implementation
    (host rounds: 90 µs in an implementation's turn, 70 at the end of the row)."""

    TIMES = {"eager": 80.0, "graph": 40.0, "host": 70.0}

    def __init__(self):
        super().__init__()
        self.host_seen = set()

    def eager(self, fn):
        fn()
        return self.TIMES["eager"]

    def graph(self, fn):
        fn()
        return self.TIMES["graph"]

    def host(self, fn):
        fn()
        first = id(fn) not in self.host_seen
        self.host_seen.add(id(fn))
        self.last_host_cpu = dict(cpu=len(self.host_seen), ref_us=25.0, slowest_ref_us=45.0)
        return self.TIMES["host"] + 20.0 * first


def test_bench_row_wiring_bf16_and_fp8():
    """splitkv, seed, extend and sdpa on a tiny CPU problem agree; the fp8 row derives from it."""
    shape = dict(model="tiny", batch=2, prefix=40)
    p = make_problem([40, 40], 4, 4, 2, 64, dtype=torch.float32, device=DEVICE, seed=3)
    impls = ("splitkv", "splitkv_invariant", "seed", "extend", "sdpa")
    row, outs = run.bench_row(p, shape, impls, FakeTimer(), 1e12)
    assert row["kv_dtype"] == "float32" and row["floor_us"] == p.kv_bytes / 1e12 * 1e6
    for name in ("splitkv", "seed", "extend", "sdpa"):
        rec = row["impls"][name]
        assert rec["graph"] == 40.0, rec
        assert rec["rel_diff_vs_splitkv"] < 1e-4, (name, rec)
    assert all(row["impls"][name]["eager"] == 80.0 for name in ("splitkv", "seed", "extend", "sdpa"))
    for name in ("splitkv", "extend", "sdpa"):  # the fastest of a round in its turn and one at the row's end
        assert row["impls"][name]["host_us"] == 70.0 and row["impls"][name]["host_rounds_us"] == [90.0, 70.0, 70.0]
        assert len(row["impls"][name]["host_cpus"]) == 3  # each round's CPU pick
    assert "host_us" not in row["impls"]["seed"]
    inv = row["impls"]["splitkv_invariant"]  # split_tokens: a time, or a recorded failure
    assert inv.get("graph") == 40.0 or inv.get("error")
    assert row["gather_floor_us"] == 40.0 and row["gather_floor_config"]["block_n"] in floors.BLOCK_NS
    assert row["splitkv_over_floor"] == 40.0 / row["floor_us"]
    assert row["splitkv_over_gather_floor"] == 1.0
    assert row["elapsed_s"] > 0

    q = peers.fp8_problem(p)
    assert q.k_buffer.dtype == torch.float8_e4m3fn and (q.k_scale, q.v_scale) == (0.5, 2.0)
    dequant = q.k_buffer.float() * q.k_scale
    assert torch.allclose(dequant, p.k_buffer, rtol=0.07, atol=0.02)
    row8, _ = run.bench_row(q, shape, ("splitkv", "extend"), FakeTimer(), 1e12, gather_floor=False,
                              bf16_row=row, bf16_out=outs["splitkv"])
    assert row8["kv_dtype"] == "float8_e4m3fn" and row8["kv_bytes"] * 4 == row["kv_bytes"]
    assert row8["fp8_over_bf16"] == 1.0
    assert row8["impls"]["extend"]["rel_diff_vs_splitkv"] < 1e-4
    assert 1e-4 < row8["impls"]["splitkv"]["rel_diff_vs_bf16"] < 0.1  # fp8 rounding, nothing worse
    assert "gather_floor_us" not in row8 and row8["splitkv_over_gather_floor"] is None


def test_bench_row_records_failures_and_skips(monkeypatch):
    shape = dict(model="tiny", batch=1, prefix=16)
    p = make_problem([16], 4, 4, 2, 64, dtype=torch.float32, device=DEVICE, seed=4)
    monkeypatch.setattr(peers, "FLEX_MAX_ELEMENTS", 1)  # flex: skipped at every shape
    monkeypatch.setattr(peers, "verify_splitkv_fwd", lambda *a, **k: False)  # the drop-in declines
    row, outs = run.bench_row(p, shape, ("splitkv", "extend", "flex"), FakeTimer(), 1e12, gather_floor=False)
    assert row["impls"]["splitkv"]["graph"] is None
    assert "declined" in row["impls"]["splitkv"]["error"]
    assert "flex" in row["impls"]["flex"]["skipped"] or "2^31" in row["impls"]["flex"]["skipped"]
    assert row["impls"]["extend"]["graph"] == 40.0 and "rel_diff_vs_splitkv" not in row["impls"]["extend"]
    assert row["splitkv_over_floor"] is None and "splitkv" not in outs


def test_make_impl_invariant_passes_split_tokens(monkeypatch):
    seen = {}
    monkeypatch.setattr(peers, "verify_splitkv_fwd", lambda *a, **k: seen.update(k) or True)
    p = make_problem([16], 4, 4, 2, 64, dtype=torch.float32, device=DEVICE, seed=5)
    assert peers.make_impl("splitkv_invariant", p, p.new_output())() is True
    assert seen["split_tokens"] == peers.INVARIANT_SPLIT_TOKENS == 1024 and seen["max_bs"] == 1


def test_flex_skip_rule():
    """Skipped exactly where flex failed to compile in the committed H200 run."""
    def problem(model, bs, prefix):
        s = run.MODEL_SHAPES[model]
        # Shapes only: a stand-in with the fields skip_reason reads.
        return type("P", (), dict(batch_size=bs, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                                  prefix_lens=[prefix], extend_lens=[4]))()

    assert peers.skip_reason("flex", problem("llama3-8b", 32, 65536))
    assert peers.skip_reason("flex", problem("qwen3-32b", 32, 65536))
    assert not peers.skip_reason("flex", problem("qwen3-next", 32, 65536))
    assert not peers.skip_reason("flex", problem("llama3-8b", 32, 16384))
    assert not peers.skip_reason("sdpa", problem("llama3-8b", 32, 65536))


def test_run_benchmark_loop_on_cpu(monkeypatch, tmp_path):
    """The sweep loop end to end with fake timers: bf16 then fp8 rows per shape, JSON after each row."""
    import json

    from splitkv.testing import HeadShape

    cpu_problem = run.make_problem

    def make(*args, **kw):  # the interpreter: float32 on the CPU, not bf16 on a GPU
        return cpu_problem(*args, **dict(kw, dtype=torch.float32, device=DEVICE))

    monkeypatch.setattr(run, "make_problem", make)
    monkeypatch.setattr(run, "MODEL_SHAPES", {"tiny": HeadShape("tiny", 4, 2, 64)})
    monkeypatch.setattr(run, "measure_read_bandwidth", lambda: 1e12)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    if not CUDA:
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda *a: type("P", (), {"multi_processor_count": 132}))
    out = tmp_path / "run.json"
    result = run.run_benchmark(["tiny"], [1, 2], [32], ("splitkv", "extend", "sdpa"),
                                 timer=FakeTimer(), out_path=str(out), progress=False, gather_floor=False)
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(result))
    rows = saved["rows"]
    assert [(r["batch"], r["kv_dtype"]) for r in rows] == [
        (1, "float32"), (1, "float8_e4m3fn"), (2, "float32"), (2, "float8_e4m3fn")]
    for r in rows[1::2]:
        assert set(r["impls"]) == {"splitkv", "extend"} and r["fp8_over_bf16"] == 1.0, r
        assert (r["k_scale"], r["v_scale"]) == (0.5, 2.0)
    assert all(r["splitkv_over_floor"] == 40.0 / r["floor_us"] for r in rows)
    assert saved["device"] == "NVIDIA H200" and saved["elapsed_s"] > 0
    report.format_markdown(saved)


def test_host_timer_on_cpu():
    t = timing.Timer(host_calls=1000)
    assert 0 < t.host(lambda: None) < 1000


def test_host_timer_bursts_and_pins(monkeypatch):
    """Calls go back to back in bursts (one synchronisation after each), on the fastest CPU; the thread's
    CPU set is restored afterwards."""
    syncs, seen = [], []
    monkeypatch.setattr(timing, "_sync", lambda: syncs.append(1))
    t = timing.Timer(host_calls=100, host_burst=20)
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    t.host(lambda: seen.append(os.sched_getaffinity(0) if before is not None else None))
    assert len(seen) == 101 and len(syncs) == 1 + 5  # after the warm-up call, then after each burst of 20
    if before is None:  # no pinning on this platform
        assert t.last_host_cpu is None
        return
    pick = t.last_host_cpu
    assert pick["cpu"] in before and 0 < pick["ref_us"] <= pick["slowest_ref_us"]
    assert all(cpus == {pick["cpu"]} for cpus in seen[1:])  # the timed calls ran pinned
    assert os.sched_getaffinity(0) == before
    unpinned = timing.Timer(host_calls=10, host_pin=False)
    unpinned.host(lambda: None)
    assert unpinned.last_host_cpu is None
    with pytest.raises(ValueError):
        timing.Timer(host_burst=0)


def test_host_timer_is_a_median_of_calls_timed_alone():
    """An interrupted call (a 50 ms stall in one of 100) does not move the host time; each call is timed."""
    import time

    calls = iter(range(10**6))
    stall = lambda: time.sleep(0.05) if next(calls) == 40 else None  # the warm-up call is number 0
    t = timing.Timer(host_calls=100)
    assert t.host(stall) < 100  # µs; one mean over the 100 calls would be >= 500
    assert next(calls) == 101  # the warm-up call and 100 timed ones
    assert timing.Timer(host_calls=50).host(lambda: time.sleep(0.002)) >= 2000
    for bad in (dict(host_calls=0), dict(host_rounds=0)):
        with pytest.raises(ValueError):
            timing.Timer(**bad)


# ---- Tables and plots on a synthetic result --------------------------------------------------------

def _rec(graph, **extra):
    return dict(graph=graph, gbps=1.0, pct_bw=50.0, rel_diff_vs_splitkv=0.001, **extra)


def synthetic_result():
    """Two bf16 shapes and one fp8 row, with every new field, a failure and a skip."""
    floor_cfg = dict(block_n=32, tokens_per_program=128, num_warps=4, num_stages=3)

    def bf16_row(model, bs, prefix, ours):
        return dict(
            model=model, batch=bs, prefix=prefix, kv_dtype="bfloat16", k_scale=1.0, v_scale=1.0,
            kv_bytes=bs * prefix * 4096, floor_us=ours * 0.8, gather_floor_us=ours * 0.9,
            gather_floor_config=floor_cfg, gather_floor_trials=[[32, 128, 4, 3, ours * 0.9]],
            splitkv_over_floor=1.25, splitkv_over_gather_floor=1 / 0.9, invariant_over_splitkv=1.1,
            elapsed_s=3.2, setup_s=0.5,
            impls=dict(
                splitkv=_rec(ours, eager=ours + 50, host_us=71.5, host_rounds_us=[120.0, 71.5],
                             host_cpus=[dict(cpu=3, ref_us=44.6, slowest_ref_us=47.0),
                                        dict(cpu=8, ref_us=25.4, slowest_ref_us=46.1)]),
                splitkv_invariant=_rec(ours * 1.1),
                seed=_rec(ours * 3),
                extend=_rec(ours * 10, host_us=None, host_skipped="graph time 2000 us > 500 us: device-bound"),
                flex=dict(graph=None, error="InductorError: SubprocException: boom\nTraceback"),
                sdpa=_rec(ours * 5, eager=ours * 5 + 3, host_us=90.0),
            ),
        )

    rows = [bf16_row("llama3-8b", 1, 4096, 19.5), bf16_row("qwen3-32b", 32, 65536, 2052.7)]
    rows[1]["impls"]["flex"] = dict(skipped="dense K of 2.0 Gi elements: flex's template failed")
    rows.append(dict(
        model="llama3-8b", batch=1, prefix=4096, kv_dtype="float8_e4m3fn", k_scale=0.5, v_scale=2.0,
        kv_bytes=4096 * 2048, floor_us=8.0, gather_floor_us=9.5, gather_floor_config=floor_cfg,
        splitkv_over_floor=1.7, splitkv_over_gather_floor=1.43, invariant_over_splitkv=1.05,
        fp8_over_bf16=0.7, elapsed_s=1.0, setup_s=0.01,
        impls=dict(splitkv=_rec(13.6, eager=60.0, host_us=72.0, rel_diff_vs_bf16=0.04),
                   splitkv_invariant=_rec(14.3), extend=_rec(300.0)),
    ))
    return dict(
        device="NVIDIA H200", num_sms=132, torch="2.11.0", triton="3.6.0", python="3.12.3",
        date="2026-12-01", read_bandwidth=4.25e12, draft_tokens=4, dtype="bfloat16",
        kv_dtypes=list(run.KV_DTYPES), fp8_scales=dict(k_scale=0.5, v_scale=2.0),
        invariant_split_tokens=1024, implementations=dict(peers.IMPL_HELP),
        timing=dict(warmup_ms=5.0, rep_ms=25.0, host_calls=1000, host_rounds=2, host_max_graph_us=500.0,
                    eager_impls=["splitkv", "sdpa"]),
        elapsed_s=10.0, rows=rows,
    )


def test_format_markdown():
    md = report.format_markdown(synthetic_result())
    tables = [line for line in md.splitlines() if line.startswith("|") and not line.startswith("|---")]
    widths = {line.count("|") - 1 for line in tables}
    assert max(widths) <= 9, widths
    captions = [line for line in md.splitlines() if line.startswith("**")]
    assert len(captions) == 5  # times, ratios, eager, host, fp8
    assert "| llama3-8b bs1 4k | 15.6 | 17.6 | 19.5 | 21.5 | 58.5 | 195.0 | fail | 97.5 |" in md
    assert "| qwen3-32b bs32 64k | 1642 | 1847 | 2053 | 2258 | 6158 | 20527 | skip | 10264 |" in md
    assert "| llama3-8b bs1 4k | 1.25 | 1.11 | 1.10 | 3.00 | 10.00 | fail | 5.00 |" in md  # ratios
    assert "| llama3-8b bs1 4k | 69.5 | 100.5 |" in md  # eager: splitkv, sdpa
    # host: fastest, slowest round, the CPU reference of the fastest round (its CPU / the slowest CPU)
    assert "| llama3-8b bs1 4k | 71.5 | 120.0 | 25 / 46 | skip | fail | 90.0 |" in md
    assert "the fastest of 2 rounds" in md
    assert "| llama3-8b bs1 4k | 8.0 | 9.5 | 13.6 | 14.3 | 300.0 | 1.43 | 0.70 | 22.06 |" in md  # fp8
    assert "flex failed at llama3-8b bs1 4k bf16: InductorError: SubprocException: boom" in md
    assert "flex skipped at qwen3-32b bs32 64k bf16" in md
    assert "NVIDIA H200 (132 SMs), measured read bandwidth 4.25 TB/s" in md


def test_rows_carried_from_another_run_are_marked():
    result = synthetic_result()
    result["rows"][-1]["carried_from"] = "the run of 2026-12-01 at commit abc1234"
    md = report.format_markdown(result)
    shape = report._shape(result["rows"][-1])
    assert shape.endswith(" †") and f"| {shape} |" in md
    assert "† not measured in this run; carried over from the run of 2026-12-01 at commit abc1234." in md
    assert " †" not in report._shape(result["rows"][0])


def test_merge_results_of_a_run_in_parts():
    """Two parts: rows in order, seconds added, the second part's floors at the first part's bandwidth."""
    a, b = synthetic_result(), synthetic_result()
    a["rows"], b["rows"] = a["rows"][:1], b["rows"][1:]
    b["read_bandwidth"], b["elapsed_s"] = a["read_bandwidth"] * 0.99, 7.0
    before = copy.deepcopy(b["rows"][0])
    merged = run.merge_results([a, b])
    assert [r["model"] for r in merged["rows"]] == ["llama3-8b", "qwen3-32b", "llama3-8b"]
    assert merged["elapsed_s"] == 17.0 and merged["read_bandwidth"] == a["read_bandwidth"]
    assert merged["read_bandwidth_runs"] == [a["read_bandwidth"], b["read_bandwidth"]]
    row = merged["rows"][1]
    assert math.isclose(row["floor_us"], before["floor_us"] * 0.99)
    assert math.isclose(row["splitkv_over_floor"], before["splitkv_over_floor"] / 0.99)
    assert math.isclose(row["impls"]["seed"]["pct_bw"], before["impls"]["seed"]["pct_bw"] * 0.99)
    assert merged["rows"][0] == a["rows"][0] and b["rows"][0] == before  # the parts are not changed
    assert "The rows come from 2 runs" in report.format_markdown(merged)
    b_fp8 = dict(b, kv_dtypes=["float8_e4m3fn"], date="2026-12-02")
    both = run.merge_results([dict(a, kv_dtypes=["bfloat16"]), b_fp8])
    assert both["kv_dtypes"] == ["bfloat16", "float8_e4m3fn"] and both["date"] == "2026-12-01 and 2026-12-02"
    assert "The rows come from" not in report.format_markdown(a)
    with pytest.raises(ValueError, match="more than one part"):
        run.merge_results([a, a])
    b["triton"] = "3.5.0"
    with pytest.raises(ValueError, match="differ in triton"):
        run.merge_results([a, b])


def test_cli_merge_writes_the_result_tables_and_plots(tmp_path):
    """``--merge`` needs no GPU: the merged JSON, its Markdown beside it and the plots."""
    a, b = synthetic_result(), synthetic_result()
    a["rows"], b["rows"] = a["rows"][:2], b["rows"][2:]
    paths = []
    for i, part in enumerate((a, b)):
        paths.append(str(tmp_path / f"part{i}.json"))
        with open(paths[-1], "w") as f:
            json.dump(part, f)
    out = tmp_path / "out" / "benchmark_test.json"
    run.main(["--merge", *paths, "--out", str(out), "--figures", str(tmp_path / "figs")])
    with open(out) as f:
        assert json.load(f) == run.merge_results([a, b])
    assert (tmp_path / "out" / "benchmark_test.md").read_text() == report.format_markdown(run.merge_results([a, b])) + "\n"
    assert sorted(os.listdir(tmp_path / "figs")) == ["roofline_test.png", "speedup_test.png"]


def test_format_table():
    text = report.format_table(synthetic_result())
    assert "gather floor" in text and "fp8 ÷ bf16" in text and "invariant" in text
    line = next(x for x in text.splitlines() if x.startswith("llama3-8b bs1 4k") and "fail" in x)
    assert re.search(r"19\.5\s+21\.5\s+58\.5\s+195\.0\s+fail\s+97\.5$", line)


def test_tables_read_the_old_result_format():
    """The committed result files before these fields still format (missing cells are dashes)."""
    old = synthetic_result()
    for row in old["rows"]:
        for key in list(row):
            if "floor" in key and key != "floor_us" or key in ("invariant_over_splitkv", "kv_dtype", "fp8_over_bf16"):
                del row[key]
    old["rows"] = old["rows"][:2]
    for key in ("timing", "fp8_scales", "kv_dtypes", "invariant_split_tokens", "elapsed_s"):
        del old[key]
    md = report.format_markdown(old)
    assert "fp8 KV pool" not in md
    assert "| llama3-8b bs1 4k | 15.6 | – |" in md
    report.format_table(old)


def test_plots_with_failures_and_fp8(tmp_path):
    pytest.importorskip("matplotlib")
    from splitkv.bench.plots import IMPL_STYLE, plot_benchmark

    assert set(peers.IMPLEMENTATIONS) <= set(IMPL_STYLE)
    result = synthetic_result()
    paths = plot_benchmark(result, str(tmp_path), tag="test")
    assert [os.path.basename(p) for p in paths] == ["roofline_test.png", "speedup_test.png"]
    assert all(os.path.getsize(p) > 10_000 for p in paths)
    old = copy.deepcopy(result)
    old["rows"] = [r for r in old["rows"] if r["kv_dtype"] == "bfloat16"]
    for r in old["rows"]:
        del r["kv_dtype"], r["gather_floor_us"], r["impls"]["splitkv_invariant"]
    plot_benchmark(old, str(tmp_path), tag="old")


# ---- Command line ---------------------------------------------------------------------------------

def test_cli_help_exits_0():
    proc = subprocess.run([sys.executable, "-m", "splitkv.bench", "--help"], capture_output=True, text=True,
                          timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    for needle in ("CUDA GPU", "python -m splitkv demo", "--quick", "minutes", "benchmark_<gpu>.json",
                   "(default: 1 8 32)", "tokens per sequence", "splitkv_invariant", "split_tokens=1024",
                   "--small", "reduced grid"):
        assert needle in text, needle


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU message")
def test_cli_without_gpu_points_to_demo():
    with pytest.raises(SystemExit) as exc:
        run.main([])
    assert "python -m splitkv demo" in str(exc.value.code)


def test_breadth_window_baseline_reads_the_same_slots():
    """The window row's plain call: each prefix's last n keys, from the same pool slots."""
    p = make_problem([70, 33, 97], 4, 4, 2, 16, dtype=torch.float16, device=DEVICE, seed=5)
    q = breadth.last_keys(p, 32)
    assert q.kv_indptr.tolist() == [0, 32, 64, 96] and q.prefix_lens == [32] * 3
    ends = p.kv_indptr[1:].tolist()
    assert q.kv_indices.tolist() == sum((p.kv_indices[e - 32:e].tolist() for e in ends), [])
    assert q.kv_bytes * sum(p.prefix_lens) == p.kv_bytes * 96
    assert q.k_buffer is p.k_buffer and q.kv_indices.dtype == p.kv_indices.dtype
    with pytest.raises(ValueError, match="at least 34 keys"):
        breadth.last_keys(p, 34)


def test_breadth_markdown_from_a_result():
    """The breadth benchmark's tables come from its result record (every row, its numbers)."""
    row = dict(model="llama3-8b", batch=8, prefix=16384, kv_bytes=536_870_912, token_us=150.0, token_pct_bw=85.2)
    for g in breadth.PAGE_SIZES:
        row[f"page{g}_us"], row[f"page{g}_pct_bw"] = 140.0 + g, 90.0
    result = dict(device="GPU X", date="2026-11-30", torch="t", triton="tr", read_bandwidth=4.2e12,
                  elapsed_s=12.0, paged=[row],
                  features=[dict(shape="gemma2-9b-capped", batch=8, prefix=65536, features={"logit_cap": 50.0},
                                 feature_us=120.0, plain_prefix=65536, plain_us=100.0, ratio=1.2)])
    md = breadth.format_markdown(result)
    assert "| llama3-8b | 16k | 537 | 150.0 (85 %) | 156.0 (90 %) | 204.0 (90 %) |" in md
    assert "| gemma2-9b-capped | 64k | logit_cap=50.0 | 120.0 | 100.0 (65536) | 1.20 |" in md
    assert "GPU X, 2026-11-30" in md
