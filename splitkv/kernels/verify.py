"""The split-KV verify kernel: one launch, prefix slices merged in the same grid.

What one launch computes. Sequence ``b`` has ``n_draft`` draft tokens (rows
``qo_indptr[b]:qo_indptr[b+1]`` of ``q_extend``/``k_extend``/``v_extend``) and a
prefix of ``n_prefix`` keys (token-pool slots
``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` of ``k_buffer``/``v_buffer``). Every
draft token attends to the whole prefix and, causally or through a tree mask,
to the draft tokens.

The grid is ``(tiles, n_splits)``:

* axis 0 (``tiles = batch x head_tiles x m_blocks``, up to 2^31 - 1) picks a
  *tile*: one sequence, one KV head, a block of query rows;
* axis 1 (``n_splits`` <= 65535) picks a *slice* of that sequence's prefix
  (with ``MERGE_PROGRAMS``, the tile's merge programs follow: see "Merging").

GQA packing. A KV head serves ``GROUP`` query heads; one tile takes all of
them, times the draft tokens, as the rows of its query block::

    tile row r  ->  draft token l = r // GROUP,  query head  h = kv_head * GROUP + r % GROUP

so each K/V row gathered is multiplied against ``GROUP * L`` query rows and the
prefix is read once per KV head. Rows are padded to a power of two (at least
16, what a tensor-core dot needs); ``m_blocks > 1`` when they exceed ``BLOCK_M``.
(``HEADS_PER_TILE = 1`` gives the seed's one-query-head-per-program layout,
kept for teaching and benchmarks: it reads the prefix ``GROUP`` times.)

Slices. The sequence's prefix is cut into ``n_used`` slices of ``split_len``
keys (a multiple of ``BLOCK_N``)::

    adaptive:        split_len = max(roundup(cdiv(n_prefix, n_splits), BLOCK_N), min_split)
    fixed (SPLIT_TOKENS > 0):  split_len = SPLIT_TOKENS         (batch-invariant)
    n_used = max(1, cdiv(n_prefix, split_len))     <= n_splits

Programs with ``split >= n_used`` exit at once: a short prefix in a ragged
batch is not over-split. The program of the last slice also attends to the
draft block (same online softmax, other keys and scale), so the draft tokens
cost no extra program.

Score features (SGLang's ``extend_attention_fwd`` semantics). Draft token
``l`` sits at position ``p = n_prefix + l``. A logit cap maps each score to
``cap * tanh(s / cap)``; the xai temperature multiplies the scores of rows
with ``p > len`` by ``log2(p) / log2(len)``; a sliding window ``W`` hides key
``n`` from row ``l`` unless ``p <= n + W``. Under a window the slices cover
only keys ``[first_key, n_prefix)``, ``first_key`` being the first key draft
0 sees rounded down to a whole key tile: keys before it are never read, so a
long prefix under a short window costs the window.

Merging. With ``n_used == 1`` the tile's only program normalises and writes
the output itself. Otherwise every program writes its slice's normalised
output ``o_s`` and log-sum-exp ``lse_s`` to scratch, and the slices are merged::

    lse = log sum_s exp(lse_s)          o = sum_s exp(lse_s - lse) * o_s

always reading them in order ``s = 0, 1, ...``, so results are bitwise
identical run to run whoever merges. ``MERGE`` says who (attention sinks add
``exp(sink)`` to the denominator once, at the end):

* ``LAST_PROGRAM``: each program, having written its slice, increments the
  tile's counter in global memory (an atomic with acquire-release ordering,
  after a barrier so all its threads' stores are done). The program that sees
  ``n_used - 1`` is the last: every slice is written, so it merges, then sets
  the counter back to 0, so the next launch (a CUDA-graph replay too) finds it
  zeroed without a memset. One program reads every slice of its tile: fine
  while they are few (``splitkv.schedule.FUSED_MAX_MERGE``).
* ``MERGE_PROGRAMS``: for many slices, the grid's axis 1 holds the
  ``n_splits`` slices and then, per tile, merge programs that each merge a
  block of ``MERGE_ROWS`` rows x ``MERGE_DV`` value columns. Work goes by
  *ticket*: every program first takes the next number of a counter, and
  ticket ``t`` does the work of grid cell ``(t % tiles, t // tiles)``. Every
  merge program's ticket is later than every slice program's, so when a merge
  program waits (spinning on its tile's counter until ``n_used`` slices are
  published) each slice it waits for has taken its ticket: it is already
  running, and it waits for nothing, so the wait ends however the hardware
  schedules programs. The tile's last merge program zeroes the tile's
  counter, and the grid's last program (an exit counter) zeroes the ticket
  and exit counters, which sit just past the tiles' counters.
* ``SEPARATE_MERGE``: programs only publish; ``_merge_kernel`` merges in a
  second launch, whose grid spreads each tile's merge over blocks of rows and
  columns, as a programmatic dependent launch (it starts while this grid
  drains and waits for it in hardware). It needs no counters.

All three share ``_tile_slices`` and ``_merge_rows``: same slices, same order,
same bits.

Memory layout. Pool rows ``[pool_tokens, H_KV, D]`` are gathered through
``kv_indices``. The dot wants K as ``[D, BLOCK_N]``: it is either loaded that
way (addresses walk ``D`` within a key), or, with ``K_ROWS``, loaded as rows
``[BLOCK_N, D]`` like V (both gathers share one layout of row offsets) and
transposed on chip; the tile table picks per head dim and pool type. A
paged pool is ``[pages, PAGE_SIZE, H_KV, D]``: ``kv_indices`` holds page ids,
key ``n`` is row ``n % PAGE_SIZE`` of page ``kv_indices[kv_start + n //
PAGE_SIZE]``, and the prefix is ``(pages - 1) * PAGE_SIZE + last_page_len``
keys. Key tiles start at multiples of ``BLOCK_N``, so where ``PAGE_SIZE`` is
a multiple of ``BLOCK_N`` a tile lies in one page: one page-id load per tile
instead of one slot load per key; where ``PAGE_SIZE`` divides ``BLOCK_N`` (up
to 64) a tile is whole pages: one load per page. Gather offsets (slot x stride +
head + column) are 32-bit where every element of both pools lies below 2^31
(``OFFSETS_32``, which the plan reads off the pools' shapes and strides),
64-bit otherwise; a slot or page id is bounds-checked before it is narrowed.
The 32-bit form needs fewer registers and instructions per gathered row
(Qwen3-Next on the H200, batch 8 / 64k: 3-4 % faster in pages of 16 or 64).

Scratch is per tile and slice, so a tile's merge reads one block::

    part_o  [tiles, n_splits, BLOCK_M, V_HEAD_DIM]   (bf16 for a bf16 output, else float32)
    part_lse[tiles, n_splits, BLOCK_M]               (float32, base 2)

The region of ``part_o`` is sized for float32 whatever the output; a bf16
output's partials fill its first half (``_partial_outputs``). They are
normalised slice outputs, so bf16 keeps their range, and rounding them once
more costs about one bf16 rounding of the output. Half the bytes to publish
and merge took 0.5-1.7 us off small-batch calls on the H200.

Bounds. Every gather is bounded: pool slots outside ``[0, pool_tokens)``,
index positions outside ``kv_indices``, mask positions outside
``custom_mask`` and rows outside the draft tensors are never dereferenced (a
key with a bad slot is treated as absent). Malformed metadata gives a wrong
answer, never an illegal address.

Checks. With ``CHECK`` the kernel also reports what it bounded: the program
of each sequence's first slice checks the sequence's indptrs, draft count
(against ``max_draft``), last-page length, the extent of its mask rows and,
in the batch-invariant mode, that its prefix fits the grid's slices; every
program checks the slots it gathers. A fault is stored as ``sequence * 16
+ field`` (``ERR_*``) in the launch's own word ``err_slot`` of the fault log
``Err``, whose word 0 it also sets: the host reads them without waiting for
the kernel (:mod:`splitkv.errors`); with several faults, one of them. Whatever ``CHECK`` says, counters that no launch could have left
(a workspace holding garbage, or shared by two streams at once) are
reported as ``ERR_COUNTERS``, and a merge program stops waiting for its
slices after ``spin_limit`` polls (``ERR_MERGE_WAIT``): never a hang.

fp8 pools. K and V rows are widened on chip to the query's dtype, except
that bf16 queries meet fp8 keys in float16 (``DOT_F16``): one instruction
widens two e4m3 values to float16, while reaching bf16 takes two more
conversions, and the widening, not the halved bytes, bounded the fp8 kernel
(Llama-3-8B, batch 8 / 64k on the H200: 525 us in bf16 dots, 395 us in
float16 with the query scaling below, 366 us without it, against 503 us for
a bf16 pool; see the design notes). Every e4m3 value is exact in
float16 (e5m2 too), and float16 keeps 3 more mantissa bits than bf16; its range is
the catch, so the query tile is divided by a power of two ``q_div``
(1 unless some element exceeds 2^14) and the scores multiplied back by it.
The probabilities meet V in float16 as well (FlashAttention's fp16 path).

MLA. DeepSeek's multi-head latent attention verifies with one KV head whose
key is ``[latent (512) | rope (64)]`` and whose value is the latent itself:
``v_buffer = k_buffer[..., :512]``, the same storage. With ``ROPE_DIM > 0``
(``HEAD_DIM = V_HEAD_DIM + ROPE_DIM``, both powers of two) the kernel takes
the head in those two chunks, so nothing is padded (one chunk would pad 576
to 1024, nearly doubling the tile)::

    s = q[:, :DV] k[:DV] + q[:, DV:] k[DV:]      (the second dot accumulates onto the first)

With ``KV_SHARED`` (the plan compares the pools' addresses, shapes and
strides) each latent row is gathered once, as ``[BLOCK_N, DV]``, widened
once (fp8), and used twice: transposed on chip as K's first chunk, and as V;
``V_Buf`` is never read. ``DRAFT_SHARED`` does the same for ``k_extend`` /
``v_extend``. With one KV head every query head and draft token shares
each key, so a tile holds 64 rows (``m_blocks > 1`` beyond) and the prefix
is read once per row block. Under ``DOT_F16`` the draft dots load the
query tile again rather than keep it beside the float16 copy through the
prefix loop: the loop then holds one 64 x 576 query tile, not two.

Base 2. Scores are pre-multiplied by ``log2(e)`` so exponentials are ``exp2``
(one instruction); LSEs are kept in base 2 and converted (``x ln 2``) only when
written out.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (ERR_COUNTERS, ERR_DRAFTS, ERR_KV_INDPTR, ERR_LAST_PAGE, ERR_MASK, ERR_MERGE_WAIT, ERR_PREFIX_BOUND,
                     ERR_QO_INDPTR, ERR_SLOT, _report, _attend_tile, _attend_tile_rope, _finish, _pool_offset, _tile_slices)
from .merge import _merge_chunk, _partial_outputs


@triton.jit
def _check_sequence(Err, err_slot, b, qo_indptr, kv_indptr, Last_Page_Len, mask_indptr, Mask_Offsets, num_tokens, kv_len,
                    mask_len, max_draft, n_prefix, n_draft, n_keys, n_splits, PAGE_SIZE: tl.constexpr,
                    SPLIT_TOKENS: tl.constexpr, USE_MASK: tl.constexpr, HAS_MASK_OFFSETS: tl.constexpr):
    """Checked mode: report sequence ``b``'s malformed metadata in the launch's slot of the fault log
    (see "Checks").

    The mask check covers the sequence's whole block of ``n_draft`` rows of ``offset + n_prefix +
    n_draft`` entries from ``mask_indptr[b]``, the columns the kernel skips included.
    """
    q0 = tl.load(qo_indptr + b)
    q1 = tl.load(qo_indptr + b + 1)
    k0 = tl.load(kv_indptr + b)
    k1 = tl.load(kv_indptr + b + 1)
    code = b * 16
    _report(Err, err_slot, code + ERR_QO_INDPTR, (q0 < 0) | (q1 < q0) | (q1 > num_tokens))
    _report(Err, err_slot, code + ERR_DRAFTS, q1 - q0 > max_draft)
    _report(Err, err_slot, code + ERR_KV_INDPTR, (k0 < 0) | (k1 < k0) | (k1 > kv_len))
    if PAGE_SIZE > 1:
        last = tl.load(Last_Page_Len + b)
        has_pages = k1 > k0
        _report(Err, err_slot, code + ERR_LAST_PAGE,
                tl.where(has_pages, (last < 1) | (last > PAGE_SIZE), last != 0))
    if SPLIT_TOKENS > 0:
        _report(Err, err_slot, code + ERR_PREFIX_BOUND, tl.cdiv(n_keys, SPLIT_TOKENS) > n_splits)
    if USE_MASK:
        offset = 0
        if HAS_MASK_OFFSETS:
            offset = tl.load(Mask_Offsets + b).to(tl.int64)
        start = tl.load(mask_indptr + b).to(tl.int64)
        end = start + n_draft.to(tl.int64) * (offset + n_prefix + n_draft)
        _report(Err, err_slot, code + ERR_MASK, (start < 0) | (end > mask_len))

@triton.jit
def _rope_queries(Q, rows, h, stride_qt, stride_qh, offs_dv, offs_r, row_ok):
    """MLA's query tile in its two chunks: ``(q [BLOCK_M, DV], q_rope [BLOCK_M, ROPE_DIM])``
    for token rows ``rows`` and query heads ``h``."""
    q_rows = Q + rows.to(tl.int64)[:, None] * stride_qt + h[:, None] * stride_qh
    q = tl.load(q_rows + offs_dv[None, :], mask=row_ok[:, None], other=0.0)
    q_r = tl.load(q_rows + offs_r[None, :], mask=row_ok[:, None], other=0.0)
    return q, q_r


@triton.jit
def _f16_queries(q, q_r, qk_scale_prefix):
    """Both query chunks divided by one power of two ``q_div`` and narrowed to float16, and the score
    scale times ``q_div`` (see "fp8 pools"): ``(q_pre, q_pre_rope, scale_pre)``."""
    q32 = q.to(tl.float32)
    q32_r = q_r.to(tl.float32)
    q_top = tl.maximum(tl.max(tl.max(tl.abs(q32), 1), 0), tl.max(tl.max(tl.abs(q32_r), 1), 0))
    q_div = tl.exp2(tl.maximum(tl.ceil(tl.log2(q_top / 16384.0)), 0.0))  # a power of two >= 1
    return (q32 / q_div).to(tl.float16), (q32_r / q_div).to(tl.float16), qk_scale_prefix * q_div


@triton.jit
def _rope_keys(K, V, k_row, v_row, ok, offs_dv, offs_r, dtype, SHARED: tl.constexpr, K_ROWS: tl.constexpr):
    """MLA's keys and values for one tile of rows: ``(k [DV, N], k_rope [ROPE_DIM, N], v [N, DV])`` in ``dtype``.

    ``k_row``/``v_row``: each row's element offset from ``K``/``V`` (which
    include the head). With ``SHARED`` the latent rows are loaded once, as
    ``[N, DV]``, widened once, and serve as V and (transposed on chip) as K's
    first chunk; V is never read.
    """
    k_r = tl.trans(tl.load(K + k_row[:, None] + offs_r[None, :], mask=ok[:, None], other=0.0).to(dtype))
    if SHARED:
        v = tl.load(K + k_row[:, None] + offs_dv[None, :], mask=ok[:, None], other=0.0).to(dtype)
        k = tl.trans(v)
    else:
        if K_ROWS:
            k = tl.trans(tl.load(K + k_row[:, None] + offs_dv[None, :], mask=ok[:, None], other=0.0)).to(dtype)
        else:
            k = tl.load(K + k_row[None, :] + offs_dv[:, None], mask=ok[None, :], other=0.0).to(dtype)
        v = tl.load(V + v_row[:, None] + offs_dv[None, :], mask=ok[:, None], other=0.0).to(dtype)
    return k, k_r, v


@triton.jit(do_not_specialize=["lse_offset", "num_tokens", "pool_tokens", "kv_len", "mask_len", "n_splits",
                               "min_split", "window", "xai_len", "max_draft", "spin_limit", "err_slot"])
def _verify_kernel(
    Q, K_Ext, V_Ext, K_Buf, V_Buf, O, LSE_Out,
    qo_indptr, kv_indptr, kv_indices, Last_Page_Len, Mask, mask_indptr, Mask_Offsets, Sinks,
    Part_O, lse_offset, Counters,  # scratch: partial outputs, then (at lse_offset) partial LSEs
    Err,  # the fault log: word 0 its flag (see "Checks" and splitkv.errors)
    err_slot,  # this launch's word of the fault log
    qk_scale_prefix,  # sm_scale * k_scale * log2(e)
    qk_scale_draft,  # sm_scale * log2(e)
    v_scale,
    cap2,  # logit_cap * log2(e)
    num_tokens,  # rows of q/k/v_extend and o_extend
    pool_tokens,  # rows (token pool) or pages (paged pool) of k_buffer/v_buffer
    kv_len,  # entries of kv_indices
    mask_len,  # entries of custom_mask
    n_splits,  # grid axis 1
    min_split,  # adaptive mode: fewest keys per slice (a multiple of BLOCK_N)
    window,  # sliding window: a query at position p sees keys at positions >= p - window
    xai_len,  # xai temperature length
    max_draft,  # max_len_extend (checked mode)
    spin_limit,  # most polls of a merge program's wait
    stride_qt, stride_qh,
    stride_ket, stride_keh,
    stride_vet, stride_veh,
    stride_kbt, stride_kbr, stride_kbh,  # pool: slot (or page), row within a page, head
    stride_vbt, stride_vbr, stride_vbh,
    stride_ot, stride_oh,
    NUM_Q_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    HEADS_PER_TILE: tl.constexpr,  # GROUP (packed) or 1 (one query head per tile)
    M_BLOCKS: tl.constexpr,  # row blocks per (sequence, head tile)
    HEAD_DIM: tl.constexpr,
    V_HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_N_DRAFT: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    K_ROWS: tl.constexpr,  # load K as [BLOCK_N, D] rows (like V) and transpose it for the dot
    PAGE_SIZE: tl.constexpr,  # 1: token pool (kv_indices are slots); else kv_indices are page ids
    OFFSETS_32: tl.constexpr,  # every pool element's offset fits int32: gather addresses in 32-bit arithmetic
    SPLIT_TOKENS: tl.constexpr,  # > 0: fixed slice length (batch-invariant mode)
    USE_MASK: tl.constexpr,  # draft visibility from custom_mask
    HAS_MASK_OFFSETS: tl.constexpr,  # window_kv_offsets shift each sequence's mask columns
    IS_CAUSAL: tl.constexpr,  # else causal if set, else every draft token visible
    HAS_WINDOW: tl.constexpr,
    HAS_LOGIT_CAP: tl.constexpr,
    HAS_XAI_TEMP: tl.constexpr,
    ATTEND_DRAFT: tl.constexpr,  # False: prefix only (context-parallel shards)
    HAS_SINKS: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    MERGE_UNROLL: tl.constexpr,  # slices the merging program loads per step
    MERGE: tl.constexpr,  # who merges a tile's slices: SEPARATE_MERGE, LAST_PROGRAM or MERGE_PROGRAMS
    MERGE_ROWS: tl.constexpr,  # MERGE_PROGRAMS: tile rows per merge program (else unused)
    MERGE_DV: tl.constexpr,  # MERGE_PROGRAMS: value columns per merge program (else unused)
    USE_PDL: tl.constexpr,  # let _merge_kernel launch while this grid drains
    DOT_PRECISION: tl.constexpr,
    DOT_F16: tl.constexpr,  # fp8 pool, bf16 queries: prefix dots in float16 (see "fp8 pools")
    CHECK: tl.constexpr,  # validate the metadata, reporting faults in Err (see "Checks")
    ROPE_DIM: tl.constexpr,  # > 0: QK in two chunks, V_HEAD_DIM + ROPE_DIM (see "MLA")
    KV_SHARED: tl.constexpr,  # ROPE_DIM > 0: V rows are the K rows' first V_HEAD_DIM columns (pools)
    DRAFT_SHARED: tl.constexpr,  # ROPE_DIM > 0: the same for k_extend / v_extend
):
    n_tiles = tl.num_programs(0)
    if MERGE == 2:  # MERGE_PROGRAMS: work goes by ticket, in the order programs start
        ticket = tl.atomic_add(Counters + n_tiles, 1, sem="relaxed", scope="gpu")
        # Tickets run 0 .. programs - 1; anything else means the counters were not zeroed.
        ticket_ok = (ticket >= 0) & (ticket < n_tiles * tl.num_programs(1))
        _report(Err, err_slot, ERR_COUNTERS, ticket_ok == 0)
        ticket = tl.where(ticket_ok, ticket, 0)
        tile = ticket % n_tiles
        split = ticket // n_tiles  # >= n_splits: a merge program
    else:
        tile = tl.program_id(0)
        split = tl.program_id(1)
    Part_LSE = Part_O + lse_offset
    Part_O = _partial_outputs(Part_O, O)
    HEAD_TILES: tl.constexpr = NUM_Q_HEADS // HEADS_PER_TILE
    b, head_tile, m_block, q_start, n_draft, kv_start, n_prefix, first_key, split_len, n_used = _tile_slices(
        tile, qo_indptr, kv_indptr, Last_Page_Len, num_tokens, kv_len, n_splits, min_split, window,
        HEAD_TILES, M_BLOCKS, BLOCK_N, SPLIT_TOKENS, PAGE_SIZE, HAS_WINDOW)
    kv_head = head_tile * HEADS_PER_TILE // GROUP
    has_rows = m_block * BLOCK_M < n_draft * HEADS_PER_TILE
    if MERGE == 2:
        has_rows = has_rows & ticket_ok
    if CHECK:
        if (split == 0) & (head_tile == 0) & (m_block == 0):
            _check_sequence(Err, err_slot, b, qo_indptr, kv_indptr, Last_Page_Len, mask_indptr, Mask_Offsets, num_tokens,
                            kv_len, mask_len, max_draft, n_prefix, n_draft, n_prefix - first_key, n_splits,
                            PAGE_SIZE, SPLIT_TOKENS, USE_MASK, HAS_MASK_OFFSETS)
    if (split < n_used) & has_rows:
        # Query rows: draft token l, query head h (see the module docstring).
        r = tl.arange(0, BLOCK_M)
        rows = m_block * BLOCK_M + r
        l = rows // HEADS_PER_TILE
        h = head_tile * HEADS_PER_TILE + rows % HEADS_PER_TILE
        row_ok = l < n_draft
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        d_ok = offs_d < HEAD_DIM
        dv_ok = offs_dv < V_HEAD_DIM
        q_pos = n_prefix + l  # absolute position of each query row

        if ROPE_DIM > 0:
            # MLA: the latent chunk [BLOCK_M, DV] and the rope chunk [BLOCK_M, ROPE_DIM] (see "MLA").
            tl.static_assert(HEAD_DIM == V_HEAD_DIM + ROPE_DIM)
            offs_r = V_HEAD_DIM + tl.arange(0, ROPE_DIM)
            q, q_r = _rope_queries(Q, q_start + l, h, stride_qt, stride_qh, offs_dv, offs_r, row_ok)
            q_pre = q
            q_pre_r = q_r
            scale_pre = qk_scale_prefix
            if DOT_F16:
                # The draft dots load q again: the prefix loop then holds one query tile, not two.
                q_pre, q_pre_r, scale_pre = _f16_queries(q, q_r, qk_scale_prefix)
        else:
            q = tl.load(
                Q + (q_start + l).to(tl.int64)[:, None] * stride_qt + h[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0,
            )
            # The prefix dots' query tile and score scale (see "fp8 pools").
            q_pre = q
            scale_pre = qk_scale_prefix
            if DOT_F16:
                q32 = q.to(tl.float32)
                q_top = tl.max(tl.max(tl.abs(q32), 1), 0)
                q_div = tl.exp2(tl.maximum(tl.ceil(tl.log2(q_top / 16384.0)), 0.0))  # a power of two >= 1
                q_pre = (q32 / q_div).to(tl.float16)
                scale_pre = qk_scale_prefix * q_div
        temperature = tl.full([BLOCK_M], 1.0, tl.float32)
        if HAS_XAI_TEMP:
            # Queries past position xai_len: scores x log2(p) / log2(xai_len).
            temperature = tl.where(q_pos > xai_len,
                                   tl.log2(tl.maximum(q_pos, 1).to(tl.float32)) / tl.log2(xai_len.to(tl.float32)),
                                   1.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

        # 1. This slice of the prefix: every key visible (or those inside the window).
        lo = first_key + split * split_len
        hi = tl.minimum(lo + split_len, n_prefix)
        bad_key = tl.zeros([BLOCK_N], tl.int32)  # checked mode: keys whose slot lies outside the pool
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_ok = offs_n < hi
            # Gather. Token pool: key n is row kv_indices[kv_start + n]. Paged pool:
            # key n is row n % PAGE_SIZE of page kv_indices[kv_start + n // PAGE_SIZE].
            if PAGE_SIZE == 1:
                slot = tl.load(kv_indices + kv_start + offs_n, mask=n_ok, other=0)
                slot_ok = (slot >= 0) & (slot < pool_tokens)
                if CHECK:
                    bad_key = bad_key | (n_ok & ~slot_ok).to(tl.int32)
                n_ok = n_ok & slot_ok
                slot = _pool_offset(slot, OFFSETS_32)
                k_row = slot * stride_kbt
                v_row = slot * stride_vbt
            else:
                if PAGE_SIZE % BLOCK_N == 0:
                    # Tiles start at multiples of BLOCK_N: the whole tile is in one page.
                    page = tl.load(kv_indices + kv_start + start // PAGE_SIZE)
                    page_ok = ((offs_n * 0 + page) >= 0) & ((offs_n * 0 + page) < pool_tokens)
                    if CHECK:
                        bad_key = bad_key | (n_ok & ~page_ok).to(tl.int32)
                    n_ok = n_ok & page_ok
                elif BLOCK_N <= 64 and BLOCK_N % PAGE_SIZE == 0:
                    # The tile is BLOCK_N // PAGE_SIZE whole pages: one page-id load per page,
                    # repeated for its PAGE_SIZE keys. Measured on the H200 (batch 8 / 64k, bf16,
                    # pages of 16): 0.81-0.93x the time of one load per key at BLOCK_N 32-64
                    # (Qwen3-Next 337 -> 287 us), but 1.10-1.17x at BLOCK_N 128 (Llama-3-8B,
                    # Qwen3-32B), which therefore keep one load per key.
                    pg = start // PAGE_SIZE + tl.arange(0, BLOCK_N // PAGE_SIZE)
                    pages = tl.load(kv_indices + kv_start + pg, mask=pg * PAGE_SIZE < hi, other=0)
                    page = tl.reshape(tl.broadcast_to(pages[:, None], (BLOCK_N // PAGE_SIZE, PAGE_SIZE)), (BLOCK_N,))
                else:
                    page = tl.load(kv_indices + kv_start + offs_n // PAGE_SIZE, mask=n_ok, other=0)
                if PAGE_SIZE % BLOCK_N != 0:
                    page_ok = (page >= 0) & (page < pool_tokens)
                    if CHECK:
                        bad_key = bad_key | (n_ok & ~page_ok).to(tl.int32)
                    n_ok = n_ok & page_ok
                page = _pool_offset(page, OFFSETS_32)
                in_page = offs_n % PAGE_SIZE
                k_row = page * stride_kbt + in_page * stride_kbr
                v_row = page * stride_vbt + in_page * stride_vbr
            if ROPE_DIM > 0:
                k, k_r, v = _rope_keys(K_Buf + kv_head * stride_kbh, V_Buf + kv_head * stride_vbh, k_row, v_row,
                                       n_ok, offs_dv, offs_r, q_pre.dtype, KV_SHARED, K_ROWS)
                visible = n_ok[None, :]
                if HAS_WINDOW:
                    visible = visible & (q_pos[:, None] <= offs_n[None, :] + window)
                m_i, l_i, acc = _attend_tile_rope(
                    q_pre, q_pre_r, k, k_r, v, visible, scale_pre, m_i, l_i, acc,
                    cap2, temperature, HAS_LOGIT_CAP, HAS_XAI_TEMP, DOT_PRECISION,
                )
            else:
                if K_ROWS:
                    k = tl.trans(tl.load(
                        K_Buf + k_row[:, None] + kv_head * stride_kbh + offs_d[None, :],
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0,
                    ))
                else:
                    k = tl.load(
                        K_Buf + k_row[None, :] + kv_head * stride_kbh + offs_d[:, None],
                        mask=n_ok[None, :] & d_ok[:, None], other=0.0,
                    )
                v = tl.load(
                    V_Buf + v_row[:, None] + kv_head * stride_vbh + offs_dv[None, :],
                    mask=n_ok[:, None] & dv_ok[None, :], other=0.0,
                )
                visible = n_ok[None, :]
                if HAS_WINDOW:
                    visible = visible & (q_pos[:, None] <= offs_n[None, :] + window)
                m_i, l_i, acc = _attend_tile(
                    q_pre, k.to(q_pre.dtype), v.to(q_pre.dtype), visible, scale_pre, m_i, l_i, acc,
                    cap2, temperature, HAS_LOGIT_CAP, HAS_XAI_TEMP, DOT_PRECISION,
                )
        acc = acc * v_scale  # fp8 pools: dequantise V once, on the slice's output
        if CHECK:
            _report(Err, err_slot, b * 16 + ERR_SLOT, tl.max(bad_key, 0) != 0)

        # 2. The last slice's program also takes the draft block.
        if ATTEND_DRAFT:
            if split == n_used - 1:
                if ROPE_DIM > 0:
                    if DOT_F16:
                        q, q_r = _rope_queries(Q, q_start + l, h, stride_qt, stride_qh, offs_dv, offs_r, row_ok)
                for start in range(0, n_draft, BLOCK_N_DRAFT):
                    j = start + tl.arange(0, BLOCK_N_DRAFT)
                    j_ok = j < n_draft
                    if ROPE_DIM > 0:
                        k, k_r, v = _rope_keys(K_Ext + kv_head * stride_keh, V_Ext + kv_head * stride_veh,
                                               (q_start + j).to(tl.int64) * stride_ket,
                                               (q_start + j).to(tl.int64) * stride_vet,
                                               j_ok, offs_dv, offs_r, q.dtype, DRAFT_SHARED, True)
                    else:
                        k = tl.load(
                            K_Ext + (q_start + j).to(tl.int64)[None, :] * stride_ket + kv_head * stride_keh
                            + offs_d[:, None],
                            mask=j_ok[None, :] & d_ok[:, None], other=0.0,
                        )
                        v = tl.load(
                            V_Ext + (q_start + j).to(tl.int64)[:, None] * stride_vet + kv_head * stride_veh
                            + offs_dv[None, :],
                            mask=j_ok[:, None] & dv_ok[None, :], other=0.0,
                        )
                    visible = row_ok[:, None] & j_ok[None, :]
                    if USE_MASK:
                        # Row l of the sequence's mask spans [offset | prefix keys | draft keys].
                        offset = 0
                        if HAS_MASK_OFFSETS:
                            offset = tl.load(Mask_Offsets + b).to(tl.int64)
                        pos = (tl.load(mask_indptr + b).to(tl.int64)
                               + l.to(tl.int64)[:, None] * (offset + n_prefix + n_draft)
                               + offset + n_prefix + j[None, :])
                        in_mask = visible & (pos >= 0) & (pos < mask_len)
                        allowed = tl.load(Mask + pos, mask=in_mask, other=0)
                        visible = in_mask & (allowed != 0)
                    elif IS_CAUSAL:
                        visible = visible & (j[None, :] <= l[:, None])
                    if HAS_WINDOW:
                        visible = visible & (l[:, None] <= j[None, :] + window)
                    if ROPE_DIM > 0:
                        m_i, l_i, acc = _attend_tile_rope(
                            q, q_r, k, k_r, v, visible, qk_scale_draft, m_i, l_i, acc,
                            cap2, temperature, HAS_LOGIT_CAP, HAS_XAI_TEMP, DOT_PRECISION,
                        )
                    else:
                        m_i, l_i, acc = _attend_tile(
                            q, k, v, visible, qk_scale_draft, m_i, l_i, acc,
                            cap2, temperature, HAS_LOGIT_CAP, HAS_XAI_TEMP, DOT_PRECISION,
                        )

        if n_used == 1:
            # 3a. The tile's only program: finish in registers.
            sink2 = 0.0
            if HAS_SINKS:
                sink2 = tl.load(Sinks + h, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
            o, lse2 = _finish(acc, m_i, l_i, sink2, HAS_SINKS)
            out_rows = (q_start + l).to(tl.int64)
            tl.store(O + out_rows[:, None] * stride_ot + h[:, None] * stride_oh + offs_dv[None, :],
                     o.to(O.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])
            if WRITE_LSE:
                tl.store(LSE_Out + out_rows * NUM_Q_HEADS + h, lse2 * 0.6931471805599453, mask=row_ok)
        else:
            # 3b. Publish this slice for the merge (see "Merging"); the sink joins once, in the merge.
            o_s, lse_s = _finish(acc, m_i, l_i, 0.0, False)
            part = (tile.to(tl.int64) * n_splits + split) * BLOCK_M + r
            tl.store(Part_O + part[:, None] * V_HEAD_DIM + offs_dv[None, :], o_s.to(Part_O.dtype.element_ty),
                     mask=dv_ok[None, :])
            tl.store(Part_LSE + part, lse_s)
            if MERGE == 1:  # LAST_PROGRAM
                tl.debug_barrier()  # every thread's stores issued before the release below
                done = tl.atomic_add(Counters + tile, 1, sem="acq_rel", scope="gpu")
                _report(Err, err_slot, b * 16 + ERR_COUNTERS, (done < 0) | (done >= n_used))
                if done == n_used - 1:
                    tl.atomic_xchg(Counters + tile, 0, sem="relaxed", scope="gpu")  # ready for the next launch
                    # The whole tile as one block: rows x every value column.
                    _merge_chunk(O, LSE_Out, Sinks, Part_O, Part_LSE, tile, 0, 0,
                                 m_block, head_tile, q_start, n_draft, n_used, n_splits, stride_ot, stride_oh,
                                 NUM_Q_HEADS, HEADS_PER_TILE, V_HEAD_DIM, BLOCK_M, BLOCK_M, BLOCK_DV,
                                 HAS_SINKS, WRITE_LSE, MERGE_UNROLL)
            if MERGE == 2:  # MERGE_PROGRAMS
                tl.debug_barrier()  # every thread's stores issued before the release below
                tl.atomic_add(Counters + tile, 1, sem="release", scope="gpu")  # one more slice published
    if MERGE == 2:  # MERGE_PROGRAMS
        # 4. Merge programs: wait for the tile's n_used slices, merge one block of rows x columns.
        DV_CHUNKS: tl.constexpr = (V_HEAD_DIM + MERGE_DV - 1) // MERGE_DV
        CHUNKS: tl.constexpr = (BLOCK_M + MERGE_ROWS - 1) // MERGE_ROWS * DV_CHUNKS
        chunk = split - n_splits
        if (chunk >= 0) & (n_used > 1) & has_rows:
            # Every slice program took an earlier ticket, so it is running or done: this wait ends.
            # It is bounded all the same: counters a launch does not own could hold anything.
            seen = tl.atomic_add(Counters + tile, 0, sem="acquire", scope="gpu")
            polls = 0
            while (seen < n_used) & (polls < spin_limit):
                seen = tl.atomic_add(Counters + tile, 0, sem="acquire", scope="gpu")
                polls += 1
            _report(Err, err_slot, b * 16 + ERR_MERGE_WAIT, seen < n_used)
            if seen >= n_used:
                _merge_chunk(O, LSE_Out, Sinks, Part_O, Part_LSE, tile, chunk // DV_CHUNKS, chunk % DV_CHUNKS,
                             m_block, head_tile, q_start, n_draft, n_used, n_splits, stride_ot, stride_oh,
                             NUM_Q_HEADS, HEADS_PER_TILE, V_HEAD_DIM, BLOCK_M, MERGE_ROWS, MERGE_DV,
                             HAS_SINKS, WRITE_LSE, MERGE_UNROLL)
            # The tile's last merge program zeroes its counter for the next launch.
            if tl.atomic_add(Counters + tile, 1, sem="relaxed", scope="gpu") == n_used + CHUNKS - 1:
                tl.atomic_xchg(Counters + tile, 0, sem="relaxed", scope="gpu")
        # The grid's last program zeroes the ticket and exit counters.
        if tl.atomic_add(Counters + n_tiles + 1, 1, sem="acq_rel", scope="gpu") == n_tiles * tl.num_programs(1) - 1:
            tl.atomic_xchg(Counters + n_tiles, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(Counters + n_tiles + 1, 0, sem="relaxed", scope="gpu")
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
