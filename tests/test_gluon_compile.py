"""The Gluon MLA kernel compiles for sm_90 without a GPU (:func:`splitkv.gluon_mla.compile_report`).

Gluon's API changes between Triton releases, and the kernel never runs on a CPU (Gluon has no
interpreter path): this is what shows an API break without a GPU. Each Triton the kernel is written
for is checked where it is installed: the one in this environment, and Triton 3.6 (the H200's)
installed aside in ``.venv/triton36`` by ``make triton36`` (or the directory ``SPLITKV_TRITON36``
names). Each compile must fit sm_90's shared memory, spill nothing in the key loop (OVERLAP: next to
nothing), and compute the scores once:
the score ``wgmma`` is ``BLOCK_N / 2`` wide (each warpgroup takes half the key columns) and the
value ``wgmma`` 256 (half the value columns). The host side's answers without a GPU are checked at the end.
"""

import os

import pytest
import torch
import triton

from splitkv.bench import gluon_mla as gluon_bench
from splitkv.gluon_mla import (COMPILE_TRITON, DEFAULT_TILE, RAN_ON_TRITON, TILES, compile_report, decline_reason,
                               gluon_mla_verify, selection_reason, unavailable_reason)
from splitkv.launch import _triton_version
from splitkv.testing import make_problem

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRITON36 = os.environ.get("SPLITKV_TRITON36") or os.path.join(ROOT, ".venv", "triton36")
#: Every tile at 128 heads; 16 heads with pages of 64 and a tree mask; an fp8 cache in pages with a tree.
CONFIGS = [dict(num_q_heads=128, tile=t) for t in TILES] + [
    dict(num_q_heads=16, tile=t, page_size=64, tree=True) for t in (DEFAULT_TILE, (32, 4, True))] + [
    dict(num_q_heads=128, tile=(64, 2, False), page_size=64, tree=True, fp8=True)]
#: Spill stores outside the key loop (the draft block, the prologue) are tolerated up to this; inside it, none
#: without OVERLAP and at most OVERLAP_LOOP_SPILLS local-memory instructions with it (see docs/design.md).
SPILL_BYTES = 512
OVERLAP_LOOP_SPILLS = 8


def check(reports, version):
    assert len(reports) == len(CONFIGS)
    for report, config in zip(reports, CONFIGS):
        block_n, _, overlap = config["tile"]
        assert report["triton"].startswith(version), report
        assert report["fits"], report
        assert report["spill_bytes"] is None or report["spill_bytes"] <= SPILL_BYTES, report
        assert report.get("key_loop_spills") is None or report["key_loop_spills"] <= (
            OVERLAP_LOOP_SPILLS if overlap else 0), report
        # Per score tile 576 / 16 instructions and per P V BLOCK_N / 16, per warpgroup: in the code, the prefix
        # loop's and the draft block's (and with OVERLAP the first tile's scores, before the loop).
        assert report["wgmma"] == {f"m64n{block_n // 2}k16": (3 if overlap else 2) * 36,
                                   "m64n256k16": 2 * block_n // 16}, report


@pytest.mark.skipif(_triton_version(triton.__version__) not in COMPILE_TRITON,
                    reason=f"triton {triton.__version__}: the kernel is written for "
                           + ", ".join(f"{a}.{b}" for a, b in COMPILE_TRITON))
def test_compiles_with_this_triton():
    check(compile_report(None, CONFIGS), triton.__version__)


@pytest.mark.skipif(not os.path.isdir(os.path.join(TRITON36, "triton")),
                    reason=f"no Triton 3.6 in {TRITON36} (make triton36 installs it there)")
def test_compiles_with_triton_3_6():
    check(compile_report(TRITON36, CONFIGS), "3.6.")


# --- the host side without a GPU -------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
def test_unavailable_without_a_gpu():
    assert unavailable_reason() == selection_reason() == "no CUDA device"
    with pytest.raises(RuntimeError, match="no CUDA device"):
        gluon_mla_verify(*[torch.empty(0)] * 9, 4)


def test_never_selected_before_it_ran():
    assert RAN_ON_TRITON == () and selection_reason() is not None


def test_decline_reason():
    p = make_problem([40, 0], [4, 2], 16, 1, 576, 512, dtype=torch.bfloat16, seed=0)
    q, k, v, o, kb, vb = p.tensors(p.new_output())[:6]
    assert decline_reason(q, k, v, o, kb, vb, p.kv_indices) == "v_buffer must be k_buffer[..., :512]"
    kv = dict(v=k[..., :512], vb=kb[..., :512])
    assert decline_reason(q, k, kv["v"], o, kb, kv["vb"], p.kv_indices) is None
    assert "bf16" in decline_reason(q.half(), k, kv["v"], o, kb, kv["vb"], p.kv_indices)
    fp8 = kb.to(torch.float8_e4m3fn)
    assert decline_reason(q, k, kv["v"], o, fp8, fp8[..., :512], p.kv_indices) is None
    half = kb.half()
    assert "latent cache" in decline_reason(q, k, kv["v"], o, half, half[..., :512], p.kv_indices)
    assert "pool must be" in decline_reason(q, k, kv["v"], o, kb[:, None, None], kv["vb"], p.kv_indices)
    pages = kb[:40].view(5, 8, 1, 576)
    assert "kv_last_page_len" in decline_reason(q, k, kv["v"], o, pages, pages[..., :512], p.kv_indices)
    assert decline_reason(q, k, kv["v"], o, pages, pages[..., :512], p.kv_indices, kv_last_page_len=p.kv_indptr,
                          custom_mask=torch.ones(1, dtype=torch.bool)) is None
    assert "bool or uint8" in decline_reason(q, k, kv["v"], o, kb, kv["vb"], p.kv_indices, custom_mask=torch.ones(1))
    assert "sinks" in decline_reason(q, k, kv["v"], o, kb, kv["vb"], p.kv_indices, sinks=torch.ones(16))


def test_bench_verdict():
    row = dict(heads=128, batch=8, prefix=16384, impls={"tl": dict(us=100.0), "gluon 32x3": dict(speedup=1.31),
                                                        "gluon 64x2": dict(error="x")})
    assert gluon_bench.verdict(row).startswith("GO: best Gluon tile 1.31x")
    row["impls"]["gluon 32x3"]["speedup"] = 1.2
    assert gluon_bench.verdict(row).startswith("NO-GO")
