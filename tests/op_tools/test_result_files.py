"""Every tool session writes its own files: sessions in the same second never overwrite each other."""

import os

import pytest
import torch

import op_tools


@pytest.mark.parametrize("tool, folder, pattern, env", [
    (op_tools.OpTimeMeasure, "op_time_measure_result", "op_elasped_info_pid*.csv", {}),
    (op_tools.OpAutoCompare, "op_autocompare_result", "op_autocompare_info_pid*.csv", {}),
    (op_tools.OpCapture, "op_capture_results", "summary_pid*.csv", {"OP_CAPTURE_MODE": "summary"}),
], ids=["time_measure", "autocompare", "capture_summary"])
def test_one_tool_per_step_keeps_every_sessions_file(sim, tmp_path, monkeypatch, tool, folder, pattern, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    x = torch.randn(4, 4, device=sim)
    stems = []
    for _ in range(4):  # four sessions, well within one second
        with tool() as session:
            torch.exp(x).sum()
        stems.append(session.stem)
    files = sorted((tmp_path / "results" / folder).glob(pattern))
    assert len(files) == 4, files
    assert len(set(stems)) == 4 and all(s.startswith(f"pid{os.getpid()}_") for s in stems)
