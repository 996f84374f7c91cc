"""OpAutoCompare with its float64 reference on the device (``reference="device"``/``"auto"``), on sim, which computes
float64: the recipes' verdicts are the CPU reference's, a fault in the device's float64 kernels alone is caught by the
cross-check (the op then moves to the CPU, nothing is reported falsely), and the copies to the host mostly go."""

import contextlib
import os

import pytest
import torch
import zoo

import ditorch.sim
import op_tools
from op_tools.numerics import comparison
from op_tools.numerics.device_reference import AGREEMENT_SHARE, Trust, references_differ
from op_tools.offline.run_report.analysis import analyse
from op_tools.offline.run_report.readers import read_results
from op_tools.offline.run_report.report import console_report
from op_tools.tools import autocompare


@pytest.fixture(autouse=True)
def _fresh_process_state(monkeypatch):
    """No variable of the user's, and no trust learnt by another test (it is kept per process)."""
    for name in list(os.environ):
        if "AUTOCOMPARE" in name or name.endswith("_OP_DTYPE_CAST_DICT"):
            monkeypatch.delenv(name)
    monkeypatch.setattr(autocompare.LEARNT, "trust", Trust())


def _places(tool, phase: str) -> dict:
    return {why: n for (p, why), n in tool.reference_place.items() if p == phase}


def _run(workload, device, spec: str = "", **options):
    with op_tools.OpAutoCompare(**options) as tool, ditorch.sim.faults(spec) if spec else contextlib.nullcontext():
        losses = workload.run(device)
    return tool, losses


@pytest.mark.parametrize("workload", zoo.ZOO, ids=[w.name for w in zoo.ZOO])
def test_recipes_with_the_device_reference_keep_their_losses_fail_nothing_and_name_the_cpus_first_fault(sim,
                                                                                                     workload):
    expected = workload.run(sim)
    _run(workload, sim, reference="device")  # first calls of each op: on the CPU, where the rerun's rng is checked
    clean, losses = _run(workload, sim, reference="device")
    assert losses == expected
    assert clean.failures == [], clean.failures[:3]
    forward = _places(clean, "forward")
    assert forward.get("device", 0) > sum(n for why, n in forward.items() if why != "device"), forward
    if workload.name == "checkpoint_reentrant":  # the region's backward runs in CheckpointFunction's, unseen
        assert clean.not_checked().startswith("the backward of custom autograd.Functions not compared "
                                              "(CheckpointFunction:")
    else:
        assert not clean.not_checked()

    spec, suffix = workload.forward_fault
    on_cpu, _ = _run(workload, sim, spec)
    on_device, _ = _run(workload, sim, spec, reference="device")
    first_cpu, first_device = on_cpu.failures[0], on_device.failures[0]
    assert (first_device["op"], first_device["phase"]) == (first_cpu["op"], first_cpu["phase"])
    assert first_device["op"].endswith(suffix)
    # the same ops fail, each judged by the CPU reference (a failure is never the device reference's alone)
    assert {f["op"] for f in on_device.failures} == {f["op"] for f in on_cpu.failures}


def _mlp(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
                                torch.nn.Linear(64, 8)).to(device)
    x = torch.randn(16, 32, device=device)

    def steps(n: int) -> list:
        losses = []
        for _ in range(n):
            loss = model(x).softmax(-1).square().sum()
            loss.backward()
            losses.append(loss.item())
        return losses

    return steps


def test_a_fault_in_the_devices_float64_kernel_alone_is_caught_by_the_cross_check_and_the_real_fault_still_found(
        sim, caplog, tmp_path):
    steps = _mlp(sim)
    with op_tools.OpAutoCompare(reference="device"):
        steps(1)  # the ops' first calls
    # the linear's float64 product is wrong (the device reference's), and so is the float32 gelu (the device's)
    with op_tools.OpAutoCompare(reference="device", results_dir=str(tmp_path)) as tool, ditorch.sim.faults(
            "addmm@float64:noise=1e-3;gelu@float32:noise=1e-2"), caplog.at_level("WARNING", "op_tools"):
        steps(3)
    assert [f["op"] for f in tool.failures][:1] == ["torch.nn.functional.gelu"]
    assert {f["op"] for f in tool.failures} == {"torch.nn.functional.gelu"}  # nothing falsely reported
    assert list(autocompare.LEARNT.trust.untrusted) == ["torch.nn.functional.linear"]
    assert "float64 reference on sim disagrees with the CPU's" in caplog.text
    forward = _places(tool, "forward")
    assert forward["its float64 kernels on the device disagreed with the CPU's"] >= 4, forward
    assert "untrusted for 1 op (torch.nn.functional.linear: on the CPU)" in tool.closing_line()
    assert "torch.nn.functional.linear: the device's float64 reference disagreed" in tool.summary()
    # and the run report says so beside the failure it names first
    report = console_report(analyse(read_results(str(tmp_path))))
    assert "NOTE: rank 0: OpAutoCompare's float64 reference on sim disagreed with the CPU's for " \
        "torch.nn.functional.linear (forward: normalised difference" in report
    assert "what went wrong first: " in report and "torch.nn.functional.gelu" in report.split("what went wrong")[1]


def test_a_backward_fault_is_found_through_the_device_reference_and_judged_on_the_cpu(sim):
    steps = _mlp(sim)
    with op_tools.OpAutoCompare(reference="device"):
        steps(1)
    with op_tools.OpAutoCompare(reference="device") as tool, ditorch.sim.faults("gelu_backward@float32:noise=1e-2"):
        steps(2)
    assert [(f["op"], f["phase"]) for f in tool.failures][:1] == [("torch.nn.functional.gelu", "backward")]
    assert {f["phase"] for f in tool.failures} == {"backward"}
    backward = _places(tool, "backward")
    assert backward["its verdict needed the CPU"] >= 2 and backward["device"] > 0, backward
    assert autocompare.LEARNT.trust.untrusted == {}  # the float64 backward was right: no op moved


@pytest.mark.parametrize("batch", [1, 64])
def test_a_backward_kernel_writing_its_upstream_gradient_is_found_with_the_reference_on_the_device(sim, batch):
    """``tanh_backward`` in float32 halves the upstream gradients it is given, then computes from them: ``y``'s (the
    sum autograd makes of two, which no call made) and ``z``'s (made by ``mul``'s backward). Kept after the backward
    ran, the upstream was what the kernel wrote, the device's float64 reference computed from it agreed with the
    kernel, and both calls passed: the upstream is kept as it arrives, before the node runs."""

    def run():
        x = torch.linspace(-1, 1, 256, device=sim, requires_grad=True)
        y = torch.tanh(x * 2.0)
        z = torch.tanh(x * 3.0)
        (y * 3.0 + y + z * torch.linspace(1, 2, 256, device=sim)).sum().backward()
        return x.grad.cpu()

    with op_tools.OpAutoCompare(reference="device", verdict_batch=batch):
        right = run()  # the ops' first calls: on the CPU
        run()  # their first calls on the device: cross-checked against the CPU's
    with ditorch.sim.faults("tanh_backward@float32:scratch=-0.5"), \
            op_tools.OpAutoCompare(reference="device", verdict_batch=batch) as tool:
        wrong = run()
        tool.stop()  # judged while the kernel still writes its input, as a real one does at every call
    assert torch.allclose(wrong, right / 2)  # the fault acted
    assert [(f["op"], f["phase"]) for f in tool.failures] == [("torch.tanh", "backward")] * 2
    assert set(_places(tool, "forward")) == {"device"}  # the calls judged against the device's reference
    assert autocompare.LEARNT.trust.untrusted == {}  # the float64 kernels were right: no op moved


def test_a_clean_step_judged_on_the_device_copies_a_fraction_of_what_the_cpu_reference_copies(sim):
    steps = _mlp(sim)
    with op_tools.OpAutoCompare(reference="device"):
        steps(2)  # each op's first call, and its first on the device (cross-checked)
    charges = {}
    for reference in ("cpu", "device"):
        with op_tools.OpAutoCompare(reference=reference, cross_check_every=1000) as tool:
            before = torch.sim.device_counts()
            steps(2)
            charges[reference] = torch.sim.device_counts() - before
        assert tool.failures == []
    cpu, device = charges["cpu"], charges["device"]
    # what stays: the losses' item() and each comparison's few statistics
    assert device.device_to_host_bytes * 20 < cpu.device_to_host_bytes, (device, cpu)


def test_auto_on_a_device_without_float64_runs_the_reference_on_the_cpu_and_says_why_once(sim, caplog):
    steps = _mlp(sim)
    autocompare.LEARNT.float64.pop("sim", None)
    try:
        with ditorch.sim.faults(".*@float64:unsupported"), caplog.at_level("INFO", "op_tools"), \
                op_tools.OpAutoCompare(reference="auto") as tool:
            steps(2)
    finally:
        autocompare.LEARNT.float64.pop("sim", None)  # learnt under the fault: not the sim's truth
    assert tool.failures == [] and tool.counts["forward compared"] > 0
    assert _places(tool, "forward").get("device", 0) == 0
    said = [r for r in caplog.records if "reference=auto:" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "INFO", [r.getMessage() for r in said]
    assert "reference=auto: the float64 reference runs on the CPU, as sim has no float64 kernels" in \
        said[0].getMessage()


def test_calls_past_the_memory_bound_are_compared_on_the_cpu_and_counted(sim):
    steps = _mlp(sim)
    with op_tools.OpAutoCompare(reference="device"):
        steps(1)
    with op_tools.OpAutoCompare(reference="device", device_reference_max_bytes=512) as tool:
        steps(1)
    forward = _places(tool, "forward")
    assert forward.get("device", 0) == 0
    assert forward["its float64 copies would pass OP_AUTOCOMPARE_DEVICE_REFERENCE_MAX_BYTES"] > 0, forward
    assert tool._memory.held == 0  # every call's copies given back


def test_the_setting_reads_its_variable_and_rejects_an_unknown_place(sim, monkeypatch):
    monkeypatch.setenv("OP_AUTOCOMPARE_REFERENCE", "device")
    with op_tools.OpAutoCompare() as tool:
        pass
    assert tool.settings.reference == "device"
    monkeypatch.setenv("OP_AUTOCOMPARE_REFERENCE", "gpu")
    with pytest.raises(ValueError, match="OP_AUTOCOMPARE_REFERENCE='gpu': unknown choice 'gpu'"):
        op_tools.OpAutoCompare().start()


def test_two_references_agree_within_float64_rounding_and_differ_beyond_it():
    torch.manual_seed(0)
    a, b = torch.randn(64, 4096, dtype=torch.float64), torch.randn(4096, 64, dtype=torch.float64)
    blocked = sum(a[:, i:i + 256] @ b[i:i + 256] for i in range(0, 4096, 256))  # another summation order
    assert references_differ(a @ b, blocked, torch.float32) is None
    wrong = (a @ b) * (1 + 64 * AGREEMENT_SHARE * torch.finfo(torch.float32).eps)
    assert references_differ(wrong, a @ b, torch.float32) is not None
    nan = (a @ b).clone()
    nan[0, 0] = float("nan")
    assert "nan/inf" in references_differ(nan, a @ b, torch.bfloat16)
    # A sum whose terms cancel: two correct float64 orders differ by far more than an epsilon of its tiny result,
    # and the float32 result the verdict judged errs by more still; within a sixteenth of that, they agree.
    terms = torch.randn(1 << 20, dtype=torch.float64) * 1e8
    terms -= terms.mean()
    in_order, shuffled = terms.sum(), terms[torch.randperm(terms.numel())].sum()
    judged = float((terms.float().sum().double() - in_order).abs() / (2 * in_order.abs()))
    assert references_differ(shuffled, in_order, torch.float32) is not None  # an epsilon alone: a false alarm
    assert references_differ(shuffled, in_order, torch.float32, judged) is None


def test_a_nan_from_a_kernel_wrong_in_float64_too_is_judged_on_the_cpu_not_passed_as_agreeing(sim):
    steps = _mlp(sim)
    with op_tools.OpAutoCompare(reference="device"):
        steps(2)  # the first calls, and the cross-check of each op's first call on the device
    # every dtype's gelu gives nan: the device reference agrees with the result, the CPU's does not
    with op_tools.OpAutoCompare(reference="device", cross_check_every=1000) as tool, ditorch.sim.faults("gelu:nan"):
        steps(1)
    assert [(f["op"], f["phase"]) for f in tool.failures][:1] == [("torch.nn.functional.gelu", "forward")]


def test_a_call_whose_float64_copies_run_out_of_device_memory_is_compared_on_the_cpu(sim, monkeypatch):
    from op_tools.numerics.device_reference import DeviceCopies

    steps = _mlp(sim)
    with op_tools.OpAutoCompare(reference="device"):
        steps(2)
    # A mock of the allocator failing (sim's memory has no bound): every third copy raises PyTorch's OOM error.
    copy, made = DeviceCopies.copy, [0]

    def short_of_memory(self, t):
        made[0] += 1
        if made[0] % 3 == 0:
            raise torch.OutOfMemoryError("CUDA out of memory (a mock)")
        return copy(self, t)

    monkeypatch.setattr(DeviceCopies, "copy", short_of_memory)
    with op_tools.OpAutoCompare(reference="device") as tool:
        steps(1)
    forward = _places(tool, "forward")
    assert forward["out of device memory for its float64 copies"] > 0 and forward["device"] > 0, forward
    assert tool.failures == [] and not tool.not_checked()
    assert tool.counts["forward compared"] == sum(forward.values())


@pytest.mark.gpu
def test_on_a_cuda_gpu_the_recipes_judged_on_the_device_fail_nothing_and_trust_its_float64():
    """Issue 39 on real hardware: every recipe twice under OpAutoCompare(reference="device") (the first run holds
    each op's first call, on the CPU), 0 failing calls, the losses unchanged, most calls judged on the GPU, and no op
    whose float64 kernels disagree with the CPU's. One test, so that CUDA starts once."""
    rows, failing = [], {}
    for workload in zoo.ON_CUDA:
        expected, deterministic = zoo.cuda_baseline(workload)
        for _ in range(2):
            with op_tools.OpAutoCompare(reference="device") as tool:
                losses = workload.run("cuda")
            assert losses == expected or not deterministic, f"OpAutoCompare changed {workload.name}'s losses"
        forward = _places(tool, "forward")
        rows.append(f"{workload.name}: {forward.get('device', 0)} of {sum(forward.values())} forward calls judged on "
                    f"the GPU, {len(tool.failures)} failing")
        if tool.failures:
            failing[workload.name] = tool.failures[:3]
        assert forward.get("device", 0) > sum(forward.values()) / 2, rows[-1]
    print("\n".join(rows))
    assert not failing, failing
    assert autocompare.LEARNT.trust.untrusted == {}


def test_a_foreach_calls_list_judged_on_the_device_is_read_back_in_one_transfer(sim):
    """An optimizer's foreach op compares every parameter: their statistics are computed together
    (``comparison.launch_stats``), and the calls judged on the device neither copy nor wait when they return: their
    batch's statistics come back in one transfer, after one wait."""
    tensors = [torch.randn(64, device=sim) for _ in range(8)]
    counts = []
    with op_tools.OpAutoCompare(reference="device") as tool:
        for _ in range(2):  # its first call (on the CPU), its first on the device (cross-checked)
            torch._foreach_mul(tensors, 2.0)
        tool.judge_queued()
        for _ in range(2):
            before = torch.sim.device_counts()
            torch._foreach_mul(tensors, 2.0)
            counts.append(torch.sim.device_counts() - before)
        before = torch.sim.device_counts()
        tool.judge_queued()
        judged = torch.sim.device_counts() - before
    assert _places(tool, "forward")["device"] == 2 and tool.failures == []
    assert [(c.synchronizations, c.device_to_host_copies) for c in counts] == [(0, 0), (0, 0)], counts
    assert (judged.synchronizations, judged.device_to_host_copies) == (1, 1), judged


def test_a_result_and_a_gradient_written_after_their_call_are_judged_as_the_call_gave_them(sim):
    """A call judged on the device is judged with its batch, after the program ran on: by then it may have written
    the call's result in place (an in-place activation, without a version bump on some kernels) and scaled the
    gradient the call gave (a leaf's ``.grad`` is that tensor, and gradient clipping scales it in place). The device
    keeps what the verdict reads as the call gave it: no false failure, and nothing missed."""
    x = torch.randn(256, device=sim)
    a = torch.randn(256, device=sim, requires_grad=True)
    with op_tools.OpAutoCompare(reference="device") as tool:
        for _ in range(4):  # each op's first call (the CPU), its first on the device (cross-checked), then two
            y = torch.nn.functional.gelu(x)
            with torch._C.DisableTorchFunction(), ditorch.sim.faults("add_:unversioned"):
                y.add_(1.0)  # a write no call shows and the version counter does not
            (a * 2.0).sum().backward()
            torch.nn.utils.clip_grad_norm_([a], 1.0)  # a.grad: the product's gradient, scaled in place
            a.grad = None
        tool.judge_queued()
        assert tool.failures == [], tool.failures
        assert _places(tool, "forward")["device"] >= 6 and _places(tool, "backward")["device"] >= 4, \
            tool.reference_place
        with ditorch.sim.faults("gelu@float32:noise=1e-2"):  # and a fault in the call is still found
            torch.nn.functional.gelu(x).add_(1.0)
        tool.judge_queued()
        assert [f["op"] for f in tool.failures] == ["torch.nn.functional.gelu"]


def test_the_calls_queued_with_the_reference_on_the_device_hold_a_bounded_amount_of_its_memory(sim):
    """A queued call holds device memory until its batch is judged: its float64 copies and results, and the copies it
    keeps of its own results. An optimizer's foreach calls hold the whole model's state in float64 each: past the
    queue's byte bound (512 MB; 3 MB here) the batch is judged at once, not at the 64th call."""
    tensors = [torch.randn(32768, device=sim) for _ in range(4)]  # 512 KB a call, 2.5 MB held with its reference
    with op_tools.OpAutoCompare(reference="device") as tool:
        for _ in range(2):  # its first call (on the CPU), its first on the device (cross-checked)
            torch._foreach_mul(tensors, 2.0)
        tool.judge_queued()
        tool._queue.max_bytes = 3 << 20
        before = torch.sim.device_counts()
        for _ in range(6):
            torch._foreach_mul(tensors, 2.0)
        waits = (torch.sim.device_counts() - before).synchronizations
    assert _places(tool, "forward")["device"] >= 6 and tool.failures == []
    assert waits == 3, waits  # every second call passes the bound: its batch is judged


def test_exact_outputs_on_a_device_are_counted_with_the_statistics_and_a_difference_still_judged(sim):
    """Integer, index and boolean outputs held on a device are compared by counting the elements that differ, read
    with the floating outputs' statistics (no transfer of their own); one that differs is judged in full."""
    d = torch.arange(10, device=sim)
    other = d.clone()
    other[3] = 7
    pending = comparison.launch_stats([(d, d.clone()), (d, other), (d.float(), d.double()), (d > 4, d > 4)], None,
                                      "torch.argsort", False)
    read = pending.read()
    assert read[0] is comparison.EQUAL and read[3] is comparison.EQUAL and 1 not in read
    assert read[2][0] == 0.0  # the floating pair's max |d - r|
    results = comparison.compare_outputs((d, d), (d.clone(), other), None, op_name="torch.argsort")
    assert [r.passed for r in results] == [True, False]
    assert "values differ at 1 of 10 elements" in results[1].error_info


@pytest.mark.parametrize("reference", ["cpu", "device"])
def test_a_fault_in_an_optimizers_foreach_kernel_is_found_with_either_reference(sim, reference):
    """AdamW's in-place foreach ops write the parameters and return nothing: a wrong kernel among them is found, the
    written parameters judged against the reference's (with the device's reference, on the CPU once the device
    cannot clear the call), and a clean step before it fails nothing."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64).to(sim)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    x = torch.randn(8, 64, device=sim)

    def step():
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    with op_tools.OpAutoCompare(reference=reference) as tool:
        for _ in range(3):  # each op's first call, its first on the device (cross-checked), then one on the device
            step()
        assert tool.failures == []
        with ditorch.sim.faults("_foreach_addcdiv_@float32:noise=1e-2"):
            step()
    assert [f["op"] for f in tool.failures] == ["torch._foreach_addcdiv_"]
