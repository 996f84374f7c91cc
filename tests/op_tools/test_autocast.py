"""Autocast read the same way everywhere: each tool returns what the op returns under the user's autocast, the
same-dtype reference casts as the device's autocast does op by op, and a capture replays under its autocast."""

import os

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import op_tools
from op_tools.numerics.device_math import DeviceMath, emulated
from op_tools.offline.replay import ReplayOptions, find_entries, replay


@pytest.fixture(autouse=True)
def _no_autocompare_variables(monkeypatch):
    for name in list(os.environ):
        if "AUTOCOMPARE" in name or name.endswith("_OP_DTYPE_CAST_DICT"):
            monkeypatch.delenv(name)


def _calls(device):
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 5).to(device)
    x = torch.randn(4, 8, device=device)
    target = torch.tensor([0, 1, 2, 3], device=device)
    with torch.autocast(torch.device(device).type, dtype=torch.float16):
        logits = linear(x)                         # lower precision: float16
        probabilities = torch.softmax(logits, -1)  # float32 by policy
        loss = F.cross_entropy(logits, target)     # no rule itself; log_softmax inside stays float16, nll float32
    return logits, probabilities, loss


# OpDtypeCast is left out: asked to widen float16, it runs what autocast lowers in float32 (test_dtype_cast.py).
@pytest.mark.parametrize("tool", [op_tools.OpFallback, op_tools.OpAutoCompare])
def test_each_tool_returns_the_dtypes_the_op_returns_under_autocast(sim, tool):
    expected = [t.dtype for t in _calls(sim)]
    assert expected == [torch.float16, torch.float32, torch.float32]
    with tool():
        got = _calls(sim)
    assert [t.dtype for t in got] == expected


def test_the_cpu_replays_the_device_policy_op_by_op():
    logits = torch.randn(4, 5).half()
    target = torch.tensor([0, 1, 2, 3])
    with emulated(DeviceMath(autocast_dtype=torch.float16)):
        loss = F.cross_entropy(logits, target)
        product = torch.mm(torch.randn(3, 4), torch.randn(4, 2))
        total = torch.sum(logits)            # float32 through its dtype argument
        kept = torch.sum(logits, dtype=torch.float16)  # an explicit dtype is kept
    assert (loss.dtype, product.dtype, total.dtype, kept.dtype) == (torch.float32, torch.float16, torch.float32,
                                                                      torch.float16)
    # inside log_softmax(x, dtype=float16) the computation stays float16, as on a device
    expected = F.nll_loss(torch.log_softmax(logits, -1).float(), target)
    assert torch.equal(loss, expected)


def test_autocompare_and_the_replay_agree_on_calls_under_autocast(sim, tmp_path):
    import ditorch.sim

    with op_tools.OpAutoCompare() as clean:
        _calls(sim)
    assert clean.failures == [] and "autocast float16" in clean.summary()
    with op_tools.OpCapture():
        _calls(sim)
    root = str(tmp_path / "results" / "op_capture_results")
    entries = find_entries(root)
    results = [replay(e, sim, ReplayOptions(acc_check=True)) for e in entries]
    assert results and all(r.status == "ok" for r in results), [(r.name, r.checks) for r in results if r.failed]
    assert any("replayed under autocast float16" in r.notes for r in results)
    # a kernel wrong in float16: both name the same call
    with op_tools.OpAutoCompare() as faulty, ditorch.sim.faults("_log_softmax@float16:noise=2e-2"):
        _calls(sim)
    assert [f["op"] for f in faulty.failures] == ["torch.nn.functional.cross_entropy"]
    with ditorch.sim.faults("_log_softmax@float16:noise=2e-2"):
        verdicts = {r.name: r.status for r in (replay(e, sim, ReplayOptions(acc_check=True)) for e in entries)}
    assert verdicts["torch.nn.functional.cross_entropy"] == "mismatch"
    assert {s for name, s in verdicts.items() if name != "torch.nn.functional.cross_entropy"} == {"ok"}
