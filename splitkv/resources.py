"""What a verify tile needs on chip, and the largest tile that fits a device.

The tuned tile table (:mod:`splitkv.tuning`) was measured at head dims 128
and 256; other head dims take its nearest entry, and the kernel pads head
dims to powers of two. MLA's 576/512 at 64 query rows thereby got a tile
that needs 525824 bytes of shared memory against the H200's 232448, and
Triton raised ``OutOfResources`` after the gate had accepted the call.
:func:`shared_memory_bytes` says what a tile needs without compiling,
:func:`fit_tile` shrinks a tile until it fits, and
:func:`shared_memory_reason` is the decline reason when nothing fits.

The model. Triton keeps these tiles of ``_verify_kernel`` in shared memory
(read off the compiled kernels' TTGIR: ``allocs`` in ``shared_memory_sm90.json``),
in the query's dtype (float16 for fp8 pools) except the pool's own buffers::

    q      = BLOCK_M x BLOCK_D
    prefix = nbuf x BLOCK_N x (BLOCK_D + BLOCK_DV)        pool dtype
             + P, BLOCK_M x BLOCK_N                        (mma.sync tiles; wgmma keeps P in registers)
             + converted K and V, BLOCK_N x (BLOCK_D + BLOCK_DV)   (wgmma on a converted pool)
             + slot / page-id buffers, 3 x BLOCK_N int32   (when that load is pipelined)
    draft  = ndraft x BLOCK_N_DRAFT x (BLOCK_D + BLOCK_DV) + P (BLOCK_M x BLOCK_N_DRAFT, mma.sync)
    shared = max(q x (2 if the pool is converted else 1) + prefix, q + draft) + SLACK

The two loops' buffers share the space; a converted pool also holds the
converted query tile during the prefix loop. Buffer counts follow Triton's
software pipeliner. ``num_stages`` 1 pipelines nothing: one of each. From 2
on, K and V get one buffer when the loop's slot (or page-id) load is itself
pipelined: a vector of fewer than ``32 x num_warps`` slots or per-key page
ids, or the page ids of a tile of whole pages (at most 64 keys); otherwise
(one scalar page id for a tile inside one page, or 128 slots at 4 warps)
``num_stages - 1``. wgmma (the asynchronous Hopper dot, which Triton uses for
64-row tiles with 16-bit queries) adds one buffer, as the dot may still read
the previous one, except on a converted pool, whose dot reads the converted
copies. The draft loop has ``max(1, num_stages - 1)`` buffers, plus one with
wgmma. ``SLACK`` covers alignment and the compiler's small buffers (barriers).

Calibration: compiled for sm_90 (``python -m splitkv.record_resources``) with
Triton 3.6.0 (the H200's, on its host) and 3.9.0 (this repository's CPU
environment), 156 configurations each. The model is at or above every
compiled value (``tests/test_resources.py``) and within a few per cent of
the H200's tuned tiles; see :data:`CALIBRATION`. On the H200 the MLA tiles
:func:`fit_tile` picks (64 rows, 32 keys, one stage) ran and matched the
reference, where the table's tile raised ``OutOfResources`` (525824 bytes).
"""

from __future__ import annotations

import functools
from typing import Iterator, Optional

import torch

from .kernel import TileConfig

__all__ = ["shared_memory_bytes", "device_shared_memory", "fit_tile", "shared_memory_reason", "tile_candidates",
           "H200_SHARED_MEMORY", "CALIBRATION"]

#: The H200's (and H100's) per-block opt-in shared memory: 227 KB, what Triton's launch checks against.
H200_SHARED_MEMORY = 232448
#: What the model was calibrated against (see the module docstring).
CALIBRATION = "Triton 3.6.0 and 3.9.0, sm_90, 156 compiles each (splitkv/shared_memory_sm90.json)"
#: Bytes added to every estimate: allocations are aligned, and the compiler adds a few small buffers.
SLACK = 1024


def _pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


def _dtype(dtype) -> torch.dtype:
    """A torch dtype from itself or its name (``"float8_e4m3fn"``)."""
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def _index_pipelined(block_n: int, num_warps: int, page_size: int) -> bool:
    """Whether Triton pipelines the key loop's slot / page-id load (then K and V get one buffer)."""
    if page_size > 1 and page_size % block_n == 0:
        return False  # the tile lies in one page: one scalar page id
    if page_size > 1 and block_n <= 64 and block_n % page_size == 0:
        return True  # whole pages: a vector of page ids
    return block_n < 32 * num_warps


def shared_memory_bytes(config: TileConfig, head_dim: int, v_head_dim: int, kv_dtype, q_dtype,
                        page_size: int = 1, max_len_extend: int = 16) -> int:
    """Shared memory (bytes) of ``_verify_kernel`` compiled for sm_90 with tile ``config``: the model above.

    ``kv_dtype``/``q_dtype``: torch dtypes (or their names) of the pool and the
    queries; ``page_size`` 1 for a token pool; ``max_len_extend`` sets the
    draft loop's block (``max(16, min(block_n, next_pow2))``, 16 up to 16 drafts).
    """
    bd, bdv, bm, bn, stages = _pow2(head_dim), _pow2(v_head_dim), config.block_m, config.block_n, config.num_stages
    kv_dtype, q_dtype = _dtype(kv_dtype), _dtype(q_dtype)
    convert = kv_dtype != q_dtype  # K and V are converted on chip (fp8 pools)
    cb, kb = q_dtype.itemsize, kv_dtype.itemsize  # compute (query) and pool element sizes
    wgmma = bm >= 64 and cb == 2
    piped = stages > 1 and _index_pipelined(bn, config.num_warps, page_size)
    nbuf = 1 if stages <= 2 or piped else stages - 1
    nbuf += int(wgmma and stages > 1 and not convert)
    prefix = nbuf * bn * (bd + bdv) * kb + (3 * bn * 4 if piped else 0)
    if wgmma:
        prefix += bn * (bd + bdv) * cb if convert else 0  # the converted K and V the dot reads
    else:
        prefix += bm * bn * cb  # P
    nd = max(16, min(bn, _pow2(max_len_extend)))
    draft = (max(1, stages - 1) + int(wgmma and stages > 1)) * nd * (bd + bdv) * cb + (0 if wgmma else bm * nd * cb)
    q = bm * bd * cb  # a converted pool's prefix loop holds the converted query tile too
    return max(q * (2 if convert else 1) + prefix, q + draft) + SLACK


@functools.lru_cache(maxsize=None)
def _optin(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).shared_memory_per_block_optin)


def device_shared_memory(device=None) -> Optional[int]:
    """The per-block (opt-in) shared memory of a CUDA device, in bytes; ``None`` off CUDA.

    ``None`` for the CPU (the Triton interpreter has no such limit): callers
    that want the H200's limit there pass :data:`H200_SHARED_MEMORY`
    themselves. Read once per device (``torch.cuda.get_device_properties``).
    """
    device = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    if device.type != "cuda":
        return None
    return _optin(device.index if device.index is not None else torch.cuda.current_device())


def tile_candidates(config: TileConfig) -> Iterator[TileConfig]:
    """``config``, then smaller tiles in the order :func:`fit_tile` tries them.

    Per ``block_n`` (halved down to 16), stages from ``config``'s down to 1;
    ``block_m``, warps and the K layout are kept. Stage 1 is worth trying after
    2: Triton pipelines nothing then, which with wgmma (64-row tiles) halves the
    K/V buffers (MLA at 32 keys: 327808 bytes in two stages, 229376 in one).
    """
    bn = config.block_n
    while True:
        for stages in range(config.num_stages, 0, -1):
            yield TileConfig(config.block_m, bn, config.num_warps, stages, config.k_rows)
        if bn <= 16:
            return
        bn //= 2


def fit_tile(config: TileConfig, head_dim: int, v_head_dim: int, kv_dtype, q_dtype, limit: Optional[int],
             page_size: int = 1, max_len_extend: int = 16) -> Optional[TileConfig]:
    """``config`` if it fits in ``limit`` bytes of shared memory, else the first of
    :func:`tile_candidates` that does, else ``None``. ``limit`` ``None``: no limit (``config``)."""
    if limit is None:
        return config
    for tile in tile_candidates(config):
        if shared_memory_bytes(tile, head_dim, v_head_dim, kv_dtype, q_dtype, page_size, max_len_extend) <= limit:
            return tile
    return None


def shared_memory_reason(config: TileConfig, head_dim: int, v_head_dim: int, kv_dtype, q_dtype,
                         limit: Optional[int], page_size: int = 1, max_len_extend: int = 16) -> Optional[str]:
    """Why no tile from ``config`` down fits ``limit`` bytes (a decline reason), or ``None`` when one does."""
    if fit_tile(config, head_dim, v_head_dim, kv_dtype, q_dtype, limit, page_size, max_len_extend) is not None:
        return None
    need, tile = min(((shared_memory_bytes(t, head_dim, v_head_dim, kv_dtype, q_dtype, page_size, max_len_extend), t)
                      for t in tile_candidates(config)), key=lambda pair: pair[0])
    return (f"shared memory: the smallest tile for head dims {_pow2(head_dim)}/{_pow2(v_head_dim)} "
            f"({tile.block_m} rows, {tile.block_n} keys, {tile.num_stages} stage{'s' if tile.num_stages > 1 else ''}) "
            f"needs {need} bytes, the device has {limit}")
