"""The implementations the verify benchmark compares, each as a zero-argument callable.

* ``splitkv``  -- this package's drop-in (GQA-packed split-KV, adaptive splits);
* ``splitkv_invariant`` -- the same with ``split_tokens=1024`` (and
  ``max_prefix_len`` the row's prefix): fixed-size splits, so a sequence's
  output does not depend on its batch;
* ``seed``     -- the seed's layout: one program per query head, fixed 4/8/16
  splits by prefix length, 32-key tiles, no pipelining (same kernels, other
  launch parameters);
* ``extend``   -- the baseline prefill kernel :func:`splitkv.extend.extend_attention_fwd`;
* ``flex``     -- ``torch.compile(flex_attention)`` (its decode path) with a
  block mask, on a dense copy of each sequence's KV (the copy is not timed);
* ``sdpa``     -- ``torch.nn.functional.scaled_dot_product_attention`` with a
  boolean mask, on the same dense copy.

fp8 pools (:func:`fp8_problem`) are read by ``splitkv``, ``splitkv_invariant``
and ``extend`` only (:data:`FP8_IMPLEMENTATIONS`); the others have no fp8 pool.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..api import verify_splitkv_fwd
from ..extend import extend_attention_fwd
from ..plan import VerifySplitKV
from ..schedule import TileConfig
from ..testing.problem import VerifyProblem

__all__ = [
    "EAGER_IMPLS",
    "FP8_IMPLEMENTATIONS",
    "HOST_IMPLS",
    "HOST_MAX_GRAPH_US",
    "IMPLEMENTATIONS",
    "IMPL_HELP",
    "INVARIANT_SPLIT_TOKENS",
    "declined_message",
    "fp8_problem",
    "make_impl",
    "skip_reason",
]

#: The implementations timed, in table order.
IMPLEMENTATIONS = ("splitkv", "splitkv_invariant", "seed", "extend", "flex", "sdpa")
#: One line per implementation (``--help``, the JSON record).
IMPL_HELP = {
    "splitkv": "this package's drop-in verify_splitkv_fwd (GQA-packed split-KV, adaptive splits)",
    "splitkv_invariant": "the same with split_tokens=1024 (fixed-size splits: batch-invariant output)",
    "seed": "the seed's layout on the same kernels: a program per query head, 4/8/16 splits, 32-key tiles",
    "extend": "the baseline prefill kernel extend_attention_fwd (one program per query tile and head)",
    "flex": "torch.compile(flex_attention) with a block mask, on a dense K/V copy (copy not timed)",
    "sdpa": "torch scaled_dot_product_attention with a boolean mask, on the same dense copy",
}
#: The implementations that read an fp8 pool.
FP8_IMPLEMENTATIONS = ("splitkv", "splitkv_invariant", "extend")
#: fp8 rows' dequantisation scales (Python floats): pool = bf16 pool / scale.
FP8_K_SCALE, FP8_V_SCALE = 0.5, 2.0
#: ``split_tokens`` of the batch-invariant implementation.
INVARIANT_SPLIT_TOKENS = 1024
#: Implementations also timed eagerly with do_bench (every one).
EAGER_IMPLS = IMPLEMENTATIONS
#: Implementations whose host time per eager call is measured.
HOST_IMPLS = ("splitkv", "extend", "flex", "sdpa")
#: Peers' host time is measured only where a call's graph time is below this
#: (µs): above it 1000 calls cost seconds and time the GPU, not the host.
HOST_MAX_GRAPH_US = 500.0
#: FlexAttention's Triton template fails to compile (32-bit offsets) with a
#: dense K of 2^31 elements or more (llama3-8b and qwen3-32b at batch 32 x 64k
#: on an H200): such shapes are skipped for flex.
FLEX_MAX_ELEMENTS = 2**31


def seed_n_splits(prefix_len: int) -> int:
    """The seed's split rule: 4 below 4k tokens, 8 below 8k, else 16."""
    return 4 if prefix_len < 4096 else 8 if prefix_len < 8192 else 16


def fp8_problem(p: VerifyProblem, k_scale: float = FP8_K_SCALE, v_scale: float = FP8_V_SCALE) -> VerifyProblem:
    """The same problem with an fp8 (e4m3) pool: ``pool / scale``, dequantised by ``scale``.

    Queries, draft K/V and outputs stay in ``p``'s dtype. The dequantised pool
    approximates ``p``'s, so the fp8 output is comparable with the bf16 one.
    (Cast on the device: drawing a second pool on the host would double the
    sweep's set-up time.)
    """
    fp8 = torch.float8_e4m3fn
    return p.replace(
        k_buffer=(p.k_buffer / k_scale).to(fp8),
        v_buffer=(p.v_buffer / v_scale).to(fp8),
        k_scale=float(k_scale),
        v_scale=float(v_scale),
    )


def _dense_kv(p: VerifyProblem):
    """Each sequence's [prefix | drafts] K and V as dense [B, H_KV, S, D] (equal prefixes)."""
    bs, n_pre, n_ext = p.batch_size, p.prefix_lens[0], p.extend_lens[0]
    slots = p.kv_indices.long().view(bs, n_pre)
    k = torch.cat([p.k_buffer[slots], p.k_extend.view(bs, n_ext, *p.k_extend.shape[1:])], 1)
    v = torch.cat([p.v_buffer[slots], p.v_extend.view(bs, n_ext, *p.v_extend.shape[1:])], 1)
    return k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()


def _draft_visibility(n_pre: int, n_ext: int, device) -> torch.Tensor:
    """[L, prefix + L] bool: the whole prefix, then the causal draft block."""
    vis = torch.ones(n_ext, n_pre + n_ext, dtype=torch.bool, device=device)
    vis[:, n_pre:] = torch.tril(vis[:, n_pre:])
    return vis


def skip_reason(name: str, p: VerifyProblem) -> Optional[str]:
    """Why implementation ``name`` is not run on ``p`` (``None``: it is)."""
    if name == "flex":
        dense = p.batch_size * p.num_kv_heads * (p.prefix_lens[0] + p.extend_lens[0]) * p.head_dim
        if dense >= FLEX_MAX_ELEMENTS:
            return (f"dense K of {dense / 2**30:.1f} Gi elements: flex's Triton template fails to compile "
                    "at >= 2^31 (32-bit offsets)")
    return None


def make_impl(name: str, p: VerifyProblem, out: torch.Tensor, dense: Optional[dict] = None) -> Callable:
    """A zero-argument callable running implementation ``name``, writing ``out``.

    The drop-in implementations return ``verify_splitkv_fwd``'s result
    (``False``: declined, nothing written); the others return ``None``.
    ``dense`` caches the dense K/V copy that ``flex`` and ``sdpa`` share.
    """
    args, kw = p.args(out), p.kwargs()
    if name == "splitkv":
        return lambda: verify_splitkv_fwd(*args, **kw, max_bs=p.batch_size)
    if name == "splitkv_invariant":
        return lambda: verify_splitkv_fwd(*args, **kw, max_bs=p.batch_size, split_tokens=INVARIANT_SPLIT_TOKENS,
                                          max_prefix_len=max(p.prefix_lens))
    if name == "seed":
        seed = VerifySplitKV(
            p.num_q_heads, p.num_kv_heads, p.head_dim, p.v_head_dim, p.max_len_extend,
            p.batch_size, out.device, pack_gqa=False, n_splits=seed_n_splits(p.prefix_lens[0]),
            config=TileConfig(16, 32, 4, 1),
        )
        return lambda: seed(*args[:9], sm_scale=p.sm_scale)
    if name == "extend":
        return lambda: extend_attention_fwd(*args, **kw)
    if name not in ("flex", "sdpa"):
        raise ValueError(f"unknown implementation {name!r}")
    # The dense peers: [B, H, S, D] views of a dense copy of each sequence's KV.
    dense = {} if dense is None else dense
    if "kv" not in dense:
        dense["kv"] = _dense_kv(p)
    k, v = dense["kv"]
    bs, n_pre, n_ext = p.batch_size, p.prefix_lens[0], p.extend_lens[0]
    q = p.q_extend.view(bs, n_ext, p.num_q_heads, p.head_dim).transpose(1, 2)
    dense_out = out.view(bs, n_ext, p.num_q_heads, p.v_head_dim)
    if name == "flex":
        return _flex_impl(q, k, v, dense_out, n_pre, p.sm_scale)
    vis = _draft_visibility(n_pre, n_ext, out.device)

    def sdpa():
        o = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=vis, scale=p.sm_scale, enable_gqa=True
        )
        dense_out.copy_(o.transpose(1, 2))

    return sdpa


_FLEX = None


def _flex_impl(q, k, v, dense_out, n_pre, sm_scale):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    global _FLEX
    if _FLEX is None:
        # One compile per shape: raise dynamo's limits, or later shapes fall
        # back to an unfused path many times slower.
        import torch._dynamo

        torch._dynamo.config.recompile_limit = 1024
        torch._dynamo.config.cache_size_limit = 1024
        _FLEX = torch.compile(flex_attention, dynamic=False)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx < n_pre) | (kv_idx - n_pre <= q_idx)

    bs, _, n_ext, _ = q.shape
    block_mask = create_block_mask(mask_mod, bs, None, n_ext, k.shape[2], device=q.device)

    def flex():
        o = _FLEX(q, k, v, block_mask=block_mask, scale=sm_scale, enable_gqa=True)
        dense_out.copy_(o.transpose(1, 2))

    return flex


def declined_message(p: VerifyProblem, out: torch.Tensor) -> str:
    """Why the drop-in returned ``False`` on ``p`` (the gate's reason, where it gives one)."""
    try:
        from ..gate import decline_reason

        t = p.tensors(out)
        reason = decline_reason(*t[:3], *t[4:], **p.options(), o_extend=out)
    except Exception:  # the gate's signature is not this module's business
        reason = None
    return f"verify_splitkv_fwd declined the call (returned False){': ' + reason if reason else ''}"
