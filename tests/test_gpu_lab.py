"""The GPU lab (``python -m splitkv.teaching.gpu_lab``): on a CPU it says it needs a GPU and exits cleanly; its
steps (check, time, compare, sweep) run end to end through the interpreter with a stand-in timer."""

import io

import pytest
import torch

from splitkv.teaching import gpu_lab

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only test: on a GPU the lab really runs")


class CountingTimer:
    """Stands in for the benchmark's timer: runs the call once, returns a fixed 'µs'."""

    def __init__(self):
        self.calls = 0

    def graph(self, fn):
        fn()
        self.calls += 1
        return 10.0


@cpu_only
def test_without_a_gpu_the_lab_says_so_and_exits_cleanly(tmp_path, capsys):
    log = tmp_path / "lab.log"
    assert gpu_lab.main(["--log", str(log)]) == 0
    assert "needs a CUDA GPU" in log.read_text() and "needs a CUDA GPU" in capsys.readouterr().out


@cpu_only
def test_a_dry_run_times_the_kernels_against_the_package_and_sweeps():
    out = io.StringIO()
    timer = CountingTimer()
    shapes = [("tiny", 8, 2, 32, 2, 100)]
    res = gpu_lab.run_lab(out=out, dry_run=dict(shapes=shapes, timer=timer, bandwidth=1e12, gather_us=5.0,
                                                sweep=((16, 32), (1, 2))))
    text = out.getvalue()
    assert "stored solution (yours is a stub)" in text  # the committed your_kernels.py holds stubs
    (row,) = res["rows"]
    assert row["yours_us"] == row["splitkv_us"] == 10.0 and row["kv_bytes"] == 2 * 100 * 2 * 2 * 32 * 2
    assert [(s["block_n"], s["stages"]) for s in res["sweep"]] == [(16, 1), (16, 2), (32, 1), (32, 2)]
    assert timer.calls == 2 + 4 and "best: BLOCK_N" in text
