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
:func:`paged_problem` lays a problem's prefixes out in a NaN-poisoned paged
pool (:mod:`splitkv.paged`), as a :class:`PagedProblem`.
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
    "FEATURE_SHAPES",
    "PagedProblem",
    "VerifyProblem",
    "make_problem",
    "paged_problem",
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

#: Models whose attention uses a score feature, with that feature's settings
#: (``extend_attention_fwd`` keywords): the breadth benchmark's shapes.
FEATURE_SHAPES = {
    "gemma2-9b-capped": (HeadShape("Gemma-2-9B (logit cap 50)", 16, 8, 256), {"logit_cap": 50.0}),
    "gpt-oss-20b-window": (HeadShape("gpt-oss-20b sliding layer (window 128)", 64, 8, 64),
                           {"sliding_window_size": 128}),
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

    def tensors(self, o_extend: Optional[torch.Tensor]) -> tuple:
        """The positional tensors of :func:`splitkv.verify_attention`: ``args(o_extend)`` up to ``kv_indices``."""
        return self.args(o_extend)[:9]

    def options(self) -> dict:
        """The keywords of :func:`splitkv.verify_attention` after ``kv_indices`` for this problem."""
        a = self.args(None)
        return {"custom_mask": a[9], "is_causal": a[10], "mask_indptr": a[11], "max_len_extend": a[12],
                "k_scale": a[13], "v_scale": a[14], **self.kwargs()}

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


def _draft_tensors(randn, n_tok, num_q_heads, num_kv_heads, head_dim, v_head_dim, fused_qkv):
    """The draft tokens' q, k, v: separate tensors, or views into one fused QKV projection."""
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

    return q_ext, k_ext, v_ext


def _indptr(lens, device) -> torch.Tensor:
    """int32 offsets ``[0, lens[0], lens[0] + lens[1], ...]`` on ``device``."""
    out = torch.zeros(len(lens) + 1, dtype=torch.int32)
    out[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0)
    return out.to(device)


def _draft_mask(mask, prefix_lens, extend_lens, gen, device):
    """``(custom_mask, mask_indptr)`` for a chain or random tree of drafts; ``(None, None)`` otherwise."""
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
        mask_indptr = _indptr([b.numel() for b in blocks], device).to(torch.int64)

    return custom_mask, mask_indptr


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

    q_ext, k_ext, v_ext = _draft_tensors(randn, n_tok, num_q_heads, num_kv_heads, head_dim, v_head_dim, fused_qkv)
    # The token pool: larger than the prefix, the prefix on random slots.
    pool = max(int(math.ceil(total_prefix * pool_factor)), total_prefix + 1)
    k_buffer = randn(pool, num_kv_heads, head_dim, dt=kv_dtype)
    v_buffer = randn(pool, num_kv_heads, v_head_dim, dt=kv_dtype)
    kv_indices = torch.randperm(pool, generator=gen)[:total_prefix]
    kv_indices = kv_indices.to(device=device, dtype=index_dtype)

    custom_mask, mask_indptr = _draft_mask(mask, prefix_lens, extend_lens, gen, device)
    return VerifyProblem(
        q_extend=q_ext,
        k_extend=k_ext,
        v_extend=v_ext,
        k_buffer=k_buffer,
        v_buffer=v_buffer,
        qo_indptr=_indptr(extend_lens, device),
        kv_indptr=_indptr(prefix_lens, device),
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


@dataclass(frozen=True)
class PagedProblem:
    """A :class:`VerifyProblem` whose prefixes are laid out in a paged pool.

    The paged layout is :mod:`splitkv.paged`'s: page ids
    ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` of sequence ``b`` into
    ``k_pages``/``v_pages`` (``[num_pages, page_size, H_KV, D]``), the last page
    holding ``kv_last_page_len[b]`` keys. Key ``n`` of sequence ``b`` is the
    token-pool row ``problem.k_buffer[problem.kv_indices[problem.kv_indptr[b] + n]]``,
    bit for bit, so the float64 oracle ``reference_for(problem)`` is the
    answer of the paged call too. Every page row no prefix uses (the tail of
    last pages, the spare pages) is NaN: a kernel that reads one shows it.

    ``args(o)`` and ``kwargs()`` are ``problem``'s with the paged pool, page
    table and ``kv_last_page_len`` in place of the token pool's.

    Attributes:
        problem: the token-pool original (queries, drafts, mask, scales).
        k_pages: the key pages ``[num_pages, page_size, H_KV, D]``.
        v_pages: the value pages ``[num_pages, page_size, H_KV, Dv]``.
        kv_indptr: ``[bs + 1]`` ranges of ``kv_indices`` (``problem.kv_indptr``'s dtype).
        kv_indices: page ids (``problem.kv_indices``' dtype).
        kv_last_page_len: ``[bs]`` keys in each sequence's last page (int32;
            0 for a sequence without prefix).
        page_size: rows per page.
    """

    problem: VerifyProblem
    k_pages: torch.Tensor
    v_pages: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    page_size: int

    def args(self, o_extend: torch.Tensor) -> tuple:
        """Positional arguments of ``extend_attention_fwd``'s order, on the paged pool."""
        return self.problem.replace(
            k_buffer=self.k_pages,
            v_buffer=self.v_pages,
            kv_indptr=self.kv_indptr,
            kv_indices=self.kv_indices,
        ).args(o_extend)

    def kwargs(self) -> dict:
        """Keyword arguments: ``problem.kwargs()`` plus ``kv_last_page_len``."""
        return {**self.problem.kwargs(), "kv_last_page_len": self.kv_last_page_len}

    def tensors(self, o_extend: Optional[torch.Tensor]) -> tuple:
        """The positional tensors of :func:`splitkv.verify_attention` on the paged pool."""
        return self.args(o_extend)[:9]

    def options(self) -> dict:
        """The keywords of :func:`splitkv.verify_attention` after ``kv_indices``, ``kv_last_page_len`` included."""
        return {**self.problem.options(), "kv_last_page_len": self.kv_last_page_len}


def paged_problem(
    problem: VerifyProblem,
    page_size: int,
    *,
    seed: int = 0,
    spare_pages: int = 4,
) -> PagedProblem:
    """Lay a token-pool problem's prefixes out in a fresh, NaN-poisoned page pool.

    Sequence ``b``'s prefix rows (``k_buffer[kv_indices[kv_indptr[b]:kv_indptr[b+1]]]``,
    in order, and likewise for V) fill ``cdiv(prefix_len, page_size)`` pages
    drawn at random, without repetition, from a pool of all the pages needed
    plus ``spare_pages``. The pool has the token pool's dtype and device; rows
    no prefix uses are NaN (float8 pools are built in float32 and converted:
    ``float8_e4m3fn`` and ``float8_e5m2`` both have a NaN).

    Args:
        problem: the token-pool problem (e.g. from :func:`make_problem`).
        page_size: rows per page.
        seed: seeds the choice of pages.
        spare_pages: pages no sequence uses, all NaN.

    Returns:
        The :class:`PagedProblem`.

    Raises:
        ValueError: if ``page_size < 1``, ``spare_pages < 0`` or the pool's
            dtype cannot hold NaN.
    """
    if page_size < 1 or spare_pages < 0:
        raise ValueError(f"need page_size >= 1 and spare_pages >= 0, got {page_size} and {spare_pages}")
    p = problem
    dtype, device = p.k_buffer.dtype, p.k_buffer.device
    # Build in float32 (float64 for a float64 pool), which holds the pool's
    # values exactly and which every op supports (float8 lacks many kernels);
    # convert at the end, and make sure the pool's dtype keeps NaN.
    stage = torch.float64 if dtype == torch.float64 else torch.float32
    if not dtype.is_floating_point or not torch.tensor(float("nan")).to(dtype).to(stage).isnan():
        raise ValueError(f"a {dtype} pool cannot be poisoned with NaN")

    pages_per_seq = [-(-n // page_size) for n in p.prefix_lens]
    num_pages = sum(pages_per_seq) + spare_pages
    gen = torch.Generator(device="cpu").manual_seed(seed)
    page_ids = torch.randperm(num_pages, generator=gen)[: sum(pages_per_seq)].to(device)

    def poisoned(buffer):
        return torch.full((num_pages, page_size, *buffer.shape[1:]), float("nan"), dtype=stage, device=device)

    k_pages, v_pages = poisoned(p.k_buffer), poisoned(p.v_buffer)
    kv = p.kv_indptr.tolist()
    first_page = 0
    for b, (n_keys, n_pages) in enumerate(zip(p.prefix_lens, pages_per_seq)):
        slots = p.kv_indices[kv[b]: kv[b + 1]].long()
        n = torch.arange(n_keys, device=device)
        page = page_ids[first_page + n // page_size]
        k_pages[page, n % page_size] = p.k_buffer[slots].to(stage)
        v_pages[page, n % page_size] = p.v_buffer[slots].to(stage)
        first_page += n_pages

    indptr = torch.zeros(p.batch_size + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(torch.tensor(pages_per_seq, dtype=torch.int64), 0)
    last = [n - (m - 1) * page_size if m else 0 for n, m in zip(p.prefix_lens, pages_per_seq)]
    return PagedProblem(
        problem=p,
        k_pages=k_pages.to(dtype),
        v_pages=v_pages.to(dtype),
        kv_indptr=indptr.to(device=device, dtype=p.kv_indptr.dtype),
        kv_indices=page_ids.to(p.kv_indices.dtype),
        kv_last_page_len=torch.tensor(last, dtype=torch.int32, device=device),
        page_size=page_size,
    )
