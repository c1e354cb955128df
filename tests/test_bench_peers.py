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
    assert len(rows) == len(set(rows)) == 144
    assert {r.model for r in rows} == {"llama3-8b", "qwen3-32b", "qwen3-next", "deepseek-v3"}
    assert {r.kv_dtype for r in rows} == {"bfloat16", "float8_e4m3fn"}
    assert {r.page_size for r in rows} == {16, 64}
    assert {(r.mask, r.drafts) for r in rows} == {("causal", 4), ("tree", 8)}
    assert {r.heads for r in rows if r.mla} == {16, 128}
    assert all(3 * r.pool_bytes() <= peers_sweep.MEMORY_BUDGET for r in rows)
    assert set(peers_sweep.QUICK_ROWS) <= set(rows) and len(peers_sweep.QUICK_ROWS) == 6
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
    assert out.strip().endswith("6 rows")
    assert peers_sweep.main(["--peers=all", "--models", "deepseek-v3", "--list"]) == 0
    assert capsys.readouterr().out.strip().endswith("18 rows")
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
