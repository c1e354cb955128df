"""The direct launcher: its cache key, its version gate and the public-path fallback.

The key against Triton's own specialisation over many arguments: test_launch_key.py.
"""

import types

import pytest
import torch
import triton
import triton.language as tl

from conftest import gpu
from splitkv import launch
from splitkv.launch import Launcher, _specialization, alignment_bits

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


@triton.jit
def _add_one(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(Y + offs, tl.load(X + offs, mask=mask) + 1, mask=mask)


class _Spy:
    """A kernel stand-in that records the public launches (``fn[grid]``) and forwards them."""

    def __init__(self, fn):
        self.fn, self.grids = fn, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.fn[grid]

    def warmup(self, *args, **kwargs):
        return self.fn.warmup(*args, **kwargs)


def _no_fast_path(*args, **kwargs):
    raise AssertionError("the direct launch was used")


def test_key_follows_dtype_alignment_and_integer_specialisation():
    a = torch.zeros(64, dtype=torch.float16)
    base = _specialization((a, 32, 7, 1.5))
    assert _specialization((torch.zeros(64, dtype=torch.float16), 48, 9, 2.5)) == base  # same classes
    assert _specialization((a.to(torch.float32), 32, 7, 1.5)) != base  # dtype
    assert _specialization((a[1:], 32, 7, 1.5)) != base  # a 2-byte offset breaks 16-byte alignment
    assert _specialization((a, 33, 7, 1.5)) != base  # no longer a multiple of 16
    assert _specialization((a, 32, 1, 1.5)) != base  # 1 is specialised
    assert _specialization((a, 32, 2**31, 1.5)) != base  # past 32 bits: an i64 argument
    assert _specialization((2**40,)) != _specialization((2**63,))  # i64 and u64
    assert _specialization((True,)) != _specialization((1,))  # a bool is no int to the JIT (u1)
    assert _specialization((False,)) != _specialization((0,))
    assert _specialization((None,)) != _specialization((0.5,))  # None is a constexpr, a float an fp32


def test_alignment_bits():
    a = torch.zeros(64, dtype=torch.float16)
    assert alignment_bits([a.data_ptr(), a[8:].data_ptr()]) == -1  # all on 16-byte boundaries
    assert alignment_bits([a.data_ptr(), a[1:].data_ptr(), a[8:].data_ptr()]) == 0b101  # which ones are
    assert alignment_bits([a[1:].data_ptr(), a[3:].data_ptr()]) == 0


# --- the version gate ------------------------------------------------------------


@pytest.fixture
def cuda_torch(monkeypatch):
    """PyTorch's raw-stream getter present (a CPU build lacks it), so that only what a test changes decides."""
    if torch.version.hip is not None:
        pytest.skip("ROCm: the fast path is off there whatever the version")
    if not hasattr(torch._C, "_cuda_getCurrentRawStream"):
        monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, raising=False)


@pytest.mark.parametrize("version", ["3.3.0", "3.4.1", "3.6.0", "3.7.1", "3.9.0", "3.6.0+git1a2b3c4", "3.8.0rc1"])
def test_gate_passes_tested_versions(cuda_torch, version):
    low, high = launch.TESTED_TRITON
    assert low <= launch._triton_version(version) < high
    assert launch._check_fast_path(version) is None


@pytest.mark.parametrize("version", ["3.2.0", "3.10.0", "4.0.0", "2.3.1", "", "nightly"])
def test_gate_refuses_other_versions(cuda_torch, version):
    problem = launch._check_fast_path(version)
    assert problem is not None and "outside the tested range" in problem


def test_gate_passes_the_installed_triton(cuda_torch):
    """The Triton the tests run with is in the tested range (CI installs what pyproject.toml allows)."""
    assert launch._check_fast_path() is None, launch._check_fast_path()


@pytest.mark.parametrize("missing", ["_init_handles", "launch_metadata"])
def test_gate_refuses_a_missing_compiled_kernel_internal(cuda_torch, monkeypatch, missing):
    from triton.compiler import CompiledKernel

    monkeypatch.delattr(CompiledKernel, missing)
    problem = launch._check_fast_path(triton.__version__)
    assert problem is not None and missing in problem


def test_gate_refuses_missing_launch_hooks(cuda_torch, monkeypatch):
    monkeypatch.setattr(launch, "_launch_hooks", lambda: types.SimpleNamespace(launch_exit_hook=None))
    problem = launch._check_fast_path(triton.__version__)
    assert problem is not None and "launch_enter_hook" in problem


def test_gate_refuses_torch_without_the_raw_stream(monkeypatch):
    monkeypatch.delattr(torch._C, "_cuda_getCurrentRawStream", raising=False)
    problem = launch._check_fast_path(triton.__version__)
    assert problem is not None


def test_fast_path_available_follows_the_gate_and_the_interpreter(monkeypatch):
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    monkeypatch.setattr(launch, "_FAST_PATH_PROBLEM", None)
    assert launch.fast_path_available() and launch.fast_path_problem() is None
    monkeypatch.setattr(launch, "_FAST_PATH_PROBLEM", launch._check_fast_path("3.10.0"))
    assert not launch.fast_path_available()
    assert "3.10.0" in launch.fast_path_problem()
    monkeypatch.setattr(launch, "_FAST_PATH_PROBLEM", None)
    monkeypatch.setattr(launch, "interpreting", lambda: True)
    assert not launch.fast_path_available() and "interpreter" in launch.fast_path_problem()


def test_interpreter_takes_the_public_path():
    if launch.interpreting():
        assert not launch.fast_path_available()


def _launch_and_check(launcher, n=40):
    x = torch.arange(n, dtype=torch.float32, device=DEVICE)
    y = torch.zeros_like(x)
    launcher((triton.cdiv(n, 16), 1, 1), (x, y, n))
    torch.testing.assert_close(y, x + 1)


@pytest.mark.parametrize("version", ["3.2.0", "3.10.0"])
def test_launcher_outside_the_range_launches_through_the_jit(monkeypatch, version):
    """Outside the tested range a Launcher never touches the internals: every call is ``fn[grid](...)``."""
    monkeypatch.setattr(launch, "interpreting", lambda: False)  # only the version decides
    monkeypatch.setattr(launch, "_FAST_PATH_PROBLEM", launch._check_fast_path(version))
    monkeypatch.setattr(Launcher, "compiled", _no_fast_path)
    monkeypatch.setattr(Launcher, "_run", _no_fast_path)
    spy = _Spy(_add_one)
    launcher = Launcher(spy, {"BLOCK": 16}, {"num_warps": 1})
    for _ in range(2):
        _launch_and_check(launcher)
    assert spy.grids == [(3, 1, 1)] * 2
    assert not launcher.ready(None) and not launcher.spills((), (1, 1, 1))
    assert launcher.run_ptrs(("key",), (1, 1, 1), (), 0) is False  # nothing launched: the caller goes to __call__


def test_launcher_falls_back_when_the_compiled_kernel_lacks_an_internal(monkeypatch):
    """A compiled kernel without what the direct launch calls (here ``packed_metadata``) turns the
    launcher to the public path for good."""
    monkeypatch.setattr(launch, "fast_path_available", lambda: True)
    monkeypatch.setattr(Launcher, "_run", _no_fast_path)

    class Compiled:  # what warmup returns, less packed_metadata
        function = 0
        n_spills = 0

        def _init_handles(self):
            pass

        def run(self, gridX, gridY, gridZ, stream, function, *args):
            raise AssertionError("launched directly")

    class Fn(_Spy):
        def warmup(self, *args, grid, **kwargs):
            self.warmed = True
            return Compiled()

    spy = Fn(_add_one)
    launcher = Launcher(spy, {"BLOCK": 16}, {"num_warps": 1})
    assert launcher._fast
    _launch_and_check(launcher)
    assert spy.warmed and not launcher._fast and spy.grids == [(3, 1, 1)]
    _launch_and_check(launcher)
    assert spy.grids == [(3, 1, 1)] * 2


def test_launcher_signature_check():
    ok = launch._run_signature_ok
    assert ok(lambda gridX, gridY, gridZ, stream, function, *args: None)  # Triton <= 3.6
    assert ok(lambda gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata, launch_enter_hook,
              launch_exit_hook, *args: None)  # >= 3.7
    assert not ok(lambda gridX, gridY, gridZ, stream, *args: None)
    assert not ok(lambda gridX, gridY, gridZ, stream, function, kernel_metadata, *args: None)
    assert not ok(lambda gridX, gridY, gridZ, stream, function, launch_metadata: None)


def test_installed_cuda_launcher_has_the_positional_signature():
    """The installed Triton's CUDA launcher takes what the direct launch passes (read without a GPU)."""
    try:
        from triton.backends.nvidia.driver import CudaLauncher
    except ImportError as err:  # pragma: no cover - a Triton without the NVIDIA backend
        pytest.skip(f"no NVIDIA backend in this Triton: {err}")
    assert launch._run_signature_ok(object.__new__(CudaLauncher))


# --- the direct launch itself (GPU) ---------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or not launch.fast_path_available(), reason="needs CUDA and the fast path")
def test_direct_launch_matches_and_keys_on_alignment():
    launcher = Launcher(_add_one, {"BLOCK": 16}, {"num_warps": 1})
    x = torch.arange(64, dtype=torch.float32, device="cuda")
    for xs, n in ((x, 40), (x[1:], 40), (x, 48), (x[1:], 32)):
        y = torch.zeros_like(xs)
        launcher((triton.cdiv(n, 16), 1, 1), (xs, y, n))
        torch.testing.assert_close(y[:n], xs[:n] + 1)
        assert not y[n:].any()
    # Aligned / misaligned X, n a multiple of 16 or not: four specialisations, four compiled kernels.
    assert len(launcher._compiled) == 4
    kernels = {id(k) for k in launcher._compiled.values()}
    assert len(kernels) == 4
    # A caller key, then the addresses.
    y = torch.zeros_like(x)
    launcher((3, 1, 1), (x, y, 40), key="k")
    assert launcher.ready("k")
    y.zero_()
    assert launcher.run_ptrs("k", (3, 1, 1), (x.data_ptr(), y.data_ptr(), 40),
                             torch.cuda.current_stream().cuda_stream)
    torch.testing.assert_close(y[:40], x[:40] + 1)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or not launch.fast_path_available(), reason="needs CUDA and the fast path")
def test_direct_launch_calls_launch_hooks():
    hooks = launch._launch_hooks()
    seen = []

    def enter(metadata):
        seen.append(metadata.get()["name"] if hasattr(metadata, "get") else metadata["name"])

    chain = hooks.launch_enter_hook
    if hasattr(chain, "add"):  # Triton >= 3.5: a chain of hooks
        chain.add(enter)
        undo = lambda: chain.remove(enter)  # noqa: E731
    else:
        hooks.launch_enter_hook = enter
        undo = lambda: setattr(hooks, "launch_enter_hook", chain)  # noqa: E731
    try:
        _launch_and_check(Launcher(_add_one, {"BLOCK": 16}, {"num_warps": 1}))
    finally:
        undo()
    assert seen and "_add_one" in seen[-1]


# --- the portable path (ROCm builds, SPLITKV_PORTABLE=1) ----------------------------


@pytest.fixture
def hopper_like(monkeypatch):
    """A CUDA device of compute capability 9.x outside the interpreter, as far as supports_pdl can tell."""
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 4))
    monkeypatch.delenv(launch.PORTABLE_ENV, raising=False)
    return torch.device("cuda", 0)


def test_pdl_needs_nvidia_not_just_a_capability_of_9(hopper_like, monkeypatch):
    """A ROCm build reports an MI300 as capability 9.4: programmatic dependent launch is NVIDIA's only."""
    monkeypatch.setattr(torch.version, "hip", None)
    assert launch.supports_pdl(hopper_like)
    monkeypatch.setattr(torch.version, "hip", "6.2.0")
    assert not launch.supports_pdl(hopper_like) and launch.portable()
    assert "ROCm" in launch._check_fast_path(triton.__version__)


@pytest.mark.parametrize("value, on", [("1", True), ("yes", True), ("0", False), ("", False)])
def test_the_portable_switch_turns_off_pdl_and_the_fast_launcher(hopper_like, monkeypatch, value, on):
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setenv(launch.PORTABLE_ENV, value)
    assert launch.portable() is on
    assert launch.supports_pdl(hopper_like) is not on
    problem = launch._check_fast_path(triton.__version__)
    assert (problem is not None and "portable" in problem) if on else (problem is None or "portable" not in problem)


def test_no_pdl_off_cuda_or_under_the_interpreter(monkeypatch):
    assert not launch.supports_pdl(torch.device("cpu"))
    monkeypatch.setattr(launch, "interpreting", lambda: True)
    assert not launch.supports_pdl(torch.device("cuda", 0))


@gpu
@pytest.mark.gpu
def test_the_raw_stream_handle_is_the_public_one():
    """The private raw-stream getter and the public ``current_stream().cuda_stream`` agree, on the
    default stream and on a side stream."""
    if launch._RAW_STREAM is None:
        pytest.skip("no private raw-stream getter here: the public path is the only one")
    side = torch.cuda.Stream()
    for stream in (torch.cuda.current_stream(), side):
        with torch.cuda.stream(stream):
            assert launch._RAW_STREAM(torch.cuda.current_device()) == torch.cuda.current_stream().cuda_stream


@gpu
@pytest.mark.gpu
def test_raw_blocks_come_back_through_the_public_allocator(monkeypatch):
    """``alloc_raw``/``free_raw`` on the public path (``torch.cuda.caching_allocator_alloc``/``_delete``)."""
    monkeypatch.setattr(launch, "_RAW_ALLOC", None)
    monkeypatch.setattr(launch, "_RAW_DELETE", None)
    index = torch.cuda.current_device()
    address = launch.alloc_raw(4096, index, launch.current_stream(index))
    assert address % 16 == 0
    launch.free_raw(address)
