"""Pieces the verify, merge and extend kernels share: score tiles, soft cap, normalisation, slicing.

Exponentials are base 2: ``exp(x)`` compiles to ``exp2(x * log2(e))`` anyway,
so folding ``log2(e)`` into the score scale saves one multiply per score; LSEs
are kept in base 2 and turned back into natural log (``x ln 2``) only when
written out.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

#: ``MERGE``, who merges a tile's slices (see "Merging"): a second launch (``_merge_kernel``).
SEPARATE_MERGE = 0

#: ``MERGE``: the tile's last program to finish.
LAST_PROGRAM = 1

#: ``MERGE``: merge programs in the verify grid, after the slices' programs.
MERGE_PROGRAMS = 2

# Faults the kernel reports in its launch's slot of the fault log (see "Checks"), as
# ``sequence * 16 + field``; :data:`splitkv.errors.FIELDS` names them.
ERR_QO_INDPTR = tl.constexpr(1)
ERR_DRAFTS = tl.constexpr(2)
ERR_KV_INDPTR = tl.constexpr(3)
ERR_SLOT = tl.constexpr(4)
ERR_LAST_PAGE = tl.constexpr(5)
ERR_MASK = tl.constexpr(6)
ERR_PREFIX_BOUND = tl.constexpr(7)
ERR_COUNTERS = tl.constexpr(8)
ERR_MERGE_WAIT = tl.constexpr(9)


@triton.jit
def _report(Log, slot, code, fault):
    """Where ``fault``, store ``code`` in word ``slot`` of the fault log ``Log`` and raise its flag
    (word 0), which the host reads before it looks at the slots (:mod:`splitkv.errors`)."""
    tl.store(Log + slot, code, mask=fault)
    tl.store(Log, 1, mask=fault)


@triton.jit
def soft_cap(s, cap):
    """``cap * tanh(s / cap)``, as ``cap - 2 cap / (1 + 2^(s * 2 log2(e) / cap))`` (Triton has no tanh).

    The logit cap of Gemma 2 and Grok; the split kernel and the extend
    baseline both use it (the split kernel in base 2, see ``_attend_tile``).
    Per score: one multiply by a per-program constant, one ``exp2``, one
    division. ``tanh(x) = 1 - 2 / (1 + e^(2x))`` saturates cleanly: ``2^(+inf)``
    gives ``cap``, ``2^(-inf)`` gives ``-cap``. Measured on the H200 (Gemma-2-9B,
    batch 8, bf16, ``python -m splitkv.bench.breadth``): the cap costs 1 % over
    the plain call in the committed run (3-4 % in an earlier one), where
    ``cap * (2 sigmoid(2 s / cap) - 1)`` (two divisions) cost 6-8 %.
    """
    return cap - 2.0 * cap / (1.0 + tl.exp2(s * (2.0 * 1.4426950408889634 / cap)))

@triton.jit
def _attend_tile(q, k, v, visible, qk_scale, m_i, l_i, acc, cap2, temperature,
                 HAS_LOGIT_CAP: tl.constexpr, HAS_XAI_TEMP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One online-softmax step over a tile of keys.

    ``q [BLOCK_M, D]`` against ``k [D, BLOCK_N]`` (stored transposed), values
    ``v [BLOCK_N, DV]``; ``visible [BLOCK_M, BLOCK_N]`` masks the scores. The
    running row maximum ``m_i`` (base 2), row sum ``l_i`` and unnormalised
    output ``acc`` are rescaled by ``2^(m_old - m_new)`` when the maximum grows.
    A row that has seen no visible key keeps ``m_i = -inf`` and ``l_i = 0``.

    Score transforms, in base 2 (``s2 = s * log2(e)``): the logit cap
    ``cap * tanh(s / cap)`` is ``cap2 * tanh(s2 / cap2)`` with
    ``cap2 = cap * log2(e)``; the xai temperature multiplies row ``r`` by
    ``temperature[r]``.
    """
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
    return _attend_scores(s, v, visible, m_i, l_i, acc, cap2, temperature, HAS_LOGIT_CAP, HAS_XAI_TEMP,
                          DOT_PRECISION)

@triton.jit
def _attend_tile_rope(q, q_rope, k, k_rope, v, visible, qk_scale, m_i, l_i, acc, cap2, temperature,
                      HAS_LOGIT_CAP: tl.constexpr, HAS_XAI_TEMP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``_attend_tile`` for a head taken in two chunks (MLA: ``HEAD_DIM = V_HEAD_DIM + ROPE_DIM``).

    The scores are ``q k + q_rope k_rope``: ``q [BLOCK_M, DV]`` against the
    latent ``k [DV, BLOCK_N]``, ``q_rope [BLOCK_M, ROPE_DIM]`` against
    ``k_rope [ROPE_DIM, BLOCK_N]``, the second dot accumulating onto the
    first. Each chunk is a power of two, so nothing is padded (576 would pad
    to 1024).
    """
    s = tl.dot(q_rope, k_rope, tl.dot(q, k, input_precision=DOT_PRECISION), input_precision=DOT_PRECISION)
    return _attend_scores(s * qk_scale, v, visible, m_i, l_i, acc, cap2, temperature, HAS_LOGIT_CAP,
                          HAS_XAI_TEMP, DOT_PRECISION)

@triton.jit
def _attend_scores(s, v, visible, m_i, l_i, acc, cap2, temperature,
                   HAS_LOGIT_CAP: tl.constexpr, HAS_XAI_TEMP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The online-softmax step of ``_attend_tile`` from its scaled scores ``s [BLOCK_M, BLOCK_N]``."""
    if HAS_LOGIT_CAP:
        s = soft_cap(s, cap2)
    if HAS_XAI_TEMP:
        s = s * temperature[:, None]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # Shift by 0 where a row is still empty: avoids (-inf) - (-inf) = NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_shift)
    p = tl.exp2(s - m_shift[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc

@triton.jit
def _finish(acc, m_i, l_i, sink2, HAS_SINKS: tl.constexpr):
    """Normalise ``acc`` by its softmax denominator (+ a sink); return ``(o, lse2)``.

    With a sink (base-2 logit ``sink2``, no value row) the denominator is
    ``l * 2^(m - M) + 2^(sink2 - M)`` with ``M = max(m, sink2)``. A row with no
    visible key and no sink gets ``o = 0``, ``lse2 = -inf``.
    """
    if HAS_SINKS:
        m_top = tl.maximum(m_i, sink2)
        scale = tl.exp2(m_i - m_top)  # 0 where m_i = -inf
        den = l_i * scale + tl.exp2(sink2 - m_top)
        acc = acc * scale[:, None]
    else:
        m_top = m_i
        den = l_i
    has = den != 0  # NaN (a NaN key or value in the pool) stays NaN, as in the oracle
    o = acc / tl.where(has, den, 1.0)[:, None]
    lse2 = tl.where(has, m_top + tl.log2(tl.where(has, den, 1.0)), float("-inf"))
    return o, lse2

@triton.jit
def _tile_slices(tile, qo_indptr, kv_indptr, Last_Page_Len, num_tokens, kv_len, n_splits, min_split, window,
                 HEAD_TILES: tl.constexpr, M_BLOCKS: tl.constexpr, BLOCK_N: tl.constexpr,
                 SPLIT_TOKENS: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Where tile ``tile`` works: its sequence, draft rows, prefix, and slicing.

    Returns ``(b, head_tile, m_block, q_start, n_draft, kv_start, n_prefix,
    first_key, split_len, n_used)``. ``kv_start`` is the sequence's first
    entry of ``kv_indices`` (a slot, or a page id in a paged pool);
    ``n_prefix`` counts keys. Slices cover keys ``[first_key, n_prefix)``:
    ``first_key`` is 0, or under a sliding window the first key any draft
    token sees, rounded down to a whole key tile. Metadata is clamped to the
    tensors it indexes (see "Bounds"); the verify kernel and the merge kernel
    compute the same values.
    """
    b = tile // (HEAD_TILES * M_BLOCKS)
    head_tile = (tile // M_BLOCKS) % HEAD_TILES
    m_block = tile % M_BLOCKS
    q_start = tl.minimum(tl.maximum(tl.load(qo_indptr + b), 0), num_tokens)
    q_end = tl.minimum(tl.maximum(tl.load(qo_indptr + b + 1), q_start), num_tokens)
    kv_start = tl.minimum(tl.maximum(tl.load(kv_indptr + b), 0), kv_len)
    kv_end = tl.minimum(tl.maximum(tl.load(kv_indptr + b + 1), kv_start), kv_len)
    if PAGE_SIZE == 1:
        n_prefix = kv_end - kv_start
    else:
        # Full pages, then the last page's used rows (FlashInfer's convention).
        n_pages = kv_end - kv_start
        last = tl.minimum(tl.maximum(tl.load(Last_Page_Len + b), 0), PAGE_SIZE)
        n_prefix = tl.where(n_pages > 0, (n_pages - 1) * PAGE_SIZE + last, 0)
    first_key = n_prefix * 0
    if HAS_WINDOW:
        # Draft 0 (position n_prefix) sees keys >= n_prefix - window; later drafts see fewer.
        first_key = tl.maximum(n_prefix - window, 0) // BLOCK_N * BLOCK_N
    n_keys = n_prefix - first_key
    if SPLIT_TOKENS > 0:
        split_len = SPLIT_TOKENS + n_keys * 0
    else:
        split_len = tl.maximum(tl.cdiv(tl.cdiv(n_keys, n_splits), BLOCK_N) * BLOCK_N, min_split)
    n_used = tl.maximum(tl.cdiv(n_keys, split_len), 1)
    if SPLIT_TOKENS > 0:
        # The host sizes the grid so this never binds; if it did, stay exact.
        split_len = tl.where(n_used > n_splits, tl.cdiv(tl.cdiv(n_keys, n_splits), BLOCK_N) * BLOCK_N,
                             split_len)
        n_used = tl.minimum(n_used, n_splits)
    return (b, head_tile, m_block, q_start, q_end - q_start, kv_start, n_prefix, first_key,
            split_len, n_used)

@triton.jit
def _pool_offset(index, OFFSETS_32: tl.constexpr):
    """A pool slot or page id (already bounds-checked) in the width of the gather's offset arithmetic."""
    if OFFSETS_32:
        return index.to(tl.int32)
    else:
        return index.to(tl.int64)
