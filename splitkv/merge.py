"""Merging attention states: the exact LSE merge as a public primitive.

An *attention state* over a set of keys is the pair ``(v, s)``: ``v`` the
softmax-weighted mean of the values, ``s = log sum_j exp(score_j)`` its
natural-log log-sum-exp. Attention over the union of disjoint key sets is the
LSE-weighted mean of their states::

    s = log sum_i exp(s_i)          v = sum_i exp(s_i - s) * v_i

exact, associative and commutative. A state over no key at all has
``s = -inf`` and weighs 0 (its ``v`` is never read); if every state is empty
the result is ``v = 0``, ``s = -inf``.

This is the identity the verify kernel uses between prefix slices
(:mod:`splitkv.kernels.verify`), and what a caller uses to join states computed
elsewhere: on other GPUs (:mod:`splitkv.parallel`), over a cascade of shared
and private prefixes, or by another kernel. The arguments follow FlashInfer's
``merge_state`` / ``merge_states`` (``v [tokens, heads, dim]``, ``s [tokens,
heads]`` float32), with LSEs in natural log, as
:func:`splitkv.verify_attention` returns them with ``return_lse=True``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton

from .kernels.merge import _merge_states_kernel
from .resources import next_pow2

__all__ = ["merge_state", "merge_states"]


def merge_states(
    v: torch.Tensor, s: torch.Tensor, *, out: Optional[torch.Tensor] = None, out_lse: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge ``n`` attention states per (token, head) into one.

    Args:
        v: ``[tokens, n, heads, dim]`` outputs over ``n`` disjoint key sets
            (any strides with a unit last one; float16/bfloat16/float32).
        s: ``[tokens, n, heads]`` their natural-log LSEs (float32; ``-inf``
            for a state over no key).
        out: optional ``[tokens, heads, dim]`` output (default: new, ``v``'s dtype).
        out_lse: optional ``[tokens, heads]`` float32 for the merged LSE.

    Returns:
        ``(v_merged, s_merged)``.

    Raises:
        ValueError: on mismatched shapes, devices or dtypes.
    """
    if v.dim() != 4 or s.dim() != 3 or tuple(s.shape) != tuple(v.shape[:3]):
        raise ValueError(f"need v [tokens, n, heads, dim] and s [tokens, n, heads], got {tuple(v.shape)}, "
                         f"{tuple(s.shape)}")
    if s.dtype != torch.float32:
        raise ValueError(f"s must be float32, got {s.dtype}")
    if v.device != s.device:
        raise ValueError("v and s must be on one device")
    if v.stride(3) != 1 and v.shape[3] > 1:
        raise ValueError("v must have a unit stride in its last dimension")
    n_tok, n, heads, dim = v.shape
    if out is None:
        out = torch.empty((n_tok, heads, dim), dtype=v.dtype, device=v.device)
    if out_lse is None:
        out_lse = torch.empty((n_tok, heads), dtype=torch.float32, device=v.device)
    if out.shape != (n_tok, heads, dim) or out.stride(2) != 1 or out.device != v.device:
        raise ValueError(f"out must be [{n_tok}, {heads}, {dim}] on {v.device} with a unit last stride")
    if out_lse.shape != (n_tok, heads) or not out_lse.is_contiguous() or out_lse.dtype != torch.float32:
        raise ValueError(f"out_lse must be a contiguous float32 [{n_tok}, {heads}]")
    if n_tok == 0 or heads == 0:
        return out, out_lse
    block_d = min(next_pow2(dim), 256)
    grid = (n_tok, heads, triton.cdiv(dim, block_d))
    _merge_states_kernel[grid](
        v, s, out, out_lse, n,
        v.stride(0), v.stride(1), v.stride(2),
        s.stride(0), s.stride(1), s.stride(2),
        out.stride(0), out.stride(1),
        HEAD_DIM=dim, BLOCK_D=block_d, WRITE_S=True,
    )
    return out, out_lse


def merge_state(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states: attention over the keys of ``a`` and of ``b``.

    Args:
        v_a: ``[tokens, heads, dim]`` output over key set A.
        s_a: ``[tokens, heads]`` its natural-log LSE (float32).
        v_b: ``[tokens, heads, dim]`` output over key set B (disjoint from A).
        s_b: ``[tokens, heads]`` its natural-log LSE (float32).

    Returns:
        ``(v, s)`` over A and B together.
    """
    if v_a.shape != v_b.shape or s_a.shape != s_b.shape:
        raise ValueError("the two states must have equal shapes")
    return merge_states(torch.stack([v_a, v_b], 1), torch.stack([s_a, s_b], 1))
