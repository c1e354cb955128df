"""The float64 oracle: verify (extend) attention written the plain way.

One sequence at a time, gather the prefix K/V out of the token pool, build the
full score matrix ``[H_Q, L, prefix + L]`` in float64, mask it, softmax it,
multiply by V. Nothing here is fast; everything here is obvious. Tests,
notebooks and the benchmark compare every kernel against it.

Semantics (those of SGLang's ``extend_attention_fwd``):

* prefix scores are ``q.k * sm_scale * k_scale``, prefix values ``v * v_scale``;
  draft scores ``q.k * sm_scale``, draft values unscaled;
* ``logit_cap > 0`` maps every score ``s`` to ``cap * tanh(s / cap)``;
* ``xai_temperature_len > 0`` multiplies the scores of the query at absolute
  position ``p > len`` by ``log2(p) / log2(len)``;
* draft visibility: ``custom_mask`` if given (row-major ``[L, prefix + L]``
  per sequence at ``mask_indptr[b]``, also applied to the prefix unless
  ``skip_prefix_custom_mask``), else causal if ``is_causal``, else all;
* ``sliding_window_size = W > 0``: the query at absolute position ``p`` sees
  keys at positions ``>= p - W``;
* ``sinks[h]`` adds ``exp(sinks[h])`` to the softmax denominator of head ``h``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .problem import VerifyProblem

__all__ = ["reference_attention", "reference_for", "relative_error", "TOLERANCE", "ROW_TOLERANCE"]

#: Relative-error budgets ``||out - ref|| / ||ref||`` against the float64 oracle, per dtype of
#: the inputs: float32 keeps about 7 digits, float16 about 3, bfloat16 about 2.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}

#: Budgets for the worst single row (max over (token, head) of ``||out_row - ref_row|| /
#: ||ref_row||``): a row that misses or double-counts a slice is off by far more, so one
#: wrong row fails even where the global norm hides it.
ROW_TOLERANCE = {torch.float32: 5e-4, torch.float16: 5e-3, torch.bfloat16: 4e-2}


def reference_attention(
    q_extend: torch.Tensor,
    k_extend: torch.Tensor,
    v_extend: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    custom_mask: Optional[torch.Tensor] = None,
    is_causal: bool = True,
    mask_indptr: Optional[torch.Tensor] = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sm_scale: Optional[float] = None,
    logit_cap: float = 0.0,
    skip_prefix_custom_mask: bool = True,
    sliding_window_size: int = -1,
    sinks: Optional[torch.Tensor] = None,
    window_kv_offsets: Optional[torch.Tensor] = None,
    xai_temperature_len: int = -1,
    return_lse: bool = False,
):
    """Float64 verify attention, the semantics of the module docstring.

    Takes ``extend_attention_fwd``'s arguments (without ``o_extend`` and
    ``max_len_extend``), with the same meaning.

    Returns:
        ``[tokens, H_Q, Dv]`` float64; with ``return_lse=True`` also the
        natural-log log-sum-exp of the (scaled, masked) scores, ``[tokens,
        H_Q]`` (sinks included). Rows with no visible key are NaN.
    """
    f64 = torch.float64
    n_tok, h_q, d = q_extend.shape
    h_kv = k_extend.shape[1]
    group = h_q // h_kv
    if not sm_scale:  # None or 0, as extend_attention_fwd reads it
        sm_scale = 1.0 / math.sqrt(d)
    qo = qo_indptr.tolist()
    kv = kv_indptr.tolist()
    out = torch.full((n_tok, h_q, v_extend.shape[2]), float("nan"), dtype=f64, device=q_extend.device)
    lse_out = torch.full((n_tok, h_q), float("nan"), dtype=f64, device=q_extend.device)

    for b in range(len(qo) - 1):
        q0, q1, k0, k1 = qo[b], qo[b + 1], kv[b], kv[b + 1]
        n_ext, n_pre = q1 - q0, k1 - k0
        if n_ext == 0:
            continue
        slots = kv_indices[k0:k1].long()
        # Keys of this sequence: [prefix | drafts], each [N, H_KV, D] -> per q head.
        k_all = torch.cat([k_buffer[slots].to(f64), k_extend[q0:q1].to(f64)])
        v_all = torch.cat([v_buffer[slots].to(f64) * v_scale, v_extend[q0:q1].to(f64)])
        k_all = k_all.repeat_interleave(group, dim=1)  # [N, H_Q, D]
        v_all = v_all.repeat_interleave(group, dim=1)
        q = q_extend[q0:q1].to(f64)  # [L, H_Q, D]

        scores = torch.einsum("lhd,nhd->hln", q, k_all) * sm_scale
        scores[:, :, :n_pre] *= k_scale
        if logit_cap > 0:
            scores = logit_cap * torch.tanh(scores / logit_cap)
        q_pos = n_pre + torch.arange(n_ext, device=q.device)  # absolute positions
        if xai_temperature_len > 0:
            temp = torch.where(
                q_pos > xai_temperature_len,
                torch.log2(q_pos.to(f64)) / math.log2(xai_temperature_len),
                torch.ones((), dtype=f64, device=q.device),
            )
            scores = scores * temp[None, :, None]

        visible = _visible(b, n_pre, n_ext, q_pos, custom_mask, mask_indptr, window_kv_offsets,
                           skip_prefix_custom_mask, is_causal, sliding_window_size)
        scores = scores.masked_fill(~visible[None], float("-inf"))
        logits = scores
        if sinks is not None:
            sink = sinks.to(f64)[:, None, None].expand(h_q, n_ext, 1)
            logits = torch.cat([scores, sink], dim=2)
        lse = torch.logsumexp(logits, dim=2)  # [H_Q, L]
        probs = torch.exp(scores - lse[:, :, None])
        out[q0:q1] = torch.einsum("hln,nhd->lhd", probs, v_all)
        lse_out[q0:q1] = lse.transpose(0, 1)
    return (out, lse_out) if return_lse else out


def _visible(b, n_pre, n_ext, q_pos, custom_mask, mask_indptr, window_kv_offsets, skip_prefix_custom_mask,
             is_causal, sliding_window_size) -> torch.Tensor:
    """Which keys ``[prefix | drafts]`` each of sequence ``b``'s draft rows sees: ``[n_ext, n_pre + n_ext]``."""
    device = q_pos.device
    visible = torch.ones(n_ext, n_pre + n_ext, dtype=torch.bool, device=device)
    if custom_mask is not None:
        offset = 0 if window_kv_offsets is None else int(window_kv_offsets[b])
        m0 = int(mask_indptr[b])
        width = n_pre + n_ext + offset
        rows = custom_mask[m0 : m0 + n_ext * width].view(n_ext, width)[:, offset:].bool()
        if skip_prefix_custom_mask:
            visible[:, n_pre:] = rows[:, n_pre:]
        else:
            visible = rows.clone()
    elif is_causal:
        visible[:, n_pre:] = torch.tril(visible[:, n_pre:])
    if sliding_window_size is not None and sliding_window_size > 0:
        k_pos = torch.arange(n_pre + n_ext, device=device)
        visible &= q_pos[:, None] <= k_pos[None, :] + sliding_window_size
    return visible


def reference_for(problem: VerifyProblem, **overrides):
    """:func:`reference_attention` of a :class:`~splitkv.testing.VerifyProblem`.

    Args:
        problem: the problem.
        **overrides: keyword arguments of :func:`reference_attention` to change
            (``logit_cap=...``, ``return_lse=True``, ...).

    Returns:
        What :func:`reference_attention` returns.
    """
    p = problem
    kwargs = dict(
        custom_mask=p.custom_mask,
        is_causal=p.is_causal,
        mask_indptr=p.mask_indptr,
        k_scale=p.k_scale,
        v_scale=p.v_scale,
        sm_scale=p.sm_scale,
        sinks=p.sinks,
    )
    kwargs.update(overrides)
    return reference_attention(
        p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer,
        p.qo_indptr, p.kv_indptr, p.kv_indices, **kwargs,
    )


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64.

    Args:
        out: the result to judge (any dtype and device).
        ref: the reference.

    Returns:
        The relative error, or ``inf`` if ``out`` holds NaN or inf.
    """
    out = out.to(torch.float64)
    ref = ref.to(device=out.device, dtype=torch.float64)
    if not torch.isfinite(out).all():
        return float("inf")
    return (torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref)).item()
