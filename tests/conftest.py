"""Shared test helpers: the device under test, per-dtype tolerances, the oracle check."""

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    # On a CPU-only machine every kernel runs through the Triton interpreter;
    # triton.jit reads this when the kernels are defined, so set it first.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from splitkv.testing import reference_for, relative_error  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"

#: Relative-error budgets ||out - ref|| / ||ref|| against the float64 oracle.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}

#: dtypes the kernels are checked in here: bf16 only on the GPU, since the
#: interpreter's bf16 tl.dot is broken (triton-lang/triton#11584).
DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if CUDA else [])


def assert_matches_reference(out, problem, **overrides):
    """Every element written and finite, and within the dtype's error budget."""
    assert torch.isfinite(out).all(), "output holds NaN/inf (unwritten or broken rows)"
    err = relative_error(out, reference_for(problem, **overrides))
    tol = TOLERANCE[out.dtype]
    assert err < tol, f"relative error {err:.2e} exceeds {tol:.0e} for {out.dtype}"
    return err


gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
