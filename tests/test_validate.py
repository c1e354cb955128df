"""The GPU validation command's parts that run anywhere: the golden problem set and its comparison, the
dealing of tests to processes and the reading of their outcomes, the sanitizer's counts, the ratios against
committed records, and the verdict."""

import json

import pytest
import torch

from conftest import assert_matches_reference
from splitkv.bench import golden, validate
from splitkv.testing import VerifyProblem


def test_the_golden_set_covers_the_promised_problems_once_each():
    cases = list(golden.cases())
    names = [c.name for c in cases]
    assert len(names) == len(set(names)) == 88
    assert {c.model for c in cases} == {"qwen3-next", "llama3-8b", "qwen3-32b", "mla16"}
    assert {c.batch for c in cases} == {1, 8, 32} and {c.prefix for c in cases} == {1024, 16384}
    assert {c.mask for c in cases} == {"causal", "tree"} and {c.kv for c in cases} == {"bf16", "fp8"}
    assert {c.page for c in cases} == {1, 16, 64}


def test_a_case_draws_the_same_tensors_from_its_name():
    case = golden.Case("llama3-8b", 2, 40, "tree", "fp8")
    (a, _), (b, _) = golden.draw(case, "cpu", torch.float16), golden.draw(case, "cpu", torch.float16)
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x.float().nan_to_num(), y.float().nan_to_num())
    other = golden.draw(golden.Case("llama3-8b", 2, 40, "tree", "bf16"), "cpu", torch.float16)[0]
    assert not torch.equal(a[0], other[0])  # another name, another seed


def _as_problem(case, args, keywords):
    q, k_ext, v_ext, _, k_buf, v_buf, qo, kv, idx, mask, causal, mask_indptr, max_ext, k_scale, v_scale = args
    return VerifyProblem(q_extend=q, k_extend=k_ext, v_extend=v_ext, k_buffer=k_buf, v_buffer=v_buf, qo_indptr=qo,
                         kv_indptr=kv, kv_indices=idx, custom_mask=mask, mask_indptr=mask_indptr, is_causal=causal,
                         max_len_extend=max_ext, k_scale=k_scale, v_scale=v_scale, sm_scale=keywords["sm_scale"],
                         sinks=None, prefix_lens=[case.prefix] * case.batch, extend_lens=[golden.DRAFTS] * case.batch)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's float16 run; the GPU's is the golden run")
@pytest.mark.parametrize("case", [golden.Case("llama3-8b", 2, 70, "tree", "fp8"),
                                  golden.Case("mla16", 1, 40, "causal", "bf16"),
                                  golden.Case("qwen3-next", 1, 37, "causal", "bf16")], ids=lambda c: c.name)
def test_a_token_pool_case_is_served_exactly(case):
    """The drop-in serves the case, repeats it bit for bit, and its output is the oracle's (float16 here)."""
    result = golden.run_case(case, "cpu", torch.float16)
    assert result["served"] and result["repeats"] and result["finite"]
    args, keywords = golden.draw(case, "cpu", torch.float16)
    from splitkv import verify_splitkv_fwd

    assert verify_splitkv_fwd(*args, **keywords)
    assert golden.digest(args[3]) == result["sha256"]
    assert_matches_reference(args[3], _as_problem(case, args, keywords))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's float16 run; the GPU's is the golden run")
def test_a_paged_case_is_served_and_repeats():
    result = golden.run_case(golden.Case("llama3-8b", 2, 40, "causal", "bf16", 16), "cpu", torch.float16)
    assert result["served"] and result["repeats"] and result["finite"]


def test_compare_names_every_kind_of_mismatch():
    ok = {"sha256": "a", "served": True, "repeats": True, "finite": True}
    old = {"cases": {"x": ok, "y": ok, "z": ok}}
    new = {"cases": {"x": ok, "y": {**ok, "sha256": "b"}, "w": ok, "z": {**ok, "repeats": False, "served": False}}}
    verdict = golden.compare(new, old)
    assert verdict["equal"] == ["x", "z"] and verdict["differ"] == ["y"] and verdict["new"] == ["w"]
    assert verdict["unrepeatable"] == ["z"] and verdict["unserved"] == ["z"] and not golden.passed(verdict)
    assert golden.passed(golden.compare(old, old))


def test_tests_are_dealt_round_robin_to_at_most_the_workers():
    shares = validate.deal([f"t{i}" for i in range(10)], 4)
    assert shares == [["t0", "t4", "t8"], ["t1", "t5", "t9"], ["t2", "t6"], ["t3", "t7"]]
    assert validate.deal(["a"], 8) == [["a"]]


def test_a_test_keeps_its_worst_outcome_and_unrecorded_tests_did_not_run(tmp_path):
    path = tmp_path / "share.outcomes"
    lines = [("a", "passed"), ("a", "error"), ("b", "skipped"), ("c", "context-lost"), ("d", "failed")]
    path.write_text("".join(json.dumps({"id": i, "outcome": o, "message": o}) + "\n" for i, o in lines))
    assert validate.read_outcomes(str(path))["a"]["outcome"] == "error"
    record = validate.tests_record([["a", "b", "c"], ["d", "e"]], [str(path), str(path)], 12.0)
    assert (record["error"], record["skipped"], record["context-lost"], record["failed"], record["not_run"]) == \
        (1, 1, 1, 1, 1)
    assert [f["test"] for f in record["failures"]] == ["a", "c", "d"]
    assert not validate.verdict_ok({"tests": record})


def test_sanitizer_errors_are_counted_from_its_summaries():
    log = "x\n========= ERROR SUMMARY: 3 errors\n...\n== 5 passed in 2.0s ==\n========= ERROR SUMMARY: 0 errors\n"
    assert validate.read_sanitizer(log, timed_out=False) == {"errors": 3, "complete": True, "pytest": "5 passed in 2.0s"}
    race = validate.read_sanitizer("========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n", False)
    assert race["errors"] == 0 and race["complete"]
    cut = validate.read_sanitizer("========= Invalid __global__ read\n", timed_out=True)
    assert cut["errors"] == 1 and not cut["complete"]
    record = {"sanitizer": [{"errors": 0, "complete": False}]}
    assert not validate.verdict_ok(record)


def test_ratios_against_committed_records():
    row = dict(model="m", batch=1, prefix=4096, kv_dtype="bfloat16")
    host = validate.host_ratios({"rows": [{**row, "host_us": {"drop-in": 30.0, "new entry": 5.0}}]},
                                {"rows": [{**row, "host_us": {"drop-in": 40.0}}]})
    assert host == [{"row": "m/1/4096/bfloat16", "entry": "drop-in", "new_us": 30.0, "old_us": 40.0, "ratio": 0.75}]
    bench = validate.bench_ratios({"rows": [{**row, "impls": {"splitkv": {"graph": 22.0, "eager": 30.0}}}]},
                                  {"rows": [{**row, "impls": {"splitkv": {"graph": 20.0, "eager": 40.0}}}]})
    assert bench[0]["graph_ratio"] == pytest.approx(1.1) and bench[0]["eager_ratio"] == 0.75


def test_the_command_needs_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit):
        validate.main(["--parts", "golden"])
    assert "needs a CUDA GPU" in capsys.readouterr().err
