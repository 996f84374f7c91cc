"""FSDP2 (on a "cuda" mesh, and on its default mesh), FSDP1 (device_id a cuda device, and an ordinal) and tensor
parallel train a tiny transformers Llama under torchrun (2 processes), written for CUDA: losses and parameters equal
a single-process run on the same global batch, within float32 reassociation."""

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
import parallel_llama  # noqa: E402 - the script's own model and data, for the single-process reference

MODES = ("fsdp2", "fsdp2_default_mesh", "fsdp1", "fsdp1_current_device", "tp")


def single_process(global_batches: list) -> tuple[list, dict]:
    model = parallel_llama.tiny_llama()
    losses = parallel_llama.train(model, model.parameters(), global_batches, "cpu")
    return losses, parallel_llama.checksum(dict(model.named_parameters()))


@pytest.fixture(scope="module")
def references():
    data_parallel = [torch.cat(pair) for pair in zip(parallel_llama.batches(0), parallel_llama.batches(1))]
    return {"dp": single_process(data_parallel), "tp": single_process(parallel_llama.batches(0))}


@pytest.mark.parametrize("backend", ["sim", "cpu"])
def test_fsdp2_fsdp1_and_tensor_parallel_train_as_one_process(tmp_path, backend, references):
    env = child_env({"DITORCH_BACKEND": backend, "DITORCH_QUIET": "1", "OMP_NUM_THREADS": "1"}, drop=("DITORCH_",))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               os.path.join(SCRIPTS, "parallel_llama.py"), str(tmp_path), ",".join(MODES)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for mode in MODES:
        reports = [json.loads((tmp_path / f"{mode}.rank{rank}.json").read_text()) for rank in (0, 1)]
        errors = [r["traceback"] for r in reports if "error" in r]
        assert not errors, f"{mode}: {errors[0]}"
        expected_losses, expected_params = references["tp" if mode == "tp" else "dp"]
        if mode == "tp":  # both ranks compute the whole loss of the same batch
            losses = reports[0]["losses"]
            assert reports[1]["losses"] == losses
        else:  # each rank's loss is the mean over its half of the tokens: their mean is the global loss
            losses = [(a + b) / 2 for a, b in zip(reports[0]["losses"], reports[1]["losses"])]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-5, atol=1e-5,
                                   msg=lambda m, mode=mode: f"{mode} losses: {m}")
        for rank in (0, 1):
            params = reports[rank]["params"]
            assert sorted(params) == sorted(expected_params), mode
            torch.testing.assert_close(torch.tensor([params[k] for k in sorted(params)]),
                                       torch.tensor([expected_params[k] for k in sorted(params)]),
                                       rtol=1e-4, atol=1e-4, msg=lambda m, mode=mode: f"{mode} parameters: {m}")
