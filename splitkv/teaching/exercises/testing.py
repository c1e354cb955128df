"""Checker for notebook 05: a test that catches planted bugs.

A *kernel* here is a function ``kernel(p, out)`` that runs verify attention
for a :class:`splitkv.testing.VerifyProblem` ``p`` and writes the result into
``out``. :func:`real_kernel` is the package's split-KV kernel; :data:`PLANTED`
holds three wrong ones, each a bug a kernel writer makes:

* ``"skips a partial key tile"``: a floor where a ceiling belongs, so a
  prefix whose length is not a multiple of the key tile loses its last keys;
* ``"forgets the softmax scale"``: scores ``q.k`` instead of ``q.k * sm_scale``;
* ``"skips empty prefixes"``: a sequence without prefix keys gets no output.

:func:`check_test` judges ``test(kernel)``, a learner's test: it must return
quietly for the real kernel and raise an ``AssertionError`` for each planted
one.
"""

from __future__ import annotations

from typing import Callable, Dict

import torch

from ...plan import VerifySplitKV
from ...testing import TOLERANCE, make_problem, reference_for, relative_error
from ..lessons import DEVICE
from . import Unsolved, checks

__all__ = ["N_SPLITS", "real_kernel", "PLANTED", "check_test"]

#: Slices every launch here is cut into, so that the short prefixes a CPU can run are split too.
N_SPLITS = 3


def _plan(p, **changes):
    """The split-KV plan of ``p`` (with fields replaced by ``changes``), ``N_SPLITS`` slices."""
    p = p.replace(**changes) if changes else p
    runner = VerifySplitKV(p.num_q_heads, p.num_kv_heads, p.head_dim, p.v_head_dim, p.max_len_extend,
                           p.batch_size, p.q_extend.device, n_splits=N_SPLITS)
    return p, runner.plan(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, p.qo_indptr, p.kv_indptr,
                          p.kv_indices, custom_mask=p.custom_mask, mask_indptr=p.mask_indptr,
                          is_causal=p.is_causal, sm_scale=p.sm_scale, k_scale=p.k_scale, v_scale=p.v_scale,
                          sinks=p.sinks)


def _run(p, out, **changes):
    """Run the split-KV kernel on ``p`` (fields replaced by ``changes``) into ``out``."""
    p, plan = _plan(p, **changes)
    plan.run(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, out=out)


def real_kernel(p, out) -> None:
    """The package's split-KV verify kernel, ``N_SPLITS`` slices per prefix."""
    _run(p, out)


def _skips_partial_tile(p, out) -> None:
    # The bug: key tiles = P // BLOCK_N, not cdiv(P, BLOCK_N). Made here by pointing the
    # lost keys at a slot past the pool, which the kernel's bounded gather treats as absent.
    block_n = _plan(p)[1].config.block_n
    slots = p.kv_indices.clone()
    starts = p.kv_indptr.tolist()
    for b, n in enumerate(p.prefix_lens):
        slots[starts[b] + n // block_n * block_n: starts[b] + n] = p.k_buffer.shape[0]
    _run(p, out, kv_indices=slots)


def _forgets_scale(p, out) -> None:
    # The bug: the scores are q.k, not q.k * sm_scale.
    _run(p, out, sm_scale=1.0)


def _skips_empty_prefixes(p, out) -> None:
    # The bug: a program returns early when its sequence has no prefix, before the draft block.
    full = torch.empty_like(out)
    _run(p, full)
    rows = p.qo_indptr.tolist()
    for b, n in enumerate(p.prefix_lens):
        if n > 0:
            out[rows[b]: rows[b + 1]] = full[rows[b]: rows[b + 1]]


#: The planted bugs: a name, and a kernel that has it.
PLANTED: Dict[str, Callable] = {
    "skips a partial key tile": _skips_partial_tile,
    "forgets the softmax scale": _forgets_scale,
    "skips empty prefixes": _skips_empty_prefixes,
}

_HINTS = {
    "skips a partial key tile": "give some prefix a length that is not a multiple of the key tile "
                                "(BLOCK_N: 16 to 128 keys), such as 37",
    "forgets the softmax scale": "use random queries of ordinary size (make_problem's): if every score is 0, "
                                 "the scale changes nothing",
    "skips empty prefixes": "include a sequence whose prefix is empty (length 0), and poison the output "
                            "with NaN (p.new_output())",
}


@checks("testing", "test")
def check_test(test: Callable) -> str:
    """Run ``test`` on the real kernel (it must pass) and on each planted bug (it must raise AssertionError)."""
    try:
        test(real_kernel)
    except AssertionError as err:
        raise AssertionError(f"your test fails the correct kernel ({err}). A test must pass a right answer: "
                             f"compare with reference_for(p) within TOLERANCE[dtype] of the inputs' dtype") from None
    escaped = []
    for name, kernel in PLANTED.items():
        try:
            test(kernel)
        except AssertionError:
            continue
        except Unsolved:
            raise
        except Exception as err:  # a test fails by assertion, not by crashing
            raise AssertionError(f"on the kernel that {name}, your test raised {type(err).__name__} ({err}) "
                                 f"instead of an AssertionError") from None
        escaped.append(f"the kernel that {name} passed it: {_HINTS[name]}")
    if escaped:
        raise AssertionError("; ".join(escaped))
    return f"passed: your test passes the real kernel and catches all {len(PLANTED)} planted bugs"
