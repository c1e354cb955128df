"""Launching a compiled Triton kernel without the JIT's per-call work.

``kernel[grid](*args, **constexprs)`` does a lot on every call: it binds ~40
arguments, works out how each one specialises the kernel (dtype, whether an
integer is 1 or a multiple of 16, whether a pointer is 16-byte aligned),
hashes that into a cache key, looks the compiled kernel up, and only then
launches. For a verify step that runs once per layer with the same shapes,
all of it except the launch is the same every time.

A :class:`Launcher` does that work once, on its first call, through the
ordinary JIT path (which compiles if needed and returns the compiled kernel),
and remembers what the kernel was specialised on: the 16-byte alignment of
every tensor argument. Later calls check only those alignments -- the one
property of the arguments that can change between calls with equal shapes --
and call the compiled kernel's launcher directly. Integer arguments that vary
from call to call are declared ``do_not_specialize`` in the kernel, so they
never change the compiled code.

The fast path needs Triton >= 3.3 (the ``knobs`` module and its launch
signature). Under the interpreter, with launch hooks installed (profilers),
or with an older Triton, every call takes the ordinary JIT path.
"""

from __future__ import annotations

from typing import Dict, Sequence, Tuple

import torch

from .checks import interpreting

try:  # Triton >= 3.3
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older Triton: always the JIT path
    _knobs = None

__all__ = ["Launcher", "fast_path_available"]


def fast_path_available() -> bool:
    """True when compiled kernels are launched directly (GPU, Triton >= 3.3, no hooks)."""
    return (
        _knobs is not None
        and not interpreting()
        and _knobs.runtime.launch_enter_hook is None
        and _knobs.runtime.launch_exit_hook is None
    )


def _alignment(args: Sequence) -> Tuple[bool, ...]:
    return tuple(a.data_ptr() % 16 == 0 for a in args if isinstance(a, torch.Tensor))


class Launcher:
    """One kernel, one set of constexprs and launch options, launched fast.

    Args:
        fn: the ``@triton.jit`` kernel.
        constexprs: its ``tl.constexpr`` arguments, in signature order (they
            must be the kernel's last parameters).
        options: launch options (``num_warps``, ``num_stages``, ...).
    """

    def __init__(self, fn, constexprs: Dict[str, object], options: Dict[str, object]):
        self.fn = fn
        self.constexprs = dict(constexprs)
        self.options = dict(options)
        self._tail = tuple(self.constexprs.values())
        self._compiled: Dict[Tuple[bool, ...], object] = {}

    def compiled(self, args: Sequence, grid) -> object:
        """The compiled kernel for ``args`` (compiling it if needed), without launching.

        GPU only: the interpreter compiles nothing.
        """
        key = _alignment(args)
        kernel = self._compiled.get(key)
        if kernel is None:
            kernel = self.fn.warmup(*args, grid=grid, **self.constexprs, **self.options)
            kernel._init_handles()  # load the module: registers, launcher
            self._compiled[key] = kernel
        return kernel

    def __call__(self, grid: Tuple[int, int, int], args: Sequence, stream=None) -> None:
        """Launch on the current CUDA stream (or ``stream``, a raw handle)."""
        if not fast_path_available():
            self.fn[grid](*args, **self.constexprs, **self.options)
            return
        kernel = self._compiled.get(_alignment(args))
        if kernel is None:
            kernel = self.compiled(args, grid)
        if stream is None:
            stream = torch.cuda.current_stream().cuda_stream
        kernel.run(grid[0], grid[1], grid[2], stream, kernel.function, kernel.packed_metadata,
                   None, None, None, *args, *self._tail)
