"""The conformance sweep on sim, through its command: a clean subset passes, injected faults are exactly the rows
that do not, a mismatch reruns alone and its saved inputs replay, two runs compare, a run resumes."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest
from browser import require_browser
from cli_runs import SIM, dump_dom, environment, explain, finish, run, start

from op_tools.offline.conformance.results import CSV_FILE, HTML_FILE, RESULTS_FILE, read_csv

pytest.importorskip("expecttest", reason="the conformance sweep needs expecttest (pip install 'ditorch[conformance]')")
pytestmark = pytest.mark.children_import("op_db")  # cli_runs: the command's workers forked from it

DTYPES, DIRECTIONS = ("float32", "bfloat16"), ("forward", "backward")
# 40 OpInfos, each claiming float32 and bfloat16 forward and backward on the CPU (so on sim).
OPS = ("abs exp log sin cos tanh sigmoid sqrt rsqrt reciprocal erf add sub mul div.no_rounding_mode pow maximum atan2 "
       "hypot sum mean amax var cumsum nn.functional.linear nn.functional.conv2d nn.functional.relu "
       "nn.functional.gelu nn.functional.silu softmax log_softmax nn.functional.layer_norm nn.functional.embedding "
       "nn.functional.cross_entropy nn.functional.mse_loss cat index_select gather where matmul").split()
# noise well above bfloat16's precision on two ops, a missing kernel on a third; none of their aten ops is
# called by another op of the list, forward or backward
FAULTS = "atan2:noise=0.1;hypot:noise=0.1;erf:unsupported"
SWEEP = (*SIM, "--ops", ",".join(OPS), "--dtypes", "float32,bfloat16")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The clean sweep and the same sweep with faults, run side by side (each is mostly worker start-up)."""
    base = tmp_path_factory.mktemp("conformance")
    folders = {"clean": str(base / "clean"), "faulty": str(base / "faulty")}
    processes = {"clean": start(*SWEEP, "--output", folders["clean"], cwd=str(base)),
                 "faulty": start(*SWEEP, "--output", folders["faulty"], env={"DITORCH_SIM_FAULTS": FAULTS},
                                 cwd=str(base))}
    results = {name: finish(process) for name, process in processes.items()}
    return {name: (results[name], folders[name], read_csv(os.path.join(folders[name], CSV_FILE)))
            for name in processes}


@pytest.mark.timeout(120)  # the claim: a 40-op subset, two dtypes, both directions, under 2 minutes on sim
def test_a_40_op_subset_passes_on_sim_in_float32_and_bfloat16_forward_and_backward(runs):
    result, _, rows = runs["clean"]
    assert result.returncode == 0, explain(result)
    assert {r.key for r in rows} == {(op, d, direction) for op in OPS for d in DTYPES for direction in DIRECTIONS}
    assert [r for r in rows if r.status != "pass"] == []
    assert all(r.samples >= 1 and r.failing == 0 for r in rows)
    assert "every op that ran passed" in result.stdout
    assert re.search(r"\|\s+all\s+\|\s+both\s+\|\s+160\s+\|\s+160\s+\|.*100\.0%", result.stdout), result.stdout


def test_injected_faults_are_exactly_the_rows_that_do_not_pass(runs):
    result, folder, rows = runs["faulty"]
    assert result.returncode == 3, explain(result)
    failing = {(r.op, r.dtype, r.direction): r.status for r in rows if r.status != "pass"}
    # noise in atan2's output leaves its gradients right (they do not use the output); hypot's use it
    assert failing == {
        **{("atan2", d, "forward"): "mismatch" for d in DTYPES},
        **{("hypot", d, direction): "mismatch" for d in DTYPES for direction in DIRECTIONS},
        **{("erf", d, direction): "unsupported" for d in DTYPES for direction in DIRECTIONS},
    }
    mismatch = next(r for r in rows if r.key == ("atan2", "float32", "forward"))
    assert mismatch.sample is not None and mismatch.output == "output[0]"
    assert mismatch.device_error > 0.05 > mismatch.cpu_error
    assert "error" in mismatch.detail and f"sample {mismatch.sample}" in mismatch.detail
    assert os.path.isfile(os.path.join(mismatch.inputs, "input.pth"))
    unsupported = next(r for r in rows if r.key == ("erf", "float32", "forward"))
    assert "SimUnsupportedError" in unsupported.detail and "erf" in unsupported.detail
    assert f"--ops erf --dtypes float32 --sample {unsupported.sample}" in unsupported.reproduce
    header = json.loads(open(os.path.join(folder, RESULTS_FILE)).readline())
    assert header["device"] == "sim" and header["ops"] == OPS


def test_a_mismatch_reruns_alone_and_its_saved_inputs_replay_with_run_op_from_data(runs, tmp_path):
    _, _, rows = runs["faulty"]
    mismatch = next(r for r in rows if r.key == ("atan2", "float32", "forward"))
    words = shlex.split(mismatch.reproduce)
    env = dict(w.split("=", 1) for w in words if re.match(r"^[A-Z_0-9]+=", w))
    assert env["DITORCH_SIM_FAULTS"] == FAULTS
    args = words[words.index("op_tools.conformance") + 1:]
    rerun = run(*args, "--output", str(tmp_path / "rerun"), env=env, cwd=str(tmp_path))
    assert rerun.returncode == 3, explain(rerun)
    line = rf"\|\s+{mismatch.sample}\s+\|\s+forward\s+\|\s+output\[0\]\s+\|\s+FAIL"
    assert re.search(line, rerun.stdout), rerun.stdout
    saved = re.search(r"inputs saved in OpCapture's format: (\S+)", rerun.stdout).group(1)
    assert {"input.pth", "output.pth"} <= set(os.listdir(saved))
    replay = subprocess.run([sys.executable, "-m", "op_tools.run_op_from_data", saved, "--acc_check"],
                            env=environment({"DITORCH_BACKEND": "sim", "DITORCH_SIM_FAULTS": FAULTS,
                                             "OP_TOOLS_RESULTS_DIR": str(tmp_path / "replay")}),
                            cwd=str(tmp_path), capture_output=True, text=True, timeout=120)
    assert replay.returncode == 3, explain(replay)
    assert "torch.atan2" in replay.stdout and "1 mismatch" in replay.stdout
    clean = subprocess.run([sys.executable, "-m", "op_tools.run_op_from_data", saved, "--acc_check"],
                           env=environment({"DITORCH_BACKEND": "sim", "OP_TOOLS_RESULTS_DIR": str(tmp_path / "r2")}),
                           cwd=str(tmp_path), capture_output=True, text=True, timeout=120)
    # a correct device passes against float64; only the output captured under the fault differs
    assert re.search(r"\|\s+FAIL: captured\s+\|", clean.stdout), explain(clean)


def test_compare_sets_two_runs_side_by_side(runs, tmp_path):
    _, clean, _ = runs["clean"]
    _, faulty, faulty_rows = runs["faulty"]
    result = run("--report", faulty, "--compare", os.path.join(clean, CSV_FILE), "--output", str(tmp_path),
                 cwd=str(tmp_path))
    assert result.returncode == 3, explain(result)
    assert "10 of 160 rows differ" in result.stdout
    differing = re.findall(r"\|\s+(atan2|hypot|erf)\s+\|\s+(\w+)\s+\|\s+(\w+)\s+\|\s+(\w+)\s+\|\s+pass\s+\|",
                           result.stdout)
    assert len(differing) == 10
    page = open(os.path.join(tmp_path, HTML_FILE), encoding="utf-8").read()
    assert '"other": "pass"' in page and '"other_label": "sim (conformance.csv)"' in page


def test_the_report_of_a_real_sweep_renders_and_filters_in_a_headless_browser(runs, tmp_path):
    browser = require_browser()
    _, faulty, rows = runs["faulty"]
    dom = dump_dom(browser, os.path.join(faulty, HTML_FILE), "status=mismatch,unsupported", str(tmp_path))
    shown = re.findall(r'<tr class="row status-(\w+)"><td class="op">([^<]+)</td>', dom)
    assert sorted(shown) == sorted((r.status, r.op) for r in rows if r.status != "pass")
    assert "showing 10 of 160 rows" in dom


def test_resume_runs_only_what_the_results_file_lacks(runs, tmp_path):
    _, clean, clean_rows = runs["clean"]
    folder = str(tmp_path / "run")
    shutil.copytree(clean, folder)
    path = os.path.join(folder, RESULTS_FILE)
    lines = open(path, encoding="utf-8").read().splitlines()
    kept = lines[:1 + 76]  # the header and 76 of the 80 op x dtype
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(kept) + '\n{"kind": "rows", "rows": [{"op": "matm')  # killed while writing a line
    result = run("--resume", folder, cwd=str(tmp_path))
    assert result.returncode == 0, explain(result)
    assert "4 op x dtype to run on sim (76 done before)" in result.stdout
    resumed = read_csv(os.path.join(folder, CSV_FILE))
    assert [r.key for r in resumed] == [r.key for r in clean_rows]
    assert all(r.status == "pass" for r in resumed)
    # the 76 done before are the recorded rows, not new runs
    before = {r.key: r.seconds for r in clean_rows[:152]}
    assert {r.key: r.seconds for r in resumed[:152]} == before
