"""verify_splitkv_fwd at SGLang's real call site, and the integration module that puts it there.

SGLang 0.5.10's ``TritonAttnBackend`` (``sglang/srt/layers/attention/triton_backend.py``)
builds its metadata in ``init_forward_metadata`` (eager) and
``init_forward_metadata_capture_cuda_graph`` / ``..._replay_cuda_graph`` (CUDA graphs),
and ``forward_extend`` lays out the arguments of its one ``extend_attention_fwd`` call.
:class:`Backend` below does the same, layout for layout, on the CPU: the dtypes and
lengths of every buffer (indptrs of ``max_bs + 1``, a ``[max_bs]`` offsets buffer, the
padded ``kv_indices`` and uint8 mask of a graph), the pool stores with their fp8 scales
and the sliding-window metadata. Every mode is served (``True``) and matches the float64
oracle and, where the ``sglang`` wheel is installed, SGLang's own kernel read from it.
Where the wheel is installed, SGLang's own ``triton_backend.py`` also runs (its imports
stood in for) and must pass exactly what :class:`Backend` passes.
"""

import importlib.util
import math
import sys
import types
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import pytest
import torch
from conftest import DEVICE, DTYPES, TOLERANCE

from splitkv import can_handle, decline_reason, verify_attention, verify_splitkv_fwd
from splitkv.bench import sglang_extend
from splitkv.extend import extend_attention_fwd
from splitkv.integrations import sglang as integration
from splitkv.options import batch_view
from splitkv.testing import reference_attention, relative_error, tree_mask

H_Q, H_KV, HEAD_DIM = 4, 2, 64
NUM_DRAFT = 4  # speculative_num_draft_tokens: rows per sequence in target-verify
NUM_STEPS = 2  # speculative_num_steps: a graph's draft-extend takes NUM_STEPS + 1 rows per sequence
MAX_BS = 6  # req_to_token_pool.size: the indptr buffers hold MAX_BS + 1 entries
MAX_CONTEXT = 48  # the model's context length: sizes a graph's kv_indices and mask buffers
WINDOW = 8  # sliding_window_size of the sliding-window layers
POOL = 512  # slots in the token pool
SEQ_LENS = [37, 1, 16]  # committed tokens per request (a padded graph sequence has 1)
ACCEPT_LENS = [2, 1, 3]  # draft-extend: accepted tokens per request
TREE = [-1, 0, 0, 1]  # the draft tree's parents (speculative topk > 1)


class Mode:
    """SGLang's ForwardMode, reduced to the questions the backend asks."""

    def __init__(self, name: str):
        self.name = name

    def is_target_verify(self):
        return self.name == "target_verify"

    def is_draft_extend(self, include_v2=False):
        return self.name == "draft_extend" or (include_v2 and self.name == "draft_extend_v2")

    def is_decode_or_idle(self):
        return False


@dataclass
class Layer:
    """The RadixAttention fields forward_extend reads (fp8 layers carry k_scale and its float)."""

    scaling: float = 1.0 / math.sqrt(HEAD_DIM)
    sliding_window_size: int = -1
    logit_cap: float = 0.0
    xai_temperature_len: int = -1
    k_scale: Optional[torch.Tensor] = None
    v_scale: Optional[torch.Tensor] = None
    k_scale_float: Optional[float] = None
    v_scale_float: Optional[float] = None
    layer_id: int = 0
    tp_q_head_num: int = H_Q
    tp_k_head_num: int = H_KV
    qk_head_dim: int = HEAD_DIM
    v_head_dim: int = HEAD_DIM
    is_cross_attention: bool = False
    attn_type: str = "decoder"
    logit_capping_method: str = "tanh"


def fp8_layer(k_scale=0.5, v_scale=2.0, **kw) -> Layer:
    return Layer(k_scale=torch.tensor(k_scale), v_scale=torch.tensor(v_scale), k_scale_float=k_scale,
                 v_scale_float=v_scale, **kw)


@dataclass
class Pool:
    """MHATokenToKVPool's stores and loads: values are divided by the layer's scale before the cast."""

    k: torch.Tensor
    v: torch.Tensor

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, k_scale=None, v_scale=None):
        if cache_k.dtype != self.k.dtype:
            if k_scale is not None:
                cache_k.div_(k_scale)
            if v_scale is not None:
                cache_v.div_(v_scale)
        self.k[loc] = cache_k.to(self.k.dtype)
        self.v[loc] = cache_v.to(self.v.dtype)

    def get_key_buffer(self, layer_id):
        return self.k

    def get_value_buffer(self, layer_id):
        return self.v


@dataclass
class Backend:
    """TritonAttnBackend's metadata and forward_extend, as SGLang 0.5.10 lays them out."""

    extend_attention_fwd: object
    graph: bool = False
    enable_deterministic: bool = False
    # __init__'s buffers: int32 kv_indptr (and its window twin), int64 qo_indptr and mask_indptr
    kv_indptr: torch.Tensor = field(default_factory=lambda: torch.zeros(MAX_BS + 1, dtype=torch.int32, device=DEVICE))
    window_kv_indptr: torch.Tensor = field(default_factory=lambda: torch.zeros(MAX_BS + 1, dtype=torch.int32, device=DEVICE))
    qo_indptr: torch.Tensor = field(default_factory=lambda: torch.zeros(MAX_BS + 1, dtype=torch.int64, device=DEVICE))
    mask_indptr: torch.Tensor = field(default_factory=lambda: torch.zeros(MAX_BS + 1, dtype=torch.int64, device=DEVICE))
    # init_cuda_graph_state's buffers, sized for the largest graph
    cuda_graph_kv_indices: torch.Tensor = field(
        default_factory=lambda: torch.zeros(MAX_BS * NUM_DRAFT * MAX_CONTEXT, dtype=torch.int64, device=DEVICE))
    cuda_graph_custom_mask: torch.Tensor = field(
        default_factory=lambda: torch.zeros(MAX_BS * NUM_DRAFT * MAX_CONTEXT, dtype=torch.uint8, device=DEVICE))
    cuda_graph_window_kv_indices: torch.Tensor = field(
        default_factory=lambda: torch.zeros(MAX_BS * NUM_DRAFT * WINDOW, dtype=torch.int64, device=DEVICE))
    cuda_graph_window_kv_offsets: torch.Tensor = field(default_factory=lambda: torch.zeros(MAX_BS, dtype=torch.int32, device=DEVICE))
    forward_metadata: Optional[SimpleNamespace] = None

    # ---- init_forward_metadata / init_forward_metadata_capture_cuda_graph ----

    def init_forward_metadata(self, batch):
        if batch.forward_mode.is_target_verify():
            self.forward_metadata = self._target_verify(batch)
        elif batch.forward_mode.is_draft_extend():
            self.forward_metadata = self._draft_extend(batch)
        else:
            self.forward_metadata = self._prefill(batch)

    def _prefix(self, req, seq_lens, start=None, lens=None):
        """The pool slots of each request's tokens ``[start, start + lens)``, concatenated (int64)."""
        lens = seq_lens if lens is None else lens
        start = torch.zeros_like(seq_lens) if start is None else start
        slots = [req[i, int(s):int(s) + int(n)] for i, (s, n) in enumerate(zip(start, lens))]
        return torch.cat(slots).to(torch.int64)

    def _indices(self, slots, buffer):
        """Eager: the slots themselves (int64); graph: written into the padded buffer, passed whole."""
        if not self.graph:
            return slots
        buffer[: slots.numel()] = slots
        return buffer

    def _target_verify(self, batch):
        bs, seq_lens = len(batch.seq_lens), batch.seq_lens
        steps = torch.arange(0, (1 + bs) * NUM_DRAFT, NUM_DRAFT, dtype=torch.int32, device=DEVICE)
        if self.graph:
            qo_indptr = self.qo_indptr[: bs + 1]
            qo_indptr[:] = steps  # int64 under graphs
        else:
            qo_indptr = steps
        kv_indptr = self.kv_indptr[: bs + 1]
        kv_indptr[1:] = torch.cumsum(seq_lens, 0)
        kv_indices = self._indices(self._prefix(batch.req_to_token, seq_lens), self.cuda_graph_kv_indices)
        custom_mask = batch.custom_mask
        if self.graph:
            custom_mask = self.cuda_graph_custom_mask
            custom_mask[: batch.custom_mask.shape[0]] = batch.custom_mask
        mask_indptr = self.mask_indptr[: bs + 1]
        mask_indptr[1:] = torch.cumsum(NUM_DRAFT * (seq_lens + NUM_DRAFT), 0)
        md = SimpleNamespace(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices,
                             custom_mask=custom_mask, mask_indptr=mask_indptr, max_extend_len=NUM_DRAFT)
        self._window(md, batch)
        return md

    def _window(self, md, batch):
        """update_sliding_window_buffer(_cuda_graph): the last WINDOW tokens, and where they start."""
        bs, seq_lens = len(batch.seq_lens), batch.seq_lens
        lens = torch.minimum(seq_lens, torch.tensor(WINDOW))
        start = seq_lens - lens
        md.window_kv_indptr = self.window_kv_indptr[: bs + 1]
        md.window_kv_indptr[1:] = torch.cumsum(lens, 0)
        md.window_kv_indices = self._indices(self._prefix(batch.req_to_token, seq_lens, start, lens),
                                             self.cuda_graph_window_kv_indices)
        md.window_kv_offsets = start  # eager: [bs], the dtype of seq_lens
        if self.graph:
            md.window_kv_offsets = self.cuda_graph_window_kv_offsets  # [max_bs] int32, passed whole
            md.window_kv_offsets[:bs] = start

    def _draft_extend(self, batch):
        bs, seq_lens = len(batch.seq_lens), batch.seq_lens
        if self.graph:  # a fixed NUM_STEPS + 1 rows per sequence
            qo_indptr = self.qo_indptr[: bs + 1]
            qo_indptr[:] = torch.arange(0, bs * (NUM_STEPS + 1) + 1, NUM_STEPS + 1, dtype=torch.int32, device=DEVICE)
            kv_indptr = self.kv_indptr[: bs + 1]
            max_extend_len = NUM_STEPS + 1
        else:  # EagleDraftInput.generate_attn_arg_prefill: int32 indptrs of bs + 1
            qo_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=DEVICE)
            qo_indptr[1:] = torch.cumsum(batch.accept_length, 0)
            kv_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=DEVICE)
            max_extend_len = int(batch.accept_length.max())
        kv_indptr[1:] = torch.cumsum(seq_lens, 0)
        slots = self._prefix(batch.req_to_token, seq_lens)
        kv_indices = self._indices(slots, self.cuda_graph_kv_indices) if self.graph else slots.to(torch.int32).to(
            torch.int64)
        return SimpleNamespace(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, custom_mask=None,
                               mask_indptr=None, max_extend_len=max_extend_len)

    def _prefill(self, batch):
        bs = len(batch.seq_lens)
        kv_indptr = self.kv_indptr[: bs + 1]
        kv_indptr[1:] = torch.cumsum(batch.seq_lens, 0)
        qo_indptr = self.qo_indptr[: bs + 1]
        qo_indptr[1:] = torch.cumsum(batch.extend_lens, 0)
        md = SimpleNamespace(qo_indptr=qo_indptr, kv_indptr=kv_indptr,
                             kv_indices=self._prefix(batch.req_to_token, batch.seq_lens), custom_mask=None,
                             mask_indptr=None, max_extend_len=int(batch.extend_lens.max()))
        self._window(md, batch)
        return md

    # ---- forward_extend ----

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None):
        o = torch.empty_like(q)
        if save_kv_cache:
            pool = forward_batch.token_to_kv_pool
            if layer.k_scale is None:
                pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
            else:
                pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k.clone(), v.clone(), layer.k_scale,
                                   layer.v_scale)
        if self.enable_deterministic:
            raise NotImplementedError("the deterministic mode runs SGLang's unified kernel, not this call")
        md = self.forward_metadata
        if layer.sliding_window_size is not None and layer.sliding_window_size > -1:
            window, kv_indptr, kv_indices = layer.sliding_window_size, md.window_kv_indptr, md.window_kv_indices
            offsets = md.window_kv_offsets
        else:
            window, kv_indptr, kv_indices, offsets = -1, md.kv_indptr, md.kv_indices, None
        if layer.k_scale is not None and layer.v_scale is not None:
            k_descale, v_descale = layer.k_scale_float, layer.v_scale_float
        else:
            k_descale = v_descale = 1.0
        self.extend_attention_fwd(
            q.view(-1, layer.tp_q_head_num, layer.qk_head_dim), k.contiguous(), v.contiguous(),
            o.view(-1, layer.tp_q_head_num, layer.v_head_dim),
            forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id),
            forward_batch.token_to_kv_pool.get_value_buffer(layer.layer_id),
            md.qo_indptr, kv_indptr, kv_indices, md.custom_mask, True, md.mask_indptr, md.max_extend_len,
            k_descale, v_descale, layer.scaling, logit_cap=layer.logit_cap, sliding_window_size=window, sinks=sinks,
            window_kv_offsets=offsets, xai_temperature_len=layer.xai_temperature_len)
        return o


def _tree_masks(seq_lens) -> torch.Tensor:
    """spec_info.custom_mask: per request, NUM_DRAFT rows of seq_len + NUM_DRAFT columns, the prefix visible."""
    draft = tree_mask(TREE)
    rows = [torch.cat([torch.ones(NUM_DRAFT, int(n), dtype=torch.bool), draft], 1).flatten() for n in seq_lens]
    return torch.cat(rows)


def make_step(mode: str, *, graph=False, dtype=torch.float16, kv_dtype=None, seed=0):
    """One forward pass: its batch (mode, lengths, the request table, the pool) and the layer's q, k, v."""
    gen = torch.Generator().manual_seed(seed)
    kv_dtype = kv_dtype or dtype
    seq_lens = torch.tensor(SEQ_LENS, dtype=torch.int32 if graph else torch.int64, device=DEVICE)
    # The requests' slots, and apart from them the slots this step's tokens are stored in.
    req_to_token = torch.randperm(POOL - 64, generator=gen)[: MAX_BS * MAX_CONTEXT].view(MAX_BS, MAX_CONTEXT).int()
    accept = torch.tensor(ACCEPT_LENS, dtype=torch.int32, device=DEVICE)
    if mode == "target_verify":
        rows = [NUM_DRAFT] * len(SEQ_LENS)
    elif mode.startswith("draft_extend"):
        rows = [NUM_STEPS + 1] * len(SEQ_LENS) if graph else ACCEPT_LENS
    else:
        rows = [5, 9, 3]
    n = sum(rows)
    pool = Pool(*(torch.randn(POOL, H_KV, HEAD_DIM, generator=gen).to(DEVICE, kv_dtype) for _ in range(2)))
    batch = SimpleNamespace(forward_mode=Mode(mode), seq_lens=seq_lens, req_to_token=req_to_token.to(DEVICE),
                            accept_length=accept, extend_lens=torch.tensor(rows, device=DEVICE),
                            custom_mask=_tree_masks(SEQ_LENS).to(DEVICE), token_to_kv_pool=pool,
                            out_cache_loc=torch.arange(POOL - n, POOL, device=DEVICE))
    # RadixAttention.forward hands the backend q flat, k and v as [tokens, heads, head_dim].
    q = torch.randn(n, H_Q * HEAD_DIM, generator=gen).to(DEVICE, dtype)
    k, v = (torch.randn(n, H_KV, HEAD_DIM, generator=gen).to(DEVICE, dtype) for _ in range(2))
    return batch, (q, k, v)


class Recorder:
    """Stands in for the kernel: keeps the arguments of each call."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))


def call_site(mode: str, layer: Layer, *, graph=False, sinks=None, **step):
    """The arguments forward_extend passes to extend_attention_fwd in this mode, and the batch."""
    rec = Recorder()
    backend = Backend(rec, graph=graph)
    batch, (q, k, v) = make_step(mode, graph=graph, **step)
    backend.init_forward_metadata(batch)
    backend.forward_extend(q, k, v, layer, batch, sinks=sinks)
    (args, kwargs), = rec.calls
    return args, kwargs


def oracle(args, kwargs):
    """The float64 oracle on extend_attention_fwd's positional and keyword arguments."""
    (q, k, v, _, kb, vb, qo, kvp, kvi, mask, causal, mask_indptr, _, k_scale, v_scale, sm_scale) = args
    return reference_attention(q, k, v, kb, vb, qo, kvp, kvi, custom_mask=mask, is_causal=causal,
                               mask_indptr=mask_indptr, k_scale=k_scale, v_scale=v_scale, sm_scale=sm_scale,
                               **kwargs)


def with_output(args, fill=float("nan")):
    return args[:3] + (torch.full_like(args[3], fill),) + args[4:]


def sglang_kernel():
    """SGLang's own extend_attention_fwd read from the wheel, or None where it is not installed."""
    try:
        return sglang_extend.load_extend()[0]
    except sglang_extend.SglangNotFound:
        return None


def check_served(args, kwargs, dtype, sglang_tolerance=None):
    """The call is served, matches the oracle and, where the wheel is, SGLang's kernel."""
    args = with_output(args)
    assert verify_splitkv_fwd(*args, **kwargs, check=True)
    ref = oracle(args, kwargs)
    assert relative_error(args[3], ref) < TOLERANCE[dtype]
    theirs = run_sglang(args, kwargs)
    if theirs is not None:
        assert relative_error(theirs, ref) < (sglang_tolerance or TOLERANCE[dtype])
    return args[3], ref


def run_sglang(args, kwargs):
    """SGLang's kernel's output for these arguments, or None without the wheel."""
    kernel = sglang_kernel()
    if kernel is None:
        return None
    args = with_output(args)
    with warnings.catch_warnings():  # its uint8 mask in tl.where, exp of -inf sinks under the interpreter
        warnings.simplefilter("ignore")
        kernel(*args, **kwargs)
    return args[3]


# ---- every layout of target-verify and draft-extend ---------------------------------------------------------

MODES = {
    "target_verify": dict(mode="target_verify", layer=Layer()),
    "target_verify_graph": dict(mode="target_verify", layer=Layer(), graph=True),
    "draft_extend": dict(mode="draft_extend", layer=Layer()),
    "draft_extend_graph": dict(mode="draft_extend", layer=Layer(), graph=True),
    "sliding_window": dict(mode="target_verify", layer=Layer(sliding_window_size=WINDOW)),
    "sliding_window_graph": dict(mode="target_verify", layer=Layer(sliding_window_size=WINDOW), graph=True),
    "sinks_window_graph": dict(mode="target_verify", layer=Layer(sliding_window_size=WINDOW), graph=True,
                               sinks=torch.linspace(-1.0, 2.0, H_Q, device=DEVICE)),
    "logit_cap_xai": dict(mode="target_verify", layer=Layer(logit_cap=3.0, xai_temperature_len=16)),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(MODES))
def test_every_mode_is_served_as_sglang_lays_it_out(case, dtype):
    kw = dict(MODES[case])
    args, kwargs = call_site(kw.pop("mode"), kw.pop("layer"), dtype=dtype, **kw)
    check_served(args, kwargs, dtype)


def test_graph_layouts_are_longer_than_the_batch():
    """What the graph mode passes, so the test above covers it: int64 qo_indptr, the whole padded kv_indices and
    uint8 mask buffers, and the [max_bs] offsets buffer."""
    args, kwargs = call_site("target_verify", Layer(sliding_window_size=WINDOW), graph=True)
    bs = len(SEQ_LENS)
    assert args[6].dtype == torch.int64 and args[7].dtype == torch.int32 and args[6].shape == (bs + 1,)
    assert args[8].shape[0] > sum(min(n, WINDOW) for n in SEQ_LENS) and args[9].dtype == torch.uint8
    assert kwargs["window_kv_offsets"].shape == (MAX_BS,) and kwargs["window_kv_offsets"].dtype == torch.int32
    eager, _ = call_site("target_verify", Layer())
    assert eager[6].dtype == torch.int32 and eager[9].dtype == torch.bool and eager[11].dtype == torch.int64


def test_buffers_longer_than_the_batch_are_read_to_the_batch_only():
    """kv_indptr, mask_indptr and window_kv_offsets of max_bs entries whose tail is garbage: the first bs count."""
    args, kwargs = call_site("target_verify", Layer(sliding_window_size=WINDOW))
    bs = len(SEQ_LENS)
    garbage = dict(dtype=torch.int64, device=DEVICE)
    long_kv = torch.cat([args[7].long(), torch.full((MAX_BS - bs,), 10**6, **garbage)])
    long_mask = torch.cat([args[11], torch.full((MAX_BS - bs,), -7, **garbage)])
    offsets = torch.cat([kwargs["window_kv_offsets"], torch.full((MAX_BS - bs,), 10**6, **garbage)])
    args = args[:7] + (long_kv, args[8], args[9], args[10], long_mask) + args[12:]
    kwargs = dict(kwargs, window_kv_offsets=offsets)
    assert can_handle(*args[:3], *args[4:9], o_extend=args[3], custom_mask=args[9], is_causal=True,
                      mask_indptr=long_mask, max_len_extend=NUM_DRAFT, sliding_window_size=WINDOW,
                      window_kv_offsets=offsets)
    out, ref = check_served(args, kwargs, torch.float16)
    assert out.shape[0] == bs * NUM_DRAFT


def test_verify_attention_and_decline_reason_take_the_graph_layout_too():
    args, kwargs = call_site("target_verify", Layer(sliding_window_size=WINDOW), graph=True, dtype=torch.float32)
    options = dict(kwargs, custom_mask=args[9], is_causal=args[10], mask_indptr=args[11], max_len_extend=args[12],
                   k_scale=args[13], v_scale=args[14], sm_scale=args[15])
    assert decline_reason(*args[:3], *args[4:9], **options) is None
    out = verify_attention(*args[:3], None, *args[4:9], **options)
    assert relative_error(out, oracle(args, kwargs)) < TOLERANCE[torch.float32]


def test_batch_view_cuts_views_and_leaves_everything_else():
    qo, kv = torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int32)
    meta = dict(custom_mask=None, mask_indptr=torch.zeros(4), sinks=None, window_kv_offsets=torch.zeros(3),
                kv_last_page_len=None)
    got_kv, got_meta = batch_view(qo, kv, meta)
    assert got_kv is kv and got_meta is meta  # nothing longer: nothing made
    long_kv, offsets = torch.arange(9), torch.arange(MAX_BS)
    got_kv, got_meta = batch_view(qo, long_kv, dict(meta, window_kv_offsets=offsets))
    assert got_kv.shape == (4,) and got_kv.data_ptr() == long_kv.data_ptr()  # views: a graph reads the buffers
    assert got_meta["window_kv_offsets"].shape == (3,) and got_meta["window_kv_offsets"].data_ptr() == offsets.data_ptr()
    assert got_meta["mask_indptr"] is meta["mask_indptr"]
    for bad_qo, bad_kv in ((torch.zeros(2, 4), long_kv), (qo, list(range(9))), (qo, torch.zeros(9, 2))):
        assert batch_view(bad_qo, bad_kv, meta)[0] is bad_kv  # for validation to name


def test_too_short_metadata_is_an_error():
    args, kwargs = call_site("target_verify", Layer(sliding_window_size=WINDOW))
    short = dict(kwargs, window_kv_offsets=kwargs["window_kv_offsets"][:-1])
    with pytest.raises(ValueError, match="window_kv_offsets"):
        verify_splitkv_fwd(*args, **short, check=True)
    assert not verify_splitkv_fwd(*args, **short, check=False)
    with pytest.raises(ValueError, match="kv_indptr"):
        verify_splitkv_fwd(*args[:7], args[7][:-1], *args[8:], **kwargs, check=True)


@pytest.mark.parametrize("falsy", [0.0, 0, None])
def test_a_falsy_sm_scale_is_the_default(falsy):
    args, kwargs = call_site("target_verify", Layer(scaling=falsy))
    out, ref = check_served(args, kwargs, torch.float16)
    default, _ = check_served(call_site("target_verify", Layer())[0], kwargs, torch.float16)
    assert torch.equal(out, default)


# ---- fp8 pools ------------------------------------------------------------------------------------------------

#: How far SGLang's kernel is from the float64 oracle on fp8 pools (relative error, fp16 and fp32 inputs): it
#: rounds the queries and the softmax weights to the pool's fp8 type for its prefix dots, where splitkv
#: dequantises K/V to the queries' type. Measured on these shapes: e4m3 3.5-7.2 %, e5m2 5.8-8.0 %.
SGLANG_FP8_ERROR = {torch.float8_e4m3fn: (0.02, 0.1), torch.float8_e5m2: (0.03, 0.12)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_dtype", list(SGLANG_FP8_ERROR))
@pytest.mark.parametrize("case", ["target_verify", "sliding_window_graph", "draft_extend"])
def test_fp8_pools_with_float_scales(case, kv_dtype, dtype):
    """splitkv computes in the queries' type (the oracle's accuracy); SGLang's kernel, in fp8, is a few % off."""
    kw = dict(MODES[case])
    layer = fp8_layer(sliding_window_size=kw.pop("layer").sliding_window_size)
    args, kwargs = call_site(kw.pop("mode"), layer, dtype=dtype, kv_dtype=kv_dtype, **kw)
    assert args[4].dtype == kv_dtype and (args[13], args[14]) == (0.5, 2.0)
    _, ref = check_served(args, kwargs, dtype, sglang_tolerance=SGLANG_FP8_ERROR[kv_dtype][1])
    theirs = run_sglang(args, kwargs)
    if theirs is not None:
        assert relative_error(theirs, ref) > SGLANG_FP8_ERROR[kv_dtype][0]


# ---- the integration module -----------------------------------------------------------------------------------


class Spy:
    """SGLang's kernel (here splitkv's baseline, which takes the same arguments), recording its calls."""

    def __init__(self, kernel=extend_attention_fwd):
        self.kernel, self.calls = kernel, []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        if self.kernel is not None:
            self.kernel(*args, **kwargs)


def installed(graph=False, kernel=extend_attention_fwd):
    backend = Backend(Spy(kernel), graph=graph)
    spy = backend.extend_attention_fwd
    integration.install(backend, max_bs=MAX_BS)
    return backend, spy


def forward(backend, mode, layer, sinks=None, **step):
    batch, (q, k, v) = make_step(mode, graph=backend.graph, **step)
    backend.init_forward_metadata(batch)
    return backend.forward_extend(q, k, v, layer, batch, sinks=sinks)


@pytest.mark.parametrize("case", ["target_verify", "target_verify_graph", "draft_extend", "draft_extend_graph",
                                  "draft_extend_v2", "sliding_window_graph", "fp8"])
def test_install_serves_the_speculative_steps(case):
    kw = dict(MODES["target_verify" if case == "fp8" else case.replace("_v2", "")])
    mode, layer, graph = kw.pop("mode"), kw.pop("layer"), kw.pop("graph", False)
    mode = mode + "_v2" if case.endswith("_v2") else mode  # eager: SGLang lays it out as a prefill
    step = dict(kv_dtype=torch.float8_e4m3fn) if case == "fp8" else {}
    layer = fp8_layer() if case == "fp8" else layer
    backend, spy = installed(graph)
    o = forward(backend, mode, layer, **step, **kw)
    assert spy.calls == []  # served: SGLang's kernel never ran
    args, kwargs = call_site(mode, layer, graph=graph, **step, **kw)  # the same step: what SGLang passes
    assert relative_error(o.view(args[3].shape), oracle(args, kwargs)) < TOLERANCE[torch.float16]


@pytest.mark.parametrize("layer", [Layer(), fp8_layer(), Layer(sliding_window_size=WINDOW)])
def test_install_leaves_prefill_to_sglang(layer):
    backend, spy = installed()
    o = forward(backend, "extend", layer)
    (args, kwargs), = spy.calls
    assert_same_call((args, kwargs), call_site("extend", layer))
    assert relative_error(o.view(args[3].shape), oracle(args, kwargs)) < TOLERANCE[torch.float16]


@pytest.mark.parametrize("layer", [Layer(), fp8_layer(), Layer(sliding_window_size=WINDOW)])
def test_a_declined_call_reaches_sglang_with_its_own_arguments(layer, monkeypatch):
    """SGLang's kernel gets exactly what forward_extend built: the scales of an unquantised layer as 1.0, a
    sliding-window layer's window indices and offsets, the graph's padded buffers."""
    monkeypatch.setattr(integration, "verify_splitkv_fwd", lambda *args, **kwargs: False)  # every call declined
    backend, spy = installed(graph=True, kernel=None)
    forward(backend, "target_verify", layer)
    (args, kwargs), = spy.calls
    assert_same_call((args, kwargs), call_site("target_verify", layer, graph=True))
    assert isinstance(args[13], float) and isinstance(args[14], float)
    assert (kwargs["window_kv_offsets"] is not None) == (layer.sliding_window_size > 0)
    assert kwargs["sliding_window_size"] == (layer.sliding_window_size if layer.sliding_window_size > 0 else -1)


def test_install_once():
    backend, spy = installed()
    kernel = backend.extend_attention_fwd
    assert integration.install(backend) is kernel and kernel.sglang_kernel is spy and not kernel.active



def test_the_tests_install_the_release_the_module_names():
    makefile = (Path(__file__).resolve().parent.parent / "Makefile").read_text()
    assert f"SGLANG ?= sglang=={integration.SGLANG_VERSION}\n" in makefile


def assert_same_call(got, want):
    """Two extend_attention_fwd calls with equal arguments (tensors by value, the output by shape)."""
    (ga, gk), (wa, wk) = got, want
    assert len(ga) == len(wa) and gk.keys() == wk.keys()
    for i, (g, w) in enumerate(list(zip(ga, wa)) + [(gk[n], wk[n]) for n in wk]):
        if isinstance(w, torch.Tensor):
            assert g.dtype == w.dtype and g.shape == w.shape and (i == 3 or torch.equal(g, w)), i
        else:
            assert type(g) is type(w) and g == w, i


# ---- the model above against SGLang's own backend -------------------------------------------------------------

#: What triton_backend.py imports from SGLang, reduced to what its metadata code and forward_extend use.
_STAND_INS = {
    "sglang.srt.utils": dict(is_cuda=lambda: False, get_bool_env_var=lambda *a: False,
                             get_device_core_count=lambda *a: 0, get_int_env_var=lambda name, default: default,
                             next_power_of_2=lambda n: 1 << (n - 1).bit_length()),
    "sglang.srt.configs.model_config": dict(AttentionArch=SimpleNamespace(MLA="mla")),
    "sglang.srt.layers.attention.base_attn_backend": dict(AttentionBackend=object),
    "sglang.srt.layers.dp_attention": dict(get_attention_tp_size=lambda: 1),
    "sglang.srt.layers.radix_attention": dict(AttentionType=SimpleNamespace(
        DECODER="decoder", ENCODER_ONLY="encoder_only", DECODER_BIDIRECTIONAL="decoder_bidirectional")),
    "sglang.srt.model_executor.forward_batch_info": dict(ForwardBatch=object, ForwardMode=Mode),
    "sglang.srt.speculative.spec_utils": dict(generate_draft_decode_kv_indices=None),
}
_BACKEND_FILES = ("layers/attention/utils.py", "layers/attention/triton_backend.py")


def _sglang_srt_sources():
    """The text of SGLang's attention utils and Triton backend, from its wheel or installation (or skip)."""
    try:
        source = sglang_extend.find_sources()[1]["source"]
    except sglang_extend.SglangNotFound:
        pytest.skip("no sglang wheel: " + sglang_extend.install_hint())
    if source.endswith(".whl"):
        with zipfile.ZipFile(source) as z:
            return [z.read(f"sglang/srt/{f}").decode() for f in _BACKEND_FILES]
    srt = Path(source).parents[2]  # .../sglang/srt/layers/attention/triton_ops
    return [(srt / f).read_text() for f in _BACKEND_FILES]


@pytest.fixture(scope="module")
def sglang_backend_class(tmp_path_factory):
    """SGLang's TritonAttnBackend class, run from its own source with stand-ins for the modules it imports."""
    folder = tmp_path_factory.mktemp("sglang_backend")
    names = list(_STAND_INS) + ["sglang.srt." + rel[:-3].replace("/", ".") for rel in _BACKEND_FILES]
    saved = {name: sys.modules.get(name) for name in names}
    try:
        for name, attrs in _STAND_INS.items():
            sys.modules[name] = types.SimpleNamespace(**attrs)
        for rel, text in zip(_BACKEND_FILES, _sglang_srt_sources()):
            path = folder / Path(rel).name  # Triton reads a kernel's source from its file
            path.write_text(text)
            name = "sglang.srt." + rel[:-3].replace("/", ".")
            spec = importlib.util.spec_from_file_location(name, path)
            sys.modules[name] = module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        yield module.TritonAttnBackend
    finally:  # sys.modules as it was: SGLang's names are not left behind
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def sglang_backend(cls, batch, kernel, graph=False):
    """SGLang's own TritonAttnBackend with ``kernel`` as its extend kernel, its metadata built for ``batch``."""
    model = Backend(None, graph=graph)
    real = cls.__new__(cls)
    bs = len(SEQ_LENS)
    # __init__'s attributes (the buffers as the model allocates them), then init_cuda_graph_state's buffers
    real.__dict__.update(
        kv_indptr=model.kv_indptr, window_kv_indptr=model.window_kv_indptr, qo_indptr=model.qo_indptr,
        mask_indptr=model.mask_indptr, req_to_token=batch.req_to_token, sliding_window_size=WINDOW,
        num_draft_tokens=NUM_DRAFT, speculative_num_steps=NUM_STEPS, device=DEVICE, skip_prefill=False,
        token_to_kv_pool_allocator=None, use_mla=False, enable_deterministic=False, num_head=H_Q,
        max_kv_splits=8, v_head_dim=HEAD_DIM, max_context_len=MAX_CONTEXT,
        allow_bidirectional_attention_in_extend=False, extend_attention_fwd=kernel)
    real.init_cuda_graph_state(MAX_BS, MAX_BS * NUM_DRAFT)
    pools = torch.arange(bs, device=DEVICE)
    spec_info = SimpleNamespace(custom_mask=batch.custom_mask)
    if graph:
        real.init_forward_metadata_capture_cuda_graph(bs, int(batch.extend_lens.sum()), pools, batch.seq_lens,
                                                      None, batch.forward_mode, spec_info)
    else:
        real.init_forward_metadata(SimpleNamespace(
            batch_size=bs, forward_mode=batch.forward_mode, spec_info=spec_info, req_pool_indices=pools,
            seq_lens=batch.seq_lens, extend_prefix_lens=batch.seq_lens, extend_prefix_lens_cpu=SEQ_LENS,
            extend_seq_lens=batch.extend_lens, extend_seq_lens_cpu=batch.extend_lens.tolist()))
    return real


def sglang_call(cls, mode, layer, *, graph=False, **step):
    """The arguments SGLang's own metadata code and forward_extend pass, on the step :func:`call_site` models."""
    batch, (q, k, v) = make_step(mode, graph=graph, **step)
    real = sglang_backend(cls, batch, Recorder(), graph)
    real.forward_extend(q, k, v, layer, batch)
    (args, kwargs), = real.extend_attention_fwd.calls
    return args, kwargs


@pytest.mark.parametrize("mode,window,graph", [
    ("target_verify", -1, False), ("target_verify", WINDOW, False), ("target_verify", -1, True),
    ("target_verify", WINDOW, True), ("draft_extend", -1, True), ("extend", -1, False), ("extend", WINDOW, False),
])
def test_the_model_is_sglang_s_own_layout(sglang_backend_class, mode, window, graph):
    """SGLang 0.5.10's own init_forward_metadata(_capture_cuda_graph) and forward_extend pass what the model
    above passes (draft-extend eager builds its metadata in the EAGLE input, which the model follows)."""
    layer = fp8_layer(sliding_window_size=window)
    want = call_site(mode, layer, graph=graph, kv_dtype=torch.float8_e4m3fn)
    assert_same_call(sglang_call(sglang_backend_class, mode, layer, graph=graph, kv_dtype=torch.float8_e4m3fn),
                     want)


@pytest.mark.parametrize("mode,window,graph", [("target_verify", -1, False), ("target_verify", WINDOW, True),
                                               ("draft_extend", -1, True)])
def test_install_on_sglang_s_own_backend(sglang_backend_class, mode, window, graph):
    layer, step = fp8_layer(sliding_window_size=window), dict(kv_dtype=torch.float8_e4m3fn)
    batch, (q, k, v) = make_step(mode, graph=graph, **step)
    spy = Spy()
    real = sglang_backend(sglang_backend_class, batch, spy, graph)
    integration.install(real, max_bs=MAX_BS)
    o = real.forward_extend(q, k, v, layer, batch)
    assert spy.calls == []  # served
    args, kwargs = call_site(mode, layer, graph=graph, **step)
    assert relative_error(o.view(args[3].shape), oracle(args, kwargs)) < TOLERANCE[torch.float16]
