"""Asynchronous collectives (``async_op=True``) under the tools, in one process (a group of one rank on sim): each is
checked once the program waits for its Work, on what arrived, and one whose wait the tool cannot see is said not
checked, with why. sim's ``slow`` fault makes the collective complete late, with its output fault applied then: a check
made at the call would read what was there before (a silent pass). Two ranks: test_collective_checks.py and
test_tools_across_ranks.py."""

from __future__ import annotations

import contextlib
import gc

import torch
import torch.distributed as dist

import ditorch.sim
import op_tools

LATE_FLIP = "allreduce:slow=300;allreduce:bitflip=1"  # completes 0.3 s after the call, one bit flipped then


def test_an_asynchronous_collective_is_checked_when_the_program_waits_and_on_what_arrived(sim, group, tmp_path):
    t = torch.ones(4, device=sim)
    with ditorch.sim.faults(LATE_FLIP), op_tools.OpAutoCompare(results_dir=str(tmp_path)) as compare:
        work = dist.all_reduce(t, async_op=True)
        assert isinstance(work, dist.Work)  # what the program gets is a Work still
        assert compare.not_checked() == ("1 asynchronous collective not waited for yet (each checked when the "
                                         "program waits for it)")
        assert work.wait() is True
    assert t.cpu().tolist() == [1.5, 1.0, 1.0, 1.0]  # the flipped bit arrived, and the program reads it
    assert compare.verdict() == "found" and dict(compare.counts) == {"forward compared": 1, "forward failed": 1}
    assert compare.not_checked() == ""


def test_a_synchronize_that_returns_before_the_result_arrives_is_checked_once_it_has(sim, group, tmp_path):
    # Work.synchronize() makes a GPU stream wait; sim's (as gloo's) returns at once: the check waits for the result
    t = torch.ones(4, device=sim)
    with ditorch.sim.faults(LATE_FLIP), op_tools.OpAutoCompare(results_dir=str(tmp_path)) as compare:
        dist.all_reduce(t, async_op=True).synchronize()
    assert compare.verdict() == "found" and dict(compare.counts) == {"forward compared": 1, "forward failed": 1}


def test_every_tool_checks_an_asynchronous_collective_at_its_wait(sim, group, tmp_path):
    with ditorch.sim.faults(LATE_FLIP), op_tools.OpSelfCheck(budget=1.0, results_dir=str(tmp_path)) as check:
        dist.all_reduce(torch.rand(1024, device=sim) + 1, async_op=True).wait()
    assert check.verdict() == "found" and [f.op for f in check.findings] == ["torch.distributed.all_reduce"]
    with ditorch.sim.faults("allreduce:slow=300;allreduce:nan"), \
            op_tools.OpOverflowCheck(results_dir=str(tmp_path)) as overflow:
        dist.all_reduce(torch.ones(4, device=sim), async_op=True).wait()
    assert overflow.first_overflow is not None and overflow.first_overflow.name == "torch.distributed.all_reduce"
    assert overflow.first_overflow.received  # this rank sent finite values


def test_a_wait_checks_the_earlier_collectives_first_in_call_order(sim, group, tmp_path):
    checked = []
    x, y = torch.ones(4, device=sim), torch.ones(4, device=sim)
    with op_tools.OpAutoCompare(results_dir=str(tmp_path)) as compare:
        original = compare._after_collective
        compare._after_collective = lambda call: (checked.append(call.forward_id), original(call))  # type: ignore
        a = dist.all_reduce(x, async_op=True)
        b = dist.all_reduce(y, async_op=True)
        b.wait()  # a's check first: every rank checks in the order of the calls
        assert len(checked) == 2 and checked == sorted(checked)
        a.wait()  # its check ran already: not twice
    assert compare.verdict() == "clean" and compare.counts["forward passed"] == 2 and len(checked) == 2


def test_a_collective_whose_wait_the_tool_cannot_see_is_said_not_checked_with_why(sim, group, tmp_path):
    t = torch.ones(4, device=sim)
    with op_tools.OpAutoCompare(results_dir=str(tmp_path)) as compare:
        done = torch.futures.Future()
        # issued in a callback, which runs when the collective before completes: a moment that differs between ranks
        done.then(lambda _: dist.all_reduce(t, async_op=True).get_future().wait())
        done.set_result(None)
        dist.all_reduce(t, async_op=True)  # the Work dropped unwaited
        gc.collect()
        polled = dist.all_reduce(t, async_op=True)
        while not polled.is_completed():
            pass
        polled.wait()  # the program may have read it when it saw it complete
        late = dist.all_reduce(t, async_op=True)
    late.wait()  # after the verdict
    assert compare.verdict() == "unchecked"
    assert compare.not_checked() == "; ".join(
        f"1 asynchronous collective not checked ({why}), the first torch.distributed.all_reduce" for why in (
            "issued, or its future taken, in a future's callback", "its Work dropped before it was waited for",
            "seen complete through is_completed() instead of a wait", "not waited for while the tool ran"))
    assert "forward 0 compared, 0 passed, 0 failed, 4 not checked" in compare.summary()
    assert t.cpu().tolist() == [1.0] * 4  # one rank: every all-reduce left it as it was


def test_a_collective_issued_in_a_callback_run_at_once_is_checked_where_its_library_completes_futures_when_queued(
        sim, group, tmp_path, monkeypatch):
    # A callback chained on a future already complete runs inside then(), on the program's thread: where the library
    # completes every collective's future when it queues it (NCCL; sim), at the same point of the program on every
    # rank, so what it issues is checked. On another library it may run there on one rank and on the library's
    # thread on another: given up, as a callback run later is
    from op_tools.core import collective_waits

    t = torch.ones(4, device=sim)
    done = torch.futures.Future()
    done.set_result(None)
    with op_tools.OpAutoCompare(results_dir=str(tmp_path)) as compare:
        done.then(lambda _: dist.all_reduce(t, async_op=True).get_future().wait())
    assert compare.verdict() == "clean" and compare.counts["forward passed"] == 1, compare.not_checked()
    monkeypatch.setattr(collective_waits, "COMPLETE_WHEN_QUEUED", ())  # a library whose futures complete on its threads
    with op_tools.OpAutoCompare(results_dir=str(tmp_path)) as unknown:
        done.then(lambda _: dist.all_reduce(t, async_op=True).get_future().wait())
    assert unknown.verdict() == "unchecked"
    assert "1 asynchronous collective not checked (issued, or its future taken, in a future's callback)" in \
        unknown.not_checked()


def test_a_run_recording_records_what_a_collective_received_and_names_a_late_fault_in_it(sim, group, tmp_path):
    # a collective's result is what it received: recorded after a synchronous one, at an asynchronous one's wait;
    # compare_runs then names the collective, not the next op that reads what it received
    import op_tools.offline.compare_runs
    from op_tools.output.run_recording import read_recording

    def record(faults: str, name: str) -> str:
        t = torch.ones(4, device=sim)
        with ditorch.sim.faults(faults), \
                op_tools.OpCapture(mode="stats", results_dir=str(tmp_path / name)) as capture:
            dist.all_reduce(t, async_op=True).wait()
            t * 2
        assert capture.verdict() == "clean"
        return capture.recorder.file.path

    faulty, clean = record(LATE_FLIP, "faulty"), record("", "clean")
    _, (received, doubled) = read_recording(faulty)
    assert received["op"] == "torch.distributed.all_reduce"
    assert received["inputs"][0][3:5] == [1.0, 1.0] and received["outputs"][0][3:5] == [1.0, 1.5]  # min, max
    first = op_tools.offline.compare_runs.compare(clean, faulty).first_divergence()
    assert first is not None and first.op == "torch.distributed.all_reduce" and first.detail.startswith("outputs[0]")


class _AllReducedGradient(torch.autograd.Function):
    """The identity, whose backward all-reduces the gradient asynchronously and waits for it (a tensor-parallel
    layer's input gradient, overlapped with the rest of its backward as Megatron's are)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        work = dist.all_reduce(grad, async_op=True)
        work.wait()
        return grad


def test_an_asynchronous_all_reduce_in_a_backward_is_checked_at_its_wait(sim, group, tmp_path):
    x = torch.ones(4, device=sim, requires_grad=True)
    with ditorch.sim.faults(LATE_FLIP), op_tools.OpAutoCompare(results_dir=str(tmp_path)) as compare:
        _AllReducedGradient.apply(x).sum().backward()
    assert compare.handled["torch.distributed.all_reduce"] == 1
    assert [f["op"] for f in compare.failures] == ["torch.distributed.all_reduce"]
    assert x.grad.cpu().tolist() == [1.5, 1.0, 1.0, 1.0]  # the program's gradient: what arrived


def _doubled_on_arrival(state, bucket):
    """A DDP communication hook whose callback changes what arrived in place (PowerSGD's do): the tool checks what
    arrived, not what the callback left."""
    future = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return future.then(lambda done: done.value()[0].mul_(2))


def test_a_collective_waited_for_through_its_future_is_checked_on_what_arrived(sim, group, tmp_path):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def gradients(hook, faults: str = "", tool=None):
        torch.manual_seed(0)
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4).to(sim))
        ddp.register_comm_hook(None, hook)
        with ditorch.sim.faults(faults), tool or contextlib.nullcontext():
            ddp(torch.ones(2, 4, device=sim)).sum().backward()
        return [p.grad.cpu() for p in ddp.parameters()]

    for hook in (default_hooks.fp16_compress_hook, _doubled_on_arrival):  # checked at the end of the backward pass
        plain = gradients(hook)
        compare = op_tools.OpAutoCompare(results_dir=str(tmp_path))
        assert all(torch.equal(a, b) for a, b in zip(gradients(hook, tool=compare), plain))  # the run's numbers
        assert compare.verdict() == "clean" and compare.not_checked() == ""
        assert compare.handled["torch.distributed.all_reduce"] == 1 and compare.counts["forward compared"] == 4
    compare = op_tools.OpAutoCompare(results_dir=str(tmp_path))
    gradients(default_hooks.fp16_compress_hook, LATE_FLIP, compare)
    assert [f["op"] for f in compare.failures] == ["torch.distributed.all_reduce"]
    check = op_tools.OpSelfCheck(budget=1.0, results_dir=str(tmp_path))
    gradients(_doubled_on_arrival, LATE_FLIP, check)
    assert [f.op for f in check.findings] == ["torch.distributed.all_reduce"]
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4).to(sim))
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with ditorch.sim.faults(LATE_FLIP), op_tools.OpAutoCompare(results_dir=str(tmp_path)) as compare:
        ddp(torch.ones(2, 4, device=sim)).sum().backward()
        assert compare.waits_not_checked() == 1  # followed: checked once backward's work is done, before the step
        optimizer.step()
        assert compare.waits_not_checked() == 0 and compare.counts["forward failed"] == 1
    t = torch.ones(4, device=sim)
    with ditorch.sim.faults(LATE_FLIP), op_tools.OpAutoCompare(results_dir=str(tmp_path)) as compare:
        assert dist.all_reduce(t, async_op=True).get_future().wait()[0] is t  # its value the collective's own
        t.zero_()  # what the program does after: the check, at the tool's stop, reads what arrived
    assert [f["op"] for f in compare.failures] == ["torch.distributed.all_reduce"]
