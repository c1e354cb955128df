"""Custom operators, so that ``torch.compile`` sees verify attention as one op.

``torch.compile`` cannot trace into a Triton launch wrapped in Python caches
and per-stream state; a ``torch.library`` custom op is opaque to it instead:
the compiled graph calls the op, and a *fake* implementation tells the
compiler the output shapes and dtypes without running anything. So a model's
forward that calls these ops compiles with ``fullgraph=True`` (no graph
break), and ``mode="reduce-overhead"`` captures the op's launch in a CUDA
graph like any other kernel.

* ``torch.ops.splitkv.verify_attention(q_extend, k_extend, v_extend, k_buffer,
  v_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, sinks,
  is_causal, max_len_extend, sm_scale, k_scale, v_scale, split_tokens,
  return_lse, kv_last_page_len, window_kv_offsets, logit_cap,
  sliding_window_size, xai_temperature_len) -> (out, lse)``:
  :func:`splitkv.verify_attention` without the value checks (a compiled graph
  must not read the device); ``lse`` is ``[tokens, H_Q]`` float32 with
  ``return_lse``, else an empty tensor. ``split_tokens = 0`` means adaptive
  slices; ``kv_last_page_len`` makes the pools paged; the score features are
  off at ``0`` / ``-1``.
* ``torch.ops.splitkv.merge_states(v, s) -> (v_merged, s_merged)``:
  :func:`splitkv.merge_states`.

Both are functional (they return new tensors and mutate nothing), which is
what the compiler handles best. The op always merges in a second launch
(``one_launch=False``): the one-launch merge keeps per-stream counters alive
between calls, and ``torch.compile``'s CUDA-graph trees refuse memory that
outlives a graph without being one of its outputs. The Python wrappers :func:`verify_attention_op`
and :func:`merge_states_op` take the same arguments with defaults.

Dynamic shapes: the fake implementation's output shapes depend only on
``q_extend`` and ``v_extend``, never on ``kv_indices``, so a growing prefix
does not change the compiled graph; mark ``kv_indices`` dynamic
(``torch._dynamo.mark_dynamic(kv_indices, 0)``) or pad it to a fixed size, as
CUDA-graph engines do, to avoid even the one recompilation that automatic
dynamic shapes makes when a size first changes.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .api import verify_attention
from .merge import merge_states

__all__ = ["verify_attention_op", "merge_states_op"]

Tensor = torch.Tensor


@torch.library.custom_op("splitkv::verify_attention", mutates_args=())
def _verify_attention(
    q_extend: Tensor,
    k_extend: Tensor,
    v_extend: Tensor,
    k_buffer: Tensor,
    v_buffer: Tensor,
    qo_indptr: Tensor,
    kv_indptr: Tensor,
    kv_indices: Tensor,
    custom_mask: Optional[Tensor],
    mask_indptr: Optional[Tensor],
    sinks: Optional[Tensor],
    is_causal: bool,
    max_len_extend: int,
    sm_scale: Optional[float],
    k_scale: float,
    v_scale: float,
    split_tokens: int,
    return_lse: bool,
    kv_last_page_len: Optional[Tensor] = None,
    window_kv_offsets: Optional[Tensor] = None,
    logit_cap: float = 0.0,
    sliding_window_size: int = -1,
    xai_temperature_len: int = -1,
) -> Tuple[Tensor, Tensor]:
    result = verify_attention(
        q_extend, k_extend, v_extend, None, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
        custom_mask, is_causal, mask_indptr, max_len_extend, k_scale, v_scale, sm_scale=sm_scale,
        sinks=sinks, split_tokens=split_tokens or None, check=False, return_lse=return_lse, one_launch=False,
        kv_last_page_len=kv_last_page_len, window_kv_offsets=window_kv_offsets, logit_cap=logit_cap,
        sliding_window_size=sliding_window_size, xai_temperature_len=xai_temperature_len,
    )
    if return_lse:
        return result
    return result, q_extend.new_empty((0,), dtype=torch.float32)


@_verify_attention.register_fake
def _(q_extend, k_extend, v_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask,
      mask_indptr, sinks, is_causal, max_len_extend, sm_scale, k_scale, v_scale, split_tokens, return_lse,
      kv_last_page_len=None, window_kv_offsets=None, logit_cap=0.0, sliding_window_size=-1,
      xai_temperature_len=-1):
    out = q_extend.new_empty((q_extend.shape[0], q_extend.shape[1], v_extend.shape[2]))
    lse_shape = (q_extend.shape[0], q_extend.shape[1]) if return_lse else (0,)
    return out, q_extend.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("splitkv::merge_states", mutates_args=())
def _merge_states(v: Tensor, s: Tensor) -> Tuple[Tensor, Tensor]:
    return merge_states(v, s)


@_merge_states.register_fake
def _(v, s):
    return (v.new_empty((v.shape[0], v.shape[2], v.shape[3])),
            s.new_empty((s.shape[0], s.shape[2])))


def verify_attention_op(
    q_extend, k_extend, v_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
    custom_mask=None, mask_indptr=None, is_causal=True, max_len_extend=4, *,
    sinks=None, sm_scale=None, k_scale=1.0, v_scale=1.0, split_tokens=None, return_lse=False,
    kv_last_page_len=None, window_kv_offsets=None, logit_cap=0.0, sliding_window_size=-1, xai_temperature_len=-1,
):
    """``torch.ops.splitkv.verify_attention`` with defaults; returns ``out`` or ``(out, lse)``.

    Takes :func:`splitkv.verify_attention`'s keywords, paged pools
    (``kv_last_page_len``) and score features included.
    """
    out, lse = torch.ops.splitkv.verify_attention(
        q_extend, k_extend, v_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
        custom_mask, mask_indptr, sinks, bool(is_causal), int(max_len_extend),
        None if sm_scale is None else float(sm_scale), float(k_scale), float(v_scale),
        int(split_tokens or 0), bool(return_lse), kv_last_page_len, window_kv_offsets, float(logit_cap or 0.0),
        int(sliding_window_size if sliding_window_size is not None else -1),
        int(xai_temperature_len if xai_temperature_len is not None else -1),
    )
    return (out, lse) if return_lse else out


def merge_states_op(v, s):
    """``torch.ops.splitkv.merge_states``: see :func:`splitkv.merge_states`."""
    return torch.ops.splitkv.merge_states(v, s)
