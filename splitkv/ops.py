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

import typing
from typing import Tuple

import torch

from .api import verify_attention
from .merge import merge_states
from .options import METADATA, TENSORS, VerifyOptions, option_types

__all__ = ["verify_attention_op", "merge_states_op", "VERIFY_SCHEMA"]

Tensor = torch.Tensor

_REQUIRED = object()

#: The schema's type of each kind of option (``check`` is a bool in a compiled graph: see the module docstring).
_SCHEMA_TYPES = {int: "int", float: "float", bool: "bool"}


def _schema_type(name: str, annotation) -> str:
    """A :class:`~splitkv.options.VerifyOptions` field's type in a ``torch.library`` schema."""
    if name == "check":
        return "bool"
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if args:  # Optional[X]
        return _SCHEMA_TYPES[args[0]] + "?"
    return _SCHEMA_TYPES[annotation]


def _verify_schema() -> str:
    """The op's schema, derived from the option list: the tensors (without ``o_extend``), the optional
    metadata tensors (positional: custom ops take no keyword-only tensors; every caller names them),
    then every option as a keyword with its default (``check``'s is ``True``, as for
    :func:`splitkv.verify_attention`)."""
    tensors = [f"Tensor {name}" for name in TENSORS if name != "o_extend"]
    tensors += [f"Tensor? {name}=None" for name in METADATA]
    types = option_types()
    keywords = []
    for name in VerifyOptions._fields:
        default = True if name == "check" else VerifyOptions._field_defaults.get(name, _REQUIRED)
        written = "" if default is _REQUIRED else f"={default}"
        keywords.append(f"{_schema_type(name, types[name])} {name}{written}")
    return f"({', '.join(tensors)}, *, {', '.join(keywords)}) -> (Tensor, Tensor)"


#: ``torch.ops.splitkv.verify_attention``'s schema.
VERIFY_SCHEMA = _verify_schema()


def _verify(*args, **options) -> Tuple[Tensor, Tensor]:
    tensors = dict(zip([n for n in TENSORS if n != "o_extend"] + list(METADATA), args))
    q, k, v, kb, vb, qo, kvp, kvi = (tensors.pop(n) for n in TENSORS if n != "o_extend")
    result = verify_attention(q, k, v, None, kb, vb, qo, kvp, kvi, **tensors, **options)
    if options.get("return_lse", False):
        return result
    return result, q.new_empty((0,), dtype=torch.float32)


_verify_attention = torch.library.custom_op("splitkv::verify_attention", _verify, mutates_args=(),
                                            schema=VERIFY_SCHEMA)


@_verify_attention.register_fake
def _(q_extend, k_extend, v_extend, *args, return_lse=False, **_):
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
