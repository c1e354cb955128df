"""splitkv in SGLang's Triton attention backend (written against SGLang 0.5.10.post1).

``TritonAttnBackend.forward_extend`` serves prefill, target-verify and
draft-extend. It stores the step's K/V in the pool (with the layer's fp8
scales), picks the sliding-window metadata on sliding-window layers, passes
``k_scale``/``v_scale`` of 1.0 on unquantised layers, and then makes one call,
``self.extend_attention_fwd(...)``. :func:`install` puts the split path in
front of that call on the speculative steps::

    from splitkv.integrations.sglang import install

    install(model_runner.attn_backend, max_bs=model_runner.req_to_token_pool.size)

Everything else stays SGLang's: the stores, the metadata, prefill, and the
deterministic mode (its own kernel, ``extend_attention_fwd_unified``). A call
the split path declines goes to SGLang's kernel with the arguments SGLang
built, untouched.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..api import verify_splitkv_fwd

__all__ = ["SGLANG_VERSION", "SplitKVFirst", "install", "speculative"]

#: The SGLang release this module was written and tested against.
SGLANG_VERSION = "0.5.10.post1"


def speculative(forward_mode) -> bool:
    """Whether a forward pass is a speculative step the split path is for: target-verify or draft-extend."""
    return forward_mode.is_target_verify() or forward_mode.is_draft_extend(include_v2=True)


class SplitKVFirst:
    """SGLang's ``extend_attention_fwd`` with the split path in front of it.

    Called with ``extend_attention_fwd``'s arguments. While :attr:`active`
    (set by the ``forward_extend`` that :func:`install` wraps, for one
    speculative step's call), :func:`splitkv.verify_splitkv_fwd` gets them
    first; otherwise, or when it declines, SGLang's kernel gets them as they are.

    Attributes:
        sglang_kernel: the kernel the backend had (SGLang's ``extend_attention_fwd``).
        max_bs: passed to :func:`splitkv.verify_splitkv_fwd`.
        active: whether the call in progress is a speculative step's.
    """

    def __init__(self, sglang_kernel: Callable, max_bs: Optional[int] = None):
        self.sglang_kernel = sglang_kernel
        self.max_bs = max_bs
        self.active = False

    @torch.compiler.disable  # a kernel launch, as SGLang's own: not for torch.compile to trace
    def __call__(self, *args, **kwargs) -> None:
        if not (self.active and verify_splitkv_fwd(*args, **kwargs, max_bs=self.max_bs)):
            self.sglang_kernel(*args, **kwargs)


def install(backend, max_bs: Optional[int] = None) -> SplitKVFirst:
    """Put the split path in front of a ``TritonAttnBackend``'s extend kernel, for its speculative steps.

    Args:
        backend: SGLang's ``TritonAttnBackend`` (the target model's for
            target-verify, the draft model's for draft-extend).
        max_bs: the largest batch the backend runs (``req_to_token_pool.size``): the gate checks
            CUDA's launch limits against it. ``None``: each call's batch.

    Returns:
        The :class:`SplitKVFirst` now at ``backend.extend_attention_fwd`` (installing twice returns it again).
    """
    if isinstance(backend.extend_attention_fwd, SplitKVFirst):
        return backend.extend_attention_fwd
    kernel = SplitKVFirst(backend.extend_attention_fwd, max_bs)
    forward_extend = backend.forward_extend

    def forward_extend_split_first(q, k, v, layer, forward_batch, *args, **kwargs):
        kernel.active = speculative(forward_batch.forward_mode)
        try:
            return forward_extend(q, k, v, layer, forward_batch, *args, **kwargs)
        finally:
            kernel.active = False

    backend.extend_attention_fwd = kernel
    backend.forward_extend = forward_extend_split_first
    return kernel
