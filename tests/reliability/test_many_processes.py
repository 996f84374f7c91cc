"""Many processes: under ``torchrun --nproc_per_node=2`` on sim each tool writes per-rank results, and the
collectives (all_reduce, all_gather, reduce_scatter, broadcast) are captured and timed by name."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

from conftest import ROOT, SCRIPTS, script_env

from op_tools.tools.capture import load_op_args

NAMES = ["torch.distributed.all_reduce", "torch.distributed.all_gather", "torch.distributed.reduce_scatter",
         "torch.distributed.broadcast"]


def test_collectives_are_captured_and_timed_per_rank(tmp_path, sim):
    results = tmp_path / "results"
    env = script_env(DITORCH_BACKEND="sim", OP_TOOLS_RESULTS_DIR=str(results), OP_TOOLS_VERBOSE="0")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               os.path.join(SCRIPTS, "collectives_under_tools.py")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for rank in (0, 1):
        captured = results / "op_capture_results" / f"rank{rank}"
        assert sorted(n for n in os.listdir(captured) if not n.startswith("index_")) == sorted(NAMES)
        inputs = [os.path.join(d, n) for d, _, ns in os.walk(captured / "torch.distributed.all_reduce") for n in ns
                  if n == "input.pth"]
        assert load_op_args(inputs[0])["args"][0].tolist() == [rank + 1.0] * 4  # before the reduction
        timings = list((results / "op_time_measure_result" / f"rank{rank}").glob("op_elasped_summary_*.csv"))
        with open(timings[0], newline="") as f:
            assert sorted(row["name"] for row in csv.DictReader(f)) == sorted(NAMES)
        assert list((results / "op_autocompare_result" / f"rank{rank}").glob("op_autocompare_info_*.csv"))
