"""The verify benchmark's result record as text: plain-text and Markdown tables, progress lines, paths.

Every table reads only the result record (``run_benchmark``'s JSON), so
committed results of older runs format too: a field a result lacks shows as
``–``. Markdown tables have at most 9 columns, each with a bold caption.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

from .peers import FP8_IMPLEMENTATIONS, FP8_K_SCALE, FP8_V_SCALE, HOST_IMPLS, HOST_MAX_GRAPH_US, IMPLEMENTATIONS
from .peers import INVARIANT_SPLIT_TOKENS

__all__ = [
    "default_out_path",
    "format_markdown",
    "format_small",
    "format_table",
    "ratio",
    "row_line",
]


def default_out_path(tag: str, variant: str = "") -> str:
    """``figures/benchmark_<tag>[_<variant>].json``."""
    return os.path.join("figures", f"benchmark_{tag}{'_' + variant if variant else ''}.json")


def ratio(a, b) -> Optional[float]:
    """``a / b``, or ``None`` where either is missing (or zero)."""
    return a / b if a and b else None


def row_line(i: int, n: int, row: dict, total_s: float) -> str:
    """The progress line of row ``i`` of ``n``: splitkv's time, its ratios to the floors, the seconds spent."""
    ours = row["impls"].get("splitkv", {})
    g = ours.get("graph")
    text = f"[{i:>2}/{n}] {_shape(row):<22} {_dtype_label(row):>4}: splitkv "
    text += f"{g:8.1f} us" if g else "  failed  "
    for key, label in (("splitkv_over_floor", "floor"), ("splitkv_over_gather_floor", "gather floor")):
        if row.get(key):
            text += f", {row[key]:.2f}x {label}"
    return text + f"; row {row['elapsed_s'] + row.get('setup_s', 0):.1f} s, total {total_s:.0f} s"


#: Column labels of the implementations in the tables.
_LABEL = {"splitkv": "splitkv", "splitkv_invariant": "invariant", "seed": "seed", "extend": "extend",
          "flex": "flex", "sdpa": "sdpa"}


def _shape(r: dict) -> str:
    """The row's label; ``†`` marks a row carried over from another run (``carried_from``, see the footer)."""
    prefix = r["prefix"]
    label = f"{r['model']} bs{r['batch']} {prefix // 1024 if prefix % 1024 == 0 else prefix / 1024:g}k"
    return label + " †" if r.get("carried_from") else label


def _dtype_label(r: dict) -> str:
    return "fp8" if r.get("kv_dtype", "bfloat16").startswith("float8") else "bf16"


def _us(x) -> str:
    return "–" if not x else f"{x:.1f}" if x < 1000 else f"{x:.0f}"


def _x(x) -> str:
    return "–" if not x else f"{x:.2f}"


def _graph(r: dict, name: str) -> Optional[float]:
    return r["impls"].get(name, {}).get("graph")


def _failed(rec: dict, key: str) -> bool:
    return bool(rec.get("error") or rec.get(f"{key}_error"))


def _time_cell(r: dict, name: str, key: str = "graph") -> str:
    """µs of one implementation, or ``fail`` / ``skip`` / ``–`` (not run)."""
    rec = r["impls"].get(name)
    if rec is None:
        return "–"
    if rec.get("skipped"):
        return "skip"
    if rec.get(key):
        return _us(rec[key])
    return "fail" if _failed(rec, key) else "–"


def _host_method(timing: dict) -> str:
    """How ``host_us`` was measured, from the result's ``timing`` (older results: back-to-back batches)."""
    calls, batches = timing.get("host_calls", 1000), timing.get("host_batches", 1)
    if "host_burst" in timing:
        return (f"calls back to back in bursts of {timing['host_burst']} (synchronised between bursts, untimed), "
                f"each call timed alone, the median over {calls} calls per round"
                + (", the thread pinned to the fastest CPU at the time" if timing.get("host_pin") else "")
                + f", the fastest of {timing['host_rounds']} rounds (one in the implementation's turn, the rest at "
                "the end of the row)")
    if "host_rounds" in timing:
        return (f"each call timed alone with the GPU idle as it starts, the median over {calls} calls per round, "
                f"the fastest of {timing['host_rounds']} rounds (one in the implementation's turn, the rest at "
                "the end of the row)")
    if batches == 1:
        return f"mean over {calls} back-to-back calls, synchronised before and after only"
    return (f"median over {batches} batches of the mean of {calls // batches} back-to-back calls "
            "(synchronised before and after each batch only)")


def _host_cell(r: dict, name: str) -> str:
    rec = r["impls"].get(name)
    if rec is None:
        return "–"
    if rec.get("host_us"):
        return _us(rec["host_us"])
    if rec.get("skipped") or rec.get("host_skipped"):
        return "skip"
    return "fail" if (rec.get("error") or rec.get("host_error")) else "–"


def _slowest_round_cell(r: dict) -> str:
    """splitkv's slowest host-time round (older results kept one measurement: ``–``)."""
    rounds = r["impls"].get("splitkv", {}).get("host_rounds_us")
    return _us(max(rounds)) if rounds else "–"


def _cpu_ref_cell(r: dict) -> str:
    """For splitkv's fastest host round: the reference workload's µs on the CPU it ran on / on the slowest CPU
    (:func:`fastest_cpu`); ``–`` for unpinned results."""
    rec = r["impls"].get("splitkv", {})
    rounds, cpus = rec.get("host_rounds_us"), rec.get("host_cpus")
    if not rounds or not cpus or len(cpus) != len(rounds):
        return "–"
    pick = cpus[rounds.index(min(rounds))]
    return f"{pick['ref_us']:.0f} / {pick['slowest_ref_us']:.0f}"


def _speedup_cell(r: dict, name: str) -> str:
    """Peer graph time / splitkv graph time; ``fail`` / ``skip`` where the peer has none."""
    ours = r["impls"].get("splitkv", {}).get("graph")
    cell = _time_cell(r, name)
    if cell in ("fail", "skip", "–"):
        return cell
    return _x(ratio(r["impls"][name]["graph"], ours))


def _bf16_tables(bf16: List[dict], present: List[str]) -> List[Tuple[str, List[str], List[List[str]]]]:
    """The bf16 rows' tables: graph times, ratios, eager times, host times (where measured)."""
    peers = [n for n in present if n not in ("splitkv", "splitkv_invariant")]
    has_inv = "splitkv_invariant" in present
    tables = [(
        "Time per call, µs (median of CUDA-graph replays), bf16 KV pool",
        ["shape", "floor", "gather floor"] + [_LABEL[n] for n in present],
        [[_shape(r), _us(r.get("floor_us")), _us(r.get("gather_floor_us"))]
         + [_time_cell(r, n) for n in present] for r in bf16],
    ), (
        "Ratios, bf16 KV pool (graph replays): splitkv ÷ each floor, batch-invariant ÷ adaptive splitkv, "
        "speedup vs each peer (peer ÷ splitkv)",
        ["shape", "÷ floor", "÷ gather floor"] + (["invariant ÷ splitkv"] if has_inv else [])
        + [f"vs {_LABEL[n]}" for n in peers],
        [[_shape(r), _x(r.get("splitkv_over_floor") or ratio(_graph(r, "splitkv"), r.get("floor_us"))),
          _x(r.get("splitkv_over_gather_floor"))]
         + ([_x(r.get("invariant_over_splitkv"))] if has_inv else [])
         + [_speedup_cell(r, n) for n in peers] for r in bf16],
    )]
    eager = [n for n in present if any(r["impls"].get(n, {}).get("eager") for r in bf16)]
    if eager:
        tables.append((
            "Eager calls, bf16 KV pool, µs per call (do_bench, launches back to back)",
            ["shape"] + [_LABEL[n] for n in eager],
            [[_shape(r)] + [_time_cell(r, n, "eager") for n in eager] for r in bf16],
        ))
    host = [n for n in HOST_IMPLS if n in present]
    if any(r["impls"].get(n, {}).get("host_us") for r in bf16 for n in host):
        tables.append(_host_table(bf16, host))
    return tables


def _host_table(bf16: List[dict], host: List[str]) -> Tuple[str, List[str], List[List[str]]]:
    """Host µs per eager call: splitkv's fastest and slowest rounds, the CPU reference, the peers'."""
    pinned = any(r["impls"].get("splitkv", {}).get("host_cpus") for r in bf16)
    return (
        "Host time per eager call, bf16 KV pool, µs: the time a call holds the calling thread "
        "(fastest round; splitkv's slowest round beside it"
        + ("; CPU ref: the reference workload's µs on the CPU of splitkv's fastest round / on the "
           "slowest CPU then" if pinned else "") + ")",
        ["shape", "splitkv", "splitkv, slowest round"] + (["CPU ref"] if pinned else [])
        + [_LABEL[n] for n in host if n != "splitkv"],
        [[_shape(r), _host_cell(r, "splitkv"), _slowest_round_cell(r)]
         + ([_cpu_ref_cell(r)] if pinned else [])
         + [_host_cell(r, n) for n in host if n != "splitkv"] for r in bf16],
    )


def _fp8_table(result: dict, fp8: List[dict]) -> Tuple[str, List[str], List[List[str]]]:
    """The fp8 rows: floors, times, splitkv ÷ gather floor, fp8 ÷ bf16, speedup vs extend."""
    scales = result.get("fp8_scales", {})
    fp8_impls = [n for n in FP8_IMPLEMENTATIONS if any(n in r["impls"] for r in fp8)]
    return (
        f"fp8 KV pool (e4m3, k_scale {scales.get('k_scale', FP8_K_SCALE)}, "
        f"v_scale {scales.get('v_scale', FP8_V_SCALE)}; bf16 queries and output): µs (graph replays), ratios",
        ["shape", "floor", "gather floor"] + [_LABEL[n] for n in fp8_impls]
        + ["÷ gather floor", "fp8 ÷ bf16"] + (["vs extend"] if "extend" in fp8_impls else []),
        [[_shape(r), _us(r.get("floor_us")), _us(r.get("gather_floor_us"))]
         + [_time_cell(r, n) for n in fp8_impls]
         + [_x(r.get("splitkv_over_gather_floor")), _x(r.get("fp8_over_bf16"))]
         + ([_speedup_cell(r, "extend")] if "extend" in fp8_impls else []) for r in fp8],
    )


def _tables(result: dict) -> List[Tuple[str, List[str], List[List[str]]]]:
    """The report as (title, header, rows) tables, at most 9 columns each."""
    rows = result["rows"]
    bf16 = [r for r in rows if _dtype_label(r) == "bf16"]
    fp8 = [r for r in rows if _dtype_label(r) == "fp8"]
    present = [n for n in IMPLEMENTATIONS if any(n in r["impls"] for r in rows)]
    return (_bf16_tables(bf16, present) if bf16 else []) + ([_fp8_table(result, fp8)] if fp8 else [])


def _problems(result: dict) -> List[str]:
    """One line per distinct failure or skip reason, with where it happened."""
    seen: Dict[Tuple[str, str, str], List[str]] = {}
    for r in result["rows"]:
        where = f"{_shape(r)} {_dtype_label(r)}"
        for name, rec in r["impls"].items():
            for key, value in rec.items():
                if value and (key == "error" or key.endswith("_error") or key == "skipped"):
                    kind = "skipped" if key == "skipped" else "failed"
                    what = f"{name}" if key in ("error", "skipped") else f"{name} ({key[:-6]})"
                    seen.setdefault((kind, what, str(value).splitlines()[0][:160]), []).append(where)
        if r.get("gather_floor_us") is None and "gather_floor_config" in r:
            seen.setdefault(("failed", "gather floor", "every launch setting failed"), []).append(where)
    return [f"{what} {kind} at {', '.join(places)}: {reason}" for (kind, what, reason), places in seen.items()]


def _parts_note(result: dict) -> str:
    """For a result merged from runs made in parts: how many, and the other parts' read bandwidths."""
    runs = result.get("read_bandwidth_runs", [])
    if len(runs) < 2:
        return ""
    others = ", ".join(f"{bw / 1e12:.2f}" for bw in runs[1:])
    rest = "the second" if len(runs) == 2 else "the others"
    return (f" The rows come from {len(runs)} runs, merged by python -m splitkv.bench --merge; every floor is at "
            f"the first run's read bandwidth ({rest} measured {others} TB/s).")


def _footer(result: dict) -> List[str]:
    bw = result["read_bandwidth"] / 1e12
    t = result.get("timing", {})
    lines = [
        f"{result['device']} ({result.get('num_sms', '?')} SMs), measured read bandwidth {bw:.2f} TB/s, "
        f"torch {result['torch']}, triton {result['triton']}, {result['date']}; "
        f"{result['draft_tokens']} draft tokens per sequence (causal chain), random kv_indices. "
        f"µs = median of triton.testing.do_bench (L2 flushed"
        + (f", rep {t['rep_ms']:g} ms" if t.get("rep_ms") else "") + ") over CUDA-graph replays."
        + _parts_note(result),
        "floor = prefix K+V bytes / measured read bandwidth; gather floor = best time of a bare kernel that "
        "only gathers and sums the same K/V rows through the same kv_indices (splitkv.bench.floors), over a grid "
        "of launch settings; invariant = splitkv with split_tokens="
        f"{result.get('invariant_split_tokens', INVARIANT_SPLIT_TOKENS)} (batch-invariant); host = "
        + ("wall time per eager call, " if "host_rounds" not in t else "time a call holds the calling thread, ")
        + _host_method(t) + " (measured for "
        f"peers only where their graph time is at most {t.get('host_max_graph_us', HOST_MAX_GRAPH_US):.0f} µs); "
        "fail = the implementation raised, skip = not run at this shape.",
    ]
    carried = sorted({r["carried_from"] for r in result["rows"] if r.get("carried_from")})
    if carried:
        lines.append("† not measured in this run; carried over from " + "; ".join(carried) + ".")
    problems = _problems(result)
    if problems:
        lines.append("Failures and skips: " + "; ".join(problems) + ".")
    return lines


def plain_table(title: str, head: List[str], body: List[List[str]], left: int = 1) -> List[str]:
    """One plain-text table: the title, the header, a rule, the rows (the first ``left`` columns
    left-aligned, the others right-aligned)."""
    widths = [max(len(x) for x in col) for col in zip(head, *body)]

    def fmt(cells):
        return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return [title, fmt(head), "-" * len(fmt(head))] + [fmt(c) for c in body] + [""]


def format_table(result: dict) -> str:
    """The results as plain-text tables (µs, ratios, host times, fp8 pool) and a footer."""
    out = []
    for title, head, body in _tables(result):
        out += plain_table(title, head, body)
    return "\n".join(out + _footer(result))


def format_small(result: dict) -> str:
    """``--small``'s report: per row, splitkv's graph time against its gather floor and the read bandwidth."""
    body = []
    for r in result["rows"]:
        ours = r["impls"].get("splitkv", {})
        pct = ours.get("pct_bw")
        body.append([_shape(r), _dtype_label(r), _time_cell(r, "splitkv"), _us(r.get("gather_floor_us")),
                     _x(r.get("splitkv_over_gather_floor")), _us(r.get("floor_us")),
                     f"{pct:.0f} %" if pct else "–"])
    head = ["shape", "pool", "splitkv µs", "gather floor µs", "÷ gather floor", "floor µs", "% read bw"]
    bw = result["read_bandwidth"] / 1e12
    grid = ", ".join(f"{k.replace('_', ' ')} {'/'.join(map(str, v))}"
                     for k, v in result.get("gather_floor_grid", {}).items())
    footer = (f"{result['device']}, measured read bandwidth {bw:.2f} TB/s; µs = median of CUDA-graph replays "
              "(triton.testing.do_bench, L2 flushed); % read bw = prefix K+V bytes / splitkv's time / that "
              "bandwidth; gather floor = best of "
              + (f"a reduced grid of launch settings ({grid})" if grid else "the full launch-settings search")
              + f"; {result.get('elapsed_s', 0):.0f} s.")
    problems = _problems(result)
    return "\n".join(plain_table("splitkv against its floors", head, body) + [footer]
                     + (["Failures and skips: " + "; ".join(problems) + "."] if problems else []))


def format_markdown(result: dict) -> str:
    """The results as Markdown tables of at most 9 columns, each with a bold caption, and a footer."""
    out = []
    for title, head, body in _tables(result):
        out += [f"**{title}**", "", "| " + " | ".join(head) + " |", "|---|" + "--:|" * (len(head) - 1)]
        out += ["| " + " | ".join(cells) + " |" for cells in body] + [""]
    return "\n".join(out + ["\n\n".join(_footer(result))])
