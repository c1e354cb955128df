"""What every notebook shares: setup, figure saving, the float64 reference pieces and the error budgets.

A notebook starts with::

    from splitkv.teaching.lessons import DEVICE, attend, merge, save_figure, TOLERANCE

``attend`` and ``merge`` are the two float64 building blocks the lessons
derive (notebook 02): attention of a block of queries over a block of keys,
as an *attention state* ``(o, lse)``, and the exact merge of states over
disjoint key sets. The error budgets are the test suite's
(:data:`splitkv.testing.TOLERANCE`), so a notebook and the tests judge a
kernel by the same numbers.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Optional, Sequence, Tuple

import torch

import splitkv  # sets TRITON_INTERPRET=1 when there is no CUDA device
from splitkv.testing import ROW_TOLERANCE, TOLERANCE

__all__ = ["DEVICE", "FIGURES", "H200_L2_BYTES", "l2_bytes", "TOLERANCE", "ROW_TOLERANCE", "attend", "merge",
           "save_figure", "banner", "show_source", "ptx"]

#: Where the notebooks' kernels run: the GPU if there is one, else the Triton interpreter on the CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

#: The H200's L2 cache in bytes, for CPU runs. Source: NVIDIA, "NVIDIA Hopper Architecture In-Depth"
#: (50 MB L2 on H100 SXM5; the H200 has the same GH100 configuration, 132 SMs). Taken here as 50 MiB.
H200_L2_BYTES = 50 * 2**20


def l2_bytes() -> int:
    """The L2 cache of the GPU the notebooks run on, or :data:`H200_L2_BYTES` on a CPU."""
    if DEVICE == "cuda":
        return torch.cuda.get_device_properties(0).L2_cache_size
    return H200_L2_BYTES

# The interpreter evaluates masked-off lanes too (0/0 in padding rows); the kernels never
# use those values, so numpy's warning about them is noise.
warnings.filterwarnings("ignore", message="invalid value encountered", category=RuntimeWarning)


def _repo_root() -> Path:
    """The checkout holding splitkv/ (notebooks run from notebooks/ or the root)."""
    for d in (Path.cwd(), *Path.cwd().parents):
        if (d / "splitkv" / "__init__.py").exists() and (d / "pyproject.toml").exists():
            return d
    return Path(splitkv.__file__).resolve().parent.parent


#: The repository's figures/ folder, where the notebooks save their plots.
FIGURES = _repo_root() / "figures"


def save_figure(fig, notebook: str, name: str) -> str:
    """Save ``fig`` as ``figures/<notebook>_<name>.png`` (``_gpu`` suffix on a GPU run); return the file name."""
    FIGURES.mkdir(exist_ok=True)
    path = FIGURES / f"{notebook}_{name}{'_gpu' if DEVICE == 'cuda' else ''}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path.name


def banner() -> str:
    """One line naming the device and library versions (differs between machines: mark its cell)."""
    import triton

    return f"device: {DEVICE}, torch {torch.__version__}, triton {triton.__version__}"


def show_source(obj, start: str, stop: Optional[str] = None) -> str:
    """The lines of ``obj``'s source from the first holding ``start`` to the next holding ``stop``.

    ``obj`` is a function, a ``@triton.jit`` kernel or a module; without
    ``stop``, just the ``start`` line. Lines are picked by text, never by
    number, so the excerpt follows the code as it is edited; a marker that
    is gone raises ``ValueError``. The excerpt is dedented.
    """
    import inspect
    import textwrap

    lines = inspect.getsource(getattr(obj, "fn", obj)).splitlines()
    first = next((i for i, line in enumerate(lines) if start in line), None)
    if first is None:
        raise ValueError(f"{start!r} is not in the source of {getattr(obj, '__name__', obj)}")
    last = first if stop is None else next((i for i in range(first, len(lines)) if stop in lines[i]), None)
    if last is None:
        raise ValueError(f"{stop!r} does not follow {start!r} in the source of {getattr(obj, '__name__', obj)}")
    return textwrap.dedent("\n".join(lines[first:last + 1]))


def ptx(fn, signature: dict, arch: int = 90) -> str:
    """The PTX Triton emits for the plain function ``fn`` (a kernel body) on an sm_``arch`` GPU.

    Compiling needs no GPU: Triton lowers the code with its own LLVM, so a
    CPU-only machine can read what the GPU would run. ``signature`` maps each
    argument to a Triton type (``{"x_ptr": "*fp32"}``).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Triton's notice about its default floating-point fusion
        src = triton.compiler.ASTSource(fn=JITFunction(fn), signature=signature, constexprs={})
        return triton.compile(src, target=GPUTarget("cuda", arch, 32)).asm["ptx"]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           visible: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The attention state ``(o, lse)`` of rows ``q`` over keys ``k`` and values ``v``, in float64.

    ``q [M, D]`` (already scaled), ``k [N, D]``, ``v [N, Dv]``; ``visible [M, N]``
    masks the scores. ``lse`` is the natural-log log-sum-exp of each row's
    visible scores; a row that sees no key gets ``o = 0`` and ``lse = -inf``.
    """
    s = q.double() @ k.double().T
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[:, None])
    return p @ v.double(), lse


def merge(states: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> Tuple[torch.Tensor, torch.Tensor]:
    """The exact merge of attention states over disjoint key sets: ``(o, lse)``.

    ``lse = log sum_i exp(lse_i)`` and ``o = sum_i exp(lse_i - lse) o_i``. A
    state over no key (``lse_i = -inf``) weighs 0 whatever its ``o_i``; if all
    are empty the result is ``(0, -inf)``.
    """
    o = torch.stack([x for x, _ in states])
    lse = torch.stack([y for _, y in states])
    top = lse.max(dim=0).values
    w = torch.exp(lse - torch.where(torch.isinf(top), 0.0, top))
    den = w.sum(0)
    merged = torch.where(w[..., None] > 0, w[..., None] * o, 0.0).sum(0)
    out = merged / torch.where(den > 0, den, 1.0)[..., None]
    return out, torch.where(den > 0, top + torch.log(torch.where(den > 0, den, 1.0)), float("-inf"))
