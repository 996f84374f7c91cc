"""transformers' Trainer (through accelerate) and Lightning's Trainer(accelerator="gpu", devices=2, strategy="ddp"),
written for a CUDA node, run unchanged under torchrun (2 processes) on sim: the losses equal a single-process run on
the same global batch, within float32 reassociation."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from subprocess_env import ROOT, child_env

pytestmark = pytest.mark.children_import("transformers")  # their scripts train transformers models

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "trainers_llama.py")


def _losses(folder, trainer: str, rank: int) -> list:
    report = json.loads((folder / f"{trainer}.rank{rank}.json").read_text())
    assert "error" not in report, report.get("traceback")
    return report["losses"]


@pytest.mark.parametrize("trainer", ["hf", "lightning"])
def test_trainer_runs_unchanged_under_torchrun_on_sim_as_one_process(tmp_path, trainer):
    pytest.importorskip("lightning" if trainer == "lightning" else "accelerate")
    env = {"DITORCH_QUIET": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    single, ranks = tmp_path / "single", tmp_path / "ranks"
    single.mkdir(), ranks.mkdir()
    reference = subprocess.run([sys.executable, SCRIPT, str(single), trainer, "4"], capture_output=True, text=True,
                               env=child_env({**env, "DITORCH_BACKEND": "cpu"}, drop=("DITORCH_",)), timeout=240,
                               cwd=ROOT)
    assert reference.returncode == 0, reference.stderr[-3000:]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", SCRIPT,
               str(ranks), trainer]
    result = subprocess.run(command, env=child_env({**env, "DITORCH_BACKEND": "sim"}, drop=("DITORCH_",)),
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    expected = _losses(single, trainer, 0)
    assert len(expected) == 3
    rank0, rank1 = _losses(ranks, trainer, 0), _losses(ranks, trainer, 1)
    # transformers logs the loss averaged over the ranks; Lightning's step sees its own rank's: average them.
    losses = rank0 if trainer == "hf" else [(a + b) / 2 for a, b in zip(rank0, rank1)]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-5)
    devices = [json.loads((ranks / f"{trainer}.rank{rank}.json").read_text())["device"] for rank in (0, 1)]
    assert devices == [0, 1]  # each rank on its own device
