"""Context-parallel verify: every sequence's prefix sharded over ranks, partial states merged exactly.

At a long context one GPU spends the whole verify step streaming the prefix
K/V from its memory. Context parallelism splits that read: each rank of a
process group holds a *shard* of every sequence's prefix in its own token pool
(a quarter of a 1M-token context on each of 4 GPUs), all ranks receive the same
draft queries, and each attends to its own keys only. What a rank computes is
an attention *state* over a disjoint key set (:mod:`splitkv.merge`)::

    rank r:  (o_r, s_r)    o_r: output over its keys,  s_r = log sum_{j on r} exp(score_j)

and attention over the whole prefix is their LSE-weighted mean, exactly::

    s = log sum_r exp(s_r)          o = sum_r exp(s_r - s) * o_r

A step runs the local split-KV kernel into a send buffer, all-gathers the
ranks' states and merges them (:mod:`splitkv.parallel.plan` draws it). The
exchange is ``tokens x heads x (Dv x 2 + 4)`` bytes per rank (bf16 partials,
float32 LSE) whatever the context length: 260 KiB for 8 sequences of 4 drafts
at 32 heads x 128, against gigabytes of prefix K/V.

The draft block. Each draft token sees its own sequence's draft tokens (causal
or a tree mask). Those keys are attended on exactly one rank, ``draft_rank``;
the others launch with ``attend_draft=False``. Attention sinks add
``exp(sink)`` to the denominator once, so they too are applied on
``draft_rank`` only; its LSE includes them and the merge carries them through.

Sharding (:mod:`splitkv.parallel.shard`). Every key must be on exactly one
rank; a rank holding no key of a sequence (an *empty shard*) computes the
empty state ``s_r = -inf``, which weighs 0 in the merge. With paged pools
(``k_buffer``/``v_buffer`` of shape ``[pages, page_size, H_KV, D]``,
:mod:`splitkv.paged`) a rank holds whole pages.

Score features. The logit cap changes each score alone, so it is served as on
one GPU. The sliding window and the xai temperature depend on each key's and
query's absolute position, which a shard's kernel does not see (it counts
positions within the shard): the context-parallel entries do not take them.

Entry points:

* :class:`ContextParallelVerify` -- plan once per step, run once per layer,
  like :class:`splitkv.VerifySplitKV`; send/receive buffers are allocated at
  plan time (runs allocate only what a :class:`~splitkv.VerifyPlan` run does:
  the output if none is given, the split-KV scratch) and are graph-capturable;
* :func:`cp_verify_attention` -- one call (plans cached per thread by
  signature), the arguments of :func:`splitkv.verify_attention` (the 9 tensors
  up to ``kv_indices`` positional, everything after as keywords of the same names);
* :func:`shard_prefix`, :func:`shard_mask`, :func:`shard_owner`,
  :func:`shard_last_page_len` -- sharding metadata for engines;
* for tests and notebooks, :mod:`splitkv.testing.parallel`: shard a
  :class:`~splitkv.testing.VerifyProblem`, run a whole world in one process,
  or spawn a local gloo world on ``127.0.0.1`` (CPU, Triton interpreter).

Ranks (``draft_rank``, ``dst``) are ranks *within* ``group``.
"""

from __future__ import annotations

from .api import clear_cp_caches, cp_verify_attention
from .plan import ContextParallelPlan, ContextParallelVerify
from .shard import (
    ROUND_ROBIN_BLOCK,
    SHARD_MODES,
    PrefixShard,
    shard_last_page_len,
    shard_mask,
    shard_owner,
    shard_prefix,
)

__all__ = [
    "ContextParallelVerify",
    "ContextParallelPlan",
    "PrefixShard",
    "SHARD_MODES",
    "ROUND_ROBIN_BLOCK",
    "cp_verify_attention",
    "shard_owner",
    "shard_prefix",
    "shard_mask",
    "shard_last_page_len",
    "clear_cp_caches",
]
