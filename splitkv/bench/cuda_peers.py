"""The kernels serving engines run for the verify step, as benchmark peers (needs a CUDA GPU to time).

Peers (:data:`PEERS`), each a zero-argument callable built by :func:`build_peer`
after a plan made outside the timed region, as an engine plans once per
batch and runs once per layer:

* ``sglang_extend`` -- SGLang's own Triton ``extend_attention_fwd``, read from
  the released wheel (:mod:`splitkv.bench.sglang_extend`). It takes splitkv's
  arguments and token pool as they are: no layout conversion.
* ``flashinfer_fa2`` / ``flashinfer_fa3`` -- FlashInfer's
  ``BatchPrefillWithPagedKVCacheWrapper`` with the ``fa2`` / ``fa3`` backend,
  causal (``causal=True``) or with the draft tree as a custom mask.
* ``flashinfer_xqa`` -- FlashInfer's ``xqa`` decode kernel in its
  speculative-decoding mode (``q_seq_len`` = drafts per sequence, a bit mask
  of the draft block).
* ``flashinfer_mla`` -- FlashInfer's ``BatchMLAPagedAttentionWrapper``
  (DeepSeek-V3's 512 + 64 latent layout), causal.

Layout conversion (:func:`flashinfer_layout`, done before timing). splitkv
reads a prefix from a pool (token slots, or pages through
``kv_last_page_len``) and the draft tokens' K/V from separate tensors.
FlashInfer's kernels read one paged cache holding each sequence's prefix
*and* its drafts, the drafts in the last ``L`` positions (a serving engine
has written them there before the verify step), in its ``NHD`` layout
``[num_pages, page_size, H_KV, D]``, which is :mod:`splitkv.paged`'s layout.
So a token-pool problem is first laid out in pages by splitkv's own
:func:`splitkv.testing.paged_problem` (random pages, NaN in every unused
row), and :func:`append_drafts` then writes the drafts after each prefix:
into the free rows of its last page, then into pages no sequence uses. A
problem already in a paged pool goes through :func:`append_drafts` alone.
An fp8 pool stores the drafts in fp8 too (``k / k_scale``, as an engine's
cache would): the oracle such a peer is checked against reads the same
rounded drafts (:meth:`FlashInferPaged.stored_problem`).

XQA has one scale for K and V: the rows' ``k_scale`` and ``v_scale`` are
passed as ``kv_scale = v_scale`` and ``q_scale = k_scale / v_scale`` (XQA
multiplies the scores by ``q_scale * kv_scale`` and the output by
``kv_scale``); a softmax scale other than ``1/sqrt(D)`` goes into
``q_scale`` as well.

Nothing here imports FlashInfer or SGLang until a peer is built; a peer
whose library is missing reports :func:`unavailable`, one line with the
command that installs it.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import subprocess
import tarfile
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from ..testing import PagedProblem, VerifyProblem, paged_problem
from . import sglang_extend

__all__ = [
    "FLASHINFER_VERSION",
    "TVM_FFI_VERSION",
    "PEERS",
    "PEER_GROUPS",
    "CudaPeer",
    "FlashInferPaged",
    "append_drafts",
    "adopt_jit_builds",
    "build_flashinfer_specs",
    "build_peer",
    "check_driver_link",
    "drafts_as_stored",
    "collecting_flashinfer_specs",
    "flashinfer_layout",
    "install_hint",
    "install_jit_cache",
    "jit_libraries",
    "pack_jit_cache",
    "is_mla",
    "library_version",
    "resolve_peers",
    "skip_reason",
    "unavailable",
    "xqa_spec_mask",
]

#: The FlashInfer release the peers were written against, and the FFI package it needs.
FLASHINFER_VERSION = "0.6.13"
TVM_FFI_VERSION = "0.1.15.post2"
#: FlashInfer's latent and rope widths of the MLA kernel (DeepSeek-V3).
MLA_CKV, MLA_KPE = 512, 64
#: Page sizes XQA is built for.
XQA_PAGE_SIZES = (16, 32, 64, 128)
#: Bytes of FlashInfer's float workspace (its recommended 128 MB, doubled for 64k x 32 rows).
WORKSPACE_BYTES = 256 * 2**20


@dataclass(frozen=True)
class CudaPeer:
    """One peer: its name, its library, what it is, the rows it runs on, whether its math is fp8 on fp8 pools."""

    name: str
    library: str
    help: str
    gqa: bool = True
    mla: bool = False
    #: reads the problem in FlashInfer's paged layout (:func:`flashinfer_layout`), drafts in the cache
    paged: bool = False
    #: multiplies in e4m3 when the pool is fp8 (XQA on SM90; SGLang's extend kernel casts its queries and
    #: probabilities to the pool's dtype): checked against a looser budget there
    fp8_math: bool = False
    #: ``build(p, out, fl) -> callable`` for a peer defined outside this module (tests); ``None``: the built-in one
    build: Optional[Callable] = None


#: Every peer, in table order.
PEERS: Dict[str, CudaPeer] = {p.name: p for p in (
    CudaPeer("sglang_extend", "sglang", "SGLang's Triton extend_attention_fwd (its verify kernel), same token pool; "
             "on an fp8 pool it casts queries and probabilities to e4m3", gqa=True, mla=True, fp8_math=True),
    CudaPeer("flashinfer_fa2", "flashinfer", "FlashInfer BatchPrefillWithPagedKVCacheWrapper, backend fa2, drafts "
             "in the paged cache", paged=True),
    CudaPeer("flashinfer_fa3", "flashinfer", "FlashInfer BatchPrefillWithPagedKVCacheWrapper, backend fa3, drafts "
             "in the paged cache", paged=True),
    CudaPeer("flashinfer_xqa", "flashinfer", "FlashInfer xqa, speculative mode (q_seq_len = drafts, draft bit "
             "mask), drafts in the paged cache", paged=True, fp8_math=True),
    CudaPeer("flashinfer_mla", "flashinfer", "FlashInfer BatchMLAPagedAttentionWrapper (512 + 64 latent; backend "
             "auto: fa3 on SM90), causal, drafts in the paged cache", gqa=False, mla=True, paged=True),
)}
#: Names ``--peers`` accepts besides the peers' own.
PEER_GROUPS = {
    "flashinfer": [n for n, p in PEERS.items() if p.library == "flashinfer"],
    "sglang": [n for n, p in PEERS.items() if p.library == "sglang"],
    "all": list(PEERS),
}


def resolve_peers(spec: str) -> List[str]:
    """``"flashinfer,sglang"`` (groups or peer names, comma-separated) -> peer names in table order.

    Raises:
        ValueError: on a name that is neither a group nor a peer.
    """
    chosen = set()
    for word in (w.strip() for w in spec.split(",")):
        if not word:
            continue
        if word in PEER_GROUPS:
            chosen.update(PEER_GROUPS[word])
        elif word in PEERS:
            chosen.add(word)
        else:
            raise ValueError(f"unknown peer {word!r}: use {', '.join(list(PEER_GROUPS) + list(PEERS))}")
    return [n for n in PEERS if n in chosen]


def install_hint(library: str) -> str:
    """The commands that make ``library``'s peers available (wheels into ``.whl/``, then install or load)."""
    if library == "flashinfer":
        return ("python -m splitkv.bench.peers_sweep --fetch-wheels, then python3 -m pip install --no-deps "
                ".whl/flashinfer_python-*.whl .whl/apache_tvm_ffi-*.whl (FlashInfer "
                f"{FLASHINFER_VERSION}, apache-tvm-ffi {TVM_FFI_VERSION})")
    if library == "sglang":
        return sglang_extend.install_hint() + " (loaded from the wheel, not installed)"
    raise ValueError(f"unknown library {library!r}")


def library_version(library: str) -> Optional[str]:
    """The version of ``library`` the peers would use (``None``: not available)."""
    try:
        if library == "flashinfer":
            import flashinfer

            return getattr(flashinfer, "__version__", "unknown")
        if library == "sglang":
            return sglang_extend.find_sources()[1]["version"]
    except Exception:
        return None
    raise ValueError(f"unknown library {library!r}")


def unavailable(name: str) -> Optional[str]:
    """One line saying why peer ``name`` cannot run here and how to install it (``None``: it can)."""
    lib = PEERS[name].library
    if lib not in ("flashinfer", "sglang"):
        return None
    if lib == "flashinfer":
        try:
            import flashinfer  # noqa: F401
        except Exception as err:
            return (f"{name} skipped: flashinfer is not importable ({type(err).__name__}: {err}); install: "
                    + install_hint(lib))
        return None
    try:
        sglang_extend.find_sources()
    except sglang_extend.SglangNotFound:
        return f"{name} skipped: no sglang wheel in .whl/ and no sglang installed; fetch: " + install_hint(lib)
    return None


# ---- Layout conversion -----------------------------------------------------------------------------

def is_mla(p: VerifyProblem) -> bool:
    """DeepSeek-V3's latent layout: one KV head, keys 576 wide, values their first 512 columns."""
    return p.num_kv_heads == 1 and p.head_dim == MLA_CKV + MLA_KPE and p.v_head_dim == MLA_CKV


def drafts_as_stored(p: VerifyProblem) -> Tuple[torch.Tensor, torch.Tensor]:
    """The drafts' K and V as a paged cache of the pool's dtype holds them: unchanged for a pool of the drafts'
    dtype, else rounded to the pool's dtype after division by ``k_scale`` / ``v_scale``."""
    dtype = p.k_buffer.dtype
    if dtype == p.k_extend.dtype:
        return p.k_extend, p.v_extend
    return ((p.k_extend.float() / p.k_scale).to(dtype), (p.v_extend.float() / p.v_scale).to(dtype))


@dataclass
class FlashInferPaged:
    """A verify problem in FlashInfer's paged layout: each sequence's prefix then its drafts, in pages.

    Attributes:
        problem: the token-pool problem (queries, mask, scales; the oracle's input).
        prefix: splitkv's paged problem of the same pages (the prefix alone, ``kv_last_page_len`` of the prefix).
        k_pages: ``[num_pages, page_size, H_KV, D]`` (NHD), shared with ``prefix``.
        v_pages: ``[num_pages, page_size, H_KV, Dv]``.
        qo_indptr: ``[bs + 1]`` int32 query rows.
        kv_indptr: ``[bs + 1]`` int32 page ranges of ``kv_indices``.
        kv_indices: int32 page ids, prefix pages then draft pages.
        kv_last_page_len: ``[bs]`` int32 rows in each sequence's last page (prefix and drafts).
        seq_lens: ``[bs]`` int32 keys per sequence: prefix + drafts.
        page_size: rows per page.
        k_drafts: the drafts' keys as stored (the pool's dtype).
        v_drafts: the drafts' values as stored.
    """

    problem: VerifyProblem
    prefix: PagedProblem
    k_pages: torch.Tensor
    v_pages: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    seq_lens: torch.Tensor
    page_size: int
    k_drafts: torch.Tensor
    v_drafts: torch.Tensor

    def page_table(self) -> torch.Tensor:
        """``[bs, most pages]`` int32: row ``b`` holds sequence ``b``'s page ids, padded with its last page."""
        indptr = self.kv_indptr.tolist()
        width = max(1, max(b - a for a, b in zip(indptr[:-1], indptr[1:])))
        table = torch.zeros(len(indptr) - 1, width, dtype=torch.int32, device=self.kv_indices.device)
        for b, (a, e) in enumerate(zip(indptr[:-1], indptr[1:])):
            if e > a:
                table[b, : e - a] = self.kv_indices[a:e]
                table[b, e - a:] = self.kv_indices[e - 1]
        return table

    def stored_problem(self) -> VerifyProblem:
        """The problem with the drafts as the cache stores them (dequantised, float32): the oracle's input for a
        peer that reads the drafts from the cache."""
        p = self.problem
        if self.k_drafts.dtype == p.k_extend.dtype:
            return p
        return p.replace(k_extend=self.k_drafts.float() * p.k_scale, v_extend=self.v_drafts.float() * p.v_scale)


def _extra_pages(prefix_lens: List[int], extend_lens: List[int], page_size: int) -> int:
    return sum(-(-(n + m) // page_size) - -(-n // page_size) for n, m in zip(prefix_lens, extend_lens))


def append_drafts(pp: PagedProblem, k_drafts: Optional[torch.Tensor] = None,
                  v_drafts: Optional[torch.Tensor] = None) -> FlashInferPaged:
    """A splitkv paged problem -> FlashInfer's layout: each sequence's drafts written after its prefix.

    Draft ``j`` of sequence ``b`` (prefix ``N_b``) becomes key ``N_b + j``: row
    ``(N_b + j) % page_size`` of the sequence's page ``(N_b + j) // page_size``,
    which is its last prefix page while that has room, then a page no
    sequence uses (the pool grows by a copy only if there are too few). The
    pages are written in place. ``k_drafts`` / ``v_drafts`` default to
    :func:`drafts_as_stored`.
    """
    p, ps = pp.problem, pp.page_size
    if k_drafts is None or v_drafts is None:
        k_drafts, v_drafts = drafts_as_stored(p)
    k_pages, v_pages = pp.k_pages, pp.v_pages
    device = k_pages.device
    indptr, qo = pp.kv_indptr.tolist(), p.qo_indptr.tolist()
    used = torch.zeros(k_pages.shape[0], dtype=torch.bool, device=device)
    used[pp.kv_indices.long()] = True
    free = (~used).nonzero().flatten().tolist()
    need = _extra_pages(p.prefix_lens, p.extend_lens, ps)
    if len(free) < need:  # too few spare pages: grow the pool (a copy)
        grow = need - len(free)
        free += list(range(k_pages.shape[0], k_pages.shape[0] + grow))
        k_pages = torch.cat([k_pages, torch.full((grow, *k_pages.shape[1:]), float("nan"), device=device)
                             .to(k_pages.dtype)])
        v_pages = torch.cat([v_pages, torch.full((grow, *v_pages.shape[1:]), float("nan"), device=device)
                             .to(v_pages.dtype)])
    new_indices, new_indptr, last, lens = [], [0], [], []
    for b, (n_pre, n_ext) in enumerate(zip(p.prefix_lens, p.extend_lens)):
        pages = pp.kv_indices[indptr[b]: indptr[b + 1]].long()
        total = n_pre + n_ext
        n_new = -(-total // ps) - pages.numel()
        if n_new:
            pages = torch.cat([pages, torch.tensor(free[:n_new], dtype=torch.int64, device=device)])
            free = free[n_new:]
        n = torch.arange(n_pre, total, device=device)
        k_pages[pages[n // ps], n % ps] = k_drafts[qo[b]: qo[b + 1]].to(k_pages.dtype)
        v_pages[pages[n // ps], n % ps] = v_drafts[qo[b]: qo[b + 1]].to(v_pages.dtype)
        new_indices.append(pages)
        new_indptr.append(new_indptr[-1] + pages.numel())
        last.append(total - (pages.numel() - 1) * ps if pages.numel() else 0)
        lens.append(total)

    def i32(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    return FlashInferPaged(
        problem=p, prefix=pp, k_pages=k_pages, v_pages=v_pages, qo_indptr=p.qo_indptr.to(torch.int32),
        kv_indptr=i32(new_indptr), kv_indices=torch.cat(new_indices).to(torch.int32), kv_last_page_len=i32(last),
        seq_lens=i32(lens), page_size=ps, k_drafts=k_drafts, v_drafts=v_drafts,
    )


def flashinfer_layout(p: VerifyProblem, page_size: int, *, seed: int = 0) -> FlashInferPaged:
    """A token-pool problem -> FlashInfer's paged layout (prefix pages by :func:`splitkv.testing.paged_problem`,
    with enough spare pages for the drafts, then :func:`append_drafts`)."""
    spare = _extra_pages(p.prefix_lens, p.extend_lens, page_size) + 4
    return append_drafts(paged_problem(p, page_size, seed=seed, spare_pages=spare))


def xqa_spec_mask(p: VerifyProblem) -> torch.Tensor:
    """XQA's draft mask: ``[bs, L, 2 * cdiv(L, 32)]`` uint16, the 32-bit words of row ``i`` holding bit ``j``
    (word ``j // 32``, bit ``j % 32``) where draft ``i`` sees draft ``j`` (needs one ``L`` for every sequence)."""
    bs, n_ext = p.batch_size, p.extend_lens[0]
    if any(m != n_ext for m in p.extend_lens):
        raise ValueError("xqa needs the same number of drafts in every sequence")
    vis = torch.zeros(bs, n_ext, n_ext, dtype=torch.bool)
    if p.custom_mask is None:
        vis[:] = torch.tril(torch.ones(n_ext, n_ext, dtype=torch.bool)) if p.is_causal else True
    else:
        starts = p.mask_indptr.tolist()
        cm = p.custom_mask.cpu()
        for b, n_pre in enumerate(p.prefix_lens):
            rows = cm[starts[b]: starts[b] + n_ext * (n_pre + n_ext)].view(n_ext, n_pre + n_ext)
            vis[b] = rows[:, n_pre:].bool()
    words = -(-n_ext // 32)
    packed = torch.zeros(bs, n_ext, words, dtype=torch.int64)
    for j in range(n_ext):
        packed[:, :, j // 32] |= vis[:, :, j].long() << (j % 32)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return packed.view(torch.uint16).to(p.q_extend.device)


# ---- The peers ---------------------------------------------------------------------------------------

def _fa3_unsupported(p: VerifyProblem) -> Optional[str]:
    try:
        from flashinfer.utils import is_fa3_backend_supported, is_sm90a_supported
    except Exception:
        return None
    if not is_sm90a_supported(p.q_extend.device):
        return "fa3 needs an SM90a GPU"
    if not is_fa3_backend_supported(0, False, p.custom_mask is not None, p.q_extend.dtype, p.k_buffer.dtype):
        what = ("a custom mask" if p.custom_mask is not None
                else f"{p.q_extend.dtype} queries on a {p.k_buffer.dtype} pool")
        return f"FlashInfer's fa3 backend does not support {what} (flashinfer.utils.is_fa3_backend_supported)"
    return None


def skip_reason(name: str, p: VerifyProblem, page_size: int) -> Optional[str]:
    """Why peer ``name`` does not run on ``p`` in pages of ``page_size`` (``None``: it does). Reads no library
    except FlashInfer's own support check for fa3."""
    peer = PEERS[name]
    mla = is_mla(p)
    if mla and not peer.mla:
        return "not an MLA kernel"
    if not mla and not peer.gqa:
        return "MLA only"
    if peer.library == "flashinfer" and not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if name == "flashinfer_fa3":
        return _fa3_unsupported(p)
    if name == "flashinfer_xqa":
        if page_size not in XQA_PAGE_SIZES:
            return f"xqa takes pages of {'/'.join(map(str, XQA_PAGE_SIZES))} tokens"
        if p.head_dim != p.v_head_dim or p.head_dim % 16 or p.head_dim > 256:
            return "xqa takes one head dim, a multiple of 16 up to 256"
        if p.k_buffer.dtype not in (p.q_extend.dtype, torch.float8_e4m3fn):
            return f"xqa reads a pool of the queries' dtype or fp8 e4m3, not {p.k_buffer.dtype}"
        if len(set(p.extend_lens)) != 1:
            return "xqa needs the same number of drafts in every sequence"
        if torch.cuda.get_device_capability(p.q_extend.device)[0] not in (9, 10, 12):
            return "xqa runs on SM90, SM100 and SM120 only"
    if name == "flashinfer_mla" and p.k_buffer.dtype != p.q_extend.dtype:
        return "the MLA rows have bf16 caches only"
    return None


_WORKSPACES: Dict[Tuple[str, str], torch.Tensor] = {}


def _workspace(device, kind: str) -> torch.Tensor:
    """One zeroed buffer per device and use, shared by every wrapper (an engine keeps one per process)."""
    key = (str(device), kind)
    if key not in _WORKSPACES:
        _WORKSPACES[key] = torch.zeros(WORKSPACE_BYTES if kind != "xqa_semaphores" else 2 * 2**20,
                                       dtype=torch.uint8 if kind != "xqa_semaphores" else torch.int32,
                                       device=device)
    return _WORKSPACES[key]


def _fi_prefill(backend: str, fl: FlashInferPaged, out: torch.Tensor) -> Callable:
    import flashinfer

    p = fl.problem
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(_workspace(out.device, "float"), "NHD", backend=backend)
    # The draft tree: splitkv's custom_mask is FlashInfer's flat mask as it is ([L, prefix + L] bool per sequence,
    # row-major, sequence after sequence), since the drafts are the last L keys of each sequence.
    mask = dict(custom_mask=p.custom_mask.bool()) if p.custom_mask is not None else dict(causal=p.is_causal)
    w.plan(fl.qo_indptr, fl.kv_indptr, fl.kv_indices, fl.kv_last_page_len, p.num_q_heads, p.num_kv_heads,
           p.head_dim, fl.page_size, head_dim_vo=p.v_head_dim, sm_scale=p.sm_scale, q_data_type=p.q_extend.dtype,
           kv_data_type=fl.k_pages.dtype, o_data_type=out.dtype, **mask)
    fp8 = fl.k_pages.dtype != p.q_extend.dtype
    scales = dict(k_scale=p.k_scale, v_scale=p.v_scale) if fp8 or p.k_scale != 1 or p.v_scale != 1 else {}
    q, cache = p.q_extend.contiguous(), (fl.k_pages, fl.v_pages)
    return lambda: w.run(q, cache, out=out, **scales)


def _fi_xqa(fl: FlashInferPaged, out: torch.Tensor) -> Callable:
    from flashinfer import xqa

    p = fl.problem
    bs, n_ext = p.batch_size, p.extend_lens[0]
    q = p.q_extend.contiguous().view(bs, 1, n_ext, p.num_q_heads, p.head_dim)
    o = out.view(bs, 1, n_ext, p.num_q_heads, p.v_head_dim)
    table = fl.page_table()
    seq_lens = fl.seq_lens.view(bs, 1).view(torch.uint32)  # lengths < 2^31: the same bits
    mask = xqa_spec_mask(p) if n_ext > 1 else None
    # One KV scale: scores * q_scale * kv_scale / sqrt(D), output * kv_scale.
    q_scale = p.k_scale / p.v_scale * p.sm_scale * math.sqrt(p.head_dim)
    ws = _workspace(out.device, "xqa_scratch")
    sem = _workspace(out.device, "xqa_semaphores").view(torch.uint32)
    return lambda: xqa(q, fl.k_pages, fl.v_pages, table, seq_lens, o, ws, sem, p.num_kv_heads, fl.page_size,
                       q_scale=q_scale, kv_scale=p.v_scale, q_seq_len=n_ext, mask=mask)


def _fi_mla(fl: FlashInferPaged, out: torch.Tensor) -> Callable:
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    p = fl.problem
    w = BatchMLAPagedAttentionWrapper(_workspace(out.device, "float"), backend="auto")
    w.plan(fl.qo_indptr, fl.kv_indptr, fl.kv_indices, fl.seq_lens, p.num_q_heads, MLA_CKV, MLA_KPE, fl.page_size,
           p.is_causal, p.sm_scale, p.q_extend.dtype, fl.k_pages.dtype)
    # The latent cache as the engine keeps it, one [pages, page_size, 576] pool read through two column views.
    ckv, kpe = fl.k_pages[:, :, 0, :MLA_CKV], fl.k_pages[:, :, 0, MLA_CKV:]
    q_nope, q_pe = p.q_extend[..., :MLA_CKV].contiguous(), p.q_extend[..., MLA_CKV:].contiguous()
    return lambda: w.run(q_nope, q_pe, ckv, kpe, out=out)


def build_peer(name: str, p: VerifyProblem, out: torch.Tensor, fl: Optional[FlashInferPaged] = None) -> Callable:
    """Plan peer ``name`` on ``p`` and return a zero-argument callable that writes ``out`` (``[tokens, H_Q, Dv]``).

    ``fl`` is ``p`` in FlashInfer's layout (:func:`flashinfer_layout`); FlashInfer peers need it, SGLang's
    reads ``p``'s token pool. The plan (and any one-time work) happens here, not in the callable.
    """
    peer = PEERS.get(name)
    if peer is not None and peer.build is not None:
        return peer.build(p, out, fl)
    if name == "sglang_extend":
        fn, _ = sglang_extend.load_extend()
        args, kw = p.args(out), p.kwargs()
        return lambda: fn(*args, **kw)
    if fl is None:
        raise ValueError(f"{name} needs the problem in FlashInfer's paged layout")
    if name == "flashinfer_fa2":
        return _fi_prefill("fa2", fl, out)
    if name == "flashinfer_fa3":
        return _fi_prefill("fa3", fl, out)
    if name == "flashinfer_xqa":
        return _fi_xqa(fl, out)
    if name == "flashinfer_mla":
        return _fi_mla(fl, out)
    raise ValueError(f"unknown peer {name!r}")


# ---- FlashInfer's kernel builds ----------------------------------------------------------------------
#
# FlashInfer 0.6.13 ships no compiled attention kernel: every module (one per prefill backend x dtypes x head
# dims; per MLA dtypes; per XQA dtypes x page size x head dim x group x drafts) is built with nvcc on first use,
# one module after another, each taking minutes. Two things shorten that on a machine that starts bare:
#
# * :func:`collecting_flashinfer_specs` lets the peers run up to the first module they lack and records it, so
#   that every missing module can be built in one ninja call (flashinfer.jit.build_jit_specs), every source file
#   of every module in parallel on all cores;
# * :func:`pack_jit_cache` puts the built libraries (``<name>/<name>.so``) in one archive to bring back, and
#   :func:`install_jit_cache` unpacks such an archive into FlashInfer's AOT folder, from which FlashInfer loads a
#   module without running ninja or nvcc at all.


class SpecNeeded(RuntimeError):
    """Raised in place of a FlashInfer module build while :func:`collecting_flashinfer_specs` is active."""


@contextlib.contextmanager
def collecting_flashinfer_specs() -> Iterator[Dict[str, object]]:
    """Within the block, a FlashInfer module that is neither built nor in the AOT folder is not built: its
    ``JitSpec`` is recorded (``{name: spec}``, the yielded dict) and :class:`SpecNeeded` is raised in its place.
    Built modules load as usual."""
    from flashinfer.jit import core

    needed: Dict[str, object] = {}
    original = core.JitSpec.build_and_load

    def build_and_load(spec):
        if spec.is_aot or spec.is_compiled:
            return original(spec)
        needed[spec.name] = spec
        raise SpecNeeded(f"FlashInfer module {spec.name} is not built")

    core.JitSpec.build_and_load = build_and_load
    try:
        yield needed
    finally:
        core.JitSpec.build_and_load = original


def jit_libraries(*folders: str) -> Dict[str, str]:
    """``{module name: path}`` of every built module library ``<folder>/<name>/<name>.so`` under ``folders``
    (FlashInfer's JIT and AOT folders; the first folder holding a name wins)."""
    found: Dict[str, str] = {}
    for folder in folders:
        if not folder or not os.path.isdir(folder):
            continue
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name, name + ".so")
            if name not in found and os.path.isfile(path):
                found[name] = path
    return found


def adopt_jit_builds(jit_dir: str, aot_dir: str, names: Optional[List[str]] = None) -> List[str]:
    """Copy the libraries built in FlashInfer's JIT folder (``names``, default all) into its AOT folder, where
    missing there; returns the names copied.

    FlashInfer reruns ninja in a module's own folder before loading a JIT build, and ninja rebuilds every object
    whose dependency record is not in that folder's log: after one ninja call for many modules (or a reinstall of
    the package), that is all of them. From the AOT folder a module is loaded as it is."""
    copied = []
    for name, lib in jit_libraries(jit_dir).items():
        target = os.path.join(aot_dir, name, name + ".so")
        if (names is None or name in names) and not os.path.isfile(target):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copyfile(lib, target)
            copied.append(name)
    return copied


def _part_path(path: str, i: int) -> str:
    if i == 0:
        return path
    for ext in (".tar.gz", ".tgz"):
        if path.endswith(ext):
            return f"{path[: -len(ext)]}-{i + 1}{ext}"
    return f"{path}-{i + 1}"


def pack_jit_cache(path: str, *folders: str, max_bytes: Optional[int] = None) -> List[Tuple[str, List[str]]]:
    """Write the module libraries under ``folders`` (see :func:`jit_libraries`) to gzipped tars as
    ``<name>/<name>.so``: ``path``, then ``<path>-2.tar.gz`` ... where the libraries together pass ``max_bytes``
    (uncompressed; a larger library gets a part alone). Returns ``[(archive, module names)]`` ([]: none built)."""
    libs = jit_libraries(*folders)
    parts: List[List[str]] = []
    size = 0
    for name, lib in sorted(libs.items(), key=lambda kv: -os.path.getsize(kv[1])):
        n = os.path.getsize(lib)
        if not parts or (max_bytes is not None and size + n > max_bytes and parts[-1]):
            parts.append([])
            size = 0
        parts[-1].append(name)
        size += n
    out = []
    for i, names in enumerate(parts):
        archive = _part_path(path, i)
        os.makedirs(os.path.dirname(archive) or ".", exist_ok=True)
        with tarfile.open(archive, "w:gz") as tar:
            for name in names:
                tar.add(libs[name], arcname=f"{name}/{name}.so")
        out.append((archive, names))
    return out


def check_driver_link(path: str) -> None:
    """Raise where the library ``path`` calls the CUDA driver (undefined ``cu*`` symbols, e.g. XQA's
    ``cuTensorMapEncodeTiled``) but does not name ``libcuda.so.1`` among its needed libraries: built against a
    stand-in, it would load and then fail at its first driver call. Passes where ``nm`` / ``readelf`` are
    missing."""
    try:
        undefined = subprocess.run(["nm", "-D", "--undefined-only", path], capture_output=True, text=True,
                                   check=True).stdout
        dynamic = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return
    driver = sorted({w for line in undefined.splitlines() for w in line.split()[-1:]
                     if w[:2] == "cu" and w[2:3].isupper()})
    if driver and "[libcuda.so" not in dynamic:
        raise OSError(f"calls the CUDA driver ({', '.join(driver[:3])}) without needing libcuda.so.1")


def install_jit_cache(archive: str, aot_dir: Optional[str] = None,
                      verify: Optional[Callable[[str], object]] = None) -> List[str]:
    """Unpack an archive of :func:`pack_jit_cache` into FlashInfer's AOT folder (``aot_dir``, default
    ``flashinfer.jit.env.FLASHINFER_AOT_DIR``: the installed package's ``data/aot``); returns the module names.
    Only ``<name>/<name>.so`` members are taken. ``verify(path)`` (e.g. ``tvm_ffi.load_module``) is tried on each
    library: one that raises is removed again (FlashInfer then builds that module itself) and left out."""
    if aot_dir is None:
        from flashinfer.jit import env

        aot_dir = str(env.FLASHINFER_AOT_DIR)
    names = []
    with tarfile.open(archive, "r:*") as tar:
        for member in tar.getmembers():
            parts = member.name.split("/")
            if (not member.isfile() or len(parts) != 2 or parts[1] != parts[0] + ".so"
                    or parts[0] in ("", ".", "..")):
                continue
            os.makedirs(os.path.join(aot_dir, parts[0]), exist_ok=True)
            target = os.path.join(aot_dir, *parts)
            with tar.extractfile(member) as src, open(target, "wb") as dst:
                dst.write(src.read())
            if verify is not None:
                try:
                    verify(target)
                except Exception as err:
                    os.remove(target)
                    print(f"{parts[0]}: not loadable here, left to FlashInfer to build ({type(err).__name__}: "
                          f"{str(err)[:200]})", flush=True)
                    continue
            names.append(parts[0])
    return names


def build_flashinfer_specs(specs: List[object], log_path: Optional[str] = None, jobs: Optional[int] = None,
                           meanwhile: Optional[Callable[[], None]] = None) -> dict:
    """Build FlashInfer modules (``JitSpec``) in one ninja call: every source file of every module in parallel
    (``-j jobs``, default ninja's: the cores + 2), going on past a failed file (``-k 0``) so that one module that
    fails to compile costs no other. ninja's output goes to ``log_path`` (default: beside the build files).
    ``meanwhile()`` runs while ninja does (the Triton kernels' compiles).

    Returns ``{"built": [names], "failed": [names], "seconds", "returncode", "log"}``.
    """
    from flashinfer.jit import env

    jit_dir = env.FLASHINFER_JIT_DIR
    jit_dir.mkdir(parents=True, exist_ok=True)
    lines = ["ninja_required_version = 1.3"]
    for spec in specs:
        spec.write_ninja()
        lines.append(f"subninja {spec.ninja_path}")
    ninja_file = jit_dir / "splitkv_prebuild.ninja"
    ninja_file.write_text("\n".join(lines) + "\n")
    log_path = log_path or str(jit_dir / "splitkv_prebuild.log")
    cmd = ["ninja", "-k", "0", "-C", str(jit_dir), "-f", str(ninja_file)] + (["-j", str(jobs)] if jobs else [])
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=str(jit_dir))
        try:
            if meanwhile is not None:
                meanwhile()
            rc = proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
    built = [spec.name for spec in specs if os.path.isfile(spec.jit_library_path) or spec.is_aot]
    adopt_jit_builds(str(jit_dir), str(env.FLASHINFER_AOT_DIR), names=built)
    return dict(built=built, failed=[spec.name for spec in specs if spec.name not in built],
                seconds=round(time.perf_counter() - t0, 1), returncode=rc, log=log_path)
