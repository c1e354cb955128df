"""The GPU lab: time your split-KV kernels (``notebooks/your_kernels.py``) on a GPU.

For each shape it times, as CUDA-graph replays (``triton.testing.do_bench``,
median, L2 flushed between replays):

* your ``slice_kernel`` + ``merge_kernel`` over the prefix (the draft block
  aside), at ``BLOCK_N`` 64 and 2 stages;
* the package's verify call on the same problem (prefix and drafts, one launch
  where it can);
* the floor (prefix K and V bytes over the measured read bandwidth) and the
  gather floor (the best bare kernel that only gathers the same rows and adds
  them, :mod:`splitkv.bench.floors`),

and prints the bandwidth each achieves: prefix bytes / time. It then sweeps
``BLOCK_N`` and the pipeline's stages on your slice kernel for one shape.

A kernel still a stub is replaced by its stored solution, and the log says so.
Your kernels are checked first (the same checkers as notebooks 03 and 04); a
kernel that fails its checker is not timed.

Run it from the repository root, on a machine with a CUDA GPU::

    python -m splitkv.teaching.gpu_lab [--log FILE] [--quick] [--solutions]

On a machine without one it says so and exits cleanly (status 0).
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, List, Optional, Sequence, TextIO, Tuple

import torch

__all__ = ["SHAPES", "gpu_available", "learner_kernels", "run_lab", "main"]

#: (label, q heads, KV heads, head dim, batch, prefix): Llama-3-8B's heads and Qwen3-Next's full-attention heads.
SHAPES: List[Tuple[str, int, int, int, int, int]] = [
    ("Llama-3-8B", 32, 8, 128, 1, 4096),
    ("Llama-3-8B", 32, 8, 128, 1, 16384),
    ("Llama-3-8B", 32, 8, 128, 8, 16384),
    ("Llama-3-8B", 32, 8, 128, 8, 65536),
    ("Qwen3-Next", 16, 2, 256, 1, 16384),
    ("Qwen3-Next", 16, 2, 256, 8, 65536),
]
#: The sweep of your slice kernel: BLOCK_N x stages, at 4 warps.
SWEEP_BLOCK_N = (16, 32, 64, 128)
SWEEP_STAGES = (1, 2, 3, 4)
DRAFTS = 4


def gpu_available() -> bool:
    """Whether a CUDA GPU is there to time on."""
    return torch.cuda.is_available()


def learner_kernels(use_solutions: bool = False, out: TextIO = sys.stdout):
    """``(slice_kernel, merge_kernel, notes)``: yours from ``your_kernels.py``, checked; a stub's stored solution."""
    from .exercises import is_stub, solution_of, your_kernels
    from .exercises.kernels import check_merge_kernel, check_slice_kernel

    mine = your_kernels()
    chosen, notes = [], []
    for name, check in (("slice_kernel", check_slice_kernel), ("merge_kernel", check_merge_kernel)):
        kernel = getattr(mine, name)
        if use_solutions or is_stub(kernel) or (name == "slice_kernel" and (is_stub(mine.tile_step)
                                                                            or is_stub(mine.load_q_tile))):
            notes.append(f"{name}: the stored solution ({'asked for' if use_solutions else 'yours is a stub'})")
            kernel = solution_of(check)
        else:
            print(check(kernel), file=out)  # raises, naming the mistake, if it is wrong
            notes.append(f"{name}: yours")
        chosen.append(kernel)
    return chosen[0], chosen[1], notes


def _launch_slices(kernel, p, n_splits, part_o, part_lse, block_n, num_stages, num_warps=4):
    from .exercises.kernels import LOG2E

    kernel[(p.batch_size, p.num_kv_heads, n_splits)](
        p.q_extend, p.k_buffer, p.v_buffer, p.qo_indptr, p.kv_indptr, p.kv_indices, part_o, part_lse,
        p.sm_scale * LOG2E, part_o.shape[2], *p.q_extend.stride()[:2], *p.k_buffer.stride()[:2],
        *p.v_buffer.stride()[:2], GROUP=p.num_q_heads // p.num_kv_heads, D=p.head_dim, DV=p.v_head_dim,
        BLOCK_M=part_o.shape[3], BLOCK_N=block_n, num_stages=num_stages, num_warps=num_warps)


def _merge_outputs(part_o):
    """Preallocated ``o [tiles, BLOCK_M, Dv]`` and ``lse [tiles, BLOCK_M]`` (no fill inside a timed graph)."""
    tiles = part_o.shape[0] * part_o.shape[1]
    block_m, dv = part_o.shape[3:]
    return (torch.empty((tiles, block_m, dv), device=part_o.device),
            torch.empty((tiles, block_m), device=part_o.device))


def _launch_merge(kernel, part_o, part_lse, o, lse):
    kernel[(o.shape[0],)](part_o, part_lse, o, lse, part_o.shape[2], DV=o.shape[2], BLOCK_M=o.shape[1])
    return o, lse


def _problem(batch, prefix, h_q, h_kv, d, seed, device="cuda"):
    from splitkv import testing

    # pool_factor 1: the pool is the prefixes, shuffled (random slots), and the host draws half the data.
    # bf16 on a GPU; float16 in a dry run (the interpreter's bf16 tl.dot is wrong).
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    return testing.make_problem([prefix] * batch, DRAFTS, h_q, h_kv, d, dtype=dtype, device=device,
                                pool_factor=1.0, seed=seed)


def _n_splits(p, block_n: int, num_sms: int) -> int:
    """Enough slices for about two programs per SM, each at least one key tile long."""
    per_program = max(1, -(-2 * num_sms // (p.batch_size * p.num_kv_heads)))
    longest = max(p.prefix_lens)
    return max(1, min(per_program, -(-longest // block_n), 64))


def _attempt(what: str, fn: Callable[[], Optional[float]], out: TextIO) -> Optional[float]:
    """``fn()``, or ``None`` after printing why it failed."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        print(f"  ({what}: not measured, {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})",
              file=out)
        return None


def run_lab(use_solutions: bool = False, quick: bool = False, out: TextIO = sys.stdout, *,
            dry_run: Optional[dict] = None) -> Optional[dict]:
    """Run the lab and print its tables to ``out``; return what it measured (``None`` without a GPU).

    ``dry_run`` (tests only) runs the same steps on the CPU through the interpreter: ``{"shapes": [...],
    "timer": object with .graph(fn) -> µs, "bandwidth": bytes/s, "gather_us": µs, "sweep": (block_ns, stages)}``.
    """
    if dry_run is None and not gpu_available():
        print("The GPU lab needs a CUDA GPU, and this machine has none: nothing to time here. On a GPU machine, "
              "from the repository root: python -m splitkv.teaching.gpu_lab --log gpu_lab.log", file=out)
        return None
    import splitkv
    from splitkv import testing
    from splitkv.bench.floors import REDUCED_GRID, search_gather_floor
    from splitkv.bench.timing import Timer, measure_read_bandwidth
    from .exercises import solution_of
    from .exercises.kernels import check_merge_kernel, check_slice_kernel, new_scratch, unpack_tiles
    from .lessons import banner

    dry = dry_run or {}
    device = "cpu" if dry_run is not None else "cuda"
    name, num_sms = ("the interpreter (dry run)", 4) if dry_run is not None else (
        torch.cuda.get_device_properties(0).name, torch.cuda.get_device_properties(0).multi_processor_count)
    print(f"{name} ({num_sms} SMs); {banner()}", file=out)
    slice_kernel, merge_kernel, notes = learner_kernels(use_solutions, out)
    print("kernels timed: " + "; ".join(notes), file=out)
    bandwidth = dry.get("bandwidth") or measure_read_bandwidth()
    print(f"measured read bandwidth (x.sum() over 2 GiB): {bandwidth / 1e12:.2f} TB/s\n", file=out)
    timer = dry.get("timer") or Timer(warmup_ms=5, rep_ms=15 if quick else 25)
    shapes = dry.get("shapes") or (SHAPES[:3] if quick else SHAPES)
    sweep_block_ns, sweep_stages = dry.get("sweep") or (SWEEP_BLOCK_N, SWEEP_STAGES)

    def gather_floor(p):
        if dry_run is not None:
            return dry.get("gather_us")
        return search_gather_floor(p.k_buffer, p.v_buffer, p.kv_indices, timer.graph, **REDUCED_GRID)["us"]

    results = {"device": name, "read_bandwidth": bandwidth, "notes": notes, "rows": [], "sweep": []}

    head = (f"{'shape':<30}{'KV MB':>8}{'floor':>8}{'gather':>8}{'yours':>8}{'splitkv':>9}"
            f"{'yours TB/s':>12}{'splitkv TB/s':>14}{'floor/yours':>12}")
    print("times in µs, CUDA-graph replays; TB/s = prefix K and V bytes / time\n" + head, file=out)
    for label, h_q, h_kv, d, batch, prefix in shapes:
        p = _problem(batch, prefix, h_q, h_kv, d, seed=0, device=device)
        kv_bytes = batch * prefix * h_kv * 2 * d * 2
        block_n, stages = 64, 2
        n_splits = _n_splits(p, block_n, num_sms)
        part_o, part_lse = new_scratch(p, n_splits)
        o_t, lse_t = _merge_outputs(part_o)

        def yours():
            _launch_slices(slice_kernel, p, n_splits, part_o, part_lse, block_n, stages)
            return _launch_merge(merge_kernel, part_o, part_lse, o_t, lse_t)

        # Right before fast: your prefix attention against the stored solution's, on this very problem.
        o_mine, _ = unpack_tiles(p, *yours())
        ref_o, ref_lse = new_scratch(p, n_splits)
        _launch_slices(solution_of(check_slice_kernel), p, n_splits, ref_o, ref_lse, block_n, stages)
        o_ref, _ = unpack_tiles(p, *_launch_merge(solution_of(check_merge_kernel), ref_o, ref_lse,
                                                  *_merge_outputs(ref_o)))
        err = testing.relative_error(o_mine, o_ref)
        if not err < 1e-2:
            raise AssertionError(f"{label} batch {batch}, prefix {prefix}: your output is off by {err:.2g} "
                                 f"(relative) at this shape; fix it before timing it")

        def package():
            runner = splitkv.VerifySplitKV(h_q, h_kv, d, d, p.max_len_extend, batch, device)
            plan = runner.plan(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, p.qo_indptr,
                               p.kv_indptr, p.kv_indices, sm_scale=p.sm_scale)
            out_buf = p.new_output()
            return timer.graph(lambda: plan.run(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer,
                                                out=out_buf))

        # One measurement that fails (out of memory, say) is reported and the lab goes on.
        t_yours, t_pkg, gather = (_attempt(what, fn, out) for what, fn in (
            ("your kernels", lambda: timer.graph(yours)), ("splitkv", package), ("the gather floor",
                                                                                lambda: gather_floor(p))))
        floor = kv_bytes / bandwidth * 1e6
        row = dict(shape=label, batch=batch, prefix=prefix, n_splits=n_splits, kv_bytes=kv_bytes, floor_us=floor,
                   gather_floor_us=gather, yours_us=t_yours, splitkv_us=t_pkg)
        results["rows"].append(row)
        name = f"{label} bs{batch} {prefix // 1024}k ({n_splits} sl.)"
        nan = float("nan")
        t_yours, t_pkg, gather = (nan if t is None else t for t in (t_yours, t_pkg, gather))
        print(f"{name:<30}{kv_bytes / 1e6:>8.0f}{floor:>8.1f}{gather:>8.1f}{t_yours:>8.1f}"
              f"{t_pkg:>9.1f}{kv_bytes / t_yours / 1e6:>12.2f}{kv_bytes / t_pkg / 1e6:>14.2f}"
              f"{floor / t_yours:>12.0%}", file=out)
        del p, part_o, part_lse, o_t, lse_t, ref_o, ref_lse
        if device == "cuda":
            torch.cuda.empty_cache()

    # The sweep: BLOCK_N x stages on your slice kernel (the merge as above), one shape.
    label, h_q, h_kv, d, batch, prefix = shapes[min(2, len(shapes) - 1)]
    p = _problem(batch, prefix, h_q, h_kv, d, seed=1, device=device)
    kv_bytes = batch * prefix * h_kv * 2 * d * 2
    print(f"\nsweep of your slice kernel + merge, {label} bs{batch} {prefix // 1024}k, 4 warps: µs (TB/s)", file=out)
    print(f"{'BLOCK_N':>8}" + "".join(f"{f'{s} stage' + ('s' if s > 1 else ''):>18}" for s in sweep_stages), file=out)
    best = None
    for block_n in sweep_block_ns:
        n_splits = _n_splits(p, block_n, num_sms)
        part_o, part_lse = new_scratch(p, n_splits)
        o_t, lse_t = _merge_outputs(part_o)
        cells = []
        for stages in sweep_stages:
            def call(block_n=block_n, stages=stages, n_splits=n_splits, part_o=part_o, part_lse=part_lse):
                _launch_slices(slice_kernel, p, n_splits, part_o, part_lse, block_n, stages)
                return _launch_merge(merge_kernel, part_o, part_lse, o_t, lse_t)
            try:
                t = timer.graph(call)
            except Exception as e:  # noqa: BLE001  (out of shared memory, say)
                cells.append(f"{'-- ' + type(e).__name__[:12]:>18}")
                results["sweep"].append(dict(block_n=block_n, stages=stages, us=None, error=str(e)[:200]))
                continue
            results["sweep"].append(dict(block_n=block_n, stages=stages, us=t))
            cells.append(f"{t:>10.1f} ({kv_bytes / t / 1e6:4.2f})")
            if best is None or t < best[0]:
                best = (t, block_n, stages)
        print(f"{block_n:>8}" + "".join(cells), file=out)
    if best:
        print(f"best: BLOCK_N {best[1]}, {best[2]} stage{'s' if best[2] > 1 else ''}, {best[0]:.1f} µs = {kv_bytes / best[0] / 1e6:.2f} TB/s "
              f"({kv_bytes / bandwidth * 1e6 / best[0]:.0%} of the floor's bandwidth)", file=out)
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m splitkv.teaching.gpu_lab", description=__doc__.split("\n\n")[0])
    parser.add_argument("--log", help="also write everything printed to this file")
    parser.add_argument("--quick", action="store_true", help="the first three shapes only, shorter timings")
    parser.add_argument("--solutions", action="store_true", help="time the stored solutions, not your_kernels.py")
    args = parser.parse_args(argv)

    class Tee:
        def __init__(self, *streams):
            self.streams = streams

        def write(self, text):
            for s in self.streams:
                s.write(text)
                s.flush()

        def flush(self):
            for s in self.streams:
                s.flush()

    log = open(args.log, "w") if args.log else None
    try:
        run_lab(args.solutions, args.quick, Tee(sys.stdout, *([log] if log else [])))
    finally:
        if log:
            log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
