"""Runner and plan: work out a verify launch once, then only launch.

A :class:`VerifySplitKV` is made once per head configuration (query/KV heads,
head dims, most draft tokens). Its :meth:`~VerifySplitKV.plan` takes one
step's metadata (``qo_indptr``, ``kv_indptr``, ``kv_indices``, the mask, the
scales) and the layout of the step's tensors, checks them, and fixes
everything that does not change from layer to layer: the split count, the
tile shape, the grid, the kernel's integer and constexpr arguments, the
compiled kernel. :meth:`VerifyPlan.run` then takes a layer's tensors and
launches, with almost no Python in between. This is the shape of
FlashInfer's wrappers: plan once per step, run once per layer.

Scratch. A call whose prefixes are cut into several slices needs float32
scratch for the slices' partial outputs and LSEs, plus int32 counters: one
per tile, which the kernel's last program uses to find out it is last, or its
merge programs to wait for the slices, and two more for the merge programs'
tickets and exit count (see "Merging" in :mod:`splitkv.kernel`; :func:`merge_mode`
says which a launch uses). Two ways to provide them:

* default: the partials come from PyTorch's caching allocator on every run
  (on a GPU as a raw block of the run's stream, freed once the launches are
  queued: no tensor is made). Under CUDA-graph capture that memory belongs
  to the graph's private pool and keeps its address for every replay; on two
  streams at once each call gets its own; and it returns to the cache when
  the call is over, so memory never grows with streams or batch sizes. The
  counters must start at zero and be kept between calls: eager launches on
  a stream share a slice (4 bytes per tile) of a per-device arena, each
  captured launch gets a slice of its own (:func:`counters`), and every
  launch leaves its counters zeroed. The merge in a second launch
  (``SEPARATE_MERGE``) needs no counters.
* a caller-owned ``workspace`` (see :func:`workspace_bytes`), for engines
  that allocate everything up front: counters and partials are carved from
  it, nothing is allocated per call. The runner zeroes the counters when it
  binds the workspace (it may hold anything); one runner's workspace must
  not be used on two streams at once (the kernel reports counters it finds
  corrupted, :mod:`splitkv.errors`).
"""

from __future__ import annotations

import math
import threading
from typing import Dict, Optional, Tuple

import torch

from .checks import (check_batch_invariant, check_features, check_mode, check_output, check_verify_inputs,
                     check_verify_values, device_index, interpreting)
from .kernel import (LAST_PROGRAM, LOG2E, MERGE_PROGRAMS, SEPARATE_MERGE, TileConfig, _merge_kernel, _verify_kernel,
                     block_m_for, rows_per_tile, tile_config)
from .launch import Launcher, _specialization, alignment_bits
from .resources import device_shared_memory, fit_tile, shared_memory_reason
from .occupancy import head_tiles as count_head_tiles
from .errors import error_word, raise_pending
from .splits import (MAX_GRID_SPLITS, MAX_SPLITS, LaunchLimitError, choose_n_splits, device_sm_count, fixed_n_splits,
                     launch_limit_reason, one_wave_n_splits)
from .tuning import min_split_tokens, programs_per_sm, small_batch_tile

__all__ = ["VerifySplitKV", "VerifyPlan", "workspace_bytes", "counters"]

#: Counters per (device, stream): ``{(device index, raw stream handle): int32 tensor}``.
_COUNTERS: Dict[Tuple[int, int], torch.Tensor] = {}
#: Smallest counter array allocated (tiles); arrays grow by doubling.
_MIN_COUNTERS = 4096
#: Most partial-output floats (``n_splits x BLOCK_M x Dv``) one tile's last
#: program merges by itself (one launch). Past it that program's serial read
#: of every slice (256 KB here) costs more than spreading the merge over a
#: second, PDL-overlapped launch. Measured on the H200 at batch 1, 4k-64k:
#: Llama-3-8B (31 slices x 16 rows x 128 = 63k floats) 21.2 us in one launch
#: vs 24.3 spread; Qwen3-Next (254k) 43.3 vs 29.7 (spread with merge programs
#: of 8 rows, before the 4-row ones below).
FUSED_MAX_MERGE = 65536
#: Largest ``BLOCK_M`` merged in one launch. Measured on the H200 (CUDA-graph
#: replays, 2026-12-01, batch 1-8, 1k-64k, 4-row merge programs): Llama-3-8B's
#: 16-row tiles were 1-1.4 us faster in one launch at every point (4-16 slices);
#: Qwen3-32B's 32-row tiles were 1-4 us faster spread from 8 slices on (batch 1 /
#: 4k: 23.8 -> 20.9 us; batch 2 / 64k: 169.5 -> 159.9) and equal at 4 slices.
FUSED_MAX_BLOCK_M = 16
#: The spread merge's program shape: tile rows x value columns. Measured on the
#: H200 (Qwen3-Next, CUDA-graph replays of the whole call, 2026-11-30): 4 x 32
#: took 25.8 / 43.1 / 42.8 us at batch 1 / 4k, batch 1 / 16k and batch 8 / 4k,
#: where 8 x 32 took 28.2 / 50.0 / 45.4 (2 x 64 and 4 x 16 within 0.3 us of 4 x 32
#: at batch 1; 16 x 16 slower still). Loading more slices per step
#: (``MERGE_UNROLL`` 16-64 instead of 4) was no faster.
MERGE_ROWS, MERGE_DV = 4, 32
#: Merge programs inside the verify grid (``MERGE_PROGRAMS``, with the verify
#: kernel's warps) each merge a block of rows x ``GRID_MERGE_DV`` value columns:
#: ``GRID_MERGE_ROWS[0]`` rows in launches of at most ``GRID_MERGE_FEW`` slices,
#: else ``GRID_MERGE_ROWS[1]`` (:func:`grid_merge_rows`). Measured on the H200
#: (bf16, CUDA-graph replays, 2026-12-01), against 4 x 32 and 16 x 64 blocks and
#: the second launch: 8 x 64 was fastest with many slices (Qwen3-Next batch 1 /
#: 4k, 31 slices: 23.6 us, 16 x 64 24.3, 4 x 32 26.0, second launch 24.8), 16 x 64
#: with few (Qwen3-Next batch 32 / 1k, 4 slices: 42.6, 8 x 64 47.4, second
#: launch 42.2; Qwen3-32B batch 8 / 4k: 54.3, 56.6, 54.6).
GRID_MERGE_ROWS = (16, 8)
#: Value columns per merge program in the verify grid (see ``GRID_MERGE_ROWS``).
GRID_MERGE_DV = 64
#: Most slices for which merge programs take ``GRID_MERGE_ROWS[0]`` rows (see ``GRID_MERGE_ROWS``).
GRID_MERGE_FEW = 8
#: Counters past a launch's tiles that the merge programs' launch uses: the ticket and the exit count.
GRID_COUNTERS = 2
#: Polls a merge program makes of its tile's counter before it gives up and reports
#: ``ERR_MERGE_WAIT`` (seconds of polling; a healthy wait ends within a slice's time).
SPIN_LIMIT = 1 << 24
#: Pools whose every element offset is below this gather in 32-bit address
#: arithmetic (the kernel's ``OFFSETS_32``), larger ones in 64-bit. Measured on
#: the H200 (bf16, batch 8 / 64k, CUDA-graph replays, 2026-12-01): Qwen3-Next
#: (256-dim, 2 KV heads) in pages of 16 285.6 -> 275.5 us and of 64 275.4 ->
#: 266.7 (``python -m splitkv.bench_breadth`` before and after); from a token
#: pool 320.0 -> 317.8 there, 319.9 -> 307.2 in an A/B probe in one process;
#: the 128-dim models within 1 % in the probe. The kernel uses fewer registers
#: (Qwen3-Next's token-pool tile 221 -> 201).
OFFSETS_32_LIMIT = 2**31


def pool_offsets_32(buf: torch.Tensor) -> bool:
    """Whether every element of pool ``buf`` lies within :data:`OFFSETS_32_LIMIT` of its start."""
    return sum((n - 1) * s for n, s in zip(buf.shape, buf.stride())) < OFFSETS_32_LIMIT


def _stream_key(device: torch.device) -> Tuple[int, int]:
    if device.type != "cuda":
        return (-1, threading.get_ident())  # the interpreter runs a launch on the calling thread
    index = device_index(device)
    return (index, torch._C._cuda_getCurrentRawStream(index))


#: Per device: ``[zeroed int32 arena, next free entry]``; per-stream counters are cut from it.
_ARENAS: Dict[int, list] = {}
#: Counters per arena (4 MB): room for many streams' arrays and captured launches.
ARENA_COUNTERS = 1 << 20
#: Guards the arenas and the per-stream table when they change (never on a call's fast path).
_LOCK = threading.Lock()


# The caching allocator's raw blocks (CUDA builds of PyTorch): an address, no tensor. A
# run's partials need nothing more, and a tensor's construction and destruction cost more
# than the alloc / delete pair (2 MB on a slower CPU of the H200's host, 2026-12-01: 4.6-4.8 µs
# against 1.6-1.8; the whole call 2.2-6.3 µs faster in an A/B, see docs/benchmarks.md).
_raw_alloc = getattr(torch._C, "_cuda_cudaCachingAllocator_raw_alloc", None)
_raw_delete = getattr(torch._C, "_cuda_cudaCachingAllocator_raw_delete", None)
_current_device = getattr(torch._C, "_cuda_getDevice", None)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def counters(device: torch.device, tiles: int, stream_key: Optional[Tuple[int, int]] = None
             ) -> Optional[torch.Tensor]:
    """Zeroed tile counters (at least ``tiles``) for a launch on ``device``'s current stream, or ``None``.

    Eager launches on one stream run one after another, so they share that
    stream's array: a slice of a per-device arena, zeroed when it was made;
    the kernel leaves every counter it uses at zero again. A launch captured
    into a CUDA graph gets a slice of its own, shared with nothing, so the
    graph may be replayed on any stream alongside anything else. Capture
    allocates nothing (a zeroing recorded into the graph would run at replay,
    after the arena was in use): when no arena has room this returns ``None``
    and the plan merges in a second launch, which needs no counters. Arrays
    and arenas are never freed (a captured graph may still use them).
    ``stream_key``: ``(device index, raw stream)``, when the caller has it.
    """
    if _capturing(device):
        with _LOCK:
            return _arena_slice(device, tiles, allocate=False)
    key = stream_key or _stream_key(device)
    arr = _COUNTERS.get(key)
    if arr is not None and arr.numel() >= tiles:
        return arr
    with _LOCK:
        if arr is not None:
            _OUTGROWN.append(arr)
        arr = _COUNTERS[key] = _arena_slice(device, max(_MIN_COUNTERS, 1 << (tiles - 1).bit_length()))
    return arr


def _arena_slice(device: torch.device, size: int, allocate: bool = True) -> Optional[torch.Tensor]:
    """``size`` unused zeroed counters of ``device``'s arena (a new arena if it is full and ``allocate``)."""
    index = device_index(device)
    arena = _ARENAS.get(index)
    if arena is None or arena[1] + size > arena[0].numel():
        if not allocate:
            return None
        if arena is not None:
            _OUTGROWN.append(arena[0])
        arena = _ARENAS[index] = [_zeroed_arena(device, max(ARENA_COUNTERS, size)), 0]
    arr = arena[0][arena[1]: arena[1] + size]
    arena[1] += size
    return arr


def _zeroed_arena(device: torch.device, size: int) -> torch.Tensor:
    """A zeroed int32 array outside any CUDA-graph memory pool, zeroed before it is returned.

    Made on a side stream: a graph pool that a caller routes the current
    stream's allocations to (``torch.compile``'s CUDA-graph trees do while
    warming up) does not take it.
    """
    if device.type != "cuda":
        return torch.zeros(size, dtype=torch.int32, device=device)
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        arena = torch.zeros(size, dtype=torch.int32, device=device)
    side.synchronize()
    return arena


_OUTGROWN: list = []


def workspace_bytes(
    num_q_heads: int,
    num_kv_heads: int,
    v_head_dim: int,
    max_len_extend: int,
    max_bs: int,
    max_splits: int = MAX_SPLITS,
    *,
    pack_gqa: bool = True,
    block_m: Optional[int] = None,
) -> int:
    """Bytes of a caller-owned workspace for calls of up to ``max_bs`` sequences.

    ``tiles = max_bs x head_tiles`` counters (int32), 2 more for the
    grid's ticket and exit count, then (from a 16-byte boundary) the partials
    of ``tiles x max_splits x BLOCK_M`` rows of ``v_head_dim + 1`` float32
    (output and LSE), where ``BLOCK_M`` is the tile's row count
    (:func:`splitkv.kernel.block_m_for` of ``GROUP x max_len_extend``) and
    ``head_tiles = KV heads x ceil(GROUP x max_len_extend / BLOCK_M)``.

    Args:
        num_q_heads: query heads.
        num_kv_heads: KV heads.
        v_head_dim: value head dimension.
        max_len_extend: most draft tokens per sequence.
        max_bs: most sequences per call.
        max_splits: most prefix slices per call (64 in the adaptive mode; in
            the batch-invariant mode ``cdiv(max_prefix_len, split_tokens)``).
        pack_gqa: as for :class:`VerifySplitKV`.
        block_m: the tile's rows if a custom :class:`~splitkv.kernel.TileConfig` is used.

    Returns:
        Bytes (a multiple of 16).
    """
    per_tile = num_q_heads // num_kv_heads if pack_gqa else 1
    block_m = block_m or block_m_for(rows_per_tile(per_tile, max_len_extend))
    tiles = max_bs * count_head_tiles(num_q_heads, num_kv_heads, max_len_extend, block_m, pack_gqa)
    return _counter_bytes(tiles) + tiles * max_splits * block_m * (v_head_dim + 1) * 4


def _counter_bytes(tiles: int) -> int:
    """Bytes a workspace's counters take for ``tiles`` tiles (int32, ``GRID_COUNTERS`` more), padded to 16."""
    return -(-(tiles + GRID_COUNTERS) * 4 // 16) * 16


class VerifySplitKV:
    """Split-KV verify attention for one head configuration.

    Args:
        num_q_heads: query heads.
        num_kv_heads: KV heads (divides ``num_q_heads``).
        head_dim: query/key head dimension.
        v_head_dim: value head dimension.
        max_len_extend: most draft tokens per sequence.
        max_bs: most sequences per call (bounds the workspace and the gate's
            launch-limit checks).
        device: where the kernels run.
        num_sms: SMs the split chooser plans for (default: the device's).
        pack_gqa: one program per KV head with all its query heads as tile
            rows (reads each prefix byte once). ``False`` gives the seed's
            one-program-per-query-head layout, kept for teaching and benchmarks.
        config: kernel tile shape (default: :func:`splitkv.kernel.tile_config`).
        n_splits: a fixed grid of prefix slices for every call (default: the
            adaptive chooser, :func:`splitkv.choose_n_splits`).
        split_tokens: a fixed slice length in tokens, a multiple of 128
            (batch-invariant mode: a sequence's output is then bitwise the same
            in any batch). Needs ``max_prefix_len``.
        max_prefix_len: with ``split_tokens``, the most keys of any
            sequence's prefix: the grid has ``cdiv(max_prefix_len,
            split_tokens)`` slices, and the scratch is sized for them
            (:func:`workspace_bytes`), whatever the batch's total. A longer
            prefix is still exact, but not batch-invariant (the checked mode
            reports it).
        workspace: caller-owned zeroed bytes of at least :func:`workspace_bytes`
            (default: per-call allocation, see the module docstring).
        one_launch: merge in the verify launch (default): by the tile's last
            program, or by merge programs in the same grid (:func:`merge_mode`).
            ``False`` always merges in a second launch, which needs no counters.

    Calling the runner plans and runs in one go; see :meth:`plan` to reuse a plan.
    """

    def __init__(
        self,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        v_head_dim: int,
        max_len_extend: int,
        max_bs: int,
        device=None,
        *,
        num_sms: Optional[int] = None,
        pack_gqa: bool = True,
        config: Optional[TileConfig] = None,
        n_splits: Optional[int] = None,
        split_tokens: Optional[int] = None,
        max_prefix_len: Optional[int] = None,
        workspace: Optional[torch.Tensor] = None,
        one_launch: bool = True,
    ):
        if num_kv_heads < 1 or num_q_heads % num_kv_heads:
            raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
        if max_len_extend < 1 or max_bs < 1:
            raise ValueError("max_len_extend and max_bs must be positive")
        if n_splits is not None and not 1 <= n_splits <= MAX_GRID_SPLITS:
            raise ValueError(f"n_splits must be in [1, {MAX_GRID_SPLITS}], got {n_splits}")
        if n_splits is not None and split_tokens is not None:
            raise ValueError("give n_splits or split_tokens, not both")
        check_batch_invariant(split_tokens, max_prefix_len)
        self.num_q_heads, self.num_kv_heads = num_q_heads, num_kv_heads
        self.head_dim, self.v_head_dim = head_dim, v_head_dim
        self.max_len_extend, self.max_bs = max_len_extend, max_bs
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.num_sms = num_sms if num_sms is not None else device_sm_count(self.device)
        self.pack_gqa = pack_gqa
        self.heads_per_tile = num_q_heads // num_kv_heads if pack_gqa else 1
        self._config = config
        self.block_m = config.block_m if config else block_m_for(rows_per_tile(self.heads_per_tile, max_len_extend))
        #: programs per sequence and slice (KV heads x row blocks)
        self.head_tiles = count_head_tiles(num_q_heads, num_kv_heads, max_len_extend, self.block_m, pack_gqa)
        self.m_blocks = self.head_tiles // (num_q_heads // self.heads_per_tile)
        self.fixed_n_splits = n_splits
        self.split_tokens = split_tokens
        #: batch-invariant mode: the most keys any sequence's prefix holds (the grid's slices cover it)
        self.max_prefix_len = max_prefix_len
        #: where the kernel reports faults (:mod:`splitkv.errors`)
        self.error_word = error_word(self.device)
        self.workspace = workspace
        self.one_launch = one_launch
        if workspace is not None:
            need = workspace_bytes(num_q_heads, num_kv_heads, v_head_dim, max_len_extend, max_bs,
                                   self._max_splits(), pack_gqa=pack_gqa, block_m=self.block_m)
            if workspace.device.type != self.device.type or workspace.numel() * workspace.element_size() < need:
                raise ValueError(f"workspace must hold {need} bytes on {self.device}")
            tiles = max_bs * self.head_tiles
            raw = workspace.view(torch.uint8).reshape(-1)
            counter_bytes = _counter_bytes(tiles)
            self._ws_counters = raw[: (tiles + GRID_COUNTERS) * 4].view(torch.int32)
            end = counter_bytes + (raw.numel() - counter_bytes) // 4 * 4
            self._ws_parts = raw[counter_bytes:end].view(torch.float32)  # all the rest: plans check their fit
            # A caller's bytes may hold anything: the one-launch merges need their counters at zero.
            self._ws_counters.zero_()
        self._launchers: Dict[tuple, Launcher] = {}

    def _max_splits(self) -> int:
        if self.fixed_n_splits is not None:
            return self.fixed_n_splits
        if self.split_tokens is not None:
            return fixed_n_splits(self.max_prefix_len, self.split_tokens)
        return MAX_SPLITS

    def _small_batch(self, batch_size: Optional[int], kv_dtype: torch.dtype, prefix_len: int):
        """The small-launch tile for ``batch_size`` sequences, or ``None`` (see :mod:`splitkv.splits`)."""
        if (batch_size is None or self._config is not None or self.fixed_n_splits is not None
                or self.split_tokens is not None or interpreting()):
            return None
        return small_batch_tile(max(self.head_dim, self.v_head_dim), self.block_m, _element_size(kv_dtype),
                                batch_size * self.head_tiles, self.num_sms, prefix_len)

    def config(self, kv_dtype: torch.dtype, batch_size: Optional[int] = None, prefix_len: int = 0,
               page_size: int = 1, q_dtype: Optional[torch.dtype] = None) -> TileConfig:
        """The tile shape for a pool of ``kv_dtype`` in pages of ``page_size`` keys (1: a token pool),
        queries of ``q_dtype`` (default: bf16 for fp8 pools, else the pool's), and a batch of
        ``batch_size`` sequences of about ``prefix_len`` keys, if given.

        The tuned tile, shrunk where it would not fit the device's shared memory
        (:func:`splitkv.resources.fit_tile`: wide heads the table has no entry for).

        Raises:
            ValueError: when no tile fits (the gate declines such calls first).
        """
        if self._config is not None:
            return self._config
        small = self._small_batch(batch_size, kv_dtype, prefix_len)
        if small is not None:
            cfg = TileConfig(self.block_m, *small)
        else:
            cfg = tile_config(self.head_dim, self.v_head_dim, rows_per_tile(self.heads_per_tile, self.max_len_extend),
                              interpreting(), kv_bytes=_element_size(kv_dtype), page_size=page_size)
        if q_dtype is None:
            q_dtype = torch.bfloat16 if _element_size(kv_dtype) == 1 else kv_dtype
        limit = device_shared_memory(self.device)
        fitted = fit_tile(cfg, self.head_dim, self.v_head_dim, kv_dtype, q_dtype, limit, page_size,
                          self.max_len_extend)
        if fitted is None:
            raise ValueError(shared_memory_reason(cfg, self.head_dim, self.v_head_dim, kv_dtype, q_dtype, limit,
                                                  page_size, self.max_len_extend))
        return fitted

    def n_splits(self, batch_size: int, prefix_len: int, kv_dtype: torch.dtype = torch.bfloat16,
                 small: Optional[bool] = None, page_size: int = 1) -> int:
        """Grid slices for a batch (static shapes only).

        Args:
            batch_size: sequences in the call.
            prefix_len: representative prefix length (``kv_indices.shape[0] // batch_size``).
            kv_dtype: the pool's dtype (fp8 pools may tile differently).
            small: whether the launch runs the small-launch tile (a plan fixes
                it when made); default: as :meth:`config` decides for
                ``batch_size`` and ``prefix_len``.
            page_size: keys per page of a paged pool (1: a token pool); its
                tile may hold a different number of programs per SM.

        Returns:
            The fixed count if one was given; in the batch-invariant mode
            ``cdiv(max_prefix_len, split_tokens)``; else
            :func:`splitkv.choose_n_splits`'s.
        """
        if self.fixed_n_splits is not None:
            return self.fixed_n_splits
        if self.split_tokens is not None:
            return self._max_splits()
        if small is None:
            small = self._small_batch(batch_size, kv_dtype, prefix_len) is not None
        if small:
            return one_wave_n_splits(batch_size * self.head_tiles, prefix_len, self.num_sms,
                                     min_split_tokens=min_split_tokens())
        kv_bytes = _element_size(kv_dtype)
        return choose_n_splits(
            batch_size, self.head_tiles, prefix_len, self.num_sms,
            programs_per_sm=programs_per_sm(max(self.head_dim, self.v_head_dim), self.block_m, kv_bytes, page_size),
            min_split_tokens=min_split_tokens(),
        )

    def plan(
        self,
        q_extend, k_extend, v_extend, k_buffer, v_buffer,
        qo_indptr, kv_indptr, kv_indices, *,
        custom_mask=None, mask_indptr=None, is_causal: bool = True,
        sm_scale: Optional[float] = None, k_scale: float = 1.0, v_scale: float = 1.0,
        sinks=None, return_lse: bool = False, attend_draft: bool = True, check=False,
        logit_cap: float = 0.0, sliding_window_size: int = -1, window_kv_offsets=None,
        xai_temperature_len: int = -1, kv_last_page_len=None,
    ) -> "VerifyPlan":
        """Check one step's inputs and fix its launch.

        The tensors given are those of one layer; :meth:`VerifyPlan.run` takes
        any layer's tensors of the same shapes, dtypes and strides. The
        metadata tensors (indptrs, indices, mask, sinks) are bound to the plan:
        their *values* may change between runs (a graph replay with new
        lengths), not their addresses or sizes.

        Everything after ``kv_indices`` is a keyword.

        Args:
            q_extend, k_extend, v_extend, k_buffer, v_buffer, qo_indptr,
            kv_indptr, kv_indices, custom_mask, mask_indptr: as for
                :func:`splitkv.verify_splitkv_fwd`.
            is_causal: causal draft block when there is no ``custom_mask`` (a bool).
            sm_scale: softmax scale (default ``1/sqrt(head_dim)``).
            k_scale: key-pool multiplier (Python number).
            v_scale: value-pool multiplier (Python number).
            sinks: optional ``[H_Q]`` sink logits.
            return_lse: also write the natural-log LSE per (token, query head).
            attend_draft: ``False`` attends to the prefix only (a context-parallel
                shard that does not own the draft block).
            check: ``True``: the kernel validates the metadata of every run and
                :meth:`VerifyPlan.run` raises what it found (:mod:`splitkv.errors`);
                ``"full"``: that, and the values are checked on the host now
                (:func:`splitkv.checks.check_verify_values`, which reads the device:
                skipped while the stream is being captured); ``False``: neither.
            logit_cap: if ``> 0``, scores ``s`` become ``cap * tanh(s / cap)``.
            sliding_window_size: if ``> 0``, the query at position ``p`` sees keys
                at positions ``>= p - sliding_window_size``; only the slices that
                hold such keys are read.
            window_kv_offsets: ``[bs]`` column offsets of each sequence's
                ``custom_mask`` rows (as in ``extend_attention_fwd``; used only
                with a ``custom_mask``).
            xai_temperature_len: if ``> 0``, scores of the query at position
                ``p > len`` are multiplied by ``log2(p) / log2(len)``.
            kv_last_page_len: ``[bs]`` int32, for a paged pool (``k_buffer`` and
                ``v_buffer`` of shape ``[pages, page_size, H_KV, D]``; ``kv_indptr``
                and ``kv_indices`` then describe page ids): the rows used in each
                sequence's last page (see :mod:`splitkv.paged`).

        Raises:
            ValueError: on malformed input or shapes this runner was not built for.
            TypeError: for an ``is_causal`` or ``check`` of the wrong type.
        """
        if not isinstance(is_causal, bool):
            raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
        check_mode(check)
        dims = check_verify_inputs(
            q_extend, k_extend, v_extend, None, k_buffer, v_buffer,
            qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, self.max_len_extend, sinks,
            kv_last_page_len=kv_last_page_len,
        )
        check_features(dims, logit_cap, sliding_window_size, window_kv_offsets, xai_temperature_len, q_extend.device)
        want = (self.num_q_heads, self.num_kv_heads, self.head_dim, self.v_head_dim)
        got = (dims.num_q_heads, dims.num_kv_heads, dims.head_dim, dims.v_head_dim)
        if got != want:
            raise ValueError(f"this runner serves (H_Q, H_KV, D, Dv) = {want}, got {got}")
        if dims.batch_size > self.max_bs:
            raise ValueError(f"batch of {dims.batch_size} exceeds this runner's max_bs={self.max_bs}")
        if check == "full" and not _capturing(q_extend.device):
            check_verify_values(qo_indptr, kv_indptr, kv_indices, k_buffer.shape[0], self.max_len_extend,
                                custom_mask, mask_indptr, num_tokens=dims.num_tokens,
                                kv_last_page_len=kv_last_page_len, page_size=dims.page_size)
        return VerifyPlan(self, q_extend, k_extend, v_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
                          custom_mask, mask_indptr, is_causal, sm_scale=sm_scale, k_scale=k_scale,
                          v_scale=v_scale, sinks=sinks, return_lse=return_lse, attend_draft=attend_draft,
                          logit_cap=logit_cap, sliding_window_size=sliding_window_size,
                          window_kv_offsets=window_kv_offsets, xai_temperature_len=xai_temperature_len,
                          kv_last_page_len=kv_last_page_len, check=bool(check))

    def _launcher(self, key: tuple, constexprs: dict, options: dict, fn) -> Launcher:
        launcher = self._launchers.get(key)
        if launcher is None:
            launcher = self._launchers[key] = Launcher(fn, constexprs, options)
        return launcher

    def __call__(
        self,
        q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer,
        qo_indptr, kv_indptr, kv_indices, **options,
    ):
        """Plan and run in one go; writes and returns ``o_extend``. ``options``: :meth:`plan`'s keywords
        (without ``return_lse``)."""
        plan = self.plan(q_extend, k_extend, v_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
                         **options)
        return plan.run(q_extend, k_extend, v_extend, k_buffer, v_buffer, out=o_extend)


class VerifyPlan:
    """One step's verify launch, fixed; :meth:`run` launches it for a layer.

    Made by :meth:`VerifySplitKV.plan`. Attributes worth reading:

    Attributes:
        batch_size: sequences in the step.
        n_splits: the grid's prefix slices.
        grid: ``(tiles, n_splits)``, plus each tile's merge programs on axis 1
            when ``merge`` is ``MERGE_PROGRAMS``.
        merge: who merges the slices (:func:`merge_mode`; ``None`` for one slice).
        fused: one launch (no merge kernel follows).
        config: the tile shape.
        scratch_bytes: float32 partials one run needs (0 with one slice).
        offsets_32: whether the pools are small enough for 32-bit gather
            offsets (:data:`OFFSETS_32_LIMIT`).
    """

    def __init__(self, runner: VerifySplitKV, q_extend, k_extend, v_extend, k_buffer, v_buffer,
                 qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, is_causal, *,
                 sm_scale, k_scale, v_scale, sinks, return_lse, attend_draft,
                 logit_cap=0.0, sliding_window_size=-1, window_kv_offsets=None, xai_temperature_len=-1,
                 kv_last_page_len=None, check=False):
        r = runner
        bs = qo_indptr.shape[0] - 1
        n_tok = q_extend.shape[0]
        kv_len = kv_indices.shape[0]
        self.runner = r
        self.batch_size = bs
        self.num_tokens = n_tok
        self.out_shape = (n_tok, r.num_q_heads, r.v_head_dim)
        self.dtype = q_extend.dtype
        self.device = q_extend.device
        self.return_lse = return_lse
        #: the kernel validates the metadata and run() raises what it found (:mod:`splitkv.errors`)
        self.checked = bool(check)
        #: most polls of a merge program waiting for its slices before it reports a fault
        self.spin_limit = SPIN_LIMIT
        self._kv_dtype = k_buffer.dtype
        self._tiles = bs * r.head_tiles
        paged = k_buffer.dim() == 4
        #: keys per kv_indices entry: 1 (token pool) or the page size
        self.page_size = k_buffer.shape[1] if paged else 1
        #: keys a query may see in the prefix (sliding window), else None
        self.window = int(sliding_window_size) if sliding_window_size is not None and sliding_window_size > 0 else None
        # The tile is fixed here, from this call's prefix; rebind() may change only the split count.
        prefix = self._prefix(kv_len)
        self._small = r._small_batch(bs, k_buffer.dtype, prefix) is not None
        self._spread = False  # merge in a second launch whatever merge_mode() says
        self.merge: Optional[int] = None  # set by _pick_launchers
        self.config = cfg = r.config(k_buffer.dtype, bs, prefix, self.page_size, q_extend.dtype)
        self._size(kv_len)
        if sm_scale is None:
            sm_scale = 1.0 / math.sqrt(r.head_dim)
        use_mask = custom_mask is not None
        min_split = -(-min_split_tokens() // cfg.block_n) * cfg.block_n
        use_offsets = use_mask and window_kv_offsets is not None
        #: the device index (-1 for the CPU) every tensor of a run must report: the launch
        #: passes addresses, not tensors (see ``run``), so nothing downstream would check it
        self._dev_index = q_extend.get_device()
        #: what every run's tensors must report: 6 devices (q, k, v, pools, out), then 5 dtypes
        #: (q, k, v, pools; the output's is free: a context-parallel shard writes float32 partials)
        self._layer = (self._dev_index,) * 6 + (q_extend.dtype,) * 3 + (k_buffer.dtype,) * 2
        #: and their shapes, then strides: the launch's strides and bounds are the planned ones
        layer = (q_extend, k_extend, v_extend, k_buffer, v_buffer)
        self._layout = tuple(t.shape for t in layer) + tuple(t.stride() for t in layer)
        # Bound metadata: the same tensors every run (their values may change).
        self._bind(qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, sinks,
                   kv_last_page_len, window_kv_offsets)
        self._scales = (float(sm_scale) * float(k_scale) * LOG2E, float(sm_scale) * LOG2E, float(v_scale),
                        float(logit_cap) * LOG2E if logit_cap and logit_cap > 0 else 0.0)
        self._pool_tokens = min(k_buffer.shape[0], v_buffer.shape[0])
        self._p_err = r.error_word.data_ptr()
        #: the pools' element offsets fit 32 bits: the kernel gathers with 32-bit address arithmetic
        self.offsets_32 = pool_offsets_32(k_buffer) and pool_offsets_32(v_buffer)
        self._min_split = min_split
        has_xai = xai_temperature_len is not None and xai_temperature_len > 0
        self._features = (self.window or 0, int(xai_temperature_len) if has_xai else 0)

        def pool_strides(buf):  # (slot or page, row within a page, head)
            return (buf.stride(0), buf.stride(1), buf.stride(2)) if paged else (buf.stride(0), 0, buf.stride(1))

        self._strides = (
            q_extend.stride(0), q_extend.stride(1),
            k_extend.stride(0), k_extend.stride(1),
            v_extend.stride(0), v_extend.stride(1),
            *pool_strides(k_buffer), *pool_strides(v_buffer),
        )
        self._set_scalars(kv_len, custom_mask)
        constexprs = dict(
            NUM_Q_HEADS=r.num_q_heads,
            GROUP=r.num_q_heads // r.num_kv_heads,
            HEADS_PER_TILE=r.heads_per_tile,
            M_BLOCKS=r.m_blocks,
            HEAD_DIM=r.head_dim,
            V_HEAD_DIM=r.v_head_dim,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_N_DRAFT=max(16, min(cfg.block_n, _next_pow2(r.max_len_extend))),
            BLOCK_D=_next_pow2(r.head_dim),
            BLOCK_DV=_next_pow2(r.v_head_dim),
            K_ROWS=cfg.k_rows,
            PAGE_SIZE=self.page_size,
            OFFSETS_32=self.offsets_32,
            SPLIT_TOKENS=r.split_tokens or 0,
            USE_MASK=use_mask,
            HAS_MASK_OFFSETS=use_offsets,
            IS_CAUSAL=bool(is_causal),
            HAS_WINDOW=self.window is not None,
            HAS_LOGIT_CAP=bool(logit_cap and logit_cap > 0),
            HAS_XAI_TEMP=has_xai,
            ATTEND_DRAFT=bool(attend_draft),
            HAS_SINKS=sinks is not None,
            WRITE_LSE=bool(return_lse),
            MERGE_UNROLL=4,
            DOT_PRECISION="ieee" if q_extend.dtype == torch.float32 else None,
            DOT_F16=_element_size(k_buffer.dtype) == 1 and q_extend.dtype == torch.bfloat16,
            CHECK=self.checked,
        )
        self._constexprs = constexprs
        self._options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        cuda = self.device.type == "cuda"
        self._pdl = cuda and not interpreting() and torch.cuda.get_device_capability(self.device)[0] >= 9
        self._pick_launchers()

    def _size(self, kv_len: int) -> None:
        """Split count, grid and scratch for ``kv_len`` entries of ``kv_indices``."""
        r, bs = self.runner, self.batch_size
        n_splits = r.n_splits(bs, self._prefix(kv_len), self._kv_dtype, self._small, self.page_size)
        reason = launch_limit_reason(self._tiles, n_splits, kv_len * self.page_size)
        if reason is not None:
            raise LaunchLimitError(reason)
        self.kv_len, self.n_splits = kv_len, n_splits
        self._set_grid()
        rows = self._tiles * self.n_splits * self.config.block_m
        self.scratch_bytes = 0 if self.n_splits == 1 else rows * (r.v_head_dim + 1) * 4
        self._part_rows = rows
        #: where the partial LSEs start in the scratch, after the partial outputs
        self._lse_offset = 0 if self.n_splits == 1 else rows * r.v_head_dim
        if r.workspace is not None and self.n_splits > 1 and rows * (r.v_head_dim + 1) > r._ws_parts.numel():
            raise ValueError("the workspace is too small for this call's slices")

    def _prefix(self, kv_len: int) -> int:
        """Representative keys per sequence; under a window, the window's keys.

        The kernel reads from the key tile holding the window's first key, so up to
        ``BLOCK_N - 1`` keys more than the window; the grid is sized for the window
        itself, as a plain prefix of that length would be: a 128-key window at a 64k
        prefix takes one slice and one launch, like a 128-key prefix (H200: 10.0 µs
        against 12.5 with the grid sized for ``window + BLOCK_N``, two slices merged).
        """
        prefix = mean_prefix(kv_len, self.page_size, self.batch_size)
        return prefix if self.window is None else min(prefix, self.window)

    def _merge_mode(self) -> Optional[int]:
        """Who merges: ``None`` (one slice), ``LAST_PROGRAM``, ``MERGE_PROGRAMS`` or ``SEPARATE_MERGE``
        (:func:`merge_mode`; ``SEPARATE_MERGE`` too once :meth:`_pick_launchers` was told to spread)."""
        mode = merge_mode(self.n_splits, self._tiles, self.config.block_m, self.runner.v_head_dim,
                          self.runner.one_launch)
        return SEPARATE_MERGE if self._spread and mode is not None else mode

    def _launch_kind(self) -> Tuple[Optional[int], int]:
        """What the launchers are compiled for: who merges, and the merge programs' rows (without merge
        programs a fixed value, unused, so that the slice count does not make other variants)."""
        mode = self._merge_mode()
        return mode, grid_merge_rows(self.n_splits) if mode == MERGE_PROGRAMS else GRID_MERGE_ROWS[0]

    def _set_grid(self) -> None:
        """The verify grid: ``(tiles, n_splits)``, plus a tile's merge programs on axis 1 (``MERGE_PROGRAMS``)."""
        extra = (merge_chunks(self.n_splits, self.config.block_m, self.runner.v_head_dim)
                 if self.merge == MERGE_PROGRAMS else 0)
        self.grid = (self._tiles, self.n_splits + extra, 1)

    def _pick_launchers(self, spread: bool = False) -> None:
        """Fix who merges (:meth:`_merge_mode`; ``spread``: from now on a second launch) and the launchers."""
        r, cfg = self.runner, self.config
        self._spread = self._spread or spread
        #: who merges the slices: None (one slice), LAST_PROGRAM, MERGE_PROGRAMS or SEPARATE_MERGE
        self.merge, rows = self._launch_kind()
        #: one launch: no merge kernel follows the verify kernel
        self.fused = self.merge != SEPARATE_MERGE
        # Programmatic dependent launch: the merge kernel may start while the verify grid drains,
        # since it waits for it before its first load. The verify kernel is never launched early:
        # the kernel before it (the caller's) may write q or the metadata until it ends.
        pdl = self._pdl and not self.fused
        consts = dict(self._constexprs, MERGE=self.merge or SEPARATE_MERGE, MERGE_ROWS=rows,
                      MERGE_DV=min(GRID_MERGE_DV, self._constexprs["BLOCK_DV"]), USE_PDL=pdl,
                      DOT_PRECISION=self._constexprs["DOT_PRECISION"])
        options = dict(self._options)
        self._launch = r._launcher(("verify",) + tuple(consts.values()) + (cfg,), consts, options, _verify_kernel)
        self._set_grid()
        self._merge = None
        if not self.fused:
            c = self._constexprs
            mconsts = dict(NUM_Q_HEADS=c["NUM_Q_HEADS"], HEADS_PER_TILE=c["HEADS_PER_TILE"], M_BLOCKS=c["M_BLOCKS"],
                           V_HEAD_DIM=c["V_HEAD_DIM"], BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"],
                           MERGE_ROWS=MERGE_ROWS, MERGE_DV=min(MERGE_DV, c["BLOCK_DV"]),
                           PAGE_SIZE=c["PAGE_SIZE"], SPLIT_TOKENS=c["SPLIT_TOKENS"], HAS_WINDOW=c["HAS_WINDOW"],
                           HAS_SINKS=c["HAS_SINKS"], WRITE_LSE=c["WRITE_LSE"],
                           MERGE_UNROLL=c["MERGE_UNROLL"], USE_PDL=pdl)
            moptions = dict(num_warps=2, **({"launch_pdl": True} if pdl else {}))
            self._merge = r._launcher(("merge",) + tuple(mconsts.values()), mconsts, moptions, _merge_kernel)
            self._merge_grid = (self._tiles, -(-cfg.block_m // MERGE_ROWS), -(-r.v_head_dim // mconsts["MERGE_DV"]))

    def _set_scalars(self, kv_len: int, custom_mask) -> None:
        scalars = (
            *self._scales, self.num_tokens, self._pool_tokens, kv_len,
            custom_mask.numel() if custom_mask is not None else 0, self.n_splits, self._min_split,
            *self._features, self.runner.max_len_extend, self.spin_limit,
        )
        if scalars != getattr(self, "_scalars", None):
            self._scalars = scalars
            self._tail = scalars + self._strides
            # What the compiled kernel is specialised on among the plan's integers (the scratch's
            # LSE offset only by its width); run() adds the rest (dtypes, output strides,
            # alignment) to its launch key.
            self._spec = (_specialization(self._tail), self._lse_offset < 2**31)

    def _bind(self, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, sinks,
              kv_last_page_len, window_kv_offsets, check: bool = True) -> None:
        """Hold this step's metadata tensors and their addresses (``check``: their devices too)."""
        use_mask = custom_mask is not None
        # Placeholders (kv_indptr, qo_indptr) stand for absent tensors: never read.
        m = (
            qo_indptr, kv_indptr, kv_indices,
            kv_last_page_len if kv_last_page_len is not None else kv_indptr,
            custom_mask if use_mask else kv_indptr,
            mask_indptr if use_mask else kv_indptr,
            window_kv_offsets if use_mask and window_kv_offsets is not None else kv_indptr,
            sinks if sinks is not None else qo_indptr,
        )
        if check:
            if (m[0].get_device(), m[1].get_device(), m[2].get_device(), m[3].get_device(), m[4].get_device(),
                    m[5].get_device(), m[6].get_device(), m[7].get_device()) != (self._dev_index,) * 8:
                raise ValueError(f"metadata tensors must be on the plan's device, {self.device}")
            dtypes = (m[0].dtype, m[1].dtype, m[2].dtype, m[3].dtype, m[4].dtype, m[5].dtype, m[6].dtype, m[7].dtype)
        else:  # the caller knows the dtypes are the last bind's
            dtypes = self._static_key[1]
        # A placeholder's address is its tensor's, taken once (each data_ptr() costs ~0.1 µs of a call's ~25).
        p_qo, p_kvp = m[0].data_ptr(), m[1].data_ptr()
        ptrs = (p_qo, p_kvp, m[2].data_ptr(),
                m[3].data_ptr() if kv_last_page_len is not None else p_kvp,
                m[4].data_ptr() if use_mask else p_kvp,
                m[5].data_ptr() if use_mask else p_kvp,
                m[6].data_ptr() if use_mask and window_kv_offsets is not None else p_kvp,
                m[7].data_ptr() if sinks is not None else p_qo)
        self._meta, self._meta_ptrs = m, ptrs
        # What the compiled kernel is specialised on that is fixed per bind: the inputs' and the
        # metadata's dtypes, the metadata's 16-byte alignment.
        self._static_key = (self._layer[6:], dtypes, alignment_bits(ptrs))

    def rebind(self, qo_indptr, kv_indptr, kv_indices, custom_mask=None, mask_indptr=None, sinks=None,
               kv_last_page_len=None, window_kv_offsets=None) -> None:
        """Point the plan at another step's metadata of the same signature.

        The drop-in uses it to reuse one plan across eager steps: the tensors
        are new every step and ``kv_indices`` grows, but shapes, dtypes and
        scalars are the same. Only the split count may change (it follows
        ``len(kv_indices) // batch``, rounded as :func:`splitkv.choose_n_splits` does).
        ``kv_last_page_len`` and ``window_kv_offsets`` are given again when the
        plan was made with them (paged pools, mask offsets).

        Raises:
            ValueError: for a tensor on another device than the plan's (the plan
                is left as it was).
        """
        self._bind(qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, sinks,
                   kv_last_page_len, window_kv_offsets)
        self._resize(kv_indices.shape[0], custom_mask)

    def _rebind_same_signature(self, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, sinks,
                               kv_last_page_len, window_kv_offsets) -> None:
        """:meth:`rebind` for a caller that has checked the tensors' devices and dtypes
        against the plan's (the drop-in: they are part of its cache key)."""
        self._bind(qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, sinks,
                   kv_last_page_len, window_kv_offsets, check=False)
        self._resize(kv_indices.shape[0], custom_mask)

    def _resize(self, kv_len: int, custom_mask) -> None:
        if kv_len != self.kv_len:
            launch = self._launch_kind()
            self._size(kv_len)
            if self._launch_kind() != launch:  # e.g. one slice -> several: the kernel must now merge
                self._pick_launchers()
        elif custom_mask is None:
            return  # the scalars depend on nothing else that can change between binds
        self._set_scalars(kv_len, custom_mask)

    def release(self) -> None:
        """Drop the references to the bound metadata (a cached plan between rebinds)."""
        self._meta = self._meta_ptrs = None

    def run(self, q_extend, k_extend, v_extend, k_buffer, v_buffer, *, out=None, lse=None) -> torch.Tensor:
        """Launch for one layer's tensors (same shapes, dtypes and strides as planned).

        Args:
            q_extend, k_extend, v_extend, k_buffer, v_buffer: the layer's tensors.
            out: ``[tokens, H_Q, Dv]`` output to write, unit stride in its last
                dimension (default: a new tensor). Rows past ``qo_indptr[-1]``
                are not written.
            lse: ``[tokens, H_Q]`` contiguous float32 for the natural-log LSE;
                required by a plan made with ``return_lse``, refused by others.

        Returns:
            ``out``.

        Raises:
            ValueError: for a tensor of another device, dtype, shape or strides
                than planned, a malformed ``out`` or ``lse``; with a checked
                plan, :class:`splitkv.errors.VerifyError` for a fault the kernel
                found in this run's or an earlier run's metadata.
            RuntimeError: after :meth:`release`, until the next :meth:`rebind`.
        """
        if out is None:
            out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        layer = (q_extend, k_extend, v_extend, k_buffer, v_buffer)
        # The launch passes addresses, not tensors: nothing downstream would check these.
        if (q_extend.get_device(), k_extend.get_device(), v_extend.get_device(), k_buffer.get_device(),
                v_buffer.get_device(), out.get_device(), q_extend.dtype, k_extend.dtype,
                v_extend.dtype, k_buffer.dtype, v_buffer.dtype) != self._layer or (
                q_extend.shape, k_extend.shape, v_extend.shape, k_buffer.shape, v_buffer.shape,
                q_extend.stride(), k_extend.stride(), v_extend.stride(), k_buffer.stride(),
                v_buffer.stride()) != self._layout:
            self._refuse(layer, out)
        check_output(out, lse, self.out_shape, self.return_lse)
        if self._meta is None:
            raise RuntimeError("this plan was released: rebind() it to a step's metadata first")
        if self.checked:
            raise_pending(self.device, self._dev_index)
        self._run(q_extend, k_extend, v_extend, k_buffer, v_buffer, out, lse if lse is not None else out)
        if self.checked:
            raise_pending(self.device, self._dev_index)
        return out

    def _new_partials(self, stream: Optional[int], raw: bool) -> Tuple[Optional[torch.Tensor], int]:
        """This run's float32 partials from the caching allocator (outputs, then LSEs at
        ``_lse_offset``): ``(tensor, address)``, or with ``raw`` and where the allocator
        allows, ``(None, address)`` of a raw block on ``stream`` that the run frees."""
        if raw and stream is not None and _raw_alloc is not None and _current_device() == self._dev_index:
            return None, _raw_alloc(self.scratch_bytes, stream)
        parts = torch.empty(self._part_rows * (self.runner.v_head_dim + 1), dtype=torch.float32, device=self.device)
        return parts, parts.data_ptr()

    def _refuse(self, layer, out) -> None:
        """Raise the ValueError naming the first tensor that differs from the planned ones."""
        names = ("q_extend", "k_extend", "v_extend", "k_buffer", "v_buffer")
        for i, (name, t) in enumerate(zip(names, layer)):
            if t.get_device() != self._dev_index:
                raise ValueError(f"run() takes tensors on the plan's device, {self.device}; {name} is on {t.device}")
            if t.dtype != self._layer[6 + i]:
                raise ValueError(f"run() takes tensors of the planned dtypes; {name} is {t.dtype}, "
                                 f"planned {self._layer[6 + i]}")
            if (t.shape, t.stride()) != (self._layout[i], self._layout[5 + i]):
                raise ValueError(f"run() takes tensors of the planned shapes and strides; {name} is "
                                 f"{tuple(t.shape)} with strides {t.stride()}, planned "
                                 f"{tuple(self._layout[i])} with {self._layout[5 + i]}")
        raise ValueError(f"run() takes tensors on the plan's device, {self.device}; out is on {out.device}")

    def _run(self, q_extend, k_extend, v_extend, k_buffer, v_buffer, out, lse_arg) -> None:
        """Launch, for tensors whose devices and dtypes are the plan's (``lse_arg``: ``out`` without LSE).

        A launch that cannot merge in the verify grid (no counters to be had inside a capture, or
        merge programs that would make the kernel spill) switches the plan to a second merge launch
        and goes again.
        """
        if not self._launch_once(q_extend, k_extend, v_extend, k_buffer, v_buffer, out, lse_arg):
            self._launch_once(q_extend, k_extend, v_extend, k_buffer, v_buffer, out, lse_arg)

    def _launch_once(self, q_extend, k_extend, v_extend, k_buffer, v_buffer, out, lse_arg) -> bool:
        """:meth:`_run`'s launches; ``False`` (nothing launched) when the plan switched to a second merge launch."""
        r = self.runner
        stream = torch._C._cuda_getCurrentRawStream(self._dev_index) if self._dev_index >= 0 else None
        lse_offset = self._lse_offset
        # The addresses serve twice: the launch key's alignment bits, and the launch itself
        # (Launcher.run_ptrs: Triton would otherwise ask the driver about each tensor again).
        # The metadata's were taken when it was bound.
        p_q, p_k, p_v, p_kb, p_vb, p_o, p_lse = (
            q_extend.data_ptr(), k_extend.data_ptr(), v_extend.data_ptr(), k_buffer.data_ptr(), v_buffer.data_ptr(),
            out.data_ptr(), lse_arg.data_ptr())
        s_ot, s_oh = out.stride(0), out.stride(1)
        # The scratch's alignment is not in the key: within a runner it never changes (a
        # workspace's fixed carve-out, or else allocator blocks, arena slices and null
        # addresses, all 16-byte aligned).
        key = (self._spec, self._static_key, out.dtype, s_ot, s_oh,
               alignment_bits((p_q, p_k, p_v, p_kb, p_vb, p_o, p_lse)))
        block = 0  # a raw block of the caching allocator that this run frees
        if self.n_splits == 1:
            # One slice: no partials, no counters. The kernels never dereference them: null
            # addresses, and a float32 placeholder for the launch that compiles (below).
            parts = cnt = None
            p_parts = p_cnt = 0
        elif r.workspace is not None:
            parts, cnt = r._ws_parts, r._ws_counters
            p_parts, p_cnt = parts.data_ptr(), cnt.data_ptr()
        else:
            # A raw block only where every launch of this run is compiled (compiling takes tensors).
            parts, p_parts = self._new_partials(stream, self._launch.ready(key) and (
                self._merge is None or self._merge.ready(key)))
            block = p_parts if parts is None else 0
            cnt, p_cnt = parts, p_parts  # only the one-launch merges count
            if self.fused:
                cnt = counters(self.device, self._tiles + GRID_COUNTERS,
                               None if stream is None else (self._dev_index, stream))
                if cnt is None:  # inside a capture with no zeroed counters left
                    if block:
                        _raw_delete(block)
                    self._pick_launchers(spread=True)
                    return False
                p_cnt = cnt.data_ptr()
        meta = self._meta_ptrs
        try:
            if not self._launch.run_ptrs(key, self.grid, (p_q, p_k, p_v, p_kb, p_vb, p_o, p_lse, *meta, p_parts,
                                                          lse_offset, p_cnt, self._p_err, *self._tail, s_ot, s_oh),
                                         stream):
                if self.n_splits == 1:  # held by no one past this call (a plan may be made inside a graph's pool)
                    parts = cnt = torch.empty(1, dtype=torch.float32, device=self.device)
                args = (q_extend, k_extend, v_extend, k_buffer, v_buffer, out, lse_arg, *self._meta,
                        parts, lse_offset, cnt, r.error_word, *self._tail, s_ot, s_oh)
                if self.merge == MERGE_PROGRAMS and self._launch.spills(args, self.grid):
                    # Merge programs share the verify kernel's registers: where they would make the
                    # slices' loop spill, a second merge launch is faster (see docs/design.md).
                    self._pick_launchers(spread=True)
                    return False
                self._launch(self.grid, args, stream, key)  # compiles
            if self._merge is not None:
                # Arguments: out, lse, qo_indptr, kv_indptr, last-page lengths, sinks, partials, then the
                # scalars num_tokens, kv_len, n_splits, min_split, window and the output strides. A subset
                # of the verify launch's: the same key fixes their specialisation.
                sc = self._scalars
                tail = (lse_offset, sc[4], sc[6], sc[8], sc[9], sc[10], s_ot, s_oh)
                if not self._merge.run_ptrs(key, self._merge_grid,
                                            (p_o, p_lse, meta[0], meta[1], meta[3], meta[7], p_parts, *tail), stream):
                    m = self._meta
                    self._merge(self._merge_grid, (out, lse_arg, m[0], m[1], m[3], m[7], parts, *tail), stream, key)
        finally:
            if block:
                _raw_delete(block)  # back to the cache, for what this stream runs next
        return True


def mean_prefix(kv_len: int, page_size: int, batch_size: int) -> int:
    """Keys per sequence, on average, of ``kv_len`` entries of ``kv_indices`` (pages of ``page_size`` keys)."""
    return kv_len * page_size // max(batch_size, 1)


def fused_merge_fits(n_splits: int, block_m: int, v_head_dim: int) -> bool:
    """Whether a tile's last program merges its slices itself (one launch); see ``FUSED_MAX_MERGE``."""
    return block_m <= FUSED_MAX_BLOCK_M and n_splits * block_m * v_head_dim <= FUSED_MAX_MERGE


def grid_merge_rows(n_splits: int) -> int:
    """Tile rows per merge program in the verify grid (see ``GRID_MERGE_ROWS``)."""
    return GRID_MERGE_ROWS[0] if n_splits <= GRID_MERGE_FEW else GRID_MERGE_ROWS[1]


def merge_chunks(n_splits: int, block_m: int, v_head_dim: int) -> int:
    """Merge programs per tile in the verify grid (``MERGE_PROGRAMS``): blocks of
    :func:`grid_merge_rows` rows x ``GRID_MERGE_DV`` value columns."""
    return -(-block_m // grid_merge_rows(n_splits)) * -(-v_head_dim // min(GRID_MERGE_DV, _next_pow2(v_head_dim)))


def merge_mode(n_splits: int, tiles: int, block_m: int, v_head_dim: int, one_launch: bool = True) -> Optional[int]:
    """Who merges a launch's slices.

    ``None`` for one slice (each tile finishes in registers); with
    ``one_launch=False``, ``SEPARATE_MERGE`` (a second launch); else
    ``LAST_PROGRAM`` where :func:`fused_merge_fits`, else ``MERGE_PROGRAMS``
    (merge programs in the verify grid) while the grid's programs fit CUDA's
    axis-1 limit and a 32-bit ticket, else ``SEPARATE_MERGE``.
    """
    if n_splits == 1:
        return None
    if not one_launch:
        return SEPARATE_MERGE
    if fused_merge_fits(n_splits, block_m, v_head_dim):
        return LAST_PROGRAM
    extra = merge_chunks(n_splits, block_m, v_head_dim)
    if n_splits + extra <= MAX_GRID_SPLITS and tiles * (n_splits + extra) < 2**31:
        return MERGE_PROGRAMS
    return SEPARATE_MERGE


def _element_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype`` (1 for fp8 pools, 2 for 16-bit ones)."""
    return torch.empty((), dtype=dtype).element_size()


def _next_pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()
