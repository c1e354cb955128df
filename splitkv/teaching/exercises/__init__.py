"""Exercise checkers for the notebooks, one module per lesson.

Each checker takes the learner's function (or answer), runs it on fresh
random inputs against the float64 reference and raises an ``AssertionError``
that says what is wrong, or returns a short confirmation. Solutions live in
each module's ``solution_*`` functions, out of the learner's way.
"""
