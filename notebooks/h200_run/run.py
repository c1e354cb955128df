"""Run every tutorial notebook top to bottom and record what it printed.

    python notebooks/h200_run/run.py OUT_DIR [NOTEBOOK ...] [--scripts] [--timeout SECONDS]

For each notebook (default: every ``notebooks/NN*_*.ipynb``, in order) this writes
``OUT_DIR/<name>.log``: each code cell's source and what it printed. With Jupyter
installed the notebook runs in a kernel (nbclient) and the executed copy is saved as
``OUT_DIR/<name>.ipynb``; without it, or with ``--scripts``, its code cells are
joined into ``OUT_DIR/<name>.py`` and run with this Python. ``OUT_DIR/summary.txt``
gets the device, the library versions and one line per notebook: exit code and
seconds. Each notebook runs from ``notebooks/``, as under the notebook tests; on a
GPU they pick real shapes themselves, and save their figures as ``figures/*_gpu.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parent.parent


def _versions() -> str:
    code = ("import torch, triton; d = torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu'; "
            "print(d); print('torch', torch.__version__, 'triton', triton.__version__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=NOTEBOOKS)
    return (done.stdout + done.stderr).strip()


def _text(output) -> str:
    if output.output_type == "stream":
        return output.text
    if output.output_type == "error":
        return "\n".join(output.traceback) + "\n"
    data = output.get("data", {})
    return data["text/plain"] + "\n" if "text/plain" in data else "".join(f"[{k}]\n" for k in data)


def run_kernel(nb_path: Path, out: Path, timeout: int) -> int:
    """Execute in a Jupyter kernel; write the executed notebook and a log of every cell's output."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(nb_path, as_version=4)
    rc = 0
    try:
        NotebookClient(nb, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    except CellExecutionError:
        rc = 1
    nbformat.write(nb, out / nb_path.name)
    with open(out / f"{nb_path.stem}.log", "w") as log:
        for i, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            log.write(f"# ---- cell {i}\n{cell.source}\n# ----\n")
            log.writelines(_text(o) for o in cell.get("outputs", []))
    return rc


def run_script(nb_path: Path, out: Path, timeout: int) -> int:
    """Join the code cells into a script and run it with this Python; its output is the log."""
    cells = json.loads(nb_path.read_text())["cells"]
    script = out / f"{nb_path.stem}.py"
    script.write_text("\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code") + "\n")
    env = dict(os.environ, MPLBACKEND="Agg")
    with open(out / f"{nb_path.stem}.log", "w") as log:
        try:
            return subprocess.run([sys.executable, str(script)], stdout=log, stderr=subprocess.STDOUT,
                                  cwd=NOTEBOOKS, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            log.write(f"\n[stopped after {timeout} s]\n")
            return 124


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("notebooks", nargs="*", type=Path, help="default: every notebooks/NN*_*.ipynb")
    ap.add_argument("--scripts", action="store_true", help="run the code cells as scripts, without Jupyter")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per cell (kernel) or per notebook (script)")
    args = ap.parse_args()
    paths = [p.resolve() for p in args.notebooks] or sorted(NOTEBOOKS.glob("[0-9][0-9]*_*.ipynb"))
    use_kernel = not args.scripts
    if use_kernel:
        try:
            import nbclient  # noqa: F401
            import nbformat  # noqa: F401
        except ImportError:
            use_kernel = False
    out = args.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    lines = [_versions()]
    worst = 0
    for path in paths:
        start = time.perf_counter()
        rc = (run_kernel if use_kernel else run_script)(path, out, args.timeout)
        lines.append(f"{path.stem} rc={rc} {time.perf_counter() - start:.0f}s")
        print(lines[-1], flush=True)
        worst = max(worst, rc)
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    return worst


if __name__ == "__main__":
    sys.exit(main())
