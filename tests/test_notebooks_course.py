"""The course as a teacher hands it out: the stored notebooks show no solution, and every solution passes.

* The committed notebooks are in the learner's state: no solution text, no
  exercise that says "passed", every exercise cell waiting (nbval then checks
  the stored outputs, in ``make test``).
* The solutions live in ``notebooks/solutions/`` and the site does not publish
  them.
* Every notebook, run top to bottom with ``SPLITKV_SOLUTIONS=1``, prints
  "passed" for every exercise (the CPU pass: on a GPU the notebooks switch to
  real shapes, and the GPU machine has no Jupyter kernel).
"""

import json
import os
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
#: What a solution looks like in a notebook: the stop hook's pattern, and an import of one.
SOLUTION_TEXT = re.compile(r"worked solution|def solution_|import[^\n]*solution_|\(the stored solution\)")
#: An exercise cell: ``name = exercise(...)``.
EXERCISE = re.compile(r"^\s*\w+ = exercise\(", re.M)


def _cells(path):
    return json.loads(path.read_text())["cells"]


def _text(cell) -> str:
    return "".join(cell["source"]) + "".join("".join(o.get("text", "")) for o in cell.get("outputs", []))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_stored_notebook_shows_no_solution(path):
    cells = _cells(path)
    for i, cell in enumerate(cells):
        hit = SOLUTION_TEXT.search(_text(cell))
        assert not hit, f"{path.name}, cell {i}: {hit.group(0)!r}"
        assert not re.search(r"^\s*show_solution\(", "".join(cell["source"]), re.M), \
            f"{path.name}, cell {i} calls show_solution: a learner asks for a solution in a cell of their own"
        if cell["cell_type"] == "code" and EXERCISE.search("".join(cell["source"])):
            out = "".join("".join(o.get("text", "")) for o in cell.get("outputs", []))
            waits = len(re.findall(r"^waiting: ", out, re.M))
            assert waits == len(EXERCISE.findall("".join(cell["source"]))) and "passed" not in out, \
                f"{path.name}, cell {i}: stored outputs must be the learner's (waiting), got {out[:200]!r}"


def test_the_stored_notebooks_hold_the_exercises():
    assert sum(len(EXERCISE.findall("".join(c["source"]))) for p in NOTEBOOKS for c in _cells(p)) >= 20


def test_the_solutions_are_outside_the_package_and_off_the_site():
    import splitkv

    package = Path(splitkv.__file__).parent
    assert not [p for p in package.rglob("*.py") if re.search(r"^def solution_(?!of\b)", p.read_text(), re.M)]
    assert sorted(p.stem for p in (ROOT / "notebooks" / "solutions").glob("*.py"))
    mkdocs = (ROOT / "mkdocs.yml").read_text()
    assert re.search(r"^\s*/notebooks/solutions/\s*$", mkdocs, re.M), "mkdocs.yml must exclude notebooks/solutions/"


def test_every_kernel_stub_is_in_the_learners_file():
    from splitkv.teaching.exercises import is_stub, your_kernels

    mine = your_kernels(ROOT / "notebooks" / "your_kernels.py")
    for name in ("tile_step", "load_q_tile", "slice_kernel", "merge_kernel", "draft_kernel"):
        assert is_stub(getattr(mine, name)), f"your_kernels.py is committed with {name} written: keep the stub"


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU pass: on a GPU the notebooks run real shapes")
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_exercise_passes_with_the_solutions(path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    monkeypatch.setenv("SPLITKV_SOLUTIONS", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    exercises = 0
    for i, cell in enumerate(nb.cells):
        calls = len(EXERCISE.findall(cell.source)) if cell.cell_type == "code" else 0
        if not calls:
            continue
        out = "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")
        passed = len(re.findall(r"^passed: .*\(the stored solution\)$", out, re.M))
        assert passed == calls, f"{path.name}, cell {i}: {calls} exercise(s), {passed} passed: {out[:300]!r}"
        exercises += calls
    assert exercises or path.stem == "08_gpu_lab", f"{path.name} has no exercise"


def test_without_the_solutions_folder_a_waiting_exercise_hands_on_the_stub(monkeypatch, tmp_path, capsys):
    # A teacher may withhold notebooks/solutions/: an unwritten exercise then waits, and says there is no stand-in.
    from splitkv.teaching.exercises import exercise, todo
    from splitkv.teaching.exercises.problem import check_kv_bytes

    monkeypatch.delenv("SPLITKV_SOLUTIONS", raising=False)
    monkeypatch.setenv("SPLITKV_SOLUTIONS_DIR", str(tmp_path))

    def kv_bytes(p):
        todo("kv_bytes")

    assert exercise(kv_bytes, check_kv_bytes) is kv_bytes
    assert "no stored version here" in capsys.readouterr().out


def test_a_solution_prints_only_when_asked_for_by_name(capsys):
    from splitkv.teaching.exercises import show_solution
    from splitkv.teaching.exercises.kernels import check_slice_kernel
    from splitkv.teaching.exercises.splitting import check_slicing

    show_solution(check_slicing)
    assert capsys.readouterr().out.startswith("def slicing(")
    show_solution(check_slice_kernel)  # a @triton.jit kernel: its source, from notebooks/solutions/kernels.py
    assert "def slice_kernel(" in capsys.readouterr().out


def test_a_learner_writes_a_kernel_in_their_file_and_the_exercise_checks_theirs(tmp_path, monkeypatch, capsys):
    # The learner's path through notebook 03: fill a stub of your_kernels.py, save, rerun the cell.
    from splitkv.teaching.exercises import exercise, your_kernels
    from splitkv.teaching.exercises.kernels import check_merge_kernel

    monkeypatch.delenv("SPLITKV_SOLUTIONS", raising=False)
    stubs = (ROOT / "notebooks" / "your_kernels.py").read_text()
    theirs = (ROOT / "notebooks" / "solutions" / "kernels.py").read_text()
    body = theirs[theirs.index("def merge_kernel("):]
    body = body[body.index('    """'):]
    body = body[:body.index("\n\n\n")] if "\n\n\n" in body else body
    body = body[body.index('"""', 7) + 3:]  # past the docstring
    written = stubs.replace('    todo("merge_kernel")', body.strip("\n"))
    path = tmp_path / "your_kernels.py"
    path.write_text(written)
    mine = your_kernels(path)
    assert exercise(mine.merge_kernel, check_merge_kernel) is mine.merge_kernel
    out = capsys.readouterr().out
    assert out.startswith("passed: merge_kernel") and "stored" not in out
    # The other kernels of the file are still stubs: they wait.
    from splitkv.teaching.exercises.splitting import check_tile_step
    exercise(mine.tile_step, check_tile_step)
    assert capsys.readouterr().out.startswith("waiting: tile_step is not written yet (write tile_step in your_kernels.py")
