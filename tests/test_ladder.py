"""The latency ladder's kernels under the interpreter: each rung computes what it claims, on the verify
plan's slices; the fp8 floor's heads-together gather reads what the per-head one reads; the tables."""

import itertools
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import DEVICE

from splitkv.bench import ladder
from splitkv.bench.floors import TOKEN_BLOCK_NS, FloorConfig, gather_sum
from splitkv.bench.ladder import Rungs, Setting
from splitkv.kernels.common import LN2, LOG2E
from splitkv.schedule import split_ranges
from splitkv.teaching.lessons import merge
from splitkv.testing import TOLERANCE, make_problem, reference_for, relative_error

#: Two sequences: 70 keys cut into 3 slices of 32, 45 into 2 (its third program exits).
PREFIXES, N_SPLITS = [70, 45], 3


@pytest.fixture(autouse=True)
def _slices_of_32(monkeypatch):
    """The interpreter's shortest slice (32 keys) on every machine, so that these prefixes are cut as
    described (a GPU's tuned shortest slice would give each one slice)."""
    monkeypatch.setattr(ladder, "min_split_tokens", lambda: 32)


def _problem(dtype, seed=0, num_q_heads=4, drafts=4):
    """``num_q_heads`` query heads over 2 KV heads, ``drafts`` drafts (default 8 rows per tile); random slots."""
    return make_problem(PREFIXES, drafts, num_q_heads, 2, 32, dtype=dtype, device=DEVICE, seed=seed)


def _programs(rungs: Rungs, block_n: int):
    """``(tile, split, b, kv_head, slots)`` of every program, by :func:`splitkv.schedule.split_ranges`."""
    p, starts = rungs.p, rungs.p.kv_indptr.tolist()
    for b, kv, m in itertools.product(range(p.batch_size), range(p.num_kv_heads), range(rungs.m_blocks)):
        tile = (b * p.num_kv_heads + kv) * rungs.m_blocks + m
        ranges = split_ranges(p.prefix_lens[b], rungs.n_splits, block_n, rungs.min_split(block_n))
        for split, (lo, hi) in enumerate(ranges):
            yield tile, split, b, kv, p.kv_indices[starts[b] + lo:starts[b] + hi].long()


def _tile_rows(rungs: Rungs):
    """``(tile, r, token, head)`` of every real query row (row r: draft r // GROUP, head kv * GROUP + r % GROUP)."""
    p, qo, g = rungs.p, rungs.p.qo_indptr.tolist(), rungs.group
    for b, kv, m in itertools.product(range(p.batch_size), range(p.num_kv_heads), range(rungs.m_blocks)):
        tile = (b * p.num_kv_heads + kv) * rungs.m_blocks + m
        for r in range(rungs.block_m):
            row = m * rungs.block_m + r
            if row // g < p.extend_lens[b]:
                yield tile, r, qo[b] + row // g, kv * g + row % g


def _states(rungs: Rungs, o: torch.Tensor, lse: torch.Tensor):
    """Per-(tile, split, row) scratch as ``n_splits`` states ``([tokens, H_Q, Dv], [tokens, H_Q])``, float64."""
    p = rungs.p
    o = o.view(rungs.tiles, rungs.n_splits, rungs.block_m, p.v_head_dim).double().cpu()
    lse = lse.view(rungs.tiles, rungs.n_splits, rungs.block_m).double().cpu()
    out_o = torch.zeros(rungs.n_splits, p.num_tokens, p.num_q_heads, p.v_head_dim, dtype=torch.float64)
    out_lse = torch.full((rungs.n_splits, p.num_tokens, p.num_q_heads), -math.inf, dtype=torch.float64)
    used = {(tile, split) for tile, split, _, _, slots in _programs(rungs, 16) if slots.numel()}
    for tile, r, token, head in _tile_rows(rungs):
        for s in range(rungs.n_splits):
            if (tile, s) in used:
                out_o[s, token, head], out_lse[s, token, head] = o[tile, s, r], lse[tile, s, r]
    return [(out_o[s], out_lse[s]) for s in range(rungs.n_splits)]


def _tile_max_sum(rows: torch.Tensor, block_n: int) -> torch.Tensor:
    """What a rung keeps of a slice's gathered rows ``[n, D]``: the element-wise maximum over its key
    tiles (position ``j`` of every tile, padding and the start value 0 included), summed."""
    pad = -rows.shape[0] % block_n
    tiles = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])]).view(-1, block_n, rows.shape[1])
    return tiles.amax(0).clamp_min(0).sum()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("setting", [Setting(16, 4, 1), Setting(32, 2, 1)], ids=["n16", "n32"])
@pytest.mark.parametrize("k_rows", [False, True], ids=["k_cols", "k_rows"])
def test_rung1_keeps_the_gathered_rows_maximum(dtype, setting, k_rows):
    """Every working program's checksum is the summed element-wise maximum of its slice's K and V tiles;
    exited programs write nothing."""
    p = _problem(dtype)
    rungs = Rungs(p, N_SPLITS, 16, k_rows=k_rows)
    rungs.launch(1, setting)
    out = rungs.out.double().cpu()
    n_used = 0
    for tile, split, b, kv, slots in _programs(rungs, setting.block_n):
        program = tile * N_SPLITS + split
        if slots.numel() == 0:
            assert math.isnan(out[program]), "an exited program wrote"
            continue
        n_used += 1
        k, v = p.k_buffer[slots, kv].double(), p.v_buffer[slots, kv].double()
        want = _tile_max_sum(k, setting.block_n) + _tile_max_sum(v, setting.block_n)
        assert abs(out[program].item() - want.item()) < 1e-6 * want.item(), (tile, split)
    assert n_used == 2 * (3 + 2)  # 2 KV heads x (3 + 2) slices


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_rung2_keeps_row_maxima(dtype):
    """Rung 2's checksum: its slice's V tiles' summed maximum plus each real row's base-2 score maximum
    (padded rows score 0)."""
    p = _problem(dtype, seed=1)
    rungs = Rungs(p, N_SPLITS, 16)
    rungs.launch(2, Setting(16, 4, 1))
    out = rungs.out.double().cpu()
    rows = list(_tile_rows(rungs))
    for tile, split, b, kv, slots in _programs(rungs, 16):
        if slots.numel() == 0:
            continue
        k = p.k_buffer[slots, kv].double()
        want = _tile_max_sum(p.v_buffer[slots, kv].double(), 16)
        for t, _, token, head in rows:
            if t == tile:
                want += (k @ p.q_extend[token, head].double()).max() * p.sm_scale * LOG2E
        assert abs(out[tile * N_SPLITS + split].item() - want.item()) < TOLERANCE[dtype] * abs(want.item()) + 1e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("k_rows", [False, True], ids=["k_cols", "k_rows"])
@pytest.mark.parametrize("heads, drafts", [(4, 4), (8, 5)], ids=["one_block", "two_row_blocks"])
def test_rung3_states_merge_to_the_oracle(dtype, k_rows, heads, drafts):
    """Rung 3's per-slice states (the draft block in each sequence's last slice), merged in float64, are
    the attention of the float64 oracle: output and LSE. 8 heads x 5 drafts make 20 rows: two row
    blocks of 16, the second partly filled."""
    p = _problem(dtype, seed=2, num_q_heads=heads, drafts=drafts)
    rungs = Rungs(p, N_SPLITS, 16, k_rows=k_rows)
    assert rungs.m_blocks == (1 if heads == 4 else 2)
    rungs.launch(3, Setting(16, 4, 1), expose=True)
    l = rungs.part_l
    o = rungs.part_o.view(-1, p.v_head_dim) / l[:, None]
    lse = (rungs.part_lse + torch.log2(l)) * LN2
    got_o, got_lse = merge(_states(rungs, o, lse))
    ref_o, ref_lse = reference_for(p, return_lse=True)
    assert relative_error(got_o, ref_o) < TOLERANCE[dtype]
    assert relative_error(got_lse, ref_lse) < TOLERANCE[dtype]
    assert torch.isfinite(rungs.out[rungs.out == rungs.out]).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_rung4_scratch_holds_rung3_states(dtype):
    """Rung 4's partials are rung 3's states, normalised: ``o = acc / l``, base-2 ``lse = m + log2 l``;
    slices that exit leave the scratch untouched."""
    p = _problem(dtype, seed=3)
    three, four = Rungs(p, N_SPLITS, 16), Rungs(p, N_SPLITS, 16)
    three.launch(3, Setting(16, 4, 1), expose=True)
    four.launch(4, Setting(16, 4, 1))
    written = ~torch.isnan(four.part_lse)
    assert torch.equal(written, ~torch.isnan(three.part_lse))
    assert written.sum() == 2 * (3 + 2) * 16  # every row of every working program
    want_o = three.part_o.view(-1, p.v_head_dim) / three.part_l[:, None]
    want_lse = three.part_lse + torch.log2(three.part_l)
    assert torch.allclose(four.part_o.view(-1, p.v_head_dim)[written], want_o[written], rtol=1e-5, atol=1e-6)
    assert torch.allclose(four.part_lse[written], want_lse[written], rtol=1e-5, atol=1e-5)
    assert torch.isnan(four.out).all()  # rung 4 writes the partials instead of a checksum


#: Compiles every rung of the ladder kernel for sm_90 (bf16, Llama-3-8B's tile) and prints each rung's PTX size.
_COMPILE_RUNGS = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from splitkv.bench.ladder_kernels import _rung_kernel

pointers = dict(Q="*bf16", K_Ext="*bf16", V_Ext="*bf16", K_Buf="*bf16", V_Buf="*bf16", qo_indptr="*i32",
                kv_indptr="*i32", kv_indices="*i64", Out="*fp32", Part_O="*fp32", Part_LSE="*fp32", Part_L="*fp32")
sig = {a.name: "constexpr" if a.is_constexpr else pointers.get(a.name, "fp32" if "scale" in a.name else "i32")
       for a in _rung_kernel.params}
for rung in (1, 2, 3, 4):
    consts = dict(RUNG=rung, EXPOSE=False, GROUP=4, NUM_KV_HEADS=8, M_BLOCKS=1, HEAD_DIM=128, V_HEAD_DIM=128,
                  BLOCK_M=16, BLOCK_N=64, BLOCK_D=128, BLOCK_DV=128, BLOCK_N_DRAFT=16, K_ROWS=False,
                  OFFSETS_32=True, DOT_PRECISION=None)
    kernel = triton.compile(ASTSource(fn=_rung_kernel, signature=sig, constexprs=consts),
                            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=2))
    print("rung", rung, len(kernel.asm["ptx"]))
"""


def test_every_rung_compiles_for_hopper():
    """The interpreter runs code that the compiler refuses (a loop-carried tile whose dtype changes, say),
    so each rung is also compiled for sm_90 in bf16, as the H200 runs it. Compiling needs no GPU; it runs
    in a process of its own, since the kernels' ``@triton.jit`` reads ``TRITON_INTERPRET`` at import."""
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    done = subprocess.run([sys.executable, "-c", _COMPILE_RUNGS], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    sizes = [line.split() for line in done.stdout.splitlines() if line.startswith("rung")]
    assert [int(rung) for _, rung, _ in sizes] == [1, 2, 3, 4]
    assert all(int(size) > 0 for _, _, size in sizes)


def test_rungs_follow_the_verify_plan():
    """``Rungs.for_plan`` takes the plan's split count and tile rows; rung 1 then runs its slices."""
    p = _problem(torch.float32, seed=4)
    plan = ladder.verify_plan(p)
    rungs = Rungs.for_plan(p, plan)
    assert (rungs.n_splits, rungs.block_m) == (plan.n_splits, plan.config.block_m)
    assert rungs.tiles == plan.grid[0]
    rungs.launch(1, Setting(plan.config.block_n, 4, 1))
    working = sum(rungs.slicing(plan.config.block_n, n)[1] for n in PREFIXES) * p.num_kv_heads
    assert (~torch.isnan(rungs.out)).sum() == working


def test_rungs_refuse_what_they_do_not_model():
    p = _problem(torch.float32)
    with pytest.raises(ValueError, match="causal"):
        Rungs(p.replace(v_scale=2.0), N_SPLITS, 16)
    with pytest.raises(ValueError, match="causal"):
        Rungs(make_problem([20], 2, 2, 1, 16, mask="tree", device=DEVICE), 1, 16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("config", [FloorConfig(4, 16, 4, 1), FloorConfig(8, 64, 2, 3)], ids=["4x16", "8x64"])
@pytest.mark.parametrize("pad", [0, 8], ids=["packed", "padded_heads"])
def test_heads_together_floor_sums_what_the_per_head_floor_sums(dtype, config, pad):
    """3 KV heads of 40 / 24 dims (masked columns; heads ``pad`` elements apart), 97 random slots: the
    same per-chunk sums as torch and the same total as the per-head gather."""
    g = torch.Generator().manual_seed(5)
    k = torch.randn(300, 3, 40 + pad, generator=g).to(device=DEVICE, dtype=dtype)[:, :, :40]
    v = torch.randn(300, 3, 24 + pad, generator=g).to(device=DEVICE, dtype=dtype)[:, :, :24]
    idx = torch.randperm(300, generator=g)[:97].to(DEVICE)
    together = gather_sum(k, v, idx, config, heads_together=True)
    per_head = gather_sum(k, v, idx, FloorConfig(16, 32))
    assert together.numel() == math.ceil(97 / config.tokens_per_program)
    want = k[idx].double().sum() + v[idx].double().sum()
    scale = (k[idx].double().abs().sum() + v[idx].double().abs().sum()).item()
    assert abs(together.double().sum().item() - per_head.double().sum().item()) < 1e-6 * scale
    assert abs(together.double().sum().item() - want.item()) < 1e-6 * scale
    chunks = torch.split(idx, config.tokens_per_program)
    ref = torch.stack([k[c].double().sum() + v[c].double().sum() for c in chunks])
    assert torch.allclose(together.double().cpu(), ref.cpu(), rtol=0, atol=1e-6 * scale)


# ---- Tables and the command line ----------------------------------------------------------------

def _fake_result(kind="ladder"):
    base = dict(kind=kind, device="NVIDIA H200", num_sms=132, torch="2", triton="3", date="2030-01-01",
                command="python -m splitkv.bench.ladder", draft_tokens=4, empty_graph_us=2.5)
    if kind == "fp8_floors":
        row = dict(model="llama3-8b", batch=8, prefix=65536, bytes_per_head_token=128, bytes_per_token=1024,
                   per_head=dict(us=80.0), heads_together=dict(us=60.0))
        return dict(base, rows=[row])
    us = {"1": 10.0, "2": 12.5, "3": 15.0, "4": None, "5": 20.0}
    row = dict(model="llama3-8b", batch=1, prefix=4096, n_splits=16, merge="last program", gather_floor_us=9.0,
               rungs={r: dict(us=t) for r, t in us.items()})
    row["steps"] = ladder._steps(row["rungs"])
    return dict(base, rows=[row])


def _cells(text: str, row: str) -> list:
    line = next(x for x in text.splitlines() if x.startswith(row))
    return re.split(r"\s{2,}", line.strip())


def test_ladder_table_shows_rungs_and_steps():
    """Per row: splits, merge, floor, then each rung's µs with its step; rung 4 failed, so 4 and 5 have no step."""
    text = ladder.format_table(_fake_result())
    assert _cells(text, "llama3-8b 1x4k") == ["llama3-8b 1x4k", "16", "last program", "9.0", "10.0", "12.5 (+2.5)",
                                              "15.0 (+2.5)", "-", "20.0"]
    assert "2.5 µs" in text and "`python -m splitkv.bench.ladder`" in text
    md = ladder.format_markdown(_fake_result())
    assert md.startswith("NVIDIA H200") and "| llama3-8b 1x4k | 16 | last program | 9.0 | 10.0 |" in md


def test_fp8_table_compares_the_layouts():
    text = ladder.format_table(_fake_result("fp8_floors"))
    assert _cells(text, "llama3-8b 8x64k") == ["llama3-8b 8x64k", "128", "80.0", "60.0", "0.75x"]


def test_command_line_paths():
    full = ladder.plan_run([], "NVIDIA H200")
    assert full["out"] == "figures/ladder_h200.json" and full["md"] == "figures/ladder_h200.md"
    assert len(full["models"]) * len(full["rows"]) == 12 and full["grid"] == ladder.GRID
    quick = ladder.plan_run(["--quick", "--fp8"], "NVIDIA H200")
    assert quick["out"] == "figures/ladder_h200_fp8_quick.json" and quick["fp8"] and not quick["gather_floor"]
    assert ladder.plan_run(["--fp8"], "NVIDIA H200")["rows"][-1] == (8, 65536)
    assert ladder.plan_run(["--out", "x/y.json"], "NVIDIA H200")["md"] == "x/y.md"


class _CallOnce:
    """A stand-in timer: runs the callable once and reports ``us`` µs (the row assembly, not the clock)."""

    warmup_ms, rep_ms = 0.0, 0.0

    def __init__(self):
        self.calls = 0

    def graph(self, fn):
        fn()
        self.calls += 1
        return 10.0 + self.calls


@pytest.fixture
def tiny_model(monkeypatch):
    from splitkv.testing.problem import HeadShape

    monkeypatch.setitem(ladder.MODEL_SHAPES, "tiny", HeadShape("tiny", 4, 2, 32))
    return "tiny"


def test_ladder_row_times_every_rung_on_the_plan(tiny_model):
    """A row holds the plan's split count, each rung's winner and slicing, the verify kernel, and steps."""
    timer = _CallOnce()
    grid = dict(block_ns=(16, 32), num_warps=(4,), num_stages=(1, 2))
    row = ladder.ladder_row(tiny_model, 2, 100, timer, grid, device=DEVICE, dtype=torch.float32)
    plan_n = row["plan_config"]["block_n"]
    assert set(row["rungs"]) == {"1", "2", "3", "4", "5"} and row["n_splits"] >= 1
    for rung in "1234":
        rec = row["rungs"][rung]
        tried = {(t[0], t[1], t[2]) for t in rec["trials"]}
        planned = (plan_n, row["plan_config"]["num_warps"], row["plan_config"]["num_stages"])
        assert {(16, 4, 1), (32, 4, 1), planned} <= tried
        assert rec["us"] == min(t[3] for t in rec["trials"]) and not rec["errors"]
        assert rec["slicing"][1] <= row["n_splits"]
    assert row["steps"]["5"] == row["rungs"]["5"]["us"] - row["rungs"]["4"]["us"]
    assert row["gather_floor_us"] is not None and row["merge"] in ladder._MERGE_NAMES.values()


def test_fp8_floor_row_times_both_layouts(tiny_model):
    row = ladder.fp8_floor_row(tiny_model, 1, 64, _CallOnce(), quick=True, device=DEVICE)
    assert row["per_head"]["us"] and row["heads_together"]["us"] and not row["per_head"]["errors"]
    assert row["heads_together"]["config"]["block_n"] in TOKEN_BLOCK_NS
    assert (row["bytes_per_head_token"], row["bytes_per_token"]) == (32, 64)
