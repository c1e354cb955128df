"""The serving-engine peers of the benchmark, on the CPU: the registry, the skip messages, the layout
conversions into FlashInfer's paged cache, the correctness gate, the SGLang loader, the result writers."""

import importlib.util
import json
import math
import os
import sys

import pytest
import torch

from conftest import DEVICE

from splitkv.bench import cuda_peers, peers_sweep, run, sglang_extend
from splitkv.bench.cuda_peers import PEERS, CudaPeer
from splitkv.bench.peers_sweep import Row
from splitkv.paged import flat_pool, token_indices
from splitkv.testing import MODEL_SHAPES, HeadShape, make_problem, paged_problem, reference_for, tree_mask

# ---- Registry ----------------------------------------------------------------------------------------


def test_registry_and_groups():
    assert cuda_peers.resolve_peers("flashinfer,sglang") == list(PEERS)
    assert cuda_peers.resolve_peers("sglang") == ["sglang_extend"]
    assert cuda_peers.resolve_peers("flashinfer_xqa, sglang_extend") == ["sglang_extend", "flashinfer_xqa"]
    assert set(cuda_peers.resolve_peers("flashinfer")) == {n for n, p in PEERS.items() if p.library == "flashinfer"}
    with pytest.raises(ValueError, match="unknown peer 'flashattn'"):
        cuda_peers.resolve_peers("flashinfer,flashattn")
    for name, peer in PEERS.items():
        assert peer.name == name and peer.help and peer.library in ("flashinfer", "sglang")
        assert peer.gqa or peer.mla
        assert peer.paged == (peer.library == "flashinfer")  # FlashInfer reads its paged cache, SGLang the token pool
    assert cuda_peers.FLASHINFER_VERSION in cuda_peers.install_hint("flashinfer")
    assert sglang_extend.SGLANG_VERSION in cuda_peers.install_hint("sglang")


def test_rows():
    rows = peers_sweep.sweep_rows()
    assert len(rows) == len(set(rows)) == 145
    assert {r.model for r in rows} == {"llama3-8b", "qwen3-32b", "qwen3-next", "deepseek-v3"}
    assert {r.kv_dtype for r in rows} == {"bfloat16", "float8_e4m3fn"}
    assert {r.page_size for r in rows} == {16, 64}
    assert {(r.mask, r.drafts) for r in rows} == {("causal", 4), ("tree", 8)}
    assert {r.heads for r in rows if r.mla} == {16, 128}
    assert all(3 * r.pool_bytes() <= peers_sweep.MEMORY_BUDGET for r in rows)
    assert set(peers_sweep.QUICK_ROWS) <= set(rows) and len(peers_sweep.QUICK_ROWS) == 8
    # XQA's speculative mode with the tree's bit mask on both pools, and causal, among the quick rows
    quick_xqa = {(r.mask, r.kv_dtype) for r in peers_sweep.QUICK_ROWS
                 if not r.mla and peers_sweep.sweep_skip("flashinfer_xqa", r) is None}
    assert quick_xqa == {("causal", "bfloat16"), ("tree", "bfloat16"), ("tree", "float8_e4m3fn")}
    # the ThunderMLA comparison's shape: 16 heads, 4 drafts, 4 ragged requests
    thunder = [r for r in rows if r.lens]
    assert thunder == [peers_sweep.thunder_mla_row()] and thunder[0] in peers_sweep.QUICK_ROWS
    t = thunder[0]
    assert (t.model, t.heads, t.drafts, t.mask, t.batch, t.prefix) == ("deepseek-v3", 16, 4, "causal", 4, 45118)
    assert t.prefix_lens == [4641, 45118, 1730, 1696] and t.label() == "deepseek-v3 h16 bs4 4641/45118/1730/1696"
    assert [r.model for r in peers_sweep.sweep_rows(models=["qwen3-next"], prefixes=[65536])] == ["qwen3-next"] * 18


def test_sweep_leaves_xqa_to_its_page_size():
    rows = peers_sweep.sweep_rows(models=["llama3-8b"])
    with_xqa = [r for r in rows if peers_sweep.sweep_skip("flashinfer_xqa", r) is None]
    assert with_xqa and {r.page_size for r in with_xqa} == set(peers_sweep.XQA_ROW_PAGE_SIZES)
    assert all(peers_sweep.sweep_skip(n, r) is None for r in rows for n in PEERS if n != "flashinfer_xqa")
    assert "pages of 64" in peers_sweep.sweep_skip("flashinfer_xqa", Row("llama3-8b", 32, 1, 1024, 4, "causal",
                                                                         "bfloat16", 16))


def test_command_line_list_and_dispatch(capsys):
    assert run.main(["--peers", "flashinfer,sglang", "--quick", "--list"]) == 0
    out = capsys.readouterr().out
    assert "llama3-8b bs8 64k" in out and "fp8 p16 causal4" in out and "deepseek-v3 h128 bs8 4k" in out
    assert out.strip().endswith("8 rows") and "h16 bs4 4641/45118/1730/1696" in out
    assert peers_sweep.main(["--peers=all", "--models", "deepseek-v3", "--list"]) == 0
    assert capsys.readouterr().out.strip().endswith("19 rows")
    with pytest.raises(SystemExit):
        run.main(["--peers", "nope", "--list"])
    # Without --peers the benchmark's own parser is untouched.
    plan = run.plan_run(["--quick"], "NVIDIA H200")
    assert plan["impls"] == run.IMPLEMENTATIONS and plan["out"].endswith("benchmark_h200_quick.json")


def test_wheel_commands():
    cmds = peers_sweep.wheel_commands(".whl", python="python3")
    reqs = [c[-1] for c in cmds]
    assert reqs == [f"flashinfer-python=={cuda_peers.FLASHINFER_VERSION}",
                    f"apache-tvm-ffi=={cuda_peers.TVM_FFI_VERSION}", f"sglang=={sglang_extend.SGLANG_VERSION}"]
    for c in cmds:
        assert c[:4] == ["python3", "-m", "pip", "download"] and "--no-deps" in c and c[c.index("-d") + 1] == ".whl"
        assert c[c.index("--python-version") + 1] == "3.12" and "manylinux_2_28_x86_64" in c


# ---- Skip messages -----------------------------------------------------------------------------------


def _hide_sglang(monkeypatch, tmp_path):
    monkeypatch.setenv("SPLITKV_SGLANG_WHEEL", str(tmp_path / "absent.whl"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a))


def test_skip_messages_when_absent(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import flashinfer -> ImportError
    _hide_sglang(monkeypatch, tmp_path)
    for name, peer in PEERS.items():
        msg = cuda_peers.unavailable(name)
        assert msg.startswith(f"{name} skipped: ") and "\n" not in msg
        assert (".whl" in msg) and ("pip" in msg)
    assert "flashinfer_python" in cuda_peers.unavailable("flashinfer_fa2")
    assert "sglang==0.5.10.post1" in cuda_peers.unavailable("sglang_extend")
    assert cuda_peers.library_version("flashinfer") is None and cuda_peers.library_version("sglang") is None
    with pytest.raises(sglang_extend.SglangNotFound, match="pip download"):
        sglang_extend.load_extend(search=[str(tmp_path)])
    # A row records the skip with the same line, and runs no probe for it.
    row = Row("tiny", 4, 1, 20, 4, "causal", "float32", 16)
    rec = _run_row(monkeypatch, row, ["flashinfer_fa2", "sglang_extend"])
    assert rec["impls"]["flashinfer_fa2"] == {"skipped": cuda_peers.unavailable("flashinfer_fa2")}
    assert rec["impls"]["sglang_extend"] == {"skipped": cuda_peers.unavailable("sglang_extend")}


def test_skip_reasons_declared():
    p = make_problem([40], 4, 4, 2, 64, device=DEVICE, seed=0)
    mla = peers_sweep.draw_problem(Row("deepseek-v3", 16, 1, 20, 4, "causal", "bfloat16", 64), DEVICE)
    assert cuda_peers.is_mla(mla) and not cuda_peers.is_mla(p)
    assert cuda_peers.skip_reason("flashinfer_mla", p, 16) == "MLA only"
    assert cuda_peers.skip_reason("flashinfer_fa2", mla, 64) == "not an MLA kernel"
    assert cuda_peers.skip_reason("sglang_extend", mla, 64) is None
    if not torch.cuda.is_available():
        assert cuda_peers.skip_reason("flashinfer_xqa", p, 16) == "needs a CUDA GPU"


# ---- Layout conversions ------------------------------------------------------------------------------


def _expected_keys(p, k_drafts):
    """Each sequence's [prefix rows of the token pool | drafts as stored], concatenated."""
    kv, qo = p.kv_indptr.tolist(), p.qo_indptr.tolist()
    rows = []
    for b in range(p.batch_size):
        rows += [p.k_buffer[p.kv_indices[kv[b]:kv[b + 1]].long()], k_drafts[qo[b]:qo[b + 1]]]
    return torch.cat(rows)


def _token_view(fl, pages):
    """The paged cache read back through splitkv's own helpers (token_indices over flat_pool)."""
    tok_indptr, slots = token_indices(fl.kv_indptr, fl.kv_indices, fl.kv_last_page_len, fl.page_size)
    assert tok_indptr.tolist() == [0] + torch.cumsum(fl.seq_lens.long(), 0).tolist()
    return flat_pool(pages)[slots.long()]


def _same(a, b):
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("mask", ["causal", "tree"])
@pytest.mark.parametrize("fp8", [False, True], ids=["f32-pool", "fp8-pool"])
def test_token_pool_to_flashinfer_layout(page_size, mask, fp8):
    """Ragged prefixes (none, a partial page, exact pages, several pages) and ragged drafts."""
    p = make_problem([37, 0, 16, 5, 32], [4, 3, 8, 1, 4], 4, 2, 64, dtype=torch.float32, device=DEVICE,
                     mask=mask, seed=3)
    if fp8:
        p = peers_sweep.to_fp8(p)
    fl = cuda_peers.flashinfer_layout(p, page_size, seed=5)
    k_st, v_st = cuda_peers.drafts_as_stored(p)
    assert fl.k_pages.dtype == p.k_buffer.dtype and fl.k_drafts.dtype == p.k_buffer.dtype
    assert _same(_token_view(fl, fl.k_pages), _expected_keys(p, k_st))
    assert _same(_token_view(fl, fl.v_pages), _expected_keys(p.replace(k_buffer=p.v_buffer), v_st))
    lens = [n + m for n, m in zip(p.prefix_lens, p.extend_lens)]
    assert fl.seq_lens.tolist() == lens
    assert fl.kv_indptr.dtype == fl.kv_indices.dtype == fl.kv_last_page_len.dtype == torch.int32
    assert fl.kv_indices.unique().numel() == fl.kv_indices.numel()  # no page shared by two sequences
    # Every row nobody reads stays NaN (the paged problem's poison).
    flat = flat_pool(fl.k_pages).float()
    assert int(flat.isnan().all(-1).all(-1).sum()) == flat.shape[0] - sum(lens)
    # The prefix alone is still splitkv's paged problem of the same pages.
    assert fl.prefix.k_pages is fl.k_pages
    tok_indptr, slots = token_indices(fl.prefix.kv_indptr, fl.prefix.kv_indices, fl.prefix.kv_last_page_len,
                                      page_size)
    want = p.k_buffer[p.kv_indices.long()]
    assert _same(flat_pool(fl.k_pages)[slots.long()], want)
    # The page table: each sequence's pages in order, padded.
    table = fl.page_table()
    indptr = fl.kv_indptr.tolist()
    for b in range(p.batch_size):
        assert table[b, : indptr[b + 1] - indptr[b]].tolist() == fl.kv_indices[indptr[b]:indptr[b + 1]].tolist()
    # The oracle's input reads the drafts as stored.
    sp = fl.stored_problem()
    if fp8:
        assert torch.equal(sp.k_extend, k_st.float() * p.k_scale) and torch.equal(sp.v_extend, v_st.float() * p.v_scale)
        assert not torch.equal(sp.k_extend, p.k_extend)  # e4m3 rounding changed them
    else:
        assert sp is p


def test_paged_pool_to_flashinfer_layout_grows_the_pool():
    """A paged pool without spare pages: the drafts' pages are added to the pool."""
    p = make_problem([20, 31], 4, 4, 2, 32, dtype=torch.float32, device=DEVICE, seed=0)
    pp = paged_problem(p, 8, spare_pages=0)
    fl = cuda_peers.append_drafts(pp)
    assert fl.k_pages.shape[0] == pp.k_pages.shape[0] + 1  # 31 + 4 drafts need one more page of 8; 20 + 4 fit
    assert torch.equal(_token_view(fl, fl.k_pages), _expected_keys(p, p.k_extend))
    assert torch.equal(_token_view(fl, fl.v_pages), _expected_keys(p.replace(k_buffer=p.v_buffer), p.v_extend))
    assert fl.kv_last_page_len.tolist() == [8, 3]


def test_mla_layout_keeps_values_in_the_keys():
    row = Row("deepseek-v3", 16, 2, 40, 4, "causal", "bfloat16", 16)
    p = peers_sweep.draw_problem(row, DEVICE, dtype=torch.float32)
    assert p.v_buffer.data_ptr() == p.k_buffer.data_ptr() and p.v_head_dim == 512
    fl = cuda_peers.flashinfer_layout(p, 16)
    keys = _token_view(fl, fl.k_pages)
    assert torch.equal(keys, _expected_keys(p, p.k_extend))
    assert torch.equal(_token_view(fl, fl.v_pages), keys[..., :512])  # FlashInfer's ckv view = the values


def test_xqa_spec_mask():
    p = make_problem([9, 3, 0], 8, 4, 2, 32, device=DEVICE, mask="tree", seed=2)
    m = cuda_peers.xqa_spec_mask(p)
    assert m.dtype == torch.uint16 and tuple(m.shape) == (3, 8, 2)
    words = m.view(torch.int32)[..., 0].long() & 0xFFFFFFFF
    starts = p.mask_indptr.tolist()
    for b, n in enumerate(p.prefix_lens):
        vis = p.custom_mask[starts[b]: starts[b] + 8 * (n + 8)].view(8, n + 8)[:, n:].cpu()
        for i in range(8):
            assert [(int(words[b, i]) >> j) & 1 for j in range(8)] == vis[i].long().tolist()
    causal = cuda_peers.xqa_spec_mask(make_problem([5, 5], 4, device=DEVICE, seed=0)).view(torch.int32)[..., 0]
    assert causal.tolist() == [[1, 3, 7, 15]] * 2
    long_chain = make_problem([2], 40, device=DEVICE, seed=0)
    w = cuda_peers.xqa_spec_mask(long_chain).view(torch.int32).long() & 0xFFFFFFFF  # [1, 40, 2] 32-bit words
    assert w[0, 39].tolist() == [0xFFFFFFFF, 0xFF] and w[0, 31].tolist() == [0xFFFFFFFF, 0]
    assert torch.equal(tree_mask(list(range(-1, 39))), torch.tril(torch.ones(40, 40, dtype=torch.bool)))
    with pytest.raises(ValueError, match="same number of drafts"):
        cuda_peers.xqa_spec_mask(make_problem([5, 5], [4, 3], device=DEVICE, seed=0))


# ---- The correctness gate ----------------------------------------------------------------------------


class CountingTimer:
    """Counts what would be timed; each timing 'takes' 10 µs."""

    warmup_ms, rep_ms = 1.0, 1.0

    def __init__(self):
        self.timed = []

    def graph(self, fn):
        fn()
        self.timed.append(fn)
        return 10.0


def _oracle_peer(transform=lambda ref, p: ref, use_layout=True):
    def build(p, out, fl):
        ref = reference_for(fl.stored_problem() if (fl is not None and use_layout) else p)
        return lambda: out.copy_(transform(ref, p).to(out.dtype))
    return build


@pytest.fixture
def tiny_model(monkeypatch):
    monkeypatch.setitem(MODEL_SHAPES, "tiny", HeadShape("tiny", 4, 2, 64))


def _run_row(monkeypatch, row, impls, peers=(), timer=None, dtype=torch.float32):
    monkeypatch.setitem(MODEL_SHAPES, "tiny", HeadShape("tiny", 4, 2, 64))
    for peer in peers:
        monkeypatch.setitem(PEERS, peer.name, peer)
    p = peers_sweep.draw_problem(row, DEVICE, dtype=dtype)
    if row.kv_dtype.startswith("float8"):
        p = peers_sweep.to_fp8(p)
    return peers_sweep.run_row(row, p, impls, timer or CountingTimer(), 1e12, {})


def test_gate_refuses_a_wrong_peer_before_timing(monkeypatch):
    right = CudaPeer("fake_right", "fake", "the oracle itself", paged=True, build=_oracle_peer())
    wrong = CudaPeer("fake_wrong", "fake", "5 % off", build=_oracle_peer(lambda ref, p: ref * 1.05))
    nan = CudaPeer("fake_nan", "fake", "NaN", build=_oracle_peer(lambda ref, p: ref * float("nan")))
    timer = CountingTimer()
    row = Row("tiny", 4, 2, 40, 8, "tree", "float8_e4m3fn", 16)
    rec = _run_row(monkeypatch, row, ["fake_right", "fake_wrong", "fake_nan"], (right, wrong, nan), timer)
    imp = rec["impls"]
    assert imp["fake_right"]["graph"] == 10.0 and imp["fake_right"]["checked_against"] == "oracle"
    assert imp["fake_right"]["rel_err"] < 1e-6 and imp["fake_right"]["probe"]["ok"]
    for name in ("fake_wrong", "fake_nan"):
        assert "graph" not in imp[name] and imp[name]["refused"].startswith("probe off the oracle")
    assert len(timer.timed) == 1  # only the right peer was timed
    assert rec["case"] == "fp8 p16 tree8" and rec["kv_bytes"] == 2 * 40 * 2 * 128


def test_gate_catches_what_only_the_drafts_show(monkeypatch):
    """A peer that ignores the draft tree (causal instead) is within budget at a long prefix, where the drafts
    weigh nothing; the short probe refuses it."""
    def causal_instead(ref, p):
        return reference_for(p.replace(custom_mask=None, mask_indptr=None))

    blind = CudaPeer("fake_blind", "fake", "ignores the tree", build=_oracle_peer(causal_instead, use_layout=False))
    timer = CountingTimer()
    row = Row("tiny", 4, 1, 4096, 8, "tree", "float32", 16)
    monkeypatch.setitem(MODEL_SHAPES, "tiny", HeadShape("tiny", 4, 2, 64))
    p = peers_sweep.draw_problem(row, DEVICE, dtype=torch.float32)
    long_err = peers_sweep.check_output(causal_instead(None, p), reference_for(p), peers_sweep.budget("x", p))
    assert long_err["rel_err"] > 0  # it is wrong at the row too, only by little
    rec = _run_row(monkeypatch, row, ["fake_blind"], (blind,), timer)
    assert rec["impls"]["fake_blind"]["refused"].startswith("probe") and not timer.timed


def test_gate_falls_back_to_splitkv_where_the_oracle_does_not_fit(monkeypatch):
    monkeypatch.setattr(peers_sweep, "ORACLE_MAX_BYTES", 1)  # no row fits
    good = CudaPeer("fake_good", "fake", "the oracle", build=_oracle_peer(use_layout=False))
    bad = CudaPeer("fake_bad", "fake", "off", build=_oracle_peer(lambda ref, p: ref * 1.5, use_layout=False))
    rec = _run_row(monkeypatch, Row("tiny", 4, 1, 40, 4, "causal", "float32", 16), ["splitkv", "fake_good"],
                   (good, bad))
    assert rec["impls"]["splitkv"]["checked_against"] == "probe only"
    assert rec["impls"]["fake_good"]["checked_against"] == "splitkv" and rec["impls"]["fake_good"]["graph"]
    # Probes always use the oracle: a peer wrong everywhere never reaches the row.
    rec = _run_row(monkeypatch, Row("tiny", 4, 1, 40, 4, "causal", "float32", 16), ["splitkv", "fake_bad"], (bad,))
    assert rec["impls"]["fake_bad"]["refused"].startswith("probe")


@pytest.mark.parametrize("kv_dtype", ["float32", "float8_e4m3fn"])
def test_splitkv_entries_on_the_same_pages(monkeypatch, kv_dtype):
    """splitkv on the token pool and on FlashInfer's prefix pages, through the whole row (interpreter, float32)."""
    row = Row("tiny", 4, 2, 37, 4, "tree", kv_dtype, 16)
    monkeypatch.setitem(MODEL_SHAPES, "tiny", HeadShape("tiny", 4, 2, 64))
    p = peers_sweep.draw_problem(row, DEVICE, dtype=torch.float32)
    p = peers_sweep.to_fp8(p) if kv_dtype.startswith("float8") else p
    rec = peers_sweep.run_row(row, p, ["splitkv", "splitkv_paged"], CountingTimer(), 1e12, {}, gather_floor=True)
    assert rec["gather_floor_us"] == 10.0 and rec["floor_us"] == p.kv_bytes / 1e12 * 1e6
    for name in ("splitkv", "splitkv_paged"):
        r = rec["impls"][name]
        assert r["graph"] == 10.0 and r["checked_against"] == "oracle" and r["rel_err"] < 1e-4, r
    assert rec["impls"]["splitkv_paged"]["over_splitkv"] == 1.0


# ---- SGLang's extend kernel ---------------------------------------------------------------------------


def _sglang_or_skip():
    try:
        return sglang_extend.load_extend()
    except sglang_extend.SglangNotFound:
        pytest.skip("no sglang wheel: " + sglang_extend.install_hint())


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("mask", ["causal", "tree"])
def test_sglang_extend_matches_the_oracle(dtype, mask):
    before = {m for m in sys.modules if m == "sglang" or m.startswith("sglang.")}
    fn, info = _sglang_or_skip()
    assert {m for m in sys.modules if m == "sglang" or m.startswith("sglang.")} == before  # nothing left behind
    assert info["version"] and os.path.isfile(os.path.join(info["folder"], "extend_attention.py"))
    p = make_problem([37, 0, 16], [4, 3, 4], 4, 2, 64, dtype=dtype, device=DEVICE, mask=mask, seed=7)
    out = p.new_output()
    fn(*p.args(out), **p.kwargs())
    from splitkv.testing import TOLERANCE, relative_error

    assert relative_error(out, reference_for(p)) < TOLERANCE[dtype]


def test_sglang_peer_in_a_row(monkeypatch):
    _sglang_or_skip()
    rec = _run_row(monkeypatch, Row("tiny", 4, 2, 37, 4, "causal", "float32", 16), ["splitkv", "sglang_extend"])
    r = rec["impls"]["sglang_extend"]
    assert r["graph"] == 10.0 and r["rel_err"] < 1e-4 and r["probe"]["ok"], r


# ---- Writers ---------------------------------------------------------------------------------------------


def _fake_result():
    """A result record of the shape run_sweep writes, with made-up times (never written to figures/)."""
    def rec(g, **kw):
        return dict(graph=g, rel_err=1e-3, row_err=2e-3, checked_against="oracle", **kw)

    rows = [
        dict(model="llama3-8b", heads=32, batch=8, prefix=16384, drafts=4, mask="causal", kv_dtype="bfloat16",
             page_size=16, case="bf16 p16 causal4", kv_bytes=2**28, floor_us=60.0, gather_floor_us=60.0,
             impls=dict(splitkv=rec(70.0), splitkv_paged=rec(72.0, over_splitkv=72 / 70),
                        sglang_extend=rec(300.0, over_splitkv=300 / 70), flashinfer_fa2=rec(90.0, over_splitkv=90 / 70),
                        flashinfer_fa3=dict(skipped="not supported"), flashinfer_xqa=dict(refused="probe off"))),
        dict(model="deepseek-v3", heads=16, batch=8, prefix=4096, drafts=4, mask="causal", kv_dtype="bfloat16",
             page_size=64, case="bf16 p64 causal4", kv_bytes=2**25, floor_us=9.0,
             impls=dict(splitkv=rec(20.0), splitkv_paged=dict(error="RuntimeError: declined"),
                        sglang_extend=rec(80.0, over_splitkv=4.0), flashinfer_mla=rec(25.0, over_splitkv=1.25))),
    ]
    return dict(device="NVIDIA H200", num_sms=132, torch="2.11", triton="3.6", python="3.12", date="2026-12-05",
                read_bandwidth=4.2e12, quick=True, libraries=dict(flashinfer="0.6.13", sglang="0.5.10.post1"),
                implementations={}, fp8_scales=dict(k_scale=0.5, v_scale=2.0),
                budgets=dict(bf16=[2e-2, 4e-2], fp8_math=list(peers_sweep.FP8_MATH_BUDGET)),
                timing=dict(warmup_ms=5, rep_ms=25), elapsed_s=3.0, rows=rows)


def test_markdown_table_and_plot(tmp_path):
    result = _fake_result()
    md = peers_sweep.format_markdown(result)
    tables = [line for line in md.splitlines() if line.startswith("| shape")]
    assert len(tables) == 3 and all(line.count("|") - 1 <= 9 for line in tables)
    assert "| llama3-8b bs8 16k | bf16 p16 causal4 | 1.03 | 4.29 | 1.29 | skip | refused | 1.17 |" in md
    assert "| llama3-8b bs8 16k | bf16 p16 causal4 | 60.0 | 70.0 | 72.0 | 300.0 | 90.0 | skip | refused |" in md
    assert "| h16 bs8 4k | bf16 p64 causal4 | 9.0 | 20.0 | fail | 80.0 | 25.0 | 4.00 | 1.25 |" in md
    assert "FlashInfer fa3 skipped at llama3-8b bs8 16k bf16 p16 causal4: not supported" in md
    assert "flashinfer 0.6.13" in md and "sglang 0.5.10.post1" in md
    assert "bf16 p16 causal4" in peers_sweep.format_table(result)
    from splitkv.bench.plots import plot_peers

    path = plot_peers(result, str(tmp_path / "peers_h200.png"))
    assert os.path.getsize(path) > 10_000


def test_merge_and_write(tmp_path, capsys):
    a, b = _fake_result(), _fake_result()
    a["rows"], b["rows"] = a["rows"][:1], b["rows"][1:]
    b["read_bandwidth"] = 2.1e12
    merged = peers_sweep.merge_results([a, b])
    assert [r["model"] for r in merged["rows"]] == ["llama3-8b", "deepseek-v3"] and merged["elapsed_s"] == 6.0
    assert math.isclose(merged["rows"][1]["floor_us"], 2**25 / 4.2e12 * 1e6)
    with pytest.raises(ValueError, match="more than one part"):
        peers_sweep.merge_results([a, a])
    paths = []
    for i, part in enumerate((a, b)):
        paths.append(str(tmp_path / f"part{i}.json"))
        with open(paths[-1], "w") as f:
            json.dump(part, f)
    out = str(tmp_path / "peers_h200.json")
    assert peers_sweep.main(["--merge", *paths, "--out", out]) == 0
    assert os.path.isfile(out) and os.path.isfile(out[:-5] + ".md") and os.path.isfile(out[:-5] + ".png")


# ---- FlashInfer's API, as the peers call it (no GPU: calls recorded, bound to the real signatures) ----------


def _recorder(real_cls, calls):
    import inspect

    class Recorder:
        def __init__(self, *a, **k):
            inspect.signature(real_cls.__init__).bind(self, *a, **k)
            calls.append(("init", a, k))

        def plan(self, *a, **k):
            inspect.signature(real_cls.plan).bind(self, *a, **k)
            calls.append(("plan", a, k))

        def run(self, *a, **k):
            inspect.signature(real_cls.run).bind(self, *a, **k)
            calls.append(("run", a, k))

    return Recorder


def test_flashinfer_calls_bind_to_its_api(monkeypatch):
    import inspect

    fi = pytest.importorskip("flashinfer", reason="FlashInfer is not installed (its wheel: see cuda_peers)")
    import flashinfer.mla

    calls = []
    monkeypatch.setattr(fi, "BatchPrefillWithPagedKVCacheWrapper", _recorder(fi.BatchPrefillWithPagedKVCacheWrapper,
                                                                             calls))
    monkeypatch.setattr(flashinfer.mla, "BatchMLAPagedAttentionWrapper",
                        _recorder(flashinfer.mla.BatchMLAPagedAttentionWrapper, calls))
    real_xqa = fi.xqa

    def xqa(*a, **k):
        inspect.signature(real_xqa).bind(*a, **k)
        calls.append(("xqa", a, k))

    monkeypatch.setattr(fi, "xqa", xqa)
    p = peers_sweep.to_fp8(make_problem([37, 16], 4, 8, 2, 64, dtype=torch.bfloat16, device=DEVICE, mask="tree",
                                        seed=0))
    fl = cuda_peers.flashinfer_layout(p, 16)
    out = p.new_output()
    for backend in ("flashinfer_fa2", "flashinfer_fa3"):
        calls.clear()
        cuda_peers.build_peer(backend, p, out, fl)()
        (_, init_a, init_k), (_, plan_a, plan_k), (_, run_a, run_k) = calls
        assert init_a[1] == "NHD" and init_k["backend"] == backend[-3:]
        assert [t.tolist() for t in plan_a[:4]] == [fl.qo_indptr.tolist(), fl.kv_indptr.tolist(),
                                                    fl.kv_indices.tolist(), fl.kv_last_page_len.tolist()]
        assert plan_a[4:8] == (8, 2, 64, 16) and torch.equal(plan_k["custom_mask"], p.custom_mask)
        assert plan_k["kv_data_type"] == torch.float8_e4m3fn and plan_k["q_data_type"] == torch.bfloat16
        assert run_a[1] == (fl.k_pages, fl.v_pages) and run_k["out"] is out
        assert (run_k["k_scale"], run_k["v_scale"]) == (0.5, 2.0)
    calls.clear()
    cuda_peers.build_peer("flashinfer_xqa", p, out, fl)()
    (_, a, k), = calls
    assert tuple(a[0].shape) == (2, 1, 4, 8, 64) and a[3].dtype == torch.int32 and a[4].dtype == torch.uint32
    assert a[4].flatten().tolist() == [41, 20] and k["q_seq_len"] == 4 and k["mask"].dtype == torch.uint16
    assert math.isclose(k["kv_scale"], 2.0) and math.isclose(k["q_scale"], 0.25)
    mla_row = Row("deepseek-v3", 16, 2, 40, 4, "causal", "bfloat16", 16)
    m = peers_sweep.draw_problem(mla_row, DEVICE)
    fl = cuda_peers.flashinfer_layout(m, 16)
    out = m.new_output()
    calls.clear()
    cuda_peers.build_peer("flashinfer_mla", m, out, fl)()
    (_, _, _), (_, plan_a, _), (_, run_a, run_k) = calls
    assert plan_a[4:10] == (16, 512, 64, 16, True, m.sm_scale) and plan_a[3].tolist() == [44, 44]
    assert [tuple(t.shape) for t in run_a[:4]] == [(8, 16, 512), (8, 16, 64), (fl.k_pages.shape[0], 16, 512),
                                                   (fl.k_pages.shape[0], 16, 64)]
    assert run_a[2].data_ptr() == fl.k_pages.data_ptr() and run_k["out"] is out


@pytest.mark.skipif(torch.cuda.is_available(), reason="fakes the device name and properties: CPU only")
def test_sweep_end_to_end_on_the_cpu(monkeypatch, tmp_path, capsys):
    """run_sweep and the writers on two tiny rows sharing one draw: JSON after every row, then .md and .png."""
    from splitkv.bench import timing

    monkeypatch.setitem(MODEL_SHAPES, "tiny", HeadShape("tiny", 4, 2, 64))
    monkeypatch.setattr(timing, "measure_read_bandwidth", lambda: 1e12)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: type("P", (), {"multi_processor_count": 132}))
    right = CudaPeer("fake_right", "fake", "the oracle itself", paged=True, build=_oracle_peer())
    monkeypatch.setitem(PEERS, "fake_right", right)
    rows = [Row("tiny", 4, 2, 37, 4, "causal", "float32", 16), Row("tiny", 4, 2, 37, 4, "causal", "float8_e4m3fn", 64)]
    out = str(tmp_path / "peers_h200_custom.json")
    result = peers_sweep.run_sweep(rows, ["fake_right"], out_path=out, timer=CountingTimer(), gather_floor=False,
                                   device=DEVICE, dtype=torch.float32)
    assert [r["case"] for r in result["rows"]] == ["float32 p16 causal4", "fp8 p64 causal4"]
    with open(out) as f:
        saved = json.load(f)
    assert len(saved["rows"]) == 2 and saved["device"] == "NVIDIA H200" and saved["probes"]
    for r in saved["rows"]:
        assert set(r["impls"]) == {"splitkv", "splitkv_paged", "fake_right"}
        assert all(v.get("graph") == 10.0 for v in r["impls"].values()), r["impls"]
    peers_sweep._write(saved, out, None)
    assert os.path.isfile(out[:-5] + ".md") and os.path.isfile(out[:-5] + ".png")
    assert "[  2/2] tiny bs2 0k fp8 p64 causal4" in capsys.readouterr().out


# ---- Ragged rows (the ThunderMLA shape) --------------------------------------------------------------------


@pytest.mark.parametrize("mask", ["causal", "tree"])
def test_ragged_row_draws_its_prefixes(monkeypatch, mask):
    """A row with ragged ``lens`` draws exactly those prefixes; its layout, mask and oracle agree."""
    monkeypatch.setitem(MODEL_SHAPES, "tiny", HeadShape("tiny", 4, 2, 64))
    lens = (21, 70, 3, 16)
    row = Row("tiny", 4, len(lens), max(lens), 4, mask, "float32", 16, lens=lens)
    assert row.prefix_lens == list(lens) and row.pool_bytes() == int(sum(lens) * 1.25) * 2 * 128 * 2
    p = peers_sweep.draw_problem(row, DEVICE, dtype=torch.float32)
    assert p.prefix_lens == list(lens) and p.extend_lens == [4] * 4
    assert p.kv_indptr.tolist() == [0, 21, 91, 94, 110] and p.qo_indptr.tolist() == [0, 4, 8, 12, 16]
    assert p.kv_indices.unique().numel() == sum(lens) and p.k_buffer.shape[0] >= int(sum(lens) * 1.25)
    if mask == "tree":
        starts = p.mask_indptr.tolist()
        assert starts == [0] + torch.cumsum(torch.tensor([4 * (n + 4) for n in lens]), 0).tolist()
        for b, n in enumerate(lens):
            block = p.custom_mask[starts[b]: starts[b + 1]].view(4, n + 4).cpu()
            assert block[:, :n].all() and block[:, n:].diagonal().all() and not block[:, n:].triu(1).any()
        words = cuda_peers.xqa_spec_mask(p).view(torch.int32)[..., 0].long()
        for b, n in enumerate(lens):
            block = p.custom_mask[starts[b]: starts[b + 1]].view(4, n + 4)[:, n:].cpu()
            assert [[(int(w) >> j) & 1 for j in range(4)] for w in words[b]] == block.long().tolist()
    fl = cuda_peers.flashinfer_layout(p, 16)
    assert fl.seq_lens.tolist() == [n + 4 for n in lens]
    assert torch.equal(_token_view(fl, fl.k_pages), _expected_keys(p, p.k_extend))
    right = CudaPeer("fake_right", "fake", "the oracle itself", paged=True, build=_oracle_peer())
    monkeypatch.setitem(PEERS, "fake_right", right)
    rec = peers_sweep.run_row(row, p, ["fake_right"], CountingTimer(), 1e12, {})
    assert rec["lens"] == lens and rec["impls"]["fake_right"]["graph"] == 10.0
    assert rec["kv_bytes"] == sum(lens) * 2 * 128 * 4


def test_thunder_mla_row_is_mla_and_ragged():
    row = peers_sweep.thunder_mla_row()
    small = Row(row.model, row.heads, 4, 45, row.drafts, row.mask, "bfloat16", row.page_size, lens=(11, 45, 5, 2))
    p = peers_sweep.draw_problem(small, DEVICE, dtype=torch.float32)
    assert cuda_peers.is_mla(p) and p.v_buffer.data_ptr() == p.k_buffer.data_ptr()
    assert peers_sweep.prefix_bytes(p) == 63 * 576 * 4  # the latent rows once
    assert cuda_peers.skip_reason("flashinfer_mla", p, 64) in (None, "needs a CUDA GPU")
    assert cuda_peers.skip_reason("flashinfer_xqa", p, 64) == "not an MLA kernel"


# ---- XQA's bit mask, read back as its kernels read it --------------------------------------------------------


def _xqa_reads(mask_u16, b, i, j, n_ext):
    """Bit for draft ``j`` of draft row ``i`` of request ``b``, read as FlashInfer 0.6.13's XQA kernels read it:
    mha.cu (applyMaskFromInput) takes uint16 ``[(b * L + i) * 2 * words + j // 16]``, bit ``j % 16``;
    mha_sm90.cu (SpecDec::loadTileMaskRow) takes uint32 ``[(b * L + i) * words + j // 32]``, bit ``j % 32``."""
    words = -(-n_ext // 32)
    flat16 = mask_u16.contiguous().view(-1).view(torch.int16).long() & 0xFFFF
    flat32 = mask_u16.contiguous().view(-1).view(torch.int32).long() & 0xFFFFFFFF
    row = b * n_ext + i
    a = (int(flat16[row * 2 * words + j // 16]) >> (j % 16)) & 1
    c = (int(flat32[row * words + j // 32]) >> (j % 32)) & 1
    return a, c


@pytest.mark.parametrize("n_ext", [4, 8, 33])
def test_xqa_mask_as_the_kernels_read_it(n_ext):
    p = make_problem([5, 40, 2], n_ext, 4, 2, 32, device=DEVICE, mask="tree", seed=n_ext)
    m = cuda_peers.xqa_spec_mask(p)
    assert m.is_contiguous() and tuple(m.shape) == (3, n_ext, 2 * -(-n_ext // 32))
    starts = p.mask_indptr.tolist()
    for b, n in enumerate(p.prefix_lens):
        vis = p.custom_mask[starts[b]: starts[b] + n_ext * (n + n_ext)].view(n_ext, n + n_ext)[:, n:].cpu()
        for i in range(n_ext):
            for j in range(n_ext):
                assert _xqa_reads(m, b, i, j, n_ext) == (int(vis[i, j]),) * 2, (b, i, j)


# ---- FlashInfer's builds: collected, built at once, packed and reloaded without nvcc ---------------------------


@pytest.fixture
def fake_flashinfer_dirs(monkeypatch, tmp_path):
    pytest.importorskip("flashinfer", reason="FlashInfer is not installed (its wheel: see cuda_peers)")
    from flashinfer.jit import env

    monkeypatch.setattr(env, "FLASHINFER_JIT_DIR", tmp_path / "jit")
    monkeypatch.setattr(env, "FLASHINFER_AOT_DIR", tmp_path / "aot")
    return tmp_path


def _spec(name):
    from flashinfer.jit.core import JitSpec

    return JitSpec(name=name, sources=[], extra_cflags=None, extra_cuda_cflags=None, extra_ldflags=None,
                   extra_include_dirs=None)


def _fake_build(spec, size=100):
    spec.jit_library_path.parent.mkdir(parents=True, exist_ok=True)
    spec.jit_library_path.write_bytes(os.urandom(size))


def test_collecting_flashinfer_specs(monkeypatch, fake_flashinfer_dirs):
    from flashinfer.jit import core

    loaded = []
    monkeypatch.setattr(core.JitSpec, "build_and_load", lambda spec: loaded.append(spec.name) or "module")
    built, missing = _spec("mod_built"), _spec("mod_missing")
    _fake_build(built)
    patched = core.JitSpec.build_and_load
    with cuda_peers.collecting_flashinfer_specs() as needed:
        assert built.build_and_load() == "module" and loaded == ["mod_built"]  # a built module loads as usual
        with pytest.raises(cuda_peers.SpecNeeded, match="mod_missing"):
            missing.build_and_load()
    assert list(needed) == ["mod_missing"] and needed["mod_missing"] is missing
    assert core.JitSpec.build_and_load is patched  # restored


def test_collecting_a_real_xqa_spec(monkeypatch, fake_flashinfer_dirs):
    """FlashInfer's own XQA module lookup, stopped where it would call nvcc: the module the quick rows' causal
    bf16 row needs (Llama-3-8B: 4 query heads per KV head, 4 drafts, pages of 64)."""
    from flashinfer.jit import core

    xqa_module = importlib.import_module("flashinfer.xqa")  # (flashinfer.xqa is the function)
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    monkeypatch.setattr(core.current_compilation_context, "TARGET_CUDA_ARCHS", {(9, "0a")})
    xqa_module.get_xqa_module.cache_clear()
    with cuda_peers.collecting_flashinfer_specs() as needed:
        with pytest.raises(cuda_peers.SpecNeeded):
            xqa_module.get_xqa_module(torch.bfloat16, torch.bfloat16, 64, 128, 4, False, torch.bfloat16, 4)
    (name, spec), = needed.items()
    assert "page_size_64_head_dim_128_head_group_ratio_4" in name and name.endswith("spec_q_seq_len_4")
    assert "-DSPEC_DEC=1" in spec.extra_cuda_cflags and "-DSPEC_Q_SEQ_LEN=4" in spec.extra_cuda_cflags
    assert [f for f in spec.extra_cuda_cflags if "compute_" in f] == ["-gencode=arch=compute_90a,code=sm_90a"]
    xqa_module.get_xqa_module.cache_clear()


def test_prebuild_builds_what_the_probes_lack_at_once(monkeypatch, fake_flashinfer_dirs):
    """Two fake FlashInfer peers: one needs module A, the other A then B (B shows only once A loads). Round 1
    builds A (for both peers, once), round 2 builds B, round 3 finds nothing missing; the Triton work runs once,
    during the first build."""
    from flashinfer.jit import core

    monkeypatch.setattr(core.JitSpec, "build_and_load", lambda spec: "module")  # a built module "loads"
    specs = {"mod_a": _spec("mod_a"), "mod_b": _spec("mod_b")}

    def peer_needing(*names):
        def build(p, out, fl):
            for n in names:
                specs[n].build_and_load()
            return _oracle_peer()(p, out, fl)
        return build

    monkeypatch.setitem(PEERS, "fake_fi_a", CudaPeer("fake_fi_a", "flashinfer", "needs A", paged=True,
                                                     build=peer_needing("mod_a")))
    monkeypatch.setitem(PEERS, "fake_fi_ab", CudaPeer("fake_fi_ab", "flashinfer", "needs A, B", paged=True,
                                                      build=peer_needing("mod_a", "mod_b")))
    monkeypatch.setattr(cuda_peers, "skip_reason", lambda name, p, ps: None)
    monkeypatch.setitem(MODEL_SHAPES, "tiny", HeadShape("tiny", 4, 2, 64))
    calls, meanwhile = [], []

    def build(batch, meanwhile=None):
        calls.append(sorted(s.name for s in batch))
        if meanwhile:
            meanwhile()
        for s in batch:
            _fake_build(s)
        return dict(built=[s.name for s in batch], failed=[], seconds=1.0)

    rows = [Row("tiny", 4, 1, 40, 4, "causal", "float32", 16), Row("tiny", 4, 1, 40, 4, "tree", "float32", 16)]
    res = peers_sweep.prebuild(rows, ["fake_fi_a", "fake_fi_ab"], build=build, device=DEVICE,
                               meanwhile=lambda: meanwhile.append(1))
    assert calls == [["mod_a"], ["mod_b"]] and meanwhile == [1]
    assert res == dict(modules=["mod_a", "mod_b"], failed=[], seconds=2.0, rounds=2)
    # Everything built: nothing to do, the Triton work still runs.
    res = peers_sweep.prebuild(rows, ["fake_fi_a", "fake_fi_ab"], build=build, device=DEVICE,
                               meanwhile=lambda: meanwhile.append(2))
    assert res["rounds"] == 0 and len(calls) == 2 and meanwhile == [1, 2]


def test_pack_and_install_jit_cache(fake_flashinfer_dirs, tmp_path):
    from flashinfer.jit import env

    sizes = {"mod_big": 3000, "mod_mid": 1500, "mod_small": 1000, "mod_tiny": 400}
    for name, size in sizes.items():
        _fake_build(_spec(name), size)
    (env.FLASHINFER_JIT_DIR / "mod_unbuilt").mkdir()  # objects only, no library: not packed
    (env.FLASHINFER_JIT_DIR / "mod_big" / "x.cuda.o").write_bytes(b"o")  # objects are not packed
    parts = cuda_peers.pack_jit_cache(str(tmp_path / "out" / "fijit.tar.gz"), str(env.FLASHINFER_JIT_DIR),
                                      str(env.FLASHINFER_AOT_DIR), max_bytes=3000)
    assert [os.path.basename(a) for a, _ in parts] == ["fijit.tar.gz", "fijit-2.tar.gz"]
    assert [names for _, names in parts] == [["mod_big"], ["mod_mid", "mod_small", "mod_tiny"]]
    import tarfile

    with tarfile.open(parts[1][0]) as tar:
        assert sorted(tar.getnames()) == ["mod_mid/mod_mid.so", "mod_small/mod_small.so", "mod_tiny/mod_tiny.so"]
    # On a fresh machine: unpacked into the AOT folder, a module is "AOT" and loads without ninja or nvcc.
    assert not _spec("mod_big").is_aot
    names = []
    for archive, _ in parts:
        names += cuda_peers.install_jit_cache(archive)
    assert sorted(names) == sorted(sizes)
    for name, size in sizes.items():
        spec = _spec(name)
        assert spec.is_aot and spec.aot_path.read_bytes() == (env.FLASHINFER_JIT_DIR / name / f"{name}.so").read_bytes()
    # Packing again takes the AOT copies too (one name once), so the next archive holds every module.
    (env.FLASHINFER_JIT_DIR / "mod_tiny" / "mod_tiny.so").unlink()
    again = cuda_peers.pack_jit_cache(str(tmp_path / "again.tar.gz"), str(env.FLASHINFER_JIT_DIR),
                                      str(env.FLASHINFER_AOT_DIR))
    assert len(again) == 1 and sorted(again[0][1]) == sorted(sizes)
    # A library that does not load here is removed again (FlashInfer will build that module itself).
    def verify(path):
        if "mod_mid" in path:
            raise OSError("undefined symbol")

    aot2 = tmp_path / "aot2"
    assert sorted(cuda_peers.install_jit_cache(parts[1][0], str(aot2), verify=verify)) == ["mod_small", "mod_tiny"]
    assert not (aot2 / "mod_mid" / "mod_mid.so").exists() and (aot2 / "mod_tiny" / "mod_tiny.so").exists()
    # Libraries built in the JIT folder are copied to the AOT folder where missing there.
    _fake_build(_spec("mod_new"), 10)
    assert cuda_peers.adopt_jit_builds(str(env.FLASHINFER_JIT_DIR), str(env.FLASHINFER_AOT_DIR)) == ["mod_new"]
    assert _spec("mod_new").is_aot and cuda_peers.adopt_jit_builds(str(env.FLASHINFER_JIT_DIR),
                                                                   str(env.FLASHINFER_AOT_DIR)) == []
    # A library that calls the driver without needing libcuda (linked against a stand-in) is refused.
    nm = "                 U cuTensorMapEncodeTiled\n                 U memcpy@GLIBC_2.14\n"

    def fake_run(cmd, **kw):
        out = nm if cmd[0] == "nm" else (" (NEEDED) Shared library: [libcuda.so.1]\n" if "good" in cmd[-1] else "")
        return type("R", (), {"stdout": out})()

    import subprocess

    real_run = subprocess.run
    subprocess.run = fake_run
    try:
        with pytest.raises(OSError, match="cuTensorMapEncodeTiled"):
            cuda_peers.check_driver_link("/x/bad.so")
        cuda_peers.check_driver_link("/x/good.so")
    finally:
        subprocess.run = real_run
    # A foreign member is passed over.
    evil = tmp_path / "evil.tar.gz"
    with tarfile.open(evil, "w:gz") as tar:
        tar.add(str(parts[0][0]), arcname="../escape/escape.so")
        tar.add(str(parts[0][0]), arcname="mod_x/other.so")
    assert cuda_peers.install_jit_cache(str(evil)) == [] and not (tmp_path / "escape").exists()
    assert peers_sweep.main(["--install-jit", str(tmp_path / "absent.tar.gz")]) == 0


# ---- Who is fastest, and the benchmarks page ---------------------------------------------------------------------


def _result_with_a_loss():
    """_fake_result plus a row where FlashInfer's XQA beats splitkv (made-up numbers, never written to figures/)."""
    result = _fake_result()
    loss = json.loads(json.dumps(result["rows"][0]))
    loss.update(page_size=64, case="bf16 p64 causal4", gather_floor_us=50.0)
    loss["impls"]["flashinfer_xqa"] = dict(graph=56.0, rel_err=1e-3, row_err=2e-3, checked_against="oracle",
                                           over_splitkv=0.8)
    result["rows"].append(loss)
    ragged = json.loads(json.dumps(result["rows"][1]))
    ragged.update(batch=4, prefix=45118, lens=[4641, 45118, 1730, 1696])
    ragged["impls"]["splitkv"] = dict(refused="probe off the oracle")
    result["rows"].append(ragged)
    return result


def test_fastest_and_where_splitkv_is_not():
    result = _result_with_a_loss()
    f = peers_sweep.fastest(result)
    assert [x["fastest"] for x in f] == ["splitkv", "splitkv", "flashinfer_xqa", "flashinfer_mla"]
    first = f[0]
    assert first["runner_up"] == "splitkv_paged" and math.isclose(first["margin"], 72 / 70)
    assert first["best_peer"] == "flashinfer_fa2" and math.isclose(first["peer_over_splitkv"], 90 / 70)
    assert f[1]["row"] == "deepseek-v3 h16 bs8 4k" and f[1]["best_peer"] == "flashinfer_mla"
    assert f[3]["row"] == "deepseek-v3 h16 bs4 4641/45118/1730/1696" and f[3]["splitkv_us"] is None
    losses = peers_sweep.not_fastest(result)
    assert [(x["row"], x["case"]) for x in losses] == [("llama3-8b bs8 16k", "bf16 p64 causal4"),
                                                       ("deepseek-v3 h16 bs4 4641/45118/1730/1696",
                                                        "bf16 p64 causal4")]
    assert math.isclose(losses[0]["splitkv_over_gather_floor"], 70 / 50)
    md = peers_sweep.fastest_markdown(result)
    assert "| llama3-8b bs8 16k | bf16 p64 causal4 | FlashInfer xqa | 56.0 | splitkv | 1.25 | FlashInfer xqa | 0.80 |" \
        in md
    assert ("- llama3-8b bs8 16k bf16 p64 causal4: FlashInfer xqa 56.0 µs against splitkv's 70.0 µs (splitkv 1.25× "
            "its time; splitkv ÷ gather floor 1.40).") in md
    assert "- deepseek-v3 h16 bs4 4641/45118/1730/1696 bf16 p64 causal4: splitkv has no time" in md
    result["rows"] = result["rows"][:2]
    assert "Nowhere: splitkv (token pool) is at least as fast as every timed peer on all 2 rows." in \
        peers_sweep.fastest_markdown(result)


def test_report_writes_the_docs_block(tmp_path, capsys):
    result = _result_with_a_loss()
    result["command"] = "python -m splitkv.bench --peers flashinfer,sglang --quick"
    path = str(tmp_path / "peers_h200_quick.json")
    with open(path, "w") as f:
        json.dump(result, f)
    page = tmp_path / "benchmarks.md"
    page.write_text(f"# B\n\nbefore\n\n{peers_sweep.DOCS_BEGIN}\nNo run yet.\n{peers_sweep.DOCS_END}\n\nafter\n")
    assert peers_sweep.main(["--report", path, "--docs", str(page)]) == 0
    text = page.read_text()
    assert text.startswith("# B\n\nbefore\n\n" + peers_sweep.DOCS_BEGIN) and text.endswith(peers_sweep.DOCS_END
                                                                                          + "\n\nafter\n")
    assert "No run yet." not in text and text.count(peers_sweep.DOCS_BEGIN) == 1
    assert ("Measured on NVIDIA H200 (132 SMs), 2026-12-05, torch 2.11, triton 3.6, flashinfer 0.6.13, sglang "
            "0.5.10.post1; 4 rows; command: `python -m splitkv.bench --peers flashinfer,sglang --quick`.") in text
    assert '--8<-- "figures/peers_h200_quick.md"' in text and "**Where splitkv is not the fastest**" in text
    assert "](figures/peers_h200_quick.png)" in text and "[`figures/peers_h200_quick.json`]" in text
    assert os.path.isfile(path[:-5] + ".md") and os.path.isfile(path[:-5] + ".png")
    assert "FlashInfer xqa 56.0 µs against splitkv's 70.0 µs" in capsys.readouterr().out
    # Again: the block is replaced, not added.
    peers_sweep.update_docs(str(page), peers_sweep.docs_block(result, path))
    assert page.read_text().count(peers_sweep.DOCS_BEGIN) == 1
    with pytest.raises(ValueError, match="no"):
        peers_sweep.update_docs(str(tmp_path / "peers_h200_quick.md"), "x")


def test_the_benchmarks_page_has_the_block():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "benchmarks.md")) as f:
        text = f.read()
    assert text.count(peers_sweep.DOCS_BEGIN) == 1 and text.index(peers_sweep.DOCS_BEGIN) < text.index(
        peers_sweep.DOCS_END)
