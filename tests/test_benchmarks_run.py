"""Every benchmark still runs: each script once, with the fewest rounds, in a subprocess (no timing asserted)."""

import os
import subprocess
import sys

import pytest
from subprocess_env import child_env

pytestmark = pytest.mark.children_import("transformers")  # their scripts train transformers models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# script -> (its fewest-rounds arguments, a line of its result table)
SMALLEST = {
    "sim_overhead.py": (["--rounds", "1", "--calls", "5"], "softmax"),
    "import_overhead.py": (["--rounds", "1", "--imports", "1"], "ditorch adds"),
    # --compiled (dynamo's import and a compilation: 12 s more) is left out: test_compiled_check covers the check
    "autocompare_cost.py": (["--rounds", "1", "--size", "tiny"], "OpAutoCompare / floor"),
    "time_measure_cost.py": (["--rounds", "1", "--steps", "1"], "OpTimeMeasure VERBOSE=0"),
    "overhead.py": (["--rounds", "1", "--work-rounds", "1", "--steps", "1", "--tools", "OpCapture,OpAutoCompare"],
                    "(d) OpAutoCompare, every op"),
    "capture_storage.py": (["--rounds", "1"], "dedup writes"),
    "record_cost.py": (["--rounds", "1", "--steps", "1", "--hidden", "64", "--layers", "1", "--seq", "16"],
                       "recording / not recorded"),
    # skips without CUDA; with a GPU, one tiny op
    "time_measure_vs_profiler.py": (["--rounds", "1", "--calls", "2", "--ops", "add"],
                                    "OpTimeMeasure per-op forward time against torch.profiler's kernel time"),
    "conformance_sweep.py": (["--ops", "abs,add", "--limit-samples", "1"], "pass rate 100.0% of 4 rows"),
    # the views whose backward is a kernel, and uninitialised memory: passed unseen once
    "blind_spots.py": (["--ops", "select,narrow,split,unbind,diagonal,__getitem__,mul,sum,empty_permuted",
                                    "--samples", "1", "--phase", "all"],
                                   "summary: blind_spots: 0 silent passes"),
    "autocompare_sensitivity.py": (["--ops", "silu,sdpa", "--numerics", "gpu"], "| sdpa | 0.003 | 0.0003 |"),
    "collective_checks_cost.py": (["--rounds", "1"], "(c) OpAutoCompare default"),
    # sim only: the CPU runs the same code, and each device doubles the script's time
    "training_monitor_cost.py": (["--size", "tiny", "--rounds", "1", "--steps", "1", "--devices", "sim"],
                                 "(c) TrainingMonitor(model=model, every=10)"),
    # the other two tools: test_stay_on_cost_on_the_cpu_has_every_tool_handle_the_cpus_calls
    "stay_on_cost.py": (["--size", "tiny", "--rounds", "1", "--steps", "1", "--tools", "OpCapture,TrainingMonitor"],
                        "summary: stay_on_cost: sim: OpCapture"),
    "engine_cost.py": (["--rounds", "1", "--steps", "1"], "summary: engine_cost: cpu tiny: engine, forward+backward"),
    "reduction_cost.py": (["--calls", "2", "--device", "sim"], "summary: reduction_cost: sim: three vector_norm"),
    # the clean run and the first fault's (each run is a training of its own)
    "self_check_detection.py": (["--size", "tiny", "--steps", "2", "--late-steps", "3", "--faults", "2"],
                                "summary: self_check_detection: tiny (clean): clean"),
}


def _is_script(name: str) -> bool:
    """A benchmark runs as a script; a helper the scripts share (device_charges.py) does not."""
    with open(os.path.join(ROOT, "benchmarks", name), encoding="utf-8") as f:
        return 'if __name__ == "__main__":' in f.read()


def test_every_benchmark_is_listed_here():
    scripts = [f for f in os.listdir(os.path.join(ROOT, "benchmarks")) if f.endswith(".py") and _is_script(f)]
    assert sorted(scripts) == sorted(SMALLEST)


def _run(script: str, tmp_path, *arguments: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``benchmarks/SCRIPT ARGUMENTS`` in a child run from ``tmp_path`` (its results there), which must exit 0."""
    env = child_env({"DITORCH_QUIET": "1", "OP_TOOLS_RESULTS_DIR": str(tmp_path), **(env or {})})
    result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *arguments],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


@pytest.mark.parametrize("script", sorted(SMALLEST))
def test_benchmark_runs(script, tmp_path):
    # import_overhead times new interpreters: its own children are not forked (tests/forked_python.py)
    arguments, expected = SMALLEST[script]
    result = _run(script, tmp_path, *arguments,
                  env={"TESTS_FORKED_PYTHON": "0"} if script == "import_overhead.py" else None)
    assert expected in result.stdout


@pytest.mark.parametrize("reference", ["cpu", "device"])
def test_the_blind_spot_sweep_finds_every_kernel_that_writes_an_input_it_only_reads(tmp_path, reference):
    # --kind scratch: every kernel scales the first input it only reads, then computes; abs's forward, tanh's backward
    # with its upstream gradient from the cache, index_add's gradient passed on and tensor_split's CPU indices once
    # passed unseen (the recheck took the write for a stale copy, or the upstream was copied after the backward).
    # With the reference on the device every backward here passed (its upstream kept after the kernel wrote it).
    result = _run("blind_spots.py", tmp_path, "--kind", "scratch", "--ops",
                  "abs,tanh,index_add,tensor_split", "--samples", "2", "--reference", reference)
    assert "samples with a fault: 6 in their forward, 6 in their backward" in result.stdout, result.stdout[-2000:]
    assert "summary: blind_spots: 0 silent passes" in result.stdout
    if reference == "device":  # the backwards judged there (a forward may need the CPU: tensor_split's CPU indices)
        assert "6 of the 6 in their backward" in result.stdout, result.stdout[-2000:]


def test_the_blind_spot_sweep_in_complex_finds_what_a_conjugate_view_or_a_broadcast_sum_hid(tmp_path):
    # logcumsumexp's reference gradient is a conjugate view, which the comparison's read as reals refused; add's
    # gradient summed over a broadcast was measured on the real view's pairs against a bound of one value per complex
    # element: both went not checked
    result = _run("blind_spots.py", tmp_path, "--dtype", "complex64", "--ops", "logcumsumexp,add", "--phase",
                  "backward")
    assert "samples with a fault: 6 in their backward" in result.stdout, result.stdout[-2000:]
    assert "0 wrong results the tool said it had not checked" in result.stdout, result.stdout[-2000:]
    assert "summary: blind_spots: 0 silent passes" in result.stdout


def test_the_blind_spot_sweep_of_overflow_check_finds_every_inf_a_kernel_gives(tmp_path):
    # norm.inf's order of inf was taken for a value put in its result (the inf a kernel gave excused: a silent pass);
    # ifft's result, a conjugate view, was counted not checked on sim (its wrapper did not carry the bit)
    result = _run("blind_spots.py", tmp_path, "--tool", "overflow", "--kind", "inf", "--ops",
                  "norm.inf,fft.ifft", "--phase", "forward", "--samples", "1")
    assert "samples with a fault: 2 in their forward" in result.stdout, result.stdout[-2000:]
    assert "0 wrong results the tool said it had not checked" in result.stdout, result.stdout[-2000:]
    assert "summary: blind_spots: 0 silent passes" in result.stdout


def test_the_blind_spot_sweep_of_compare_runs_finds_each_faulted_recording(tmp_path):
    # a clean and a faulted run of each sample recorded (OP_CAPTURE_MODE=stats), then compared
    result = _run("blind_spots.py", tmp_path, "--tool", "compare_runs", "--ops", "abs,tanh",
                  "--phase", "all", "--samples", "1")
    assert "samples with a fault: 2 in their forward, 2 in their backward, 2 in their in-place" in result.stdout, \
        result.stdout[-2000:]
    assert "0 wrong results the tool said it had not checked" in result.stdout
    assert "summary: blind_spots: 0 silent passes" in result.stdout


def test_the_blind_spot_sweep_of_compare_runs_finds_every_kernel_that_writes_an_input_it_only_reads(tmp_path):
    # The gradient index_add, addcdiv and __rmod__ pass on unchanged kept the statistics it had when it arrived (3
    # silent passes); acosh in place was not checked, its input written by the recording's own faulted statistics:
    # the tools' kernels run unfaulted now. matrix_power's input takes its gradient in pieces, which autograd sums with
    # a kernel no tool judges: listed apart, as the docs' limit.
    result = _run("blind_spots.py", tmp_path, "--tool", "compare_runs", "--kind", "scratch", "--phase", "all",
                  "--ops", "index_add,addcdiv,__rmod__,acosh,linalg.matrix_power")
    assert "0 wrong results the tool said it had not checked" in result.stdout, result.stdout[-2000:]
    assert "summary: blind_spots: 0 silent passes" in result.stdout, result.stdout[-2000:]
    assert "1 faults in a backward whose input's gradient came in pieces" in result.stdout and \
        "the first linalg.matrix_power sample 1" in result.stdout, result.stdout[-2000:]


def test_the_blind_spot_sweep_of_the_offline_replay_checks_every_call_it_captured(tmp_path):
    # hardswish (which torch.overrides lists as ignored) and aten.slice.Tensor called directly were refused by the
    # replay (not checked); ones_like(x, device=...)'s CPU reference ran on the device, faulted too (a silent pass).
    # tanhshrink's gradient in pieces, which autograd sums unjudged by the tools that run with the program, is found
    # there: the replay compares the gradient autograd gave.
    result = _run("blind_spots.py", tmp_path, "--tool", "replay", "--phase", "all", "--dtype", "bfloat16",
                  "--numerics", "gpu", "--ops", "nn.functional.hardswish,slice,ones_like,nn.functional.tanhshrink")
    assert "samples with a fault: 11 in their forward, 8 in their backward" in result.stdout, result.stdout[-2000:]
    assert "0 wrong results the tool said it had not checked" in result.stdout, result.stdout[-2000:]
    assert "summary: blind_spots: 0 silent passes" in result.stdout


def test_self_check_detection_runs_over_two_ranks_and_names_the_faulty_one(tmp_path):
    # its --ranks 2 mode: a worker per rank under torchrun, a fault on rank 1 alone
    result = _run("self_check_detection.py", tmp_path, "--ranks", "2", "--size", "tiny", "--steps", "1")
    assert "summary: self_check_detection: tiny 2 ranks (clean): rank 0 0 findings, rank 1 0" in result.stdout
    faulty = next(line for line in result.stdout.splitlines() if line.startswith("mm:noise=1e-2,rank=1"))
    assert "rank 0: clean" in faulty and "rank 1: step 0: linear in model.layers.0.self_attn.q_proj" in faulty, faulty


def test_stay_on_cost_on_the_cpu_has_every_tool_handle_the_cpus_calls(tmp_path):
    # --device cpu is the proxy of a GPU's host work per call: a tool left to its default there handles no call
    # ("OpOverflowCheck: 0 calls of 0 ops handled", its ratio the mode's bare dispatch), which measured nothing
    result = _run("stay_on_cost.py", tmp_path, "--device", "cpu", "--size", "tiny", "--rounds", "1", "--steps", "1",
                  "--tools", "OpOverflowCheck,OpSelfCheck", "--profile", str(tmp_path / "profiles"))
    assert "summary: stay_on_cost: cpu: OpOverflowCheck" in result.stdout
    assert " 0 calls of 0 ops handled" not in result.stderr and "no call was checked" not in result.stderr, \
        result.stderr[-2000:]
    # --profile: a round per condition under cProfile, every thread's CPU time beside it (what gpu_check's profile
    # step brings back from a lent GPU)
    assert "where the host time goes" in result.stdout
    with open(tmp_path / "profiles" / "stay_on_cpu_OpOverflowCheck.txt") as f:
        profile = f.read()
    threads = profile.split("== the calling thread")[0]
    assert "CPU seconds per thread" in threads and ("python" in threads or "(no /proc)" in threads), profile[:2000]
    assert "overflow_check.py" in profile and "by cumulative" in profile
    assert os.path.exists(tmp_path / "profiles" / "stay_on_cpu_no_tool.txt")
