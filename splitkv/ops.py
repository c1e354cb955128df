"""Custom operators, so that ``torch.compile`` sees verify attention as one op.

``torch.compile`` cannot trace into a Triton launch wrapped in Python caches
and per-stream state; a ``torch.library`` custom op is opaque to it instead:
the compiled graph calls the op, and a *fake* implementation tells the
compiler the output shapes and dtypes without running anything. So a model's
forward compiles with ``fullgraph=True`` (no graph break), and
``mode="reduce-overhead"`` captures the op's launches in a CUDA graph like any
other kernel. :func:`splitkv.verify_attention` calls the op by itself while
being compiled: a model calls the same function eager or compiled.

* ``torch.ops.splitkv.verify_attention(q_extend, k_extend, v_extend, k_buffer,
  v_buffer, qo_indptr, kv_indptr, kv_indices, *, max_len_extend, ...) -> (out,
  lse)``: :func:`splitkv.verify_attention` with the same keywords (``check`` a
  bool: a compiled graph runs the kernel's checks, whose faults are raised by
  the next eager checked call or :func:`splitkv.check_device_errors`); ``lse``
  is ``[tokens, H_Q]`` float32 with ``return_lse``, else an empty tensor.
* ``torch.ops.splitkv.merge_states(v, s) -> (v_merged, s_merged)``:
  :func:`splitkv.merge_states`.

Both are functional (they return new tensors and mutate nothing), which is
what the compiler handles best. The op runs the one-launch design: its
counters come from an arena made outside any CUDA-graph memory pool, and each
captured launch gets counters of its own (see :func:`splitkv.workspace.counters`).
The Python wrappers :func:`verify_attention_op` and :func:`merge_states_op`
take the same arguments; called eagerly they skip the dispatcher and run
the implementation directly.

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


def _verify(
    q_extend: Tensor,
    k_extend: Tensor,
    v_extend: Tensor,
    k_buffer: Tensor,
    v_buffer: Tensor,
    qo_indptr: Tensor,
    kv_indptr: Tensor,
    kv_indices: Tensor,
    # The optional tensors are positional in the schema (custom ops take no keyword-only tensors);
    # every caller names them.
    custom_mask: Optional[Tensor] = None,
    mask_indptr: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    window_kv_offsets: Optional[Tensor] = None,
    kv_last_page_len: Optional[Tensor] = None,
    *,
    max_len_extend: int,
    is_causal: bool = True,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sm_scale: Optional[float] = None,
    logit_cap: float = 0.0,
    skip_prefix_custom_mask: bool = True,
    sliding_window_size: int = -1,
    xai_temperature_len: int = -1,
    split_tokens: Optional[int] = None,
    max_prefix_len: Optional[int] = None,
    check: bool = True,
    return_lse: bool = False,
) -> Tuple[Tensor, Tensor]:
    result = verify_attention(
        q_extend, k_extend, v_extend, None, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
        max_len_extend=max_len_extend, custom_mask=custom_mask, mask_indptr=mask_indptr, is_causal=is_causal,
        k_scale=k_scale, v_scale=v_scale, sm_scale=sm_scale, logit_cap=logit_cap,
        skip_prefix_custom_mask=skip_prefix_custom_mask, sliding_window_size=sliding_window_size, sinks=sinks,
        window_kv_offsets=window_kv_offsets, xai_temperature_len=xai_temperature_len,
        kv_last_page_len=kv_last_page_len, split_tokens=split_tokens, max_prefix_len=max_prefix_len,
        check=check, return_lse=return_lse,
    )
    if return_lse:
        return result
    return result, q_extend.new_empty((0,), dtype=torch.float32)


_verify_attention = torch.library.custom_op("splitkv::verify_attention", _verify, mutates_args=())


@_verify_attention.register_fake
def _(q_extend, k_extend, v_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask=None,
      mask_indptr=None, sinks=None, window_kv_offsets=None, kv_last_page_len=None, *, max_len_extend,
      return_lse=False, **_):
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


def verify_attention_op(q_extend, k_extend, v_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, *,
                        max_len_extend, return_lse=False, **options):
    """``torch.ops.splitkv.verify_attention``; returns ``out``, or ``(out, lse)`` with ``return_lse``.

    Takes :func:`splitkv.verify_attention`'s keywords (``check`` a bool). Eager calls run the
    implementation directly (the dispatcher costs tens of microseconds a call); compiled ones the op.
    """
    if not torch.compiler.is_compiling():
        return verify_attention(q_extend, k_extend, v_extend, None, k_buffer, v_buffer, qo_indptr, kv_indptr,
                                kv_indices, max_len_extend=max_len_extend, return_lse=return_lse, **options)
    out, lse = torch.ops.splitkv.verify_attention(q_extend, k_extend, v_extend, k_buffer, v_buffer, qo_indptr,
                                                  kv_indptr, kv_indices, max_len_extend=max_len_extend,
                                                  return_lse=return_lse, **options)
    return (out, lse) if return_lse else out


def merge_states_op(v, s):
    """``torch.ops.splitkv.merge_states``: see :func:`splitkv.merge_states`."""
    return torch.ops.splitkv.merge_states(v, s)
