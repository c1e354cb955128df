"""splitkv: split-KV (flash-decode) attention for speculative-decoding verify.

Public names:

* :func:`verify_splitkv_fwd` -- drop-in for ``extend_attention_fwd`` that runs
  the split-KV path or declines (returns ``False``);
* :func:`verify_attention` -- the production entry: split-KV when the gate
  allows, else the baseline; validates its input; can return the LSE;
* ``torch.ops.splitkv.verify_attention`` / ``torch.ops.splitkv.merge_states``
  -- the same as custom ops for ``torch.compile`` (:mod:`splitkv.ops`);
* :class:`VerifySplitKV` and :class:`VerifyPlan` -- plan once per step, run
  once per layer; :func:`workspace_bytes` sizes a caller-owned workspace;
* :func:`merge_state` / :func:`merge_states` -- the exact LSE merge of
  attention states;
* :func:`can_handle` / :func:`decline_reason` -- the gate;
* :func:`choose_n_splits` -- the split chooser;
* :func:`check_device_errors`, :func:`raise_pending_faults` and
  :class:`VerifyError` -- faults the kernels reported (:mod:`splitkv.errors`);
* :class:`VerifyOptions` -- the options every entry takes (:mod:`splitkv.options`);
* :func:`get_runner`, :func:`clear_caches` -- the entries' caches;
* :func:`extend_attention_fwd` -- the baseline prefill/extend kernel.

Problem builders, model shapes and the float64 oracle are in
:mod:`splitkv.testing`.
"""

import os as _os

import torch as _torch

if not _torch.cuda.is_available():
    # Without a CUDA device Triton kernels run only through its interpreter,
    # which triton.jit selects when a kernel is defined: choose it before any
    # kernel module is imported. An explicit TRITON_INTERPRET wins.
    _os.environ.setdefault("TRITON_INTERPRET", "1")

from .api import clear_caches, get_runner, verify_attention, verify_splitkv_fwd  # noqa: E402
from .errors import VerifyError, check_device_errors, raise_pending_faults  # noqa: E402
from .extend import extend_attention_fwd  # noqa: E402
from .gate import can_handle, decline_reason  # noqa: E402
from .merge import merge_state, merge_states  # noqa: E402
from .options import VerifyOptions  # noqa: E402
from .ops import merge_states_op, verify_attention_op  # noqa: E402
from .plan import VerifyPlan, VerifySplitKV  # noqa: E402
from .schedule import choose_n_splits, workspace_bytes  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "verify_splitkv_fwd",
    "verify_attention",
    "get_runner",
    "can_handle",
    "decline_reason",
    "choose_n_splits",
    "VerifySplitKV",
    "VerifyPlan",
    "workspace_bytes",
    "merge_state",
    "merge_states",
    "verify_attention_op",
    "merge_states_op",
    "clear_caches",
    "check_device_errors",
    "raise_pending_faults",
    "VerifyOptions",
    "VerifyError",
    "extend_attention_fwd",
]
