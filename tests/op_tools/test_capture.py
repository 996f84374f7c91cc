import glob
import os

import torch
from tiny_models import tiny_gpt2, train_llama

import op_tools


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
    assert table.splitlines()[0] == "op,count,shapes,dtypes,strides,location,rank,step,time"
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
