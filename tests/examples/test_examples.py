"""Every script in examples/ runs as a user runs it (a fresh interpreter, from another folder) and says what it should.

No accelerator here: the scripts run on the simulated device, either forced (``DITORCH_BACKEND=sim``,
where the script addresses the device as ``"cuda"``) or picked because ditorch found none.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys

import pytest
from subprocess_env import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
TIME_LIMIT_S = 120  # each script takes 5 to 20 s on a 2-core machine; the limit catches hangs, not slowness


def run_example(script: str, *args: str, cwd, env: dict | None = None, expect_status: int = 0):
    """Run ``examples/<script>`` in ``cwd`` with a clean environment (plus ``env``); return its stdout."""
    clean = child_env({"PYTHONUNBUFFERED": "1"}, drop=("DITORCH_", "OP_", "AUTOCOMPARE_"))
    clean = {k: v for k, v in clean.items() if "_AUTOCOMPARE_" not in k and not k.endswith("_OP_DTYPE_CAST_DICT")}
    clean.update(env or {})
    process = subprocess.run([sys.executable, os.path.join(EXAMPLES, script), *args], cwd=cwd, env=clean,
                             capture_output=True, text=True, timeout=TIME_LIMIT_S)
    assert process.returncode == expect_status, process.stdout[-3000:] + process.stderr[-3000:]
    return process.stdout


def test_cuda_written_training_script_runs_unmodified_on_sim(tmp_path):
    out = run_example("cuda_training.py", "--steps", "2", cwd=tmp_path, env={"DITORCH_BACKEND": "sim"})
    assert len(re.findall(r"^loss \d \d+\.\d+$", out, re.M)) == 2
    assert "checkpoint reloaded on cuda:0: outputs equal True" in out


def test_find_wrong_op_names_the_faulty_op_and_fallback_restores_the_cpu_losses(tmp_path):
    # Not the script's default fault (gelu, run by the demo test): the name comes from the comparison.
    out = run_example("find_wrong_op.py", cwd=tmp_path,
                      env={"DITORCH_BACKEND": "sim", "DITORCH_SIM_FAULTS": "rsqrt:noise=1e-3"})
    drift = float(re.search(r"^loss on the device +[\d. ]+max difference (\S+)$", out, re.M).group(1))
    assert drift > 1e-5
    assert "wrong op: torch.rsqrt (forward" in out
    assert "OP_FALLBACK_LIST=torch.rsqrt" in out
    assert re.search(r"^loss on the device, fallback +[\d. ]+max difference 0\.0e\+00$", out, re.M)
    assert "losses equal to the CPU's: True" in out


def test_where_time_goes_puts_the_slow_op_first_and_writes_a_trace(tmp_path):
    # 100 ms per softmax rather than the script's 20: with the other test worker busy beside it, every other op of
    # the step slows down several times (on a quiet machine the 20 ms make softmax over half of the time)
    out = run_example("where_time_goes.py", cwd=tmp_path,
                      env={"DITORCH_BACKEND": "sim", "DITORCH_SIM_FAULTS": "_softmax:slow=100"})
    assert re.search(r"^slowest op: torch\.softmax \(\d+\.\d%", out, re.M)
    folder = re.search(r"^OpTimeMeasure results in (\S+):$", out, re.M).group(1)
    summary = re.search(r"^  summary: (\S+)$", out, re.M).group(1)
    with open(tmp_path / folder / summary, newline="") as f:
        assert next(csv.DictReader(f))["name"] == "torch.softmax"
    trace = re.search(r"^trace with \d+ spans: (\S+)", out, re.M).group(1)
    with open(tmp_path / trace) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    assert any(e["name"] == "torch.softmax" and e["ph"] == "X" for e in events)


def test_capture_then_replay_offline_passes_on_a_correct_device(tmp_path):
    out = run_example("capture_and_replay.py", cwd=tmp_path, env={"DITORCH_BACKEND": "sim"})
    assert re.search(r"^captured 8 files under \S+torch\.nn\.functional\.gelu", out, re.M)
    assert "| all pass |" in out
    assert "2 entries: 2 ok, 0 mismatch, 0 error" in out
    assert "replay exit status: 0" in out


def test_capture_then_replay_reproduces_a_faulty_kernel(tmp_path):
    out = run_example("capture_and_replay.py", cwd=tmp_path, expect_status=3,
                      env={"DITORCH_BACKEND": "sim", "DITORCH_SIM_FAULTS": "gelu:noise=1e-2"})
    assert "| mismatch |" in out and "FAIL: output" in out  # the failed check named at 100 columns too
    assert "2 entries: 0 ok, 2 mismatch, 0 error" in out
    assert "replay exit status: 3 (a call mismatched or raised)" in out


def test_apply_feature_acts_only_on_calls_meeting_the_condition(tmp_path):
    out = run_example("apply_feature_condition.py", cwd=tmp_path)  # no accelerator: the script picks sim
    assert "linear calls: 2 printed (input wider than 64), 9 not" in out
    assert len(re.findall(r"^torch\.nn\.functional\.linear    forward_id: \d+$", out, re.M)) == 2
    assert len(re.findall(r"^torch\.nn\.functional\.gelu    forward_id: \d+$", out, re.M)) == 2  # fallback tables
    assert re.search(r"\|\s+cpu_outputs\[0\]\s+\|", out)  # the fallback's table, the op named above it


def test_op_statistics_counts_ops_and_shapes_for_the_given_input_size(tmp_path):
    out = run_example("op_statistics.py", "--batch", "4", "--seq", "32", cwd=tmp_path)
    assert "batch 4 x seq 32, hidden 64, 2 layers, on sim" in out
    assert re.search(r"^\| torch\.nn\.functional\.linear +\| 11 +\| 4 +\| \[0\]:\[4, 32, 64\] \[1\]:\[128, 64\]",
                     out, re.M)
    log = re.search(r"^PyTorch operator input log format: (\S+)$", out, re.M).group(1)
    text = (tmp_path / log).read_text()
    assert "Operator: torch.nn.functional.gelu\ncnt: 2, ((T([4, 32, 128], f32),), {'approximate': 'tanh'})" in text


@pytest.mark.slow
def test_demo_tells_the_whole_story_on_sim(tmp_path):
    out = run_example("demo.py", cwd=tmp_path)  # what `make demo` runs
    sections = ["1. Train 4 steps on sim", "2. OpAutoCompare", "3. OpFallback", "4. OpTimeMeasure", "Files written"]
    positions = [out.index(f"=== {s}") for s in sections]
    assert positions == sorted(positions)
    story = out[positions[0]:]
    assert "DITORCH_SIM_FAULTS='gelu:noise=1e-2'" in out
    assert "some op on sim computes wrong" in story
    assert re.search(r"^\| 1 +\| torch\.nn\.functional\.gelu +\| forward", story, re.M)
    fixed = story[positions[2] - positions[0]:positions[3] - positions[0]]
    assert fixed.count("0 (identical)") == 4
    for label in ("OpTimeMeasure: trace", "OpAutoCompare: every comparison", "the tools' full console output"):
        path = re.search(rf"^{re.escape(label)}.*:\n  (\S+)$", out, re.M).group(1)
        assert (tmp_path / path).is_file(), label
    assert re.search(r"^demo done in \d+ s", out, re.M)
    # the counts the READMEs and the quickstart quote are the demo's (they had drifted: 294 and 61 quoted)
    (counts,) = re.findall(r"^forward: \d+ calls compared, \d+ failed; backward: \d+ compared, \d+ failed$", out, re.M)
    for doc in ("README.md", "README_zh.md", os.path.join("docs", "quickstart.md")):
        with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
            assert f"\n{counts}\n" in f.read(), doc


@pytest.mark.slow
def test_demo_on_a_detected_accelerator_injects_nothing_and_finds_nothing(tmp_path):
    # DITORCH_BACKEND=sim stands in for a detected accelerator: the demo addresses it as "cuda".
    out = run_example("demo.py", cwd=tmp_path, env={"DITORCH_BACKEND": "sim"})
    assert 'accelerator found: sim (ditorch maps "cuda" onto it); no fault is injected' in out
    assert "identical: sim computes what the CPU computes" in out
    assert "no op failed: every op matches the float64 CPU reference." in out
    assert "=== 3. OpFallback: nothing to fall back ===" in out
    assert "=== 4. OpTimeMeasure" in out and "OP_FALLBACK_LIST" not in out
