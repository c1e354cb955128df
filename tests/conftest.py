"""Shared test helpers: the device under test, per-dtype tolerances, the oracle check,
problem surgery (concatenation, guard bands), and the subprocess harness that runs
malformed calls unchecked where a crash cannot take pytest down."""

import contextlib
import json
import os
import subprocess
import sys
import traceback

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    # On a CPU-only machine every kernel runs through the Triton interpreter;
    # triton.jit reads this when the kernels are defined, so set it first.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from splitkv import VerifyError, check_device_errors  # noqa: E402
from splitkv.testing import ROW_TOLERANCE, TOLERANCE, make_problem, reference_for, relative_error  # noqa: E402,F401
from splitkv.tuning import min_split_tokens  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"

#: dtypes the kernels are checked in here: bf16 only on the GPU, since the
#: interpreter's bf16 tl.dot is broken (triton-lang/triton#11584).
DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if CUDA else [])

#: The adaptive chooser's shortest slice on this machine (32 under the
#: interpreter): prefixes longer than a few of these are cut into several slices.
MIN_SPLIT = min_split_tokens()

gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


#: Exit status of a test process whose CUDA context a test broke (``python -m splitkv.bench.validate``
#: starts a new process for the tests after it).
CONTEXT_LOST_EXIT = 70
#: Where each test's outcome is appended as a JSON line, when set (the validation's test processes set it).
OUTCOMES = os.environ.get("SPLITKV_TEST_OUTCOMES")


def _log_outcome(nodeid, outcome, message=""):
    with open(OUTCOMES, "a") as f:
        f.write(json.dumps({"id": nodeid, "outcome": outcome, "message": message[:300]}) + "\n")


def pytest_runtest_logreport(report):
    """With ``SPLITKV_TEST_OUTCOMES`` set: one line per test phase that decides an outcome (a passed call,
    a skip, a failure or error in any phase)."""
    if OUTCOMES and (report.when == "call" or report.outcome != "passed"):
        outcome = report.outcome if report.when == "call" or report.skipped else "error"
        message = str(report.longrepr.reprcrash.message) if getattr(report.longrepr, "reprcrash", None) else ""
        _log_outcome(report.nodeid, outcome, message)


@pytest.fixture(autouse=True)
def _no_fault_left_pending(request):
    """Each test consumes the faults its checked calls store: on a GPU a checked kernel reports through the
    device's fault log after the call has returned, and a fault left there would be raised by the next
    test's first checked call instead. A test that broke the process's CUDA context (an illegal address, a
    device-side assert) ends the process: every later test in it would fail for that test's fault."""
    yield
    if CUDA:
        try:
            torch.cuda.synchronize()
        except RuntimeError as e:
            if OUTCOMES:
                _log_outcome(request.node.nodeid, "context-lost", str(e))
            pytest.exit(f"{request.node.nodeid} broke this process's CUDA context: {e}", returncode=CONTEXT_LOST_EXIT)
    try:
        check_device_errors(DEVICE)
    except VerifyError as e:
        pytest.fail(f"the test left a device fault pending: {e}")


@contextlib.contextmanager
def raises_kernel_fault(match):
    """``pytest.raises(VerifyError, match=match)`` around checked calls. On a GPU a checked kernel's fault
    reaches the host once the device is done, not necessarily at the call that launched it: the block
    ends with :func:`splitkv.check_device_errors` (under the interpreter the call has raised already)."""
    with pytest.raises(VerifyError, match=match):
        yield
        check_device_errors(DEVICE)


# --- comparing against the oracle ------------------------------------------------

def row_errors(out, ref):
    """Per-row relative errors ``||out_row - ref_row|| / ||ref_row||``, ``[tokens, heads]`` float64.

    A row is one (token, head) output vector. NaN/inf in ``out`` gives ``inf``.
    """
    out = out.to(torch.float64)
    ref = ref.to(device=out.device, dtype=torch.float64)
    diff = torch.linalg.vector_norm(out - ref, dim=-1)
    err = diff / torch.linalg.vector_norm(ref, dim=-1)
    return torch.where(torch.isfinite(out).all(-1), err, torch.full_like(err, float("inf")))


def assert_close(out, ref, dtype=None, what="output"):
    """``out`` finite, its global relative error and its worst row within ``dtype``'s budgets."""
    dtype = dtype or out.dtype
    assert torch.isfinite(out).all(), f"{what} holds NaN/inf (unwritten or broken rows)"
    assert torch.isfinite(ref).all(), f"the reference for {what} holds NaN (a row with no visible key?)"
    err = relative_error(out, ref)
    tol = TOLERANCE[dtype]
    assert err < tol, f"{what}: relative error {err:.2e} exceeds {tol:.0e} for {dtype}"
    rows = row_errors(out, ref)
    worst = rows.max().item() if rows.numel() else 0.0
    row_tol = ROW_TOLERANCE[dtype]
    if not worst < row_tol:
        bad = torch.nonzero(rows >= row_tol)[:5].tolist()
        raise AssertionError(
            f"{what}: worst row error {worst:.2e} exceeds {row_tol:.0e} for {dtype} "
            f"(global {err:.2e}); first bad (token, head) rows: {bad}"
        )
    return err


def gate_args(problem):
    """``(positional, keywords)`` of ``can_handle``/``decline_reason`` for a problem (token or paged):
    the 8 tensors up to ``kv_indices`` (``extend_attention_fwd``'s without ``o_extend``), then
    ``custom_mask``, ``is_causal``, ``mask_indptr`` and ``max_len_extend`` as keywords."""
    a = problem.args(None)
    return a[:3] + a[4:9], {"custom_mask": a[9], "is_causal": a[10], "mask_indptr": a[11], "max_len_extend": a[12]}


def gate_call(fn, problem, **overrides):
    """``fn(*positional, **keywords)`` with :func:`gate_args`' arguments, ``overrides`` added or replacing."""
    args, kwargs = gate_args(problem)
    return fn(*args, **{**kwargs, **overrides})


def plan_options(problem):
    """A problem's keywords for ``VerifySplitKV.plan`` (``options()`` without ``max_len_extend``,
    which the runner fixes): mask, ``is_causal``, scales, sinks (and ``kv_last_page_len`` when paged)."""
    options = dict(problem.options())
    del options["max_len_extend"]
    return options


def assert_matches_reference(out, problem, **overrides):
    """Every element written and finite, and within the dtype's error budgets
    (global relative norm and worst row) against the float64 oracle."""
    return assert_close(out, reference_for(problem, **overrides), out.dtype)


# --- state of the package ------------------------------------------------------

def last_plan():
    """The plan the drop-in used for its latest call (the most recently used cache entry)."""
    from splitkv import api

    plans = api._CACHES.plans  # this thread's plan cache: [plan, when last used] by signature
    assert plans, "no drop-in call has been planned"
    return max(plans.values(), key=lambda entry: entry[1])[0]


def all_counters_zero() -> bool:
    """Every per-stream tile counter array (live and outgrown) is back at zero."""
    from splitkv import workspace

    arrays = list(workspace._COUNTERS.values()) + list(workspace._OUTGROWN)
    return all(int(torch.count_nonzero(a)) == 0 for a in arrays)


def poisoned_workspace_runner(problem, *, poison=float("nan"), max_bs=None, max_splits=None, **kwargs):
    """A :class:`VerifySplitKV` with a caller-owned workspace: counters zeroed, partials ``poison``.

    Returns ``(runner, workspace)``; ``kwargs`` go to the runner (``n_splits``,
    ``pack_gqa``, ``config``, ``split_tokens``, ...); ``max_splits`` sizes the
    workspace (needed in fixed-slice mode). The counters must be zero (the kernel's
    contract); every scratch byte a program reads before writing would show up
    as NaN in the output.
    """
    from splitkv import VerifySplitKV, workspace_bytes
    from splitkv.schedule import MAX_SPLITS

    p = problem
    max_bs = max_bs or p.batch_size
    shape = (p.num_q_heads, p.num_kv_heads, p.head_dim, p.v_head_dim, p.max_len_extend, max_bs)
    probe = VerifySplitKV(*shape, DEVICE, **kwargs)
    if max_splits is None:  # fixed-slice mode needs it: cdiv(max_prefix_len, split_tokens)
        max_splits = kwargs.get("n_splits") or MAX_SPLITS
    need = workspace_bytes(p.num_q_heads, p.num_kv_heads, p.v_head_dim, p.max_len_extend, max_bs,
                           max_splits, pack_gqa=kwargs.get("pack_gqa", True), block_m=probe.block_m)
    ws = torch.zeros(need // 4, dtype=torch.float32, device=DEVICE)
    counter_bytes = workspace_bytes(p.num_q_heads, p.num_kv_heads, p.v_head_dim, p.max_len_extend, max_bs, 0,
                                    pack_gqa=kwargs.get("pack_gqa", True), block_m=probe.block_m)  # no partials
    ws[counter_bytes // 4:] = poison
    return VerifySplitKV(*shape, DEVICE, workspace=ws, **kwargs), ws


def scratch_views(runner, plan, workspace):
    """``(part_o [tiles, n_splits, BLOCK_M, Dv], part_lse [tiles, n_splits, BLOCK_M])`` in a workspace.

    The layout of :mod:`splitkv.kernels.verify` ("Memory layout"); ``part_lse`` is in base 2.
    """
    from splitkv import workspace_bytes

    counter_bytes = workspace_bytes(runner.num_q_heads, runner.num_kv_heads, runner.v_head_dim,
                                    runner.max_len_extend, runner.max_bs, 0, pack_gqa=runner.pack_gqa,
                                    block_m=runner.block_m)  # the counters: the partials follow
    return partials_views(plan, workspace.view(torch.uint8)[counter_bytes:].view(torch.float32))


def partials_views(plan, parts):
    """The kernel's partials in a flat float32 ``parts`` (outputs, then base-2 LSEs at ``rows x Dv``)."""
    tiles, n_splits, block_m = plan.grid[0], plan.n_splits, plan.config.block_m
    dv = plan.out_shape[2]
    rows = tiles * n_splits * block_m
    part_o = parts[: rows * dv].view(tiles, n_splits, block_m, dv)
    return part_o, parts[rows * dv: rows * (dv + 1)].view(tiles, n_splits, block_m)


# --- problem surgery -------------------------------------------------------------

def _indptr(lens, device, dtype=torch.int32):
    out = torch.zeros(len(lens) + 1, dtype=torch.int64)
    out[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0)
    return out.to(device=device, dtype=dtype)


def concat_problems(problems, max_len_extend=None):
    """One batch made of the sequences of several problems (same heads, dtypes, scales, sinks).

    Pools are stacked and each problem's ``kv_indices`` shifted past the pools
    before it, so every sequence keeps exactly its data.
    """
    first = problems[0]
    q = torch.cat([p.q_extend for p in problems])
    k = torch.cat([p.k_extend for p in problems])
    v = torch.cat([p.v_extend for p in problems])
    kb = torch.cat([p.k_buffer for p in problems])
    vb = torch.cat([p.v_buffer for p in problems])
    shift, indices = 0, []
    for p in problems:
        indices.append(p.kv_indices.to(torch.int64) + shift)
        shift += p.k_buffer.shape[0]
    prefix = [n for p in problems for n in p.prefix_lens]
    extend = [n for p in problems for n in p.extend_lens]
    mask = mask_indptr = None
    if first.custom_mask is not None:
        mask = torch.cat([p.custom_mask for p in problems])
        mask_indptr = _indptr([int(p.custom_mask.numel()) for p in problems], first.q_extend.device, torch.int64)
        starts = []
        for i, p in enumerate(problems):
            starts.append(p.mask_indptr[:-1].to(torch.int64) + mask_indptr[i])
        mask_indptr = torch.cat(starts + [mask_indptr[-1:]])
    return first.replace(
        q_extend=q, k_extend=k, v_extend=v, k_buffer=kb, v_buffer=vb,
        qo_indptr=_indptr(extend, q.device), kv_indptr=_indptr(prefix, q.device),
        kv_indices=torch.cat(indices).to(first.kv_indices.dtype),
        custom_mask=mask, mask_indptr=mask_indptr,
        max_len_extend=max_len_extend or max(p.max_len_extend for p in problems),
        prefix_lens=prefix, extend_lens=extend,
    )


def drop_prefix_keys(problem, positions):
    """The problem without the prefix keys at ``kv_indices`` positions ``positions``
    (what the kernel computes when those slots are outside the pool: absent keys)."""
    p = problem
    drop = set(int(i) for i in positions)
    kv = p.kv_indptr.tolist()
    keep, prefix = [], []
    for b in range(p.batch_size):
        mine = [i for i in range(kv[b], kv[b + 1]) if i not in drop]
        keep += mine
        prefix.append(len(mine))
    keep_t = torch.tensor(keep, dtype=torch.int64, device=p.kv_indices.device)
    mask = mask_indptr = None
    if p.custom_mask is not None:
        blocks, mp, qo = [], p.mask_indptr.tolist(), p.qo_indptr.tolist()
        for b in range(p.batch_size):
            n_pre, n_ext = kv[b + 1] - kv[b], qo[b + 1] - qo[b]
            rows = p.custom_mask[mp[b]: mp[b] + n_ext * (n_pre + n_ext)].view(n_ext, n_pre + n_ext)
            cols = [j for j in range(n_pre) if kv[b] + j not in drop] + list(range(n_pre, n_pre + n_ext))
            blocks.append(rows[:, cols].flatten())
        mask = torch.cat(blocks)
        mask_indptr = _indptr([b.numel() for b in blocks], p.q_extend.device, torch.int64)
    return p.replace(kv_indices=p.kv_indices[keep_t], kv_indptr=_indptr(prefix, p.q_extend.device),
                     custom_mask=mask, mask_indptr=mask_indptr, prefix_lens=prefix)


def prefix_only_mask(p):
    """``(custom_mask, mask_indptr)`` that hide every draft key: with
    ``skip_prefix_custom_mask`` (the oracle's default) the oracle then attends
    to the prefix alone, as ``attend_draft=False`` does."""
    blocks = []
    for n_pre, n_ext in zip(p.prefix_lens, p.extend_lens):
        rows = torch.zeros(n_ext, n_pre + n_ext, dtype=torch.bool)
        rows[:, :n_pre] = True
        blocks.append(rows.flatten())
    return torch.cat(blocks).to(p.q_extend.device), _indptr([b.numel() for b in blocks], p.q_extend.device,
                                                            torch.int64)


def with_prefix_parts(p, ranges):
    """The problem with each sequence's prefix cut to ``ranges[b] = (lo, hi)`` (positions in its prefix).

    Drafts, pools and scales are shared; with a ``custom_mask`` the sub-problem
    gets a causal-equivalent draft mask rebuilt for the new prefix widths.
    """
    kv = p.kv_indptr.tolist()
    pieces, lens = [], []
    for b, (lo, hi) in enumerate(ranges):
        pieces.append(p.kv_indices[kv[b] + lo: kv[b] + hi])
        lens.append(hi - lo)
    sub = p.replace(kv_indices=torch.cat(pieces), kv_indptr=_indptr(lens, p.q_extend.device), prefix_lens=lens)
    if p.custom_mask is not None:
        qo, mp = p.qo_indptr.tolist(), p.mask_indptr.tolist()
        blocks = []
        for b, (lo, hi) in enumerate(ranges):
            n_pre, n_ext = kv[b + 1] - kv[b], qo[b + 1] - qo[b]
            rows = p.custom_mask[mp[b]: mp[b] + n_ext * (n_pre + n_ext)].view(n_ext, n_pre + n_ext)
            blocks.append(torch.cat([rows[:, lo:hi], rows[:, n_pre:]], 1).flatten())
        sub = sub.replace(custom_mask=torch.cat(blocks),
                          mask_indptr=_indptr([x.numel() for x in blocks], p.q_extend.device, torch.int64))
    return sub


#: Guard rows around guarded tensors (more than any "pool + 1000" slot reaches).
GUARD = 1100


class Guarded:
    """A problem whose tensors sit inside larger buffers, to catch stray accesses.

    * pools, ``q/k/v_extend``: NaN guard rows before and after; the pool also
      gets one extra in-range *poison* slot (NaN), ``poison_slot``;
    * ``kv_indices``: guard entries holding ``poison_slot``;
    * the output: guard rows of 0 before and after.

    A kernel that reads past a pool, a draft tensor or ``kv_indices`` picks up
    NaN, which shows in the output; one that writes past the output changes a
    guard row. The valid part of every tensor is untouched.
    """

    def __init__(self, problem, guard=GUARD):
        p = problem
        dev = p.q_extend.device
        self.guard = g = guard

        def nan_framed(t, extra_rows=0):
            big = torch.full((g + t.shape[0] + extra_rows + g, *t.shape[1:]), float("nan"), dtype=t.dtype,
                             device=dev)
            big[g: g + t.shape[0]] = t
            return big, big[g: g + t.shape[0] + extra_rows]

        self._keep = []
        views = {}
        for name in ("q_extend", "k_extend", "v_extend"):
            big, views[name] = nan_framed(getattr(p, name))
            self._keep.append(big)
        self.poison_slot = p.k_buffer.shape[0]
        for name in ("k_buffer", "v_buffer"):
            big, views[name] = nan_framed(getattr(p, name), extra_rows=1)
            self._keep.append(big)
        idx = torch.full((g + p.kv_indices.shape[0] + g,), self.poison_slot, dtype=p.kv_indices.dtype, device=dev)
        idx[g: g + p.kv_indices.shape[0]] = p.kv_indices
        self._keep.append(idx)
        views["kv_indices"] = idx[g: g + p.kv_indices.shape[0]]
        self.problem = p.replace(**views)
        self._out = torch.zeros((g + p.num_tokens + g, p.num_q_heads, p.v_head_dim), dtype=p.q_extend.dtype,
                                device=dev)

    def fresh_output(self):
        """The guarded output, zeroed (guards included)."""
        self._out.zero_()
        return self._out[self.guard: self.guard + self.problem.num_tokens]

    def assert_guards_intact(self, what=""):
        g = self.guard
        assert (self._out[:g] == 0).all() and (self._out[-g:] == 0).all(), f"{what}: a write landed outside o_extend"


# --- malformed calls: building them, and running them unchecked in a subprocess ---

_DTYPES = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16,
           "int32": torch.int32, "int64": torch.int64}


def build_case(case, guard=False):
    """A malformed call from its JSON description.

    ``case``: ``{"name", "problem": make_problem kwargs (dtypes as strings),
    "max_len_extend": int or None, "edits": [[field, position or None, value]],
    "expect": "absent" | [sequence ids] | None}``. A value ``["pool", k]``
    means the pool's size plus ``k`` (``"kv_len"``, ``"tokens"``,
    ``"mask_len"`` likewise); position ``None`` replaces the whole field with
    the value (a list).

    Returns ``(problem, clean, guarded)``: the malformed problem, the problem
    before the edits, and the :class:`Guarded` wrapper of the malformed one
    (``None`` unless ``guard``; its pool has one more, poisoned, slot, which
    ``"pool"`` counts).
    """
    spec = dict(case["problem"])
    for key in ("dtype", "index_dtype", "kv_dtype"):
        if key in spec:
            spec[key] = _DTYPES[spec[key]]
    clean = make_problem(device=DEVICE, **spec)
    if case.get("max_len_extend") is not None:
        clean = clean.replace(max_len_extend=case["max_len_extend"])
    sizes = {"pool": clean.k_buffer.shape[0] + (1 if guard else 0), "kv_len": clean.kv_indices.shape[0],
             "tokens": clean.num_tokens, "abs": 0,
             "mask_len": 0 if clean.custom_mask is None else clean.custom_mask.numel()}

    def value_of(v):
        if isinstance(v, list) and len(v) == 2 and isinstance(v[0], str):
            return sizes[v[0]] + int(v[1])
        return int(v)

    fields = {}
    for field, pos, value in case.get("edits", []):
        if pos is None:
            like = getattr(clean, field)
            fields[field] = torch.tensor([value_of(x) for x in value], dtype=like.dtype, device=like.device)
            continue
        if field not in fields:
            fields[field] = getattr(clean, field).clone()
        fields[field][int(pos)] = value_of(value)
    problem = clean.replace(**fields)
    wrapper = Guarded(problem) if guard else None
    if wrapper is not None:
        problem = wrapper.problem
    return problem, clean, wrapper


def _expected_rows(case, problem, clean):
    """``(reference, row mask)`` the unchecked outputs must match, or ``None``."""
    expect = case.get("expect")
    if expect is None:
        return None
    if expect == "absent":
        bad = [i for i, (field, pos, _) in enumerate(case["edits"]) if field == "kv_indices"]
        positions = [case["edits"][i][1] for i in bad]
        ref = reference_for(drop_prefix_keys(clean, positions))
        rows = torch.ones(clean.num_tokens, dtype=torch.bool)
    else:
        ref = reference_for(clean)
        rows = torch.zeros(clean.num_tokens, dtype=torch.bool)
        qo = clean.qo_indptr.tolist()
        for b in expect:
            rows[qo[b]: qo[b + 1]] = True
    return ref, rows.to(ref.device)


def run_case_unchecked(case):
    """Run one malformed call unchecked through every entry; assert it stayed in bounds.

    Entries: ``verify_attention(check=False)``, ``verify_splitkv_fwd(check=False)``
    and a runner forced to 4 slices, merging by the tiles' last programs (or
    its default), by merge programs in the grid, and in a second launch
    (``one_launch=False``). Each may decline with a ``ValueError``
    (shapes the gate or plan refuses); when it launches, the guards must be
    intact, the output finite (no NaN read from a guard), the counters back at
    zero, and the rows ``case["expect"]`` names equal to the oracle's.
    """
    from splitkv import VerifySplitKV, verify_attention, verify_splitkv_fwd

    problem, clean, wrapper = build_case(case, guard=True)
    p = problem
    expected = _expected_rows(case, problem, clean)
    outcomes = []

    def entry_attention(out):
        verify_attention(*p.tensors(out), **p.options(), check=False)

    def entry_drop_in(out):
        if not verify_splitkv_fwd(*p.args(out), **p.kwargs(), check=False):
            raise ValueError("declined")

    def entry_runner(out, one_launch=True, merge_programs=False):
        from unittest import mock

        from splitkv import schedule

        # merge_programs: past what a last program merges alone, so the grid's merge programs wait on
        # the slices' counters (a mismatch with the malformed metadata would hang, not just be wrong).
        with mock.patch.object(schedule, "FUSED_MAX_MERGE", 0 if merge_programs else schedule.FUSED_MAX_MERGE):
            runner = VerifySplitKV(p.num_q_heads, p.num_kv_heads, p.head_dim, p.v_head_dim, p.max_len_extend,
                                   p.batch_size, DEVICE, n_splits=4, one_launch=one_launch)
            plan = runner.plan(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, p.qo_indptr,
                               p.kv_indptr, p.kv_indices, custom_mask=p.custom_mask, mask_indptr=p.mask_indptr,
                               is_causal=p.is_causal, sm_scale=p.sm_scale, k_scale=p.k_scale, v_scale=p.v_scale,
                               sinks=p.sinks)
            plan.run(p.q_extend, p.k_extend, p.v_extend, p.k_buffer, p.v_buffer, out=out)

    for name, entry in (("verify_attention", entry_attention), ("drop-in", entry_drop_in),
                        ("runner", entry_runner),
                        ("runner, merge programs", lambda out: entry_runner(out, merge_programs=True)),
                        ("runner, spread merge", lambda out: entry_runner(out, one_launch=False))):
        what = f"{case['name']} / {name}"
        out = wrapper.fresh_output()
        try:
            entry(out)
        except ValueError as err:
            outcomes.append(f"{name}: declined ({str(err)[:60]})")
            continue
        if CUDA:
            torch.cuda.synchronize()
        wrapper.assert_guards_intact(what)
        assert torch.isfinite(out).all(), f"{what}: NaN in the output (a read outside the tensors)"
        assert all_counters_zero(), f"{what}: tile counters not back at zero"
        if expected is not None:
            ref, rows = expected
            assert_close(out[rows], ref[rows], p.q_extend.dtype, what)
        outcomes.append(f"{name}: ran")
    return outcomes


def _child_main():  # pragma: no cover - runs in the subprocess
    cases = json.loads(sys.stdin.read())
    for case in cases:
        print(f"case {case['name']} ...", flush=True)
        try:
            outcomes = run_case_unchecked(case)
        except AssertionError:
            traceback.print_exc()
            print(f"FAILED {case['name']}", flush=True)
            sys.exit(3)
        print(f"  ok: {'; '.join(outcomes)}", flush=True)
    print("all cases ok", flush=True)


def run_unchecked_in_subprocess(cases, timeout=600):
    """Run malformed ``cases`` unchecked in a fresh Python; assert it exits 0.

    A crash (segfault, illegal address) kills only the child; an assertion in
    :func:`run_case_unchecked` makes it exit 3. The child's output names the
    case it was running.
    """
    env = dict(os.environ)
    env.pop("SPLITKV_CHECK", None)
    here = os.path.dirname(os.path.abspath(__file__))
    import splitkv  # the child imports the same package, however this process found it (install or PYTHONPATH)

    package_root = os.path.dirname(os.path.dirname(os.path.abspath(splitkv.__file__)))
    code = (f"import sys; sys.path[:0] = [{here!r}, {package_root!r}]; import conftest; "
            f"conftest._child_main()")
    proc = subprocess.run([sys.executable, "-c", code], input=json.dumps(cases), capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=here)
    report = f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, report
    assert "all cases ok" in proc.stdout, report
    return proc.stdout
