"""Plots of benchmark results (used by the benchmark CLI and the notebooks).

:func:`plot_benchmark` draws two figures from a :mod:`splitkv.bench.run` result:

* ``roofline_<tag>.png``: achieved bandwidth (prefix KV bytes / best time)
  against the bytes to read, per implementation, with the gather floor (a
  bare kernel reading the same rows) and splitkv on an fp8 pool;
* ``speedup_<tag>.png``: splitkv's speedup over each peer per shape, one
  panel per model (bf16 pool, CUDA-graph replays); a peer that failed or was
  skipped at a shape gets a cross and a label instead of a bar.

Both read old result files too (without the gather floor, fp8 rows or the
batch-invariant implementation).

:func:`plot_peers` draws ``peers_<tag>.png`` from a
:mod:`splitkv.bench.peers_sweep` result: each peer's time over splitkv's per
row (CUDA-graph replays), one panel per model.
"""

from __future__ import annotations

import os
from typing import List, Optional

__all__ = ["plot_benchmark", "plot_peers", "IMPL_STYLE", "PEER_STYLE"]

#: Colour and label of each implementation, shared by every figure.
IMPL_STYLE = {
    "splitkv": ("tab:red", "splitkv (GQA-packed split-KV)"),
    "splitkv_invariant": ("tab:purple", "splitkv, batch-invariant (split_tokens=1024)"),
    "seed": ("tab:orange", "seed-style per-head split-KV"),
    "extend": ("tab:gray", "extend_attention_fwd (baseline)"),
    "flex": ("tab:blue", "FlexAttention (decode path)"),
    "sdpa": ("tab:green", "torch SDPA"),
}


def _best(rec):
    times = [t for t in (rec.get("eager"), rec.get("graph")) if t]
    return min(times) if times else None


def _is_fp8(row) -> bool:
    return row.get("kv_dtype", "bfloat16").startswith("float8")


def _failure(rec: Optional[dict]) -> Optional[str]:
    """``"skip"`` / ``"fail"`` for a peer record without a graph time, else ``None``."""
    if rec is None or rec.get("graph"):
        return None
    if rec.get("skipped"):
        return "skip"
    return "fail"


def _roofline(result: dict, rows: List[dict], fp8_rows: List[dict], path: str) -> None:
    """Achieved GB/s against the prefix K+V bytes, per implementation, with the gather floor and fp8 splitkv."""
    from matplotlib.figure import Figure  # Figure objects directly: no pyplot state, no backend switch

    bw = result["read_bandwidth"] / 1e9
    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    for name, (color, label) in IMPL_STYLE.items():
        pts = [(r["kv_bytes"], r["kv_bytes"] / (_best(r["impls"][name]) * 1e-6) / 1e9)
               for r in rows if name in r["impls"] and _best(r["impls"][name])]
        if pts:
            xs, ys = zip(*sorted(pts))
            ax.scatter(xs, ys, color=color, label=label, s=18)
    pts = [(r["kv_bytes"], r["kv_bytes"] / (r["gather_floor_us"] * 1e-6) / 1e9)
           for r in rows if r.get("gather_floor_us")]
    if pts:
        ax.scatter(*zip(*sorted(pts)), color="black", marker="_", s=80, linewidths=1.5,
                   label="gather floor (bare kernel reading the same rows)")
    pts = [(r["kv_bytes"], r["kv_bytes"] / (_best(r["impls"]["splitkv"]) * 1e-6) / 1e9)
           for r in fp8_rows if _best(r["impls"].get("splitkv", {}))]
    if pts:
        ax.scatter(*zip(*sorted(pts)), facecolors="none", edgecolors=IMPL_STYLE["splitkv"][0], s=22,
                   label="splitkv, fp8 pool (fp8 bytes)")
    ax.axhline(bw, color="black", ls="--", lw=1, label=f"measured HBM read {bw / 1e3:.2f} TB/s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("prefix K+V bytes read (log)")
    ax.set_ylabel("achieved bandwidth, GB/s (KV bytes / best time)")
    pools = "bf16 pool" + (" (splitkv also on fp8)" if pts else "")
    ax.set_title(f"Verify attention roofline, {result['device']}, {pools}, {result['draft_tokens']} draft tokens",
                 fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _speedup_panel(ax, mrows: List[dict], peers: List[str]) -> float:
    """One model's grouped bars (peer time / splitkv time per shape); returns the tallest bar."""
    width, top = 0.84 / max(1, len(peers)), 1.0
    for i, name in enumerate(peers):
        color = IMPL_STYLE[name][0]
        for j, r in enumerate(mrows):
            x = j + (i - (len(peers) - 1) / 2) * width
            ours = r["impls"].get("splitkv", {}).get("graph")
            rec = r["impls"].get(name)
            if rec is None:
                continue  # not run at all (a subset of implementations)
            why = "n/a" if not ours else _failure(rec)
            if why is None:
                top = max(top, rec["graph"] / ours)
                ax.bar(x, rec["graph"] / ours, width, color=color)
            else:
                ax.plot([x], [1.0], marker="X", ms=8, color=color, mec="black", mew=0.8, ls="none")
                ax.text(x, 1.3, {"fail": "failed", "skip": "skipped"}.get(why, why), rotation=90,
                        ha="center", va="bottom", fontsize=7, color="black")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_yscale("log")
    ax.set_xticks(range(len(mrows)))
    ax.set_xticklabels([f"bs{r['batch']}\n{r['prefix'] // 1024}k" for r in mrows], fontsize=7)
    ax.set_xlim(-0.6, len(mrows) - 0.4)
    ax.set_ylabel("peer / splitkv", fontsize=8)
    ax.tick_params(axis="y", labelsize=7)
    ax.set_title(mrows[0]["model"], fontsize=9, loc="left")
    ax.grid(True, axis="y", which="major", alpha=0.3)
    return top


def _speedup(result: dict, rows: List[dict], path: str) -> None:
    """splitkv's speedup per shape: one panel per model, grouped bars per peer."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    peers = [n for n in IMPL_STYLE if n != "splitkv" and any(n in r["impls"] for r in rows)]
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig = Figure(figsize=(9, 1.0 + 2.5 * max(1, len(models))), layout="constrained")
    axes = fig.subplots(max(1, len(models)), 1, squeeze=False)[:, 0]
    top = max([1.0] + [_speedup_panel(ax, [r for r in rows if r["model"] == m], peers)
                       for ax, m in zip(axes, models)])
    for ax in axes:
        ax.set_ylim(0.5, top * 1.6)
    handles = [Line2D([], [], color=IMPL_STYLE[n][0], lw=6, label=f"vs {IMPL_STYLE[n][1]}") for n in peers]
    handles.append(Line2D([], [], marker="X", color="white", mfc="lightgray", mec="black", ms=8,
                          label="no time (failed / skipped)"))
    fig.suptitle(f"splitkv speedup per shape: peer time / splitkv time (CUDA-graph replays, bf16 pool), "
                 f"{result['device']}, {result['date']}", fontsize=9)
    fig.legend(handles=handles, loc="outside lower center", ncol=min(3, len(handles)), fontsize=7, frameon=False)
    fig.savefig(path, dpi=120)


def plot_benchmark(result: dict, folder: str = "figures", tag: str = "h200") -> List[str]:
    """Roofline (achieved GB/s vs KV bytes) and speedup bars; returns the paths."""
    os.makedirs(folder, exist_ok=True)
    rows = [r for r in result["rows"] if not _is_fp8(r)]
    fp8_rows = [r for r in result["rows"] if _is_fp8(r)]
    paths = [os.path.join(folder, f"roofline_{tag}.png"), os.path.join(folder, f"speedup_{tag}.png")]
    _roofline(result, rows, fp8_rows, paths[0])
    _speedup(result, rows, paths[1])
    return paths


#: Colour and label of each implementation of the peers sweep (:mod:`splitkv.bench.peers_sweep`).
PEER_STYLE = {
    "splitkv_paged": ("tab:purple", "splitkv on the same pages"),
    "sglang_extend": ("tab:gray", "SGLang extend_attention_fwd"),
    "flashinfer_fa2": ("tab:blue", "FlashInfer paged prefill, fa2"),
    "flashinfer_fa3": ("tab:cyan", "FlashInfer paged prefill, fa3"),
    "flashinfer_xqa": ("tab:green", "FlashInfer xqa (speculative)"),
    "flashinfer_mla": ("tab:olive", "FlashInfer MLA"),
}


def plot_peers(result: dict, path: str) -> str:
    """Each implementation's graph time ÷ splitkv's per row, one panel per model; a peer without a time at a row
    (skipped, refused, failed) gets a cross. Returns ``path``."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    rows = result["rows"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    names = [n for n in PEER_STYLE if any(n in r["impls"] for r in rows)]
    fig = Figure(figsize=(max(9, 0.45 * max([1] + [sum(r["model"] == m for r in rows) for m in models])),
                          1.2 + 2.6 * max(1, len(models))), layout="constrained")
    axes = fig.subplots(max(1, len(models)), 1, squeeze=False)[:, 0]
    for ax, model in zip(axes, models):
        mrows = [r for r in rows if r["model"] == model]
        present = [n for n in names if any(n in r["impls"] for r in mrows)]
        width = 0.84 / max(1, len(present))
        for i, name in enumerate(present):
            color = PEER_STYLE[name][0]
            for j, r in enumerate(mrows):
                rec = r["impls"].get(name)
                if rec is None:
                    continue
                x = j + (i - (len(present) - 1) / 2) * width
                if rec.get("over_splitkv"):
                    ax.bar(x, rec["over_splitkv"], width, color=color)
                else:
                    ax.plot([x], [1.0], marker="X", ms=6, color=color, mec="black", mew=0.6, ls="none")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_yscale("log")
        ax.set_xticks(range(len(mrows)))
        ax.set_xticklabels([(f"h{r['heads']} " if r.get("model") == "deepseek-v3" else "")
                            + (f"bs{r['batch']} " + "/".join(map(str, r["lens"])) if r.get("lens")
                               else f"bs{r['batch']} {r['prefix'] // 1024}k") + f"\n{r.get('case', '')}"
                            for r in mrows],
                           fontsize=6, rotation=90)
        ax.set_xlim(-0.6, len(mrows) - 0.4)
        ax.set_ylabel("time ÷ splitkv's", fontsize=8)
        ax.tick_params(axis="y", labelsize=7)
        ax.set_title(model, fontsize=9, loc="left")
        ax.grid(True, axis="y", which="major", alpha=0.3)
    handles = [Line2D([], [], color=PEER_STYLE[n][0], lw=6, label=PEER_STYLE[n][1]) for n in names]
    handles.append(Line2D([], [], marker="X", color="white", mfc="lightgray", mec="black", ms=7,
                          label="no time (skipped, refused or failed)"))
    fig.suptitle(f"Verify attention beside serving engines' kernels: time ÷ splitkv's (CUDA-graph replays; "
                 f"above 1: splitkv is faster), {result['device']}, {result['date']}", fontsize=9)
    fig.legend(handles=handles, loc="outside lower center", ncol=min(4, len(handles)), fontsize=7, frameon=False)
    fig.savefig(path, dpi=120)
    return path
