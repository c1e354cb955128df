"""``python -m splitkv`` (or ``splitkv``; ``demo`` may be named): the package's demo.

Builds verify problems for the labelled model shapes, runs the split-KV path,
the baseline ``extend_attention_fwd`` and the float64 oracle, and prints one
row per problem: relative errors, the chosen split count, and times.

On a CUDA GPU it uses real shapes (bf16, prefixes of 4k-64k tokens, timed
with ``triton.testing.do_bench``). Without one it runs the same code through
the Triton interpreter (``TRITON_INTERPRET=1``) at small shapes in float16;
interpreter times measure Python, not a GPU, and are shown only for scale.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
import time
import warnings

import torch

from . import extend_attention_fwd, get_runner, verify_splitkv_fwd
from .testing import MODEL_SHAPES, make_problem
from .testing.reference import reference_for, relative_error

#: (model, batch, prefix) cases of the demo on a GPU and on a CPU.
GPU_CASES = [("qwen3-next", 1, 4096), ("llama3-8b", 8, 16384), ("qwen3-32b", 8, 65536)]
CPU_CASES = [("qwen3-next", 2, 300), ("llama3-8b", 2, 257), ("qwen3-32b", 1, 513)]


def _timer(fn, cuda: bool) -> float:
    """Median µs of ``do_bench`` on a GPU; seconds of one run under the interpreter."""
    if cuda:
        import triton.testing

        return 1e3 * triton.testing.do_bench(fn, return_mode="median")
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def demo(cuda: bool) -> int:
    # The interpreter evaluates both sides of tl.where (0/0 on padding rows): harmless noise.
    warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float16
    cases = GPU_CASES if cuda else CPU_CASES
    where = torch.cuda.get_device_name() if cuda else "CPU, Triton interpreter (times are Python, not GPU)"
    print(f"splitkv demo on {where}; {dtype}, 4 draft tokens, random kv_indices\n")
    unit = "us" if cuda else "s"
    header = (f"{'model':<28}{'bs':>3}{'prefix':>8}{'splits':>7}{'err split':>11}{'err extend':>11}"
              f"{'split ' + unit:>11}{'extend ' + unit:>11}")
    print(header)
    print("-" * len(header))
    worst = 0.0
    for model, bs, prefix in cases:
        s = MODEL_SHAPES[model]
        p = make_problem([prefix] * bs, 4, s.num_q_heads, s.num_kv_heads, s.head_dim,
                         dtype=dtype, device=device, seed=0)
        split_out, base_out = p.new_output(), p.new_output()
        assert verify_splitkv_fwd(*p.args(split_out), **p.kwargs())
        extend_attention_fwd(*p.args(base_out), **p.kwargs())
        ref = reference_for(p)
        err_split, err_base = relative_error(split_out, ref), relative_error(base_out, ref)
        worst = max(worst, err_split)
        runner = get_runner(p.q_extend, p.k_extend, p.v_extend, p.max_len_extend, bs)
        t_split = _timer(lambda: verify_splitkv_fwd(*p.args(split_out), **p.kwargs()), cuda)
        t_base = _timer(lambda: extend_attention_fwd(*p.args(base_out), **p.kwargs()), cuda)
        print(f"{s.name:<28}{bs:>3}{prefix:>8}{runner.n_splits(bs, prefix):>7}"
              f"{err_split:>11.1e}{err_base:>11.1e}{t_split:>11.1f}{t_base:>11.1f}")
    tol = 2e-2 if cuda else 3e-3
    ok = worst < tol
    print(f"\nerr = ||out - ref|| / ||ref|| against the float64 oracle; worst split-KV error "
          f"{worst:.1e} ({'within' if ok else 'OVER'} the {dtype} budget {tol:.0e})")
    return 0 if ok else 1


def _wrap(text: str) -> str:
    """``text`` filled to 78 columns, indented by two; no break at a no-break space."""
    return textwrap.fill(text, 78, initial_indent="  ", subsequent_indent="  ",
                         break_on_hyphens=False).replace("\xa0", " ")


def _help_text() -> tuple:
    """argparse's description and epilog, with the demo's cases filled in."""
    def cases(rows):
        return "; ".join(f"{MODEL_SHAPES[m].name}, batch {bs}, prefix {prefix}".replace(" ", "\xa0")
                         for m, bs, prefix in rows)

    description = "\n".join([
        "splitkv: split-KV (flash-decode) attention for the target-verify step of",
        "speculative decoding, in Triton.",
        "",
        "command (optional; the demo is the only one and runs by default):",
        "  demo  build verify problems (4 draft tokens per sequence attending to a",
        "        long cached prefix) for three model head shapes; run the split-KV",
        "        path, the baseline extend_attention_fwd and a float64 oracle; print",
        "        one row per problem: each kernel's relative error against the",
        "        oracle, 'splits' (how many slices the prefix is cut into, run in",
        "        parallel) and each kernel's time. Exits 1 if a split-KV error is",
        "        over the dtype's budget.",
    ])
    epilog = "\n".join([
        "GPU or CPU:",
        _wrap(f"With a CUDA GPU: real shapes in bf16 ({cases(GPU_CASES)}), timed in "
              "microseconds with triton.testing.do_bench; typically under a minute, most of it "
              "compiling the kernels on first use."),
        _wrap("Without one: the same kernels through the Triton interpreter (TRITON_INTERPRET=1) "
              f"on small shapes in fp16 ({cases(CPU_CASES)}); under a minute on a laptop-class "
              "CPU. Its times are seconds of Python, for scale only."),
        "",
        "more:",
        _wrap("the tutorial notebooks (make notebooks), the documentation (make docs), the "
              "benchmark on a GPU (python -m splitkv.bench --help)."),
    ])
    return description, epilog


def main(argv=None, prog: str = "splitkv") -> int:
    from . import __version__

    description, epilog = _help_text()
    ap = argparse.ArgumentParser(
        prog=prog, description=description, epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("command", nargs="?", default="demo", choices=["demo"],
                    help="what to run (see above; default: demo)")
    ap.add_argument("--version", action="version", version=f"splitkv {__version__}")
    ap.parse_args(argv)
    return demo(torch.cuda.is_available())


if __name__ == "__main__":
    sys.exit(main(prog="python -m splitkv"))
