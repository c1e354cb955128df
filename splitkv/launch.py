"""Launching a compiled Triton kernel without the JIT's per-call work.

``kernel[grid](*args, **constexprs)`` does a lot on every call: it binds ~40
arguments, works out how each one specialises the kernel (dtype, whether an
integer is 1 or a multiple of 16, whether a pointer is 16-byte aligned),
hashes that into a cache key, looks the compiled kernel up, and only then
launches. For a verify step that runs once per layer with the same shapes,
all of it except the launch is the same every time.

A :class:`Launcher` does that work once, on its first call, through the
ordinary JIT path (which compiles if needed and returns the compiled kernel),
and remembers it under what the kernel was specialised on: every tensor's
dtype and 16-byte alignment, every integer's divisibility by 16 (and whether
it is 1, and fits 32 bits). Later calls recompute only that key -- a tuple,
no binding, no hashing of options -- and call the compiled kernel's launcher
directly. Integer arguments that vary from call to call (lengths) are
declared ``do_not_specialize`` in the kernel, so they never change the
compiled code.

A caller that knows more can pass its own ``key``: a plan whose integers and
dtypes are fixed passes what it fixed (computed once) plus the one thing
that can change from layer to layer, the tensors' 16-byte alignment
(:func:`alignment_bits`), and skips even the per-argument key. Such a caller
can also hand the tensors over as their addresses (:meth:`Launcher.run_ptrs`):
given a tensor, Triton's launcher calls its ``data_ptr`` and then asks the
driver whether the address is device memory (``cuPointerGetAttribute``), once
per tensor and launch; the plan has the addresses already (it needed them
for the alignment) and checks the devices itself. Launch hooks
that are registered but empty (Triton >= 3.5 keeps them in a chain) are not
called.

The fast path needs Triton >= 3.3 (the ``knobs`` module and its launch
signature); launch hooks (profilers) are honoured. Under the interpreter or
with an older Triton every call takes the ordinary JIT path.
"""

from __future__ import annotations

from typing import Dict, Sequence, Tuple

import torch

from .checks import interpreting

try:  # Triton >= 3.3
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older Triton: always the JIT path
    _knobs = None

__all__ = ["Launcher", "fast_path_available", "alignment_bits"]


def fast_path_available() -> bool:
    """True when compiled kernels are launched directly (GPU, Triton >= 3.3)."""
    return _knobs is not None and not interpreting()


def _specialization(args: Sequence) -> tuple:
    """What the JIT specialises a kernel on, per argument.

    Tensors: dtype and 16-byte alignment. Integers: whether they are 1 or a
    multiple of 16, and whether they fit 32 bits (the JIT types them i32 or
    i64). Other arguments (floats) do not change the compiled code.
    """
    key = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((a.dtype, a.data_ptr() & 15 == 0))
        elif isinstance(a, int):
            key.append((a & 15 == 0, a == 1, -(2**31) <= a < 2**31))
        else:
            key.append(None)
    return tuple(key)


def alignment_bits(ptrs: Sequence[int]) -> int:
    """Bit ``i`` set when address ``ptrs[i]`` is on a 16-byte boundary; ``-1`` when all are.

    The common case (every tensor aligned) costs one pass that ORs the
    addresses together.
    """
    any_ptr = 0
    for p in ptrs:
        any_ptr |= p
    if not any_ptr & 15:
        return -1
    return sum(1 << i for i, p in enumerate(ptrs) if not p & 15)


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
        self._compiled: Dict[tuple, object] = {}
        self._by_key: Dict[object, object] = {}  # caller-given keys (see the module docstring)
        self._fast = fast_path_available()

    def compiled(self, args: Sequence, grid) -> object:
        """The compiled kernel for ``args`` (compiling it if needed), without launching.

        GPU only: the interpreter compiles nothing.
        """
        key = _specialization(args)
        kernel = self._compiled.get(key)
        if kernel is None:
            kernel = self.fn.warmup(*args, grid=grid, **self.constexprs, **self.options)
            kernel._init_handles()  # load the module: registers, launcher
            self._compiled[key] = kernel
        return kernel

    def spills(self, args: Sequence, grid) -> bool:
        """Whether the kernel compiled for ``args`` spills registers to local memory
        (compiling it if needed); ``False`` off the fast path (nothing is compiled there)."""
        return self._fast and self.compiled(args, grid).n_spills > 0

    def __call__(self, grid: Tuple[int, int, int], args: Sequence, stream=None, key=None) -> None:
        """Launch on the current CUDA stream (or ``stream``, a raw handle).

        ``key``: optional, hashable, standing for :func:`_specialization` of
        ``args`` (the caller guarantees equal keys mean equal specialisations).
        """
        if not self._fast:
            self.fn[grid](*args, **self.constexprs, **self.options)
            return
        kernel = self._by_key.get(key) if key is not None else None
        if kernel is None:
            kernel = self._compiled.get(_specialization(args))
            if kernel is None:
                kernel = self.compiled(args, grid)
            if key is not None:
                self._by_key[key] = kernel
        self._run(kernel, grid, args, stream)

    def ready(self, key) -> bool:
        """Whether :meth:`run_ptrs` launches for ``key`` (it was launched through :meth:`__call__`)."""
        return key in self._by_key

    def run_ptrs(self, key, grid: Tuple[int, int, int], args: Sequence, stream: int) -> bool:
        """Launch the kernel compiled for ``key`` with ``args`` whose tensors are
        given as their ``data_ptr()`` addresses, on device memory the caller has
        checked; ``False`` (nothing launched) when ``key`` has not been launched
        through :meth:`__call__` yet, or off the fast path."""
        kernel = self._by_key.get(key)
        if kernel is None:
            return False
        self._run(kernel, grid, args, stream)
        return True

    def _run(self, kernel, grid, args, stream) -> None:
        if stream is None:
            stream = torch._C._cuda_getCurrentRawStream(torch.cuda.current_device())
        enter, leave = _live_hook(_knobs.runtime.launch_enter_hook), _live_hook(_knobs.runtime.launch_exit_hook)
        # Launch hooks (profilers) get the metadata the JIT path would give them.
        hooked = enter is not None or leave is not None
        meta = kernel.launch_metadata(grid, stream, *args, *self._tail) if hooked else None
        kernel.run(grid[0], grid[1], grid[2], stream, kernel.function, kernel.packed_metadata,
                   meta, enter, leave, *args, *self._tail)


def _live_hook(hook):
    """``hook``, or ``None`` when it is absent or an empty chain (Triton >= 3.5's ``HookChain``)."""
    if hook is None or not getattr(hook, "calls", True):
        return None
    return hook
