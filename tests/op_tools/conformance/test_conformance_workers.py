"""Worker processes and the command's errors: a kernel that kills its process or hangs is a crash and the sweep
goes on; random ops are skipped; a missing expecttest, an unknown device or a bad variable stop with a message."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch
from cli_runs import command, environment, explain, run

from op_tools.offline.conformance.results import CSV_FILE, read_csv

pytest.importorskip("expecttest", reason="the conformance sweep needs expecttest (pip install 'ditorch[conformance]')")
pytestmark = pytest.mark.children_import("op_db")  # cli_runs: the command's workers forked from it


def test_a_killed_or_hung_worker_is_a_crash_and_the_sweep_goes_on(tmp_path):
    # In op_db's order: conformance_test_noise (added for this test: its output is random, no table names it), abs,
    # neg (kills its own process on the device: a crashing kernel; a fresh worker takes over), sin, zeros, where
    # (sleeps a minute: a hang, killed at the 3 s timeout). Forked workers, as in the other sweeps here: the pool
    # watches and kills a spawned one through the same Process calls (test_a_missing_expecttest[spawn] spawns the
    # workers, and benchmarks/conformance_sweep.py runs a spawned sweep to its end in test_benchmarks_run)
    setups = ("--setup", "conformance_setups:sim_with_killing_neg", "--setup", "conformance_setups:add_random_opinfo")
    result = run("--device", "sim", *setups, "--ops", "abs,neg,sin,zeros,where,conformance_test_noise",
                 "--dtypes", "float32", "--timeout", "3", "--output", str(tmp_path / "run"),
                 env={"DITORCH_SIM_FAULTS": "where:slow=60000"}, cwd=str(tmp_path))
    assert result.returncode == 3, explain(result)  # a kernel that kills or hangs its worker is a device fault
    rows = {(r.op, r.direction): r for r in read_csv(os.path.join(tmp_path, "run", CSV_FILE))}
    assert {key: r.status for key, r in rows.items()} == {
        ("conformance_test_noise", "forward"): "skipped", ("conformance_test_noise", "backward"): "skipped",
        ("abs", "forward"): "pass", ("abs", "backward"): "pass",
        ("neg", "forward"): "crash", ("neg", "backward"): "crash",
        ("sin", "forward"): "pass", ("sin", "backward"): "pass",
        ("zeros", "forward"): "pass", ("zeros", "backward"): "skipped",
        ("where", "forward"): "crash", ("where", "backward"): "crash",
    }
    assert rows[("neg", "forward")].detail == "the worker died from signal SIGKILL in sample 0 (forward)"
    assert rows[("where", "forward")].detail == "timed out after 3 s in sample 0 (forward) (the worker was killed)"
    assert rows[("where", "forward")].reproduce.endswith("--ops where --dtypes float32 --sample 0")
    assert rows[("zeros", "backward")].detail == "no autograd: the OpInfo does not support it"
    assert rows[("conformance_test_noise", "forward")].detail.startswith("random: two CPU runs")
    assert "crash: neg float32: the worker died from signal SIGKILL" in result.stderr


@pytest.mark.fresh_interpreter  # the suite's forked children have imported op_db, expecttest with it
@pytest.mark.parametrize("start", ["spawn", "fork"])  # the worker's import fails, or the command's own
def test_a_missing_expecttest_is_named_with_the_extra_that_installs_it(tmp_path, start):
    stub = tmp_path / "without_expecttest"  # first on the path: `import expecttest` fails as if it were not installed
    stub.mkdir()
    (stub / "expecttest.py").write_text("raise ModuleNotFoundError('No module named expecttest', name='expecttest')\n")
    env = environment()
    env["PYTHONPATH"] = os.pathsep.join([str(stub), env["PYTHONPATH"]])
    result = subprocess.run(command("--start-method", start, "--device", "cpu", "--ops", "abs", "--output",
                                    str(tmp_path / "run")),
                            env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, explain(result)
    assert "pip install expecttest" in result.stderr and "ditorch[conformance]" in result.stderr


def test_a_device_torch_does_not_know_asks_for_the_setup_that_registers_it(tmp_path):
    result = run("--device", "tpu", "--ops", "abs", cwd=str(tmp_path), timeout=120)
    assert result.returncode == 2, explain(result)
    assert "--device 'tpu' is not a device torch knows" in result.stderr and "--setup" in result.stderr


def test_ditorch_backend_sim_alone_runs_the_sweep_on_sim(tmp_path):
    # no --device, no --setup: DITORCH_BACKEND=sim names the device, which implies ditorch.sim:register
    result = run("--ops", "abs", "--dtypes", "float32", "--limit-samples", "2", "--output", str(tmp_path / "run"),
                 env={"DITORCH_BACKEND": "sim"}, cwd=str(tmp_path), timeout=120)
    assert result.returncode == 0, explain(result)
    assert "DITORCH_BACKEND=sim: each worker runs --setup ditorch.sim:register" in result.stdout
    rows = read_csv(os.path.join(tmp_path, "run", CSV_FILE))
    assert [(r.device, r.direction, r.status) for r in rows] == [("sim", "forward", "pass"),
                                                                ("sim", "backward", "pass")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is the accelerator found here")
def test_without_an_accelerator_the_device_must_be_named(tmp_path):
    result = run("--ops", "abs", cwd=str(tmp_path), timeout=120)
    assert result.returncode == 2, explain(result)
    assert "no accelerator found: name the device with --device" in result.stderr


def test_a_malformed_tolerance_variable_is_named_before_anything_runs(tmp_path):
    result = run("--device", "cpu", env={"AUTOCOMPARE_ERROR_TOLERANCE_FLOAT32": "tight"}, cwd=str(tmp_path),
                 timeout=120)
    assert result.returncode == 2, explain(result)
    assert "AUTOCOMPARE_ERROR_TOLERANCE_FLOAT32='tight'" in result.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_correctly_rounded_ops_pass_as_the_detected_accelerator(tmp_path):
    # no --device: the accelerator torch.accelerator reports; add, mul and relu are exact in float32 on CUDA.
    # Spawned workers: CUDA cannot run in a forked one (the command refuses fork, tested below).
    result = run("--start-method", "spawn", "--ops", "add,mul,nn.functional.relu", "--dtypes", "float32",
                 "--limit-samples", "4", "--output", str(tmp_path / "run"), cwd=str(tmp_path))
    assert result.returncode == 0, explain(result)
    rows = read_csv(os.path.join(tmp_path, "run", CSV_FILE))
    assert {r.device for r in rows} == {"cuda"} and len(rows) == 6 and {r.status for r in rows} == {"pass"}


def test_forked_workers_are_refused_for_cuda_and_an_unknown_start_method_is_named(capsys):
    from op_tools.offline.conformance import cli
    from op_tools.offline.conformance.workers import WorkerConfig

    assert cli.main(["--device", "cuda", "--start-method", "fork", "--ops", "abs"]) == 2
    assert capsys.readouterr().err.startswith("conformance: --start-method fork cannot run CUDA: ")
    with pytest.raises(ValueError, match="start method 'forkserver': expected one of spawn, fork"):
        WorkerConfig("sim", start="forkserver")
