"""What a verify tile needs on chip, and the largest tile that fits a device.

The tuned tile table (:mod:`splitkv.tuning`) was measured at head dims 128
and 256; other head dims take its nearest entry (or a default), and the
kernel pads head dims to powers of two, except a head of ``Dv`` plus a power
of two (MLA's 576 = 512 + 64), which it takes in those two chunks
(:func:`rope_dim`; "MLA" in :mod:`splitkv.kernels.verify`). Padded to 1024,
MLA's 576/512 at 64 query rows got a tile that needed 525824 bytes of shared
memory against the H200's 232448, and Triton raised ``OutOfResources`` after
the gate had accepted the call. :func:`shared_memory_bytes` says what a tile
needs without compiling, :func:`fit_tile` shrinks a tile until it fits, and
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

The chunked layout (``ROPE_DIM > 0``) pads nothing: ``BLOCK_D`` is the head
dim itself, and a gathered row is ``D`` wide where V is a view of K
(``kv_shared``: the latent serves both dots) or ``D + Dv`` wide otherwise;
the draft block is modelled with its own V (the larger case). The kernel
reloads the query tile for the draft dots, so a converted pool's prefix
loop holds one query tile, not two, and in one stage a converted pool's
tile goes through registers to its converted copy (no pool-dtype buffer).
The compiler places these larger buffers with gaps (up to 20 KB seen, at
32 keys), so the estimate is rounded up to a multiple of
``CHUNKED_GRANULE`` (32 KB).

Calibration: compiled for sm_90 (``python -m splitkv.bench.record_resources``) with
Triton 3.6.0 (the H200's, on its host) and 3.9.0 (this repository's CPU
environment), 156 configurations each, in the padded layout. The model is
at or above every compiled value (``tests/test_resources.py``) and within a
few per cent of the H200's tuned tiles; see :data:`CALIBRATION`. The
chunked layout was calibrated the same way (Triton 3.9.0, 35 compiles) on
MLA's tiles: bf16, fp8 (bf16 and fp16 queries) and float32 pools, V a view
of K or not, token pools and pages of 16 and 64, every merge mode, every
feature, and 192/128 and 80/64 heads (``CHUNKED_COMPILED`` in
``tests/test_resources.py``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from .tile import TileConfig

__all__ = ["shared_memory_bytes", "device_shared_memory", "fit_tile", "shared_memory_reason", "tile_candidates",
           "rope_dim", "shares_rows", "next_pow2", "DeviceLimits", "device_limits", "H200_SHARED_MEMORY",
           "CALIBRATION", "OutOfDeviceResources", "refuse", "refusal"]

#: The H200's (and H100's) per-block opt-in shared memory: 227 KB, what Triton's launch checks against.
H200_SHARED_MEMORY = 232448
#: What the model was calibrated against (see the module docstring).
CALIBRATION = "Triton 3.6.0 and 3.9.0, sm_90, 156 compiles each (splitkv/shared_memory_sm90.json)"
#: Bytes added to every estimate: allocations are aligned, and the compiler adds a few small buffers.
SLACK = 1024
#: The chunked (MLA) layout's estimate is rounded up to a multiple of this many bytes: its compiled
#: kernels place their buffers with gaps (up to 20 KB at 32 keys, see the module docstring).
CHUNKED_GRANULE = 32768


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= max(n, 1)``."""
    return 1 << (max(1, n) - 1).bit_length()


def _dtype(dtype) -> torch.dtype:
    """A torch dtype from itself or its name (``"float8_e4m3fn"``)."""
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def rope_dim(head_dim: int, v_head_dim: int) -> int:
    """The second QK chunk of a head the kernel takes in two (``ROPE_DIM``), or 0 (one padded chunk).

    A head dim that is not a power of two but is ``v_head_dim`` plus a power of
    two, both at least 16 (a tensor-core dot's depth), is taken as
    ``v_head_dim + rope``: MLA's 576 = 512 + 64, or 192 = 128 + 64. The
    kernel then pads nothing, where one chunk would pad 576 to 1024.
    """
    rope = head_dim - v_head_dim
    if _is_pow2(head_dim) or not (_is_pow2(v_head_dim) and _is_pow2(rope)) or min(v_head_dim, rope) < 16:
        return 0
    return rope


def shares_rows(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``v`` is ``k[..., :Dv]``: same storage, address, dtype, strides and leading shape.

    Then the kernel loads each row once for both (``KV_SHARED``): MLA's value
    rows are its latent rows, the first ``Dv`` of the ``D`` key columns.
    """
    return (v.data_ptr() == k.data_ptr() and v.dtype == k.dtype and v.stride() == k.stride()
            and v.shape[:-1] == k.shape[:-1] and v.shape[-1] <= k.shape[-1])


def _index_pipelined(block_n: int, num_warps: int, page_size: int) -> bool:
    """Whether Triton pipelines the key loop's slot / page-id load (then K and V get one buffer)."""
    if page_size > 1 and page_size % block_n == 0:
        return False  # the tile lies in one page: one scalar page id
    if page_size > 1 and block_n <= 64 and block_n % page_size == 0:
        return True  # whole pages: a vector of page ids
    return block_n < 32 * num_warps


def shared_memory_bytes(config: TileConfig, head_dim: int, v_head_dim: int, kv_dtype, q_dtype,
                        page_size: int = 1, max_len_extend: int = 16, kv_shared: bool = False,
                        rope: Optional[int] = None) -> int:
    """Shared memory (bytes) of ``_verify_kernel`` compiled for sm_90 with tile ``config``: the model above.

    ``kv_dtype``/``q_dtype``: torch dtypes (or their names) of the pool and the
    queries; ``page_size`` 1 for a token pool; ``max_len_extend`` sets the
    draft loop's block (``max(16, min(block_n, next_pow2))``, 16 up to 16 drafts).
    ``rope``: the kernel's ``ROPE_DIM`` (default :func:`rope_dim`, what the plan
    launches; 0 models the one padded chunk); ``kv_shared``: V is a view of K
    in the pools (``KV_SHARED``, the chunked layout only).
    """
    rope = rope_dim(head_dim, v_head_dim) if rope is None else rope
    bm, bn, stages = config.block_m, config.block_n, config.num_stages
    kv_dtype, q_dtype = _dtype(kv_dtype), _dtype(q_dtype)
    convert = kv_dtype != q_dtype  # K and V are converted on chip (fp8 pools)
    cb, kb = q_dtype.itemsize, kv_dtype.itemsize  # compute (query) and pool element sizes
    if rope:  # two exact chunks; a shared row is K and V at once
        qk, row, draft_row = head_dim, head_dim + (0 if kv_shared else v_head_dim), head_dim + v_head_dim
    else:
        qk = next_pow2(head_dim)
        row = draft_row = qk + next_pow2(v_head_dim)
    wgmma = bm >= 64 and cb == 2
    piped = stages > 1 and _index_pipelined(bn, config.num_warps, page_size)
    nbuf = 1 if stages <= 2 or piped else stages - 1
    nbuf += int(wgmma and stages > 1 and not convert)
    if rope and convert and stages == 1:
        nbuf = 0  # unpipelined, a chunked pool tile goes through registers straight to its converted copy
    prefix = nbuf * bn * row * kb + (3 * bn * 4 if piped else 0)
    if wgmma:
        prefix += bn * row * cb if convert else 0  # the converted K and V the dot reads
    else:
        prefix += bm * bn * cb  # P
    nd = max(16, min(bn, next_pow2(max_len_extend)))
    draft = (max(1, stages - 1) + int(wgmma and stages > 1)) * nd * draft_row * cb + (0 if wgmma else bm * nd * cb)
    q = bm * qk * cb
    if not rope:  # a converted pool's prefix loop holds the converted query tile too
        return max(q * (2 if convert else 1) + prefix, q + draft) + SLACK
    # The chunked kernel reloads the query tile for the draft block: one tile through the prefix loop.
    total = max(q + prefix, q + draft) + SLACK
    return -(-total // CHUNKED_GRANULE) * CHUNKED_GRANULE


def _prop(props, *names) -> Optional[int]:
    """The first of ``names`` that ``props`` has with a positive value, as an int; ``None`` if none does."""
    for name in names:
        value = getattr(props, name, None)
        if isinstance(value, (int, float)) and value > 0:
            return int(value)
    return None


@dataclass(frozen=True)
class DeviceLimits:
    """What an SM holds, from ``torch.cuda.get_device_properties`` (any of it may be unknown: ``None``).

    Attributes:
        num_sms: SMs (compute units on ROCm).
        shared_memory_per_sm: shared memory (LDS) per SM, bytes.
        shared_memory_per_block: the most one block may take (the opt-in limit where reported), bytes.
        regs_per_sm: 32-bit registers per SM.
        warp_size: threads per warp (64 on AMD's wavefronts).
        max_threads_per_sm: resident threads per SM.
        hip: a ROCm build of torch (``torch.version.hip``).
    """

    num_sms: Optional[int] = None
    shared_memory_per_sm: Optional[int] = None
    shared_memory_per_block: Optional[int] = None
    regs_per_sm: Optional[int] = None
    warp_size: int = 32
    max_threads_per_sm: Optional[int] = None
    hip: bool = False

    @classmethod
    def from_properties(cls, props, hip: Optional[bool] = None) -> "DeviceLimits":
        """From a ``torch.cuda.get_device_properties`` result, or any object with some of its attributes.

        Every property is optional (ROCm builds, and older torch, lack some):
        per-block shared memory is ``shared_memory_per_block_optin``, else
        ``shared_memory_per_block``; per SM, ``shared_memory_per_multiprocessor``,
        else the per-block figure (one block's worth); ``warp_size`` defaults
        to 64 on ROCm, 32 elsewhere. ``hip``: default ``torch.version.hip`` is set.
        """
        if hip is None:
            import torch

            hip = getattr(torch.version, "hip", None) is not None
        per_block = _prop(props, "shared_memory_per_block_optin", "shared_memory_per_block")
        per_sm = _prop(props, "shared_memory_per_multiprocessor", "max_shared_memory_per_multiprocessor") or per_block
        return cls(num_sms=_prop(props, "multi_processor_count"), shared_memory_per_sm=per_sm,
                   shared_memory_per_block=per_block,
                   regs_per_sm=_prop(props, "regs_per_multiprocessor", "registers_per_multiprocessor"),
                   warp_size=_prop(props, "warp_size") or (64 if hip else 32),
                   max_threads_per_sm=_prop(props, "max_threads_per_multi_processor",
                                            "max_threads_per_multiprocessor"),
                   hip=bool(hip))

    @property
    def reserved_shared_memory(self) -> int:
        """Shared memory the driver keeps per resident block (1 KB on NVIDIA since sm_80; none counted on ROCm)."""
        return 0 if self.hip else 1024


@functools.lru_cache(maxsize=None)
def device_limits(index: int) -> DeviceLimits:
    """The :class:`DeviceLimits` of CUDA (or ROCm) device ``index``, read once (the package's one reader of
    ``torch.cuda.get_device_properties``' limits; :func:`splitkv.tuning.clear_cache` forgets them)."""
    return DeviceLimits.from_properties(torch.cuda.get_device_properties(index))


def device_shared_memory(device=None) -> Optional[int]:
    """The per-block (opt-in) shared memory of a CUDA device, in bytes (:attr:`DeviceLimits.shared_memory_per_block`);
    ``None`` off CUDA.

    ``None`` for the CPU (the Triton interpreter has no such limit): callers
    that want the H200's limit there pass :data:`H200_SHARED_MEMORY`
    themselves. Read once per device (:func:`device_limits`).
    """
    device = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    if device.type != "cuda":
        return None
    return device_limits(device.index if device.index is not None else torch.cuda.current_device()
                         ).shared_memory_per_block


def tile_candidates(config: TileConfig) -> Iterator[TileConfig]:
    """``config``, then smaller tiles in the order :func:`fit_tile` tries them.

    Per ``block_n`` (halved down to 16), stages from ``config``'s down to 1;
    ``block_m``, warps and the K layout are kept. Stage 1 is worth trying after
    2: Triton pipelines nothing then, which with wgmma (64-row tiles) halves the
    K/V buffers (MLA with a value pool of its own, 64 keys: 212992 bytes compiled
    in one stage, where two stages need twice the K/V buffers and do not fit).
    """
    bn = config.block_n
    while True:
        for stages in range(config.num_stages, 0, -1):
            yield TileConfig(config.block_m, bn, config.num_warps, stages, config.k_rows)
        if bn <= 16:
            return
        bn //= 2


def fit_tile(config: TileConfig, head_dim: int, v_head_dim: int, kv_dtype, q_dtype, limit: Optional[int],
             page_size: int = 1, max_len_extend: int = 16, kv_shared: bool = False) -> Optional[TileConfig]:
    """``config`` if it fits in ``limit`` bytes of shared memory, else the first of
    :func:`tile_candidates` that does, else ``None``. ``limit`` ``None``: no limit (``config``).
    ``kv_shared``: V is a view of K in the pools (:func:`shared_memory_bytes`)."""
    if limit is None:
        return config
    for tile in tile_candidates(config):
        if shared_memory_bytes(tile, head_dim, v_head_dim, kv_dtype, q_dtype, page_size, max_len_extend,
                               kv_shared) <= limit:
            return tile
    return None


def shared_memory_reason(config: TileConfig, head_dim: int, v_head_dim: int, kv_dtype, q_dtype,
                         limit: Optional[int], page_size: int = 1, max_len_extend: int = 16,
                         kv_shared: bool = False) -> Optional[str]:
    """Why no tile from ``config`` down fits ``limit`` bytes (a decline reason), or ``None`` when one does."""
    if fit_tile(config, head_dim, v_head_dim, kv_dtype, q_dtype, limit, page_size, max_len_extend,
                kv_shared) is not None:
        return None
    need, tile = min(((shared_memory_bytes(t, head_dim, v_head_dim, kv_dtype, q_dtype, page_size, max_len_extend,
                                           kv_shared), t)
                      for t in tile_candidates(config)), key=lambda pair: pair[0])
    rope = rope_dim(head_dim, v_head_dim)
    dims = f"{v_head_dim}+{rope}/{v_head_dim}" if rope else f"{next_pow2(head_dim)}/{next_pow2(v_head_dim)}"
    return (f"shared memory: the smallest tile for head dims {dims} "
            f"({tile.block_m} rows, {tile.block_n} keys, {tile.num_stages} stage{'s' if tile.num_stages > 1 else ''}) "
            f"needs {need} bytes, the device has {limit}")


class OutOfDeviceResources(NotImplementedError):
    """The split path declines a plan whose kernel the device cannot hold: Triton's compile raised
    ``OutOfResources`` (a tile the shared-memory model under-estimated). What :meth:`splitkv.VerifyPlan.run`
    raises, as context parallelism raises ``NotImplementedError`` for the calls it declines; the drop-in
    returns ``False`` and :func:`splitkv.verify_attention` runs the baseline instead."""


#: Tiles (:class:`splitkv.schedule.TilePlan`) whose kernel did not compile for lack of resources, with why:
#: the gate declines them from then on, so ``can_handle`` says what a call would do.
_REFUSED: dict = {}


def refuse(tile, reason: str) -> OutOfDeviceResources:
    """Record that ``tile``'s kernel does not fit the device (every later gate declines it); the decline."""
    _REFUSED[tile] = reason = f"resources: {reason}"
    return OutOfDeviceResources(reason)


def refusal(tile) -> Optional[str]:
    """Why ``tile``'s kernel did not compile on its device, or ``None`` (never tried, or it fitted)."""
    return _REFUSED.get(tile)
