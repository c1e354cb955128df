"""Exercise checkers for the notebooks, one module per lesson, and the switch that solves them.

Each checker takes the learner's function (or answer), runs it on fresh
random inputs against the float64 reference and raises an ``AssertionError``
that says what is wrong, or returns a short confirmation.

The solutions are not in this package. They live in the repository's
``notebooks/solutions/`` folder, one file per lesson module (``kernels.py``
holds the Triton kernels of notebooks 03 and 04), with the exercise's own
name: ``check_x`` is decorated ``@checks("lesson", "x")``, and
:func:`solution_of` loads ``x`` from ``notebooks/solutions/lesson.py`` (or
from the folder ``SPLITKV_SOLUTIONS_DIR`` names). A learner sees one only by
asking for it by name, with :func:`show_solution`.

A notebook's exercise cell passes the learner's function to :func:`exercise`::

    def kv_bytes(p):
        todo("kv_bytes")            # raises Unsolved until you write the body

    kv_bytes = exercise(kv_bytes, check_kv_bytes)

:func:`exercise` runs the checker on the learner's function and returns the
function later cells use. While the stub is unsolved it prints that the
exercise waits (never "passed") and hands later cells the stored solution,
without showing it, so the lesson still runs to its end. With the switch on
(``SPLITKV_SOLUTIONS=1``) the solution replaces the learner's function before
the check; the test suite runs every notebook that way and requires every
exercise to pass.

The Triton kernels of notebooks 03 and 04 are written in one file,
``notebooks/your_kernels.py``; :func:`your_kernels` (re)loads it, so a cell
picks up the learner's latest save.

A Triton exercise's stub is a ``@triton.jit`` function whose body is
``todo("...")``. A kernel's body is never called as plain Python on a GPU, so
its checker first asks :func:`is_stub`, which reads the source, and raises
:class:`Unsolved` for a stub without launching it.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import os
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Callable, Dict, Optional, Union

__all__ = ["SOLUTIONS_ENV", "SOLUTIONS_DIR_ENV", "KERNELS_FILE_ENV", "Unsolved", "todo", "checks", "exercise",
           "solutions_enabled", "solutions_dir", "solution_of", "show_solution", "is_stub", "your_kernels"]

#: The environment variable that runs every exercise with its worked solution.
SOLUTIONS_ENV = "SPLITKV_SOLUTIONS"
#: The environment variable that names the solutions folder (default: the checkout's ``notebooks/solutions``).
SOLUTIONS_DIR_ENV = "SPLITKV_SOLUTIONS_DIR"
#: The environment variable that names the learner's kernel file (default: ``your_kernels.py`` in the
#: current folder or in ``notebooks/`` below it).
KERNELS_FILE_ENV = "SPLITKV_KERNELS_FILE"
#: The checkout this package sits in (an editable install or a source tree).
_CHECKOUT = Path(__file__).resolve().parents[3]
_ON, _OFF = ("1", "true", "on", "yes"), ("", "0", "false", "off", "no")


class Unsolved(NotImplementedError):
    """Raised by an exercise stub the learner has not written yet."""


def todo(what: str) -> None:
    """The body of an exercise stub: raise :class:`Unsolved` naming the exercise."""
    raise Unsolved(f"write {what} here: replace the todo(...) line by your code")


def is_stub(fn: Callable) -> bool:
    """Whether ``fn`` (a function or a ``@triton.jit`` function) still calls ``todo(...)`` in its body."""
    try:
        source = textwrap.dedent(inspect.getsource(getattr(fn, "fn", fn)))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):
        return False
    return any(isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "todo"
               for node in ast.walk(tree))


def solutions_enabled() -> bool:
    """Whether ``SPLITKV_SOLUTIONS`` asks for the stored solutions (``1/true/on/yes``; ``0/false/off/no`` or unset: not)."""
    raw = os.environ.get(SOLUTIONS_ENV, "").strip().lower()
    if raw in _ON:
        return True
    if raw in _OFF:
        return False
    raise ValueError(f"{SOLUTIONS_ENV} must be one of {_ON + _OFF[1:]}, got {raw!r}")


def solutions_dir() -> Path:
    """The folder of the solution files: ``$SPLITKV_SOLUTIONS_DIR``, else the checkout's ``notebooks/solutions``."""
    named = os.environ.get(SOLUTIONS_DIR_ENV)
    return Path(named) if named else _CHECKOUT / "notebooks" / "solutions"


_loaded: Dict[Path, ModuleType] = {}


def _load_file(path: Path, module_name: str) -> ModuleType:
    """Import the Python file ``path`` as ``module_name`` (kept in ``sys.modules``: Triton reads a kernel's globals)."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def _solutions(lesson: str) -> ModuleType:
    path = solutions_dir() / f"{lesson}.py"
    if path not in _loaded:
        if not path.is_file():
            raise FileNotFoundError(f"no solution file {path}: the solutions ship with the repository's notebooks "
                                    f"(notebooks/solutions/), or set {SOLUTIONS_DIR_ENV} to their folder")
        _loaded[path] = _load_file(path, f"_splitkv_solutions_{lesson}")
    return _loaded[path]


def checks(lesson: str, name: str) -> Callable[[Callable], Callable]:
    """Decorator: mark a checker as judging exercise ``name``, whose solution is ``name`` in ``solutions/<lesson>.py``."""

    def attach(checker: Callable) -> Callable:
        checker.lesson, checker.exercise_name = lesson, name
        return checker

    return attach


def solution_of(checker: Callable) -> Callable:
    """The stored solution of the exercise ``checker`` judges, loaded from the solutions folder."""
    return getattr(_solutions(checker.lesson), checker.exercise_name)


def your_kernels(path: Optional[Union[str, Path]] = None) -> ModuleType:
    """Load (again) the learner's kernel file: ``path``, ``$SPLITKV_KERNELS_FILE``, or ``your_kernels.py`` in the
    current folder or in its ``notebooks/`` folder. Each call reads the file afresh, so saved edits count."""
    candidates = [Path(path)] if path else (
        [Path(os.environ[KERNELS_FILE_ENV])] if os.environ.get(KERNELS_FILE_ENV)
        else [Path("your_kernels.py"), Path("notebooks") / "your_kernels.py", _CHECKOUT / "notebooks" / "your_kernels.py"])
    for candidate in candidates:
        if candidate.is_file():
            return _load_file(candidate.resolve(), "your_kernels")
    raise FileNotFoundError(f"no kernel file among {[str(c) for c in candidates]}: copy notebooks/your_kernels.py "
                            f"from the repository, or set {KERNELS_FILE_ENV}")


def exercise(learner: Callable, checker: Callable, *args, **kwargs) -> Callable:
    """Check the learner's function and return the one later cells should use.

    * switch on: the stored solution is checked and returned;
    * the learner's stub still raises :class:`Unsolved`: prints that the
      exercise waits and returns the stored solution, unprinted (later cells run),
      or the stub itself where the solutions folder is absent (withheld);
    * otherwise the learner's function is checked (a wrong answer raises the
      checker's ``AssertionError`` with its hint) and returned.

    ``args``/``kwargs`` go to the checker after the function.
    """
    name = getattr(learner, "__name__", "the function")
    if solutions_enabled():
        solution = solution_of(checker)
        print(checker(solution, *args, **kwargs), "(the stored solution)")
        return solution
    try:
        message = checker(learner, *args, **kwargs)
    except Unsolved as err:
        try:
            stored = solution_of(checker)
        except FileNotFoundError:  # the solutions were withheld from this copy of the course
            print(f"waiting: {name} is not written yet ({err}). There is no stored version here: "
                  f"write it to run the cells that use it.")
            return learner
        print(f"waiting: {name} is not written yet ({err}). Later cells use a stored version, unseen.")
        return stored
    print(message)
    return learner


def show_solution(checker: Callable) -> None:
    """Print the source of the stored solution ``checker`` judges against (a ``@triton.jit`` function's too).

    Call it on purpose, by the checker's name, once both hints have not got you there.
    """
    solution = solution_of(checker)
    print(inspect.getsource(getattr(solution, "fn", solution)))
