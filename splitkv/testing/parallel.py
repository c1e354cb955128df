"""Context parallelism for tests, notebooks and benchmarks: shard problems, run worlds locally.

* :func:`shard_problem` -- one rank's view of a :class:`~splitkv.testing.VerifyProblem`;
* :func:`shard_paged_problem` -- the same for a :class:`~splitkv.testing.PagedProblem` (whole pages);
* :func:`simulate_context_parallel` -- every rank's step in one process, merged;
* :func:`launch_local` -- ``fn(rank, world_size, ...)`` in fresh processes joined
  by a gloo group on ``127.0.0.1``; :func:`run_cases` is such an ``fn``.

The production entry points are in :mod:`splitkv.parallel`.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Callable, List, Optional, Sequence

import torch

from ..merge import merge_states
from ..paged import paged_prefix_lens
from ..parallel import ContextParallelVerify, cp_verify_attention, shard_last_page_len, shard_mask, shard_prefix
from ..parallel.group import dist
from ..plan import VerifySplitKV
from .problem import PagedProblem, make_problem, paged_problem

__all__ = ["shard_problem", "shard_paged_problem", "simulate_context_parallel", "launch_local", "run_cases"]


def _dtype_of(t: Optional[torch.Tensor]):
    return None if t is None else t.dtype


def shard_problem(problem, world_size: int, rank: int, mode: str = "chunk", block: Optional[int] = None,
                  *, local_pool: bool = True, seed: int = 0):
    """Rank ``rank``'s view of a :class:`~splitkv.testing.VerifyProblem` (tests, notebooks, benchmarks).

    The draft tensors (``q/k/v_extend``, ``qo_indptr``), scales and sinks are
    shared; the prefix is the rank's shard (:func:`shard_prefix`) and a
    ``custom_mask`` is re-laid for it (:func:`shard_mask`). With ``local_pool``
    the rank gets its own pool holding only its keys (at random slots drawn from
    ``seed + rank``, so gathers stay scattered), as a real rank would; otherwise
    the local ``kv_indices`` point into the shared global pool.

    Which rank attends the draft block and applies the sinks is
    :class:`ContextParallelVerify`'s business (``draft_rank``): the returned
    problem keeps both, and its own oracle (``reference_for``) is attention over
    the local keys *and* the drafts.

    Returns:
        A new ``VerifyProblem`` whose ``prefix_lens`` are the local lengths.
    """
    p = problem
    shard = shard_prefix(p.kv_indptr, p.kv_indices, world_size, rank, mode, block)
    kv_indices = shard.kv_indices
    k_buffer, v_buffer = p.k_buffer, p.v_buffer
    n_local = int(shard.kv_indptr[-1])
    if local_pool:
        slots = shard.kv_indices[:n_local].long()
        pool = max(n_local, 1)
        gen = torch.Generator(device="cpu")
        gen.manual_seed(seed + rank)
        order = torch.randperm(pool, generator=gen)[:n_local].to(p.k_buffer.device)
        k_buffer = torch.zeros((pool,) + tuple(p.k_buffer.shape[1:]), dtype=p.k_buffer.dtype, device=p.k_buffer.device)
        v_buffer = torch.zeros((pool,) + tuple(p.v_buffer.shape[1:]), dtype=p.v_buffer.dtype, device=p.v_buffer.device)
        k_buffer[order] = p.k_buffer[slots]
        v_buffer[order] = p.v_buffer[slots]
        kv_indices = order.to(p.kv_indices.dtype) if n_local else torch.zeros(1, dtype=p.kv_indices.dtype,
                                                                              device=p.kv_indices.device)
    custom_mask, mask_indptr = p.custom_mask, p.mask_indptr
    if custom_mask is not None:
        custom_mask, mask_indptr = shard_mask(custom_mask, mask_indptr, p.qo_indptr, p.kv_indptr, shard)
        mask_indptr = mask_indptr.to(_dtype_of(p.mask_indptr))
    return p.replace(k_buffer=k_buffer, v_buffer=v_buffer, kv_indptr=shard.kv_indptr.to(p.kv_indptr.dtype),
                     kv_indices=kv_indices, custom_mask=custom_mask, mask_indptr=mask_indptr,
                     prefix_lens=[int(x) for x in shard.prefix_lens.tolist()])


def shard_paged_problem(paged: PagedProblem, world_size: int, rank: int, mode: str = "chunk",
                        block: Optional[int] = None) -> PagedProblem:
    """Rank ``rank``'s view of a :class:`~splitkv.testing.PagedProblem`: whole pages.

    :func:`shard_prefix` deals the page ids out (``block`` counts pages),
    :func:`shard_last_page_len` gives the local last-page lengths and
    :func:`shard_mask` re-lays a tree mask in keys. The page pool is the
    global one (a rank's pages are a subset of it). The returned problem's
    inner ``problem`` carries the local mask and the local prefix lengths in
    keys; its token-pool fields are the global ones and unused.
    """
    p = paged.problem
    shard = shard_prefix(paged.kv_indptr, paged.kv_indices, world_size, rank, mode, block)
    last = shard_last_page_len(shard, paged.kv_indptr, paged.kv_last_page_len, paged.page_size)
    keys = paged_prefix_lens(shard.kv_indptr, last, paged.page_size).tolist()
    custom_mask, mask_indptr = p.custom_mask, p.mask_indptr
    if custom_mask is not None:
        custom_mask, mask_indptr = shard_mask(custom_mask, mask_indptr, p.qo_indptr, paged.kv_indptr, shard,
                                              page_size=paged.page_size, kv_last_page_len=paged.kv_last_page_len)
        mask_indptr = mask_indptr.to(_dtype_of(p.mask_indptr))
    return PagedProblem(
        problem=p.replace(custom_mask=custom_mask, mask_indptr=mask_indptr, prefix_lens=keys),
        k_pages=paged.k_pages, v_pages=paged.v_pages,
        kv_indptr=shard.kv_indptr.to(paged.kv_indptr.dtype), kv_indices=shard.kv_indices,
        kv_last_page_len=last, page_size=paged.page_size,
    )


# ---- A world in one process (tests, notebooks) ---------------------------------------------------


def simulate_context_parallel(problem, world_size: int, mode: str = "chunk", block: Optional[int] = None, *,
                              draft_rank: int = 0, n_splits: Optional[int] = None, return_partials: bool = False,
                              page_size: int = 1, logit_cap: float = 0.0):
    """Every rank's step run in this process, one after another, then merged.

    The same computation as a real world (:func:`shard_problem` per rank, the
    split-KV kernel with ``attend_draft`` and sinks on ``draft_rank`` only,
    :func:`splitkv.merge_states` over the ranks' states), without
    ``torch.distributed``: what the cross-GPU merge does, on one device.

    Args:
        problem: a :class:`~splitkv.testing.VerifyProblem`.
        world_size, mode, block: the sharding (:func:`shard_prefix`).
        draft_rank: the rank attending the draft block.
        n_splits: force the kernel's prefix slices (default: the chooser's).
        return_partials: also return the per-rank states.
        page_size: ``> 1`` lays the prefixes out in pages of this size
            (:func:`~splitkv.testing.paged_problem`) and shards whole pages
            (:func:`shard_paged_problem`; ``block`` then counts pages).
        logit_cap: the score feature, on every rank.

    Returns:
        ``(out, lse)`` merged; with ``return_partials`` also ``(o_parts
        [tokens, W, H, Dv], lse_parts [tokens, W, H])``.
    """
    p = problem
    paged = paged_problem(p, page_size, seed=1) if page_size > 1 else None
    o_parts, s_parts = [], []
    for rank in range(world_size):
        last = None
        if paged is None:
            lp = shard_problem(p, world_size, rank, mode, block)
        else:
            local = shard_paged_problem(paged, world_size, rank, mode, block)
            lp = local.problem.replace(k_buffer=local.k_pages, v_buffer=local.v_pages, kv_indptr=local.kv_indptr,
                                       kv_indices=local.kv_indices)
            last = local.kv_last_page_len
        runner = VerifySplitKV(p.num_q_heads, p.num_kv_heads, p.head_dim, p.v_head_dim, p.max_len_extend,
                               p.batch_size, p.q_extend.device, n_splits=n_splits)
        draft = rank == draft_rank
        plan = runner.plan(lp.q_extend, lp.k_extend, lp.v_extend, lp.k_buffer, lp.v_buffer, lp.qo_indptr,
                           lp.kv_indptr, lp.kv_indices, custom_mask=lp.custom_mask if draft else None,
                           mask_indptr=lp.mask_indptr if draft else None, is_causal=lp.is_causal,
                           sm_scale=lp.sm_scale, k_scale=lp.k_scale, v_scale=lp.v_scale,
                           sinks=lp.sinks if draft else None, return_lse=True, attend_draft=draft, check="full",
                           logit_cap=logit_cap, kv_last_page_len=last)
        s = torch.empty(plan.out_shape[:2], dtype=torch.float32, device=plan.device)
        o = plan.run(lp.q_extend, lp.k_extend, lp.v_extend, lp.k_buffer, lp.v_buffer, lse=s)
        o_parts.append(o)
        s_parts.append(s)
    o_all, s_all = torch.stack(o_parts, 1), torch.stack(s_parts, 1)
    out, lse = merge_states(o_all, s_all)
    return (out, lse, o_all, s_all) if return_partials else (out, lse)


# ---- Local worlds: spawned processes joined by gloo on 127.0.0.1 ---------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _local_main() -> None:
    """Entry of a :func:`launch_local` process: ``python -c ... <job dir> <rank>``."""
    import importlib
    import sys

    job_dir, rank = sys.argv[1], int(sys.argv[2])
    path = os.path.join(job_dir, f"rank{rank}.pt")
    try:
        job = torch.load(os.path.join(job_dir, "job.pt"), weights_only=False)
        module, _, name = job["fn"].partition(":")
        fn = importlib.import_module(module)
        for part in name.split("."):
            fn = getattr(fn, part)
        torch.set_num_threads(1)
        dist.init_process_group(job["backend"], init_method=f"tcp://127.0.0.1:{job['port']}", rank=rank,
                                world_size=job["world_size"], timeout=timedelta(seconds=job["timeout_s"]))
        try:
            result = fn(rank, job["world_size"], *job["args"])
        finally:
            dist.destroy_process_group()
        torch.save({"ok": True, "result": result}, path)
    except BaseException:  # report any failure to the parent, then exit non-zero
        torch.save({"ok": False, "error": traceback.format_exc()}, path)
        sys.exit(1)


def _loopback_ifname() -> Optional[str]:
    names = {name for _, name in socket.if_nameindex()} if hasattr(socket, "if_nameindex") else set()
    return next((n for n in ("lo", "lo0") if n in names), None)


def launch_local(fn: Callable, world_size: int = 2, *args, backend: str = "gloo", timeout_s: float = 180.0,
                 env: Optional[dict] = None) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes joined by a process group.

    For CPU tests and notebooks: each rank is a new Python process (a
    subprocess, so this works the same from a script, a notebook or pytest),
    joins a ``gloo`` group through ``tcp://127.0.0.1:<free port>`` with gloo's
    sockets on the loopback interface, runs ``fn`` and returns its result
    (saved with ``torch.save``). Under the Triton interpreter keep shapes small:
    each process runs on one thread.

    Args:
        fn: a module-level function of an importable module (not one defined
            in a notebook cell or ``__main__``).
        world_size: processes.
        *args: passed to ``fn`` after ``rank, world_size`` (picklable).
        backend: the process-group backend.
        timeout_s: the whole run's deadline (and the group's collective timeout).
        env: extra environment variables for the processes (e.g.
            ``{"TRITON_INTERPRET": "1"}`` to run CPU tensors through the
            interpreter on a machine that has a GPU).

    Returns:
        ``fn``'s results, by rank.

    Raises:
        RuntimeError: a rank failed (its traceback and output included) or timed out.
    """
    import subprocess
    import sys

    if dist is None or not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this build")
    module = getattr(fn, "__module__", None)
    if not module or module == "__main__" or "<locals>" in fn.__qualname__:
        raise ValueError("launch_local needs a module-level function of an importable module")
    child_env = dict(os.environ)
    child_env.update({k: str(v) for k, v in (env or {}).items()})
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds splitkv/
    child_env["PYTHONPATH"] = os.pathsep.join([root] + [x for x in [child_env.get("PYTHONPATH")] if x])
    ifname = _loopback_ifname()
    if ifname and "GLOO_SOCKET_IFNAME" not in child_env:
        child_env["GLOO_SOCKET_IFNAME"] = ifname
    with tempfile.TemporaryDirectory(prefix="splitkv_cp_") as job_dir:
        torch.save(dict(fn=f"{module}:{fn.__qualname__}", args=tuple(args), backend=backend,
                        port=_free_port(), world_size=world_size, timeout_s=timeout_s),
                   os.path.join(job_dir, "job.pt"))
        logs = [open(os.path.join(job_dir, f"rank{r}.log"), "w+") for r in range(world_size)]
        code = "import splitkv.testing.parallel as m; m._local_main()"
        procs = [subprocess.Popen([sys.executable, "-c", code, job_dir, str(r)], env=child_env,
                                  stdout=logs[r], stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
                 for r in range(world_size)]
        deadline = time.monotonic() + timeout_s
        hung = []
        for r, proc in enumerate(procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                hung.append(r)
        for r in hung:  # our own children, by handle
            procs[r].kill()
            procs[r].wait()
        results, errors = [], []
        for r in range(world_size):
            logs[r].seek(0)
            output = logs[r].read()[-4000:]
            logs[r].close()
            path = os.path.join(job_dir, f"rank{r}.pt")
            rec = torch.load(path, weights_only=False) if os.path.exists(path) else None
            if rec is not None and rec["ok"]:
                results.append(rec["result"])
                continue
            results.append(None)
            why = ("killed at the deadline" if r in hung else f"exit code {procs[r].returncode}")
            errors.append(f"rank {r} failed ({why}):\n{rec['error'] if rec else ''}\n--- output ---\n{output}")
        if errors:
            raise RuntimeError("\n".join(errors))
        return results


def run_cases(rank: int, world_size: int, cases: Sequence[dict]) -> List[dict]:
    """A rank's side of context-parallel checks: build, shard, run, return (for :func:`launch_local`).

    Each case is a dict:

    * ``problem``: keyword arguments of :func:`splitkv.testing.make_problem`
      (with a ``seed``: every rank draws the same global problem);
    * ``mode``, ``block``: the sharding (default ``"chunk"``);
    * ``draft_rank`` (default 0), ``dst`` (default ``None``), ``partial_dtype``;
    * ``entry``: ``"plan"`` (:class:`ContextParallelVerify` plan/run, run
      twice to reuse the plan) or ``"function"`` (:func:`cp_verify_attention`);
    * ``n_splits``: force the local kernel's slices.

    Returns:
        Per case: ``out`` and ``lse`` (``None`` on ranks that do not merge),
        the rank's partial ``part_lse``, and ``local_prefix_lens``.
    """
    results = []
    for case in cases:
        p = make_problem(**case["problem"])
        lp = shard_problem(p, world_size, rank, case.get("mode", "chunk"), case.get("block"))
        draft_rank, dst = case.get("draft_rank", 0), case.get("dst")
        part_lse = None
        if case.get("entry", "plan") == "plan":
            cp = ContextParallelVerify(p.num_q_heads, p.num_kv_heads, p.head_dim, p.v_head_dim, p.max_len_extend,
                                       p.batch_size, p.q_extend.device, draft_rank=draft_rank, dst=dst,
                                       partial_dtype=case.get("partial_dtype"), n_splits=case.get("n_splits"))
            plan = cp.plan(lp.q_extend, lp.k_extend, lp.v_extend, lp.k_buffer, lp.v_buffer, lp.qo_indptr,
                           lp.kv_indptr, lp.kv_indices, custom_mask=lp.custom_mask, mask_indptr=lp.mask_indptr,
                           is_causal=lp.is_causal, sm_scale=lp.sm_scale, k_scale=lp.k_scale, v_scale=lp.v_scale,
                           sinks=lp.sinks, return_lse=True, check="full")
            res = None
            for _ in range(2):  # the second run reuses the plan and its buffers
                out = lp.new_output() if plan.merges else None
                lse = torch.empty(plan.out_shape[:2], dtype=torch.float32, device=plan.device) if plan.merges else None
                res = plan.run(lp.q_extend, lp.k_extend, lp.v_extend, lp.k_buffer, lp.v_buffer, out=out, lse=lse)
                res = None if res is None else (res, lse)
            part_lse = plan.part_lse.clone() if plan.world_size > 1 else None
        else:
            res = cp_verify_attention(*lp.tensors(lp.new_output()), **lp.options(), draft_rank=draft_rank, dst=dst,
                                      return_lse=True, check="full")
        out, lse = res if res is not None else (None, None)
        results.append(dict(out=out, lse=lse, part_lse=part_lse, local_prefix_lens=lp.prefix_lens))
    return results
