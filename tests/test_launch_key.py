"""The direct launcher's key against Triton's own specialisation.

:func:`splitkv.launch._specialization` restates how the JIT specialises a
kernel on its arguments. Here Triton's binder (what ``JITFunction.run`` calls
to bind and specialise, built by ``create_function_from_signature`` for a
probe kernel) and our key see the same values; for a specialised parameter
the two must partition them alike (same key in ours <=> same specialisation
in Triton's), for a ``do_not_specialize`` one ours may only be finer. It needs
no GPU: on the CPU the binder gets Triton's ``BaseBackend``, whose
specialisation hooks the NVIDIA backend uses unchanged; with CUDA, the real
backend.
"""

import itertools
import math

import pytest
import torch
import triton

from splitkv.launch import _specialization

jit = pytest.importorskip("triton.runtime.jit")


def _probe(spec, fixed):  # the probe kernel: one specialised parameter, one do_not_specialize
    pass


def _binder():
    """Triton's binder for ``_probe``: ``binder(spec, fixed)`` returns ``(bound, specialization, options)``."""
    create = getattr(jit, "create_function_from_signature", None)
    if create is None or not hasattr(jit, "JITFunction"):
        pytest.skip(f"triton {triton.__version__} has no create_function_from_signature/JITFunction "
                    "to compare the key with")
    # JITFunction itself, not triton.jit (which gives the interpreter's function under TRITON_INTERPRET=1).
    fn = jit.JITFunction(_probe, do_not_specialize=["fixed"])
    if torch.cuda.is_available():
        from triton.compiler import make_backend
        from triton.runtime.driver import driver

        backend = make_backend(driver.active.get_current_target())
    else:
        from triton.backends.compiler import BaseBackend

        backend = BaseBackend  # its specialisation hooks are static; the NVIDIA backend keeps them
    return create(fn.signature, fn.params, backend)


def _tensors(device):
    """Tensors of several dtypes, each at 16-byte aligned and misaligned addresses."""
    dtypes = [torch.bool, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.float16,
              torch.bfloat16, torch.float32, torch.float64]
    dtypes += [getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)]
    out = []
    for dtype in dtypes:
        base = torch.zeros(256, dtype=dtype, device=device)
        size = base.element_size()
        assert base.data_ptr() % 16 == 0
        for offset in sorted({0, 1, 3, 16 // size, 32 // size, 24 // size}):
            out.append(base[offset:])  # a slice: data_ptr moves by offset * size bytes
        storage = base.untyped_storage()
        for offset in (1, 16 // size):  # the same through an explicit storage offset
            out.append(torch.empty(0, dtype=dtype, device=device).set_(storage, offset, (8,), (1,)))
    assert any(t.data_ptr() % 16 for t in out) and any(t.data_ptr() % 16 == 0 for t in out)
    return out


_NEAR = [2**31, -(2**31), 2**32, 2**63, 2**64]
INTS = sorted({0, 1, -1, 2, 15, 16, 17, 32, 48, -16, -17, 2**31 - 1, 2**40, 2**40 + 1, 2**40 + 16,
               2**63 - 1, 2**64 - 1, -(2**31) - 1, -(2**63)}
              | {n + d for n in _NEAR for d in (-32, -16, -15, -1, 0, 1, 15, 16)})
FLOATS = [0.0, -0.0, 1.0, 1.5, -2.0, 16.0, 2.0**40, 1e300, -1e-300, math.inf, -math.inf, math.nan]
OTHERS = [None, True, False]


def _triton_spec(binder, value):
    """Triton's specialisation of ``value`` as the specialised and as the do_not_specialize parameter,
    or ``None`` when Triton refuses the value (an integer past 64 bits)."""
    try:
        _, spec, _ = binder(value, value)
    except OverflowError:
        return None
    return tuple(map(_hashable, spec))


def _hashable(x):
    return tuple(_hashable(y) for y in x) if isinstance(x, (list, tuple)) else x


def _show(v):
    if isinstance(v, torch.Tensor):
        return f"tensor({v.dtype}, data_ptr % 16 = {v.data_ptr() % 16})"
    return repr(v)


def _check_partition(rows, finer_ok):
    """``rows``: ``(value, our key, Triton's specialisation)``. Ours and Triton's partition the values
    alike (``finer_ok``: ours may split one of Triton's classes, never merge two)."""
    problems = []
    # (group by, must then agree on): our key => Triton's always; Triton's => ours unless finer_ok.
    for by, then in ((1, 2),) if finer_ok else ((1, 2), (2, 1)):
        classes = {}
        for row in rows:
            classes.setdefault(row[by], {}).setdefault(row[then], row[0])
        for k, seen in classes.items():
            if len(seen) > 1:
                (ka, va), (kb, vb) = itertools.islice(seen.items(), 2)
                side, other = ("our key", "Triton's") if by == 1 else ("Triton's", "our key")
                problems.append(f"{side} {k} holds {_show(va)} and {_show(vb)}, apart in {other}: {ka} != {kb}")
    assert not problems, "\n".join(problems[:10])


@pytest.fixture(scope="module")
def specs():
    """``(value, our key, Triton's as the specialised parameter, as the do_not_specialize one)`` for
    every probe value Triton accepts."""
    binder = _binder()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = []
    for v in INTS + FLOATS + OTHERS + _tensors(device):
        s = _triton_spec(binder, v)
        if s is not None:
            out.append((v, _specialization((v,))[0], s[0], s[1]))
    return out


def test_specialised_arguments_partition_alike(specs):
    """A specialised parameter: our key and Triton's specialisation split ints, bools, floats, None and
    tensors (dtype x alignment) into the same classes."""
    _check_partition([(v, ours, spec) for v, ours, spec, _ in specs], finer_ok=False)


def test_do_not_specialize_arguments_are_refined(specs):
    """A ``do_not_specialize`` parameter: Triton still types ints i32 / i64 / u64 (and keeps a tensor's
    dtype); our key, which does not know which parameters those are, is finer and never merges two
    of Triton's classes."""
    _check_partition([(v, ours, fixed) for v, ours, _, fixed in specs], finer_ok=True)
    # The i32 / i64 boundary shows in Triton's type of an unspecialised int, and in our key.
    typed = {v: (ours, fixed[0]) for v, ours, _, fixed in specs if type(v) is int}
    for inside, outside in ((2**31 - 1, 2**31), (-(2**31), -(2**31) - 1)):
        assert typed[inside][1] == "i32" and typed[outside][1] == "i64"
        assert typed[inside][0] != typed[outside][0]


def test_probe_covers_every_class():
    """The probe values reach each of Triton's integer classes and both alignments, so the partition
    tests above compare something (i32/i64/u64, multiple of 16 or not, the constant 1)."""
    binder = _binder()
    kinds = {_triton_spec(binder, v)[0] for v in INTS if _triton_spec(binder, v) is not None}
    types = {k[0] for k in kinds}
    assert {"i32", "i64", "u64", "constexpr"} <= types, types
    assert len(kinds) >= 7, kinds  # i32/i64/u64 x (multiple of 16 or not), and 1
