"""OpAutoCompare's verdicts judged in batches (``verdict_queue.py``): one wait for the device per batch of calls, and
the verdicts those of judging each call when it returns: on a device whose copies land late (sim's lag), with
faults, and with a cached input written without a version bump."""

import contextlib
import math
import os

import pytest
import torch
from tiny_models import tiny_llama

import ditorch.sim
import op_tools


@pytest.fixture(autouse=True)
def _no_autocompare_variables(monkeypatch):
    for name in list(os.environ):
        if "AUTOCOMPARE" in name or name.endswith("_OP_DTYPE_CAST_DICT"):
            monkeypatch.delenv(name)


def _llama_step(device: str, **compare):
    """A Llama training step under OpAutoCompare with ``compare`` (none without): the tool, and what the step (the
    tool's stop with it) charged the device."""
    torch.manual_seed(0)
    model = tiny_llama().to(device)
    ids = torch.randint(0, 128, (2, 16)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = torch.sim.device_counts()
    with op_tools.OpAutoCompare(**compare) if compare else contextlib.nullcontext() as tool:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        optimizer.step()
    return tool, torch.sim.device_counts() - before


def _verdicts(tool: op_tools.OpAutoCompare) -> tuple:
    """What a run's verdicts say, without the ids and times that differ from run to run."""
    rows = [(op, phase, module, c.name, c.passed, c.max_abs_diff, c.max_relative_diff)
            for op, _, phase, c, _, module, _, _ in tool.rows]
    failures = [(f["op"], f["phase"], f["module"], f["failing"]) for f in tool.failures]
    return rows, failures, dict(tool.counts), dict(tool.skipped)


def test_a_training_step_waits_for_the_device_once_per_batch_of_verdicts(sim):
    _llama_step(sim, verdict_batch=64)  # what a process learns once (the output dtypes)
    _, plain = _llama_step(sim)
    tool, batched = _llama_step(sim, verdict_batch=64)
    _, at_once = _llama_step(sim, verdict_batch=1)
    compared = tool.counts["forward compared"] + tool.counts["backward compared"]
    assert compared > 200 and tool.failures == []
    # a wait per copy judged at once; one per 64 verdicts, and one where a call writes what a queued call may re-read
    assert at_once.synchronizations - plain.synchronizations > compared
    assert batched.synchronizations - plain.synchronizations <= compared / 64 + 2, (batched, plain, compared)
    # the same copies, made without waiting
    assert batched.device_to_host_copies == at_once.device_to_host_copies


def test_with_the_reference_on_the_device_a_step_waits_once_per_batch_and_once_per_call_the_cpu_judges(sim):
    """The device's reference and the comparison's statistics run when a call returns; the statistics come back with
    the batch's one wait. A call the device cannot clear is judged on the CPU from copies brought back together: one
    wait more each (the ops' first and cross-checked calls, and those above the floor with no precedent yet)."""
    for _ in range(2):  # what a process learns once: output dtypes, first calls, the first cross-checks
        _llama_step(sim, verdict_batch=64, reference="device")
    _, plain = _llama_step(sim)
    tool, counts = _llama_step(sim, verdict_batch=64, reference="device")
    compared = tool.counts["forward compared"] + tool.counts["backward compared"]
    on_the_cpu = sum(n for (_, place), n in tool.reference_place.items() if place not in ("device", "cross-checked"))
    assert compared > 200 and tool.failures == [] and on_the_cpu < compared / 16, tool.reference_place
    assert counts.synchronizations - plain.synchronizations <= compared / 64 + 2 + on_the_cpu, \
        (counts, plain, compared, tool.reference_place)


@pytest.mark.parametrize("reference", ["cpu", "device"])
# in the device's float32 kernels only (forward and backward: mm runs the linear layers' both): the float64
# reference on the device stays exact, and draws no noise (a draw more would change the noise of every fault after it)
@pytest.mark.parametrize("faults", ["", "silu@float32:noise=1e-2;mm@float32:noise=1e-2"])
def test_verdicts_judged_in_batches_on_a_late_device_are_those_judged_at_once(sim, faults, reference):
    """sim's lag holds each copy's values back (NaN) until an event after it is waited for: a verdict read from a
    copy before it landed would differ or fail. With the reference on the device, the calls it cannot clear are
    judged on the CPU from copies brought back late too."""
    noise = ditorch.sim.fault_injection.TABLE._noise_gen  # each run draws the same noise: from the seed
    with ditorch.sim.faults(faults):
        noise.manual_seed(0)
        at_once = _verdicts(_llama_step(sim, verdict_batch=1, reference=reference)[0])
    with ditorch.sim.faults(faults), ditorch.sim.asynchronous(lag=16):
        noise.manual_seed(0)
        batched = _verdicts(_llama_step(sim, verdict_batch=64, reference=reference)[0])
    if reference == "device":
        # What the process learnt in the first run (first calls, cross-checks, precedents) moves some calls of the
        # second from the CPU's verdict to the device's, whose statistics are computed otherwise (torch, not numpy;
        # the differences of float64 values near 1 where the errors are near 1e-9): the same figures to 6 digits.
        assert [r[:5] for r in batched[0]] == [r[:5] for r in at_once[0]]
        assert all(math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-300) for r, q in zip(batched[0], at_once[0])
                   for a, b in zip(r[5:], q[5:])), [(r, q) for r, q in zip(batched[0], at_once[0]) if r != q]
        assert batched[1:] == at_once[1:]
    else:
        assert batched == at_once
    assert bool(at_once[1]) == bool(faults)  # the faults are found; the clean run has no failure
    assert not faults or {phase for _, phase, _, _ in at_once[1]} == {"forward", "backward"}


def test_a_queued_call_re_reads_a_stale_input_before_a_later_call_writes_it(sim):
    x = torch.randn(64, device=sim)
    with op_tools.OpAutoCompare() as tool:
        torch.exp(x)  # x's copy is cached
        with torch._C.DisableTorchFunction(), ditorch.sim.faults("add_:unversioned"):
            x.add_(1.0)  # a write no call shows and the version counter does not (a collective's from C++)
        torch.exp(x)  # compared with the stale cached copy: fails, then is re-read ...
        x.mul_(0.5)  # ... before this write: the queue judges it first
    assert tool.failures == [] and tool.stale_copies == 1, tool.failures
    assert tool.counts["forward compared"] == 3


def test_a_call_the_tool_does_not_handle_writes_only_after_the_queue_is_judged(sim):
    x = torch.randn(64, device=sim)
    with op_tools.OpAutoCompare(disable=["torch.Tensor.mul_"]) as tool:
        torch.exp(x)
        with torch._C.DisableTorchFunction(), ditorch.sim.faults("add_:unversioned"):
            x.add_(1.0)
        torch.exp(x)
        x.mul_(0.5)  # not handled: the engine tells the tool before it writes
    assert tool.failures == [] and tool.stale_copies == 1, tool.failures


def test_a_steps_verdicts_are_all_in_when_its_optimizer_step_returns(sim):
    torch.manual_seed(0)
    model = tiny_llama().to(sim)
    ids = torch.randint(0, 128, (2, 16)).to(sim)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with ditorch.sim.faults("silu:noise=1e-2"), op_tools.OpAutoCompare() as tool:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        optimizer.step()
        assert len(tool._queue) == 0  # nothing waits: the step's cost includes its judging
        assert [f["op"] for f in tool.failures][:1] == ["torch.nn.functional.silu"]
        judged = tool.counts["forward compared"]
    assert tool.counts["forward compared"] == judged  # stop() had nothing left to judge


def test_judge_queued_completes_the_verdicts_without_an_optimizer(sim):
    x = torch.randn(64, device=sim)
    with ditorch.sim.faults("silu:noise=1e-2"), op_tools.OpAutoCompare() as tool:
        torch.nn.functional.silu(x)
        assert tool.failures == []  # still queued
        tool.judge_queued()
        assert [f["op"] for f in tool.failures] == ["torch.nn.functional.silu"]



def test_module_to_right_after_a_forward_swaps_the_parameters_as_without_the_tool(sim):
    """sim's parameters are a traceable tensor subclass: ``Module.to`` swaps them (``torch.utils.swap_tensors``),
    which refuses one that a view still refers to. The queue holds no call's arguments or result (the swap's own
    ``view_as`` call, queued, kept its view of the weight alive)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 8).to(sim)
    with op_tools.OpAutoCompare() as tool:
        linear(torch.randn(4, 8, device=sim))
        linear.to(torch.float64)
        assert linear.weight.dtype == torch.float64
    assert tool.failures == [] and not tool.not_checked()
