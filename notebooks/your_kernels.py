"""Your split-KV kernels: the one file you edit for notebooks 03 and 04 and the GPU lab.

Replace each ``todo(...)`` line by your code and save; the notebooks reload
this file every time an exercise cell runs, and check what you wrote. Keep
the names and signatures: the checkers, the launchers (``run_slices``,
``run_draft``, ``run_merge`` in ``splitkv.teaching.exercises.kernels``) and
the GPU lab call them as they are.

The layout the kernels share (notebook 03): a *tile* is one sequence and one
KV head; row ``r`` of its ``BLOCK_M`` query rows is draft token ``r // GROUP``
of query head ``kv_head * GROUP + r % GROUP``. Partial states are float32:
``Part_O [tiles * n_parts * BLOCK_M, DV]`` and base-2 ``Part_LSE [tiles *
n_parts * BLOCK_M]``, part ``s`` of tile ``t`` at rows ``(t * n_parts + s) *
BLOCK_M + r``.
"""

import splitkv  # noqa: F401  (before triton: on a CPU the kernels then run in Triton's interpreter)
import triton
import triton.language as tl

from splitkv.teaching.exercises import todo


# Exercise 3.1 -- one online-softmax step over a tile of base-2 scores s [BLOCK_M, BLOCK_N]
# (-inf where hidden) and values v [BLOCK_N, DV]; returns the new (m_i, l_i, acc).
@triton.jit
def tile_step(m_i, l_i, acc, s, v):
    todo("tile_step")


# Exercise 3.2 -- the GQA-packed query tile [BLOCK_M, D] of one KV head; rows past the drafts are 0.
@triton.jit
def load_q_tile(Q, q_start, n_draft, kv_head, stride_qt, stride_qh,
                GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr):
    todo("load_q_tile")


# Exercise 3.3 -- grid (batch, H_kv, n_splits): the partial state of one tile over one slice of its prefix.
@triton.jit
def slice_kernel(Q, K, V, qo_indptr, kv_indptr, kv_indices, Part_O, Part_LSE, qk_scale, n_parts,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                 GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    todo("slice_kernel")


# Exercise 3.4 -- grid (tiles,): merge a tile's n_parts states into O [tiles, BLOCK_M, DV] and the
# natural-log LSE [tiles, BLOCK_M].
@triton.jit
def merge_kernel(Part_O, Part_LSE, O, LSE, n_parts, DV: tl.constexpr, BLOCK_M: tl.constexpr):
    todo("merge_kernel")


# Exercise 4.1 -- grid (batch, H_kv): the partial state of one tile over its draft block, causal or under
# a tree's mask, stored as the tile's last part (n_parts - 1).
@triton.jit
def draft_kernel(Q, K_Ext, V_Ext, qo_indptr, kv_indptr, Mask, mask_indptr, Part_O, Part_LSE,
                 qk_scale, n_parts, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                 GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_L: tl.constexpr, TREE: tl.constexpr):
    todo("draft_kernel")
