"""``python -m splitkv.bench.validate``: re-validate the package on a GPU in one command (about 8 minutes).

    python -m splitkv.bench.validate --out record/          # everything
    python -m splitkv.bench.validate --parts tests golden   # some parts

It writes a record folder and prints a summary. The parts, the first three side by side, the
last two after them on a quiet GPU:

* ``tests``: every test of ``tests/``, the collected ids dealt out to ``--workers`` pytest
  processes, each under a time limit (one process's dead CUDA context fails its share only);
* ``sanitizer``: compute-sanitizer ``memcheck`` over the GPU tests of plan/run, faults, CUDA
  graphs, paged pools, MLA and context-parallel shards, and ``racecheck`` over the kernels'
  shared memory, with the number of errors each reports;
* ``golden``: the bit-exact outputs of :mod:`splitkv.bench.golden` against
  ``figures/golden_<gpu>.json`` (``--golden-from DIR`` makes the reference from another
  checkout's code in the same run, e.g. the previous release);
* ``host``: the host-time table (:mod:`splitkv.bench.host`) against the last committed
  ``figures/host_<gpu>.json``, as ratios;
* ``bench``: the quick benchmark (``python -m splitkv.bench --quick``) against the rows of the
  committed ``figures/benchmark_<gpu>.json``, as ratios.

The record also holds the device, driver, library versions, commit and date, and whether this
GPU has a tuned table of its own; on one that has none (an H100, say) the same command runs the
untuned-GPU path and says so.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

PARTS = ("tests", "sanitizer", "golden", "host", "bench")
TEST_ROOT = "tests"
TEST_IGNORE = ("tests/browser",)


@dataclass(frozen=True)
class SanitizerRun:
    """One compute-sanitizer run: a tool over a pytest selection."""

    name: str
    tool: str
    selection: Sequence[str]


#: Where memory errors would hide: the plan/run path and its faults, paged pools, MLA heads, context-parallel
#: shards; racecheck over the kernels whose warps share memory (the verify, merge and MLA tiles). The runs go
#: without PyTorch's caching allocator, whose blocks would hide overruns; CUDA-graph captures cannot allocate
#: then, so the graph tests run in the test part only.
SANITIZER_RUNS = (
    SanitizerRun("memcheck: plan/run, faults, graphs", "memcheck",
                 ("tests/test_host.py", "tests/test_faults.py", "tests/test_gpu_oneshot.py", "tests/test_gpu.py",
                  "-k", "not 16k and not 64k and not graph and not capture")),
    SanitizerRun("memcheck: paged pools, MLA (bf16, fp8)", "memcheck",
                 ("tests/test_paged.py", "tests/test_mla.py", "-k",
                  "(paged_matches_oracle or token_pool_matches_oracle or fp8_pool_with_scales) and not dtype0 "
                  "and not dtype1")),
    SanitizerRun("memcheck: context-parallel shards", "memcheck", ("tests/test_parallel.py",)),
    SanitizerRun("racecheck: verify, merge and MLA tiles", "racecheck",
                 ("tests/test_gpu.py", "tests/test_mla.py", "-k",
                  "trees_bf16 and (causal-3 or tree-5) or token_pool_matches_oracle and 576-512 and causal and dtype2")),
)


def gpu_facts(commit: Optional[str]) -> Dict[str, object]:
    """The device, its driver, the library versions, the commit, the date and the table in use."""
    import torch
    import triton

    from .. import tuning
    from .timing import gpu_tag

    name = torch.cuda.get_device_name()
    table = tuning.table_for(torch.device("cuda"))
    smi = _run_text(["nvidia-smi", "--query-gpu=driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"])
    return {
        "device": name, "tag": gpu_tag(name), "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "driver": smi.strip(), "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
        "python": platform.python_version(), "commit": commit or _run_text(["git", "rev-parse", "HEAD"]).strip() or "-",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "table": {"measured": table.measured, "source": str(table.source)},
        "path": "tuned (this GPU's own table)" if table.measured else
                "untuned GPU: tile shapes from the packaged table, programs per SM from this GPU's properties",
    }


def _run_text(cmd: List[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


# --- tests ---------------------------------------------------------------------------------------

def collect(python: str = sys.executable) -> List[str]:
    """The ids of every test under ``tests/`` (the browser check aside)."""
    cmd = [python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", TEST_ROOT]
    cmd += [f"--ignore={path}" for path in TEST_IGNORE]
    out = subprocess.run(cmd, capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "::" in line and not line.startswith(" ")]


def deal(ids: Sequence[str], workers: int) -> List[List[str]]:
    """``ids`` dealt round robin to ``workers`` shares (each file's tests spread across the processes)."""
    shares = [[] for _ in range(max(1, workers))]
    for i, test in enumerate(ids):
        shares[i % len(shares)].append(test)
    return [s for s in shares if s]


#: Exit status of a test process whose CUDA context a test broke (tests/conftest.py ends the process then).
CONTEXT_LOST_EXIT = 70
#: pytest's exit statuses of a run that went through its tests: all passed, some failed, none collected.
PYTEST_DONE = (0, 1, 5)


def run_share(ids: Sequence[str], outcomes: str, limit_s: float, python: str = sys.executable) -> None:
    """Run ``ids`` in pytest processes until each has an outcome in the file ``outcomes`` or time is up.

    The tests' conftest appends every test's outcome to ``outcomes`` and ends the process when a test breaks
    its CUDA context; a process that dies without a word charges its next test. Either way a new process
    takes the tests after it, so one broken context costs one test, not the rest of the share."""
    deadline = time.monotonic() + limit_s
    env = dict(os.environ, SPLITKV_TEST_OUTCOMES=outcomes)
    remaining = list(ids)
    while remaining and time.monotonic() < deadline:
        cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *remaining]
        try:
            code = subprocess.run(cmd, env=env, timeout=deadline - time.monotonic()).returncode
        except subprocess.TimeoutExpired:
            return
        if code in PYTEST_DONE:
            return
        done = set(read_outcomes(outcomes))
        left = [t for t in remaining if t not in done]
        if code == CONTEXT_LOST_EXIT or not left:
            remaining = left
            continue
        # Died without a word: the first test without an outcome took the process down with it; a usage or
        # internal error before any test ran (pytest's 3 and 4) ends the share.
        stuck = len(left) == len(remaining) and code in (3, 4)
        with open(outcomes, "a") as f:
            for test in left if stuck else left[:1]:
                f.write(json.dumps({"id": test, "outcome": "crashed", "message": f"pytest exit status {code}"}) + "\n")
        remaining = [] if stuck else left[1:]


#: Outcomes from best to worst: a test's outcome is the worst of its phases'.
OUTCOME_ORDER = ("passed", "skipped", "failed", "error", "context-lost", "crashed")


def read_outcomes(path: str) -> Dict[str, Dict[str, str]]:
    """Each test's worst outcome (with its message) in an outcomes file."""
    result: Dict[str, Dict[str, str]] = {}
    if not os.path.exists(path):
        return result
    with open(path) as f:
        for line in f:
            entry = json.loads(line)
            old = result.get(entry["id"])
            if old is None or OUTCOME_ORDER.index(entry["outcome"]) > OUTCOME_ORDER.index(old["outcome"]):
                result[entry["id"]] = entry
    return result


def tests_record(shares: Sequence[Sequence[str]], outcome_files: Sequence[str], seconds: float) -> Dict[str, object]:
    """Counts of every outcome over the shares (``not_run``: no outcome by the time limit), the failing tests."""
    counts = dict.fromkeys(("passed", "skipped", "failed", "error", "context-lost", "crashed", "not_run"), 0)
    failures = []
    for share, path in zip(shares, outcome_files):
        outcomes = read_outcomes(path)
        for test in share:
            entry = outcomes.get(test)
            outcome = entry["outcome"] if entry else "not_run"
            counts[outcome] += 1
            if outcome not in ("passed", "skipped", "not_run"):
                failures.append({"test": test, "outcome": outcome, "message": entry["message"]})
    return {**counts, "failures": failures, "workers": len(shares), "seconds": seconds}


# --- sanitizer -----------------------------------------------------------------------------------

#: memcheck's closing line, and racecheck's (which counts hazards, the errors among them).
ERROR_SUMMARY = re.compile(r"(?:ERROR SUMMARY: (\d+) error|RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) error)")


def sanitizer_command(run: SanitizerRun, tool_path: str, python: str = sys.executable) -> List[str]:
    return [tool_path, "--tool", run.tool, "--print-limit", "20", "--target-processes", "all",
            python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *run.selection]


def read_sanitizer(log: str, timed_out: bool) -> Dict[str, object]:
    """The errors compute-sanitizer reported (the sum of its ERROR SUMMARY lines; with no summary line, the
    count of its error headers) and pytest's closing line."""
    summaries = [int(a or b) for a, b in ERROR_SUMMARY.findall(log)]
    errors = sum(summaries) if summaries else log.count("========= Invalid") + log.count("========= Race")
    closing = [line for line in log.splitlines() if re.search(r"\d+ (passed|failed)", line)]
    return {"errors": errors, "complete": not timed_out and bool(summaries),
            "pytest": closing[-1].strip("= ") if closing else "-"}


def find_sanitizer() -> Optional[str]:
    return shutil.which("compute-sanitizer") or next(
        (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if os.path.exists(p)), None)


# --- comparisons with committed records ----------------------------------------------------------

def host_ratios(new: Dict, old: Dict) -> List[Dict[str, object]]:
    """Per (row, entry): new and old host µs and their ratio, for the rows and entries both tables hold."""
    key = lambda r: (r["model"], r["batch"], r["prefix"], r["kv_dtype"])  # noqa: E731
    before = {key(r): r["host_us"] for r in old["rows"]}
    out = []
    for row in new["rows"]:
        for entry, us in row["host_us"].items():
            then = before.get(key(row), {}).get(entry)
            if then:
                out.append({"row": "/".join(map(str, key(row))), "entry": entry, "new_us": us, "old_us": then,
                            "ratio": us / then})
    return out


def bench_ratios(new: Dict, old: Dict, impl: str = "splitkv") -> List[Dict[str, object]]:
    """Per row both records hold: ``impl``'s graph, eager and host times, new over old."""
    key = lambda r: (r["model"], r["batch"], r["prefix"], r["kv_dtype"])  # noqa: E731
    before = {key(r): r["impls"].get(impl, {}) for r in old["rows"]}
    out = []
    for row in new["rows"]:
        now, then = row["impls"].get(impl, {}), before.get(key(row))
        if not then:
            continue
        ratios = {m: now[m] / then[m] for m in ("graph", "eager", "host_us") if now.get(m) and then.get(m)}
        out.append({"row": "/".join(map(str, key(row))), **{f"{m}_ratio": r for m, r in ratios.items()},
                    "graph_us": now.get("graph"), "old_graph_us": then.get("graph")})
    return out


def _load(path: str) -> Optional[Dict]:
    if path and os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return None


# --- the run -------------------------------------------------------------------------------------

@dataclass
class Job:
    """A child process writing its output to a log, killed at its deadline."""

    name: str
    proc: subprocess.Popen
    log: str
    deadline: float
    started: float
    timed_out: bool = False
    seconds: float = 0.0

    @classmethod
    def start(cls, name: str, cmd: List[str], log: str, limit_s: float, env=None, cwd=None) -> "Job":
        handle = open(log, "w")
        proc = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True)
        handle.close()
        now = time.monotonic()
        return cls(name, proc, log, now + limit_s, now)

    def poll(self) -> bool:
        """True once the process has ended (killing it, with its children, past its deadline)."""
        if self.proc.poll() is not None:
            self.seconds = self.seconds or time.monotonic() - self.started
            return True
        if time.monotonic() > self.deadline:
            self.timed_out = True
            try:
                os.killpg(self.proc.pid, 9)
            except ProcessLookupError:
                pass
            self.proc.wait()
            self.seconds = time.monotonic() - self.started
            return True
        return False


def wait_all(jobs: Sequence[Job]) -> None:
    while not all(job.poll() for job in jobs):
        time.sleep(1.0)


def summarise(record: Dict) -> str:
    """The record's summary in a few plain lines."""
    facts = record["facts"]
    lines = [f"splitkv validation: {facts['device']} ({facts['sms']} SMs, driver {facts['driver']}), torch "
             f"{facts['torch']}, triton {facts['triton']}, commit {facts['commit']}, {facts['date']}",
             f"kernel path: {facts['path']}"]
    tests = record.get("tests")
    if tests:
        lines.append(f"tests: {tests['passed']} passed, {tests['failed']} failed, {tests['error']} errors, "
                     f"{tests['context-lost']} broke their CUDA context, {tests['crashed']} crashed their process, "
                     f"{tests['skipped']} skipped, {tests['not_run']} not run (time limit), in {tests['workers']} "
                     f"processes ({tests['seconds']:.0f} s)")
        lines += [f"  {f['outcome'].upper()} {f['test']}: {f['message']}" for f in tests["failures"][:40]]
    for run in record.get("sanitizer", []):
        state = "" if run["complete"] else " (incomplete: " + ("time limit" if run["timed_out"] else "no summary") + ")"
        lines.append(f"{run['name']}: {run['errors']} errors; pytest: {run['pytest']}{state}")
    if record.get("sanitizer_missing"):
        lines.append(f"sanitizer: not run ({record['sanitizer_missing']})")
    golden = record.get("golden")
    if golden:
        lines.append(f"golden: {golden['summary']}")
    for part, label in (("host", "host µs"), ("bench", "quick benchmark, splitkv graph µs")):
        block = record.get(part)
        if block:
            lines.append(f"{label}: {block['summary']}")
    return "\n".join(lines)


def _span(ratios: List[float]) -> str:
    return f"{min(ratios):.2f}-{max(ratios):.2f}x" if ratios else "-"


def start_tests(out: str, workers: int, limit_s: int, python: str):
    """The test shares, each run by a job of its own; returns ``(jobs, shares, outcome files)``."""
    shares = deal(collect(python), workers)
    jobs, files = [], []
    for i, share in enumerate(shares):
        ids, outcomes = os.path.join(out, f"tests_{i}.ids"), os.path.join(out, f"tests_{i}.outcomes")
        with open(ids, "w") as f:
            f.write("\n".join(share))
        cmd = [python, "-m", "splitkv.bench.validate", "--share", ids, "--outcomes", outcomes, "--limit-s", str(limit_s)]
        jobs.append(Job.start(f"tests[{i}]", cmd, os.path.join(out, f"tests_{i}.log"), limit_s + 30))
        files.append(outcomes)
    return jobs, shares, files


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m splitkv.bench.validate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, metavar="DIR", help="record folder (default figures/validation_<gpu>)")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), metavar="PART",
                    help=f"what to run (default all: {' '.join(PARTS)})")
    ap.add_argument("--workers", type=int, default=None,
                    help="pytest processes for the tests (default: one per 17 GiB of GPU memory, at most 8)")
    ap.add_argument("--limit-s", type=int, default=280,
                    help="time limit of the tests and the sanitizer runs, side by side (default 280); after them the golden "
                         "outputs get 180 s, the host table and the quick benchmark 120 s each")
    ap.add_argument("--golden-from", metavar="DIR", help="make the golden reference with the package in DIR "
                    "(another checkout) in this run, instead of reading figures/golden_<gpu>.json")
    ap.add_argument("--commit", help="the commit under test, for the record (default: git rev-parse HEAD)")
    ap.add_argument("--share", metavar="IDS", help=argparse.SUPPRESS)  # one test process's share: its ids, a line each
    ap.add_argument("--outcomes", metavar="PATH", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.share:
        with open(args.share) as f:
            run_share(f.read().splitlines(), args.outcomes, args.limit_s)
        return 0

    import torch

    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (the CPU runs the tests with `make test`)")
    facts = gpu_facts(args.commit)
    tag = facts["tag"]
    out = args.out or os.path.join("figures", f"validation_{tag}")
    os.makedirs(out, exist_ok=True)
    record: Dict[str, object] = {"facts": facts, "parts": list(args.parts)}
    python = sys.executable
    print(f"validating on {facts['device']}: {facts['path']}; record in {out}", flush=True)

    # Side by side: the tests and the sanitizer runs.
    workers = args.workers or min(8, max(1, torch.cuda.get_device_properties(0).total_memory // (17 * 2**30)))
    test_jobs, shares, outcome_files = start_tests(out, workers, args.limit_s, python) if "tests" in args.parts \
        else ([], [], [])
    san_jobs: List[Job] = []
    tool = find_sanitizer()
    if "sanitizer" in args.parts and tool:
        env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")  # the caching allocator hides overruns
        for i, run in enumerate(SANITIZER_RUNS):
            san_jobs.append(Job.start(run.name, sanitizer_command(run, tool, python),
                                      os.path.join(out, f"sanitizer_{i}.log"), args.limit_s, env=env))
    wait_all(test_jobs + san_jobs)

    if test_jobs:
        record["tests"] = tests_record(shares, outcome_files, max(job.seconds for job in test_jobs))
    if "sanitizer" in args.parts:
        record["sanitizer"] = [
            {"name": run.name, "tool": run.tool, "selection": list(run.selection), "timed_out": job.timed_out,
             "seconds": round(job.seconds), **read_sanitizer(open(job.log, errors="replace").read(), job.timed_out)}
            for run, job in zip(SANITIZER_RUNS, san_jobs)] if tool else []
        if not tool:
            record["sanitizer_missing"] = "compute-sanitizer not found"
    # On a quiet GPU: the golden problems need memory, the host times and the benchmark need quiet.
    if "golden" in args.parts:
        record["golden"] = golden_part(out, tag, args.golden_from, python)
    if "host" in args.parts:
        record["host"] = host_part(out, tag, python)
    if "bench" in args.parts:
        record["bench"] = bench_part(out, tag, python)

    with open(os.path.join(out, "record.json"), "w") as f:
        json.dump(record, f, indent=1)
    summary = summarise(record)
    with open(os.path.join(out, "summary.txt"), "w") as f:
        f.write(summary + "\n")
    print(summary)
    return 0 if verdict_ok(record) else 1


def golden_part(out: str, tag: str, golden_from: Optional[str], python: str) -> Dict[str, object]:
    """The golden outputs against ``figures/golden_<tag>.json``, or against those of the package in
    ``golden_from`` made first in the same run; with neither, this code's outputs become the record."""
    reference = os.path.join("figures", f"golden_{tag}.json")
    new = os.path.join(out, "golden.json")
    steps = []
    if golden_from:
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden.py")
        reference = os.path.join(out, "golden_reference.json")
        steps.append(f"(cd {golden_from} && PYTHONPATH={golden_from} {python} {script} "
                     f"--write {os.path.abspath(reference)})")
    if golden_from or os.path.exists(reference):
        steps.append(f"{python} -m splitkv.bench.golden --check {reference} --out {new}")
    else:
        steps.append(f"{python} -m splitkv.bench.golden --write {new}")
    job = Job.start("golden", ["bash", "-c", " && ".join(steps)], os.path.join(out, "golden.log"), 180)
    wait_all([job])
    log = open(job.log, errors="replace").read().strip().splitlines()
    ok = job.proc.returncode == 0 and not job.timed_out
    return {"reference": reference, "verdict": (_load(new) or {}).get("verdict"), "passed": ok,
            "summary": (log[-1] if log else "no output") + ("" if ok else " -- FAILED")}


def host_part(out: str, tag: str, python: str) -> Dict[str, object]:
    """The host-time table, and per entry the span of its ratios to ``figures/host_<tag>.json``."""
    path = os.path.join(out, "host.json")
    job = Job.start("host", [python, "-m", "splitkv.bench.host", "--json", path], os.path.join(out, "host.log"), 120)
    wait_all([job])
    new, old = _load(path), _load(os.path.join("figures", f"host_{tag}.json"))
    ratios = host_ratios(new, old) if new and old else []
    by_entry: Dict[str, List[float]] = {}
    for r in ratios:
        by_entry.setdefault(r["entry"], []).append(r["ratio"])
    summary = ("; ".join(f"{e} {_span(v)}" for e, v in by_entry.items()) + f" of {old['date']}" if ratios else
               "no committed record for this GPU: this run is the first" if new else "failed (see host.log)")
    return {"ratios": ratios, "summary": summary}


def bench_part(out: str, tag: str, python: str) -> Dict[str, object]:
    """The quick benchmark, and the span of splitkv's ratios to the rows of ``figures/benchmark_<tag>.json``."""
    path = os.path.join(out, "bench_quick.json")
    job = Job.start("bench", [python, "-m", "splitkv.bench", "--quick", "--out", path, "--figures", out],
                    os.path.join(out, "bench.log"), 120)
    wait_all([job])
    new, old = _load(path), _load(os.path.join("figures", f"benchmark_{tag}.json"))
    ratios = bench_ratios(new, old) if new and old else []
    summary = (f"graph {_span([r['graph_ratio'] for r in ratios if 'graph_ratio' in r])}, host "
               f"{_span([r['host_us_ratio'] for r in ratios if 'host_us_ratio' in r])} of {old['date']}" if ratios else
               "no committed rows for this GPU: this run is the first" if new else "failed (see bench.log)")
    return {"ratios": ratios, "summary": summary}


def verdict_ok(record: Dict) -> bool:
    """All tests passed, every sanitizer run complete with no error, the golden outputs equal."""
    tests = record.get("tests")
    if tests and any(tests[k] for k in ("failed", "error", "context-lost", "crashed", "not_run")):
        return False
    if any(run["errors"] or not run["complete"] for run in record.get("sanitizer", [])):
        return False
    return not (record.get("golden") and not record["golden"]["passed"])


if __name__ == "__main__":
    sys.exit(main())
