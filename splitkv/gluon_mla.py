"""MLA verify through the Gluon kernel for sm_90 (:mod:`splitkv.kernels.gluon_mla`): launch and compile check.

The kernel is an alternative to the split path's ``tl`` MLA tile, written in
Gluon so that its two warpgroups share one score tile. It is **not chosen by
any plan**: :func:`gluon_mla_verify` runs it when called directly (tests,
benchmarks), and :func:`unavailable_reason` says why it cannot run here.
The ``tl`` kernel stays the portable path.

Versions. Gluon's API changes between Triton releases; the kernel compiles for
sm_90 with Triton 3.6 and 3.9 (checked on a CPU: :func:`compile_sm90`,
``python -m splitkv.gluon_mla [--triton-path DIR]`` for its resources, and
``tests/test_gluon_compile.py`` in CI). :data:`RAN_ON_TRITON` lists the
releases on which it *ran* and matched the oracle on a GPU; only those could
ever be selected (:func:`selection_reason`).

    from splitkv.gluon_mla import gluon_mla_verify
    # q [tokens, heads, 576], k_buf [slots, 1, 576], v_buf = k_buf[..., :512], 4 drafts at most
    gluon_mla_verify(q, k_ext, v_ext, out, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, 4, sm_scale=576 ** -0.5)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .launch import _triton_version
from .resources import shares_rows
from .schedule import (cdiv, device_sm_count, mean_prefix, merge_launch_block, merge_unroll, min_split_for,
                       one_wave_n_splits)

__all__ = ["LATENT_DIM", "ROPE_DIM", "COMPILE_TRITON", "RAN_ON_TRITON", "DEFAULT_TILE", "TILES", "SHARED_LIMIT",
           "unavailable_reason", "selection_reason", "decline_reason", "gluon_mla_verify", "compile_sm90",
           "compile_report"]

#: DeepSeek's latent (value) and rope widths, the only head the kernel takes.
LATENT_DIM, ROPE_DIM = 512, 64
#: Triton releases (major, minor) the kernel compiles on for sm_90 (checked on a CPU).
COMPILE_TRITON = ((3, 6), (3, 9))
#: Triton releases on which the kernel ran on an sm_90 GPU and matched the oracle: none yet.
RAN_ON_TRITON: Tuple[Tuple[int, int], ...] = ()
#: ``(BLOCK_N, STAGES, OVERLAP)``: keys per tile, key tiles in shared memory, and whether a tile's
#: softmax overlaps the previous tile's ``P V``. 32 x 3 uses 189 KB of shared memory.
DEFAULT_TILE = (32, 3, False)
#: Tiles that fit sm_90's 227 KB of shared memory per block (OVERLAP needs 3 stages and two P buffers).
TILES = ((32, 2, False), (32, 3, False), (32, 4, False), (64, 2, False), (32, 3, True), (32, 4, True))
#: Shared memory one block may use on sm_90 (227 KB).
SHARED_LIMIT = 232448
#: Shortest slice worth a program, in keys.
MIN_SPLIT_TOKENS = 128


def _kernel():
    from .kernels.gluon_mla import BLOCK_M, NUM_WARPS, _gluon_mla_kernel

    return _gluon_mla_kernel, int(BLOCK_M.value), NUM_WARPS


def unavailable_reason(device=None) -> Optional[str]:
    """Why the Gluon kernel cannot run on ``device`` (default: the current CUDA device); ``None``: it can."""
    if torch.version.hip is not None:
        return "ROCm: the kernel is written for NVIDIA sm_90 (wgmma)"
    if not torch.cuda.is_available():
        return "no CUDA device"
    device = torch.device("cuda") if device is None else torch.device(device)
    if device.type != "cuda":
        return f"device {device} is not a CUDA device"
    cap = torch.cuda.get_device_capability(device)
    if cap != (9, 0):
        return f"compute capability {cap[0]}.{cap[1]}: the kernel is written for sm_90 (Hopper)"
    import triton

    if _triton_version(triton.__version__) not in COMPILE_TRITON:
        return f"triton {triton.__version__}: the kernel compiles on " + ", ".join(
            f"{a}.{b}" for a, b in COMPILE_TRITON)
    try:
        _kernel()
    except ImportError as err:
        return f"triton.experimental.gluon is unusable here: {err}"
    return None


def selection_reason(device=None) -> Optional[str]:
    """Why a plan may not choose the kernel on ``device`` (``None``: it may): it must run here
    (:func:`unavailable_reason`) with a Triton release it has run on and matched the oracle with
    (:data:`RAN_ON_TRITON`). No plan consults this yet."""
    why = unavailable_reason(device)
    if why:
        return why
    import triton

    if _triton_version(triton.__version__) not in RAN_ON_TRITON:
        return f"triton {triton.__version__}: the kernel has not run on a GPU with this release"
    return None


def decline_reason(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, kv_indices, *, custom_mask=None,
                   kv_last_page_len=None, sinks=None) -> Optional[str]:
    """Why the kernel does not serve these tensors (``None``: it does): MLA heads (576 = 512 + 64, one
    KV head), bf16 queries, drafts and output, a bf16 or fp8 e4m3 latent cache, values views of the
    keys' latent columns, a token pool ``[slots, 1, 576]`` or a paged one ``[pages, page_size, 1, 576]``
    (with ``kv_last_page_len``), no sinks."""
    head = LATENT_DIM + ROPE_DIM
    if q_extend.dim() != 3 or q_extend.shape[2] != head:
        return f"queries must be [tokens, heads, {head}]"
    if k_buffer.shape[-2:] != (1, head) or k_buffer.dim() not in (3, 4):
        return f"the pool must be [slots, 1, {head}] or [pages, page_size, 1, {head}]"
    if (k_buffer.dim() == 4) != (kv_last_page_len is not None):
        return "a paged pool needs kv_last_page_len, a token pool takes none"
    if k_extend.dim() != 3 or k_extend.shape[1:] != (1, head):
        return f"k_extend must be [tokens, 1, {head}]"
    if v_buffer.shape[-1] != LATENT_DIM or not shares_rows(k_buffer, v_buffer):
        return "v_buffer must be k_buffer[..., :512]"
    if v_extend.shape[-1] != LATENT_DIM or not shares_rows(k_extend, v_extend):
        return "v_extend must be k_extend[..., :512]"
    if any(t.dtype != torch.bfloat16 for t in (q_extend, k_extend, o_extend)):
        return "bf16 queries, drafts and output only"
    if k_buffer.dtype not in (torch.bfloat16, torch.float8_e4m3fn):
        return "a bf16 or float8_e4m3fn latent cache only"
    if o_extend.shape != (q_extend.shape[0], q_extend.shape[1], LATENT_DIM):
        return f"the output must be [tokens, heads, {LATENT_DIM}]"
    for name, t in (("q_extend", q_extend), ("k_extend", k_extend), ("k_buffer", k_buffer), ("o_extend", o_extend)):
        # cp.async moves 16 bytes: rows 16-byte aligned, columns contiguous
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any(s % 8 for s in t.stride()[:-1]):
            return f"{name} must have contiguous, 16-byte aligned rows"
    if kv_indices.dtype not in (torch.int32, torch.int64):
        return "kv_indices must be int32 or int64"
    if custom_mask is not None and custom_mask.dtype not in (torch.bool, torch.uint8):
        return "custom_mask must be bool or uint8"
    if sinks is not None:
        return "attention sinks are not served yet"
    return None


def gluon_mla_verify(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
                     max_len_extend: int, *, custom_mask=None, mask_indptr=None, is_causal: bool = True,
                     kv_last_page_len=None, sm_scale: Optional[float] = None, k_scale: float = 1.0,
                     v_scale: float = 1.0, lse: Optional[torch.Tensor] = None, n_splits: Optional[int] = None,
                     tile: Tuple[int, int, bool] = DEFAULT_TILE):
    """MLA verify with the Gluon kernel: ``o_extend`` (and the natural-log ``lse [tokens, heads]``) filled.

    Arguments as in :func:`splitkv.verify_splitkv_fwd` (a tree as ``custom_mask`` / ``mask_indptr``, a
    paged pool with ``kv_last_page_len``, an fp8 cache with ``k_scale`` / ``v_scale``); ``tile`` is
    ``(BLOCK_N, STAGES, OVERLAP)`` (:data:`TILES`); ``n_splits`` slices per sequence (default: one
    wave of one program per SM, from the mean prefix the shapes give). Reads no device value on the
    host, so it can be captured in a CUDA graph. Raises ``RuntimeError`` where it cannot run
    (:func:`unavailable_reason`) and ``ValueError`` for tensors it does not serve (:func:`decline_reason`).
    """
    why = unavailable_reason(q_extend.device)
    if why:
        raise RuntimeError(why)
    why = decline_reason(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, kv_indices,
                         custom_mask=custom_mask, kv_last_page_len=kv_last_page_len)
    if why:
        raise ValueError(why)
    tile = tuple(tile)
    if tile not in TILES:
        raise ValueError(f"tile must be one of {TILES}")
    if tile[2] and k_buffer.dtype != torch.bfloat16:
        raise ValueError("an fp8 latent cache takes the tiles without OVERLAP")
    if (custom_mask is None) != (mask_indptr is None):
        raise ValueError("custom_mask and mask_indptr come together")
    _, block_m, _ = _kernel()
    page_size = k_buffer.shape[1] if k_buffer.dim() == 4 else 1
    batch = qo_indptr.shape[0] - 1
    m_blocks = cdiv(q_extend.shape[1] * max_len_extend, block_m)
    if n_splits is None:
        n_splits = one_wave_n_splits(batch * m_blocks, mean_prefix(kv_indices.shape[0], page_size, batch),
                                     device_sm_count(q_extend.device), min_split_tokens=MIN_SPLIT_TOKENS,
                                     block_n=tile[0])
    sm_scale = q_extend.shape[2] ** -0.5 if sm_scale is None else sm_scale
    last = kv_indptr if kv_last_page_len is None else kv_last_page_len  # read only for a paged pool
    mask = None if custom_mask is None else custom_mask.view(torch.uint8)
    _launch(q_extend, k_extend, o_extend, k_buffer, qo_indptr, kv_indptr, kv_indices, last, mask, mask_indptr,
            lse, tile, n_splits, m_blocks, page_size, is_causal, sm_scale, k_scale, v_scale)
    return o_extend


def _launch(q, k_ext, out, k_buf, qo_indptr, kv_indptr, kv_indices, last, mask, mask_indptr, lse, tile, n_splits,
            m_blocks, page_size, is_causal, sm_scale, k_scale, v_scale) -> None:
    """The Gluon kernel over ``(tiles, n_splits)``, then (several slices) the verify kernel's second
    merge launch, unchanged: same slices, same order."""
    from .kernels.merge import _merge_kernel

    kernel, block_m, num_warps = _kernel()
    block_n, stages, overlap = tile
    tokens, heads, _ = q.shape
    tiles = (qo_indptr.shape[0] - 1) * m_blocks
    min_split = min_split_for(block_n, MIN_SPLIT_TOKENS)
    log2e = 1.4426950408889634
    # Scratch in the verify kernel's layout: bf16 partials [tiles, n_splits, 64, 512] in a region sized
    # for float32, then the partial LSEs [tiles, n_splits, 64] (float32).
    rows = tiles * n_splits * block_m
    parts = torch.empty(rows * LATENT_DIM + rows if n_splits > 1 else 1, dtype=torch.float32, device=q.device)
    lse_out = out if lse is None else lse
    paged = k_buf.dim() == 4
    kernel[(tiles, n_splits)](
        q, k_ext, k_buf, out, lse_out, qo_indptr, kv_indptr, kv_indices, last,
        kv_indptr if mask is None else mask, kv_indptr if mask_indptr is None else mask_indptr,
        parts, rows * LATENT_DIM, sm_scale * k_scale * log2e, sm_scale * log2e, v_scale,
        tokens, k_buf.shape[0], kv_indices.shape[0], 0 if mask is None else mask.numel(), n_splits, min_split,
        q.stride(0), q.stride(1), k_ext.stride(0), k_buf.stride(0), k_buf.stride(1) if paged else 0,
        out.stride(0), out.stride(1),
        NUM_Q_HEADS=heads, M_BLOCKS=m_blocks, DV=LATENT_DIM, ROPE_DIM=ROPE_DIM, BLOCK_N=block_n, STAGES=stages,
        OVERLAP=overlap, PAGE_SIZE=page_size, USE_MASK=mask is not None, IS_CAUSAL=is_causal,
        WRITE_LSE=lse is not None, num_warps=num_warps)
    if n_splits > 1:
        m_rows, m_cols = merge_launch_block(LATENT_DIM)
        _merge_kernel[(tiles, cdiv(block_m, m_rows), cdiv(LATENT_DIM, m_cols))](
            out, lse_out, qo_indptr, kv_indptr, last, out, parts, rows * LATENT_DIM,
            tokens, kv_indices.shape[0], n_splits, min_split, 0, out.stride(0), out.stride(1),
            NUM_Q_HEADS=heads, HEADS_PER_TILE=heads, M_BLOCKS=m_blocks, V_HEAD_DIM=LATENT_DIM, BLOCK_M=block_m,
            BLOCK_N=block_n, MERGE_ROWS=m_rows, MERGE_DV=m_cols, PAGE_SIZE=page_size, SPLIT_TOKENS=0,
            HAS_WINDOW=False, HAS_SINKS=False, WRITE_LSE=lse is not None, MERGE_UNROLL=merge_unroll(None, n_splits),
            USE_PDL=False, num_warps=2)


# ---------------------------------------------------------------------------- compiling without a GPU


def _ptxas_usage(ptx: str) -> Dict:
    """Resources of ``ptx`` for sm_90a, from ``ptxas -v`` as Triton runs it (its own ``ptxas`` for
    sm_90): ``n_regs``, ``spill_bytes`` (spill stores), and ``key_loop_spills``, the local-memory
    instructions inside the key loop (:func:`_key_loop_spills`). Empty where that ``ptxas`` cannot
    run; no ``key_loop_spills`` without ``cuobjdump``."""
    import tempfile

    try:
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(90).path
    except Exception:  # noqa: BLE001 -- another Triton layout: no figures, not an error
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = os.path.join(tmp, "kernel.ptx"), os.path.join(tmp, "kernel.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        proc = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", cubin], capture_output=True, text=True,
                              timeout=300)
        regs, spills = re.search(r"Used (\d+) registers", proc.stderr), re.search(r"(\d+) bytes spill stores",
                                                                                 proc.stderr)
        if not (regs and spills):
            return {}
        usage = dict(n_regs=int(regs.group(1)), spill_bytes=int(spills.group(1)))
        cuobjdump = os.path.join(os.path.dirname(ptxas), "cuobjdump")
        if os.path.exists(cuobjdump):
            sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, timeout=300).stdout
            usage["key_loop_spills"] = _key_loop_spills(sass)
    return usage


def _key_loop_spills(sass: str) -> Optional[int]:
    """Local-memory instructions (``LDL`` / ``STL``: spills) in the kernel's first loop that holds
    ``HGMMA`` (in code order, the prefix's key loop; the draft block's loop comes after it)."""
    rows = []
    for line in sass.splitlines():
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*)", line)
        if m:
            rows.append((int(m.group(1), 16), m.group(2)))
    loops = sorted((int(t.group(1), 16), a) for a, text in rows
                   for t in [re.search(r"BRA (0x[0-9a-f]+)", text)] if t and int(t.group(1), 16) < a)
    for lo, hi in loops:
        body = [text for a, text in rows if lo <= a <= hi]
        if any("HGMMA" in text for text in body):
            return sum(bool(re.search(r"\b(LDL|STL)\b", text)) for text in body)
    return None


def compile_sm90(num_q_heads: int = 128, max_len_extend: int = 4, tile: Tuple[int, int, bool] = DEFAULT_TILE,
                 page_size: int = 1, tree: bool = False, fp8: bool = False) -> Dict:
    """Compile the kernel for sm_90 with the Triton imported here (no GPU needed) and read its resources.

    Run it in a process where ``TRITON_INTERPRET=0`` (``import splitkv`` without a GPU sets it to 1,
    which turns the shared ``triton.jit`` helpers into interpreted functions). Returns the Triton
    version, ``shared`` bytes, ``n_regs`` and ``spill_bytes`` (from ``ptxas -v``; ``None`` where it
    cannot run), and the ``wgmma`` instructions of the PTX by shape.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    kernel, block_m, num_warps = _kernel()
    block_n, stages, overlap = tile
    pointers = {"Q": "*bf16", "K_Ext": "*bf16", "K_Buf": "*fp8e4nv" if fp8 else "*bf16", "O": "*bf16",
                "LSE_Out": "*fp32", "qo_indptr": "*i32", "kv_indptr": "*i32", "kv_indices": "*i32",
                "Last_Page_Len": "*i32", "Mask": "*u8", "mask_indptr": "*i32", "Part_O": "*fp32"}
    consts = dict(NUM_Q_HEADS=num_q_heads, M_BLOCKS=cdiv(num_q_heads * max_len_extend, block_m), DV=LATENT_DIM,
                  ROPE_DIM=ROPE_DIM, BLOCK_N=block_n, STAGES=stages, OVERLAP=bool(overlap), PAGE_SIZE=page_size,
                  USE_MASK=tree, IS_CAUSAL=True, WRITE_LSE=False)
    floats = ("qk_scale_prefix", "qk_scale_draft", "v_scale")
    signature = {n: pointers.get(n) or ("constexpr" if n in consts else "fp32" if n in floats else "i32")
                 for n in kernel.arg_names}
    # What the JIT would specialise for real tensors: 16-byte aligned pointers and row strides
    # (decline_reason demands them), so that each cp.async moves 16 bytes.
    aligned = [n for n in kernel.arg_names if n in pointers or n in (
        "stride_qt", "stride_qh", "stride_ket", "stride_kbt", "stride_kbr", "stride_ot", "stride_oh")]
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    compiled = triton.compile(GluonASTSource(fn=kernel, signature=signature, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))
    ptx = compiled.asm["ptx"]
    wgmma: Dict[str, int] = {}
    for shape in re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx):
        wgmma[shape] = wgmma.get(shape, 0) + 1
    report = dict(triton=triton.__version__, tile=list(tile), num_q_heads=num_q_heads, page_size=page_size,
                  tree=tree, fp8=fp8, num_warps=num_warps,
                  shared=compiled.metadata.shared, fits=compiled.metadata.shared <= SHARED_LIMIT,
                  n_regs=None, spill_bytes=None, wgmma=wgmma)
    report.update(_ptxas_usage(ptx))
    return report


def compile_report(python_path: Optional[str] = None, configs: Sequence[Dict] = ({},)) -> List[Dict]:
    """:func:`compile_sm90` of each keyword set in ``configs``, in a fresh interpreter
    (``TRITON_INTERPRET=0``) with ``python_path`` (a directory holding another Triton, e.g. 3.6) ahead
    on ``PYTHONPATH``. Raises ``RuntimeError`` with the child's error output if it fails."""
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="0")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (python_path, root, env.get("PYTHONPATH")) if p)
    code = ("import json, sys; from splitkv.gluon_mla import compile_sm90; "
            "print(json.dumps([compile_sm90(**c) for c in json.loads(sys.argv[1])]))")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(list(configs))], capture_output=True, text=True,
                          env=env, cwd=root, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-4000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    """``python -m splitkv.gluon_mla [--triton-path DIR]``: the compile report of every tile in :data:`TILES`."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m splitkv.gluon_mla", description=main.__doc__)
    ap.add_argument("--triton-path", default=None, help="a directory holding the Triton to compile with")
    ap.add_argument("--heads", type=int, default=128)
    args = ap.parse_args(argv)
    for report in compile_report(args.triton_path, [dict(num_q_heads=args.heads, tile=t) for t in TILES]):
        print(json.dumps(report))


if __name__ == "__main__":
    main()
