import csv
import json
import logging
import os
import re
import subprocess
import sys
import time

import pytest
import torch
from subprocess_env import child_env
from tiny_models import tiny_llama, train_llama

import op_tools
from op_tools.time_measure import CALL_COLUMNS


@pytest.fixture(autouse=True)
def _own_results(tmp_path, monkeypatch):
    monkeypatch.setenv("OP_TOOLS_RESULTS_DIR", str(tmp_path / "results"))
    monkeypatch.setenv("OP_TOOLS_VERBOSE", "0")
    for name in ("OP_TIME_MEASURE_LIST", "OP_TIME_MEASURE_DISABLE_LIST", "OP_TOOLS_STRICT"):
        monkeypatch.delenv(name, raising=False)


def _result_files(tmp_path, kind):
    folder = tmp_path / "results" / "op_time_measure_result"
    return sorted(folder.glob(f"op_elasped_{kind}_pid{os.getpid()}_*"))


def _timed_llama_step(device, tmp_path):
    base = train_llama(device, steps=1)
    start = time.perf_counter()
    with op_tools.OpTimeMeasure() as timer:
        losses = train_llama(device, steps=1)
    wall = time.perf_counter() - start
    assert losses == base  # timing only waits: the numbers are bit-identical
    return timer, wall


def _check_llama_step(timer, wall, tmp_path):
    m = timer.measurements
    assert m.records and all(r.forward_ns > 0 for r in m.records)
    for name in ("torch.nn.functional.linear", "torch.nn.functional.embedding",
                 "torch.nn.functional.scaled_dot_product_attention", "torch.nn.functional.silu",
                 "torch.nn.functional.cross_entropy"):
        totals = m.totals[name]
        assert totals.calls > 0 and totals.backward_calls == totals.calls, name  # every call has a backward time
        assert totals.backward_ns > 0
    # The optimizer step has no gradient, so no backward time: AdamW's per-tensor path (sim, CPU) or the
    # foreach kernels PyTorch picks on CUDA.
    step_ops = [name for name in ("torch.Tensor.addcdiv_", "torch._foreach_addcdiv_") if name in m.totals]
    assert step_ops and all(m.totals[name].backward_calls == 0 for name in step_ops)
    measured = sum(t.forward_ns + t.backward_ns for t in m.totals.values()) / 1e9
    ratio = measured / wall
    print(f"per-op sum {measured * 1e3:.1f} ms, step wall {wall * 1e3:.1f} ms, ratio {ratio:.2f}")
    assert 0.05 < ratio < 1.0  # spans never overlap on one thread: their sum cannot exceed the wall time

    (trace_file,) = _result_files(tmp_path, "trace")
    trace = json.loads(trace_file.read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert all({"name", "cat", "ts", "dur", "pid", "tid"} <= e.keys() and e["dur"] >= 0 for e in spans)
    forward = [e for e in spans if e["cat"] == "forward"]
    backward = [e for e in spans if e["cat"] == "backward"]
    assert len(forward) == len(m.records) == sum(t.calls for t in m.totals.values())
    assert len(backward) == sum(t.backward_calls for t in m.totals.values())
    assert len({e["args"]["forward_id"] for e in forward}) == len(forward)  # one span per call

    (calls_file,) = _result_files(tmp_path, "info")
    with open(calls_file, newline="") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == CALL_COLUMNS and len(rows) == len(forward)
    assert all(r["unit"] == "ms" and float(r["forward_elasped"]) > 0 for r in rows)
    (summary_file,) = _result_files(tmp_path, "summary")
    with open(summary_file, newline="") as f:
        totals = [float(r["total_ms"]) for r in csv.DictReader(f)]
    assert totals == sorted(totals, reverse=True)


def test_llama_step_has_forward_and_backward_times_a_trace_and_unchanged_numerics(sim, tmp_path):
    timer, wall = _timed_llama_step(sim, tmp_path)
    _check_llama_step(timer, wall, tmp_path)
    assert re.fullmatch(r"op_elasped_info_pid\d+_\d{4}(-\d\d){5}_\d+\.csv", _result_files(tmp_path, "info")[0].name)


def test_an_op_made_slow_tops_the_summary(sim, tmp_path, capsys):
    import ditorch.sim

    model = tiny_llama().to(sim)
    ids = torch.randint(0, 128, (2, 16)).to(sim)
    with ditorch.sim.faults("silu:slow=100"), op_tools.OpTimeMeasure() as timer:
        model(input_ids=ids, labels=ids).loss.backward()
    top = timer.measurements.summary_rows()[0]
    assert top["name"] == "torch.nn.functional.silu" and top["forward_mean_ms"] >= 100
    printed = capsys.readouterr().out
    assert printed.index("torch.nn.functional.silu") < printed.index("torch.nn.functional.linear")


def test_lists_choose_the_ops_timed(sim, monkeypatch):
    monkeypatch.setenv("OP_TIME_MEASURE_LIST", r"torch\.nn\.functional\..*")
    monkeypatch.setenv("OP_TIME_MEASURE_DISABLE_LIST", "torch.nn.functional.silu")
    x = torch.randn(4, 8, device=sim)
    w = torch.randn(3, 8, device=sim)
    with op_tools.OpTimeMeasure() as timer:
        torch.nn.functional.silu(torch.nn.functional.linear(x, w) * 2)
    assert set(timer.measurements.totals) == {"torch.nn.functional.linear"}


def test_per_call_tables_keep_the_original_columns_when_verbose(sim, monkeypatch, capsys):
    monkeypatch.setenv("OP_TOOLS_VERBOSE", "1")
    w = torch.randn(3, 4, device=sim, requires_grad=True)
    with op_tools.OpTimeMeasure():
        torch.nn.functional.linear(torch.randn(2, 4, device=sim), w).sum().backward()
    out = capsys.readouterr().out
    for column in ("forward_id", "forward_elasped", "backward_elasped", "unit", "requires_grad"):
        assert column in out
    assert "torch.nn.functional.linear inputs[0]" in out


def test_a_failing_synchronize_is_reported_once_and_the_ops_still_run(sim, monkeypatch, caplog):
    def broken(device=None):
        raise RuntimeError("driver gone")

    monkeypatch.setattr(torch.sim, "synchronize", broken)
    monkeypatch.setattr("op_tools.time_measure._synchronizers", {})
    x = torch.ones(4, device=sim)
    with caplog.at_level(logging.WARNING, logger="op_tools"), op_tools.OpTimeMeasure() as timer:
        y = (x + 1) + 1
    assert torch.equal(y.cpu(), torch.full((4,), 3.0))
    assert timer.measurements.totals["torch.Tensor.add"].calls == 2
    assert sum("driver gone" in r.getMessage() for r in caplog.records) == 1
    monkeypatch.setenv("OP_TOOLS_STRICT", "1")
    with pytest.raises(RuntimeError, match="driver gone"), op_tools.OpTimeMeasure():
        x + 1


def test_apply_feature_times_the_chosen_op_and_writes_the_files_at_exit(tmp_path):
    code = """
import torch, ditorch.sim, op_tools
ditorch.sim.register()
op_tools.apply_feature("torch.nn.functional.linear", feature="measure_op_time")
x, w = torch.randn(2, 4, device="sim"), torch.randn(3, 4, device="sim")
for _ in range(3):
    torch.nn.functional.linear(x, w).relu()
"""
    env = child_env({"OP_TOOLS_RESULTS_DIR": str(tmp_path / "results"), "OP_TOOLS_VERBOSE": "0"})
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    (calls_file,) = (tmp_path / "results" / "op_time_measure_result").glob("op_elasped_info_pid*.csv")
    with open(calls_file, newline="") as f:
        assert [r["name"] for r in csv.DictReader(f)] == ["torch.nn.functional.linear"] * 3
    assert "OpTimeMeasure: 3 calls of 1 ops" in done.stdout


@pytest.mark.gpu
def test_llama_step_on_cuda(tmp_path):
    timer, wall = _timed_llama_step("cuda", tmp_path)
    _check_llama_step(timer, wall, tmp_path)
