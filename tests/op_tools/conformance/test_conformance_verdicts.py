"""The conformance account: each row compared (pass, mismatch), raised on the device (unsupported), not checked
(crash, unchecked) or skipped; "every op that ran passed" only when every row that ran was checked; exit 0 clean,
3 a row failed, 4 none failed but some were not checked, 5 the reports not written."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
import torch
from cli_runs import explain, run

from op_tools.offline.conformance import cli, report
from op_tools.offline.conformance.results import CSV_FILE, RESULTS_FILE, ResultsFile, Row, read_csv

pytest.importorskip("expecttest", reason="the conformance sweep needs expecttest (pip install 'ditorch[conformance]')")
pytestmark = pytest.mark.children_import("op_db")  # cli_runs: the command's workers forked from it


def _row(op, status, direction="forward", detail=""):
    return Row(op, "float32", direction, status, detail=detail, device="sim")


def test_samples_without_a_cpu_reference_make_an_unchecked_row_never_a_pass(sim):
    from torch.testing._internal.opinfo.core import OpInfo, SampleInput

    from op_tools.offline.conformance.case import CaseOptions, run_case

    def samples(op, device, dtype, requires_grad, **kwargs):
        for n in (3, 4):
            yield SampleInput(torch.linspace(-1, 1, n, device=device, dtype=dtype).requires_grad_(requires_grad))

    def op(x):
        if x.device.type == "cpu" and x.numel() == 4:  # the CPU cannot compute this sample: no reference
            raise RuntimeError("no CPU kernel for 4 elements")
        return torch.sin(x)

    opinfo = OpInfo("conformance_test_cpu_less", op=op, dtypes=(torch.float32,), sample_inputs_func=samples,
                    supports_autograd=True)
    forward, backward = run_case(opinfo, torch.float32, torch.device("sim"), CaseOptions()).rows
    for row in (forward, backward):
        assert row.status == "unchecked", row
        assert row.detail == ("1 of 2 samples not checked, the first: no CPU reference: RuntimeError: no CPU kernel "
                              "for 4 elements; 1 passed")
    assert report.verdict([forward, backward]) == "unchecked"


def test_the_summary_says_every_op_passed_only_when_every_row_that_ran_was_checked():
    clean = [_row("abs", "pass"), _row("zeros", "skipped", "backward", "no autograd")]
    assert report.summary(clean, "t").splitlines()[-1] == "every op that ran passed"
    unchecked = [*clean, _row("sin", "unchecked", detail="not run: the sweep stopped")]
    text = report.summary(unchecked, "t", saved=("CSV: c.csv",))
    assert "every op that ran passed" not in text
    assert text.splitlines()[-2:] == [
        "3 rows: 1 pass, 0 mismatch, 0 unsupported, 0 crash, 1 unchecked, 1 skipped",
        "WARNING: 1 rows not checked, the first sin float32 forward: not run: the sweep stopped"]
    found = [*unchecked, _row("erf", "unsupported", detail="RuntimeError: no kernel"),
             _row("neg", "crash", detail="the worker died from signal SIGKILL in sample 0 (forward)")]
    assert "2 rows failed (0 mismatch, 1 unsupported, 1 crash)" in report.summary(found, "t")
    assert [report.verdict(rows) for rows in (clean, unchecked, found)] == ["clean", "unchecked", "found"]
    skipped = [_row("silu", "skipped", detail="int32 not supported"), _row("silu", "skipped", "backward")]
    assert report.verdict(skipped) == "unchecked"  # nothing ran: "every op that ran passed" was vacuous, exit 0
    assert report.summary(skipped, "t").splitlines()[-1] == \
        "WARNING: no row ran (every one skipped): nothing was checked"


@pytest.mark.parametrize(("statuses", "status"), [(("pass", "skipped"), 0), (("skipped",), 4), (("pass", "crash"), 3),
                                                   (("pass", "unchecked"), 4), (("crash", "mismatch"), 3)])
def test_the_exit_status_tells_clean_from_failed_from_not_checked(tmp_path, statuses, status):
    results = ResultsFile(str(tmp_path / RESULTS_FILE))
    results.start({"device": "sim"})
    results.append([_row(f"op{i}", s) for i, s in enumerate(statuses)])
    assert cli.main(["--report", str(tmp_path)]) == status


def test_reports_that_cannot_be_written_exit_5_naming_the_folder(tmp_path, capsys):
    results = ResultsFile(str(tmp_path / RESULTS_FILE))
    results.start({"device": "sim"})
    results.append([_row("abs", "mismatch")])
    (tmp_path / "a_file").write_text("")  # a file where a folder should be: unwritable even for root
    blocked = tmp_path / "a_file" / "sub"
    assert cli.main(["--report", str(tmp_path), "--output", str(blocked)]) == 5
    assert capsys.readouterr().err.startswith(f"conformance: cannot write the reports in {blocked}: ")


_POOL_RUN = """
import pickle, sys
from op_tools.offline.conformance.case import CaseOptions
from op_tools.offline.conformance.workers import Task, WorkerConfig, WorkerPool

with WorkerPool(WorkerConfig("cpu", log_dir=sys.argv[1], start="fork"), timeout=60) as pool:
    result, = pool.run([Task("no_such_opinfo", "float32")], CaseOptions())
sys.stdout.buffer.write(pickle.dumps(result))
"""


def test_a_failure_of_the_tool_on_an_op_is_unchecked_not_a_crash(tmp_path):
    # The pool runs in a child forked from the suite's op_db server, and forks its worker from there: op_db is imported
    # once per session (a spawned pool, which imports it in its worker, is tested by test_conformance_workers).
    done = subprocess.run([sys.executable, "-c", _POOL_RUN, str(tmp_path)], capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-4000:]
    result = pickle.loads(done.stdout)
    assert result.status == "unchecked"
    assert result.crash.startswith("the conformance tool failed on this op (KeyError: 'no_such_opinfo'")
    settings = cli.Settings("cpu", (), None, ("float32",), None, True)
    assert [r.status for r in cli.crash_rows(result, settings, gradients=True)] == ["unchecked", "unchecked"]


def test_a_sweep_whose_device_is_gone_reports_what_ran_and_what_did_not_and_exits_3(tmp_path):
    # abs passes; neg kills its worker and leaves the device gone; sin never runs: no worker starts any more
    result = run("--device", "sim", "--setup", "conformance_setups:sim_gone_after_neg", "--ops", "abs,neg,sin",
                 "--dtypes", "float32", "--output", str(tmp_path / "run"),
                 env={"CONFORMANCE_TEST_GONE": str(tmp_path / "gone")}, cwd=str(tmp_path))
    assert result.returncode == 3, explain(result)  # the crash is found; the ops not run are not checked
    rows = {(r.op, r.direction): r for r in read_csv(os.path.join(tmp_path, "run", CSV_FILE))}
    assert {key: r.status for key, r in rows.items()} == {
        ("abs", "forward"): "pass", ("abs", "backward"): "pass", ("neg", "forward"): "crash",
        ("neg", "backward"): "crash", ("sin", "forward"): "unchecked", ("sin", "backward"): "unchecked"}
    assert rows[("sin", "forward")].detail.startswith("not run: the sweep stopped: a worker cannot run on 'sim': "
                                                      "RuntimeError: the device is gone")
    assert result.stdout.strip().splitlines()[-1].startswith(
        "WARNING: 2 rows not checked, the first sin float32 forward: not run: the sweep stopped")
    # what did not run is left to --resume
    assert {r.op for r in ResultsFile(os.path.join(tmp_path, "run", RESULTS_FILE)).read()[1]} == {"abs", "neg"}


def test_a_row_whose_samples_all_gave_empty_results_is_unchecked_never_a_pass(sim):
    # --limit-samples 4 takes only svd's empty samples (its first 20 are): its rows passed with no value compared
    from torch.testing._internal.common_methods_invocations import op_db

    from op_tools.offline.conformance.case import CaseOptions, run_case

    svd = next(o for o in op_db if o.name == "svd")
    rows = run_case(svd, torch.float32, torch.device("sim"), CaseOptions(limit_samples=4)).rows
    assert [(r.status, r.detail) for r in rows] == \
        [("unchecked", "the results of its 4 samples were empty: no value compared")] * 2
    assert report.verdict(rows) == "unchecked"
    absolute = next(o for o in op_db if o.name == "abs")  # a sample with values passes as before
    assert [r.status for r in run_case(absolute, torch.float32, torch.device("sim"),
                                       CaseOptions(limit_samples=1)).rows] == ["pass", "pass"]


def test_a_sort_that_orders_ties_otherwise_passes_and_one_with_a_wrong_index_is_a_mismatch(sim, monkeypatch):
    # The sweep compared a sort's indices element by element: a device whose sort orders equal elements otherwise
    # than the CPU's (CUDA's) was a mismatch, forward and backward. It now takes the device's valid choice, as
    # OpAutoCompare and the replay do.
    from torch.testing._internal.opinfo.core import OpInfo, SampleInput

    import ditorch.sim.kernels as sim_kernels
    from op_tools.offline.conformance.case import CaseOptions, run_case

    aten = torch.ops.aten

    def samples(op, device, dtype, requires_grad, **kwargs):
        generator = torch.Generator().manual_seed(0)
        ties = torch.randint(0, 4, (6, 16), generator=generator).to(device=device, dtype=dtype)
        yield SampleInput(ties.requires_grad_(requires_grad), args=(-1,))

    def reversed_ties(x, dim=-1, descending=False):
        values, indices = aten.sort.default(x.flip(dim), dim, descending)
        return values, x.shape[dim] - 1 - indices

    def wrong_index(x, dim=-1, descending=False):
        values, indices = reversed_ties(x, dim, descending)
        wrong = indices.clone()
        wrong[..., 0], wrong[..., -1] = indices[..., -1], indices[..., 0]
        return values, wrong

    opinfo = OpInfo("sort", op=torch.sort, dtypes=(torch.float32,), sample_inputs_func=samples,
                    supports_autograd=True)
    monkeypatch.setitem(sim_kernels.KERNELS, aten.sort.default, reversed_ties)
    rows = run_case(opinfo, torch.float32, torch.device("sim"), CaseOptions()).rows
    assert [(r.direction, r.status) for r in rows] == [("forward", "pass"), ("backward", "pass")], rows
    monkeypatch.setitem(sim_kernels.KERNELS, aten.sort.default, wrong_index)
    rows = run_case(opinfo, torch.float32, torch.device("sim"), CaseOptions()).rows
    assert rows[0].status == "mismatch", rows


def test_the_saved_inputs_of_a_backward_mismatch_replay_its_backward_and_find_it(sim, tmp_path):
    # The inputs were saved detached: the replay took no gradient, checked the forward only and said "ok | all pass"
    from torch.testing._internal.common_methods_invocations import op_db

    import ditorch.sim
    from op_tools.offline.conformance.case import CaseOptions, run_case
    from op_tools.offline.replay import ReplayOptions, find_entries, replay

    sin = next(o for o in op_db if o.name == "sin")
    with ditorch.sim.faults("cos:noise=1e-2"):  # sin's gradient only
        forward, backward = run_case(sin, torch.float32, torch.device("sim"),
                                     CaseOptions(sample=0, save_dir=str(tmp_path))).rows
        assert (forward.status, backward.status) == ("pass", "mismatch"), (forward, backward)
        (entry,) = find_entries(backward.inputs)
        result = replay(entry, "sim", ReplayOptions(acc_check=True))
    assert result.status == "mismatch" and result.backward_ms, result
    assert [c["check"] for c in result.checks if not c["ok"]] == ["grad vs cpu float64"], result.checks
