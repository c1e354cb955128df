"""Every measured number the README and the docs quote comes from a committed record.

Each check below recomputes a number, a count or a range from a record in ``figures/`` with a
stated rule (which rows, which pool, which ratio), prints it the way the page prints it (the
page's number of decimals, ranges as ``lo–hi`` with an en dash) and asserts that the page says
exactly that sentence. A number that drifts from its record fails, and so does a sentence the
page reworded: update its rule here, never the record. Nothing here needs a GPU.

Rules shared by the checks of the main benchmark (``figures/benchmark_h200.json``):

- times are CUDA-graph replays (``graph``), except where a sentence says best of graph and eager;
- ``÷ gather floor`` is splitkv's graph time over the row's ``gather_floor_us``;
- ``% of the measured read bandwidth`` is the row's ``pct_bw`` (prefix K+V bytes over the best
  of splitkv's graph and eager times, over the run's ``read_bandwidth``);
- "reads 1 GB or more" means ``kv_bytes >= 1e9``, "256 MB or more" ``kv_bytes >= 256e6`` (of the
  bf16 pool, for fp8 rows too);
- speedups are the peer's graph time over splitkv's.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "figures"


# --------------------------------------------------------------------------- helpers

@lru_cache(maxsize=None)
def page(name: str) -> str:
    """A page's text with every run of whitespace (line breaks included) made one space."""
    return re.sub(r"\s+", " ", (ROOT / name).read_text(encoding="utf-8"))


@lru_cache(maxsize=None)
def record(name: str) -> dict:
    return json.loads((FIGURES / f"{name}.json").read_text(encoding="utf-8"))


def num(x: float, nd: int = 0) -> str:
    """``x`` with ``nd`` decimals, as the pages print it."""
    return f"{x:.{nd}f}"


def span(values, nd: int = 0, nd_hi: int | None = None) -> str:
    """``min–max`` of ``values``; the high end with ``nd_hi`` decimals where that differs."""
    values = list(values)
    assert values, "a range over no rows: the rule selects nothing"
    return f"{num(min(values), nd)}–{num(max(values), nd if nd_hi is None else nd_hi)}"


def us(x: float) -> str:
    """A time in µs as the benchmark's tables print it: one decimal below 1000, none above."""
    return f"{x:.1f}" if x < 1000 else f"{x:.0f}"


def says(name: str, sentence: str) -> None:
    text = page(name)
    assert sentence in text, (
        f"{name} should say, from its record:\n  {sentence!r}\n"
        f"nearest text: {_nearest(text, sentence)!r}")


def _nearest(text: str, sentence: str) -> str:
    """The page's text around the longest leading part of ``sentence`` it contains."""
    for n in range(len(sentence), 8, -4):
        i = text.find(sentence[:n])
        if i >= 0:
            return text[i:i + len(sentence) + 40]
    return "(no part of it found)"


# --------------------------------------------------------------------------- the main benchmark

def bench() -> dict:
    return record("benchmark_h200")


def rows(kv: str | None = None, **where) -> list:
    """The main benchmark's rows on the ``kv`` pool (``"bf16"``, ``"fp8"``, None: both) matching ``where``."""
    out = []
    for r in bench()["rows"]:
        fp8 = r["kv_dtype"].startswith("float8")
        if kv == "bf16" and fp8 or kv == "fp8" and not fp8:
            continue
        if all(r[k] == v for k, v in where.items()):
            out.append(r)
    return out


def graph(r: dict, impl: str = "splitkv") -> float | None:
    return r["impls"].get(impl, {}).get("graph")


def eager(r: dict, impl: str = "splitkv") -> float | None:
    return r["impls"].get(impl, {}).get("eager")


def best(r: dict, impl: str = "splitkv") -> float | None:
    times = [t for t in (graph(r, impl), eager(r, impl)) if t]
    return min(times) if times else None


def over_gather(r: dict) -> float:
    return graph(r) / r["gather_floor_us"]


def pct_bw(r: dict) -> float:
    return r["impls"]["splitkv"]["pct_bw"]


def bf16_twin(r: dict) -> dict:
    """The bf16 row of an fp8 row's shape."""
    (twin,) = rows("bf16", model=r["model"], batch=r["batch"], prefix=r["prefix"])
    return twin


def big(r: dict) -> bool:
    """The call reads 1 GB or more (bf16 pool)."""
    return r["kv_bytes"] >= 1e9


def peers(r: dict) -> list:
    """The row's other implementations (splitkv's own batch-invariant mode is not a peer)."""
    return [n for n in r["impls"] if n not in ("splitkv", "splitkv_invariant")]


def fastest_everywhere() -> int:
    """Rows where splitkv is faster than every peer that ran, in graph replays and eagerly."""
    count = 0
    for r in rows():
        if all((graph(r, n) is None or graph(r, n) > graph(r)) and (eager(r, n) is None or eager(r, n) > eager(r))
               for n in peers(r)):
            count += 1
    return count


def invariant_ratios(rs) -> list:
    return [graph(r, "splitkv_invariant") / graph(r) for r in rs]


MODELS = {"Llama-3-8B": "llama3-8b", "Qwen3-32B": "qwen3-32b", "Qwen3-Next (256-dim heads)": "qwen3-next"}
README_COLUMNS = {"floor": lambda r: r["floor_us"], "gather floor": lambda r: r["gather_floor_us"],
                  "splitkv": graph, "FlexAttention": lambda r: graph(r, "flex"),
                  "extend": lambda r: graph(r, "extend")}


def readme_table() -> tuple:
    """The README's results table: its header, its rows (cells as printed) and the line after it."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| model, batch, prefix |"))
    head = [c.strip() for c in lines[start].strip("|").split("|")]
    body, i = [], start + 2
    while i < len(lines) and lines[i].startswith("|"):
        body.append([c.strip() for c in lines[i].strip("|").split("|")])
        i += 1
    after = " ".join(line for line in lines[i + 1:i + 3] if line)
    return head, body, after


def test_readme_table_cells_are_the_record_rounded_as_printed():
    head, body, _ = readme_table()
    assert head[0] == "model, batch, prefix" and set(head[1:]) == set(README_COLUMNS)
    assert len(body) == 6
    for cells in body:
        model, batch, prefix = (c.strip() for c in cells[0].rsplit(",", 2))
        assert prefix.endswith("k")
        (r,) = rows("bf16", model=MODELS[model], batch=int(batch), prefix=int(prefix[:-1]) * 1024)
        for column, cell in zip(head[1:], cells[1:]):
            assert cell == us(README_COLUMNS[column](r)), (cells[0], column, cell, us(README_COLUMNS[column](r)))


def test_readme_table_has_one_provenance_line_from_the_record():
    _, _, after = readme_table()
    b = bench()
    assert after.startswith(b["device"] + ",")
    assert b["date"] in after
    assert f"torch {'.'.join(b['torch'].split('.')[:2])}" in after
    assert f"Triton {'.'.join(b['triton'].split('.')[:2])}" in after
    command = f"`python -m splitkv.bench --rep-ms {b['timing']['rep_ms']:g} --host-calls {b['timing']['host_calls']}`"
    assert command in after
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert readme.count(f"{b['device']}, torch") == 1


def test_readme_prose():
    bf64 = rows("bf16", prefix=65536)
    says("README.md", f"at 64k-token prefixes on bf16 pools it is "
                      f"{span((graph(r, 'extend') / graph(r) for r in bf64))}× faster than")
    assert fastest_everywhere() == len(rows()) == 72
    says("README.md", f"faster than every other implementation measured at all {len(rows())} shapes (three models")
    assert len({r["model"] for r in rows()}) == 3
    large = [r for r in rows("bf16") if big(r)]
    says("README.md", f"Wherever a call reads 1 GB or more ({len(large)} bf16 rows) it runs at "
                      f"{span(map(pct_bw, large))} % of the measured read bandwidth, which is torch's `x.sum()`")
    # Above 100 % is possible: the bare gather kernel also reads faster than x.sum() at those rows.
    beat = max(r["floor_us"] / r["gather_floor_us"] - 1 for r in large) * 100
    assert max(map(pct_bw, large)) > 100 and beat > 0
    says("README.md", f"the bare gather kernel beats it too, by up to {num(beat)} % at those rows")
    b14 = rows("bf16", batch=1, prefix=4096)
    says("README.md", f"At batch 1 and 4k-token prefixes splitkv takes {span(map(over_gather, b14), 1)}× the "
                      "gather floor")


# --------------------------------------------------------------------------- the benchmarks page: main run

def test_benchmarks_run_parts_and_bandwidth():
    b = bench()
    part = {}
    for r in rows():
        key = "a" if r["model"] in ("qwen3-next", "llama3-8b") else "b"
        part[key] = part.get(key, 0) + r["elapsed_s"] + r.get("setup_s", 0)
    says("docs/benchmarks.md", f"one with `--models qwen3-next llama3-8b` ({num(part['a'])} s) and one with "
                               f"`--models qwen3-32b` ({num(part['b'])} s)")
    runs = b["read_bandwidth_runs"]
    assert runs[0] == b["read_bandwidth"] and len({num(x / 1e12, 2) for x in runs}) == 1
    says("docs/benchmarks.md", f"every floor is taken at the first run's read bandwidth, "
                               f"{num(b['read_bandwidth'] / 1e12, 2)} TB/s (the second measured the same)")
    says("docs/benchmarks.md", f"make bench # the full sweep (about {num(b['elapsed_s'] / 60)} minutes on an H200)")
    minutes = round(record("benchmark_mla_h200")["elapsed_s"] / 60)
    words = ["zero", "one", "two", "three", "four", "five", "six"]
    says("docs/benchmarks.md", f"python -m splitkv.bench.mla # MLA (DeepSeek-V3), about {words[minutes]} minutes")


def test_benchmarks_in_short():
    assert fastest_everywhere() == len(rows())
    says("docs/benchmarks.md", f"splitkv is faster than every other implementation at all {len(rows())} rows, "
                               "in graph replays and eagerly")
    # The closest peer: the smallest peer ÷ splitkv, each at its best of graph and eager.
    _, r, name = min(((best(r, n) / best(r), r, n) for r in rows() for n in peers(r) if best(r, n)),
                     key=lambda x: x[0])
    assert (name, r["model"], r["batch"], r["prefix"], r["kv_dtype"]) == ("flex", "qwen3-next", 1, 65536, "bfloat16")
    says("docs/benchmarks.md", f"The closest is FlexAttention on its dense copy at Qwen3-Next, batch 1 / 64k "
                               f"({us(best(r, 'flex'))} against {us(best(r))} µs)")
    inv = invariant_ratios(rows())
    faster = [x for x in inv if x < 1]
    says("docs/benchmarks.md", f"splitkv's own batch-invariant mode is faster than its adaptive mode at {len(faster)} "
                               f"rows, by up to {num((1 - min(faster)) * 100)} %")
    large = [r for r in rows("bf16") if big(r)]
    beat = max(r["floor_us"] / r["gather_floor_us"] - 1 for r in large) * 100
    says("docs/benchmarks.md", f"Wherever a call reads 1 GB or more ({len(large)} rows, bf16 pool), splitkv runs at "
                               f"{span(map(pct_bw, large))} % of the measured read bandwidth, "
                               f"{span(map(over_gather, large), 2)}× the gather floor. Above 100 % is possible "
                               "because that bandwidth is torch's `x.sum()` over a contiguous 2 GiB buffer, not the "
                               "memory's peak: at those rows the bare gather kernel beats it too, by up to "
                               f"{num(beat)} %.")
    at = {p: [graph(r, "extend") / graph(r) for r in rows("bf16", prefix=p)] for p in (1024, 65536)}
    says("docs/benchmarks.md", f"Against `extend_attention_fwd` (bf16): {span(at[1024], 1, 0)}× faster at 1k-token "
                               f"prefixes, {span(at[65536])}× at 64k")
    fp8_128 = [graph(r) / graph(bf16_twin(r)) for r in rows("fp8")
               if r["model"] != "qwen3-next" and bf16_twin(r)["kv_bytes"] >= 256e6]
    says("docs/benchmarks.md", f"fp8 pools take {span(fp8_128, 2)}× the bf16 time for the 128-dim models at 256 MB "
                               "of KV and more")
    small = [r for r in rows("bf16") if r["batch"] <= 8 and r["prefix"] <= 16384]
    b14 = rows("bf16", batch=1, prefix=4096)
    says("docs/benchmarks.md", f"At batch ≤ 8 and prefixes ≤ 16k ({len(small)} bf16 rows) splitkv takes "
                               f"{span(map(over_gather, small), 2)}× the gather floor, within 1.25× at "
                               f"{sum(over_gather(r) <= 1.25 for r in small)} of them; at batch 1 and 4k, "
                               f"{span(map(graph, b14), 1)} µs against floors of "
                               f"{span((r['gather_floor_us'] for r in b14), 1)} µs")


def test_benchmarks_known_limits_main_run():
    doc = "docs/benchmarks.md"
    b14 = rows("bf16", batch=1, prefix=4096)
    small = [r for r in rows("bf16") if r["batch"] <= 8 and r["prefix"] <= 16384]
    says(doc, f"At batch 1 and a 4k prefix a call takes {span(map(graph, b14), 1)} µs, "
              f"{span(map(over_gather, b14), 1)}× the gather floor (at batch ≤ 8 and prefixes ≤ 16k: "
              f"{span(map(over_gather, small), 2)}×)")
    says(doc, f"those calls read at {span(map(pct_bw, b14))} % of the measured read bandwidth")
    qn = [r for r in rows("bf16", model="qwen3-next", batch=1) if r["prefix"] <= 16384]
    says(doc, f"Qwen3-Next is furthest ({span(map(over_gather, qn), 1)}× at batch 1 up to 16k)")

    medium = [r for r in rows("bf16") if 256e6 <= r["kv_bytes"] < 1e9]
    qn268 = [r for r in medium if r["model"] == "qwen3-next"]
    assert {round(r["kv_bytes"] / 1e6) for r in qn268} == {268}
    b164 = [r for r in medium if r["model"] != "qwen3-next" and r["batch"] == 1 and r["prefix"] == 65536]
    gather_pct = {num(r["floor_us"] / r["gather_floor_us"] * 100) for r in b164}
    assert len(gather_pct) == 1
    says(doc, f"At 256 MB–1 GB of KV the bf16 calls reach {span(map(pct_bw, medium))} % of the read bandwidth "
              f"(Qwen3-Next {span(map(pct_bw, qn268))} % at 268 MB; the 128-dim models {span(map(pct_bw, b164))} % "
              f"at batch 1 / 64k, where the gather floor itself reaches {gather_pct.pop()} %)")

    fp8 = rows("fp8")
    qn_large = [r for r in fp8 if r["model"] == "qwen3-next" and bf16_twin(r)["kv_bytes"] >= 256e6]
    qn_b1 = [r for r in fp8 if r["model"] == "qwen3-next" and r["batch"] == 1]
    (qn864,) = rows("fp8", model="qwen3-next", batch=8, prefix=65536)
    says(doc, f"Qwen3-Next's fp8 calls take {span((graph(r) / graph(bf16_twin(r)) for r in qn_large), 2)}× its bf16 "
              f"calls where the bf16 pool holds 256 MB or more (up to "
              f"{num(max(graph(r) / graph(bf16_twin(r)) for r in qn_b1), 2)}× at batch 1)")
    says(doc, f"there it takes {span(map(over_gather, qn_large), 2)}× the fp8 gather floor (batch 8 / 64k: "
              f"{us(graph(qn864))} against {us(qn864['gather_floor_us'])} µs)")
    m128 = [r for r in fp8 if r["model"] != "qwen3-next" and bf16_twin(r)["kv_bytes"] >= 256e6]
    (l864,) = rows("fp8", model="llama3-8b", batch=8, prefix=65536)
    says(doc, f"For the 128-dim models fp8 takes {span((graph(r) / graph(bf16_twin(r)) for r in m128), 2)}× the "
              f"bf16 time and {span(map(over_gather, m128), 2)}× the fp8 gather floor (Llama-3-8B batch 8 / 64k: "
              f"{us(graph(l864))} against {us(l864['gather_floor_us'])} µs)")

    inv_all = invariant_ratios(rows())
    inv_qn = invariant_ratios([r for r in rows(model="qwen3-next", prefix=1024) if r["batch"] in (1, 8)])
    inv_32 = invariant_ratios([r for r in rows(batch=32) if r["model"] != "qwen3-next" and r["prefix"] >= 4096])
    says(doc, f"takes {span(inv_all, 2, 1)}× the adaptive time; most for Qwen3-Next at 1k prefixes "
              f"({span(inv_qn, 1)}× at batch 1 and 8); {span(inv_32, 2)}× at batch 32 for the 128-dim models from "
              "4k prefixes on")
    says("docs/design.md", f"with 1024-token slices the H200 benchmark measured {span(inv_all, 2, 1)}× the adaptive "
                           f"time, {span(inv_32, 2)}× for Llama-3-8B and Qwen3-32B at batch 32 from 4k prefixes on")


def host_us(rs) -> list:
    return [r["impls"]["splitkv"]["host_us"] for r in rs]


def test_host_times():
    doc = "docs/benchmarks.md"
    h = host_us(rows())
    says(doc, f"{span(h)} µs per call on the fastest CPU of the benchmark's machine (median "
              f"{num(statistics.median(h))}), above 30 µs at {sum(x > 30 for x in h)} of the {len(h)} rows")
    says("docs/design.md", f"{span(h)} µs at the benchmark's {len(h)} shapes, at most 30 at "
                           f"{sum(x <= 30 for x in h)} of them")
    qn8 = host_us(rows("fp8", model="qwen3-next"))
    qn16 = host_us(rows("bf16", model="qwen3-next"))
    says("docs/design.md", f"Qwen3-Next's fp8 calls launch twice (a median of {num(statistics.median(qn8))} µs "
                           f"against {num(statistics.median(qn16))} for its bf16 rows)")
    cpus = [c for r in rows() for rec in r["impls"].values() for c in rec.get("host_cpus", [])]
    says(doc, f"took {span(c['ref_us'] for c in cpus)} µs on the fastest CPU and "
              f"{span(c['slowest_ref_us'] for c in cpus)} µs on the slowest over the benchmark's host rounds")
    assert round(statistics.median(c["slowest_ref_us"] / c["ref_us"] for c in cpus)) == 2  # "about twice as much"
    (l11,) = rows("bf16", model="llama3-8b", batch=1, prefix=1024)
    says(doc, f"Of an eager drop-in call of about {num(l11['impls']['splitkv']['host_us'])} µs "
              "(Llama-3-8B, batch 1 / 1k)")




def test_host_time_drift_against_the_earlier_run():
    earlier = earlier_record(EARLIER_RUN)
    assert earlier["date"] == "2026-12-01"
    h = [r["impls"]["splitkv"]["host_us"] for r in earlier["rows"]]

    def extend_l11(result):
        (r,) = [r for r in result["rows"] if (r["model"], r["batch"], r["prefix"], r["kv_dtype"])
                == ("llama3-8b", 1, 1024, "bfloat16")]
        return num(r["impls"]["extend"]["host_us"], 1)

    says("docs/benchmarks.md", f"a run on {earlier['date']}, of an earlier version of the package, measured "
                               f"{span(h)} µs (median {num(statistics.median(h))}), and the peers' host times were "
                               f"lower by about as much (`extend` at Llama-3-8B batch 1 / 1k: {extend_l11(earlier)} "
                               f"against {extend_l11(bench())} µs)")


def test_design_fp8_gather_floors():
    shapes = [("llama3-8b", 8, 65536), ("qwen3-32b", 8, 16384), ("qwen3-next", 8, 65536), ("llama3-8b", 1, 4096)]
    floors = [us(rows("fp8", model=m, batch=b, prefix=p)[0]["gather_floor_us"]) for m, b, p in shapes]
    says("docs/design.md", f"in the benchmark of {bench()['date']}, {floors[0]}, {floors[1]}, {floors[2]} and "
                           f"{floors[3]} µs at the four rows.)")
    (ladder,) = [r for r in record("ladder_h200_fp8")["rows"] if (r["model"], r["batch"], r["prefix"])
                 == ("qwen3-next", 8, 65536)]
    says("docs/design.md", f"1.6× the current floor kernel's {us(ladder['per_head']['us'])} µs")
    assert num(227.6 / ladder["per_head"]["us"], 1) == "1.6"  # the probe's 227.6 µs against it


# --------------------------------------------------------------------------- paged pools, score features

def test_paged_pools_and_features():
    doc = "docs/benchmarks.md"
    breadth = record("benchmark_breadth_h200")
    ratios = [(p[k] / p["token_us"], p["model"], p["prefix"], k) for p in breadth["paged"]
              for k in ("page16_us", "page64_us")]
    fastest = min(ratios)
    assert fastest[1:] == ("qwen3-next", 65536, "page64_us")
    says(doc, f"Pages of 16 or 64 tokens take {span((x[0] for x in ratios), 2)}× the token pool's time, never more "
              f"than {num((max(ratios)[0] - 1) * 100, 1)} % longer (the fastest, {num(fastest[0], 2)}×, is "
              "Qwen3-Next at 64k in pages of 64)")
    cap = {num((f["ratio"] - 1) * 100) for f in breadth["features"] if "logit_cap" in f["features"]}
    assert len(cap) == 1
    says(doc, f"A logit cap costs {cap.pop()} %")
    (window,) = [f for f in breadth["features"] if "sliding_window_size" in f["features"]]
    assert window["plain_prefix"] == window["features"]["sliding_window_size"] == 128
    assert num(window["ratio"], 2) == "1.01"
    says(doc, "a 128-token sliding window over a 64k prefix costs what a plain 128-key prefix costs")

    (qn,) = [p for p in breadth["paged"] if p["model"] == "qwen3-next" and p["kv_bytes"] >= 1e9]
    wide = [p[k] for p in breadth["paged"] if p["model"] != "qwen3-next" and p["kv_bytes"] >= 1e9
            for k in ("page16_pct_bw", "page64_pct_bw")]
    says(doc, f"Paged pools of 256-dim heads in pages of 16** reach {num(qn['page16_pct_bw'])} % of the read "
              f"bandwidth at 1 GB, against {num(qn['page64_pct_bw'])} % in pages of 64 and {span(wide)} % for the "
              "128-dim models")


# --------------------------------------------------------------------------- context parallelism

def test_context_parallel():
    doc = "docs/benchmarks.md"
    cp = record("benchmark_cp_h200x2")["rows"]
    ratio = {(r["model"], r["batch"], r["prefix"]): r["cp_us"] / r["single_us"] for r in cp}
    large = [ratio[r["model"], r["batch"], r["prefix"]] for r in cp
             if r["kv_gb_per_gpu"] >= 1 and (r["model"], r["batch"]) != ("qwen3-next", 1)]
    err = max(r["err_vs_single"] for r in cp)
    says(doc, f"Two GPUs take {span(large, 2)}× the one-GPU time wherever each GPU reads at least 1 GB (Qwen3-Next "
              f"at batch 1 / 1M tokens: {num(ratio['qwen3-next', 1, 1 << 20], 2)}×); the all-gather and the merge "
              f"add {span(r['comm_us'] for r in cp)} µs per call, and every output is within "
              f"{num(err * 1e3, 1)}e-3 of the one-GPU output")
    b8 = [r for r in cp if r["batch"] == 8]
    short = [r["speedup"] for r in cp if r["kv_gb_per_gpu"] < 1]
    says(doc, f"the all-gather and merge take {span(r['comm_us'] for r in b8)} µs per call at batch 8, most of it "
              f"the all-gather ({span(r['allgather_us'] for r in b8)} µs); over short per-GPU reads two GPUs give "
              f"{span(short, 1)}×")


# --------------------------------------------------------------------------- MLA

def mla_rows(fp8: bool = False) -> list:
    return record("benchmark_mla_fp8_h200" if fp8 else "benchmark_mla_h200")["rows"]


def mla(r: dict, impl: str = "splitkv") -> float | None:
    return r["impls"].get(impl, {}).get("us")


def mla_large(r: dict) -> bool:
    """The latent cache holds 151 MB or more (as the table prints ``latent MB``)."""
    return round(r["latent_mb"], 1) >= 151


def test_mla_bf16():
    doc = "docs/benchmarks.md"
    rs = mla_rows()
    for r in rs:  # the record's TFLOPS: 2 × (576 + 512) flops per query row and visible key
        assert r["impls"]["splitkv"]["tflops"] == pytest.approx(r["flops"] / mla(r) / 1e6)
    large = [r for r in rs if mla_large(r)]
    tflops = span(r["impls"]["splitkv"]["tflops"] for r in large)
    pct16 = span(r["impls"]["splitkv"]["pct_bw"] for r in large if r["heads"] == 16)
    gf16 = span((mla(r) / r["gather_floor_us"] for r in large if r["heads"] == 16), 1)
    says("README.md", f"runs at {tflops} TFLOPS wherever the latent cache is 151 MB or more")
    says(doc, f"The kernel reaches {tflops} TFLOPS in both regimes wherever the latent cache holds 151 MB or more, "
              f"so at 16 heads it reads at {pct16} % of the bandwidth there")
    says(doc, f"reaches {span((r['floor_us'] / r['gather_floor_us'] * 100 for r in large))} % of the bandwidth at "
              f"151 MB and more: splitkv takes {gf16}× it at 16 heads there")
    tb = record("benchmark_mla_h200")["read_bandwidth"] / 1e12
    says(doc, f"about {num(64 * 1088 * 2 / 1152)} flops per byte at 16 heads, {num(512 * 1088 * 2 / 1152)} at 128, "
              f"against the H200's ratio of dense bf16 peak to read bandwidth of about {num(989 / round(tb, 1))} "
              f"(989 TFLOPS / {num(tb, 1)} TB/s)")
    b1 = {r["prefix"]: us(mla(r)) for r in rs if r["heads"] == 16 and r["batch"] == 1}
    says(doc, f"{b1[4096]} / {b1[16384]} / {b1[65536]} µs at 4k / 16k / 64k")
    ext = span(mla(r, "extend") / mla(r) for r in rs if r["prefix"] >= 16384)
    says("README.md", f"{ext}× faster than the package's SGLang-shaped baseline `splitkv.extend_attention_fwd` "
                      "from 16k-token prefixes on")
    says(doc, f"takes {ext}× splitkv's time from 16k keys on")
    says(doc, f"FlexAttention (compiled, on a dense copy) takes "
              f"{span(mla(r, 'flex') / mla(r) for r in rs if r['heads'] == 16)}× at 16 heads")
    assert all("NoValidChoicesError" in r["impls"]["flex"]["error"] for r in rs if r["heads"] == 128)
    oom = [r for r in rs if "OutOfMemoryError" in r["impls"]["sdpa"].get("error", "")]
    assert oom and all(r["prefix"] >= 16384 for r in oom)

    # Known limits
    says(doc, f"**MLA** reaches {tflops} TFLOPS "
              f"({span((r['impls']['splitkv']['tflops'] / 989 * 100 for r in large))} % of the dense bf16 peak) from "
              f"151 MB of latent cache on: {pct16} % of the read bandwidth at 16 heads, where the bytes alone would "
              f"allow more than twice the speed ({gf16}× the gather floor), and "
              f"{span(r['impls']['splitkv']['tflops'] for r in rs if r['heads'] == 128 and r['latent_mb'] >= 64)} "
              "TFLOPS at 128 heads from 64 MB on")
    b14 = [r for r in rs if r["batch"] == 1 and r["prefix"] == 4096]
    says(doc, f"At batch 1 and 4k a call takes {span(map(mla, b14))} µs, "
              f"{span((mla(r) / r['gather_floor_us'] for r in b14), 1)}× the gather floor")


def test_mla_fp8():
    doc = "docs/benchmarks.md"
    rs = mla_rows(fp8=True)
    for r in rs:
        assert r["fp8_over_bf16"] == pytest.approx(mla(r) / r["bf16_us"])
    ratio = span((r["fp8_over_bf16"] for r in rs), 2)
    says("README.md", f"an fp8 latent cache takes {ratio}× the time of a bf16 one")
    says(doc, f"An fp8 latent cache takes {ratio}× the time of a bf16 one")
    says(doc, f"fp8 calls take {ratio}× the bf16 time, most at 128 heads "
              f"({span((r['fp8_over_bf16'] for r in rs if r['heads'] == 128), 2)}×)")
    says(doc, f"The outputs differ from the bf16 cache's by {span((r['rel_diff_vs_bf16'] * 100 for r in rs), 1)} %")
    says(doc, f"`extend_attention_fwd` on the same fp8 cache takes "
              f"{span((mla(r, 'extend') / mla(r) for r in rs if r['prefix'] >= 16384), 1, 0)}× splitkv's time from "
              "16k keys on")

    sweep = {}
    for t in record("mla_tiles_fp8_h200")["tile_sweep"]:
        tiles = sweep.setdefault((t["heads"], t["batch"], t["prefix"]), {})
        tiles[t["block_n"], t["num_warps"], t["num_stages"]] = t["us"]
    shipped = (64, 8, 2)
    one_stage = [(1 - tiles[64, 8, 1] / tiles[shipped]) * 100 for tiles in sweep.values()]
    says(doc, f"found 64 keys, 8 warps and one stage {span(one_stage)} % faster than the two stages used here")
    key32 = [(min(u for (n, _, s), u in tiles.items() if n == 32 and s <= 2) / tiles[shipped] - 1) * 100
             for tiles in sweep.values()]
    says(doc, f"32-key tiles would cost {span(key32)} % (the fastest 32-key tile of one or two stages against the "
              "shipped tile, per shape of the sweep")


# --------------------------------------------------------------------------- ladder (fp8 floors)

def test_ladder_fp8_heads_together():
    rs = record("ladder_h200_fp8")["rows"]
    ratio = {(r["model"], r["batch"], r["prefix"]): r["heads_together"]["us"] / r["per_head"]["us"] for r in rs}
    at = {num(ratio[m, 8, 65536], 2) for m in ("llama3-8b", "qwen3-32b")}
    assert len(at) == 1
    says("docs/benchmarks.md", f"in fp8 pools its floor is {span(ratio.values(), 2)}× the per-head one, {at.pop()}× "
                               "at the 128-dim models' batch 8 / 64k")
    earlier = earlier_record(EARLIER_LADDER)
    old = [r["heads_together"]["us"] / r["per_head"]["us"] for r in earlier["rows"]]
    says("docs/benchmarks.md", f"The earlier floor kernel had measured {span(old, 2)}× ({earlier['date']});")


# --------------------------------------------------------------------------- earlier runs' records

#: Committed records of earlier runs that the pages compare with, (commit, path): the main benchmark of
#: 2026-12-01 (host times) and the MLA benchmark of 2026-12-02 (batch 1 in one 64-row tile).
EARLIER_RUN = ("2ede29c", "figures/benchmark_h200.json")
EARLIER_MLA = ("01c4813", "figures/benchmark_mla_h200.json")
#: The fp8 floors of 2026-12-02, measured by the floor kernel before its one-accumulator form.
EARLIER_LADDER = ("4de37b2", "figures/ladder_h200_fp8.json")


def earlier_record(where: tuple) -> dict:
    """A record as an earlier commit holds it (the test skips where the checkout has no history)."""
    try:
        text = subprocess.run(["git", "show", ":".join(where)], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("an earlier run's record needs this checkout's git history")
    return json.loads(text)


def test_mla_batch1_against_one_64_row_tile():
    earlier = earlier_record(EARLIER_MLA)
    assert earlier["date"] == "2026-12-02"
    old = {r["prefix"]: us(r["impls"]["splitkv"]["us"]) for r in earlier["rows"]
           if r["heads"] == 16 and r["batch"] == 1}
    assert all(r["impls"]["splitkv"]["config"].startswith("TileConfig(block_m=64") for r in earlier["rows"]
               if r["heads"] == 16 and r["batch"] == 1)
    new = {r["prefix"]: us(mla(r)) for r in mla_rows() if r["heads"] == 16 and r["batch"] == 1}
    assert all(r["impls"]["splitkv"]["config"].startswith("TileConfig(block_m=32") for r in mla_rows()
               if r["heads"] == 16 and r["batch"] == 1)
    says("docs/benchmarks.md", f"{new[4096]} / {new[16384]} / {new[65536]} µs at 4k / 16k / 64k, where one 64-row "
                               f"tile took {old[4096]} / {old[16384]} / {old[65536]} ({earlier['date']},")


# --------------------------------------------------------------------------- probes kept in logs and tables

LOG = ROOT / "notebooks" / "h200_run" / "gpu_tests.log"
_LOG_ROW = re.compile(r"^(?P<model>\S+) (?P<kv>fp8|bf16) bs(?P<batch>\d+) (?P<prefix>\d+): A merge \d+ ns \d+ "
                      r"\[\((?P<a_regs>\d+), (?P<a_spills>\d+)\)\] (?P<a>[\d.]+) \|.*\| D2 merge \d+ ns \d+ "
                      r"\[\((?P<d_regs>\d+), (?P<d_spills>\d+)\)\] (?P<d>[\d.]+) \|")
_LABEL = {"Qwen3-Next": "qwen3-next", "Llama-3-8B": "llama3-8b", "Qwen3-32B": "qwen3-32b"}


def markdown_table(name: str, header: str) -> list:
    """The rows (cells as printed) of the table whose header line starts with ``header``."""
    lines = (ROOT / name).read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    out = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        out.append([c.strip() for c in line.strip("|").split("|")])
    return out


def test_cost_of_the_bounds_check_is_the_logged_a_b():
    """The bounds-check table is the log's A (as shipped) and D2 (slot check removed) of one same-process probe."""
    logged = {}
    for line in LOG.read_text(encoding="utf-8").splitlines():
        m = _LOG_ROW.match(line)
        if m:
            logged[m["model"], m["kv"], int(m["batch"]), int(m["prefix"])] = m
    costs = []
    for shape, with_, without, cost in markdown_table("docs/benchmarks.md", "| shape | with the check, µs |"):
        sm = re.fullmatch(r"(\S+)( fp8)? bs (\d+) / (\d+)k", shape)
        m = logged[_LABEL[sm[1]], "fp8" if sm[2] else "bf16", int(sm[3]), int(sm[4]) * 1024]
        for cell, t, regs, spills in ((with_, m["a"], m["a_regs"], m["a_spills"]),
                                      (without, m["d"], m["d_regs"], m["d_spills"])):
            assert cell in (t, f"{t} ({regs} / {spills})"), (shape, cell, t)
        c = (float(m["a"]) / float(m["d"]) - 1) * 100
        assert cost == f"{'+' if c >= 0 else '−'}{abs(c):.1f} %", (shape, cost, c)
        costs.append(c)
    assert len(costs) == 6
    says("docs/benchmarks.md", f"The check costs up to {num(max(costs))} %, most where registers are tight")
    says("docs/design.md", f"pool's slot check costs up to {num(max(costs))} % on the current kernel")


def test_merge_cost_from_the_design_table():
    rows_ = markdown_table("docs/design.md", "| shape | merged by | float32 partials |")
    b1 = [(r[0], float(r[2]) - float(r[4]), float(r[3]) - float(r[4])) for r in rows_ if "batch 1 /" in r[0]]
    f32, b16 = [x[1] for x in b1], [x[2] for x in b1]
    assert max(b1, key=lambda x: x[2])[0] == "Qwen3-Next, batch 1 / 16k"
    says("docs/design.md", f"costs {span(b16, 1)} µs with bf16 partials and {span(f32, 1)} µs with float32 ones, "
                           "most at Qwen3-Next's 16k row")
    says("docs/benchmarks.md", f"The merge alone still costs {span(b16, 1)} µs at batch 1")


def test_torch_compile_second_launch_from_the_design_table():
    (llama,) = [r for r in markdown_table("docs/design.md", "| model (`BLOCK_M × Dv`) |") if r[0].startswith("Llama")]
    one, spread = llama[2].split()[0], llama[3].split()[0]
    says("docs/benchmarks.md", f"the custom op always merges in a second launch, {spread} against {one} µs for "
                               "Llama-3-8B at batch 1 / 4k")


#: The benchmark runs of 2026-12-01 that the design notes' fp8 history quotes: the one beside the float16-dot
#: probes, and the runs before and after Qwen3-Next's fp8 tile began loading K as rows.
EARLIER_FP8 = ("0408790", "figures/benchmark_h200.json")
EARLIER_K_COLUMNS = ("0bc32b6", "figures/benchmark_h200.json")
EARLIER_K_ROWS = ("ba4feb8", "figures/benchmark_h200.json")


def graph_in(result: dict, model: str, batch: int, prefix: int, fp8: bool) -> str:
    (r,) = [r for r in result["rows"] if (r["model"], r["batch"], r["prefix"]) == (model, batch, prefix)
            and r["kv_dtype"].startswith("float8") == fp8]
    return us(graph(r))


def test_design_fp8_history_from_earlier_runs():
    earlier = earlier_record(EARLIER_FP8)
    assert earlier["date"] == "2026-12-01"
    table = markdown_table("docs/design.md", "| shape | bf16 pool | fp8, bf16 dots (before) |")
    shapes = {"Llama-3-8B, batch 8, 64k": ("llama3-8b", 8, 65536), "Qwen3-32B, batch 8, 16k": ("qwen3-32b", 8, 16384),
              "Qwen3-Next, batch 8, 64k": ("qwen3-next", 8, 65536), "Llama-3-8B, batch 1, 4k": ("llama3-8b", 1, 4096)}
    assert [r[0] for r in table] == list(shapes)
    for cells in table:
        m, b, p = shapes[cells[0]]
        assert cells[1].split()[0] == graph_in(earlier, m, b, p, fp8=False), cells
        assert cells[4] == graph_in(earlier, m, b, p, fp8=True), cells
        (r,) = [r for r in earlier["rows"] if (r["model"], r["batch"], r["prefix"]) == (m, b, p)
                and r["kv_dtype"].startswith("float8")]
        assert cells[5] == us(r["gather_floor_us"]), cells
    before, after = earlier_record(EARLIER_K_COLUMNS), earlier_record(EARLIER_K_ROWS)
    assert before["date"] == after["date"] == "2026-12-01"
    says("docs/design.md", f"two benchmark runs of {after['date']} before and after: "
                           f"{graph_in(before, 'qwen3-next', 8, 65536, True)} → "
                           f"{graph_in(after, 'qwen3-next', 8, 65536, True)} µs for Qwen3-Next")


def test_host_pieces_from_the_logged_probe():
    text = LOG.read_text(encoding="utf-8")
    m = re.search(r"pieces on a fast CPU \(llama3-8b bs1 1k\): the launch alone \(prebuilt arguments\) "
                  r"(?P<launch>[\d.]+-[\d.]+), the signature (?P<key>[\d.]+),\s*##\s*the partials' allocation "
                  r"(?P<scratch>[\d.]+);", text)
    assert m, "the host pieces' probe is no longer in the log"
    says("docs/benchmarks.md", f"the launch through Triton's compiled launcher takes {m['launch'].replace('-', '–')} "
                               f"µs, the cache key of the call's signature {m['key']} and the scratch allocation "
                               f"{m['scratch']}")


def test_ladder_qwen3_next_before_the_merge():
    rs = [r for r in record("ladder_h200")["rows"] if r["model"] == "qwen3-next" and r["batch"] == 1]
    assert sorted(r["prefix"] for r in rs) == [1024, 4096, 16384]
    before_merge = [r["rungs"]["4"]["us"] / r["gather_floor_us"] for r in rs]
    says("docs/benchmarks.md", f"its 256-dim slices take {span(before_merge, 1)}× the gather floor before any merge "
                               "(the latency ladder's fourth rung")


# --------------------------------------------------------------------------- the shipped tuning table's sweeps

@lru_cache(maxsize=None)
def tuning() -> dict:
    return json.loads((ROOT / "splitkv" / "tables" / "nvidia_h200.json").read_text(encoding="utf-8"))


def swept(model: str, kv: str, block_n: int, warps: int, stages: int, k_rows: bool, paged: int = 0) -> dict:
    sweep = tuning()["paged_tile_sweep" if paged else "tile_sweep"]
    (t,) = [t for t in sweep if (t["model"], t["kv_dtype"], t["block_n"], t["num_warps"], t["num_stages"], t["k_rows"])
            == (model, kv, block_n, warps, stages, k_rows) and t.get("page_size", 0) == paged]
    return t


def pair(t: dict) -> str:
    """A sweep entry's 16k / 64k times, as the design notes print them."""
    return f"{us(t['us_by_prefix']['16384'])} / {us(t['us_by_prefix']['65536'])}"


def test_design_tuning_sweeps():
    doc = "docs/design.md"
    gm = {int(k): num(v, 1) for k, v in tuning()["min_split_geomean_us"].items()}
    fastest = min(tuning()["min_split_geomean_us"].items(), key=lambda x: x[1])[0]
    assert tuning()["min_split_tokens"] == 128 == int(fastest)
    says(doc, f"the sweep's geometric mean over its shapes was {gm[128]} µs at 128 against {gm[64]} at 64, "
              f"{gm[256]} at 256 and {gm[512]} at 512")
    bf, f8 = "bfloat16", "float8_e4m3fn"
    cols, rows_ = swept("qwen3-next", bf, 64, 4, 3, False), swept("qwen3-next", bf, 64, 4, 3, True)
    assert (cols["n_regs"], rows_["n_regs"], rows_["n_spills"]) == (255, 224, 0) and cols["n_spills"] > 0
    two = min((t for t in tuning()["tile_sweep"] if t["model"] == "qwen3-next" and t["kv_dtype"] == bf
               and t["num_stages"] == 2), key=lambda t: t["us"])
    assert min((t for t in tuning()["tile_sweep"] if t["model"] == "qwen3-next" and t["kv_dtype"] == bf),
               key=lambda t: t["us"]) is rows_  # "the fastest of its sweep"
    says(doc, f"stages needed 255 registers and spilled with K as `[D, BLOCK_N]` ({pair(cols)} µs), and fitted 224 "
              f"without spills with K as rows ({pair(rows_)} µs, the fastest of its sweep; the best two-stage tile "
              f"took {pair(two)}). Its fp8 tile gained too ({pair(swept('qwen3-next', f8, 64, 4, 3, True))} against "
              f"{pair(swept('qwen3-next', f8, 64, 4, 3, False))})")
    l_rows, l_cols = swept("llama3-8b", bf, 128, 4, 2, True), swept("llama3-8b", bf, 128, 4, 2, False)
    q_rows, q_cols = swept("qwen3-32b", bf, 128, 4, 2, True), swept("qwen3-32b", bf, 128, 4, 2, False)
    fp8 = [swept(m, f8, 128, 4, 3, True)["us_by_prefix"][p] / swept(m, f8, 128, 4, 3, False)["us_by_prefix"][p] - 1
           for m in ("llama3-8b", "qwen3-32b") for p in ("16384", "65536")]
    says(doc, f"Llama-3-8B bf16 {pair(l_rows)} against {pair(l_cols)} (the table keeps the faster by "
              f"{num((1 - l_rows['us'] / l_cols['us']) * 100, 1)} %), Qwen3-32B bf16 {pair(q_rows)} against "
              f"{pair(q_cols)} ({q_rows['n_regs']} registers), their fp8 tiles {span(x * 100 for x in fp8)} % slower")
    p3, p2 = swept("qwen3-next", bf, 64, 4, 3, True, paged=64), swept("qwen3-next", bf, 64, 4, 2, True, paged=64)
    assert p3["programs_per_sm"] == 1
    says(doc, f"whole in shared memory, {num(p3['shared'] / 1000)} KB, which leaves one program per SM, and it ran "
              f"{num((p3['us_by_prefix']['65536'] / p2['us_by_prefix']['65536'] - 1) * 100)} % slower there than two "
              f"stages (batch 8 / 64k: {us(p3['us_by_prefix']['65536'])} against {us(p2['us_by_prefix']['65536'])} µs")


def test_design_small_batch_sweep():
    sweep = tuning()["small_batch_sweep"]

    def entry(model, block_n, warps, stages):
        (t,) = [t for t in sweep if (t["model"], t["block_n"], t["num_warps"], t["num_stages"])
                == (model, block_n, warps, stages)]
        return t

    def times(d):
        return f"{us(d['4096'])} / {us(d['16384'])}"

    llama, qwen = entry("llama3-8b", 128, 4, 3), entry("qwen3-32b", 128, 4, 3)
    for model in ("llama3-8b", "qwen3-32b"):  # 128-key tiles, 4 warps, 3 stages: each model's fastest
        own = [t for t in sweep if t["model"] == model]
        best_ = min(own, key=lambda t: sum(t["us"].values()))
        assert (best_["block_n"], best_["num_warps"], best_["num_stages"]) == (128, 4, 3)
        for p in best_["us"]:  # no 8-warp tile was as fast, at either prefix
            assert min(t["us"][p] for t in own if t["num_warps"] == 8) > best_["us"][p]
    assert all(any(t["us"][p] >= t["usual_us"][p] for p in t["us"]) for t in sweep if t["model"] == "qwen3-next")
    says("docs/design.md", f"Llama-3-8B {times(llama['us'])} µs against {times(llama['usual_us'])} µs, Qwen3-32B "
                           f"{times(qwen['us'])} against {times(qwen['usual_us'])}; no 8-warp tile was as fast; for "
                           "Qwen3-Next no tile beat the usual schedule")


def test_design_graph_node_cost():
    fixed = record("fixed_costs_h200")
    node = fixed["two_empty_kernels_us"] - fixed["one_empty_kernel_us"]
    says("docs/design.md", f"each extra node costs about {num(node, 1)} µs per replay on the H200")


#: Breadth records quoted by the design notes: the logit cap of an earlier run, the sigmoid form of the cap (the
#: last run before the exp2 form), and the window's grid before it was sized for the window alone.
EARLIER_CAP = ("0bc32b6", "figures/benchmark_breadth_h200.json")
EARLIER_SIGMOID_CAP = ("881d09f", "figures/benchmark_breadth_h200.json")
EARLIER_WINDOW = ("f4854b7", "figures/benchmark_breadth_h200.json")


def cap_cost(result: dict) -> str:
    return span(((f["ratio"] - 1) * 100 for f in result["features"] if "logit_cap" in f["features"]))


def window_ratio(result: dict) -> str:
    (f,) = [f for f in result["features"] if "sliding_window_size" in f["features"]]
    return num(f["ratio"], 2)


def test_design_score_features():
    now = record("benchmark_breadth_h200")
    cost = cap_cost(now)
    lo, hi = cost.split("–")
    assert lo == hi  # printed as one number
    earlier, sigmoid = cap_cost(earlier_record(EARLIER_CAP)), cap_cost(earlier_record(EARLIER_SIGMOID_CAP))
    says("docs/design.md", f"one `exp2` and one division per score, {lo} % over the plain call at Gemma-2-9B's shape "
                           f"on the H200 ({earlier} % in an earlier run), where a sigmoid form with two divisions cost "
                           f"{sigmoid} %)")
    before = window_ratio(earlier_record(EARLIER_WINDOW))
    says("docs/design.md", f"plain call has one slice: {before}× its time on the H200, against "
                           f"{window_ratio(now)}× now)")


#: The MLA benchmark's run right after batch-1 launches were cut into two 32-row tiles (EARLIER_MLA: before).
EARLIER_MLA_CUT = ("ca07ad3", "figures/benchmark_mla_h200.json")


def test_design_mla_cut_into_two_tiles():
    before, after = earlier_record(EARLIER_MLA), earlier_record(EARLIER_MLA_CUT)
    assert before["date"] == after["date"] == "2026-12-02"

    def b1(result):
        return {r["prefix"]: r["impls"]["splitkv"] for r in result["rows"] if r["heads"] == 16 and r["batch"] == 1}

    old, new = b1(before), b1(after)
    assert all(new[p]["config"].startswith("TileConfig(block_m=32") for p in new)
    says("docs/design.md", f"the call takes {span((new[p]['us'] / old[p]['us'] for p in new), 2)}× the time at "
                           f"4k–64k (the MLA benchmark of {after['date']}, before and after the cut)")


def test_design_mla_layout_probes_from_the_log():
    text = LOG.read_text(encoding="utf-8")
    same_tile, per_row = [], {}
    for m in re.finditer(r"^\s*(\d+h b\d+ 16k) tile (\d+), (\d+), 8, (\d) A ([\d.]+) \(\d+/\d+\)\s+"
                         r"B (?:([\d.]+)|does not fit)", text, re.M):
        row, tile, a, b = m[1], (int(m[2]), int(m[3]), int(m[4])), float(m[5]), m[6]
        shipped = per_row.setdefault(row, {"a": None, "b": []})
        if tile == ((32 if " b1 " in row and row.startswith("16h") else 64), 64, 2):
            shipped["a"] = a
        if b:
            same_tile.append(float(b) / a)
            shipped["b"].append(float(b))
    assert len(per_row) == 4 and all(v["a"] for v in per_row.values())
    says("docs/design.md", f"the call took {span(same_tile, 1)}× as long at the same tile, "
                           f"{span((min(v['b']) / v['a'] for v in per_row.values()), 1)}× the shipped tile's time")
    cut = []
    for m in re.finditer(r"^16h (b\d+) (\d+k)  64, 64, 8, 2: ([\d.]+); (.*)$", text, re.M):
        others = [float(x.split(": ")[1]) for x in m[4].split("; ")]
        cut.append(min(others) / float(m[3]))
    assert len(cut) == 3
    says("docs/design.md", f"tiles reading each latent row, no spills) took {span(cut, 1, 2)}× as long at batch 8 "
                           "and 32")


def test_design_slices_per_merge_step_from_the_log():
    text = LOG.read_text(encoding="utf-8")
    table = {}
    row = re.compile(r"^(\S+)\s+b(\d+)\s+(\d+k)\s+(last|grid)\s+(\d+)" + r"\s+([\d.]+)" * 4 + r"\s*$", re.M)
    for m in row.finditer(text):
        times = dict(zip((2, 4, 8, 16), (m[6], m[7], m[8], m[9])))
        table[m[1], int(m[2]), m[3]] = times
        if m[4] == "grid" and int(m[5]) > 8:  # merge programs reading more than 8 slices: fastest at 16
            assert float(times[16]) == min(map(float, times.values()))
    q4, q16 = table["qwen3-32b", 1, "4k"], table["qwen3-32b", 1, "16k"]
    n4, n16 = table["qwen3-next", 1, "4k"], table["qwen3-next", 1, "16k"]
    l1 = table["llama3-8b", 1, "1k"]
    assert min(l1.items(), key=lambda x: float(x[1]))[0] == 4
    says("docs/design.md", f"(Qwen3-32B batch 1 / 4k {q4[4]} → {q4[16]} µs, / 16k {q16[4]} → {q16[16]}; "
                           f"Qwen3-Next batch 1 / 4k {n4[4]} → {n4[16]}, / 16k {n16[4]} → {n16[16]}), while "
                           f"Llama-3-8B's last-program merge was fastest at 4 (batch 1 / 1k {l1[4]} µs, {l1[16]} "
                           "at 16)")


def _variants(line: str) -> dict:
    """``{name: (registers, spills, µs)}`` of one A/B line of the log (``A merge 0 ns 16 [(255, 20)] 293.4 | ...``)."""
    return {m[1]: (int(m[2]), int(m[3]), float(m[4]))
            for m in re.finditer(r"(\w+) merge \d+ ns \d+ \[\((\d+), (\d+)\)\] ([\d.]+)", line)}


def test_design_fp8_probes_from_the_log():
    lines = LOG.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("## 2. The drop-in call as shipped (A)"))
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("## 16."))
    section = lines[start:end]
    key = "qwen3-next fp8 bs8 65536:"
    shipped = [_variants(line)["A"][2] for line in section
               if line.startswith(key) and "A merge" in line and "graph A" not in line]
    shipped += [float(re.search(r"graph A ([\d.]+)", line)[1]) for line in section
                if line.startswith(key) and "graph A" in line]
    says("docs/design.md", f"The shipped kernel takes {span(shipped)} µs there in CUDA-graph replays, the same day")
    (diag,) = [_variants(line) for line in section if line.startswith(key) and " D2 " in line]
    assert (diag["A"][1], diag["D2"][1], diag["D1"][1], diag["D3"][1]) == (20, 4, 28, 0)
    says("docs/design.md", f"- without the slot bounds check: {diag['D2'][2]} µs, and {diag['A'][1]} spilled values "
                           f"become {diag['D2'][1]} (see [Bounds](#bounds)); - without the draft block: "
                           f"{diag['D1'][2]} µs, slower, with {diag['D1'][1]} spilled values; - without both: "
                           f"{diag['D3'][2]} µs and no spills.")
    reload = [(float(m[2]) / float(m[1]), m[1], m[2]) for line in section
              if (m := re.search(r"graph A ([\d.]+) B ([\d.]+)", line))]
    worst = max(reload)
    says("docs/design.md", f"up to {num((worst[0] - 1) * 100)} % slower (batch 32 / 64k: {worst[2]} against "
                           f"{worst[1]} µs)")
    folded = [_variants(line) for line in section if " B1 merge" in line and " B2 merge" in line]
    widen = [abs(v["B1"][2] / v["A"][2] - 1) * 100 for v in folded]
    masks = sorted(v["B2"][2] / v["A"][2] - 1 for v in folded)
    rest = max(abs(x) for x in masks[:-1]) * 100  # every row but the one named
    says("docs/design.md", f"widening K before transposing it instead of after: within {num(max(widen), 1)} %; - "
                           "folding the head-dim masks away where `BLOCK_D` equals the head dim: within "
                           f"{num(rest, 1)} %, one small row {num(masks[-1] * 100)} % slower.")
