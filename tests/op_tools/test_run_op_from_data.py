import csv
import dataclasses
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
from subprocess_env import child_env
from tiny_models import tiny_llama

import op_tools
from op_tools.offline.replay import ReplayError, find_entries, resolve_op
from op_tools.offline.run_op_from_data import main
from op_tools.output import reporting

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "op_tools", "run_op_from_data.py")


@pytest.fixture(autouse=True)
def _own_results(tmp_path, monkeypatch):
    monkeypatch.setenv("OP_TOOLS_RESULTS_DIR", str(tmp_path / "results"))
    monkeypatch.setenv("OP_TOOLS_VERBOSE", "0")
    for name in list(os.environ):
        if name.startswith(("OP_CAPTURE", "AUTOCOMPARE_ERROR_TOLERANCE")):
            monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def captured_step(tmp_path_factory):
    """A captured training step of a one-layer tiny Llama on sim (forward, backward, AdamW step)."""
    import ditorch.sim

    ditorch.sim.register()
    root = tmp_path_factory.mktemp("capture")
    patch = pytest.MonkeyPatch()
    patch.setenv("OP_TOOLS_RESULTS_DIR", str(root))
    patch.setenv("OP_TOOLS_VERBOSE", "0")
    try:
        torch.manual_seed(0)
        model = tiny_llama(layers=1).to("sim")
        ids = torch.randint(0, 128, (2, 8)).to("sim")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with op_tools.OpCapture():
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
    finally:
        patch.undo()
    return str(root / "op_capture_results")


def _summary(tmp_path):
    (path,) = (tmp_path / "results" / "op_replay_result").glob("replay_summary_pid*.csv")
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _times(tmp_path):
    (path,) = (tmp_path / "results" / "op_replay_result").glob("replay_times_pid*.csv")
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _run_cli(args, tmp_path, env=None, module=False):
    command = [sys.executable, "-m", "op_tools.run_op_from_data"] if module else [sys.executable, SCRIPT]
    full_env = child_env({"DITORCH_BACKEND": "sim", "DITORCH_QUIET": "1",
                          "OP_TOOLS_RESULTS_DIR": str(tmp_path / "results"), **(env or {})})
    return subprocess.run(command + args, env=full_env, capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_replay_of_a_captured_step_reruns_every_call_forward_and_backward(captured_step, tmp_path, sim):
    entries = find_entries(captured_step)
    assert len(entries) == sum("input.pth" in files for _, _, files in os.walk(captured_step)) > 50
    assert main([captured_step, "--device", sim]) == 0
    rows = _summary(tmp_path)
    assert len(rows) == len(entries) and {r["status"] for r in rows} == {"ok"}
    by_name = {r["name"]: r for r in rows}
    assert "torch.nn.functional.linear" in by_name and "torch._foreach_addcdiv_" in by_name  # foreach, as on CUDA


def test_sync_time_measure_writes_each_run_forward_and_backward(captured_step, tmp_path, sim, capsys):
    folder = os.path.join(captured_step, "torch.nn.functional.linear")
    assert main([folder, "--device", sim, "--run_times", "3", "--sync_time_measure"]) == 0
    times = _times(tmp_path)
    assert len(times) == 3 * len(find_entries(folder))
    assert all(float(r["forward_elasped"]) > 0 and float(r["backward_elasped"]) > 0 for r in times)
    out = capsys.readouterr().out
    assert "fwd ms" in out and "forward_elasped" not in out  # one summary row per entry, not a row per run
    for row in _summary(tmp_path):
        assert row["runs"] == "3"
        for phase in ("forward", "backward"):
            mean, median, low = (float(row[f"{phase}_{k}_ms"]) for k in ("mean", "median", "min"))
            assert 0 < low <= median and low <= mean


def test_only_run_forward_runs_no_backward(captured_step, tmp_path, sim):
    folder = os.path.join(captured_step, "torch.nn.functional.silu")
    assert main([folder, "--device", sim, "--only_run_forward", "--sync_time_measure", "--run_times", "2"]) == 0
    assert {r["backward_elasped"] for r in _times(tmp_path)} == {""}


def test_acc_check_of_the_whole_step_passes_on_a_correct_device(captured_step, tmp_path, sim):
    assert main([captured_step, "--device", sim, "--acc_check", "true"]) == 0  # the original's `--flag True` form
    rows = _summary(tmp_path)
    assert all("FAIL" not in r["checks"] and "output vs cpu float64: pass" in r["checks"] for r in rows)
    assert all("output vs captured output: pass" in r["checks"] for r in rows)


def _original_capture(root, name, args, kwargs, output, forward_id):
    """A call saved as the original ditorch's OpCapture saved it: ``torch.save`` of the arguments and of the output
    as they were (named tuples, slices and ``...`` included), the output as the one element of ``args``."""
    folder = root / name / "1234" / str(forward_id) / "2024-10-09-11-42-15"
    folder.mkdir(parents=True)
    torch.save({"name": name, "args": args, "kwargs": kwargs, "identifier": f"{forward_id}/input"},
               folder / "input.pth")
    torch.save({"name": name, "args": (output,), "kwargs": {}, "identifier": f"{forward_id}/output"},
               folder / "output.pth")


@pytest.mark.skipif(not hasattr(torch.serialization, "safe_globals"), reason="torch < 2.5 allows no more globals")
def test_captures_written_by_the_original_ditorch_are_replayed_named_tuples_slices_and_all(tmp_path, sim):
    root = tmp_path / "original" / "op_capture_results"
    x = torch.randn(4, 8)
    _original_capture(root, "torch.Tensor.sort", (x,), {"dim": -1}, x.sort(dim=-1), 1)
    _original_capture(root, "torch.Tensor.__getitem__", (x, (slice(1, 3, None), Ellipsis)), {}, x[1:3, ...], 2)
    _original_capture(root, "torch.max", (x,), {"dim": 0}, torch.max(x, dim=0), 3)
    assert main([str(root), "--device", sim, "--acc_check"]) == 0
    rows = _summary(tmp_path)
    assert {r["name"]: r["status"] for r in rows} == {
        "torch.Tensor.sort": "ok", "torch.Tensor.__getitem__": "ok", "torch.max": "ok"}
    assert all("output vs captured output: pass" in r["checks"] for r in rows)


def test_script_reproduces_a_faulty_kernel_and_exits_non_zero(captured_step, tmp_path):
    folder = os.path.join(captured_step, "torch.nn.functional.linear")
    done = _run_cli([folder, "--acc_check"], tmp_path, env={"DITORCH_SIM_FAULTS": "mm:noise=1e-3"})
    assert done.returncode == 3, done.stderr  # found
    rows = _summary(tmp_path)
    assert rows and all(r["status"] == "mismatch" and "output vs cpu float64: FAIL" in r["checks"] for r in rows)
    assert "mismatch" in done.stdout


def test_module_form_and_console_script_entry_run_the_same_main(captured_step, tmp_path):
    folder = os.path.join(captured_step, "torch.nn.functional.embedding")
    done = _run_cli([folder], tmp_path, module=True)
    assert done.returncode == 0, done.stderr
    assert "1 entries: 1 ok" in done.stdout
    if sys.version_info >= (3, 11):
        import tomllib

        with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
            target = tomllib.load(f)["project"]["scripts"]["op_tools_run_op_from_data"]
        assert target == "op_tools.offline.run_op_from_data:main"
    installed = shutil.which("op_tools_run_op_from_data")
    if installed:
        done = subprocess.run([installed, "--help"], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "--sync_time_measure" in done.stdout


def _entry(root, name, *parts):
    folder = os.path.join(root, name, "1", *parts)
    os.makedirs(folder)
    return folder


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_bad_entries_are_each_reported_and_the_run_goes_on(tmp_path):
    root = str(tmp_path / "captures")
    marker = tmp_path / "code_ran"
    good = _entry(root, "torch.add", "1", "t")
    torch.save({"name": "torch.add", "args": (torch.ones(3), torch.ones(3)), "kwargs": {}}, f"{good}/input.pth")
    truncated = _entry(root, "torch.mul", "2", "t")
    torch.save({"name": "torch.mul", "args": (torch.ones(1000), 2.0), "kwargs": {}}, f"{truncated}/input.pth")
    data = open(f"{truncated}/input.pth", "rb").read()
    open(f"{truncated}/input.pth", "wb").write(data[: len(data) // 2])
    malicious = _entry(root, "torch.sub", "3", "t")
    torch.save({"name": "torch.sub", "args": (_RunsCode(marker),), "kwargs": {}}, f"{malicious}/input.pth")
    raw_pickle = _entry(root, "torch.div", "4", "t")
    open(f"{raw_pickle}/input.pth", "wb").write(pickle.dumps({"name": "torch.div", "args": (_RunsCode(marker),)}))
    system = _entry(root, "os.system", "5", "t")
    torch.save({"name": "os.system", "args": (f"touch {marker}",), "kwargs": {}}, f"{system}/input.pth")
    unknown = _entry(root, "torch.no_such_op", "6", "t")
    torch.save({"name": "torch.no_such_op", "args": (torch.ones(2),), "kwargs": {}}, f"{unknown}/input.pth")
    raising = _entry(root, "torch.matmul", "7", "t")
    torch.save({"name": "torch.matmul", "args": (torch.ones(2, 3), torch.ones(2, 3)), "kwargs": {}},
               f"{raising}/input.pth")
    missing = _entry(root, "torch.exp", "8", "t")
    torch.save({"name": "torch.exp", "args": (torch.ones(2),), "kwargs": {}}, f"{missing}/output.pth")

    dangling = _entry(root, "torch.relu", "9", "t")
    torch.save({"name": "torch.relu", "args": ({"op_tools_ref": "../gone/input.pth", "path": ["args", 0]},),
                "kwargs": {}}, f"{dangling}/input.pth")

    done = _run_cli([root, "--acc_check"], tmp_path)
    assert done.returncode == 3  # found: torch.matmul raised on the device (the refused captures alone would be 4)
    assert not marker.exists()  # no file's content ever ran
    detail = {r["name"] or r["entry"].split(os.sep)[0]: (r["status"], r["detail"]) for r in _summary(tmp_path)}
    assert detail["torch.add"][0] == "ok"
    assert detail["torch.mul"] == ("error", detail["torch.mul"][1]) and "corrupt or truncated" in detail["torch.mul"][1]
    for name in ("torch.sub", "torch.div"):
        assert detail[name][0] == "error" and "refused" in detail[name][1] and "nothing in it ran" in detail[name][1]
    assert "refused op name 'os.system'" in detail["os.system"][1]
    assert "unknown op 'torch.no_such_op'" in detail["torch.no_such_op"][1]
    assert "torch.matmul raised RuntimeError" in detail["torch.matmul"][1]
    assert "missing file" in detail["torch.exp"][1]
    assert "refers to a tensor stored once in" in detail["torch.relu"][1]
    assert "1 ok, 0 mismatch, 8 error" in done.stdout
    assert "refused" in done.stderr  # each error is also logged as it happens


def test_a_capture_not_replayed_exits_4_no_capture_2_and_a_summary_not_written_5(tmp_path, capsys, monkeypatch):
    root = str(tmp_path / "captures")
    unknown = _entry(root, "torch.no_such_op", "1", "t")
    torch.save({"name": "torch.no_such_op", "args": (torch.ones(2),), "kwargs": {}}, f"{unknown}/input.pth")
    assert main([root, "--device", "cpu"]) == 4  # not replayed: nothing found, nothing concluded
    os.makedirs(tmp_path / "empty")
    assert main([str(tmp_path / "empty"), "--device", "cpu"]) == 2
    assert "no captured call under" in capsys.readouterr().err
    (tmp_path / "a_file").write_text("")  # a file where a folder should be: unwritable even for root
    monkeypatch.setenv("OP_TOOLS_RESULTS_DIR", str(tmp_path / "a_file"))
    assert main([root, "--device", "cpu"]) == 2  # a malformed variable: said before replaying
    capsys.readouterr()
    monkeypatch.setenv("OP_TOOLS_RESULTS_DIR", str(tmp_path / "a_file" / "sub"))
    assert main([root, "--device", "cpu"]) == 5
    out, err = capsys.readouterr()
    assert "1 entries: 0 ok, 0 mismatch, 1 error" in out and "run_op_from_data: cannot write " in err


def test_an_entry_with_nothing_checked_is_counted_not_checked_and_exits_4(tmp_path, capsys):
    # torch.empty's memory is never written, so nothing of it is compared: it replayed "1 entries: 1 ok", exit 0
    root = str(tmp_path / "captures")
    empty = f"{_entry(root, 'torch.empty', '1', 't')}/input.pth"
    torch.save({"name": "torch.empty", "args": (5, 5), "kwargs": {}}, empty)
    assert main([root, "--device", "cpu", "--acc_check"]) == 4
    out = capsys.readouterr().out
    assert "1 entries: 0 ok, 0 mismatch, 0 error, 1 not checked" in out
    (row,) = _summary(tmp_path)
    assert (row["status"], row["checks"]) == ("not checked", "")
    assert row["detail"].startswith("memory never written (torch.empty's): accuracy not checked")
    add = f"{_entry(root, 'torch.add', '2', 't')}/input.pth"
    torch.save({"name": "torch.add", "args": (torch.ones(3), torch.ones(3)), "kwargs": {}}, add)
    assert main([add, "--device", "cpu", "--acc_check"]) == 0  # every entry checked: clean
    assert main([root, "--device", "cpu"]) == 0  # no check asked for: replayed is all it says
    assert "2 entries: 2 ok, 0 mismatch, 0 error" in capsys.readouterr().out.splitlines()[-1]


def test_an_entry_that_does_not_load_still_names_its_op(tmp_path, sim):
    # Its op column was empty where its input.pth refers to a tensor in a file not copied along
    from op_tools.offline.replay import ReplayOptions, replay

    x, w = torch.randn(4, 8).to(sim), torch.randn(6, 8).to(sim)
    with op_tools.OpCapture(results_dir=str(tmp_path / "capture")):
        torch.nn.functional.gelu(torch.nn.functional.linear(x, w))  # gelu's input: linear's output, stored there
    (gelu,) = (tmp_path / "capture").rglob("torch.nn.functional.gelu")
    shutil.copytree(gelu, tmp_path / "alone" / gelu.name)
    (entry,) = find_entries(str(tmp_path / "alone"))
    result = replay(entry, sim, ReplayOptions())
    assert (result.status, result.name) == ("error", "torch.nn.functional.gelu"), result
    assert "refers to a tensor stored once in" in result.error
    open(os.path.join(entry.directory, "input.pth"), "wb").write(b"not a capture")  # nothing to read: its folder
    assert replay(entry, sim, ReplayOptions()).name == "torch.nn.functional.gelu"


def test_an_autocompare_failure_folder_is_replayed_from_its_device_side(captured_step, tmp_path, sim):
    """OpAutoCompare's layout <op>/<pid>/autocompare/<forward_id>/<time>/{device,cpu}/: the device side replays."""
    source = find_entries(os.path.join(captured_step, "torch.nn.functional.linear"))[0].directory
    failing = tmp_path / "captures" / "torch.nn.functional.linear" / "1" / "autocompare" / "7" / "t"
    for side in ("device", "cpu"):  # files that load alone, as OpAutoCompare writes them
        os.makedirs(failing / side)
        for file in os.listdir(source):
            torch.save(op_tools.load_op_args(os.path.join(source, file)), failing / side / file)
    (entry,) = find_entries(str(tmp_path / "captures"))
    assert entry.kind == "autocompare" and entry.directory.endswith("device")
    import ditorch.sim

    with ditorch.sim.faults("mm:noise=1e-3"):
        assert main([str(tmp_path / "captures"), "--device", sim, "--acc_check"]) == 3
    assert _summary(tmp_path)[0]["status"] == "mismatch"


def test_only_torch_operators_or_allowed_packages_resolve():
    assert resolve_op("torch.add") is torch.add
    assert resolve_op("torch.Tensor.add") is torch.Tensor.add
    assert resolve_op("torch.nn.functional.linear") is torch.nn.functional.linear
    assert resolve_op("torch._foreach_add_") is torch._foreach_add_
    # the name the tools give torch.relu_ (its alias in torch.nn.functional), which torch.overrides does not list
    assert resolve_op("torch.nn.functional.relu_") is torch.relu_
    # torch's own operators torch.overrides lists as ignored, which the tools meet all the same (MobileNet's
    # hardswish, transformers' new_zeros), and aten operators called directly, as the tools name them: refused before
    assert resolve_op("torch.nn.functional.hardswish") is torch.nn.functional.hardswish
    assert resolve_op("torch.Tensor.new_zeros") is torch.Tensor.new_zeros
    assert resolve_op("aten.slice.Tensor") is torch.ops.aten.slice.Tensor
    assert resolve_op("aten._softmax_backward_data") is torch.ops.aten._softmax_backward_data
    for name in ("torch.save", "torch.load", "torch.hub.load", "torch.compile", "torch.export.load", "os.system",
                 "builtins.eval"):
        with pytest.raises(ReplayError, match="refused"):
            resolve_op(name)
    with pytest.raises(ReplayError, match="unknown op 'aten.no_such_op.default'"):
        resolve_op("aten.no_such_op.default")
    import tiny_models

    assert resolve_op("tiny_models.mlp", allowed_modules=("tiny_models",)) is tiny_models.mlp


@pytest.mark.gpu
def test_capture_and_replay_on_cuda(tmp_path, monkeypatch):
    monkeypatch.setenv("OP_TOOLS_RESULTS_DIR", str(tmp_path / "capture"))
    torch.manual_seed(0)
    model = tiny_llama(layers=1).cuda()
    ids = torch.randint(0, 128, (2, 8), device="cuda")
    with op_tools.OpCapture():
        model(input_ids=ids, labels=ids).loss.backward()
    monkeypatch.setenv("OP_TOOLS_RESULTS_DIR", str(tmp_path / "results"))
    folder = str(tmp_path / "capture" / "op_capture_results")
    assert main([folder, "--device", "cuda", "--acc_check", "--sync_time_measure", "--run_times", "2"]) == 0
    assert {r["status"] for r in _summary(tmp_path)} == {"ok"}


def test_replay_of_a_real_autocompare_failure_reproduces_it_only_with_the_fault(tmp_path, sim, monkeypatch):
    import ditorch.sim

    monkeypatch.setenv("OP_TOOLS_RESULTS_DIR", str(tmp_path / "autocompare"))
    x = torch.randn(4, 8, device=sim)
    w = torch.randn(3, 8, device=sim, requires_grad=True)
    with ditorch.sim.faults("mm:noise=1e-3"), op_tools.OpAutoCompare():
        torch.nn.functional.linear(x, w).sum().backward()
    folder = str(tmp_path / "autocompare" / "op_capture_results")
    (entry,) = [e for e in find_entries(folder) if e.kind == "autocompare"]
    monkeypatch.setenv("OP_TOOLS_RESULTS_DIR", str(tmp_path / "results"))
    with ditorch.sim.faults("mm:noise=1e-3"):
        assert main([entry.directory, "--device", sim, "--acc_check"]) == 3
    assert _summary(tmp_path)[0]["status"] == "mismatch"
    shutil.rmtree(tmp_path / "results")
    main([entry.directory, "--device", sim, "--acc_check"])
    checks = _summary(tmp_path)[0]["checks"]  # a correct kernel matches float64, not the faulty captured output
    assert "output vs cpu float64: pass" in checks and "output vs captured output: FAIL" in checks


def test_summary_names_op_shapes_dtypes_device_and_versions(captured_step, tmp_path, sim, capsys):
    folder = os.path.join(captured_step, "torch.nn.functional.linear")
    assert main([folder, "--device", sim]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()  # the first line wrapped at the console's width: joined back
    header = lines[:next(i for i, line in enumerate(lines) if i and not line.startswith(reporting.CONTINUATION))]
    assert lines[0].startswith("run_op_from_data: ")
    assert f"torch {torch.__version__}, ditorch " in reporting.unwrapped("\n".join(header))
    rows = _summary(tmp_path)
    assert rows and all(r["device"] == sim and r["dtypes"].split() == ["float32"] * len(r["shapes"].split("] ["))
                        for r in rows)
    assert any(r["shapes"].startswith("[2, 8, 64] [") for r in rows)  # the hidden states, then the weight
    assert all(max(len(line) for line in out.splitlines() if line.startswith(("+", "|"))) <= 120 for _ in rows)


def test_report_md_writes_a_markdown_summary_to_paste(captured_step, tmp_path, sim):
    folder = os.path.join(captured_step, "torch.nn.functional.silu")
    assert main([folder, "--device", sim, "--sync_time_measure", "--run_times", "3", "--report", "md"]) == 0
    (report,) = (tmp_path / "results" / "op_replay_result").glob("replay_report_pid*.md")
    text = report.read_text()
    assert text.startswith("# run_op_from_data report") and f"torch {torch.__version__}, ditorch " in text
    assert "| name | shapes | dtypes | device | status | forward_mean_ms | forward_median_ms | forward_min_ms |" in text
    rows = [line for line in text.splitlines() if line.startswith("| torch.nn.functional.silu |")]
    assert len(rows) == len(find_entries(folder)) and all(" | ok | " in row for row in rows)
    chosen = tmp_path / "bug report.md"
    assert main([folder, "--device", sim, "--report", str(chosen)]) == 0
    assert chosen.read_text().startswith("# run_op_from_data report")
    assert main([folder, "--device", sim, "--report", "report.txt"]) == 2


def test_a_single_input_pth_file_is_replayed_as_its_call(captured_step, tmp_path, sim):
    (entry, *_) = find_entries(os.path.join(captured_step, "torch.nn.functional.linear"))
    path = os.path.join(entry.directory, "input.pth")
    assert find_entries(path) == [dataclasses.replace(entry, label=".")]
    assert main([path, "--device", sim, "--acc_check"]) == 0
    (row,) = _summary(tmp_path)
    assert row["status"] == "ok" and row["name"] == "torch.nn.functional.linear"
    with pytest.raises(ReplayError, match="no such file or directory"):
        find_entries(os.path.join(entry.directory, "missing.pth"))


def test_an_entry_without_its_captured_output_says_it_was_not_compared_with_it(captured_step, tmp_path, sim):
    # checked against the CPU's float64 run, as ever, but the check against the captured output was dropped unsaid
    tree = tmp_path / "captured"
    shutil.copytree(captured_step, tree)  # whole: a saved tensor may be stored once, in another call's file
    (entry, *_) = find_entries(str(tree / "torch.nn.functional.linear"))
    os.remove(os.path.join(entry.directory, "output.pth"))
    assert main([entry.directory, "--device", sim, "--acc_check"]) == 0
    (row,) = _summary(tmp_path)
    assert row["status"] == "ok" and "output vs captured output" not in row["checks"]
    assert "no output.pth: not compared with the captured output" in row["detail"]


FUSED_PACKAGE = """
import torch


def fused_gelu(x):
    # A vendor-only fused kernel, as flash_attn's: no CPU implementation.
    if x.device.type == "cpu":
        raise RuntimeError("fused_gelu: no CPU kernel")
    return torch.nn.functional.gelu(x)
"""


def test_a_reference_that_raises_is_its_own_status_not_a_mismatch(tmp_path, sim, monkeypatch):
    (tmp_path / "fusedpkg.py").write_text(FUSED_PACKAGE)
    monkeypatch.syspath_prepend(str(tmp_path))
    call = tmp_path / "captures" / "fusedpkg.fused_gelu" / "1" / "1" / "t"
    call.mkdir(parents=True)
    torch.save({"name": "fusedpkg.fused_gelu", "args": (torch.randn(4, 8),), "kwargs": {}, "identifier": "input"},
               call / "input.pth")
    # incomplete: the device ran it, nothing to check it against
    assert main([str(tmp_path / "captures"), "--device", sim, "--acc_check", "--allow_module", "fusedpkg"]) == 4
    (row,) = _summary(tmp_path)
    assert row["status"] == "reference error" and row["checks"] == ""
    assert "the CPU reference raised RuntimeError: fused_gelu: no CPU kernel" in row["detail"]
    assert row["runs"] == "1"  # the device ran it


GRAD_SCALER_STEP = """
import torch, ditorch, op_tools
model = torch.nn.Linear(8, 8).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cuda")
with op_tools.OpCapture():
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(torch.randn(4, 8, device="cuda")).float().square().mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
"""


def test_ops_whose_outputs_have_no_gradient_run_forward_only(tmp_path, sim):
    done = subprocess.run([sys.executable, "-c", GRAD_SCALER_STEP], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env=child_env({"DITORCH_BACKEND": "sim", "DITORCH_QUIET": "1",
                                                      "OP_CAPTURE_LIST": "torch._amp_update_scale_",
                                                      "OP_TOOLS_RESULTS_DIR": str(tmp_path / "captured")},
                                                     drop=("OP_",)))
    assert done.returncode == 0, done.stderr
    captured = tmp_path / "captured" / "op_capture_results"
    (entry,) = find_entries(str(captured))
    # The same call with its scale requiring grad: aten::_amp_update_scale_ has no derivative formula.
    data = torch.load(os.path.join(entry.directory, "input.pth"), weights_only=True)
    data["args"] = (data["args"][0].requires_grad_(), *data["args"][1:])
    wanted = tmp_path / "with_grad" / "call"
    wanted.mkdir(parents=True)
    torch.save(data, wanted / "input.pth")
    for folder in (captured, tmp_path / "with_grad"):
        assert main([str(folder), "--device", sim, "--acc_check", "--sync_time_measure", "--run_times", "2"]) == 0
    first, second = (r for r in sorted(_all_summaries(tmp_path), key=lambda r: r["entry"] == "call"))
    for row in (first, second):
        assert row["name"] == "torch._amp_update_scale_" and row["status"] == "ok" and row["runs"] == "2"
        assert row["backward_mean_ms"] == "" and "no backward" in row["detail"]
    assert "the op has no derivative" in second["detail"]


def _all_summaries(tmp_path):
    rows = []
    for path in (tmp_path / "results" / "op_replay_result").glob("replay_summary_pid*.csv"):
        with open(path, newline="") as f:
            rows += list(csv.DictReader(f))
    return rows


# --- --failures-only: the console shows what needs a look, counts the rest; the step each call was captured in

def _table_rows(out: str) -> list[list[str]]:
    """The console table's rows below its header, as lists of cells."""
    lines = [line for line in out.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[1:]]


def test_failures_only_shows_the_mismatch_of_a_whole_step_and_counts_the_ok_entries(captured_step, tmp_path, sim,
                                                                                    capsys):
    import ditorch.sim

    entries = find_entries(captured_step)
    total = len(entries)
    with ditorch.sim.faults("silu:noise=1e-3"):
        assert main([captured_step, "--device", sim, "--acc_check"]) == 3
        everything = capsys.readouterr().out
        assert main([captured_step, "--device", sim, "--acc_check", "--failures-only"]) == 3
    out = capsys.readouterr().out
    assert len(_table_rows(everything)) == total  # without the option: a row per entry
    (row,) = _table_rows(out)
    assert row[:3] == ["torch.nn.functional.silu", "[2, 8, 128]", "mismatch"] and row[-1] == "0"  # its step
    assert f"--failures-only: {total - 1} ok entries not shown (the summary CSV has all {total})" in out
    assert f"{total} entries: {total - 1} ok, 1 mismatch, 0 error" in out
    summaries = _all_summaries(tmp_path)
    assert len(summaries) == 2 * total  # the CSV keeps every entry
    # each row's step is the one saved with its call
    saved = {e.label: torch.load(os.path.join(e.directory, "input.pth"), weights_only=True)["step"] for e in entries}
    assert {r["entry"]: r["step"] for r in summaries} == {label: str(step) for label, step in saved.items()}
    assert set(saved.values()) == {0}  # one step captured, the first


def test_failures_only_never_hides_an_error_or_a_call_not_checked_and_step_is_appended(tmp_path, capsys):
    root = str(tmp_path / "captures")
    add = {"name": "torch.add", "args": (torch.ones(3), torch.ones(3)), "kwargs": {}}
    torch.save({**add, "step": 3}, f"{_entry(root, 'torch.add', '1', 't')}/input.pth")
    torch.save(add, f"{_entry(root, 'torch.add', '2', 't')}/input.pth")  # captured before calls had a step
    torch.save({"name": "torch.matmul", "args": (torch.ones(2, 3), torch.ones(2, 3)), "kwargs": {}, "step": 1},
               f"{_entry(root, 'torch.matmul', '3', 't')}/input.pth")
    torch.save({"name": "torch.nn.functional.dropout", "args": (torch.ones(4, 4), 0.5, True), "kwargs": {},
                "step": 2}, f"{_entry(root, 'torch.nn.functional.dropout', '4', 't')}/input.pth")
    assert main([root, "--device", "cpu", "--acc_check", "--failures-only", "--report", "md"]) == 3  # matmul raised
    out = capsys.readouterr().out
    (error, not_checked) = _table_rows(out)
    assert error[0] == "torch.matmul" and error[2] == "error" and error[-1] == "1"
    # ok, but its accuracy was not checked (random draws): shown, and said so
    assert not_checked[0] == "torch.nn.functional.dropout" and not_checked[2:4] == ["ok", "finite only"]
    assert not_checked[-1] == "2"
    assert "--failures-only: 2 ok entries not shown (the summary CSV has all 4)" in out
    rows = _summary(tmp_path)
    assert list(rows[0])[-2:] == ["detail", "step"]  # appended: the other columns keep their places
    assert sorted((r["entry"].split(os.sep)[0], r["step"]) for r in rows) == [
        ("torch.add", ""), ("torch.add", "3"), ("torch.matmul", "1"), ("torch.nn.functional.dropout", "2")]
    (report,) = (tmp_path / "results" / "op_replay_result").glob("replay_report_pid*.md")
    assert "| detail | entry | step |" in report.read_text()
    # without --acc_check nothing was asked to be checked: only the error is shown; the per-run times have the step
    shutil.rmtree(tmp_path / "results")
    assert main([root, "--device", "cpu", "--failures-only", "--sync_time_measure"]) == 3
    out = capsys.readouterr().out
    assert [row[0] for row in _table_rows(out)] == ["torch.matmul"]
    assert "--failures-only: 3 ok entries not shown" in out
    assert sorted(r["step"] for r in _times(tmp_path)) == ["", "2", "3"]  # matmul raised: no run timed


def test_a_device_this_torch_does_not_know_is_a_usage_error_that_says_how_to_import_its_backend(captured_step,
                                                                                                 capsys):
    # Before, --device sim without ditorch's backend imported ended in torch.device's traceback, after the search.
    assert main([str(captured_step), "--device", "npu:0"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("run_op_from_data: --device npu:0: ") and "DITORCH_BACKEND=<its name>" in error


def test_a_call_naming_its_device_is_referenced_on_the_cpu_and_replayed_on_the_replays_device(tmp_path, sim):
    # ones_like(x, dtype=..., device=...) names its device. The CPU reference kept that device argument: it ran on the
    # device, faults and all, and a wrong result passed. A capture made on another device (cuda:1) failed to run.
    import ditorch.sim
    from op_tools.offline.replay import ReplayOptions, replay

    x = torch.zeros(8).to(sim)
    with op_tools.OpCapture(results_dir=str(tmp_path / "here")):
        torch.ones_like(x, dtype=torch.bfloat16, device=sim)
    (entry,) = [e for e in find_entries(str(tmp_path / "here")) if "ones_like" in e.label]
    with ditorch.sim.faults("ones_like:noise=0.3"):
        faulty = replay(entry, sim, ReplayOptions(acc_check=True))
    assert faulty.status == "mismatch" and faulty.checks[0]["check"] == "output vs cpu float64", faulty.checks
    assert not faulty.checks[0]["ok"]
    assert replay(entry, sim, ReplayOptions(acc_check=True)).status == "ok"

    elsewhere = tmp_path / "elsewhere"
    _original_capture(elsewhere, "torch.ones_like", (torch.zeros(8),), {"device": "cuda:1"}, torch.ones(8), 1)
    (entry,) = find_entries(str(elsewhere))
    moved = replay(entry, sim, ReplayOptions(acc_check=True))
    assert moved.status == "ok" and all(c["ok"] for c in moved.checks), (moved.error, moved.checks)


def test_memory_never_written_is_replayed_but_not_checked_and_says_so(tmp_path, sim):
    # torch.empty_like's result (and x.new_empty's, replayed since torch.overrides' ignored functions resolve) is
    # whatever the memory held: compared, it was a mismatch or a pass by chance
    from op_tools.offline.replay import ReplayOptions, replay

    x = torch.randn(64).to(sim)
    with op_tools.OpCapture(results_dir=str(tmp_path)):
        torch.empty_like(x)
        x.new_empty((8, 8))
    results = {r.name: r for r in (replay(e, sim, ReplayOptions(acc_check=True)) for e in find_entries(str(tmp_path)))}
    for name in ("torch.empty_like", "torch.Tensor.new_empty"):
        assert results[name].status == "not checked" and results[name].checks == [], results[name]
        assert results[name].verdict() == "unchecked" and not results[name].failed
        assert "memory never written (torch.empty's): accuracy not checked" in results[name].notes, results[name]


def test_a_bfloat16_output_captured_wrong_is_not_reproduced_and_the_replay_says_so(tmp_path, sim):
    # the captured output against the replay's: two bfloat16 results, judged by the floor for a reference no more
    # precise than the result, 256 eps, which in bfloat16 is 2.0: a 30% fault at capture time passed as reproduced
    import ditorch.sim
    from op_tools.offline.replay import ReplayOptions, replay

    x = torch.linspace(-2, 2, 256, dtype=torch.bfloat16).to(sim)
    with ditorch.sim.faults("exp:noise=0.3"), op_tools.OpCapture(results_dir=str(tmp_path)):
        torch.exp(x)
    (entry,) = [e for e in find_entries(str(tmp_path)) if "exp" in e.label]
    result = replay(entry, sim, ReplayOptions(acc_check=True))
    checks = {c["check"]: c for c in result.checks}
    assert checks["output vs cpu float64"]["ok"], checks  # the replay, unfaulted, computes right
    assert not checks["output vs captured output"]["ok"] and result.status == "mismatch", checks
    assert "above 0.0625 (8 ulps of bfloat16" in checks["output vs captured output"]["detail"], checks


def test_what_a_call_writes_into_its_arguments_is_saved_and_compared_so_a_faulty_setitem_is_found(tmp_path, sim):
    # y[0] = 5 returns None: capture saved only that None and the replay compared only it, so a fault in the kernel
    # writing the row (fill_, copy_) passed as "ok | all pass"
    import ditorch.sim
    from op_tools.offline.replay import ReplayOptions, replay
    from op_tools.output.capture_format import WRITTEN_KEY

    x = torch.zeros(3, 4).to(sim)
    with op_tools.OpCapture(results_dir=str(tmp_path)):
        y = x.clone()
        y[0] = 5.0
        z = x.clone()
        z[1] = torch.ones(4).to(sim)
    entries = [e for e in find_entries(str(tmp_path)) if "__setitem__" in e.label]
    assert len(entries) == 2
    with ditorch.sim.faults("fill_:noise=1e-1"):
        faulty = replay(entries[0], sim, ReplayOptions(acc_check=True))
    failed = {c["check"] for c in faulty.checks if not c["ok"]}
    assert faulty.status == "mismatch" and "written vs cpu float64" in failed, faulty.checks
    assert "written args[0]" in next(c["detail"] for c in faulty.checks if not c["ok"])
    # sim's copy_ is also the copy to the device: the inputs arrive changed, and that copy is named, not the op
    with ditorch.sim.faults("copy_:noise=1e-1"):
        faulty = replay(entries[1], sim, ReplayOptions(acc_check=True))
    assert faulty.status == "mismatch" and [c["check"] for c in faulty.checks] == ["inputs on the device"], \
        faulty.checks
    clean = replay(entries[0], sim, ReplayOptions(acc_check=True))
    checks = {c["check"]: c["ok"] for c in clean.checks}
    assert clean.status == "ok" and checks["written vs cpu float64"] and checks["written vs captured"], clean.checks
    saved = op_tools.load_op_args(os.path.join(entries[0].directory, "output.pth"))
    assert saved["args"] == (None,) and torch.equal(saved[WRITTEN_KEY]["args[0]"], y.cpu())

    # a capture of before: its output.pth holds the None only; the write is still checked against the CPU, and the
    # replay says what it could not compare
    older = os.path.join(entries[0].directory, "output.pth")
    torch.save({"name": "torch.Tensor.__setitem__", "args": (None,), "kwargs": {}, "identifier": "output"}, older)
    with ditorch.sim.faults("fill_:noise=1e-1"):
        faulty = replay(entries[0], sim, ReplayOptions(acc_check=True))
    assert faulty.status == "mismatch" and "written vs captured" not in {c["check"] for c in faulty.checks}
    assert "written arguments not compared with the captured ones: captured by an older version" in faulty.notes


def test_a_slice_with_a_tensor_bound_replays_and_an_argument_kept_as_text_is_not_replayable(tmp_path, sim, capsys):
    # x[:, :n] with n a 0-d tensor was saved as the text "slice(None, tensor(3), None)", which the replay passed to
    # the op: "__getitem__ raised TypeError", exit 3, a device finding for the capture format's limit
    class Position:  # a user's index object: no plain value keeps it
        def __index__(self):
            return 2

    x = torch.randn(4, 6).to(sim)
    n = torch.tensor(3)
    with op_tools.OpCapture(results_dir=str(tmp_path / "new")):
        x[:, :n]
        x[Position()]
    entries = {e.label: e for e in find_entries(str(tmp_path / "new")) if "__getitem__" in e.label}
    data = [op_tools.load_op_args(os.path.join(e.directory, "input.pth")) for e in entries.values()]
    assert any(isinstance(d["args"][1], tuple) and d["args"][1][1] == slice(None, n, None) for d in data)
    assert main([str(tmp_path / "new"), "--device", sim, "--acc_check"]) == 4
    statuses = sorted(r["status"] for r in _summary(tmp_path) if r["name"] == "torch.Tensor.__getitem__")
    assert statuses == ["error", "ok"], _summary(tmp_path)
    (refused,) = [r for r in _summary(tmp_path) if r["status"] == "error"]
    assert refused["detail"].startswith("not replayable: argument args[1] of torch.Tensor.__getitem__ was captured as "
                                        "its text only") and "Position" in refused["detail"], refused

    old = tmp_path / "old" / "op_capture_results"
    index = (slice(None), "slice(None, tensor(3), None)")  # as OpCapture kept it
    _original_capture(old, "torch.Tensor.__getitem__", (torch.randn(4, 6), index), {}, torch.randn(4, 3), 1)
    capsys.readouterr()
    assert main([str(old), "--device", sim, "--acc_check"]) == 4  # not replayable, not a finding
    assert "not replayable: argument args[1][1] of torch.Tensor.__getitem__" in capsys.readouterr().err


def test_a_file_naming_a_device_type_this_process_lacks_says_so_and_where_to_load_it(tmp_path, sim):
    # a capture made on sim, replayed where sim is not registered: torch.load's "Expected one of cpu, cuda, ...
    # device type at start of device string: sim" was reported as a corrupt or truncated file; the device named as
    # text reached the op, whose error read as a device finding (exit 3)
    x, y = torch.zeros(4).to(sim), torch.ones(2).to(sim)  # y: x's file, x stored once, names the device
    with op_tools.OpCapture(results_dir=str(tmp_path / "captured")):
        torch.ones_like(x, device=torch.device(sim))
        torch.zeros_like(y, device=sim)
    env = {k: v for k, v in child_env({"OP_TOOLS_RESULTS_DIR": str(tmp_path / "results")}).items()
           if not k.startswith("DITORCH_BACKEND")}
    done = subprocess.run([sys.executable, SCRIPT, str(tmp_path / "captured"), "--device", "cpu"], env=env,
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 4, done.stdout + done.stderr
    rows = {r["name"]: r for r in _summary(tmp_path)}
    assert rows.keys() == {"torch.ones_like", "torch.zeros_like"}, rows  # the unread file's op: named by its folder
    unread = rows["torch.ones_like"]  # its file, naming torch.device("sim"), is not read
    assert unread["status"] == "error" and "corrupt" not in unread["detail"], rows
    assert unread["detail"].startswith("device type 'sim', unknown in this process, named in ") and \
        "load it where that backend is registered" in unread["detail"], rows
    assert rows["torch.zeros_like"]["detail"].startswith("the call names device type 'sim', unknown in this process"), \
        rows


def test_a_clean_bfloat16_autocast_lstm_replays_ok_and_a_fault_in_its_backward_is_still_found(tmp_path, sim):
    # the same-dtype CPU run of torch.lstm ran oneDNN's float32 kernel, which the emulated autocast cannot reach: its
    # gradients had float32's error (3.7e-07) as the yardstick, and a clean bfloat16 LSTM's replayed as a mismatch
    import ditorch.sim
    from op_tools.offline.replay import ReplayOptions, replay

    torch.manual_seed(0)
    lstm = torch.nn.LSTM(8, 8, batch_first=True).to(sim)
    x = torch.randn(2, 5, 8).to(sim)
    with op_tools.OpCapture(results_dir=str(tmp_path), ops=[r"torch\.lstm"]):
        with torch.autocast(sim, dtype=torch.bfloat16):
            h, _ = lstm(x)
        h.float().sum().backward()
    (entry,) = find_entries(str(tmp_path))
    clean = replay(entry, sim, ReplayOptions(acc_check=True))
    assert clean.status == "ok" and [c["check"] for c in clean.checks if c["ok"]] == [
        "output vs cpu float64", "grad vs cpu float64", "output vs captured output", "grad vs captured grad"], \
        (clean.checks, clean.notes)
    with ditorch.sim.faults("_thnn_fused_lstm_cell_backward_impl:noise=3e-2"):
        faulty = replay(entry, sim, ReplayOptions(acc_check=True))
    assert faulty.status == "mismatch" and [c["check"] for c in faulty.checks if not c["ok"]] == \
        ["grad vs cpu float64", "grad vs captured grad"], faulty.checks


def test_a_gradient_captured_wrong_is_a_mismatch_and_a_broken_grad_inputs_file_an_error(tmp_path, sim):
    # grad_inputs.pth was written and never read: a backward kernel wrong where the capture was taken replayed "all
    # pass" on a correct device, and the file broken went unsaid
    import ditorch.sim
    from op_tools.offline.replay import ReplayOptions, replay

    torch.manual_seed(0)
    x = torch.randn(4, 6).to(sim).requires_grad_()
    with ditorch.sim.faults("gelu_backward:noise=1e-1"), \
            op_tools.OpCapture(results_dir=str(tmp_path), ops=["torch.nn.functional.gelu"]):
        torch.nn.functional.gelu(x).sum().backward()
    (entry,) = find_entries(str(tmp_path))
    replayed = replay(entry, sim, ReplayOptions(acc_check=True))
    assert replayed.status == "mismatch" and [c["check"] for c in replayed.checks if not c["ok"]] == \
        ["grad vs captured grad"], replayed.checks
    with open(os.path.join(entry.directory, "grad_inputs.pth"), "w") as f:
        f.write("garbage")
    broken = replay(entry, sim, ReplayOptions(acc_check=True))
    assert broken.status == "error" and "grad_inputs.pth" in broken.error, broken


def test_a_random_op_is_checked_for_finite_outputs_from_finite_inputs(tmp_path, sim):
    # Its values, drawn again, are not compared: an all-nan dropout replayed "ok", exit 0
    import ditorch.sim
    from op_tools.offline.replay import ReplayOptions, replay

    x = torch.randn(3, 3).to(sim)
    with op_tools.OpCapture(results_dir=str(tmp_path), ops=["torch.nn.functional.dropout"]):
        torch.nn.functional.dropout(x, 0.5)
    (entry,) = find_entries(str(tmp_path))
    clean = replay(entry, sim, ReplayOptions(acc_check=True))
    assert clean.status == "ok" and [(c["check"], c["ok"]) for c in clean.checks] == [("output finite", True)]
    with ditorch.sim.faults("native_dropout:nan"):
        faulty = replay(entry, sim, ReplayOptions(acc_check=True))
    assert faulty.status == "mismatch" and faulty.checks[0]["detail"] == "output[0] holds nan or inf from finite inputs"


def test_a_random_op_whose_backward_writes_nan_is_a_mismatch(tmp_path, sim):
    # Only its outputs were checked: nan gradients from dropout's backward replayed "ok | finite only", exit 0
    import ditorch.sim
    from op_tools.offline.replay import ReplayOptions, replay

    x = torch.randn(3, 3).to(sim).requires_grad_()
    with op_tools.OpCapture(results_dir=str(tmp_path), ops=["torch.nn.functional.dropout"]):
        torch.nn.functional.dropout(x, 0.5).sum().backward()
    (entry,) = find_entries(str(tmp_path))
    clean = replay(entry, sim, ReplayOptions(acc_check=True))
    assert clean.status == "ok" and [(c["check"], c["ok"]) for c in clean.checks] == [
        ("output finite", True), ("grad finite", True)], clean
    with ditorch.sim.faults("native_dropout_backward:nan"):
        faulty = replay(entry, sim, ReplayOptions(acc_check=True))
    assert faulty.status == "mismatch", faulty
    assert [(c["check"], c["ok"], c["detail"]) for c in faulty.checks] == [
        ("output finite", True, "every output finite"),
        ("grad finite", False, "grad[0] holds nan or inf from finite inputs and upstream gradients")]


def test_as_strided_on_a_view_with_gaps_replays_its_storage_and_what_was_not_captured_is_not_replayable(tmp_path, sim):
    # x[:, ::2] was saved dense: its as_strided read other elements when replayed, a mismatch with no fault (exit 3)
    from op_tools.offline.replay import ReplayOptions, replay

    x = torch.arange(24.0).reshape(4, 6).to(sim)
    y, tail = x[:, ::2], x[1:, ::2]
    with op_tools.OpCapture(results_dir=str(tmp_path), ops=["torch.Tensor.as_strided"]):
        y.as_strided((3,), (1,))           # x[0, 0:3]: a gap element among them
        tail.as_strided((3,), (1,), 7)     # an explicit storage offset, inside tail's span (6 to 22)
        x[0].expand(4, 6).as_strided((6,), (1,))
        y.as_strided((3,), (1,), 21)       # x's last elements: past y's span (0 to 22), never saved
    results = [replay(e, sim, ReplayOptions(acc_check=True)) for e in find_entries(str(tmp_path))]
    assert [r.status for r in results] == ["ok", "ok", "ok", "error"], [(r.status, r.checks, r.error) for r in results]
    assert all(c["ok"] for r in results[:3] for c in r.checks) and not results[3].op_raised
    assert results[3].error == ("not replayable: the input's layout was not captured: torch.Tensor.as_strided reads "
                                "storage elements 21 to 23, the capture saved 0 to 22 (the span its input covers)")

    # a capture of before: its input a dense copy, which as_strided reads otherwise: not replayable, not a finding
    old = tmp_path / "old"
    _original_capture(old, "torch.Tensor.as_strided", (x[:, ::2].cpu().contiguous(), (3,), (1,)), {},
                      torch.tensor([0.0, 1.0, 2.0]), 1)
    assert main([str(old), "--device", sim, "--acc_check"]) == 4
    (row,) = _summary(tmp_path)
    assert row["status"] == "error" and row["detail"].startswith(
        "not replayable: the input's layout was not captured: torch.Tensor.as_strided "
        "reads its input's storage, which captures made before"), row


def test_inputs_changed_by_the_copy_to_the_device_are_named_not_the_ops_they_feed(tmp_path, sim):
    # a faulty copy to the device made every replayed op look wrong (a view, a sort's indices, unique's shape), and
    # nothing named the copy
    import ditorch.sim
    from op_tools.offline.replay import ReplayOptions, replay

    x = torch.randn(6, 4).to(sim)
    with op_tools.OpCapture(results_dir=str(tmp_path)):
        x.view(24)
        torch.sort(x[0])
    entries = find_entries(str(tmp_path))
    assert {e.label.split(os.sep)[1] for e in entries} >= {"torch.Tensor.view", "torch.sort"}, entries
    with ditorch.sim.faults("_to_copy:noise=1e-2;copy_:noise=1e-2"):
        results = [replay(entry, sim, ReplayOptions(acc_check=True)) for entry in entries]
    for result in results:
        assert result.status == "mismatch", (result.name, result.checks)
        assert [c["check"] for c in result.checks] == ["inputs on the device"], (result.name, result.checks)
        assert "the copy to the device is at fault, not the op" in result.checks[0]["detail"]
    assert all(replay(entry, sim, ReplayOptions(acc_check=True)).status == "ok" for entry in entries)


def test_an_input_that_cannot_be_read_back_or_compared_is_said_so_not_taken_for_the_ops_failure(sim):
    # torch.equal has no complex32 kernel: the read-back check raised, and the replay reported the op as raising
    from op_tools.offline.replay import Entry, ReplayResult, _arrived

    x = torch.ones(3, dtype=torch.complex32)
    result = ReplayResult(Entry("", "", "capture"))
    assert _arrived(((x,), {}, ()), ((x.to(sim),), {}, ()), result)
    assert result.checks == [] and "tensor 0 of the inputs not read back from the device" in result.notes[0]


def test_an_ops_captured_upstream_gradient_is_used_beside_an_output_without_one(tmp_path, sim):
    # frexp's upstream gradients are captured as (the mantissa's, None for the integer exponent): two for its one
    # differentiable output, so the replay took ones instead, and its gradients never matched the captured ones
    from op_tools.offline.replay import ReplayOptions, replay

    torch.manual_seed(0)
    x = torch.randn(4, 6).to(sim).requires_grad_()
    upstream = torch.randn(4, 6).to(sim)
    with op_tools.OpCapture(results_dir=str(tmp_path), ops=["torch.frexp"]):
        torch.frexp(x).mantissa.backward(upstream)
    (entry,) = find_entries(str(tmp_path))
    replayed = replay(entry, sim, ReplayOptions(acc_check=True))
    assert not any("ones" in note for note in replayed.notes), replayed.notes
    assert replayed.status == "ok" and ("grad vs captured grad", True) in \
        [(c["check"], c["ok"]) for c in replayed.checks], replayed.checks
