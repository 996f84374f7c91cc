import collections
import csv
import glob
import os
import shutil

import pytest
import torch
from tiny_models import mlp, tiny_gpt2, train_llama, train_mlp

import op_tools
from op_tools.output import reporting


def _files(root, name):
    return sorted(glob.glob(os.path.join(root, "op_capture_results", "**", name), recursive=True))


def test_capture_writes_inputs_outputs_and_gradients_in_the_original_layout(sim, tmp_path):
    w = torch.randn(3, 4, device=sim, requires_grad=True)
    x = torch.randn(2, 4, device=sim)
    with op_tools.OpCapture():
        y = torch.nn.functional.linear(x, w)
    y.sum().backward()
    root = str(tmp_path / "results")
    (input_file,) = _files(root, "input.pth")
    relative = os.path.relpath(input_file, os.path.join(root, "op_capture_results")).split(os.sep)
    assert relative[0] == "torch.nn.functional.linear" and relative[1] == str(os.getpid())
    assert relative[2].isdigit() and len(relative) == 5  # <op>/<pid>/<forward_id>/<timestamp>/input.pth
    folder = os.path.dirname(input_file)
    assert sorted(os.listdir(folder)) == ["grad_inputs.pth", "grad_outputs.pth", "input.pth", "output.pth"]
    data = op_tools.load_op_args(input_file)
    assert data["name"] == "torch.nn.functional.linear"
    replay = torch.nn.functional.linear(*data["args"], **data["kwargs"])
    output = op_tools.load_op_args(os.path.join(folder, "output.pth"))["args"][0]
    assert torch.equal(replay, output) and torch.equal(output, y.detach().cpu())
    grad_outputs = op_tools.load_op_args(os.path.join(folder, "grad_outputs.pth"))["args"]
    assert torch.equal(grad_outputs[0], torch.ones(2, 3))


def test_identical_tensors_are_stored_once_and_files_still_load_alone(sim, tmp_path):
    w = torch.randn(64, 64, device=sim)
    x = torch.randn(4, 64, device=sim)
    with op_tools.OpCapture() as capture:
        for _ in range(3):
            torch.nn.functional.linear(x, w)
    inputs = _files(str(tmp_path / "results"), "input.pth")
    assert len(inputs) == 3
    raw = [torch.load(f, weights_only=True) for f in inputs]
    inline = [r for r in raw if isinstance(r["args"][1], torch.Tensor)]
    assert len(inline) == 1  # the weight is written once, referenced twice
    for f in inputs:
        args = op_tools.load_op_args(f)["args"]
        assert torch.equal(args[1], w.cpu()) and torch.equal(args[0], x.cpu())
    assert capture.store.bytes_written < 2 * 64 * 64 * 4


def test_a_tensor_changed_in_place_is_stored_again(sim, tmp_path):
    x = torch.zeros(8, device=sim)
    with op_tools.OpCapture():
        x.sin()
        x.add_(1)
        x.sin()
    files = sorted(_files(str(tmp_path / "results"), "input.pth"), key=lambda f: int(f.split(os.sep)[-3]))
    values = [op_tools.load_op_args(f)["args"][0] for f in files]
    assert [v[0].item() for v in values] == [0.0, 0.0, 1.0]


def test_llama_training_is_bit_identical_under_capture(sim, tmp_path):
    base = train_llama(sim, steps=2)
    with op_tools.OpCapture():
        assert train_llama(sim, steps=2) == base
    root = str(tmp_path / "results")
    assert _files(root, "grad_inputs.pth") and _files(root, "output.pth")


def test_summary_mode_writes_an_aggregated_table_and_operator_input_log(sim, tmp_path, monkeypatch):
    monkeypatch.setenv("OP_CAPTURE_MODE", "summary")
    torch.manual_seed(0)
    model = tiny_gpt2().to(sim)
    ids = torch.randint(0, 128, (8, 32), device=sim)
    with op_tools.OpCapture():
        model(input_ids=ids, labels=ids).loss.backward()
    folder = tmp_path / "results" / "op_capture_results"
    assert not list(folder.glob("torch.*"))  # metadata only: no per-call folders
    (csv_file,) = folder.glob("summary_pid*.csv")
    (log_file,) = folder.glob("summary_pid*.txt")
    table = csv_file.read_text()
    # the original's columns in their places, then rank, step and time (docs/tools/README.md#ranks-steps-and-times)
    assert table.splitlines()[0] == "op,count,shapes,dtypes,strides,location,module,rank,step,time"
    rows = {r["op"]: r for r in csv.DictReader(table.splitlines())}  # each row's first call's module
    assert rows["torch.nn.functional.layer_norm"]["module"] == "transformer.h.0.ln_1"
    for op in ("torch.nn.functional.layer_norm", "torch.nn.functional.scaled_dot_product_attention"):
        assert op in table
    log = log_file.read_text()
    assert "Operator: torch.nn.functional.layer_norm" in log
    assert ("cnt: 5, ((T([8, 32, 64], f32), (64,)), {'weight': T([64], f32), 'bias': T([64], f32), 'eps': 1e-05})"
            in log)
    assert "Operator: torch.nn.functional.scaled_dot_product_attention\ncnt: 2, ((T([8, 4, 32, 16], f32, stride=" in log


def test_rank_appears_in_the_path_under_torchrun(sim, tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with op_tools.OpCapture():
        torch.ones(2, device=sim).sin()
    assert (tmp_path / "results" / "op_capture_results" / "rank1" / "torch.Tensor.sin").is_dir()


def test_op_tools_does_not_import_ditorch(run_script):
    import subprocess
    import sys

    code = "import sys, op_tools; assert not any(m.startswith('ditorch') for m in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert result.returncode == 0, result.stderr


# --- bounded captures: steps, calls per op, what was dropped ---

def _index(root) -> list[dict]:
    (path,) = glob.glob(os.path.join(root, "op_capture_results", "index_pid*.csv"))
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _closing(caplog) -> str:
    """The closing line of the last OpCapture session stopped, its lines wrapped at the console's width joined."""
    return reporting.unwrapped([r.getMessage() for r in caplog.records if r.getMessage().startswith("OpCapture:")][-1])


def test_steps_selects_the_steps_saved_and_the_closing_line_counts_the_calls_left_out(sim, tmp_path, caplog):
    with op_tools.OpCapture(results_dir=tmp_path / "every"):
        train_mlp(sim, steps=5)
    per_step = collections.Counter(int(r["step"]) for r in _index(str(tmp_path / "every")))
    assert sorted(per_step) == [0, 1, 2, 3, 4]
    with caplog.at_level("INFO", logger="op_tools"), op_tools.OpCapture(steps="0,2-3") as capture:
        train_mlp(sim, steps=5)
    root = str(tmp_path / "results")
    index = _index(root)
    assert collections.Counter(int(r["step"]) for r in index) == {s: per_step[s] for s in (0, 2, 3)}
    for r in index:  # the index row names the call's folder, whose input.pth says the same
        data = op_tools.load_op_args(os.path.join(root, "op_capture_results", r["folder"], "input.pth"))
        assert (data["name"], data["module"], data["step"]) == (r["op"], r["module"], int(r["step"]))
        assert r["folder"].split(os.sep)[2] == r["forward_id"]
    left_out = per_step[1] + per_step[4]
    assert capture.outside_steps == left_out
    assert _closing(caplog).endswith(f"; {left_out} calls outside steps 0,2-3 (OP_CAPTURE_STEPS) not saved")


def test_max_calls_per_op_saves_the_first_calls_of_each_op_and_counts_the_others(sim, tmp_path, caplog):
    x = torch.randn(4, device=sim)
    with caplog.at_level("INFO", logger="op_tools"), op_tools.OpCapture(max_calls_per_op=2) as capture:
        for _ in range(5):
            x = torch.add(x, 1)
        x.sin()
    index = _index(str(tmp_path / "results"))
    assert [r["op"] for r in index] == ["torch.add", "torch.add", "torch.Tensor.sin"]
    assert len(_files(str(tmp_path / "results"), "input.pth")) == 3
    assert capture.over_op_cap == {"torch.add": 3}
    assert "; 3 calls of 1 op past 2 per op (OP_CAPTURE_MAX_CALLS_PER_OP) not saved" in _closing(caplog)


def test_a_bounded_capture_of_a_training_step_saves_each_op_once(sim, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("OP_CAPTURE_STEPS", "1")
    monkeypatch.setenv("OP_CAPTURE_MAX_CALLS_PER_OP", "1")
    with caplog.at_level("INFO", logger="op_tools"), op_tools.OpCapture() as capture:
        train_llama(sim, steps=3)
    index = _index(str(tmp_path / "results"))
    ops = [r["op"] for r in index]
    assert len(ops) == len(set(ops)) == len(capture.saved_per_op) and {r["step"] for r in index} == {"1"}
    assert sum(capture.saved_per_op.values()) + capture.outside_steps + sum(capture.over_op_cap.values()) == \
        sum(capture.handled.values())  # every call handled is saved or counted under one reason
    closing = _closing(caplog)
    assert "OP_CAPTURE_STEPS) not saved" in closing and "OP_CAPTURE_MAX_CALLS_PER_OP) not saved" in closing
    modules = {r["module"] for r in index}
    assert "model.layers.0.mlp.act_fn" in modules or "model.layers.1.mlp.act_fn" in modules


def test_each_saved_call_records_its_module_path(sim, tmp_path):
    model = mlp().to(sim)
    with op_tools.OpCapture(ops=["torch.nn.functional.linear", "torch.nn.functional.gelu"]):
        model(torch.randn(2, 16, device=sim))
    index = _index(str(tmp_path / "results"))
    assert [(r["op"], r["module"]) for r in index] == [
        ("torch.nn.functional.linear", "0"), ("torch.nn.functional.gelu", "1"), ("torch.nn.functional.linear", "3")]
    assert [int(r["forward_id"]) for r in index] == sorted(int(r["forward_id"]) for r in index)


def test_summary_mode_counts_only_the_chosen_steps(sim, tmp_path, caplog):
    with caplog.at_level("INFO", logger="op_tools"), op_tools.OpCapture(mode="summary", steps=range(1, 3)) as tool:
        train_mlp(sim, steps=4)
    assert {r["step"] for r in tool.summary.values()} == {1}  # each row's first call: step 1
    linears = sum(r["count"] for r in tool.summary.values() if r["op"] == "torch.nn.functional.linear")
    assert linears == 2 * 2  # two linears a step, steps 1 and 2
    assert f"; {tool.outside_steps} calls outside steps 1-2 (OP_CAPTURE_STEPS) not counted" in _closing(caplog)


@pytest.mark.parametrize(("kwargs", "env", "words"), [
    ({"steps": "1-0"}, {}, ["steps='1-0'", "ends before it starts"]),
    ({}, {"OP_CAPTURE_STEPS": "first"}, ["OP_CAPTURE_STEPS='first'", "not a step"]),
    ({"max_calls_per_op": 0}, {}, ["max_calls_per_op=0", "must be >= 1"]),
    ({}, {"OP_CAPTURE_MAX_CALLS_PER_OP": "many"}, ["OP_CAPTURE_MAX_CALLS_PER_OP='many'", "an integer >= 1"]),
    ({"mode": "stats", "steps": 2}, {}, ["OP_CAPTURE_STEPS=2", "stats mode records every step"]),
    ({"mode": "summary", "max_calls_per_op": 3}, {}, ["OP_CAPTURE_MAX_CALLS_PER_OP=3", "full only"]),
])
def test_a_bad_or_inapplicable_bound_is_an_error_naming_it(kwargs, env, words, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as info:
        op_tools.OpCapture(**kwargs).start()
    for word in words:
        assert word in str(info.value)


def test_step_selections_read_as_written():
    from op_tools.config.step_selection import convert_steps, parse_steps

    assert [s for s in range(8) if s in parse_steps(" 0, 2-3,6- ")] == [0, 2, 3, 6, 7]
    assert parse_steps("all") is None and parse_steps("") is None
    assert str(parse_steps("0,2-3,5-")) == "0,2-3,5-"
    assert str(convert_steps([3, 1])) == "1,3" and str(convert_steps(range(2, 5))) == "2-4"
    assert 4 not in convert_steps(3)
    with pytest.raises(TypeError):
        convert_steps([True])


def test_an_index_that_cannot_be_written_leaves_the_verdict_unchecked(sim, tmp_path, caplog):
    x = torch.randn(4, device=sim)
    folder = tmp_path / "out" / "op_capture_results"
    with caplog.at_level("INFO", logger="op_tools"), op_tools.OpCapture(results_dir=tmp_path / "out") as capture:
        x.sin()
        shutil.rmtree(folder)
        folder.write_text("")  # the folder is gone by stop(): no index can be written there
    closing = [r for r in caplog.records if r.getMessage().startswith("OpCapture:")][-1]
    assert closing.levelname == "WARNING" and capture.verdict() == "unchecked"
    message = reporting.unwrapped(closing.getMessage())
    assert f"the index {folder}{os.sep}index_pid" in message and "not written" in message


def test_numpy_scalars_are_saved_as_the_python_numbers_they_equal(sim, tmp_path):
    # np.float64(2) and np.int64(3) were pickled with numpy's globals: weights_only loading refused the file
    import numpy as np

    x = torch.randn(4, 6, device=sim)
    with op_tools.OpCapture():
        x * np.float64(2.0)
        torch.add(x, np.int64(3))
        torch.sum(x, dim=np.int64(1))
        x * np.float32(0.1)
        x * np.bool_(True)
    values = {}
    for f in _files(str(tmp_path / "results"), "input.pth"):
        data = torch.load(f, weights_only=True)  # no numpy global left to refuse
        values.setdefault(data["name"], []).append(data["args"][1] if len(data["args"]) > 1 else data["kwargs"]["dim"])
    assert sorted(values["torch.Tensor.mul"], key=str) == [0.10000000149011612, 2.0, True]  # float32's exact value
    assert values["torch.add"] == [3] and values["torch.sum"] == [1]
    assert all(type(v) in (bool, int, float) for vs in values.values() for v in vs)


def test_an_input_with_gaps_overlaps_or_an_offset_is_saved_as_its_storage_span_and_loads_with_its_layout(sim, tmp_path):
    # a device tensor was copied to the host dense: x[:, ::2]'s strides and an expanded input's stride 0 were lost,
    # and an op reading its storage (as_strided) read other memory when replayed
    x = torch.arange(24.0).reshape(4, 6).to(sim)
    gaps, expanded, offset = x[:, ::2], x[0].expand(4, 6), x[1:]
    with op_tools.OpCapture(results_dir=str(tmp_path), ops=["torch.sin"]):
        for t in (gaps, expanded, offset):
            torch.sin(t)
    files = sorted(glob.glob(os.path.join(str(tmp_path), "**", "input.pth"), recursive=True))
    loaded = {tuple(d["args"][0].stride()): d for d in map(op_tools.load_op_args, files)}
    for t in (gaps, expanded, offset):
        data = loaded[t.stride()]
        kept = data["args"][0]
        assert torch.equal(kept, t.cpu()) and kept.stride() == t.stride(), (kept.stride(), t.stride())
        assert kept.as_strided((3,), (1,)).tolist() == t.as_strided((3,), (1,)).tolist()  # the storage as it was
        assert data["op_tools_storage_offsets"] == {("args", 0): t.storage_offset()}
    # the span, not the dense copy: the expanded input's 6 elements once, x[:, ::2]'s 23 with the gaps
    raw = [torch.load(f, weights_only=True) for f in files]  # plain data for any loader
    assert sorted(r["args"][0]["op_tools_strided"].numel() for r in raw) == [6, 18, 23]
    assert all(r["layouts"] == 1 for r in raw)
