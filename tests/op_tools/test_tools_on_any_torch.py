"""Every tool on a CPU training step made of torch's own modules, its calls handled as a device's: the verdict is
clean, nothing it could not check, and the step's numbers and random stream are the ones without it.

No sim (torch >= 2.10), no transformers (torch >= 2.6), no child process: this file runs on any torch the project
declares (``pyproject.toml``), and is the one to run in a venv with an older torch (docs/device_layer.md).
"""

import os

import pytest
import torch

import op_tools
from op_tools.tools.training_monitor import TrainingMonitor

TOOLS = sorted(cls.__name__ for cls in op_tools.FEATURES.values())


@pytest.fixture(autouse=True)
def _results_here(tmp_path, monkeypatch):
    for name in list(os.environ):
        if name.startswith("OP_") or "AUTOCOMPARE" in name:
            monkeypatch.delenv(name)
    monkeypatch.setenv("OP_TOOLS_RESULTS_DIR", str(tmp_path))


class Net(torch.nn.Module):
    """A convolution with batch norm and an in-place ReLU, attention, layer norm, an LSTM and dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.norm = torch.nn.BatchNorm2d(8)
        self.attention = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        self.lstm = torch.nn.LSTM(8, 8, batch_first=True)
        self.layer_norm = torch.nn.LayerNorm(8)
        self.dropout = torch.nn.Dropout(0.1)
        self.head = torch.nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu_(self.norm(self.conv(x)))
        x = x.flatten(2).transpose(1, 2)  # (batch, 16 positions, 8 channels)
        x = x + self.attention(x, x, x, need_weights=False)[0]
        x = self.layer_norm(x + self.lstm(x)[0])
        return self.head(self.dropout(x).mean(1))


def train(tool=None, steps: int = 2) -> list:
    """Two AdamW steps; the losses, the parameters and the random state after."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, target = torch.randn(4, 3, 4, 4), torch.tensor([0, 1, 2, 3])
    losses = []
    for _ in range(steps):
        if tool is not None:
            tool.start()
        loss = torch.nn.functional.cross_entropy(model(x), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if tool is not None:
            tool.stop()
        losses.append(loss.item())
    return [losses, [p.detach().clone() for p in model.parameters()], torch.get_rng_state()]


@pytest.mark.parametrize("name", TOOLS)
def test_each_tool_on_a_cpu_training_step_is_clean_and_changes_nothing(name):
    expected = train()
    tool = getattr(op_tools, name)()
    tool.handles_cpu_calls = True  # the host taken as the device: no other device runs on every torch
    got = train(tool)
    # OpDtypeCast's default table casts float16 and bfloat16: over this float32 step it says it cast nothing
    assert tool.verdict() == ("unchecked" if name == "OpDtypeCast" else "clean"), tool.closing_line()
    if name == "OpDtypeCast":
        assert "(0 cast)" in tool.closing_line() and "no call was cast" in tool.not_checked()
    # it saw the step, not a few stray calls (OpSelfCheck wraps the functions it checks, within its time budget)
    assert sum(tool.handled.values()) >= (3 if name == "OpSelfCheck" else 100), tool.closing_line()
    assert got[0] == expected[0]
    assert all(torch.equal(a, b) for a, b in zip(got[1], expected[1]))
    assert torch.equal(got[2], expected[2])


def test_the_training_monitor_on_a_cpu_training_step_is_clean_and_changes_nothing():
    expected = train()
    torch.manual_seed(0)
    model = Net()
    monitor = TrainingMonitor(model=model)
    got = train(monitor)
    assert monitor.verdict() == "clean", monitor.closing_line()
    assert got[0] == expected[0]
    assert torch.equal(got[2], expected[2])


def test_a_capture_of_the_step_replays_ok_for_every_entry(tmp_path):
    from op_tools.offline.replay import ReplayOptions, find_entries, replay

    tool = op_tools.OpCapture()
    tool.handles_cpu_calls = True
    train(tool, steps=1)
    entries = find_entries(str(tmp_path / "op_capture_results"))
    assert len(entries) > 50
    results = [replay(entry, "cpu", ReplayOptions(acc_check=True)) for entry in entries]
    assert [(r.entry.label, r.status, r.error) for r in results if r.status != "ok"] == []  # not checked: no pass


def test_two_recordings_of_the_step_compare_equal_and_a_fault_in_the_convolution_is_the_first_divergence(tmp_path,
                                                                                                      monkeypatch):
    from op_tools.offline.compare_runs import compare

    def record(name: str, noise: float = 0.0) -> str:
        monkeypatch.setenv("OP_TOOLS_RESULTS_DIR", str(tmp_path / name))
        hook = torch.nn.Conv2d.register_forward_hook if noise else None
        handle = None
        if hook is not None:  # a fault in the device's convolution: its output off by a relative `noise`
            handle = torch.nn.modules.module.register_module_forward_hook(
                lambda module, args, out: out * (1 + noise) if isinstance(module, torch.nn.Conv2d) else None)
        try:
            train(op_tools.OpCapture(mode="stats"), steps=1)
        finally:
            if handle is not None:
                handle.remove()
        return str(tmp_path / name)

    clean = record("clean")
    assert compare(clean, record("again")).divergences == []
    first = compare(clean, record("fault", noise=1e-3)).first_divergence()
    assert first is not None and (first.phase, first.module) == ("forward", "norm"), first


@pytest.mark.parametrize("name", TOOLS)
def test_a_tool_that_handled_no_call_earns_no_clean_verdict(name):
    # a CUDA-written script run where the device's package was not imported: every call on the CPU, the reference
    tool = getattr(op_tools, name)()
    with tool:
        torch.nn.Linear(4, 4)(torch.randn(2, 4)).sum().backward()
    said = "no call of the ops it checks ran on a device" if name == "OpSelfCheck" else "no call was handled"
    assert tool.verdict() == "unchecked" and said in tool.closing_line(), tool.closing_line()


def test_a_training_monitor_that_monitored_no_step_earns_no_clean_verdict(caplog):
    model = torch.nn.Linear(4, 4)
    monitor = TrainingMonitor(model=model)
    with caplog.at_level("INFO", logger="op_tools"), monitor:
        model(torch.randn(2, 4)).sum().backward()  # no optimizer step
    assert monitor.verdict() == "unchecked"
    assert any("no step monitored" in r.getMessage() for r in caplog.records)
