"""examples/cuda_training.py, a CUDA-written script, runs on sim and computes what it computes on the host."""

from __future__ import annotations

import os
import subprocess
import sys

from subprocess_env import ROOT, child_env

EXAMPLE = os.path.join(ROOT, "examples", "cuda_training.py")


def _start(backend: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, EXAMPLE, "--steps", "4"],
                            env=child_env({"DITORCH_BACKEND": backend}, drop=("DITORCH_",)), cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_cuda_written_training_script_on_sim_matches_the_host_run():
    runs = {backend: _start(backend) for backend in ("sim", "cpu")}  # side by side: each is mostly import time
    out = {}
    for backend, process in runs.items():
        stdout, stderr = process.communicate(timeout=240)
        assert process.returncode == 0, stderr[-3000:]
        out[backend] = stdout.splitlines()
    losses = {backend: [line for line in lines if line.startswith("loss ")] for backend, lines in out.items()}
    assert len(losses["sim"]) == 4
    assert losses["sim"] == losses["cpu"]
    assert any(line.startswith("device sim allocated ") and " peak " in line for line in out["sim"])
    assert "checkpoint reloaded on cuda:0: outputs equal True" in out["sim"]
