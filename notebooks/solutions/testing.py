"""Solution to notebook 05's exercise."""

from typing import Callable

import torch

from splitkv.teaching.lessons import DEVICE
from splitkv.testing import TOLERANCE, make_problem, reference_for, relative_error


def test(kernel: Callable) -> None:
    """One ragged batch of fresh random data against the float64 oracle, into a NaN-poisoned output."""
    p = make_problem([150, 37, 0], [4, 3, 2], num_q_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float16,
                     device=DEVICE, seed=torch.randint(1 << 30, ()).item())
    out = p.new_output()  # NaN: an element the kernel does not write cannot pass
    kernel(p, out)
    err = relative_error(out, reference_for(p))
    assert err < TOLERANCE[p.q_extend.dtype], f"relative error {err:.1e} over the budget"
