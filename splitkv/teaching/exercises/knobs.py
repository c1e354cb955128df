"""Exercises of notebook 06b: what a tile of the verify kernel costs on chip.

* :func:`check_tile_shared_bytes` -- ``tile_shared_bytes(tile, head_dim, kv_bytes)``:
  the shared memory of one program, in the simple case of the model in
  :mod:`splitkv.resources` (below), judged against
  :func:`splitkv.resources.shared_memory_bytes`;
* :func:`check_programs_per_sm` -- ``programs_per_sm(n_regs, num_warps, shared)``:
  how many programs one H200 SM holds at once, judged against every compiled
  tile the H200 sweep recorded (``splitkv/tables/nvidia_h200.json``).

The simple case (:func:`simple_case`): a token pool, ``head_dim == v_head_dim``
a power of two, 2-byte queries (bf16/fp16), ``block_m`` 16 or 32 (the
``mma.sync`` dot, which keeps its probability tile ``P`` in shared memory),
at most 16 draft tokens, and ``block_n >= 32 * num_warps`` (the loop's slot
load is then not pipelined itself). There the model of
:func:`splitkv.resources.shared_memory_bytes` reduces to::

    q     = block_m x head_dim x 2                    (x 2 again for an fp8 pool: its converted copy)
    K, V  = max(1, num_stages - 1) x block_n x 2 head_dim x kv_bytes
    P     = block_m x block_n x 2
    total = q + K, V + P + SLACK                       (SLACK = 1024: alignment, barriers)

and the draft loop's smaller buffers never set the maximum.
"""

from __future__ import annotations

import math
import random
from typing import Callable, List, Tuple

import torch

from splitkv.resources import SLACK, shared_memory_bytes
from splitkv.schedule import TileConfig

from . import checks

__all__ = ["SM_SHARED_MEMORY", "SM_REGISTERS", "SM_THREADS", "MAX_PROGRAMS", "simple_case",
           "check_tile_shared_bytes", "check_programs_per_sm", "recorded_sweep"]

#: Shared memory of one H200 SM (228 KB); one program (block) may take at most 227 KB of it.
SM_SHARED_MEMORY = 233472
#: 32-bit registers of one H200 SM.
SM_REGISTERS = 65536
#: Threads one H200 SM holds at once.
SM_THREADS = 2048
#: Programs (blocks) one SM holds at most.
MAX_PROGRAMS = 32


def _kv_dtype(kv_bytes: int) -> torch.dtype:
    return torch.float8_e4m3fn if kv_bytes == 1 else torch.bfloat16


def simple_case(tile: TileConfig, head_dim: int) -> bool:
    """Whether ``tile`` at ``head_dim`` (token pool, bf16 queries) lies in the exercise's simple case."""
    return (tile.block_m in (16, 32) and tile.block_n >= 32 * tile.num_warps and head_dim >= 16
            and head_dim & (head_dim - 1) == 0)


def _variants(tile: TileConfig, d: int, kb: int) -> List[Tuple[int, str]]:
    """What the usual slips give, each with the hint that names it."""
    bm, bn, s = tile.block_m, tile.block_n, tile.num_stages
    q = bm * d * 2 * (2 if kb == 1 else 1)
    p, right_buf = bm * bn * 2, max(1, s - 1)

    def total(q=q, buffers=right_buf, row=2 * d, kb=kb, p=p, slack=SLACK):
        return q + buffers * bn * row * kb + p + slack

    return [
        (total(row=d), "count a V row as well as a K row for every key: 2 x head_dim per key"),
        (total(buffers=s), "num_stages stages keep num_stages - 1 K/V buffers (one at least), not num_stages"),
        (total(buffers=s - 1), "at num_stages 1 nothing is pipelined, but the tile still needs one buffer"),
        (total(buffers=1), "each pipeline stage past the first adds a K/V buffer: max(1, num_stages - 1)"),
        (total(kb=2), "an fp8 pool holds 1-byte elements: its K/V buffers are kv_bytes = 1 per element"),
        (total(q=bm * d * 2), "an fp8 pool's tile also holds the query converted for the dot: the q tile twice"),
        (total(q=bm * d * 2 * 2), "only an fp8 pool needs the converted query copy"),
        (total(p=0), "add the P tile (block_m x block_n, 2 bytes) that the P.V dot reads"),
        (total(slack=0), "add SLACK (1024 bytes: alignment and the compiler's small buffers)"),
        (total(q=bm * d * 4 * (2 if kb == 1 else 1), p=bm * bn * 4), "the queries and P are bf16: 2 bytes each"),
    ]


def _tile_cases(rng: random.Random) -> List[Tuple[TileConfig, int, int]]:
    """The tuned table's tiles in the simple case, a fixed spread over stages and pools, and random tiles."""
    from splitkv import tuning

    cases = []
    for (d, bm, kb), t in tuning.TUNED["tiles"].items():
        tile = TileConfig(bm, t["block_n"], t["num_warps"], t["num_stages"], t["k_rows"])
        if simple_case(tile, d):
            cases.append((tile, d, kb))
    for stages in (1, 2, 3, 4):
        for kb in (1, 2):
            cases.append((TileConfig(16, 128, 4, stages), 128, kb))
    while len(cases) < 80:
        warps = rng.choice([1, 2, 4, 8])
        tile = TileConfig(rng.choice([16, 32]), rng.choice([b for b in (32, 64, 128, 256) if b >= 32 * warps]),
                          warps, rng.randint(1, 5))
        cases.append((tile, rng.choice([32, 64, 128, 256]), rng.choice([1, 2])))
    return cases


def _what(tile: TileConfig, d: int, kb: int) -> str:
    return (f"block_m {tile.block_m}, block_n {tile.block_n}, {tile.num_warps} warps, {tile.num_stages} "
            f"stage{'s' if tile.num_stages > 1 else ''}, head dim {d}, {'fp8' if kb == 1 else 'bf16'} pool")


def _tile_hint(cases, answers, failed: int) -> str:
    """The slip that explains the learner's answers on every case, else one that explains the failing one."""
    table = [_variants(*case) for case in cases]
    for k, (_, hint) in enumerate(table[failed]):
        if all(got == row[k][0] for got, row in zip(answers, table)):
            return f" ({hint})"
    tile, d, kb = cases[failed]
    want, got = shared_memory_bytes(tile, d, d, _kv_dtype(kb), torch.bfloat16), answers[failed]
    for value, hint in table[failed]:
        if value != want and value == got:
            return f" ({hint})"
    if math.isclose(got * 1024, want, rel_tol=1e-9):
        return " (return bytes, not KB)"
    return ""


@checks("knobs", "tile_shared_bytes")
def check_tile_shared_bytes(fn: Callable[[TileConfig, int, int], int]) -> str:
    """Check ``fn(tile, head_dim, kv_bytes)`` against splitkv.resources.shared_memory_bytes on simple-case tiles."""
    rng = random.Random()
    cases = _tile_cases(rng)
    answers = []
    for tile, d, kb in cases:
        got = fn(tile, d, kb)
        if not isinstance(got, (int, float)) or not math.isfinite(got):
            raise AssertionError(f"{_what(tile, d, kb)}: got {got!r}, expected a number of bytes")
        answers.append(got)
    for i, ((tile, d, kb), got) in enumerate(zip(cases, answers)):
        want = shared_memory_bytes(tile, d, d, _kv_dtype(kb), torch.bfloat16)
        if got != want:
            raise AssertionError(f"{_what(tile, d, kb)}: got {got} bytes, shared_memory_bytes says {want}"
                                 + _tile_hint(cases, answers, i))
    return f"passed: tile_shared_bytes matches splitkv.resources.shared_memory_bytes on {len(cases)} tiles"


def _expected_programs_per_sm(n_regs: int, num_warps: int, shared: int) -> int:
    """Programs one H200 SM holds at once: the fewest its registers, shared memory and threads allow (1 at least)."""
    threads = 32 * num_warps
    by_registers = SM_REGISTERS // (max(1, n_regs) * threads)
    by_shared = SM_SHARED_MEMORY // max(1, shared)
    by_threads = SM_THREADS // threads
    return max(1, min(by_registers, by_shared, by_threads, MAX_PROGRAMS))


def recorded_sweep() -> List[dict]:
    """Every compiled tile of the H200 sweep (token and paged pools): registers, spills, shared memory, programs/SM."""
    from splitkv import tuning

    return list(tuning.TUNED.get("tile_sweep") or []) + list(tuning.TUNED.get("paged_tile_sweep") or [])


@checks("knobs", "programs_per_sm")
def check_programs_per_sm(fn: Callable[[int, int, int], int]) -> str:
    """Check ``fn(n_regs, num_warps, shared)`` on every recorded compiled tile and on random ones."""
    rng = random.Random()
    rows = recorded_sweep()
    cases = [(r["n_regs"], r["num_warps"], r["shared"], r["programs_per_sm"], "recorded") for r in rows]
    for _ in range(60):
        args = (rng.randint(24, 255), rng.choice([1, 2, 4, 8, 16]), rng.randint(4096, 232448))
        cases.append(args + (_expected_programs_per_sm(*args), "random"))
    cases.append((16, 4, 1024, 16, "random"))  # small on every count: the threads decide
    for regs, warps, shared, want, kind in cases:
        got = fn(regs, warps, shared)
        if got != want:
            threads = 32 * warps
            hint = ""
            if got == max(1, min(SM_REGISTERS // (regs * warps), SM_SHARED_MEMORY // shared, SM_THREADS // threads)):
                hint = " (registers are per thread: a program holds n_regs x 32 x num_warps)"
            elif got == max(1, min(SM_REGISTERS // (regs * threads), 232448 // shared, SM_THREADS // threads)):
                hint = " (227 KB is one program's limit; the SM has 228 KB to share: SM_SHARED_MEMORY)"
            elif got == max(1, min(SM_REGISTERS // (regs * threads), SM_SHARED_MEMORY // shared)):
                hint = " (an SM also holds at most 2048 threads: SM_THREADS)"
            raise AssertionError(f"{kind} tile with {regs} registers a thread, {warps} warps, {shared} bytes of "
                                 f"shared memory: got {got} programs per SM, expected {want}{hint}")
    return (f"passed: programs_per_sm matches the {len(rows)} compiled tiles of the H200 sweep "
            f"and {len(cases) - len(rows)} random ones")
