"""DDP's gradient buckets and backward's collectives as calls the tools see, in one process (a group of one rank on
sim): the bucket's all-reduce is handled while a tool runs and DDP's own default after; a model with its own
communication hook keeps it and the tools say so; torch.distributed's collectives are themselves again once the
last tool stops. The two-rank behaviour is in test_run_report.py and test_tools_across_ranks.py."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

import op_tools
from op_tools.core import gradient_communication


def _ddp(sim):
    torch.manual_seed(0)
    return torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 4)).to(sim))


def test_the_bucket_all_reduce_is_a_call_the_tools_see_and_ddp_computes_the_same(sim, group, tmp_path):
    ddp, x = _ddp(sim), torch.ones(2, 4, device=sim)
    ddp(x).sum().backward()
    plain = [p.grad.cpu().clone() for p in ddp.parameters()]
    ddp.zero_grad()
    with op_tools.OpOverflowCheck(results_dir=str(tmp_path)) as check:
        ddp(x).sum().backward()
    assert check.handled["torch.distributed.all_reduce"] == 1
    assert all(torch.equal(p.grad.cpu(), g) for p, g in zip(ddp.parameters(), plain))
    ddp.zero_grad()
    ddp(x).sum().backward()  # no tool: DDP's default hook again, the same gradients
    assert all(torch.equal(p.grad.cpu(), g) for p, g in zip(ddp.parameters(), plain))


def test_a_model_with_its_own_communication_hook_keeps_it_and_the_tools_say_so(sim, group, tmp_path, caplog):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp, calls = _ddp(sim), []

    def users_hook(state, bucket):
        calls.append(bucket.index())
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, users_hook)
    with caplog.at_level(logging.WARNING, logger="op_tools"), op_tools.OpOverflowCheck(results_dir=str(tmp_path)):
        ddp(torch.ones(2, 4, device=sim)).sum().backward()
    assert calls == [0]
    assert "has a communication hook of its own" in caplog.text


def test_torch_distributed_collectives_are_wrapped_only_while_a_tool_runs(sim, tmp_path):
    original = dist.all_reduce
    with op_tools.OpObserve(results_dir=str(tmp_path)):
        assert dist.all_reduce is not original and dist.all_reduce.__wrapped__ is original
        with op_tools.OpTimeMeasure(results_dir=str(tmp_path)):
            pass
        assert dist.all_reduce is not original  # the outer tool still runs
    assert dist.all_reduce is original and gradient_communication._originals == {}


def test_a_tool_without_a_mode_sees_the_collectives_a_backward_pass_makes_on_autograds_thread(sim, group, tmp_path):
    # OpSelfCheck wraps its functions (targeted dispatch) on the thread that started it; sim's backward, as a GPU's,
    # runs on an autograd thread, where DDP's buckets are all-reduced: seen there too, and a faulty one found
    import ditorch.sim

    ddp = _ddp(sim)
    with ditorch.sim.faults("allreduce:bitflip=1"), \
            op_tools.OpSelfCheck(budget=1.0, results_dir=str(tmp_path)) as check:
        ddp(torch.ones(2, 4, device=sim)).sum().backward()
    assert check.handled["torch.distributed.all_reduce"] == 1
    assert [f.op for f in check.findings] == ["torch.distributed.all_reduce"]
