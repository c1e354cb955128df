"""What tests, notebooks and the benchmark share, kept apart from the production API.

* :func:`make_problem`, :func:`tree_mask`, :class:`VerifyProblem`,
  :class:`HeadShape`, :data:`MODEL_SHAPES`, :data:`FEATURE_SHAPES` -- seeded
  verify problems and the labelled head configurations every table and plot uses;
* :func:`paged_problem`, :class:`PagedProblem` -- the same problems in a paged pool;
* :func:`reference_attention`, :func:`reference_for` -- the float64 oracle;
* :func:`relative_error`, :data:`TOLERANCE`, :data:`ROW_TOLERANCE` -- the error measure and the
  per-dtype budgets written in it (tests and notebooks use the same).
"""

from .problem import FEATURE_SHAPES, MODEL_SHAPES, HeadShape, PagedProblem, VerifyProblem, make_problem, paged_problem, tree_mask
from .reference import ROW_TOLERANCE, TOLERANCE, reference_attention, reference_for, relative_error

__all__ = [
    "make_problem",
    "tree_mask",
    "VerifyProblem",
    "paged_problem",
    "PagedProblem",
    "HeadShape",
    "MODEL_SHAPES",
    "FEATURE_SHAPES",
    "reference_attention",
    "reference_for",
    "relative_error",
    "TOLERANCE",
    "ROW_TOLERANCE",
]
