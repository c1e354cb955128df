"""Exercise checkers for the notebooks, one module per lesson, and the switch that solves them.

Each checker takes the learner's function (or answer), runs it on fresh
random inputs against the float64 reference and raises an ``AssertionError``
that says what is wrong, or returns a short confirmation. Each checker knows
its worked solution (:func:`checks`), which lives in its module, out of the
learner's way.

A notebook's exercise cell holds a stub that the learner replaces::

    def kv_bytes(p):
        todo("kv_bytes")            # raises Unsolved until you write the body

    kv_bytes = exercise(kv_bytes, check_kv_bytes)

:func:`exercise` runs the checker on the learner's function and returns the
function later cells use. While the stub is unsolved it prints that the
exercise waits (never "passed") and hands later cells the worked solution,
so the lesson still runs to its end. With the switch on
(``SPLITKV_SOLUTIONS=1``: CI, nbval, the docs build) the worked solution
replaces the learner's function before the check, so stored outputs show a
solved run. :func:`show_solution` prints a worked solution's source.

A Triton exercise's stub is a ``@triton.jit`` function whose body is
``todo("...")``. A kernel's body is never called as plain Python on a GPU, so
its checker first asks :func:`is_stub`, which reads the source, and raises
:class:`Unsolved` for a stub without launching it.
"""

from __future__ import annotations

import ast
import inspect
import os
import textwrap
from typing import Callable

__all__ = ["SOLUTIONS_ENV", "Unsolved", "todo", "checks", "exercise", "solutions_enabled", "show_solution", "is_stub"]

#: The environment variable that runs every exercise with its worked solution.
SOLUTIONS_ENV = "SPLITKV_SOLUTIONS"
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
    """Whether ``SPLITKV_SOLUTIONS`` asks for the worked solutions (``1/true/on/yes``; ``0/false/off/no`` or unset: not)."""
    raw = os.environ.get(SOLUTIONS_ENV, "").strip().lower()
    if raw in _ON:
        return True
    if raw in _OFF:
        return False
    raise ValueError(f"{SOLUTIONS_ENV} must be one of {_ON + _OFF[1:]}, got {raw!r}")


def checks(solution: Callable) -> Callable[[Callable], Callable]:
    """Decorator: mark a checker as judging exercises whose worked solution is ``solution``."""

    def attach(checker: Callable) -> Callable:
        checker.solution = solution
        return checker

    return attach


def exercise(learner: Callable, checker: Callable, *args, **kwargs) -> Callable:
    """Check the learner's function and return the one later cells should use.

    * switch on: the worked solution is checked and returned;
    * the learner's stub still raises :class:`Unsolved`: prints that the
      exercise waits and returns the worked solution (later cells run);
    * otherwise the learner's function is checked (a wrong answer raises the
      checker's ``AssertionError`` with its hint) and returned.

    ``args``/``kwargs`` go to the checker after the function.
    """
    solution = checker.solution
    name = getattr(learner, "__name__", "the function")
    if solutions_enabled():
        print(checker(solution, *args, **kwargs), "(worked solution)")
        return solution
    try:
        message = checker(learner, *args, **kwargs)
    except Unsolved as err:
        print(f"waiting: {name} is not written yet ({err}). "
              f"Later cells use the worked solution; set {SOLUTIONS_ENV}=1 to run every exercise solved.")
        return solution
    print(message)
    return learner


def show_solution(checker: Callable) -> None:
    """Print the source of the worked solution ``checker`` judges against (a ``@triton.jit`` function's too)."""
    solution = checker.solution
    print(inspect.getsource(getattr(solution, "fn", solution)))
