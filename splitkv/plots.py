"""Plots of benchmark results (used by the benchmark CLI and the notebooks)."""

from __future__ import annotations

import os
from typing import List

__all__ = ["plot_benchmark", "IMPL_STYLE"]

#: Colour and label of each implementation, shared by every figure.
IMPL_STYLE = {
    "splitkv": ("tab:red", "splitkv (GQA-packed split-KV)"),
    "seed": ("tab:orange", "seed-style per-head split-KV"),
    "extend": ("tab:gray", "extend_attention_fwd (baseline)"),
    "flex": ("tab:blue", "FlexAttention (decode path)"),
    "sdpa": ("tab:green", "torch SDPA"),
}


def _best(rec):
    times = [t for t in (rec.get("eager"), rec.get("graph")) if t]
    return min(times) if times else None


def plot_benchmark(result: dict, folder: str = "figures", tag: str = "h200") -> List[str]:
    """Roofline (achieved GB/s vs KV bytes) and speedup bars; returns the paths."""
    # Figure objects directly: no pyplot state, no backend switch in notebooks.
    from matplotlib.figure import Figure

    os.makedirs(folder, exist_ok=True)
    rows = result["rows"]
    bw = result["read_bandwidth"] / 1e9
    paths = []

    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    for name, (color, label) in IMPL_STYLE.items():
        pts = [(r["kv_bytes"], r["kv_bytes"] / (_best(r["impls"][name]) * 1e-6) / 1e9)
               for r in rows if name in r["impls"] and _best(r["impls"][name])]
        if pts:
            xs, ys = zip(*sorted(pts))
            ax.scatter(xs, ys, color=color, label=label, s=18)
    ax.axhline(bw, color="black", ls="--", lw=1, label=f"measured HBM read {bw / 1e3:.2f} TB/s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("prefix K+V bytes read (log)")
    ax.set_ylabel("achieved bandwidth, GB/s (KV bytes / best time)")
    ax.set_title(f"Verify attention roofline, {result['device']}, bf16, {result['draft_tokens']} draft tokens")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, which="both", alpha=0.3)
    path = os.path.join(folder, f"roofline_{tag}.png")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    paths.append(path)

    peers = [n for n in IMPL_STYLE if n != "splitkv" and any(n in r["impls"] for r in rows)]
    labels = [f"{r['model']}\nbs{r['batch']} {r['prefix'] // 1024}k" for r in rows]
    fig = Figure(figsize=(max(8, 0.45 * len(rows)), 5))
    ax = fig.subplots()
    width = 0.8 / max(1, len(peers))
    for i, name in enumerate(peers):
        ys = []
        for r in rows:
            ours, theirs = _best(r["impls"].get("splitkv", {})), _best(r["impls"].get(name, {}))
            ys.append(theirs / ours if ours and theirs else 0)
        xs = [j + (i - (len(peers) - 1) / 2) * width for j in range(len(rows))]
        ax.bar(xs, ys, width, color=IMPL_STYLE[name][0], label=f"vs {IMPL_STYLE[name][1]}")
    ax.axhline(1.0, color="black", lw=1)
    ax.set_yscale("log")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, rotation=90, fontsize=6)
    ax.set_ylabel("speedup of splitkv (peer time / splitkv time, log)")
    ax.set_title(f"splitkv speedup per shape, {result['device']} ({result['date']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(folder, f"speedup_{tag}.png")
    fig.savefig(path, dpi=120)
    paths.append(path)
    return paths
