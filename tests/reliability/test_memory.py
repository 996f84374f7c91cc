"""Memory: 50 training steps under OpAutoCompare and under OpTimeMeasure (both at once, in fresh processes).

Resident memory levels off (OpAutoCompare keeps nothing per step; OpTimeMeasure keeps one small record per call
for its CSV and trace, by design), and after ``stop()`` no CPU tensor made during the run is alive.
"""

from __future__ import annotations

import json

import pytest
from conftest import start_script

pytestmark = pytest.mark.children_import("transformers")  # their scripts train transformers models

STEPS = 50


def test_fifty_steps_level_off_and_leave_no_cpu_copies(tmp_path, capsys):
    processes = {tool: start_script("train_under_tools.py", f"memory-{tool}", str(STEPS),
                                    OP_TOOLS_RESULTS_DIR=str(tmp_path / tool), OP_TOOLS_VERBOSE="0")
                 for tool in ("OpAutoCompare", "OpTimeMeasure")}
    reports = {}
    for tool, process in processes.items():
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-2000:]
        reports[tool] = json.loads(out.strip().splitlines()[-1])
    with capsys.disabled():
        for tool, r in reports.items():
            rss = r["rss_mb"]  # after steps 10, 20, ..., 50
            print(f"\n{tool}: RSS after every 10 steps {[round(x, 1) for x in rss]} MB; growth over the last 30 "
                  f"steps {rss[-1] - rss[1]:.1f} MB; live CPU tensors {r['cpu_tensors_before']} before, "
                  f"{r['cpu_tensors_after']} after stop()")
    for tool, r in reports.items():
        assert r["cpu_tensors_after"] <= r["cpu_tensors_before"], (tool, r)  # no copy of the run kept alive
        rss = r["rss_mb"]
        # levels off: the last 30 steps grow by less than 0.2 MB a step (a leaked copy of each op's tensors
        # would be about 1 MB a step for this model)
        assert (rss[-1] - rss[1]) / 30 < 0.2, (tool, rss)
