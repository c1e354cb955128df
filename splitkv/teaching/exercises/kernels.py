"""Checkers for the Triton kernels the learner writes in notebooks 02-04: split-KV attention, piece by piece.

The pieces share one scratch layout. A *tile* is one sequence and one KV head;
its ``BLOCK_M`` rows pack the query heads of the KV head (GQA): row ``r`` is
draft token ``r // G`` of query head ``kv_head * G + r % G``. Partial states
live in float32 scratch

* ``part_o [batch, H_kv, n_parts, BLOCK_M, Dv]``: normalised partial outputs,
* ``part_lse [batch, H_kv, n_parts, BLOCK_M]``: their log-sum-exp, **base 2**,

with ``(0, -inf)`` for a part that saw no key. The exercises:

* :func:`check_merge_kernel` (notebook 02): ``merge_kernel``, one program per
  tile, merges its ``n_parts`` states into ``o`` and a natural-log ``lse``;
* :func:`check_load_q` (notebook 03): ``load_q_tile``, the GQA-packed query load;
* :func:`check_slice_kernel` (notebook 03): ``slice_kernel``, one program per
  (sequence, KV head, slice): the partial state over a slice of the prefix,
  gathered through ``kv_indices``;
* :func:`check_draft_kernel` (notebook 04): ``draft_kernel``, the partial
  state over the draft block, causal or under a tree's ``custom_mask``.

:func:`split_kv` launches the three kernels as one verify attention.

Each checker runs the learner's kernel under Triton (the interpreter on a
CPU) on small random problems, compares with float64, and when the result is
wrong, also with what each usual slip would produce, to name the slip.
"""

from __future__ import annotations

import math
import re
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from . import Unsolved, checks, is_stub
from .. import lessons
from ...testing import make_problem, relative_error
from ...launch import interpreting

__all__ = ["check_merge_kernel", "check_load_q", "check_slice_kernel", "check_draft_kernel",
           "new_scratch", "run_slices", "run_draft", "run_merge", "split_kv", "unpack_tiles", "block_m_for"]

LN2 = math.log(2.0)
LOG2E = 1.0 / LN2


# --- launching ----------------------------------------------------------------------------------

def block_m_for(p) -> int:
    """Rows of a tile: ``G x`` the longest draft block, a power of two, at least 16 (``tl.dot``'s minimum)."""
    return max(16, triton.next_power_of_2(p.num_q_heads // p.num_kv_heads * p.max_len_extend))


def new_scratch(p, n_parts: int, device=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """NaN-filled float32 ``part_o [B, H_kv, n_parts, BLOCK_M, Dv]`` and ``part_lse [B, H_kv, n_parts, BLOCK_M]``."""
    device = device or p.q_extend.device
    part_o = torch.full((p.batch_size, p.num_kv_heads, n_parts, block_m_for(p), p.v_head_dim), float("nan"),
                        device=device)
    return part_o, torch.full(part_o.shape[:-1], float("nan"), device=device)


def run_slices(kernel, p, n_splits: int, part_o, part_lse, block_n: int = 16) -> None:
    """Launch ``kernel`` (a slice kernel) on grid ``(batch, H_kv, n_splits)`` into the scratch."""
    kernel[(p.batch_size, p.num_kv_heads, n_splits)](
        p.q_extend, p.k_buffer, p.v_buffer, p.qo_indptr, p.kv_indptr, p.kv_indices, part_o, part_lse,
        p.sm_scale * LOG2E, part_o.shape[2], *p.q_extend.stride()[:2], *p.k_buffer.stride()[:2],
        *p.v_buffer.stride()[:2], GROUP=p.num_q_heads // p.num_kv_heads, D=p.head_dim, DV=p.v_head_dim,
        BLOCK_M=part_o.shape[3], BLOCK_N=block_n)


def run_draft(kernel, p, part_o, part_lse) -> None:
    """Launch ``kernel`` (a draft kernel) on grid ``(batch, H_kv)``: the draft block into the last part."""
    tree = p.custom_mask is not None
    mask = p.custom_mask if tree else torch.zeros(1, dtype=torch.bool, device=part_o.device)
    mask_indptr = p.mask_indptr if tree else p.qo_indptr
    kernel[(p.batch_size, p.num_kv_heads)](
        p.q_extend, p.k_extend, p.v_extend, p.qo_indptr, p.kv_indptr, mask, mask_indptr, part_o, part_lse,
        p.sm_scale * LOG2E, part_o.shape[2], *p.q_extend.stride()[:2], *p.k_extend.stride()[:2],
        *p.v_extend.stride()[:2], GROUP=p.num_q_heads // p.num_kv_heads, D=p.head_dim, DV=p.v_head_dim,
        BLOCK_M=part_o.shape[3], BLOCK_L=max(16, triton.next_power_of_2(p.max_len_extend)), TREE=tree)


def run_merge(kernel, part_o, part_lse) -> Tuple[torch.Tensor, torch.Tensor]:
    """Launch ``kernel`` (a merge kernel), one program per tile: ``o [tiles, BLOCK_M, Dv]``, ``lse [tiles, BLOCK_M]``."""
    tiles = part_o.shape[0] * part_o.shape[1]
    n_parts, block_m, dv = part_o.shape[2:]
    o = torch.full((tiles, block_m, dv), float("nan"), device=part_o.device)
    lse = torch.full((tiles, block_m), float("nan"), device=part_o.device)
    kernel[(tiles,)](part_o, part_lse, o, lse, n_parts, DV=dv, BLOCK_M=block_m)
    return o, lse


def split_kv(p, n_splits: int, slice_kernel, draft_kernel, merge_kernel, block_n: int = 16):
    """Verify attention from the three kernels: ``(o [tokens, H_q, Dv], lse [tokens, H_q])``, lse in natural log.

    Parts ``0 .. n_splits - 1`` are the prefix slices, part ``n_splits`` the
    draft block; the merge turns them into one state per tile, whose rows are
    then scattered back to (token, query head).
    """
    part_o, part_lse = new_scratch(p, n_splits + 1)
    run_slices(slice_kernel, p, n_splits, part_o, part_lse, block_n)
    run_draft(draft_kernel, p, part_o, part_lse)
    return unpack_tiles(p, *run_merge(merge_kernel, part_o, part_lse))


def unpack_tiles(p, o_t: torch.Tensor, lse_t: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Tile rows back to ``(o [tokens, H_q, Dv], lse [tokens, H_q])``: row ``r`` of tile ``(b, kv_head)`` is
    draft ``r // G`` of query head ``kv_head * G + r % G``."""
    G, h_kv = p.num_q_heads // p.num_kv_heads, p.num_kv_heads
    out = torch.full((p.num_tokens, p.num_q_heads, p.v_head_dim), float("nan"), device=o_t.device)
    lse = torch.full((p.num_tokens, p.num_q_heads), float("nan"), device=o_t.device)
    for b in range(p.batch_size):
        q0, q1 = p.qo_indptr[b].item(), p.qo_indptr[b + 1].item()
        rows = (q1 - q0) * G  # row r of a tile: draft r // G, head kv_head * G + r % G
        for kv_head in range(h_kv):
            t = b * h_kv + kv_head
            out[q0:q1, kv_head * G:(kv_head + 1) * G] = o_t[t, :rows].view(q1 - q0, G, -1)
            lse[q0:q1, kv_head * G:(kv_head + 1) * G] = lse_t[t, :rows].view(q1 - q0, G)
    return out, lse


# --- shared checking helpers --------------------------------------------------------------------

def _require_kernel(fn, what: str) -> None:
    """Raise :class:`Unsolved` for a stub, and a clear error for something that is not a ``@triton.jit`` function."""
    if is_stub(fn):
        raise Unsolved(f"write {what} in your_kernels.py: replace its todo(...) line by your code")
    if not hasattr(fn, "fn"):
        raise AssertionError(f"{what} should be a @triton.jit function, got {type(fn).__name__}")


_DOT_SHAPES = ("the scores are q times k transposed, tl.dot(q, tl.trans(k)): [BLOCK_M, D] x [D, BLOCK_N]; the "
               "output adds tl.dot(p, v): [BLOCK_M, BLOCK_N] x [BLOCK_N, DV]. The checker's shapes make D, BLOCK_N "
               "and BLOCK_M differ, so a missing transpose cannot pass by accident")


def _run(what: str, launch: Callable):
    """Run a launch; a crash is a wrong answer too, reported with its cause (a tl.dot of mismatched shapes by name)."""
    try:
        return launch()
    except Unsolved:
        raise
    except Exception as e:  # noqa: BLE001
        text = f"{e} {e.__cause__ or ''}"
        first = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
        if re.search(r"reduction dimension|compatible for matmul|incompatible dimensions|dot.*shape", text, re.I | re.S):
            raise AssertionError(f"{what}: a tl.dot's operands do not fit ({first}). Hint: {_DOT_SHAPES}") from e
        raise AssertionError(f"{what} raised {type(e).__name__}: {first}") from e


#: How close a learner's float32 state must come to the float64 one. Under the interpreter tl.dot multiplies
#: float32 in float32; on a GPU it multiplies float32 operands in TF32 (a 10-bit mantissa) by default, which
#: moves a state by up to about 1e-3. Every slip the checkers name is off by far more than either.
STATE_TOL = 1e-4 if interpreting() else 5e-3


def _states_close(o, lse, o_ref, lse_ref, tol: float = STATE_TOL) -> bool:
    """Whether a float32 state matches a float64 one: ``-inf`` exactly where expected, else within ``tol``."""
    o, lse = o.double().cpu(), lse.double().cpu()
    empty = torch.isneginf(lse_ref)
    if not torch.equal(torch.isneginf(lse), empty) or torch.isnan(lse).any() or torch.isnan(o).any():
        return False
    seen = ~empty
    if not seen.any():
        return bool((o == 0).all())
    lse_ok = ((lse[seen] - lse_ref[seen]).abs() <= tol * (1 + lse_ref[seen].abs())).all()
    return bool(lse_ok) and relative_error(o[seen], o_ref[seen]) < tol and bool((o[empty] == 0).all())


def _packed_rows(p, b: int, kv_head: int) -> torch.Tensor:
    """float64 queries of tile ``(b, kv_head)``, packed (row ``l * G + g``), scaled by ``sm_scale``."""
    G = p.num_q_heads // p.num_kv_heads
    q0, q1 = p.qo_indptr[b].item(), p.qo_indptr[b + 1].item()
    return p.q_extend[q0:q1, kv_head * G:(kv_head + 1) * G].reshape(-1, p.head_dim).cpu().double() * p.sm_scale


def _state2(q, k, v, visible=None):
    """float64 ``(o, lse)`` with ``lse`` in base 2."""
    o, lse = lessons.attend(q, k.cpu().double(), v.cpu().double(), visible)
    return o, lse / LN2


# --- the merge kernel -----------------------------------------------------------------------------

_M_SHIFT = ("subtract the running maximum: w = tl.exp2(lse - shift) with shift = max of the LSEs so far, and rescale "
            "den and acc by alpha = tl.exp2(m - shift) when it grows (2^lse overflows float32 for lse > 128)")
_M_GUARD = ("a row whose parts so far are all empty has m = -inf, and 2^(-inf - (-inf)) is NaN: shift by 0 "
            "where the running maximum is still -inf")
_M_SELECT = ("an empty part's o is garbage (NaN here) and 0 * NaN = NaN: select, "
             "tl.where(w[:, None] > 0, w[:, None] * o, 0.0), rather than multiply")
_M_BASE = ("the partial LSEs are base 2, the merged LSE is natural log: store (m + tl.log2(den)) * ln 2 "
           "(0.6931471805599453)")
_M_EMPTY = "a row with no key in any part gets o = 0 and lse = -inf: divide by tl.where(den > 0, den, 1.0)"
_M_GENERIC = ("lse = m + log2(sum_s 2^(lse_s - m)), o = sum_s 2^(lse_s - lse) o_s; part s of tile t holds rows "
              "(t * n_parts + s) * BLOCK_M + r")

_MT, _MP, _MM, _MD = 3, 4, 16, 16  # tiles, parts, rows, value columns of the merge checker's scratch


def _merge_case(gen, scale: float, sizes: List[List[int]], hidden_rows: Dict[int, Sequence[int]], nan_empty: bool):
    """Scratch of ``_MT`` tiles x ``_MP`` parts from float64 states; returns (part_o, part_lse, o_ref, lse_ref)."""
    part_o = torch.zeros(_MT, _MP, _MM, _MD, dtype=torch.float64)
    part_lse = torch.zeros(_MT, _MP, _MM, dtype=torch.float64)
    for t in range(_MT):
        q = torch.randn(_MM, 8, generator=gen, dtype=torch.float64) * scale
        for s in range(_MP):
            n = sizes[t][s]
            k = torch.randn(n, 8, generator=gen, dtype=torch.float64)
            v = torch.randn(n, _MD, generator=gen, dtype=torch.float64)
            vis = torch.ones(_MM, n, dtype=torch.bool)
            for r in hidden_rows.get(s, ()):  # rows that see no key of part s
                vis[r] = False
            o, lse = _state2(q, k, v, vis)
            part_o[t, s], part_lse[t, s] = o, lse
    part_o, part_lse = part_o.float(), part_lse.float()
    if nan_empty:
        part_o = torch.where(torch.isneginf(part_lse)[..., None], float("nan"), part_o)
    # The reference merges the stored float32 states in float64 (natural log out).
    o_ref = torch.zeros(_MT, _MM, _MD, dtype=torch.float64)
    lse_ref = torch.zeros(_MT, _MM, dtype=torch.float64)
    for t in range(_MT):
        states = [(part_o[t, s].double(), part_lse[t, s].double() * LN2) for s in range(_MP)]
        o_ref[t], lse_ref[t] = lessons.merge(states)
    return part_o, part_lse, o_ref, lse_ref


def _merge_cases(seed: int):
    """(description, hint, part_o, part_lse, o_ref, lse_ref) for the merge-kernel checker."""
    gen = torch.Generator().manual_seed(seed)
    full = [[5, 9, 3, 12]] * _MT
    return [
        ("four parts with keys", _M_GENERIC, *_merge_case(gen, 0.5, full, {}, False)),
        ("large scores (LSEs near 180 in base 2)", _M_SHIFT, *_merge_case(gen, 25.0, full, {}, False)),
        ("empty parts (o = NaN) after a part with keys", _M_SELECT,
         *_merge_case(gen, 0.5, [[6, 0, 4, 0], [3, 5, 0, 7], [8, 0, 0, 0]], {}, True)),
        ("empty first parts, rows that see no key at all (o = 0 there)", _M_GUARD,
         *_merge_case(gen, 0.5, [[0, 0, 5, 4], [0, 6, 0, 3], [0, 0, 0, 0]], {2: (1, 3), 3: (1, 5)}, False)),
    ]


@checks("kernels", "merge_kernel")
def check_merge_kernel(kernel, seed: int = 0) -> str:
    """Check a learner's ``@triton.jit`` ``merge_kernel(Part_O, Part_LSE, O, LSE, n_parts, DV, BLOCK_M)``.

    Grid ``(tiles,)``; part ``s`` of tile ``t`` is row block ``t * n_parts + s``
    of the scratch, LSEs in base 2; the kernel writes ``O [tiles, BLOCK_M, DV]``
    and natural-log ``LSE [tiles, BLOCK_M]``.
    """
    _require_kernel(kernel, "merge_kernel")
    dev = lessons.DEVICE
    cases = _merge_cases(seed)
    for desc, hint, part_o, part_lse, o_ref, lse_ref in cases:
        o, lse = _run(f"{desc}: merge_kernel", lambda: run_merge(kernel, part_o.to(dev)[None], part_lse.to(dev)[None]))
        o, lse = o.cpu().double(), lse.cpu().double()
        if _states_close(o, lse, o_ref, lse_ref, 2e-5):
            continue
        empty = torch.isneginf(lse_ref)
        if torch.isnan(o).any() or torch.isnan(lse).any():
            bad = torch.isnan(o).any(-1) | torch.isnan(lse)
            raise AssertionError(f"{desc}: NaN in {int(bad.sum())} rows. Hint: {hint}")
        if torch.isinf(o).any() or torch.isposinf(lse).any():
            raise AssertionError(f"{desc}: inf in the output. Hint: {_M_SHIFT}")
        if not torch.equal(torch.isneginf(lse), empty) or (o[empty] != 0).any():
            raise AssertionError(f"{desc}: rows with no key in any part should get o = 0, lse = -inf. Hint: {_M_EMPTY}")
        seen = ~empty
        if ((lse[seen] * LN2 - lse_ref[seen]).abs() < 1e-4 * (1 + lse_ref[seen].abs())).all():
            raise AssertionError(f"{desc}: lse is in base 2. Hint: {_M_BASE}")
        err = relative_error(o[seen], o_ref[seen])
        lse_err = (lse[seen] - lse_ref[seen]).abs().max().item()
        raise AssertionError(f"{desc}: o off by {err:.2g} (relative), lse by up to {lse_err:.2g}. Hint: {hint}")
    return f"passed: merge_kernel matches a float64 merge in {len(cases)} cases, empty parts and overflow included"


# --- the GQA-packed query load ------------------------------------------------------------------

@triton.jit
def _load_q_probe(Q, qo_indptr, Out, stride_qt, stride_qh, LOAD: tl.constexpr,
                  GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr):
    """Grid ``(batch, H_kv)``: store ``LOAD``'s tile of ``(b, kv_head)`` to ``Out [b, kv_head]`` as float32."""
    b, kv_head = tl.program_id(0), tl.program_id(1)
    q_start = tl.load(qo_indptr + b)
    q = LOAD(Q, q_start, tl.load(qo_indptr + b + 1) - q_start, kv_head, stride_qt, stride_qh, GROUP, D, BLOCK_M)
    r, d = tl.arange(0, BLOCK_M), tl.arange(0, D)
    tl.store(Out + ((b * tl.num_programs(1) + kv_head) * BLOCK_M + r)[:, None] * D + d[None, :], q.to(tl.float32))


_Q_MASK = ("rows past the drafts (r // GROUP >= n_draft) must be 0, not the next sequence's queries: "
           "load with mask=(r // GROUP < n_draft)[:, None], other=0.0")
_Q_HEAD = "row r belongs to query head kv_head * GROUP + r % GROUP: the G heads of KV head kv_head are consecutive"
_Q_TOKEN = ("the rows are draft-major: row r is draft token q_start + r // GROUP (heads vary fastest), "
            "so row l * GROUP + g is draft l of head g of the group")
_Q_STRIDE = ("address Q with its strides, token * stride_qt + head * stride_qh + d: "
             "Q need not be contiguous (here each head row is padded)")


def _locate(row: torch.Tensor, q: torch.Tensor) -> Optional[Tuple[int, int]]:
    """(token, head) of ``q [tokens, heads, D]`` whose vector equals ``row``, or ``None``."""
    hit = (q == row).all(dim=-1).nonzero()
    return tuple(hit[0].tolist()) if len(hit) else None


@checks("kernels", "load_q_tile")
def check_load_q(load_fn, seed: int = 0) -> str:
    """Check a learner's ``@triton.jit`` ``load_q_tile(Q, q_start, n_draft, kv_head, stride_qt, stride_qh, GROUP, D,
    BLOCK_M)`` on a ragged batch with a padded (non-contiguous) ``Q``, naming the first misplaced row."""
    _require_kernel(load_fn, "load_q_tile")
    dev = lessons.DEVICE
    gen = torch.Generator().manual_seed(seed)
    for h_q, h_kv, drafts in ((8, 2, [3, 1, 4, 2]), (6, 3, [2, 5])):
        G, D, block_m = h_q // h_kv, 16, max(16, triton.next_power_of_2(h_q // h_kv * max(drafts)))
        tokens = sum(drafts)
        # Padded storage, plus spare tokens after the batch, so that a load without a row mask stays in memory.
        store = torch.randn(tokens + block_m, h_q, D + 8, generator=gen).to(dev)
        q = store[:tokens, :, :D]
        qo = torch.tensor([0] + drafts, device=dev).cumsum(0).to(torch.int32)
        out = torch.full((len(drafts), h_kv, block_m, D), float("nan"), device=dev)
        _run("load_q_tile", lambda: _load_q_probe[(len(drafts), h_kv)](
            q, qo, out, q.stride(0), q.stride(1), LOAD=load_fn, GROUP=G, D=D, BLOCK_M=block_m))
        out, allq = out.cpu(), store[:, :, :D].cpu()
        for b, n in enumerate(drafts):
            q0 = int(qo[b])
            for kv_head in range(h_kv):
                for r in range(block_m):
                    got = out[b, kv_head, r]
                    where = f"H_q = {h_q}, H_kv = {h_kv}, sequence {b} ({n} drafts), KV head {kv_head}, row {r}"
                    if r // G >= n:
                        if (got != 0).any():
                            raise AssertionError(f"{where}: expected zeros (padding), got a loaded row. Hint: {_Q_MASK}")
                        continue
                    token, head = q0 + r // G, kv_head * G + r % G
                    if torch.equal(got, allq[token, head]):
                        continue
                    found = _locate(got, allq)
                    if found is None:
                        hint = _Q_STRIDE
                        what = "a row that is no query of the batch"
                    else:
                        hint = _Q_TOKEN if found[0] != token else _Q_HEAD
                        what = f"draft token {found[0]}, head {found[1]}"
                    raise AssertionError(f"{where}: expected draft token {token}, query head {head}; got {what}. "
                                         f"Hint: {hint}")
    return "passed: load_q_tile packs the query heads of each KV head, draft-major, padding rows 0, in 2 batches"


# --- the slice kernel -----------------------------------------------------------------------------

_S_GUARD = ("an empty slice (or padding row) has l_i = 0: store o = 0 and lse = -inf, dividing by "
            "tl.where(l_i > 0, l_i, 1.0), never by 0")
_S_GATHER = ("key n of sequence b sits in pool row kv_indices[kv_indptr[b] + n]: load the slot numbers first, then "
             "K and V at those rows; the prefix is not contiguous in the pool")
_S_BASE = "store the partial LSE in base 2, m_i + tl.log2(l_i): the scores are base 2 and the merge expects base 2"
_S_TILES = ("split_len is the even share cdiv(n_prefix, n_splits) rounded up to whole BLOCK_N tiles, so that "
            "every slice but the last is whole tiles")
_S_CLAMP = "clamp the slice's end to the prefix length: past it lie other sequences' keys"
_S_INDEX = ("store part `split` of tile (b, kv_head) at rows ((b * H_kv + kv_head) * n_parts + split) * BLOCK_M + r "
            "(H_kv = tl.num_programs(1)); n_parts, the scratch's parts per tile, may exceed the slices")
_S_GENERIC = ("scores: tl.dot(q, tl.trans(k)) * qk_scale; fold every key tile of [lo, hi) with tile_step, "
              "keys past hi hidden (-inf)")


def _slices(P: int, n_splits: int, block_n: int, rounded: bool = True, clamp: bool = True):
    """The key ranges ``[lo, hi)`` of a prefix's slices (as the kernel cuts them; or by a slip)."""
    share = -(-P // n_splits)
    split_len = -(-share // block_n) * block_n if rounded else share
    out = []
    for s in range(n_splits):
        lo = s * split_len
        out.append((lo, min(lo + split_len, P) if clamp else lo + split_len))
    return out


def _slice_state(p, b, kv_head, lo, hi, gather=True):
    """float64 base-2 state of tile ``(b, kv_head)`` over prefix keys ``[lo, hi)``, gathered (or read contiguously)."""
    k0 = p.kv_indptr[b].item()
    total = len(p.kv_indices)
    end = min(k0 + hi, total if gather else len(p.k_buffer))
    idx = torch.arange(k0 + lo, max(k0 + lo, end))
    slots = p.kv_indices.cpu()[idx] if gather else idx
    q = _packed_rows(p, b, kv_head)
    return _state2(q, p.k_buffer.cpu()[slots, kv_head], p.v_buffer.cpu()[slots, kv_head])


@checks("kernels", "slice_kernel")
def check_slice_kernel(kernel, seed: int = 0) -> str:
    """Check a learner's ``@triton.jit`` ``slice_kernel`` (grid ``(batch, H_kv, n_splits)``) slice by slice.

    Ragged prefixes (one empty), slices that are short or empty, float32 data,
    scratch poisoned with NaN and one part more than there are slices.
    """
    _require_kernel(kernel, "slice_kernel")
    dev = lessons.DEVICE
    # D = 64, BLOCK_N = 32, BLOCK_M = 16: all different, so a missing transpose or a swapped dimension fails by name.
    block_n, n_splits, head_dim = 32, 3, 64
    cases = [([40, 0, 23, 16], [2, 1, 3, 2], 4, 2, seed), ([70, 9], [1, 2], 6, 3, seed + 1)]
    for prefixes, drafts, h_q, h_kv, s in cases:
        p = make_problem(prefixes, drafts, h_q, h_kv, head_dim, dtype=torch.float32, device=dev, seed=s)
        # kv_indices runs on past the last prefix with valid slots: a slice that is not clamped reads real keys
        # (and is named below) instead of memory past the tensor.
        gen = torch.Generator().manual_seed(s)
        tail = torch.randint(0, p.k_buffer.shape[0], (n_splits * block_n * 2,), generator=gen).to(p.kv_indices)
        p = p.replace(kv_indices=torch.cat([p.kv_indices, tail]))
        part_o, part_lse = new_scratch(p, n_splits + 1)
        _run("slice_kernel", lambda: run_slices(kernel, p, n_splits, part_o, part_lse, block_n))
        part_o, part_lse = part_o.cpu().double(), part_lse.cpu().double()
        G = h_q // h_kv
        if not torch.isnan(part_lse[:, :, n_splits]).all():
            raise AssertionError(f"prefixes {prefixes}: the kernel wrote part {n_splits}, which no slice owns "
                                 f"({n_splits} slices, {n_splits + 1} parts per tile). Hint: {_S_INDEX}")
        for b, P in enumerate(prefixes):
            rows = G * drafts[b]
            for kv_head in range(h_kv):
                for split, (lo, hi) in enumerate(_slices(P, n_splits, block_n)):
                    o, lse = part_o[b, kv_head, split, :rows], part_lse[b, kv_head, split, :rows]  # padding: any
                    where = (f"prefixes {prefixes}, {n_splits} slices of BLOCK_N = {block_n}: sequence {b} (P = {P}), "
                             f"KV head {kv_head}, slice {split} (keys {lo}..{hi})")
                    if torch.isnan(lse).all() and torch.isnan(o).all():
                        raise AssertionError(f"{where}: nothing was stored. Hint: {_S_INDEX}")
                    o_ref, lse_ref = _slice_state(p, b, kv_head, lo, hi)
                    if _states_close(o, lse, o_ref, lse_ref):
                        continue
                    raise AssertionError(f"{where}: {_slice_diagnosis(p, b, kv_head, split, o, lse, o_ref, lse_ref, n_splits, block_n)}")
    return (f"passed: slice_kernel's partial states match float64 on {len(cases)} ragged batches "
            f"(empty prefix, short and empty slices)")


def _slice_diagnosis(p, b, kv_head, split, o, lse, o_ref, lse_ref, n_splits, block_n) -> str:
    """What a wrong partial state most likely comes from: compare with each slip's result."""
    P = p.prefix_lens[b]
    if torch.isnan(o).any() or torch.isnan(lse).any():
        return f"NaN in the stored state. Hint: {_S_GUARD}"
    empty = torch.isneginf(lse_ref)
    if (~empty).any() and _states_close(o, lse / LN2, o_ref, lse_ref):
        return f"lse is in natural log. Hint: {_S_BASE}"
    lse_problem = _lse_problem(o, lse, o_ref, lse_ref)
    if lse_problem:
        return lse_problem
    slips = [(_S_TILES, dict(rounded=False), True), (_S_CLAMP, dict(clamp=False), True), (_S_GATHER, {}, False)]
    for hint, cut, gather in slips:
        lo, hi = _slices(P, n_splits, block_n, **cut)[split]
        hi = min(hi, len(p.kv_indices) - p.kv_indptr[b].item())
        if hi <= lo and not gather:
            continue
        o_s, l_s = _slice_state(p, b, kv_head, lo, max(lo, hi), gather=gather)
        if _states_close(o, lse, o_s, l_s):
            return f"your state is that of keys {lo}..{hi}{'' if gather else ' read contiguously'}. Hint: {hint}"
    if empty.all():
        return f"the slice is empty, so its state must be (0, -inf). Hint: {_S_GUARD}"
    err = relative_error(o[~empty], o_ref[~empty])
    return f"o off by {err:.2g} (relative). Hint: {_S_GENERIC}"


def _lse_problem(o, lse, o_ref, lse_ref) -> Optional[str]:
    """A message when the output rows are right and only the (base-2) LSE is wrong, naming its base when it can."""
    seen = ~torch.isneginf(lse_ref)
    if not seen.any() or relative_error(o[seen], o_ref[seen]) >= STATE_TOL:
        return None
    got, want = lse[seen], lse_ref[seen]
    if ((got - want * LN2).abs() <= STATE_TOL * (1 + want.abs())).all():
        return ("o is right but lse is in natural log (ln l + m ln 2). Hint: store the partial LSE in base 2, "
                "m_i + tl.log2(l_i): the scores are base 2 and the merge expects base 2")
    if ((got * LN2 - want).abs() <= STATE_TOL * (1 + want.abs())).all():
        return "o is right but lse is scaled by 1/ln 2. Hint: store m_i + tl.log2(l_i), base 2, as it is"
    off = (got - want).abs().max().item()
    return (f"o is right but lse is off by up to {off:.3g} (base 2). Hint: lse = m_i + tl.log2(l_i), the running "
            f"maximum plus the log of the running sum, both of base-2 scores")


# --- the draft block ------------------------------------------------------------------------------

_D_DIAG = ("a draft token sees itself: causal visibility is j <= l (drafts 0..l), not j < l; "
           "in the tree mask, too, the diagonal is set")
_D_ROW = ("row r of the packed tile is draft token l = r // GROUP, not r: compare the draft key j with r // GROUP")
_D_OFFSET = ("a row of custom_mask spans the P prefix columns, then the L draft columns: "
             "draft key j of draft l is at mask_indptr[b] + l * (P + L) + P + j")
_D_STRIDE = "rows of the sequence's custom_mask are P + L long (prefix and draft columns), not L"
_D_TREE = "with TREE set, read the visibility from custom_mask: a tree is not a chain"
_D_SLOT = ("the draft block is the tile's last part: store at part n_parts - 1, rows "
           "((b * H_kv + kv_head) * n_parts + n_parts - 1) * BLOCK_M + r")
_D_GENERIC = ("the keys are rows q_start + j of K_Ext and V_Ext (j < n_draft) at the tile's KV head; scores "
              "tl.dot(q, tl.trans(k)) * qk_scale; hidden keys -inf; one tile_step from the empty state")


def _draft_visibility(p, b: int, slip: Optional[str] = None) -> torch.Tensor:
    """``[rows, L]`` visibility of tile rows over draft keys for sequence ``b``; ``slip`` names a mistake to imitate."""
    G = p.num_q_heads // p.num_kv_heads
    L, P = p.extend_lens[b], p.prefix_lens[b]
    l = torch.arange(L * G) // G
    j = torch.arange(L)
    if slip == "row":
        l = torch.arange(L * G)
    if p.custom_mask is None or slip == "causal":
        vis = j[None, :] < l[:, None] if slip == "diag" else j[None, :] <= l[:, None]
        return vis & (l < L)[:, None]  # rows whose index passes the drafts count as padding
    mask = p.custom_mask.cpu().bool()
    m0 = int(p.mask_indptr[b])
    width, offset = (L, P) if slip == "stride" else (P + L, 0 if slip == "offset" else P)
    at = m0 + l[:, None] * width + offset + j[None, :]
    vis = torch.where(at < len(mask), mask[at.clamp(max=len(mask) - 1)], torch.zeros((), dtype=torch.bool))
    if slip == "diag":
        vis &= j[None, :] != l[:, None]
    return vis & (l < L)[:, None]


def _draft_state(p, b, kv_head, slip=None):
    """float64 base-2 state of tile ``(b, kv_head)`` over its draft block."""
    q0, q1 = p.qo_indptr[b].item(), p.qo_indptr[b + 1].item()
    return _state2(_packed_rows(p, b, kv_head), p.k_extend.cpu()[q0:q1, kv_head], p.v_extend.cpu()[q0:q1, kv_head],
                   _draft_visibility(p, b, slip))


@checks("kernels", "draft_kernel")
def check_draft_kernel(kernel, seed: int = 0) -> str:
    """Check a learner's ``@triton.jit`` ``draft_kernel`` (grid ``(batch, H_kv)``) under a causal chain and a tree."""
    _require_kernel(kernel, "draft_kernel")
    dev = lessons.DEVICE
    n_parts = 3
    slips = {"causal": [("diag", _D_DIAG), ("row", _D_ROW)],
             "tree": [("diag", _D_DIAG), ("row", _D_ROW), ("offset", _D_OFFSET), ("stride", _D_STRIDE),
                      ("causal", _D_TREE)]}
    for mask in ("causal", "tree"):
        # D = 64, BLOCK_M = 32 (4 heads x 5 drafts), BLOCK_L = 16: a missing transpose fails by name.
        p = make_problem([5, 0, 12], [3, 5, 2], 8, 2, 64, dtype=torch.float32, device=dev, mask=mask, seed=seed)
        part_o, part_lse = new_scratch(p, n_parts)
        _run("draft_kernel", lambda: run_draft(kernel, p, part_o, part_lse))
        part_o, part_lse = part_o.cpu().double(), part_lse.cpu().double()
        if not torch.isnan(part_lse[:, :, :n_parts - 1]).all():
            raise AssertionError(f"{mask} mask: the kernel wrote a part other than the last. Hint: {_D_SLOT}")
        G = p.num_q_heads // p.num_kv_heads
        for b, L in enumerate(p.extend_lens):
            rows = G * L
            for kv_head in range(p.num_kv_heads):
                o, lse = part_o[b, kv_head, -1], part_lse[b, kv_head, -1]
                where = f"{mask} mask, sequence {b} ({L} drafts, prefix {p.prefix_lens[b]}), KV head {kv_head}"
                if torch.isnan(lse).all():
                    raise AssertionError(f"{where}: nothing was stored in the last part. Hint: {_D_SLOT}")
                if torch.isnan(o).any() or torch.isnan(lse).any():
                    raise AssertionError(f"{where}: NaN in the stored state (rows past the drafts see no key: "
                                         f"store o = 0, lse = -inf there). Hint: {_D_GENERIC}")
                if not (torch.isneginf(lse[rows:]).all() and (o[rows:] == 0).all()):
                    raise AssertionError(f"{where}: padding rows (r >= {rows} = GROUP x n_draft) should hold "
                                         f"(o, lse) = (0, -inf): they see no key, and the merge must weigh them 0. "
                                         f"Hint: store o = acc / tl.where(l_i > 0, l_i, 1.0) and lse = -inf where "
                                         f"l_i = 0")
                o_ref, lse_ref = _draft_state(p, b, kv_head)
                if _states_close(o[:rows], lse[:rows], o_ref, lse_ref):
                    continue
                lse_problem = _lse_problem(o[:rows], lse[:rows], o_ref, lse_ref)
                if lse_problem:
                    raise AssertionError(f"{where}: {lse_problem}")
                for slip, hint in slips[mask]:
                    o_s, l_s = _draft_state(p, b, kv_head, slip)
                    if _states_close(o[:rows], lse[:rows], o_s, l_s):
                        raise AssertionError(f"{where}: your rows see the wrong draft keys. Hint: {hint}")
                err = relative_error(o[:rows], o_ref)
                raise AssertionError(f"{where}: o off by {err:.2g} (relative). Hint: {_D_GENERIC}")
    return "passed: draft_kernel matches float64 under a causal chain and a tree, ragged drafts and an empty prefix"
