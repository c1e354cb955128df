"""splitkv: split-KV (flash-decode) attention for speculative-decoding verify.

Public names:

* :func:`verify_splitkv_fwd` -- drop-in for ``extend_attention_fwd`` that runs
  the split-KV path or declines (returns ``False``);
* :func:`verify_attention` -- the production entry: split-KV when the gate
  allows, else the baseline; validates its input;
* :func:`can_handle` / :func:`decline_reason` -- the gate;
* :func:`choose_n_splits` -- the split chooser;
* :class:`VerifySplitKV` -- the cached runner with fixed scratch;
* :func:`get_runner` -- the drop-in's runner cache;
* :func:`extend_attention_fwd` -- the baseline prefill/extend kernel;
* :func:`reference_attention`, :func:`reference_for`, :func:`relative_error`
  -- the float64 oracle and the error measure;
* :func:`make_problem`, :func:`tree_mask`, :class:`VerifyProblem`,
  :class:`HeadShape`, :data:`MODEL_SHAPES` -- problem builders and shapes.
"""

import os as _os

import torch as _torch

if not _torch.cuda.is_available():
    # Without a CUDA device Triton kernels run only through its interpreter,
    # which triton.jit selects when a kernel is defined: choose it before any
    # kernel module is imported. An explicit TRITON_INTERPRET wins.
    _os.environ.setdefault("TRITON_INTERPRET", "1")

from .api import get_runner, verify_attention, verify_splitkv_fwd  # noqa: E402
from .extend import extend_attention_fwd  # noqa: E402
from .gate import can_handle, decline_reason  # noqa: E402
from .runner import VerifySplitKV  # noqa: E402
from .splits import choose_n_splits  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "verify_splitkv_fwd",
    "verify_attention",
    "get_runner",
    "can_handle",
    "decline_reason",
    "choose_n_splits",
    "VerifySplitKV",
    "extend_attention_fwd",
]
