"""``python -m splitkv.bench.host``: host time of one eager call of each entry (GPU only).

For each labelled model shape, batch and pool dtype, the benchmark's host
timing (:meth:`splitkv.bench.timing.Timer.host`: calls in bursts, each timed alone,
the thread pinned to the fastest CPU; the fastest of ``--rounds`` medians) of

* ``plan.run`` -- a plan made once (:class:`splitkv.VerifyPlan`);
* ``drop-in`` -- :func:`splitkv.verify_splitkv_fwd`;
* ``verify_attention`` -- with its default checks, and with ``check=False``;
* ``op wrapper`` -- :func:`splitkv.verify_attention_op` (eager: the implementation);
* ``torch.ops`` -- ``torch.ops.splitkv.verify_attention`` through the dispatcher,
  as a compiled graph calls it.

Host times depend on the CPU: compare entries within one run.
"""

from __future__ import annotations

import argparse
import datetime
import json

import torch

from .. import VerifySplitKV, verify_attention, verify_attention_op, verify_splitkv_fwd
from .timing import Timer
from ..testing import MODEL_SHAPES, make_problem

CASES = [(1, 4096), (8, 16384)]


def entries(p):
    """The timed calls for problem ``p``."""
    o = p.new_output()
    args, kwargs, tensors, options = p.args(o), p.kwargs(), p.tensors(o), p.options()
    layer = (p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer)
    plan = VerifySplitKV(p.num_q_heads, p.num_kv_heads, p.head_dim, p.v_head_dim, p.max_len_extend,
                         p.batch_size).plan(*layer, p.qo_indptr, p.kv_indptr, p.kv_indices,
                                            k_scale=p.k_scale, v_scale=p.v_scale)
    op_args = tensors[:3] + tensors[4:]
    return {
        "plan.run": lambda: plan.run(*layer, out=o),
        "drop-in": lambda: verify_splitkv_fwd(*args, **kwargs),
        "verify_attention": lambda: verify_attention(*tensors, **options),
        "verify_attention(check=False)": lambda: verify_attention(*tensors, **options, check=False),
        "op wrapper": lambda: verify_attention_op(*op_args, **options),
        "torch.ops": lambda: torch.ops.splitkv.verify_attention(*op_args, **options),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m splitkv.bench.host", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300, help="timed calls per round (default: 300)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per entry, the fastest kept (default: 3)")
    parser.add_argument("--json", metavar="PATH", help="also write the table here (device, date, one row per line)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    timer = Timer(host_calls=args.calls)
    device = torch.cuda.get_device_name()
    print(f"host µs per eager call, {device}, fastest of {args.rounds} medians of {args.calls} calls")
    rows = []
    for model, shape in MODEL_SHAPES.items():
        for bs, prefix in CASES:
            for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
                p = make_problem([prefix] * bs, 4, shape.num_q_heads, shape.num_kv_heads, shape.head_dim,
                                 dtype=torch.bfloat16, kv_dtype=kv_dtype, device="cuda", seed=0)
                times = {name: min(timer.host(fn) for _ in range(args.rounds)) for name, fn in entries(p).items()}
                kv = str(kv_dtype).split(".")[-1]
                rows.append(dict(model=model, batch=bs, prefix=prefix, kv_dtype=kv, host_us=times))
                cells = " ".join(f"{name}={t:.1f}" for name, t in times.items())
                print(f"{model:<11} bs {bs:<2} {prefix:>6} {kv:<14} {cells}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device, date=datetime.date.today().isoformat(), command="python -m splitkv.bench.host",
                           calls=args.calls, rounds=args.rounds, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
