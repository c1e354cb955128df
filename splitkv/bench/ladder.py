"""The small-batch latency ladder: where a verify call's time goes, step by step.

At batch 1-8 the verify kernel takes about twice the time of a bare kernel
that only gathers the same K/V (the gather floor, :mod:`splitkv.bench.floors`).
The ladder times kernels that each add one step of the verify kernel's work
to that gather, on the verify kernel's own grid and slices
(:mod:`splitkv.bench.ladder_kernels`), so each step's cost is the difference
between two rungs:

1. gather: the slice's slots, its K and V rows (their element-wise maximum kept);
2. + the QK dot (scores, row maxima);
3. + the online softmax and the PV dot (the slice's state in registers; the
   last slice also takes the draft block);
4. + the slice's normalised output and LSE written to float32 scratch;
5. + the merge: the verify kernel itself (:meth:`splitkv.VerifySplitKV.plan`
   then :meth:`~splitkv.VerifyPlan.run`), which merges in the same launch.

Rungs 1-4 cut the prefix exactly as the verify plan does: its split count
(``plan.n_splits``), its ``BLOCK_M``, K layout and offset width, and the
slicing of :mod:`splitkv.schedule` at each rung's own ``BLOCK_N``. Each rung
is the best of a small grid of launch settings: ``BLOCK_N`` 32/64/128 x warps
2/4/8 at 2 stages (less those whose key tile would spill) and the verify
plan's own setting, then stages 1 and 3 at the winner. Rung 5 runs as
planned. Every time is the median of CUDA-graph replays under ``do_bench``
with L2 flushed (:class:`Timer`), and the run also times a graph of one
empty kernel: the launch cost no kernel beats.

``--fp8`` instead times the gather floor of fp8 (e4m3) pools in two layouts:
one program per KV head (128 bytes per token at 8 heads x 128 dims) and one
program per token with all its KV heads (``heads_together``: 1 KB contiguous).

Rows: each model of :data:`splitkv.testing.MODEL_SHAPES`, batch 1 at 1k, 4k
and 16k prefix tokens and batch 8 at 4k (``--fp8`` adds batch 8 at 64k); bf16
queries, 4 draft tokens (a causal chain), random slots of a token pool.
Results go to ``figures/ladder_<gpu>.json`` and ``.md`` (``_fp8``, ``_quick``
or ``_custom`` variants; ``--out`` overrides).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch
import triton

from ..kernels.common import LOG2E
from ..plan import VerifyPlan, VerifySplitKV
from ..schedule import (LAST_PROGRAM, MERGE_PROGRAMS, SEPARATE_MERGE, head_tiles, min_split_for, next_pow2,
                        slicing)
from ..testing.problem import MODEL_SHAPES, VerifyProblem, make_problem
from ..tuning import min_split_tokens
from .floors import MAX_ACC_REGISTERS, REDUCED_GRID, TOKEN_TOKENS_PER_PROGRAM, search_gather_floor
from .ladder_kernels import _empty_kernel, _rung_kernel

from .timing import Timer, gpu_tag

__all__ = ["Setting", "Rungs", "verify_plan", "search_rung", "ladder_row", "fp8_floor_row", "run_ladder",
           "format_table", "format_markdown", "main", "ROWS", "FP8_ROWS", "RUNG_NAMES"]

#: (batch, prefix tokens) of the ladder, per model.
ROWS = ((1, 1024), (1, 4096), (1, 16384), (8, 4096))
#: The fp8 floors' rows: the ladder's and one long batch.
FP8_ROWS = ROWS + ((8, 65536),)
#: ``--quick``: (models, rows).
QUICK = (("llama3-8b",), ((1, 4096), (8, 4096)))
#: Draft tokens per sequence (a causal chain).
DRAFT_TOKENS = 4
#: What each rung adds (the fifth is the verify kernel).
RUNG_NAMES = {1: "gather", 2: "+QK dot", 3: "+softmax/PV", 4: "+partials", 5: "+merge (verify)"}
#: The rung kernels' launch settings: round 1 is every BLOCK_N x warps at the first stage count
#: (and the verify plan's setting), round 2 the other stage counts at round 1's winner.
GRID = dict(block_ns=(32, 64, 128), num_warps=(2, 4, 8), num_stages=(2, 1, 3))
#: ``--quick``'s grid: one round of two settings (and the verify plan's).
QUICK_GRID = dict(block_ns=(32, 64), num_warps=(4,), num_stages=(2,))
#: The fp8 floor searches' grids under ``--quick``: (per head, heads together).
QUICK_FP8_GRIDS = (REDUCED_GRID, dict(tokens_per_program=(16, 64, 256), num_warps=(4,)))


@dataclass(frozen=True)
class Setting:
    """A rung kernel's launch setting (the slicing follows ``block_n``)."""

    block_n: int
    num_warps: int
    num_stages: int


class Rungs:
    """The rung kernels' launches for one problem, cut into the slices of ``n_splits``.

    Args:
        p: the problem (a token pool, causal drafts, ``v_scale`` 1).
        n_splits: the grid's slices (the verify plan's).
        block_m: query rows per tile (the verify plan's ``config.block_m``).
        k_rows: load K as rows and transpose it (the plan's ``config.k_rows``).
        offsets_32: 32-bit gather offsets (the plan's ``offsets_32``).

    Attributes:
        out: ``[tiles * n_splits]`` float32 checksums of rungs 1-3.
        part_o, part_lse, part_l: ``[tiles * n_splits * block_m (* Dv)]`` float32
            scratch: rung 4's partials (``o``, base-2 LSE), rung 3's exposed state
            (``acc``, ``m``, ``l``). All start as NaN.
    """

    def __init__(self, p: VerifyProblem, n_splits: int, block_m: int, k_rows: bool = False,
                 offsets_32: bool = True):
        if p.custom_mask is not None or not p.is_causal or p.k_buffer.dim() != 3 or p.v_scale != 1.0:
            raise ValueError("the ladder runs token pools with causal drafts and v_scale 1")
        self.p, self.n_splits, self.block_m = p, n_splits, block_m
        self.k_rows, self.offsets_32 = k_rows, offsets_32
        self.group = p.num_q_heads // p.num_kv_heads
        self.m_blocks = head_tiles(p.num_q_heads, p.num_kv_heads, p.max_len_extend, block_m) // p.num_kv_heads
        self.tiles = p.batch_size * p.num_kv_heads * self.m_blocks
        rows = self.tiles * n_splits * block_m
        f32 = dict(dtype=torch.float32, device=p.q_extend.device)
        self.out = torch.full((self.tiles * n_splits,), float("nan"), **f32)
        self.part_o = torch.full((rows * p.v_head_dim,), float("nan"), **f32)
        self.part_lse = torch.full((rows,), float("nan"), **f32)
        self.part_l = torch.full((rows,), float("nan"), **f32)

    @classmethod
    def for_plan(cls, p: VerifyProblem, plan: VerifyPlan) -> "Rungs":
        """The rungs of the verify plan ``plan`` made for ``p``."""
        return cls(p, plan.n_splits, plan.config.block_m, plan.config.k_rows, plan.offsets_32)

    def min_split(self, block_n: int) -> int:
        """The shortest slice at ``block_n``, as the verify plan computes it."""
        return min_split_for(block_n, min_split_tokens())

    def slicing(self, block_n: int, prefix_len: int) -> tuple:
        """``(split_len, n_used)`` of ``prefix_len`` keys at ``block_n``: :func:`splitkv.schedule.slicing`."""
        return slicing(prefix_len, self.n_splits, block_n, self.min_split(block_n))

    def launch(self, rung: int, setting: Setting, expose: bool = False) -> None:
        """One launch of rung ``rung`` (1-4); ``expose``: rung 3 also stores its state."""
        p = self.p
        sm = p.sm_scale * LOG2E
        _rung_kernel[(self.tiles, self.n_splits)](
            p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, p.qo_indptr, p.kv_indptr, p.kv_indices,
            self.out, self.part_o, self.part_lse, self.part_l,
            sm * p.k_scale, sm, p.num_tokens, p.k_buffer.shape[0], p.kv_indices.shape[0], self.n_splits,
            self.min_split(setting.block_n),
            p.q_extend.stride(0), p.q_extend.stride(1), p.k_extend.stride(0), p.k_extend.stride(1),
            p.v_extend.stride(0), p.v_extend.stride(1), p.k_buffer.stride(0), p.k_buffer.stride(1),
            p.v_buffer.stride(0), p.v_buffer.stride(1),
            RUNG=rung, EXPOSE=expose, GROUP=self.group, NUM_KV_HEADS=p.num_kv_heads, M_BLOCKS=self.m_blocks,
            HEAD_DIM=p.head_dim, V_HEAD_DIM=p.v_head_dim, BLOCK_M=self.block_m, BLOCK_N=setting.block_n,
            BLOCK_D=next_pow2(p.head_dim), BLOCK_DV=next_pow2(p.v_head_dim),
            BLOCK_N_DRAFT=max(16, min(setting.block_n, next_pow2(p.max_len_extend))),
            K_ROWS=self.k_rows, OFFSETS_32=self.offsets_32,
            DOT_PRECISION="ieee" if p.q_extend.dtype == torch.float32 else None,
            num_warps=setting.num_warps, num_stages=setting.num_stages,
        )


def verify_plan(p: VerifyProblem) -> VerifyPlan:
    """The verify kernel's plan for ``p`` on its device, as the drop-in would make it."""
    runner = VerifySplitKV(p.num_q_heads, p.num_kv_heads, p.head_dim, p.v_head_dim, p.max_len_extend,
                           p.batch_size, p.q_extend.device)
    return runner.plan(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, p.qo_indptr, p.kv_indptr,
                       p.kv_indices, is_causal=p.is_causal, sm_scale=p.sm_scale, k_scale=p.k_scale,
                       v_scale=p.v_scale)


def _fits(rungs: Rungs, rung: int, s: Setting) -> bool:
    """Whether a setting's key tile fits the registers (else it spills: slower, and slow to compile).

    Every rung holds the K and V tiles (or their running maximum) in the pool's dtype,
    which must fit :data:`splitkv.bench.floors.MAX_ACC_REGISTERS` 32-bit registers per thread.
    """
    p = rungs.p
    words = p.k_buffer.element_size() / 4  # registers per tile element
    width = next_pow2(p.head_dim) + next_pow2(p.v_head_dim)
    return s.block_n * width * words <= MAX_ACC_REGISTERS * 32 * s.num_warps


def search_rung(rungs: Rungs, rung: int, time_us: Callable[[Callable[[], object]], float],
                grid: dict = GRID, planned: Optional[Setting] = None) -> dict:
    """The fastest setting of rung ``rung`` over ``grid`` (see the module docstring).

    Returns:
        ``{"us", "setting", "slicing": [split_len, n_used] of the mean prefix at the
        winner's BLOCK_N, "trials": [[block_n, warps, stages, µs or None], ...], "errors"}``.
    """
    trials: Dict[Setting, Optional[float]] = {}
    errors: Dict[str, str] = {}

    def trial(s: Setting) -> None:
        if s in trials or (s != planned and not _fits(rungs, rung, s)):
            return
        try:
            trials[s] = time_us(lambda: rungs.launch(rung, s))
        except Exception as err:  # a setting that cannot run here is skipped, not fatal
            trials[s] = None
            errors[f"{s.block_n}/{s.num_warps}w/{s.num_stages}s"] = f"{type(err).__name__}: {err}"[:200]

    def best() -> Optional[Setting]:
        timed = [s for s, t in trials.items() if t is not None]
        return min(timed, key=trials.get) if timed else None

    first_stages = grid["num_stages"][0]
    for bn, w in itertools.product(grid["block_ns"], grid["num_warps"]):
        trial(Setting(bn, w, first_stages))
    if planned is not None:
        trial(planned)
    first = best()
    for stages in grid["num_stages"][1:] if first else ():
        trial(Setting(first.block_n, first.num_warps, stages))
    winner = best()
    prefix = rungs.p.kv_indices.shape[0] // rungs.p.batch_size
    return dict(
        us=trials[winner] if winner else None,
        setting=asdict(winner) if winner else None,
        slicing=list(rungs.slicing(winner.block_n, prefix)) if winner else None,
        trials=[[s.block_n, s.num_warps, s.num_stages, t] for s, t in trials.items()],
        errors=errors,
    )


_MERGE_NAMES = {None: "one slice", LAST_PROGRAM: "last program", MERGE_PROGRAMS: "merge programs",
                SEPARATE_MERGE: "second launch"}


def _problem(model: str, batch: int, prefix: int, device, dtype=torch.bfloat16) -> VerifyProblem:
    s = MODEL_SHAPES[model]
    return make_problem([prefix] * batch, DRAFT_TOKENS, s.num_q_heads, s.num_kv_heads, s.head_dim,
                        dtype=dtype, device=device, pool_factor=1.25, seed=0)


def _steps(rungs: dict) -> dict:
    """Each rung's cost over the one before it (µs; ``None`` where either is missing)."""
    us = [rungs[str(r)]["us"] for r in range(1, 6)]
    return {str(r): (us[r - 1] - us[r - 2] if us[r - 1] is not None and us[r - 2] is not None else None)
            for r in range(2, 6)}


def ladder_row(model: str, batch: int, prefix: int, timer: Timer, grid: dict = GRID,
               gather_floor: bool = True, device="cuda", dtype=torch.bfloat16) -> dict:
    """One row of the ladder: the five rungs, their steps, and the gather floor of :mod:`.floors`
    (``device`` and ``dtype`` of queries and pool: bf16 on the GPU)."""
    t0 = time.perf_counter()
    p = _problem(model, batch, prefix, device, dtype)
    plan = verify_plan(p)
    rungs = Rungs.for_plan(p, plan)
    cfg = plan.config
    planned = Setting(cfg.block_n, cfg.num_warps, cfg.num_stages)
    row = dict(model=model, batch=batch, prefix=prefix, n_splits=plan.n_splits,
               plan_config=dict(block_m=cfg.block_m, block_n=cfg.block_n, num_warps=cfg.num_warps,
                                num_stages=cfg.num_stages, k_rows=cfg.k_rows),
               tiles=rungs.tiles, rungs={})
    for rung in range(1, 5):
        row["rungs"][str(rung)] = search_rung(rungs, rung, timer.graph, grid, planned)
    out = p.new_output()
    verify = lambda: plan.run(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, out=out)  # noqa: E731
    row["rungs"]["5"] = dict(us=timer.graph(verify), setting=asdict(planned),
                             slicing=list(rungs.slicing(cfg.block_n, prefix)))
    row["merge"] = _MERGE_NAMES[plan.merge]  # after the runs: a capture may have moved it to a second launch
    row["steps"] = _steps(row["rungs"])
    if gather_floor:
        found = search_gather_floor(p.k_buffer, p.v_buffer, p.kv_indices, timer.graph)
        row["gather_floor_us"], row["gather_floor_config"] = found["us"], found["config"]
    row["elapsed_s"] = time.perf_counter() - t0
    return row


def fp8_floor_row(model: str, batch: int, prefix: int, timer: Timer, quick: bool = False,
                  device="cuda") -> dict:
    """The gather floor of an fp8 e4m3 pool per KV head and per token (``heads_together``)."""
    t0 = time.perf_counter()
    p = _problem(model, batch, prefix, device)
    idx, k8, v8 = p.kv_indices, p.k_buffer.to(torch.float8_e4m3fn), p.v_buffer.to(torch.float8_e4m3fn)
    del p  # and its bf16 pools
    per_head_grid, together_grid = QUICK_FP8_GRIDS if quick else ({}, {})
    per_head = search_gather_floor(k8, v8, idx, timer.graph, **per_head_grid)
    together = search_gather_floor(k8, v8, idx, timer.graph, heads_together=True,
                                   **{"tokens_per_program": TOKEN_TOKENS_PER_PROGRAM, **together_grid})
    s = MODEL_SHAPES[model]
    return dict(model=model, batch=batch, prefix=prefix, bytes_per_head_token=s.head_dim,
                bytes_per_token=s.num_kv_heads * s.head_dim,
                per_head=dict(us=per_head["us"], config=per_head["config"], errors=per_head["errors"]),
                heads_together=dict(us=together["us"], config=together["config"], errors=together["errors"]),
                elapsed_s=time.perf_counter() - t0)


def _header(command: str, timer: Timer, kind: str) -> dict:
    return dict(kind=kind, device=torch.cuda.get_device_name(),
                num_sms=torch.cuda.get_device_properties(0).multi_processor_count, torch=torch.__version__,
                triton=triton.__version__, python=platform.python_version(),
                date=datetime.date.today().isoformat(), command=command, draft_tokens=DRAFT_TOKENS,
                dtype="bfloat16", timing=dict(warmup_ms=timer.warmup_ms, rep_ms=timer.rep_ms), rows=[])


def empty_graph_us(timer: Timer) -> float:
    """µs of a graph of one launch of an empty kernel."""
    x = torch.empty(1, device="cuda")
    return timer.graph(lambda: _empty_kernel[(1,)](x))


def run_ladder(models: Sequence[str], rows: Sequence[tuple], timer: Timer, command: str, *, fp8: bool = False,
               grid: dict = GRID, gather_floor: bool = True, quick: bool = False,
               out_path: Optional[str] = None) -> dict:
    """Time every row (the ladder, or with ``fp8`` the fp8 floors); return the record (also written to
    ``out_path`` after every row)."""
    start = time.perf_counter()
    result = _header(command, timer, "fp8_floors" if fp8 else "ladder")
    result["empty_graph_us"] = empty_graph_us(timer)
    if not fp8:
        result["grid"] = grid
    for model, (batch, prefix) in itertools.product(models, rows):
        if fp8:
            row = fp8_floor_row(model, batch, prefix, timer, quick)
        else:
            row = ladder_row(model, batch, prefix, timer, grid, gather_floor)
        result["rows"].append(row)
        result["elapsed_s"] = time.perf_counter() - start
        print(_row_line(row, result["elapsed_s"]), flush=True)
        if out_path:
            with open(out_path, "w") as f:
                json.dump(result, f, indent=1)
        torch.cuda.empty_cache()
    return result


# ---- Tables -------------------------------------------------------------------------------------

def _us(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def _shape(r: dict) -> str:
    return f"{r['model']} {r['batch']}x{r['prefix'] // 1024}k"


def _rung_cell(r: dict, rung: int) -> str:
    us = r["rungs"][str(rung)]["us"]
    step = r["steps"].get(str(rung)) if rung > 1 else None
    return _us(us) + ("" if step is None else f" ({step:+.1f})")


def _ratio(a, b) -> str:
    return "-" if a is None or b is None else f"{a / b:.2f}x"


def _table(result: dict):
    """``(head, body)`` of the result's table."""
    if result["kind"] == "fp8_floors":
        head = ["row", "B/token/head", "per head", "heads together", "together / per head"]
        body = [[_shape(r), str(r["bytes_per_head_token"]), _us(r["per_head"]["us"]),
                 _us(r["heads_together"]["us"]), _ratio(r["heads_together"]["us"], r["per_head"]["us"])]
                for r in result["rows"]]
        return head, body
    head = ["row", "splits", "merge", "floor"] + [f"{n}. {RUNG_NAMES[n]}" for n in range(1, 6)]
    body = [[_shape(r), str(r["n_splits"]), r["merge"], _us(r.get("gather_floor_us"))]
            + [_rung_cell(r, n) for n in range(1, 6)] for r in result["rows"]]
    return head, body


def _notes(result: dict) -> List[str]:
    lines = [f"{result['device']} ({result['num_sms']} SMs), torch {result['torch']}, triton {result['triton']}, "
             f"{result['date']}: `{result['command']}`.",
             f"µs = median of triton.testing.do_bench over CUDA-graph replays, L2 flushed; a graph of one empty "
             f"kernel takes {result['empty_graph_us']:.1f} µs."]
    if result["kind"] == "fp8_floors":
        lines.append("Gather floor of an fp8 e4m3 pool (splitkv.bench.floors): per head = one program per KV "
                     "head and chunk of tokens, reading B/token/head bytes of K (and of V) per token; heads "
                     "together = one program per chunk, every KV head of a token in one contiguous row. Best "
                     "of a grid of launch settings each.")
    else:
        lines.append(f"bf16, {result['draft_tokens']} draft tokens, random slots of a token pool. Rungs 1-4 run "
                     "on the verify plan's grid and slices, best of a grid of launch settings each; (+x) = the "
                     "step's cost over the rung before; floor = the benchmark's gather floor (a flat gather, "
                     "not the verify grid); merge = who merges in the verify kernel.")
    return lines


def format_table(result: dict) -> str:
    """The result as a plain-text table and notes."""
    head, body = _table(result)
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    fmt = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([fmt(head), "-" * len(fmt(head))] + [fmt(c) for c in body] + [""] + _notes(result))


def format_markdown(result: dict) -> str:
    """The result as a Markdown table under its provenance line."""
    head, body = _table(result)
    notes = _notes(result)
    lines = [notes[0], "", "| " + " | ".join(head) + " |", "|---|" + "--:|" * (len(head) - 1)]
    return "\n".join(lines + ["| " + " | ".join(c) + " |" for c in body] + [""] + notes[1:]) + "\n"


def _row_line(row: dict, total_s: float) -> str:
    if "rungs" in row:
        text = "  ".join(f"{n}: {_rung_cell(row, n)}" for n in range(1, 6))
    else:
        text = f"fp8 per head {_us(row['per_head']['us'])}, heads together {_us(row['heads_together']['us'])}"
    return f"{_shape(row):<22} {text} us; row {row['elapsed_s']:.1f} s, total {total_s:.0f} s"


# ---- Command line -------------------------------------------------------------------------------

_EPILOG = """\
time: the default run (3 models x 4 rows, up to 12 settings per rung) spends
most of its time compiling the rung kernels, one per rung, model and setting
(about 120), then about 55 timings per row; --fp8 times 15 rows x two floor
searches (up to 18 and 27 settings); --quick is sized to stay under a minute.
"""


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m splitkv.bench.ladder", description=__doc__.split("\n\n")[0],
                                 epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=list(MODEL_SHAPES), metavar="MODEL",
                    help=f"of {', '.join(MODEL_SHAPES)} (default: all)")
    ap.add_argument("--quick", action="store_true",
                    help=f"smoke run: {QUICK[0][0]} at batch 1 and 8 x 4k tokens, 2 settings per rung (and the "
                         "plan's)")
    ap.add_argument("--fp8", action="store_true",
                    help="the fp8 gather floors per KV head and per token instead of the ladder")
    ap.add_argument("--no-gather-floor", action="store_true", help="skip the flat gather-floor column")
    ap.add_argument("--rep-ms", type=float, default=25.0, metavar="MS",
                    help="do_bench measuring time per timing, milliseconds (default: 25)")
    ap.add_argument("--out", default=None, metavar="PATH",
                    help="result JSON path, the .md beside it "
                         "(default: figures/ladder_<gpu>[_fp8][_quick|_custom].json)")
    return ap


def plan_run(argv: Optional[Sequence[str]], device_name: str) -> dict:
    """What a command line asks for on a GPU called ``device_name``: run_ladder's arguments and the paths."""
    args = _parser().parse_args(argv)
    models, rows = QUICK if args.quick else (tuple(MODEL_SHAPES), FP8_ROWS if args.fp8 else ROWS)
    variant = ("_fp8" if args.fp8 else "") + ("_quick" if args.quick else "_custom" if args.models else "")
    out = args.out or os.path.join("figures", f"ladder_{gpu_tag(device_name)}{variant}.json")
    command = " ".join(["python -m splitkv.bench.ladder", *(argv if argv is not None else sys.argv[1:])])
    return dict(models=tuple(args.models or models), rows=rows, fp8=args.fp8, quick=args.quick,
                grid=QUICK_GRID if args.quick else GRID, gather_floor=not (args.no_gather_floor or args.quick),
                timer=dict(warmup_ms=2.0 if args.quick else 5.0, rep_ms=min(args.rep_ms, 10.0) if args.quick
                           else args.rep_ms),
                command=command.strip(), out=out, md=os.path.splitext(out)[0] + ".md")


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The ``python -m splitkv.bench.ladder`` command line."""
    if not torch.cuda.is_available():
        _parser().parse_args(argv)  # --help works anywhere
        sys.exit("the ladder needs a CUDA GPU")
    run = plan_run(argv, torch.cuda.get_device_name())
    if os.path.dirname(run["out"]):
        os.makedirs(os.path.dirname(run["out"]), exist_ok=True)
    print(f"{torch.cuda.get_device_name()}: writing {run['out']} and {run['md']}", flush=True)
    result = run_ladder(run["models"], run["rows"], Timer(**run["timer"]), run["command"], fp8=run["fp8"],
                        grid=run["grid"], gather_floor=run["gather_floor"], quick=run["quick"], out_path=run["out"])
    with open(run["md"], "w") as f:
        f.write(format_markdown(result))
    print(format_table(result))
    print(f"total {result['elapsed_s']:.0f} s")


if __name__ == "__main__":
    main()
