"""The Gluon MLA kernel compiles for sm_90 without a GPU (:func:`splitkv.gluon_mla.compile_report`).

Gluon's API changes between Triton releases, and the kernel never runs on a CPU (Gluon has no
interpreter path): this is what shows an API break without a GPU. Each Triton the kernel is written
for is checked where it is installed: the one in this environment, and Triton 3.6 (the H200's)
installed aside in ``.venv/triton36`` by ``make triton36`` (or the directory ``SPLITKV_TRITON36``
names). Each compile must fit sm_90's shared memory, spill nothing, and compute the scores once:
the score ``wgmma`` is ``BLOCK_N / 2`` wide (each warpgroup takes half the key columns) and the
value ``wgmma`` 256 (half the value columns).
"""

import os

import pytest
import triton

from splitkv.gluon_mla import COMPILE_TRITON, DEFAULT_TILE, TILES, compile_report
from splitkv.launch import _triton_version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRITON36 = os.environ.get("SPLITKV_TRITON36") or os.path.join(ROOT, ".venv", "triton36")
CONFIGS = [dict(num_q_heads=128, tile=t) for t in TILES] + [dict(num_q_heads=16, tile=DEFAULT_TILE)]


def check(reports, version):
    assert len(reports) == len(CONFIGS)
    for report, config in zip(reports, CONFIGS):
        block_n = config["tile"][0]
        assert report["triton"].startswith(version), report
        assert report["fits"], report
        assert report["spill_bytes"] in (0, None), report
        # Per attend step (prefix and draft block: two in the code): 576 / 16 score instructions and
        # BLOCK_N / 16 value instructions per warpgroup.
        assert report["wgmma"] == {f"m64n{block_n // 2}k16": 2 * 36, "m64n256k16": 2 * block_n // 16}, report


@pytest.mark.skipif(_triton_version(triton.__version__) not in COMPILE_TRITON,
                    reason=f"triton {triton.__version__}: the kernel is written for "
                           + ", ".join(f"{a}.{b}" for a, b in COMPILE_TRITON))
def test_compiles_with_this_triton():
    check(compile_report(None, CONFIGS), triton.__version__)


@pytest.mark.skipif(not os.path.isdir(os.path.join(TRITON36, "triton")),
                    reason=f"no Triton 3.6 in {TRITON36} (make triton36 installs it there)")
def test_compiles_with_triton_3_6():
    check(compile_report(TRITON36, CONFIGS), "3.6.")
