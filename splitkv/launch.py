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
it is 1, and its type: i32, i64 or u64), the type of every other argument.
Later calls recompute only that key -- a tuple, no binding, no hashing of
options -- and call the compiled kernel's launcher directly. Integer
arguments that vary from call to call (lengths) are declared
``do_not_specialize`` in the kernel, so they never change the compiled code
(only their i32/i64 type, which the key keeps).

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
called; registered hooks (profilers) are honoured.

The fast path relies on Triton internals that change between releases, so it
runs only on the releases it was checked against (:data:`TESTED_TRITON`) where
those internals are present (checked once, at import); elsewhere, under
the interpreter, on ROCm and with ``SPLITKV_PORTABLE=1``, every call takes
the public ``fn[grid](...)`` path.

This is the package's one module that uses CPython, PyTorch or Triton
internals; each has a public fallback that the others take:

* :func:`current_stream` -- the current stream's raw handle
  (``torch._C._cuda_getCurrentRawStream``; public: ``torch.cuda.current_stream().cuda_stream``);
* :func:`alloc_raw` / :func:`free_raw` -- a block of the caching allocator
  without a tensor (public: ``torch.cuda.caching_allocator_alloc`` / ``_delete``);
* :class:`Launcher` -- the compiled kernel launched directly (public: ``fn[grid](...)``);
* :func:`environ_reader` -- an environment variable read from CPython's store behind
  ``os.environ`` (public: ``os.environ.get``), for the one the drop-in reads on every call.

And the device facts the launch needs, in one place: :func:`capturing`,
:func:`supports_pdl`, :func:`portable`, :func:`interpreting`.
"""

from __future__ import annotations

import os
import re
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch
import triton


__all__ = ["Launcher", "fast_path_available", "fast_path_problem", "alignment_bits", "TESTED_TRITON", "PORTABLE_ENV",
           "portable", "capturing", "supports_pdl", "current_stream", "alloc_raw", "free_raw", "environ_reader",
           "interpreting"]

#: Set to ``1`` to take the portable path everywhere: Triton's public launch, no programmatic
#: dependent launch, no private PyTorch hooks (what a ROCm build of PyTorch takes by itself).
PORTABLE_ENV = "SPLITKV_PORTABLE"


def interpreting() -> bool:
    """True when Triton kernels run through the interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def portable() -> bool:
    """Whether the launch takes only public, vendor-neutral paths (ROCm, or ``SPLITKV_PORTABLE=1``)."""
    return torch.version.hip is not None or os.environ.get(PORTABLE_ENV, "0").strip().lower() in ("1", "true", "on", "yes")


def capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is being captured into a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def supports_pdl(device: torch.device) -> bool:
    """Whether kernels on ``device`` may use programmatic dependent launch: an NVIDIA GPU of compute
    capability 9.0 or newer, outside the interpreter and the portable path (a ROCm build reports an
    MI300 as capability 9.4, so the capability alone does not say it)."""
    return (device.type == "cuda" and not interpreting() and not portable()
            and torch.cuda.get_device_capability(device)[0] >= 9)

#: Triton releases ``[low, high)`` (major, minor) whose launch internals and
#: specialisation rules the fast path was checked against (tests/test_launch_key.py).
TESTED_TRITON = ((3, 3), (3, 10))

_I32 = 2**31
_U64 = 2**63


def _triton_version(version: str) -> Optional[Tuple[int, int]]:
    """``(major, minor)`` of a version string such as ``"3.6.0"`` or ``"3.7.0+git1a2b"``."""
    m = re.match(r"\s*(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _launch_hooks():
    """Where Triton keeps the launch hooks: ``triton.knobs.runtime`` (>= 3.4), ``CompiledKernel`` (3.3)."""
    try:
        from triton import knobs
    except ImportError:
        from triton.compiler import CompiledKernel

        return CompiledKernel
    return knobs.runtime


def _check_fast_path(version: Optional[str] = None) -> Optional[str]:
    """Why the fast path cannot be used with this Triton and PyTorch (``None``: it can).

    It calls ``JITFunction.warmup``, ``CompiledKernel._init_handles`` and
    ``launch_metadata``, the compiled kernel's ``function``, ``packed_metadata``
    and positional ``run(gridX, gridY, gridZ, stream, function, metadata,
    launch_metadata, enter_hook, exit_hook, *args)`` (:func:`_usable` checks
    those on the first compiled kernel), the launch hooks, PyTorch's
    ``_cuda_getCurrentRawStream``, and restates the JIT's specialisation
    (:func:`_specialization`). ``version`` stands for ``triton.__version__``.
    """
    version = triton.__version__ if version is None else version
    parsed = _triton_version(version)
    low, high = TESTED_TRITON
    if parsed is None or not low <= parsed < high:
        return (f"triton {version} is outside the tested range "
                f"{low[0]}.{low[1]} <= version < {high[0]}.{high[1]}")
    if torch.version.hip is not None:
        # Triton's AMD backend also specialises pointers on their buffer's size (buffer ops).
        return "ROCm: the AMD backend specialises pointers on more than the key restates"
    if portable():
        return f"{PORTABLE_ENV}=1: the portable path"
    if not hasattr(torch._C, "_cuda_getCurrentRawStream"):
        return "torch._C._cuda_getCurrentRawStream is missing (PyTorch without CUDA)"
    try:
        from triton.compiler import CompiledKernel
        from triton.runtime.jit import JITFunction

        hooks = _launch_hooks()
    except ImportError as err:
        return f"a Triton module the fast path uses is missing: {err}"
    for owner, what, name in ((CompiledKernel, "triton.compiler.CompiledKernel", "_init_handles"),
                              (CompiledKernel, "triton.compiler.CompiledKernel", "launch_metadata"),
                              (JITFunction, "triton.runtime.jit.JITFunction", "warmup"),
                              (hooks, "the launch hooks' home", "launch_enter_hook"),
                              (hooks, "the launch hooks' home", "launch_exit_hook")):
        if not hasattr(owner, name):
            return f"{what}.{name} is missing"
    return None


#: Why the fast path is off (``None``: it is on, outside the interpreter); checked once, at import.
_FAST_PATH_PROBLEM: Optional[str] = _check_fast_path()
#: The launch hooks' home (``None`` where the fast path is off).
_HOOKS = _launch_hooks() if _FAST_PATH_PROBLEM is None else None
#: The run() signature each launcher class was checked for: True when it is the one the fast path calls.
_LAUNCHER_OK: Dict[type, bool] = {}


#: The raw stream and allocator hooks (CUDA builds of PyTorch; ``None`` on the portable path).
_RAW_STREAM = None if portable() else getattr(torch._C, "_cuda_getCurrentRawStream", None)
_RAW_ALLOC = None if portable() else getattr(torch._C, "_cuda_cudaCachingAllocator_raw_alloc", None)
_RAW_DELETE = None if portable() else getattr(torch._C, "_cuda_cudaCachingAllocator_raw_delete", None)


def current_stream(index: int) -> int:
    """The raw handle of CUDA device ``index``'s current stream."""
    if _RAW_STREAM is not None:
        return _RAW_STREAM(index)
    return torch.cuda.current_stream(index).cuda_stream


def alloc_raw(nbytes: int, index: int, stream: int) -> int:
    """``nbytes`` of device ``index`` from PyTorch's caching allocator, for use on ``stream``: an address
    (no tensor), given back with :func:`free_raw` once the launches that use it are queued."""
    if _RAW_ALLOC is not None and torch.cuda.current_device() == index:
        return _RAW_ALLOC(nbytes, stream)
    return torch.cuda.caching_allocator_alloc(nbytes, index, stream)


def free_raw(address: int) -> None:
    """Give a block from :func:`alloc_raw` back to the caching allocator."""
    if _RAW_DELETE is not None:
        _RAW_DELETE(address)
    else:
        torch.cuda.caching_allocator_delete(address)


def environ_reader(name: str) -> Callable[[], Optional[str]]:
    """A function that reads ``os.environ.get(name)`` as it is set when called: from the bytes-keyed dict
    behind ``os.environ`` on POSIX CPython (one lookup, where ``os.environ.get`` makes four Python calls),
    which ``os.environ``'s own updates keep current; elsewhere through ``os.environ.get``."""
    data = getattr(os.environ, "_data", None)
    if os.name != "posix" or not isinstance(data, dict):
        return lambda: os.environ.get(name)
    key, decode = os.environ.encodekey(name), os.environ.decodevalue

    def read() -> Optional[str]:
        raw = data.get(key)
        return None if raw is None else decode(raw)

    return read


def fast_path_problem() -> Optional[str]:
    """Why kernels take the public JIT path here, or ``None`` when they are launched directly."""
    if interpreting():
        return "the Triton interpreter (TRITON_INTERPRET=1)"
    return _FAST_PATH_PROBLEM


def fast_path_available() -> bool:
    """True when compiled kernels are launched directly (CUDA, a tested Triton, outside the interpreter)."""
    return _FAST_PATH_PROBLEM is None and not interpreting()


def _run_signature_ok(run) -> bool:
    """Whether ``run`` (a compiled kernel's launcher) takes ``(gridX, gridY, gridZ, stream, function,
    ...)`` positionally: up to 3.6 the rest is ``*args``, from 3.7 named up to the hooks, then ``*args``."""
    import inspect

    try:
        params = list(inspect.signature(run).parameters.values())
    except (TypeError, ValueError):
        return False
    names = [p.name for p in params]
    return (names[:5] == ["gridX", "gridY", "gridZ", "stream", "function"]
            and params[-1].kind is inspect.Parameter.VAR_POSITIONAL
            and names[5:-1] in ([], ["kernel_metadata", "launch_metadata", "launch_enter_hook", "launch_exit_hook"]))


def _usable(kernel) -> bool:
    """Whether a compiled (and loaded) kernel has what :meth:`Launcher._run` calls (once per launcher class
    for the signature)."""
    run = getattr(kernel, "run", None)
    if run is None or not (hasattr(kernel, "function") and hasattr(kernel, "packed_metadata")):
        return False
    ok = _LAUNCHER_OK.get(type(run))
    if ok is None:
        ok = _LAUNCHER_OK[type(run)] = _run_signature_ok(run)
    return ok


def _specialization(args: Sequence) -> tuple:
    """What the JIT specialises a kernel on, per argument.

    Tensors: dtype and 16-byte alignment. Integers: whether they are 1 or a
    multiple of 16, and their type (i32 when they fit 32 bits, u64 in [2**63, 2**64),
    else i64). Bools, floats and ``None`` (each one type), other objects by
    type and value. Equal keys mean equal specialisations (tests/test_launch_key.py
    checks this against Triton's own rules); for ``do_not_specialize`` arguments
    the key is finer than Triton's, which is safe.
    """
    key = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((a.dtype, a.data_ptr() & 15 == 0))
        elif isinstance(a, bool):  # before int: bool is an int, and Triton types it u1 (3.3: i1)
            key.append(bool)
        elif isinstance(a, int):
            key.append((a & 15 == 0, a == 1, -_I32 <= a < _I32, _U64 <= a < 2 * _U64))
        elif isinstance(a, float):
            key.append(float)
        elif a is None:
            key.append(None)
        else:
            key.append((type(a), a))
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

        GPU only: the interpreter compiles nothing. A compiled kernel that lacks
        what the direct launch calls turns this launcher to the public path.
        """
        key = _specialization(args)
        kernel = self._compiled.get(key)
        if kernel is None:
            kernel = self.fn.warmup(*args, grid=grid, **self.constexprs, **self.options)
            kernel._init_handles()  # load the module: registers, launcher
            if not _usable(kernel):
                self._fast = False
            self._compiled[key] = kernel
        return kernel

    def spills(self, args: Sequence, grid) -> bool:
        """Whether the kernel compiled for ``args`` spills registers to local memory
        (compiling it if needed); ``False`` off the fast path (nothing is compiled there)."""
        return self._fast and self.compiled(args, grid).n_spills > 0

    def __call__(self, grid: Tuple[int, int, int], args: Sequence, stream=None, key=None) -> None:
        """Launch on the current CUDA stream (or ``stream``, a raw handle; the public
        path launches on the current stream).

        ``key``: optional, hashable, standing for :func:`_specialization` of
        ``args`` (the caller guarantees equal keys mean equal specialisations).
        """
        if self._fast:
            kernel = self._by_key.get(key) if key is not None else None
            if kernel is None:
                kernel = self._compiled.get(_specialization(args))
                if kernel is None:
                    kernel = self.compiled(args, grid)
                if self._fast and key is not None:
                    self._by_key[key] = kernel
            if self._fast:
                self._run(kernel, grid, args, stream)
                return
        self.fn[grid](*args, **self.constexprs, **self.options)

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
            stream = current_stream(torch.cuda.current_device())
        enter, leave = _live_hook(_HOOKS.launch_enter_hook), _live_hook(_HOOKS.launch_exit_hook)
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
