"""Stage 1 of split-KV verify: partial attention over one slice of the keys.

The keys a draft token attends to are split into ``n_splits + 1`` parts:

* parts ``0 .. n_splits-1`` are equal slices of the sequence's prefix (token
  pool slots ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``), every key visible;
* part ``n_splits`` is the sequence's own draft tokens (``k_extend``/``v_extend``
  rows ``qo_indptr[b]:qo_indptr[b+1]``), under the causal or tree mask.

Each program computes, for its slice and its tile of query rows, the softmax
attention restricted to that slice: the normalised partial output ``o_s`` and
its log-sum-exp ``lse_s``. Stage 2 (:mod:`splitkv.merge`) combines the parts
exactly. Because every part is an independent program, a long prefix keeps
``n_splits`` times more of the GPU busy than a serial walk over it.

GQA packing. A KV head serves ``GROUP`` query heads. With packing, one program
takes all of them, times the draft tokens, as the rows of its query tile::

    tile row r  ->  draft token l = r // GROUP,  query head  h = kv_head * GROUP + r % GROUP

so each K/V row it gathers is multiplied against ``GROUP * L`` query rows: the
prefix is read once per KV head instead of once per query head. Rows are
padded to a power of two (at least 16, what a tensor-core dot needs); when
``GROUP * L`` exceeds ``BLOCK_M`` the rows are cut into ``m_blocks`` tiles.
Without packing (``HEADS_PER_TILE = 1``, the seed's layout, kept for teaching
and benchmarking) a program serves one query head and the prefix is read
``GROUP`` times.

Scratch layout (float32, owned by :class:`splitkv.runner.VerifySplitKV`)::

    part_o  [num_tokens, H_Q, n_splits + 1, V_HEAD_DIM]
    part_lse[num_tokens, H_Q, n_splits + 1]         (base-2, see below)

Every program writes every slot it owns, empty slices included (``o = 0``,
``lse = -inf``), so stage 2 never reads memory that this call did not write.

The softmax runs in base 2: scores are pre-multiplied by ``log2(e)`` so the
exponentials are ``exp2`` (one instruction); ``lse`` is stored in the same
base-2 units, ``lse2 = log2(sum_j 2^(s_j))`` (natural ``lse = lse2 * ln 2``).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["split_kv_partials", "TileConfig", "tile_config", "rows_per_tile"]

LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(q, k, v, visible, qk_scale, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """One online-softmax step over a tile of keys.

    ``q [BLOCK_M, D]`` against ``k [D, BLOCK_N]`` (stored transposed), values
    ``v [BLOCK_N, DV]``; ``visible [BLOCK_M, BLOCK_N]`` masks the scores. The
    running row maximum ``m_i`` (base 2), row sum ``l_i`` and unnormalised
    output ``acc`` are rescaled by ``2^(m_old - m_new)`` when the maximum grows.
    A row that has seen no visible key keeps ``m_i = -inf`` and ``l_i = 0``.
    """
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
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
def _split_kv_partials_kernel(
    Q, K_Ext, V_Ext, K_Buf, V_Buf,
    qo_indptr, kv_indptr, kv_indices, Mask, mask_indptr,
    Part_O, Part_LSE,
    qk_scale_prefix,  # sm_scale * k_scale * log2(e)
    qk_scale_draft,  # sm_scale * log2(e)
    v_scale,
    n_splits,
    stride_qt, stride_qh,
    stride_ket, stride_keh,
    stride_vet, stride_veh,
    stride_kbt, stride_kbh,
    stride_vbt, stride_vbh,
    NUM_Q_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    HEADS_PER_TILE: tl.constexpr,  # GROUP (packed) or 1 (one query head per program)
    M_BLOCKS: tl.constexpr,  # row tiles per (sequence, head tile)
    HEAD_DIM: tl.constexpr,
    V_HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_N_DRAFT: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    USE_MASK: tl.constexpr,  # draft visibility from custom_mask
    IS_CAUSAL: tl.constexpr,  # else causal if set, else every draft token visible
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,  # let the merge kernel launch while this grid drains
):
    split = tl.program_id(0)
    tile = tl.program_id(1)
    head_tiles: tl.constexpr = NUM_Q_HEADS // HEADS_PER_TILE
    b = tile // (head_tiles * M_BLOCKS)
    head_tile = (tile // M_BLOCKS) % head_tiles
    m_block = tile % M_BLOCKS
    kv_head = head_tile * HEADS_PER_TILE // GROUP

    q_start = tl.load(qo_indptr + b)
    n_draft = tl.load(qo_indptr + b + 1) - q_start
    kv_start = tl.load(kv_indptr + b)
    n_prefix = tl.load(kv_indptr + b + 1) - kv_start
    if m_block * BLOCK_M >= n_draft * HEADS_PER_TILE:
        return  # this row tile lies past the sequence's draft tokens

    # Query rows: draft token l, query head h (see the module docstring).
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    l = rows // HEADS_PER_TILE
    h = head_tile * HEADS_PER_TILE + rows % HEADS_PER_TILE
    row_ok = l < n_draft
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_ok = offs_d < HEAD_DIM
    dv_ok = offs_dv < V_HEAD_DIM

    q_ptrs = Q + (q_start + l)[:, None] * stride_qt + h[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    if split < n_splits:
        # A prefix slice. Slices are BLOCK_N-aligned so only a slice's last
        # tile is partial; short prefixes leave the last slices empty.
        split_len = tl.cdiv(tl.cdiv(n_prefix, n_splits), BLOCK_N) * BLOCK_N
        lo = split * split_len
        hi = tl.minimum(lo + split_len, n_prefix)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_ok = offs_n < hi
            # Gather: the pool row of key n is kv_indices[kv_start + n].
            slot = tl.load(kv_indices + kv_start + offs_n, mask=n_ok, other=0).to(tl.int64)
            k = tl.load(
                K_Buf + slot[None, :] * stride_kbt + kv_head * stride_kbh + offs_d[:, None],
                mask=n_ok[None, :] & d_ok[:, None], other=0.0,
            )
            v = tl.load(
                V_Buf + slot[:, None] * stride_vbt + kv_head * stride_vbh + offs_dv[None, :],
                mask=n_ok[:, None] & dv_ok[None, :], other=0.0,
            )
            m_i, l_i, acc = _attend_tile(
                q, k.to(q.dtype), v.to(q.dtype), n_ok[None, :], qk_scale_prefix,
                m_i, l_i, acc, DOT_PRECISION,
            )
        acc = acc * v_scale  # fp8 pools: dequantise V once, on the slice's output
    else:
        # The draft block: keys are the sequence's own draft tokens.
        for start in range(0, n_draft, BLOCK_N_DRAFT):
            j = start + tl.arange(0, BLOCK_N_DRAFT)
            j_ok = j < n_draft
            k = tl.load(
                K_Ext + (q_start + j)[None, :] * stride_ket + kv_head * stride_keh + offs_d[:, None],
                mask=j_ok[None, :] & d_ok[:, None], other=0.0,
            )
            v = tl.load(
                V_Ext + (q_start + j)[:, None] * stride_vet + kv_head * stride_veh + offs_dv[None, :],
                mask=j_ok[:, None] & dv_ok[None, :], other=0.0,
            )
            visible = row_ok[:, None] & j_ok[None, :]
            if USE_MASK:
                # Row l of the sequence's mask spans [prefix keys | draft keys].
                mask_row = tl.load(mask_indptr + b) + l.to(tl.int64) * (n_prefix + n_draft)
                allowed = tl.load(
                    Mask + mask_row[:, None] + n_prefix + j[None, :], mask=visible, other=0
                )
                visible = visible & (allowed != 0)
            elif IS_CAUSAL:
                visible = visible & (j[None, :] <= l[:, None])
            m_i, l_i, acc = _attend_tile(
                q, k, v, visible, qk_scale_draft, m_i, l_i, acc, DOT_PRECISION
            )

    # Normalise; an empty slice stores o = 0 and lse = -inf (weight 0 in the merge).
    has_keys = l_i > 0
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))

    slot_row = ((q_start + l) * NUM_Q_HEADS + h) * (n_splits + 1) + split
    tl.store(
        Part_O + slot_row[:, None] * V_HEAD_DIM + offs_dv[None, :],
        o,
        mask=row_ok[:, None] & dv_ok[None, :],
    )
    tl.store(Part_LSE + slot_row, lse, mask=row_ok)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


class TileConfig:
    """Launch shape of the partials kernel (performance only, never results).

    Attributes:
        block_m: query rows per tile (a power of two, at least 16).
        block_n: prefix keys per loop step.
        num_warps: warps per program.
        num_stages: software-pipelining depth of the key loop.
    """

    __slots__ = ("block_m", "block_n", "num_warps", "num_stages")

    def __init__(self, block_m, block_n, num_warps, num_stages):
        self.block_m, self.block_n = block_m, block_n
        self.num_warps, self.num_stages = num_warps, num_stages

    def __repr__(self):
        return (
            f"TileConfig(block_m={self.block_m}, block_n={self.block_n}, "
            f"num_warps={self.num_warps}, num_stages={self.num_stages})"
        )


def rows_per_tile(heads_per_tile: int, max_len_extend: int) -> int:
    """Query rows one (sequence, head tile) needs: heads x draft tokens.

    Args:
        heads_per_tile: query heads per program (the GQA group when packed, else 1).
        max_len_extend: most draft tokens per sequence.

    Returns:
        ``heads_per_tile * max_len_extend``.
    """
    return heads_per_tile * max_len_extend


def tile_config(head_dim: int, v_head_dim: int, rows: int, interpret: bool = False) -> TileConfig:
    """Block sizes for a head configuration.

    ``BLOCK_M`` covers the packed rows (at least 16 for the tensor cores, at
    most 64 to bound the fp32 accumulator ``BLOCK_M x DV``). Wide heads take
    narrower key tiles so K, V and the accumulator fit the register file;
    three pipeline stages keep several gathers in flight.

    Args:
        head_dim: query/key head dimension.
        v_head_dim: value head dimension.
        rows: query rows per (sequence, head tile), see :func:`rows_per_tile`.
        interpret: small tiles for the Triton interpreter.

    Returns:
        The :class:`TileConfig`.
    """
    block_m = min(64, max(16, triton.next_power_of_2(rows)))
    if interpret:
        return TileConfig(block_m, 16, 4, 1)
    widest = max(head_dim, v_head_dim)
    if widest > 128:
        return TileConfig(block_m, 64, 4, 3)
    return TileConfig(block_m, 128 if block_m <= 32 else 64, 4, 3)


def split_kv_partials(
    q_extend, k_extend, v_extend, k_buffer, v_buffer,
    qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, is_causal,
    part_o, part_lse, *,
    batch_size: int, max_len_extend: int, n_splits: int,
    sm_scale: float, k_scale: float, v_scale: float,
    pack_gqa: bool = True, config: TileConfig, pdl: bool = False,
):
    """Launch stage 1 over a ``(n_splits + 1, batch x head tiles x m_blocks)`` grid.

    Takes ``extend_attention_fwd``'s tensors (see :func:`splitkv.verify_splitkv_fwd`),
    the scratch, the batch size, the split count, the scales and the tile shape;
    returns the launch grid.

    ``part_o``/``part_lse`` must hold at least ``num_tokens * H_Q *
    (n_splits + 1)`` rows; their contents on entry do not matter. ``pdl``
    (Hopper and later) lets the next kernel on the stream start launching
    before this one has drained (programmatic dependent launch).
    """
    n_tok, h_q, head_dim = q_extend.shape
    h_kv, v_head_dim = k_extend.shape[1], v_extend.shape[2]
    group = h_q // h_kv
    heads_per_tile = group if pack_gqa else 1
    rows = rows_per_tile(heads_per_tile, max_len_extend)
    m_blocks = triton.cdiv(rows, config.block_m)
    grid = (n_splits + 1, batch_size * (h_q // heads_per_tile) * m_blocks)
    use_mask = custom_mask is not None
    _split_kv_partials_kernel[grid](
        q_extend, k_extend, v_extend, k_buffer, v_buffer,
        qo_indptr, kv_indptr, kv_indices,
        custom_mask if use_mask else kv_indptr,  # placeholder pointer, never read
        mask_indptr if use_mask else kv_indptr,
        part_o, part_lse,
        sm_scale * k_scale * LOG2E, sm_scale * LOG2E, v_scale,
        n_splits,
        q_extend.stride(0), q_extend.stride(1),
        k_extend.stride(0), k_extend.stride(1),
        v_extend.stride(0), v_extend.stride(1),
        k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        NUM_Q_HEADS=h_q,
        GROUP=group,
        HEADS_PER_TILE=heads_per_tile,
        M_BLOCKS=m_blocks,
        HEAD_DIM=head_dim,
        V_HEAD_DIM=v_head_dim,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_N_DRAFT=max(16, min(config.block_n, triton.next_power_of_2(max_len_extend))),
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_DV=triton.next_power_of_2(v_head_dim),
        USE_MASK=use_mask,
        IS_CAUSAL=bool(is_causal),
        DOT_PRECISION="ieee" if q_extend.dtype.is_floating_point and q_extend.element_size() == 4 else None,
        USE_PDL=pdl,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **({"launch_pdl": True} if pdl else {}),
    )
    return grid
