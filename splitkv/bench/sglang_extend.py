"""SGLang's own Triton ``extend_attention_fwd``, loaded from its released wheel without importing SGLang.

SGLang serves the speculative-decoding verify step of its Triton attention
backend with ``extend_attention_fwd``
(``sglang/srt/layers/attention/triton_ops/extend_attention.py``), the kernel
:func:`splitkv.extend_attention_fwd` follows. It takes splitkv's arguments in
splitkv's order and reads the same token pool, so no layout conversion is
needed to compare the two.

Installing the ``sglang`` package would pull in a serving stack (and pin its
own torch); the kernel needs none of it. :func:`load_extend` therefore reads
two files out of the wheel (or out of an installed SGLang, without importing
it): ``extend_attention.py`` and the ``prefill_attention.py`` it imports. Their
only other SGLang import is ``sglang.srt.utils.is_cuda`` / ``is_hip``, which
is answered by a stand-in module (CUDA: a CUDA build of torch with a device;
HIP: a ROCm build). The files are written to a folder of their own under the
temporary directory and imported as private modules; ``sys.modules`` is left
as it was, apart from those private names.

Where the wheel comes from (first found wins): the ``SPLITKV_SGLANG_WHEEL``
environment variable (a ``.whl`` path), ``sglang-*.whl`` in ``.whl/`` of the
current directory or of this checkout, an installed ``sglang`` distribution.
Fetch the wheel with::

    python -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl sglang==0.5.10.post1
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import sys
import tempfile
import types
import zipfile
import zlib
from typing import Callable, Dict, List, Optional, Tuple

# The SGLang release the benchmark reads its kernel from: the one the integration module was written against.
from ..integrations.sglang import SGLANG_VERSION

__all__ = [
    "SGLANG_VERSION",
    "SglangNotFound",
    "find_sources",
    "install_hint",
    "load_extend",
]

#: Where the two kernel files live inside the package.
_PACKAGE_DIR = "sglang/srt/layers/attention/triton_ops"
_FILES = ("prefill_attention.py", "extend_attention.py")
#: The absolute module names ``extend_attention.py`` imports.
_UTILS = "sglang.srt.utils"
_PREFILL = "sglang.srt.layers.attention.triton_ops.prefill_attention"
#: The private names the two files are imported under.
_PRIVATE = {"prefill_attention.py": "splitkv_sglang_prefill_attention",
            "extend_attention.py": "splitkv_sglang_extend_attention"}

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class SglangNotFound(ImportError):
    """No SGLang wheel or installation to read ``extend_attention_fwd`` from."""


def install_hint() -> str:
    """The one command that makes the SGLang peer available."""
    return (f"python -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl "
            f"sglang=={SGLANG_VERSION}")


def _wheel_candidates(search: Optional[List[str]]) -> List[str]:
    env = os.environ.get("SPLITKV_SGLANG_WHEEL")
    if env:
        return [env]
    dirs = search if search is not None else [os.path.join(os.getcwd(), ".whl"), os.path.join(_REPO_ROOT, ".whl")]
    found: List[str] = []
    for d in dirs:
        found += sorted(glob.glob(os.path.join(d, "sglang-*.whl")), reverse=True)
    return list(dict.fromkeys(found))


def _version_of_wheel(path: str) -> str:
    m = re.match(r"sglang-([^-]+)-", os.path.basename(path))
    return m.group(1) if m else "unknown"


def find_sources(search: Optional[List[str]] = None) -> Tuple[Dict[str, str], dict]:
    """The two kernel files' text and where they came from.

    Args:
        search: folders to look for ``sglang-*.whl`` in (default: ``.whl/`` of
            the current directory and of this checkout); the
            ``SPLITKV_SGLANG_WHEEL`` variable overrides it.

    Returns:
        ``({file name: source}, {"version", "source"})``.

    Raises:
        SglangNotFound: with the command that fetches the wheel.
    """
    for path in _wheel_candidates(search):
        if not os.path.isfile(path):
            continue
        with zipfile.ZipFile(path) as z:
            names = set(z.namelist())
            if all(f"{_PACKAGE_DIR}/{f}" in names for f in _FILES):
                texts = {f: z.read(f"{_PACKAGE_DIR}/{f}").decode() for f in _FILES}
                return texts, {"version": _version_of_wheel(path), "source": os.path.abspath(path)}
    spec = importlib.util.find_spec("sglang")  # locates the package, runs none of it
    if spec is not None and spec.submodule_search_locations:
        root = os.path.join(list(spec.submodule_search_locations)[0], "srt", "layers", "attention", "triton_ops")
        if all(os.path.isfile(os.path.join(root, f)) for f in _FILES):
            try:
                from importlib.metadata import version

                ver = version("sglang")
            except Exception:
                ver = "unknown"
            texts = {}
            for f in _FILES:
                with open(os.path.join(root, f)) as fh:
                    texts[f] = fh.read()
            return texts, {"version": ver, "source": root}
    raise SglangNotFound(f"SGLang's extend_attention_fwd not found: no sglang wheel in .whl/ and no sglang "
                         f"installed (fetch it: {install_hint()})")


def _utils_stand_in() -> types.ModuleType:
    """``sglang.srt.utils`` reduced to the two questions the kernel files ask."""
    import torch

    mod = types.ModuleType(_UTILS)
    mod.is_cuda = lambda: bool(torch.version.cuda) and torch.cuda.is_available()
    mod.is_hip = lambda: torch.version.hip is not None
    return mod


def _import_file(name: str, path: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # Triton reads a kernel's module while compiling it
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return mod


_LOADED: Dict[str, Tuple[Callable, dict]] = {}


def load_extend(search: Optional[List[str]] = None) -> Tuple[Callable, dict]:
    """SGLang's ``extend_attention_fwd`` and ``{"version", "source", "folder"}`` (loaded once per source).

    Raises:
        SglangNotFound: no wheel or installation (the message says how to fetch one).
    """
    texts, info = find_sources(search)
    key = info["source"]
    if key in _LOADED:
        return _LOADED[key]
    folder = os.path.join(tempfile.gettempdir(), f"splitkv-sglang-{info['version']}-{zlib.crc32(key.encode()):08x}")
    os.makedirs(folder, exist_ok=True)
    for f, text in texts.items():
        path = os.path.join(folder, f)
        if not os.path.isfile(path) or open(path).read() != text:
            with open(path, "w") as fh:
                fh.write(text)
    saved = {n: sys.modules.get(n) for n in (_UTILS, _PREFILL)}
    try:
        sys.modules[_UTILS] = _utils_stand_in()
        prefill = _import_file(_PRIVATE["prefill_attention.py"], os.path.join(folder, "prefill_attention.py"))
        sys.modules[_PREFILL] = prefill
        extend = _import_file(_PRIVATE["extend_attention.py"], os.path.join(folder, "extend_attention.py"))
    finally:
        for n, mod in saved.items():
            if mod is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = mod
    result = (extend.extend_attention_fwd, dict(info, folder=folder))
    _LOADED[key] = result
    return result
