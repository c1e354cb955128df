"""The cached runner: fixed scratch, two launches, CUDA-graph safe.

A :class:`VerifySplitKV` is built once per head configuration. Its float32
scratch (the partial outputs and LSEs of stage 1) is sized for the largest
batch it will serve, ``max_bs``, and reused by every smaller batch, so

* the scratch addresses never change: a CUDA graph captured with them stays
  valid, replay after replay;
* memory does not grow with the number of distinct batch sizes seen.

Scratch is kept per CUDA stream: two streams running the same shape at once
each write their own partials. Inside a graph capture the capture stream gets
its own scratch, allocated from the graph's pool on first use.

Scratch size. With ``n_splits`` prefix slices a call needs
``num_tokens x H_Q x (n_splits + 1)`` partial rows. The split chooser gives
large batches fewer slices, so the worst case over ``bs <= max_bs`` is small;
the runner computes it once from the same rule the calls use.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from .checks import interpreting
from .merge import merge_partials
from .occupancy import head_tiles
from .partials import TileConfig, rows_per_tile, split_kv_partials, tile_config
from .splits import choose_n_splits, device_sm_count

__all__ = ["VerifySplitKV"]

#: Prefix length standing for "as long as you like" when sizing scratch.
_UNBOUNDED_PREFIX = 1 << 40


class VerifySplitKV:
    """Split-KV verify attention for one head configuration.

    Args:
        num_q_heads: query heads.
        num_kv_heads: KV heads (divides ``num_q_heads``).
        head_dim: query/key head dimension.
        v_head_dim: value head dimension.
        max_len_extend: most draft tokens per sequence.
        max_bs: most sequences per call; scratch is sized for it.
        device: where the scratch lives.
        pack_gqa: one program per KV head with all its query heads as tile
            rows (reads each prefix byte once). ``False`` gives the seed's
            one-program-per-query-head layout, kept for teaching and benchmarks.
        config: kernel tile shape (default: :func:`splitkv.partials.tile_config`).
        n_splits: a fixed number of prefix slices for every call (default:
            :func:`splitkv.choose_n_splits` per call, from static shapes).

    Calling the runner writes ``o_extend`` and returns it.
    """

    def __init__(
        self,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        v_head_dim: int,
        max_len_extend: int,
        max_bs: int,
        device="cuda",
        *,
        pack_gqa: bool = True,
        config: Optional[TileConfig] = None,
        n_splits: Optional[int] = None,
    ):
        if num_kv_heads < 1 or num_q_heads % num_kv_heads:
            raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
        if max_len_extend < 1 or max_bs < 1:
            raise ValueError("max_len_extend and max_bs must be positive")
        self.num_q_heads, self.num_kv_heads = num_q_heads, num_kv_heads
        self.head_dim, self.v_head_dim = head_dim, v_head_dim
        self.max_len_extend, self.max_bs = max_len_extend, max_bs
        self.device = torch.device(device)
        self.pack_gqa = pack_gqa
        heads_per_tile = num_q_heads // num_kv_heads if pack_gqa else 1
        rows = rows_per_tile(heads_per_tile, max_len_extend)
        self.config = config or tile_config(head_dim, v_head_dim, rows, interpreting())
        #: stage-1 programs per sequence and split
        self.head_tiles = head_tiles(
            num_q_heads, num_kv_heads, max_len_extend, self.config.block_m, pack_gqa
        )
        self.num_sms = device_sm_count(self.device)
        #: programmatic dependent launch of the merge (Hopper and later GPUs;
        #: ``SPLITKV_PDL=0`` turns it off)
        self.pdl = (
            self.device.type == "cuda"
            and torch.cuda.get_device_capability(self.device)[0] >= 9
            and os.environ.get("SPLITKV_PDL", "1") != "0"
        )
        if n_splits is not None and n_splits < 1:
            raise ValueError(f"n_splits must be positive, got {n_splits}")
        self.fixed_n_splits = n_splits
        #: partial rows the scratch holds: the worst case over batch sizes
        self.capacity = max(
            bs * max_len_extend * num_q_heads * (self.n_splits(bs, _UNBOUNDED_PREFIX) + 1)
            for bs in range(1, max_bs + 1)
        )
        if self.capacity * v_head_dim >= 2**31:
            # The kernels index scratch with 32-bit offsets.
            raise ValueError(
                f"scratch of {self.capacity} rows x {v_head_dim} exceeds 2^31 elements: "
                "lower max_bs or max_len_extend"
            )
        self._scratch = {}

    def n_splits(self, batch_size: int, prefix_len: int) -> int:
        """Prefix slices this runner uses for a batch (static shapes only).

        Args:
            batch_size: sequences in the call.
            prefix_len: representative prefix length (``kv_indices.shape[0] // batch_size``).

        Returns:
            The fixed split count if one was given, else :func:`splitkv.choose_n_splits`'s.
        """
        if self.fixed_n_splits is not None:
            return self.fixed_n_splits
        return choose_n_splits(batch_size, self.head_tiles, prefix_len, self.num_sms)

    @property
    def scratch_bytes(self) -> int:
        """Bytes of scratch one stream uses."""
        return self.capacity * (self.v_head_dim + 1) * 4

    def scratch(self):
        """``(part_o, part_lse)`` of the current stream, allocated on first use."""
        key = None
        if self.device.type == "cuda":
            key = torch.cuda.current_stream(self.device).cuda_stream
        bufs = self._scratch.get(key)
        if bufs is None:
            bufs = (
                torch.empty(self.capacity * self.v_head_dim, dtype=torch.float32, device=self.device),
                torch.empty(self.capacity, dtype=torch.float32, device=self.device),
            )
            self._scratch[key] = bufs
        return bufs

    def __call__(
        self,
        q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer,
        qo_indptr, kv_indptr, kv_indices,
        custom_mask=None, mask_indptr=None, is_causal=True, *,
        sm_scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
        sinks=None,
    ):
        """Run both stages. Inputs must have passed :func:`splitkv.can_handle`.

        Takes ``extend_attention_fwd``'s tensors (see
        :func:`splitkv.verify_splitkv_fwd`) and Python-number scales.

        Returns:
            ``o_extend``, written.

        Raises:
            ValueError: if the batch exceeds ``max_bs`` or holds more draft
                rows than ``batch x max_len_extend``.
        """
        bs = qo_indptr.shape[0] - 1
        if bs > self.max_bs:
            raise ValueError(f"batch of {bs} exceeds this runner's max_bs={self.max_bs}")
        if q_extend.shape[0] > bs * self.max_len_extend:
            raise ValueError(f"{q_extend.shape[0]} draft rows exceed bs * max_len_extend")
        n_splits = self.n_splits(bs, kv_indices.shape[0] // bs)
        part_o, part_lse = self.scratch()
        split_kv_partials(
            q_extend, k_extend, v_extend, k_buffer, v_buffer,
            qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, is_causal,
            part_o, part_lse,
            batch_size=bs, max_len_extend=self.max_len_extend, n_splits=n_splits,
            sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale,
            pack_gqa=self.pack_gqa, config=self.config, pdl=self.pdl,
        )
        merge_partials(part_o, part_lse, o_extend, qo_indptr, sinks, batch_size=bs, n_splits=n_splits,
                       pdl=self.pdl)
        return o_extend
