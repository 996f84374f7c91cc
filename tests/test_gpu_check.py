"""scripts/gpu_check.sh, run for real: what it does where it cannot check anything."""

import os
import subprocess

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.sh")


def _run(tmp_path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", SCRIPT], cwd=tmp_path, env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the script runs the whole check: make gpu-check")
def test_without_a_gpu_it_says_so_and_exits_0(tmp_path):
    done = _run(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no GPU" in done.stdout and "summary" not in done.stdout


def test_a_missing_dependency_is_named_and_the_check_stops(tmp_path):
    # A package on the caller's PYTHONPATH that cannot be imported: the script keeps PYTHONPATH, so it sees it.
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "prettytable.py").write_text("raise ImportError('simulated: not installed')\n")
    done = _run(tmp_path, PYTHONPATH=str(shadow))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "missing dependency: prettytable" in done.stdout


def test_the_steps_asked_for_alone_are_run_and_a_misspelt_one_is_named_before_any(tmp_path):
    # GPU_CHECK_DRY_RUN says each step it would run instead of running it, on any machine: the selection a short
    # device lease uses is checked here
    done = _run(tmp_path, GPU_CHECK_DRY_RUN="1", GPU_CHECK_STEPS="stay-on,autocompare")
    assert done.returncode == 0, done.stdout + done.stderr
    would = [line.split(":")[1].split()[-1] for line in done.stdout.splitlines()
             if line.startswith("gpu_check: would run")]
    assert would == ["autocompare", "stay-on"], done.stdout  # in the script's order
    everything = _run(tmp_path, GPU_CHECK_DRY_RUN="1")
    assert everything.stdout.count("gpu_check: would run") == 13, everything.stdout
    wrong = _run(tmp_path, GPU_CHECK_STEPS="stay-on,stay_on")
    assert wrong.returncode == 2 and "unknown step 'stay_on'" in wrong.stdout and "stay-on" in wrong.stdout, \
        wrong.stdout
    assert "would run" not in wrong.stdout
