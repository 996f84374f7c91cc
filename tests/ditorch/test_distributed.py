"""init_process_group("nccl") and DDP on the sim device, two processes under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from subprocess_env import ROOT, child_env

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "ddp_cuda.py")


def test_ddp_over_nccl_on_sim_leaves_both_ranks_with_identical_parameters(tmp_path):
    env = child_env({"DITORCH_BACKEND": "sim", "DITORCH_QUIET": "1", "OMP_NUM_THREADS": "1"}, drop=("DITORCH_",))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", SCRIPT,
               str(tmp_path)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["backend"] for r in reports] == ["simccl", "simccl"]
    assert [r["device"] for r in reports] == ["cuda:0", "cuda:0"]  # shown as cuda; one sim device per process
    assert reports[0]["params"] == reports[1]["params"]
