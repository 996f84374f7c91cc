"""A CUDA-written torchrun script (set_device(local_rank), init_process_group("nccl", device_id=...), DDP with
device_ids=[local_rank]) on sim and on the host, two processes: one device per rank, as on a real node; and DDP
finding unused parameters."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from subprocess_env import ROOT, child_env

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")
sys.path.insert(0, SCRIPTS)
from ddp_cuda import model_and_batches  # noqa: E402 - the script's own model and data, for the reference run


def single_process_params() -> torch.Tensor:
    """The two ranks' run done in one process: rank 0's weights, each step on both ranks' batches together."""
    model, batches0 = model_and_batches(0, 100)
    _, batches1 = model_and_batches(1, 101)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x0, x1 in zip(batches0, batches1):
        model(torch.cat([x0, x1])).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize(("backend", "ccl"), [("sim", "simccl"), ("cpu", "gloo")])
def test_torchrun_ddp_runs_one_device_per_rank_and_matches_one_process(tmp_path, backend, ccl):
    env = child_env({"DITORCH_BACKEND": backend, "DITORCH_QUIET": "1", "OMP_NUM_THREADS": "1"}, drop=("DITORCH_",))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               os.path.join(SCRIPTS, "ddp_cuda.py"), str(tmp_path)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["backend"] for r in reports] == [ccl, ccl]
    assert [r["device"] for r in reports] == ["cuda:0", "cuda:1"]  # shown as cuda, the rank's own device
    assert [r["device_count"] for r in reports] == [2, 2]  # one per local rank
    assert [r["current_device"] for r in reports] == [0, 1]  # ints, as CUDA's
    assert [r["as_device"] for r in reports] == ["cuda:0", "cuda:1"]
    assert reports[0]["params"] == reports[1]["params"]
    torch.testing.assert_close(torch.tensor(reports[0]["params"]), single_process_params(), rtol=1e-5, atol=1e-6)
    # find_unused_parameters=True (the reducer stages its map of used parameters in pinned memory): the same
    # training beside a layer never used, which gets no gradient
    assert [r["unused_grads"] for r in reports] == [[True, True], [True, True]]
    assert reports[0]["params_beside_unused"] == reports[1]["params_beside_unused"]
    torch.testing.assert_close(torch.tensor(reports[0]["params_beside_unused"]), single_process_params(), rtol=1e-5,
                               atol=1e-6)
    # torch.compile(DDP(model)) trains as the eager DDP module
    assert reports[0]["compiled_params"] == reports[1]["compiled_params"]
    torch.testing.assert_close(torch.tensor(reports[0]["compiled_params"]), single_process_params(), rtol=1e-5,
                               atol=1e-6)
