"""MLA verify for sm_90 in Gluon: two warpgroups share one score tile.

What it computes is the split path's MLA verify (:mod:`splitkv.kernels.verify`,
"MLA"): one KV head whose key is ``[latent (DV = 512) | rope (ROPE_DIM = 64)]``
and whose value is the latent itself, every query head and draft token of a
sequence in one tile of ``BLOCK_M = 64`` rows::

    tile row r  ->  draft token l = r // NUM_Q_HEADS,  query head h = r % NUM_Q_HEADS

(with 128 heads a tile holds one draft token's 64 heads; with 16 heads, 4
draft tokens' 16). The grid, the slices of the prefix, the partial outputs
and their LSEs are the verify kernel's (``_tile_slices``, ``Part_O`` /
``Part_LSE`` in its layout), so its second merge launch (``_merge_kernel``)
combines them unchanged; a tile with one slice writes its output itself.

Why a second kernel. Triton's ``tl.dot`` lays the chained 64-row dots of an
8-warp program out by rows (``warpsPerCTA = [8, 1]``), but 64 rows are one
warpgroup's worth of ``wgmma`` rows: both warpgroups compute the whole score
tile ``[64, BLOCK_N]`` over 576 columns, twice in all. Here the warpgroups
split *columns* (``NVMMADistributedLayout(warps_per_cta=[4, 2])``)::

    S [64, BLOCK_N]   = Q [64, 576] K^T        warpgroup w: key columns  w * BLOCK_N/2 + [0, BLOCK_N/2)
    O [64, DV]       += P [64, BLOCK_N] V       warpgroup w: value columns w * DV/2 + [0, DV/2)

so each score is computed once. The softmax needs whole rows: the row max
and row sum reduce across both warpgroups (through shared memory, which the
compiler arranges), and P goes through shared memory (bf16), where each
warpgroup writes its key columns and reads all of them as the A operand of
its half of ``P V``. Tensor work per key: ``2 * 64 * (576 + 512)`` flops,
none duplicated (the ``tl`` kernel does ``2 * 64 * (2 * 576 + 512)``).

Shared memory, per program::

    q_smem  [64, DV] + qr_smem [64, ROPE_DIM]            the query tile, loaded once (bf16)
    kv_smem [STAGES, BLOCK_N, DV]                        latent rows: K's first chunk and V, loaded once
    kr_smem [STAGES, BLOCK_N, ROPE_DIM]                  rope rows: K's second chunk
    p_smem  [1 or 2, 64, BLOCK_N]                        the probabilities, bf16 (2 with OVERLAP)

(an fp8 cache: kv_smem / kr_smem hold fp8 rows as copied, and one more bf16
stage, kv16 / kr16, the widened tile ``wgmma`` reads)

all in NVMMA layouts (128-byte swizzle), the layouts ``wgmma`` reads. The
score dot reads a latent tile transposed (``permute``: K-major B), the value
dot reads the same bytes as they are (N-major B): each latent row is gathered
once and used twice.

Pipeline. Key rows are gathered through ``kv_indices`` (token slots, or page
ids of a paged pool) with ``cp.async`` (16 bytes per copy; rows past the slice
or whose slot or page is out of range are zero-filled, moving no bytes, and
masked out of the scores), ``STAGES - 1`` key tiles
ahead of the tile being computed; one commit group per tile, so "tile ``i``
has landed" is ``wait_group(STAGES - 2)``. Each step:

1. wait for tile ``i``'s copies, fence them to the async proxy (``wgmma``
   reads shared memory through it), barrier: tile ``i`` is visible to every
   warp, and every warp has finished step ``i - 1`` (its reads of the stage
   about to be refilled, and of ``p_smem``);
2. issue tile ``i + STAGES - 1``'s copies into the stage step ``i - 1`` read;
3. ``S = Q_latent K_latent^T + Q_rope K_rope^T`` (two ``wgmma``, one
   accumulator), scale, mask, online softmax in base 2 (scores pre-multiplied
   by ``log2 e``, as in the ``tl`` kernel);
4. P to ``p_smem``, fence, barrier; rescale ``O`` by ``2^(m_old - m_new)``;
   ``O += P V``.

In this, the smallest version, each ``wgmma`` is waited for at once, and no
warp is specialised. With ``OVERLAP`` (``STAGES >= 3``, P double-buffered)
step ``i`` issues tile ``i + 1``'s score ``wgmma``, then tile ``i``'s ``P V``,
waits for the scores only (``wgmma`` groups complete in order, so one
outstanding group is the ``P V``) and computes tile ``i + 1``'s softmax while
the tensor cores run ``P V``: FlashAttention-3's overlap within a warpgroup.

The last slice's program also takes the draft block: the draft rows
(``k_extend``, values their latent columns) come through the same stages,
with the draft score scale, visible through a tree (``Mask``, rows laid out
as the verify kernel's), causally (draft ``j`` visible to row ``l`` iff
``j <= l``) or all.

An fp8 (e4m3) latent cache is copied as it is into plain staging stages and
widened, one tile a step, into a single bf16 stage that ``wgmma`` reads (e4m3
is exact in bf16); ``k_scale`` sits in the prefix's score scale and
``v_scale`` multiplies the slice's output. It takes the tiles without
``OVERLAP``.

Limits, checked by the host (:mod:`splitkv.gluon_mla`): bf16 queries, drafts
and output; values a view of the keys' latent columns, in the pool and in the
draft block; no sinks, windows, soft cap, xai temperature, window mask
offsets or checked mode; the output's partials in bf16 (``O`` bf16).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from .common import _tile_slices

#: A barrier across the program's threads: ``thread_barrier`` in Triton 3.6, ``barrier`` in 3.9.
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

#: cp.async into shared memory: ``async_copy_global_to_shared`` in Triton 3.6, ``async_load`` in 3.9.
_cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

#: Rows of a tile (heads x drafts; the host reads ``BLOCK_M.value``) and warps of a program: two warpgroups.
BLOCK_M = gl.constexpr(64)
NUM_WARPS = 8


@gluon.jit
def _gather_rows(dst, Base, row, ok, COLS: gl.constexpr, layout: gl.constexpr):
    """``cp.async`` of ``COLS`` columns of the rows at element offsets ``row`` (from ``Base``) into
    ``dst`` ``[rows, COLS]``; rows with ``ok`` false are zero-filled (``cp.async`` with source size 0)."""
    cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    _cp_async(dst, Base + row[:, None] + cols[None, :], mask=ok[:, None])


@gluon.jit
def _key_rows(Index, n, n_keys, pool_tokens, stride_t, stride_r, PAGE_SIZE: gl.constexpr):
    """Where keys ``n`` of a sequence live: ``(row, ok)``, each key's element offset in the pool and
    whether it is a real key (``n < n_keys``, its slot or page inside the pool).

    Token pool (``PAGE_SIZE`` 1): key ``n`` is slot ``Index[n]``. Paged pool: row ``n % PAGE_SIZE``
    of page ``Index[n // PAGE_SIZE]``. A slot or page outside ``[0, pool_tokens)`` is never
    dereferenced: its key counts as absent (its copy moves 0 bytes and zero-fills).
    """
    ok = n < n_keys
    if PAGE_SIZE == 1:
        slot = gl.load(Index + n, mask=ok, other=0)
        ok = ok & (slot >= 0) & (slot < pool_tokens)
        row = slot.to(gl.int64) * stride_t
    else:
        page = gl.load(Index + n // PAGE_SIZE, mask=ok, other=0)
        ok = ok & (page >= 0) & (page < pool_tokens)
        row = page.to(gl.int64) * stride_t + (n % PAGE_SIZE).to(gl.int64) * stride_r
    return row, ok


@gluon.jit
def _load_keys(kv_dst, kr_dst, Base, first, n_keys, stride_t, stride_r, Index, pool_tokens, PAGE_SIZE: gl.constexpr,
               BLOCK_N: gl.constexpr, DV: gl.constexpr, ROPE_DIM: gl.constexpr,
               lat_layout: gl.constexpr, rope_layout: gl.constexpr):
    """Issue the copies of keys ``first + [0, BLOCK_N)`` (those that are real keys, see ``_key_rows``;
    the others zero-filled) into one stage: latent columns to ``kv_dst``, rope columns to ``kr_dst``.

    ``PAGE_SIZE`` 0: the keys are rows ``n`` of ``Base`` (the draft block). The slots are loaded once
    per layout (the latent and rope copies spread rows over threads differently); the second load
    hits L1.
    """
    n_lat = first + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, lat_layout))
    n_rope = first + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, rope_layout))
    if PAGE_SIZE == 0:
        ok_lat = n_lat < n_keys
        ok_rope = n_rope < n_keys
        r_lat = n_lat.to(gl.int64) * stride_t
        r_rope = n_rope.to(gl.int64) * stride_t
    else:
        r_lat, ok_lat = _key_rows(Index, n_lat, n_keys, pool_tokens, stride_t, stride_r, PAGE_SIZE)
        r_rope, ok_rope = _key_rows(Index, n_rope, n_keys, pool_tokens, stride_t, stride_r, PAGE_SIZE)
    _gather_rows(kv_dst, Base, r_lat, ok_lat, DV, lat_layout)
    _gather_rows(kr_dst, Base, r_rope + DV, ok_rope, ROPE_DIM, rope_layout)


@gluon.jit
def _keys_ok(Index, first, n_keys, pool_tokens, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
             s_layout: gl.constexpr):
    """Keys ``first + [0, BLOCK_N)`` as the score tile's columns, and which of them are real keys."""
    n = first + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    if PAGE_SIZE == 0:
        ok = n < n_keys
    else:
        _, ok = _key_rows(Index, n, n_keys, pool_tokens, 0, 0, PAGE_SIZE)
    return n, ok


@gluon.jit
def _softmax(s, visible, qk_scale, m_i, l_i, p_smem):
    """The online-softmax step on a score tile ``s`` (see the module docstring): returns ``(m_new, l_new,
    alpha)``, ``alpha = 2^(m_old - m_new)`` the factor the output must be rescaled by before this tile's
    ``P V``; P (bf16) is stored to ``p_smem`` and fenced for ``wgmma`` (the caller barriers)."""
    s = gl.where(visible, s * qk_scale, float("-inf"))
    # The row max and sum reduce across both warpgroups (each holds half the key columns).
    m_new = gl.maximum(m_i, gl.max(s, 1))
    # Shift by 0 where a row is still empty: avoids (-inf) - (-inf) = NaN.
    m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_shift)
    p = gl.exp2(s - m_shift[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    p_smem.store(p.to(gl.bfloat16))
    fence_async_shared()
    return m_new, l_i, alpha


@gluon.jit
def _rescale(acc, alpha, o_layout: gl.constexpr):
    """``acc * alpha[:, None]``: the score and output layouts spread rows alike (both [4, 2] warps,
    16-row instructions), so ``alpha`` changes layout without moving."""
    return acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout), assert_trivial=True)[:, None]


@gluon.jit
def _scores(q_smem, qr_smem, kv, kr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """Issue ``S = Q_latent K_latent^T + Q_rope K_rope^T`` (asynchronous ``wgmma``; wait for the result)."""
    s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    s = warpgroup_mma(q_smem, kv.permute((1, 0)), s, use_acc=False, is_async=True)
    return warpgroup_mma(qr_smem, kr.permute((1, 0)), s, is_async=True)


@gluon.jit
def _attend(q_smem, qr_smem, kv, kr, p_smem, visible, qk_scale, m_i, l_i, acc,
            BLOCK_N: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr):
    """One online-softmax step over a key tile held in shared memory: the scores' two ``wgmma`` (latent
    and rope chunks) waited for together, then ``P V`` waited for."""
    s = _scores(q_smem, qr_smem, kv, kr, BLOCK_N, s_layout)
    s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
    m_i, l_i, alpha = _softmax(s, visible, qk_scale, m_i, l_i, p_smem)
    _cta_barrier()  # both warpgroups' key columns of P written
    acc = warpgroup_mma(p_smem, kv, _rescale(acc, alpha, o_layout))
    return m_i, l_i, acc


@gluon.jit
def _landed(n_outstanding: gl.constexpr):
    """Wait until at most ``n_outstanding`` copy groups are pending (this thread's), make the landed
    bytes visible to ``wgmma`` (async proxy), and barrier so every thread's copies are."""
    async_copy.wait_group(n_outstanding)
    fence_async_shared()
    _cta_barrier()


@gluon.jit(do_not_specialize=["lse_offset", "num_tokens", "pool_tokens", "kv_len", "mask_len", "n_splits",
                               "min_split"])
def _gluon_mla_kernel(
    Q, K_Ext, K_Buf, O, LSE_Out,
    qo_indptr, kv_indptr, kv_indices, Last_Page_Len, Mask, mask_indptr,
    Part_O, lse_offset,  # scratch: partial outputs (bf16), then (at lse_offset float32 words) partial LSEs
    qk_scale_prefix,  # sm_scale * k_scale * log2(e)
    qk_scale_draft,  # sm_scale * log2(e)
    v_scale,
    num_tokens,  # rows of q/k_extend and the output
    pool_tokens,  # slots (token pool) or pages (paged pool) of k_buffer
    kv_len,  # entries of kv_indices
    mask_len,  # entries of Mask
    n_splits,  # grid axis 1
    min_split,  # fewest keys per slice (a multiple of BLOCK_N)
    stride_qt, stride_qh,
    stride_ket,  # k_extend: one KV head, so the head stride never enters
    stride_kbt, stride_kbr,  # k_buffer: per slot (or page), per row within a page
    stride_ot, stride_oh,
    NUM_Q_HEADS: gl.constexpr,
    M_BLOCKS: gl.constexpr,  # row blocks per sequence: cdiv(NUM_Q_HEADS * max drafts, BLOCK_M)
    DV: gl.constexpr,  # latent width, the value head dim (512)
    ROPE_DIM: gl.constexpr,  # rope width (64)
    BLOCK_N: gl.constexpr,  # keys per tile
    STAGES: gl.constexpr,  # key tiles in shared memory (>= 2; >= 3 with OVERLAP)
    OVERLAP: gl.constexpr,  # the softmax of one key tile overlaps the P V of the one before
    PAGE_SIZE: gl.constexpr,  # 1: token pool (kv_indices are slots); else kv_indices are page ids
    USE_MASK: gl.constexpr,  # the draft block's visibility from Mask (a tree)
    IS_CAUSAL: gl.constexpr,  # without USE_MASK: a causal chain, else every draft visible
    WRITE_LSE: gl.constexpr,
):
    gl.static_assert(gl.num_warps() == 8, "two warpgroups")
    POOL_FP8: gl.constexpr = K_Buf.dtype.element_ty.primitive_bitwidth == 8  # an fp8 (e4m3) latent cache
    gl.static_assert(STAGES >= 3 if OVERLAP else STAGES >= 2)
    tile = gl.program_id(0)
    split = gl.program_id(1)
    b, head_tile, m_block, q_start, n_draft, kv_start, n_prefix, first_key, split_len, n_used = _tile_slices(
        tile, qo_indptr, kv_indptr, Last_Page_Len, num_tokens, kv_len, n_splits, min_split, 0,
        1, M_BLOCKS, BLOCK_N, 0, PAGE_SIZE, False)
    if (split < n_used) & (m_block * BLOCK_M < n_draft * NUM_Q_HEADS):
        # Layouts. Scores [64, BLOCK_N] and output [64, DV]: wgmma accumulators, warpgroups side by
        # side (warps_per_cta [4, 2]): each owns half the columns, every row.
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                           instr_shape=[16, BLOCK_N // 2, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                           instr_shape=[16, DV // 2, 16])
        # Gathers: 8 bf16 (16 bytes, one cp.async) per thread, a warp along a row.
        lat_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
        rope_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (ROPE_DIM // 8), ROPE_DIM // 8], [8, 1], [1, 0])
        lat_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, DV], gl.bfloat16)
        rope_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROPE_DIM], gl.bfloat16)

        q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, DV],
                                           gl.NVMMASharedLayout.get_default_for([BLOCK_M, DV], gl.bfloat16))
        qr_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, ROPE_DIM],
                                            gl.NVMMASharedLayout.get_default_for([BLOCK_M, ROPE_DIM], gl.bfloat16))
        if POOL_FP8:
            # fp8 rows land as copied in plain staging stages; each step widens one to bf16 into the
            # one stage wgmma reads (kv16 / kr16), which the draft block also fills (its rows are bf16).
            # The copies' layouts (16 and 8 bytes a copy) read back what each thread copied.
            gl.static_assert(not OVERLAP, "an fp8 pool takes the tiles without OVERLAP")
            pool_lat: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [8, 1], [1, 0])
            pool_rope: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
            staging: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
            kv_smem = gl.allocate_shared_memory(K_Buf.dtype.element_ty, [STAGES, BLOCK_N, DV], staging)
            kr_smem = gl.allocate_shared_memory(K_Buf.dtype.element_ty, [STAGES, BLOCK_N, ROPE_DIM], staging)
            kv16 = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_N, DV], lat_smem)
            kr16 = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_N, ROPE_DIM], rope_smem)
        else:
            pool_lat: gl.constexpr = lat_layout
            pool_rope: gl.constexpr = rope_layout
            kv_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, DV], lat_smem)
            kr_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, ROPE_DIM], rope_smem)
            kv16 = kv_smem
            kr16 = kr_smem
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [2 if OVERLAP else 1, BLOCK_M, BLOCK_N],
                                           gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.bfloat16))

        # The query tile, one commit group ahead of the keys': row r is draft l, head h.
        r_lat = m_block * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, lat_layout))
        r_rope = m_block * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, rope_layout))
        l_lat = r_lat // NUM_Q_HEADS
        l_rope = r_rope // NUM_Q_HEADS
        q_row_lat = (q_start + l_lat).to(gl.int64) * stride_qt + (r_lat % NUM_Q_HEADS) * stride_qh
        q_row_rope = (q_start + l_rope).to(gl.int64) * stride_qt + (r_rope % NUM_Q_HEADS) * stride_qh + DV
        _gather_rows(q_smem, Q, q_row_lat, l_lat < n_draft, DV, lat_layout)
        _gather_rows(qr_smem, Q, q_row_rope, l_rope < n_draft, ROPE_DIM, rope_layout)
        async_copy.commit_group()

        # Rows in the accumulators' layouts.
        rows_s = m_block * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        l_s = rows_s // NUM_Q_HEADS
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([BLOCK_M, DV], gl.float32, o_layout)

        # 1. This slice of the prefix, every key visible.
        lo = first_key + split * split_len
        hi = gl.minimum(lo + split_len, n_prefix)
        Index = kv_indices + kv_start
        n_tiles = gl.cdiv(hi - lo, BLOCK_N)
        for t in gl.static_range(STAGES - 1):  # prologue: tiles 0 .. STAGES - 2 (past the slice: empty)
            _load_keys(kv_smem.index(t), kr_smem.index(t), K_Buf, lo + t * BLOCK_N, hi, stride_kbt, stride_kbr,
                       Index, pool_tokens, PAGE_SIZE, BLOCK_N, DV, ROPE_DIM, pool_lat, pool_rope)
            async_copy.commit_group()
        if OVERLAP:
            # Tile 0's scores and probabilities first; then step i issues tile i + 1's scores, then
            # tile i's P V, waits for the scores only (wgmma groups complete in order), and computes
            # tile i + 1's softmax while P V runs. P is double-buffered; the tile after the slice is
            # all masked (its P is zero and never used; its alpha is 1).
            _landed(STAGES - 2)
            s = _scores(q_smem, qr_smem, kv_smem.index(0), kr_smem.index(0), BLOCK_N, s_layout)
            s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
            _, n_ok = _keys_ok(Index, lo, hi, pool_tokens, PAGE_SIZE, BLOCK_N, s_layout)
            m_i, l_i, alpha = _softmax(s, n_ok[None, :], qk_scale_prefix, m_i, l_i, p_smem.index(0))
            for i in range(n_tiles):
                # Tile i + 1 landed, every warp's P_i written and P V of tile i - 1 done.
                _landed(STAGES - 3)
                ahead = i + STAGES - 1
                _load_keys(kv_smem.index(ahead % STAGES), kr_smem.index(ahead % STAGES), K_Buf,
                           lo + ahead * BLOCK_N, hi, stride_kbt, stride_kbr, Index, pool_tokens, PAGE_SIZE,
                           BLOCK_N, DV, ROPE_DIM,
                           lat_layout, rope_layout)
                async_copy.commit_group()
                s = _scores(q_smem, qr_smem, kv_smem.index((i + 1) % STAGES), kr_smem.index((i + 1) % STAGES),
                            BLOCK_N, s_layout)
                acc = warpgroup_mma(p_smem.index(i % 2), kv_smem.index(i % STAGES), _rescale(acc, alpha, o_layout),
                                    is_async=True)
                s = warpgroup_mma_wait(num_outstanding=1, deps=[s])
                _, n_ok = _keys_ok(Index, lo + (i + 1) * BLOCK_N, hi, pool_tokens, PAGE_SIZE, BLOCK_N,
                                   s_layout)
                m_i, l_i, alpha = _softmax(s, n_ok[None, :], qk_scale_prefix, m_i, l_i,
                                           p_smem.index((i + 1) % 2))
                acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        else:
            for i in range(n_tiles):
                _landed(STAGES - 2)
                ahead = i + STAGES - 1
                _load_keys(kv_smem.index(ahead % STAGES), kr_smem.index(ahead % STAGES), K_Buf,
                           lo + ahead * BLOCK_N, hi, stride_kbt, stride_kbr, Index, pool_tokens, PAGE_SIZE,
                           BLOCK_N, DV, ROPE_DIM, pool_lat, pool_rope)
                async_copy.commit_group()
                if POOL_FP8:
                    # Widen tile i (e4m3 is exact in bf16; the scales stay in the score scale and on
                    # the output). Every warp's reads of kv16 in step i - 1 are done (the barrier above).
                    kv16.index(0).store(kv_smem.index(i % STAGES).load(pool_lat).to(gl.bfloat16))
                    kr16.index(0).store(kr_smem.index(i % STAGES).load(pool_rope).to(gl.bfloat16))
                    fence_async_shared()
                    _cta_barrier()
                    kv_t = kv16.index(0)
                    kr_t = kr16.index(0)
                else:
                    kv_t = kv_smem.index(i % STAGES)
                    kr_t = kr_smem.index(i % STAGES)
                _, n_ok = _keys_ok(Index, lo + i * BLOCK_N, hi, pool_tokens, PAGE_SIZE, BLOCK_N, s_layout)
                m_i, l_i, acc = _attend(q_smem, qr_smem, kv_t, kr_t, p_smem.index(0), n_ok[None, :], qk_scale_prefix,
                                        m_i, l_i, acc, BLOCK_N, s_layout, o_layout)
        acc = acc * v_scale  # the pool's value scale, on the slice's output
        async_copy.wait_group(0)  # the prologue's copies past the slice (empty, but in flight)
        _cta_barrier()  # every warp done with the stages before the draft block refills them

        # 2. The last slice's program also takes the draft block (rows q_start .. of k_extend).
        if split == n_used - 1:
            K_Draft = K_Ext + q_start.to(gl.int64) * stride_ket
            for start in range(0, n_draft, BLOCK_N):
                _load_keys(kv16.index(0), kr16.index(0), K_Draft, start, n_draft, stride_ket, 0, Index,
                           pool_tokens, 0, BLOCK_N, DV, ROPE_DIM, lat_layout, rope_layout)
                async_copy.commit_group()
                _landed(0)
                j, j_ok = _keys_ok(Index, start, n_draft, pool_tokens, 0, BLOCK_N, s_layout)
                visible = (l_s < n_draft)[:, None] & j_ok[None, :]
                if USE_MASK:
                    # Row l of the sequence's mask spans [prefix keys | draft keys] (as in the verify kernel),
                    # from mask_indptr[b]: entry l * (n_prefix + n_draft) + n_prefix + j of the block.
                    base = gl.load(mask_indptr + b).to(gl.int64)
                    rel = l_s[:, None] * (n_prefix + n_draft) + n_prefix + j[None, :]
                    in_mask = visible & (base >= 0) & (rel < mask_len - base)
                    visible = in_mask & (gl.load(Mask + base + rel, mask=in_mask, other=0) != 0)
                elif IS_CAUSAL:
                    visible = visible & (j[None, :] <= l_s[:, None])
                m_i, l_i, acc = _attend(q_smem, qr_smem, kv16.index(0), kr16.index(0), p_smem.index(0), visible,
                                        qk_scale_draft, m_i, l_i, acc, BLOCK_N, s_layout, o_layout)
                _cta_barrier()  # every warp done with stage 0 and P before the next draft tile

        # 3. Normalise: the output itself (one slice), or this slice's partial for the merge.
        row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
        m_o = gl.convert_layout(m_i, row_layout, assert_trivial=True)
        l_o = gl.convert_layout(l_i, row_layout, assert_trivial=True)
        has = l_o != 0  # NaN stays NaN, as in the oracle
        o = acc / gl.where(has, l_o, 1.0)[:, None]
        lse2 = gl.where(has, m_o + gl.log2(gl.where(has, l_o, 1.0)), float("-inf"))
        r = gl.arange(0, BLOCK_M, layout=row_layout)
        rows = m_block * BLOCK_M + r
        l = rows // NUM_Q_HEADS
        h = rows % NUM_Q_HEADS
        row_ok = l < n_draft
        cols = gl.arange(0, DV, layout=gl.SliceLayout(0, o_layout))
        if n_used == 1:
            out_rows = (q_start + l).to(gl.int64)
            gl.store(O + out_rows[:, None] * stride_ot + (h * stride_oh)[:, None] + cols[None, :],
                     o.to(O.dtype.element_ty), mask=row_ok[:, None])
            if WRITE_LSE:
                gl.store(LSE_Out + out_rows * NUM_Q_HEADS + h, lse2 * 0.6931471805599453, mask=row_ok)
        else:
            # The verify kernel's scratch layout (splitkv.kernels.verify, "Merging"): bf16 partials
            # in the first half of the float32 region, LSEs (base 2) at lse_offset.
            part = (tile.to(gl.int64) * n_splits + split) * BLOCK_M + r
            Part_O16 = Part_O.to(gl.pointer_type(gl.bfloat16))
            gl.store(Part_O16 + part[:, None] * DV + cols[None, :], o.to(gl.bfloat16))
            gl.store(Part_O + lse_offset + part, lse2)
