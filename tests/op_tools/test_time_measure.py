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
from op_tools.tools.time_measure import CALL_COLUMNS


@pytest.fixture(autouse=True)
def _own_results(tmp_path, monkeypatch):
    monkeypatch.setenv("OP_TOOLS_RESULTS_DIR", str(tmp_path / "results"))
    monkeypatch.setenv("OP_TOOLS_VERBOSE", "0")
    for name in ("OP_TIME_MEASURE_LIST", "OP_TIME_MEASURE_DISABLE_LIST", "OP_TIME_MEASURE_SYNC", "OP_TOOLS_STRICT"):
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
    # spans never overlap on one thread: their sum cannot exceed the wall time; it is a few % of it on sim (the
    # wall holds the tool's own per-call work, and a loaded machine stretches it: 0.048 seen in CI)
    assert 0.01 < ratio < 1.0

    (trace_file,) = _result_files(tmp_path, "trace")
    trace = json.loads(trace_file.read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert all({"name", "cat", "ts", "dur", "pid", "tid"} <= e.keys() and e["dur"] >= 0 for e in spans)
    forward = [e for e in spans if e["cat"] == "forward"]
    backward = [e for e in spans if e["cat"] == "backward"]
    assert len(forward) == len(m.records) == sum(t.calls for t in m.totals.values())
    assert len(backward) == sum(t.backward_calls for t in m.totals.values())
    assert len({e["args"]["forward_id"] for e in forward}) == len(forward)  # one span per call
    # One thread runs the forward calls one after another: their spans follow one another, in call order.
    forward.sort(key=lambda e: e["args"]["forward_id"])
    # µs; events read to about 0.5 µs on a GPU
    assert all(a["ts"] + a["dur"] <= b["ts"] + 2.0 for a, b in zip(forward, forward[1:]))

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


def test_an_op_made_slow_tops_the_summary(sim, tmp_path, logged):
    import ditorch.sim

    model = tiny_llama().to(sim)
    ids = torch.randint(0, 128, (2, 16)).to(sim)
    # 300 ms a call: a CI run whose VM stalled the process 0.4 s inside one torch.cat call put cat on top of 100 ms
    with ditorch.sim.faults("silu:slow=300"), op_tools.OpTimeMeasure() as timer:
        model(input_ids=ids, labels=ids).loss.backward()
    top = timer.measurements.summary_rows()[0]
    assert top["name"] == "torch.nn.functional.silu" and top["forward_mean_ms"] >= 300
    printed = logged()
    assert printed.index("torch.nn.functional.silu") < printed.index("torch.nn.functional.linear")


def test_the_module_made_slow_tops_the_time_per_module(sim, tmp_path, logged):
    import ditorch.sim

    model = tiny_llama().to(sim)
    ids = torch.randint(0, 128, (2, 16)).to(sim)
    slow = model.model.layers[1].mlp.act_fn
    slow.register_forward_pre_hook(lambda *_: ditorch.sim.set_faults("silu:slow=100"))
    slow.register_forward_hook(lambda *_: ditorch.sim.clear_faults())
    with op_tools.OpTimeMeasure() as timer:
        model(input_ids=ids, labels=ids).loss.backward()
    rows = timer.measurements.module_rows()
    by_path = {r["module"]: r for r in rows}
    # with their submodules' time: the root (named by its class), its child "model", the container of the layers
    chain = ["LlamaForCausalLM", "model", "model.layers", "model.layers.1", "model.layers.1.mlp",
             "model.layers.1.mlp.act_fn"]
    assert [r["module"] for r in rows if r["module"] in chain] == chain and rows[0]["module"] == chain[0]
    assert by_path["model.layers.1"]["total_ms"] > by_path["model.layers.0"]["total_ms"]
    act_fn = by_path["model.layers.1.mlp.act_fn"]
    assert act_fn["self_ms"] == act_fn["total_ms"] >= 100 and act_fn["calls"] == 1
    layer = by_path["model.layers.1"]
    assert layer["self_ms"] < layer["total_ms"]  # layer 1's own adds, plus its attention, norms and MLP
    assert by_path["model.layers"]["self_ms"] == 0  # a ModuleList runs nothing itself
    (modules_file,) = _result_files(tmp_path, "modules")
    with open(modules_file, newline="") as f:
        assert [r["module"] for r in csv.DictReader(f)][:2] == ["LlamaForCausalLM", "model"]
    assert "time per module" in logged()


class _TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.l2(torch.nn.functional.gelu(self.l1(x)))  # gelu: the root's own call


def test_a_root_module_holds_its_children_time(sim):
    model = _TwoLayers().to(sim)
    head = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).to(sim)  # a root that runs nothing itself
    with op_tools.OpTimeMeasure() as timer:
        head(model(torch.randn(8, 16, device=sim))).sum().backward()
    rows = {r["module"]: r for r in timer.measurements.module_rows()}
    assert set(rows) == {"_TwoLayers", "l1", "l2", "Sequential", "0", "1", "(no module)"}
    root = rows["_TwoLayers"]
    assert root["calls"] == 3 and root["self_ms"] < root["total_ms"]
    assert root["total_ms"] == pytest.approx(root["self_ms"] + rows["l1"]["total_ms"] + rows["l2"]["total_ms"])
    assert rows["Sequential"]["calls"] == 2 and rows["Sequential"]["self_ms"] == 0
    assert rows["Sequential"]["total_ms"] == pytest.approx(rows["0"]["total_ms"] + rows["1"]["total_ms"])
    # the roots and the calls outside any module (sum) are the whole run
    whole = sum(t.forward_ns + t.backward_ns for t in timer.measurements.totals.values()) / 1e6
    assert root["total_ms"] + rows["Sequential"]["total_ms"] + rows["(no module)"]["total_ms"] == pytest.approx(whole)


def test_calls_whose_op_raised_are_counted_by_the_summary_and_the_closing_line(sim, logged):
    from op_tools.output import reporting

    a, b = torch.randn(3, 4, device=sim), torch.randn(5, 6, device=sim)
    with op_tools.OpTimeMeasure() as timer:
        for _ in range(3):
            with pytest.raises(RuntimeError):
                a @ b  # the user's shape error: propagated, never timed
        a.sin()
    assert re.search(r"OpTimeMeasure: 1 calls of 1 ops, measured [^\n]*\); 3 raised by the op itself, not timed "
                     r"\(torch\.Tensor\.matmul: 3\)\n", reporting.unwrapped(logged()))
    # 1 timed and 3 raised: the 4 calls handled
    assert reporting.unwrapped(timer.closing_line()).startswith(
        "OpTimeMeasure: 4 calls of 2 ops handled (3 raised by the op itself, not timed); wrote 4 files")
    assert timer.verdict() == "clean"  # the op's own error is the user's, no call the tool failed to time


def test_lists_choose_the_ops_timed(sim, monkeypatch):
    monkeypatch.setenv("OP_TIME_MEASURE_LIST", r"torch\.nn\.functional\..*")
    monkeypatch.setenv("OP_TIME_MEASURE_DISABLE_LIST", "torch.nn.functional.silu")
    x = torch.randn(4, 8, device=sim)
    w = torch.randn(3, 8, device=sim)
    with op_tools.OpTimeMeasure() as timer:
        torch.nn.functional.silu(torch.nn.functional.linear(x, w) * 2)
    assert set(timer.measurements.totals) == {"torch.nn.functional.linear"}


def test_per_call_tables_keep_the_original_columns_when_verbose(sim, monkeypatch, logged):
    monkeypatch.setenv("OP_TOOLS_VERBOSE", "1")
    w = torch.randn(3, 4, device=sim, requires_grad=True)
    with op_tools.OpTimeMeasure():
        torch.nn.functional.linear(torch.randn(2, 4, device=sim), w).sum().backward()
    out = logged()
    for column in ("forward_id", "forward_elasped", "backward_elasped", "unit", "requires_grad"):
        assert column in out
    assert "torch.nn.functional.linear    forward_id" in out and "| inputs[0] " in out


def _count_synchronize(monkeypatch) -> list:
    """Every torch.sim.synchronize call, recorded (the real one still runs)."""
    calls = []
    real = torch.sim.synchronize

    def counting(device=None):
        calls.append(device)
        return real(device)

    monkeypatch.setattr(torch.sim, "synchronize", counting)
    monkeypatch.setattr("op_tools.numerics.device_timing._synchronizers", {})
    return calls


def test_calls_are_timed_with_events_on_the_stream_and_no_synchronisation_per_call(sim, monkeypatch, logged):
    synchronised = _count_synchronize(monkeypatch)
    recorded = []
    real_record = torch.sim.Event.record
    monkeypatch.setattr(torch.sim.Event, "record", lambda self, stream=None: (recorded.append(stream),
                                                                               real_record(self, stream))[1])
    w = torch.randn(3, 8, device=sim, requires_grad=True)
    x = torch.randn(4, 8, device=sim)
    with op_tools.OpTimeMeasure() as timer:
        for _ in range(5):
            torch.nn.functional.linear(x, w).relu().sum().backward()
    m = timer.measurements
    assert synchronised == []  # not once: the events are waited for, the device never is
    assert all(s is torch.sim.current_stream(sim) for s in recorded)  # on the op's stream
    # the drain, the origin and the probe (device_timing.EventClock), then two per span
    assert len(recorded) == 3 + 2 * (len(m.records) + len(m.backward_spans))
    assert [r.name for r in m.records[:3]] == ["torch.nn.functional.linear", "torch.Tensor.relu", "torch.Tensor.sum"]
    assert len(m.records) == 15 and all(r.forward_ns > 0 for r in m.records)
    assert len(m.backward_spans) == 15 and all(duration > 0 for _, _, duration, _ in m.backward_spans)
    assert all(r.backward_ns > 0 for r in m.records)
    assert "timed with timing events (torch.sim.Event) on the op's stream" in logged()


def test_sync_option_times_between_synchronisations(sim, monkeypatch, logged):
    monkeypatch.setenv("OP_TIME_MEASURE_SYNC", "1")
    synchronised = _count_synchronize(monkeypatch)
    w = torch.randn(3, 8, device=sim, requires_grad=True)
    x = torch.randn(4, 8, device=sim)
    with op_tools.OpTimeMeasure() as timer:
        torch.nn.functional.linear(x, w).sum().backward()
    m = timer.measurements
    assert len(m.records) == 2 and len(m.backward_spans) == 2
    assert len(synchronised) == 2 * 4  # before and after each forward and each backward span
    assert all(r.forward_ns > 0 and r.backward_ns > 0 for r in m.records)
    assert "timed with synchronisations of the device around each call" in logged()
    monkeypatch.setenv("OP_TIME_MEASURE_SYNC", "maybe")
    with pytest.raises(ValueError, match="OP_TIME_MEASURE_SYNC='maybe'.*expected 0 or 1"):
        op_tools.OpTimeMeasure().start()


def test_a_device_without_timing_events_is_timed_between_synchronisations(sim, monkeypatch, logged):
    def no_timing(*args, **kwargs):
        raise RuntimeError("this backend has no timing events")

    monkeypatch.setattr(torch.sim, "Event", no_timing)
    synchronised = _count_synchronize(monkeypatch)
    x = torch.ones(4, device=sim)
    with op_tools.OpTimeMeasure() as timer:
        x + 1
    assert timer.measurements.totals["torch.Tensor.add"].calls == 1 and len(synchronised) == 2
    assert "timed with synchronisations of the device" in logged()


def test_pending_spans_are_read_in_batches_and_all_at_stop(sim, monkeypatch):
    monkeypatch.setattr("op_tools.tools.time_measure.MAX_PENDING", 4)
    monkeypatch.setattr("op_tools.tools.time_measure.RESOLVE_BATCH", 3)
    x = torch.ones(4, device=sim)
    seen = []
    with op_tools.OpTimeMeasure() as timer:
        for _ in range(10):
            x = x + 1
            seen.append((len(timer.measurements.records), len(timer.measurements.pending)))
    assert [n for n, _ in seen] == [0, 0, 0, 0, 3, 3, 3, 6, 6, 6]  # three at a time once more than 4 wait
    assert max(p for _, p in seen) <= 4
    assert len(timer.measurements.records) == 10 and not timer.measurements.pending
    ids = [r.forward_id for r in timer.measurements.records]
    assert ids == sorted(ids)


def test_each_timed_call_is_a_named_range_in_a_running_profiler(sim):
    x = torch.ones(64, device=sim)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        with op_tools.OpTimeMeasure():
            torch.nn.functional.silu(x)
    names = {event.key for event in profile.key_averages()}
    assert "torch.nn.functional.silu" in names
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        torch.nn.functional.silu(x)
    assert "torch.nn.functional.silu" not in {event.key for event in profile.key_averages()}


@pytest.mark.parametrize("sync", ["1", "0"])
def test_a_failing_synchronize_is_reported_once_and_the_ops_still_run(sim, monkeypatch, caplog, sync):
    def broken(device=None):
        raise RuntimeError("driver gone")

    monkeypatch.setenv("OP_TIME_MEASURE_SYNC", sync)
    monkeypatch.setattr(torch.sim, "synchronize", broken)
    monkeypatch.setattr("op_tools.numerics.device_timing._synchronizers", {})
    x = torch.ones(4, device=sim)
    with caplog.at_level(logging.WARNING, logger="op_tools"), op_tools.OpTimeMeasure() as timer:
        y = (x + 1) + 1
    assert torch.equal(y.cpu(), torch.full((4,), 3.0))
    assert timer.measurements.totals["torch.Tensor.add"].calls == 2
    # with timing events the device's synchronize is never called
    assert sum("driver gone" in r.getMessage() for r in caplog.records) == (1 if sync == "1" else 0)
    monkeypatch.setenv("OP_TOOLS_STRICT", "1")
    if sync == "1":
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


def _info_rows(tmp_path):
    (calls_file,) = _result_files(tmp_path, "info")
    with open(calls_file, newline="") as f:
        return list(csv.DictReader(f)), f.name


def test_max_cache_size_appends_the_calls_as_they_come_and_every_time_measured_is_in_the_file(sim, tmp_path):
    # OP_TOOLS_MAX_CACHE_SIZE, the original's: the per-call CSV grows as the run goes. A call's row waits for its
    # backward; a backward timed after its call's row went out is a row of its own (forward columns empty). Every
    # call and every backward measured is in the file, once.
    w = torch.randn(16, 16, device=sim, requires_grad=True)
    with op_tools.OpTimeMeasure(max_cache_size=20) as timer:
        train_llama(sim, steps=3)
        written, _ = _info_rows(tmp_path)
        assert len(written) > 100  # before stop(), in the file
        kept = (w * 2).sum()  # its backward comes after a later step's calls sent its rows out
        torch.optim.SGD([w], lr=0.1).step()
        for _ in range(30):
            torch.sigmoid(w)
        kept.backward()
    rows, name = _info_rows(tmp_path)
    assert open(name).read().count("name,forward_id,") == 1 and tuple(rows[0]) == CALL_COLUMNS
    m = timer.measurements
    calls = [r for r in rows if r["forward_elasped"]]
    assert sorted(int(r["forward_id"]) for r in calls) == sorted(r.forward_id for r in m.records)
    backward: dict[int, float] = {}
    for r in rows:
        if r["backward_elasped"]:
            backward[int(r["forward_id"])] = backward.get(int(r["forward_id"]), 0.0) + float(r["backward_elasped"])
    timed = {r.forward_id: r.backward_ns / 1e6 for r in m.records if r.backward_ns is not None}
    assert backward.keys() == timed.keys() and len(timed) > 100
    assert all(abs(backward[k] - timed[k]) < 1e-5 for k in timed)
    late = [r for r in rows if not r["forward_elasped"]]
    assert {r["name"] for r in late} == {"torch.Tensor.mul", "torch.Tensor.sum"} and all(r["grad_inputs"] for r in late)
    assert timer.tally.files == 4


def test_op_tools_max_cache_size_leaves_the_calls_timed_before_a_run_dies(tmp_path):
    script = ("import os, torch, ditorch, op_tools\n"
              "x = torch.randn(8, device='cuda')\n"
              "op_tools.OpTimeMeasure().start()\n"
              "for _ in range(30):\n"
              "    torch.sigmoid(x)\n"
              "os._exit(0)  # as a kernel's crash or a kill: no stop(), no exit handlers\n")
    env = child_env({"DITORCH_BACKEND": "sim", "DITORCH_QUIET": "1", "OP_TOOLS_MAX_CACHE_SIZE": "10",
                     "OP_TOOLS_RESULTS_DIR": str(tmp_path / "results")}, drop=("OP_",))
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=300)
    (path,) = (tmp_path / "results" / "op_time_measure_result").glob("op_elasped_info_pid*.csv")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) >= 20 and {r["name"] for r in rows} == {"torch.sigmoid"}
    assert all(float(r["forward_elasped"]) > 0 for r in rows)


@pytest.mark.gpu
def test_llama_step_on_cuda(tmp_path):
    from op_tools.numerics.device_timing import EventClock

    timer, wall = _timed_llama_step("cuda", tmp_path)
    _check_llama_step(timer, wall, tmp_path)
    assert all(type(clock) is EventClock for clock in timer._clocks.values())  # CUDA's events, not synchronising


TWO_DEVICE_NAMES = """
import torch, ditorch, op_tools
x = torch.randn(4, 16, device="cuda")
with op_tools.OpTimeMeasure():
    x.sin()
    torch.zeros(3, device=torch.device("sim")).add(1)  # the same device by its own name: torch.sim.Event times it
"""


def test_the_summary_says_timing_events_once_when_a_device_has_two_names(tmp_path):
    done = subprocess.run([sys.executable, "-c", TWO_DEVICE_NAMES], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env=child_env({"DITORCH_BACKEND": "sim", "DITORCH_QUIET": "1"},
                                                     drop=("OP_",)))
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("timed with ")]
    assert line == "timed with timing events (torch.cuda.Event, torch.sim.Event) on the op's stream"
