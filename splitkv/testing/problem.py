"""Verify problems: the one place tests, notebooks and the benchmark build inputs.

A *target-verify* step of EAGLE speculative decoding gives every sequence ``b``
a few draft tokens (rows ``qo_indptr[b]:qo_indptr[b+1]`` of ``q_extend``,
``k_extend``, ``v_extend``) that attend to

* the sequence's cached prefix: token-pool slots
  ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` of ``k_buffer``/``v_buffer``
  (shape ``[pool_tokens, H_KV, D]``), every prefix key visible to every draft
  token, and
* the draft tokens themselves: causally (a chain, speculative ``topk == 1``) or
  through a tree mask (``custom_mask``, ``topk > 1``).

:func:`make_problem` draws such a problem with fresh random data: random slots
in a pool larger than the prefix, optional fused-QKV (non-contiguous) inputs,
ragged prefix and extend lengths, tree masks, KV scales and attention sinks.
:data:`MODEL_SHAPES` are the labelled head configurations used everywhere.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

__all__ = [
    "HeadShape",
    "MODEL_SHAPES",
    "VerifyProblem",
    "make_problem",
    "tree_mask",
]


@dataclass(frozen=True)
class HeadShape:
    """Attention head configuration of one model (per tensor-parallel rank = 1).

    Attributes:
        name: the model, as labelled in tables and plots.
        num_q_heads: query heads.
        num_kv_heads: key/value heads.
        head_dim: dimension of every head.
    """

    name: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        """Query heads that share one KV head (the GQA ratio)."""
        return self.num_q_heads // self.num_kv_heads


#: Head configurations of the models the project is measured on.
MODEL_SHAPES = {
    "qwen3-next": HeadShape("Qwen3-Next full-attention", 16, 2, 256),
    "llama3-8b": HeadShape("Llama-3-8B", 32, 8, 128),
    "qwen3-32b": HeadShape("Qwen3-32B", 64, 8, 128),
}


@dataclass
class VerifyProblem:
    """All inputs of one verify attention call, plus host-side lengths.

    ``args(o)`` returns the positional arguments shared by
    :func:`splitkv.extend_attention_fwd` and :func:`splitkv.verify_splitkv_fwd`
    (``q_extend ... v_scale``); ``kwargs()`` the keyword ones.

    Attributes:
        q_extend: draft queries ``[tokens, H_Q, D]``.
        k_extend: draft keys ``[tokens, H_KV, D]``.
        v_extend: draft values ``[tokens, H_KV, Dv]``.
        k_buffer: the key pool ``[pool_tokens, H_KV, D]``.
        v_buffer: the value pool ``[pool_tokens, H_KV, Dv]``.
        qo_indptr: ``[bs + 1]`` draft rows of each sequence (int32).
        kv_indptr: ``[bs + 1]`` ranges of ``kv_indices`` (int32).
        kv_indices: prefix slots in the pool (int32 or int64).
        custom_mask: the flat draft-tree mask, or ``None``.
        mask_indptr: ``[bs + 1]`` start of each sequence's mask, or ``None``.
        is_causal: causal draft block when there is no ``custom_mask``.
        max_len_extend: most draft tokens of any sequence.
        k_scale: key-pool dequantisation multiplier.
        v_scale: value-pool dequantisation multiplier.
        sm_scale: softmax scale (``1 / sqrt(D)``).
        sinks: ``[H_Q]`` sink logits (float32), or ``None``.
        prefix_lens: host list of prefix lengths.
        extend_lens: host list of draft counts.
    """

    q_extend: torch.Tensor
    k_extend: torch.Tensor
    v_extend: torch.Tensor
    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    custom_mask: Optional[torch.Tensor]
    mask_indptr: Optional[torch.Tensor]
    is_causal: bool
    max_len_extend: int
    k_scale: float
    v_scale: float
    sm_scale: float
    sinks: Optional[torch.Tensor]
    prefix_lens: list
    extend_lens: list

    @property
    def batch_size(self) -> int:
        return len(self.prefix_lens)

    @property
    def num_q_heads(self) -> int:
        return self.q_extend.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k_extend.shape[1]

    @property
    def head_dim(self) -> int:
        return self.q_extend.shape[2]

    @property
    def v_head_dim(self) -> int:
        return self.v_extend.shape[2]

    @property
    def num_tokens(self) -> int:
        return self.q_extend.shape[0]

    @property
    def kv_bytes(self) -> int:
        """Bytes of prefix K and V every correct kernel must read at least once."""
        per_token = self.num_kv_heads * (self.head_dim + self.v_head_dim)
        return sum(self.prefix_lens) * per_token * self.k_buffer.element_size()

    def new_output(self, fill: float = float("nan")) -> torch.Tensor:
        """An output tensor poisoned with ``fill`` (NaN by default)."""
        return torch.full(
            (self.num_tokens, self.num_q_heads, self.v_head_dim),
            fill,
            dtype=self.q_extend.dtype,
            device=self.q_extend.device,
        )

    def args(self, o_extend: torch.Tensor) -> tuple:
        """Positional arguments of ``extend_attention_fwd``/``verify_splitkv_fwd``."""
        return (
            self.q_extend,
            self.k_extend,
            self.v_extend,
            o_extend,
            self.k_buffer,
            self.v_buffer,
            self.qo_indptr,
            self.kv_indptr,
            self.kv_indices,
            self.custom_mask,
            self.is_causal,
            self.mask_indptr,
            self.max_len_extend,
            self.k_scale,
            self.v_scale,
        )

    def kwargs(self) -> dict:
        """Keyword arguments: ``sm_scale`` and ``sinks``."""
        return {"sm_scale": self.sm_scale, "sinks": self.sinks}

    def replace(self, **changes) -> "VerifyProblem":
        """A copy with some fields replaced (tensors are shared, not copied)."""
        return dataclasses.replace(self, **changes)


def tree_mask(parents: Sequence[int]) -> torch.Tensor:
    """Draft-block visibility of a token tree: ``[L, L]`` bool.

    ``parents[i]`` is the index of token ``i``'s parent (``-1`` for the root,
    which must be token 0; parents precede their children). Token ``i`` sees
    token ``j`` iff ``j`` is ``i`` or one of its ancestors. A chain
    (``parents = [-1, 0, 1, ...]``) gives the causal lower triangle.

    Returns:
        The ``[L, L]`` visibility matrix.

    Raises:
        ValueError: if token 0 is not the root or a parent follows its child.
    """
    n = len(parents)
    visible = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if i == 0:
            if p != -1:
                raise ValueError("token 0 must be the root (parent -1)")
        elif not 0 <= p < i:
            raise ValueError(f"parent of token {i} must precede it, got {p}")
        visible[i, i] = True
        if p >= 0:
            visible[i] |= visible[p]
    return visible


IntOrList = Union[int, Sequence[int]]


def _as_list(value: IntOrList, n: int, what: str) -> list:
    if isinstance(value, int):
        return [value] * n
    value = [int(v) for v in value]
    if len(value) != n:
        raise ValueError(f"{what}: expected {n} values, got {len(value)}")
    return value


def make_problem(
    prefix_lens: Sequence[int],
    extend_lens: IntOrList = 4,
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    v_head_dim: Optional[int] = None,
    *,
    dtype: torch.dtype = torch.float16,
    kv_dtype: Optional[torch.dtype] = None,
    device: Union[str, torch.device] = "cpu",
    mask: str = "causal",
    pool_factor: float = 2.0,
    index_dtype: torch.dtype = torch.int64,
    fused_qkv: bool = False,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sinks: bool = False,
    seed: Optional[int] = None,
) -> VerifyProblem:
    """Draw a verify problem with fresh random data.

    Args:
        prefix_lens: prefix length of each sequence (0 allowed).
        extend_lens: draft tokens per sequence (an int, or one per sequence).
        num_q_heads: query heads.
        num_kv_heads: KV heads (divides ``num_q_heads``).
        head_dim: query/key head dimension.
        v_head_dim: value head dimension (defaults to ``head_dim``).
        dtype: dtype of queries, draft K/V and the output.
        kv_dtype: dtype of the token pool (defaults to ``dtype``).
        mask: ``"causal"`` (chain, ``is_causal=True``, no custom mask),
            ``"chain"`` (the same visibility passed as a ``custom_mask``),
            ``"tree"`` (a random token tree as ``custom_mask``) or ``"none"``
            (every draft token sees every draft token, ``is_causal=False``).
        pool_factor: the token pool holds ``pool_factor`` times the total
            prefix (at least one slot more); prefix slots are a random subset.
        index_dtype: dtype of ``kv_indices`` (int32 or int64).
        fused_qkv: make q/k/v views into one fused ``[tokens, (Hq+2Hkv)*D]``
            projection output, as a model's QKV linear produces them (so their
            row strides are not ``H*D``); needs ``v_head_dim == head_dim``.
        k_scale: key-pool dequantisation multiplier.
        v_scale: value-pool dequantisation multiplier.
        sinks: draw one attention-sink logit per query head.
        seed: seed a private generator (fresh, unseeded data by default).

    Returns:
        A :class:`VerifyProblem` on ``device``.

    Raises:
        ValueError: on inconsistent head counts, lengths or an unknown mask kind.
    """
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError("num_q_heads must be a positive multiple of num_kv_heads")
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    bs = len(prefix_lens)
    prefix_lens = [int(p) for p in prefix_lens]
    extend_lens = _as_list(extend_lens, bs, "extend_lens")
    if bs < 1 or min(prefix_lens) < 0 or min(extend_lens) < 1:
        raise ValueError("need >= 1 sequence, prefix >= 0 and extend >= 1")
    if mask not in ("causal", "chain", "tree", "none"):
        raise ValueError(f"unknown mask kind {mask!r}")

    gen = torch.Generator(device="cpu")
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)

    def randn(*shape, dt=dtype):
        # Draw on the CPU from the private generator, then move: the same
        # seed gives the same problem on every device.
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(
            device=device, dtype=dt
        )

    n_tok = sum(extend_lens)
    total_prefix = sum(prefix_lens)

    # Draft-token projections, optionally as views into one fused QKV output.
    if fused_qkv:
        if v_head_dim != head_dim:
            raise ValueError("fused_qkv needs v_head_dim == head_dim")
        qkv = randn(n_tok, (num_q_heads + 2 * num_kv_heads) * head_dim)
        q, k, v = qkv.split(
            [num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
            dim=1,
        )
        q_ext = q.view(n_tok, num_q_heads, head_dim)
        k_ext = k.view(n_tok, num_kv_heads, head_dim)
        v_ext = v.view(n_tok, num_kv_heads, head_dim)
    else:
        q_ext = randn(n_tok, num_q_heads, head_dim)
        k_ext = randn(n_tok, num_kv_heads, head_dim)
        v_ext = randn(n_tok, num_kv_heads, v_head_dim)

    # The token pool: larger than the prefix, the prefix on random slots.
    pool = max(int(math.ceil(total_prefix * pool_factor)), total_prefix + 1)
    k_buffer = randn(pool, num_kv_heads, head_dim, dt=kv_dtype)
    v_buffer = randn(pool, num_kv_heads, v_head_dim, dt=kv_dtype)
    kv_indices = torch.randperm(pool, generator=gen)[:total_prefix]
    kv_indices = kv_indices.to(device=device, dtype=index_dtype)

    def indptr(lens):
        out = torch.zeros(len(lens) + 1, dtype=torch.int32)
        out[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0)
        return out.to(device)

    custom_mask = mask_indptr = None
    if mask in ("chain", "tree"):
        blocks = []
        for p_len, l_ext in zip(prefix_lens, extend_lens):
            if mask == "chain":
                parents = list(range(-1, l_ext - 1))
            else:
                parents = [-1] + [
                    int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, l_ext)
                ]
            # Row i of a sequence's mask covers [prefix keys | draft keys].
            rows = torch.ones(l_ext, p_len + l_ext, dtype=torch.bool)
            rows[:, p_len:] = tree_mask(parents)
            blocks.append(rows.flatten())
        custom_mask = torch.cat(blocks).to(device)
        mask_indptr = indptr([b.numel() for b in blocks]).to(torch.int64)

    return VerifyProblem(
        q_extend=q_ext,
        k_extend=k_ext,
        v_extend=v_ext,
        k_buffer=k_buffer,
        v_buffer=v_buffer,
        qo_indptr=indptr(extend_lens),
        kv_indptr=indptr(prefix_lens),
        kv_indices=kv_indices,
        custom_mask=custom_mask,
        mask_indptr=mask_indptr,
        is_causal=(mask != "none"),
        max_len_extend=max(extend_lens),
        k_scale=float(k_scale),
        v_scale=float(v_scale),
        sm_scale=1.0 / math.sqrt(head_dim),
        sinks=randn(num_q_heads, dt=torch.float32) if sinks else None,
        prefix_lens=prefix_lens,
        extend_lens=extend_lens,
    )
