"""Collectives under the tools, 2 processes on sim: OpAutoCompare checks each collective against a reference
computed on the host from every rank's inputs (sum, average, maximum, minimum, gathers, reduce-scatter, broadcast;
float32, bfloat16, int32; an asynchronous one at its wait) and fails a result that differs from it;
OP_AUTOCOMPARE_COLLECTIVES=0 counts them as skipped; OpOverflowCheck tells an inf received from another rank from one
born here."""

from __future__ import annotations

import json
import os

import pytest
import torch
from subprocess_env import torchrun_on_sim
from torch.overrides import handle_torch_function, has_torch_function  # a global: as in c10d's code

import op_tools
from op_tools.ops import collectives as collective_tables
from op_tools.ops.collectives import collective_call

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "collective_checks.py")
# The names of the calls the tools see: torch 2.13's all_gather_into_tensor calls all_gather_single, torch 2.11 has
# none; torch 2.11's broadcast dispatches no __torch_function__, so no tool sees it (said, not checked).
_NEWER = hasattr(torch.distributed, "all_gather_single")
COLLECTIVES = ("torch.distributed.all_reduce", "torch.distributed.all_gather",
               "torch.distributed.all_gather_single" if _NEWER else "torch.distributed.all_gather_into_tensor",
               "torch.distributed.reduce_scatter_single" if _NEWER else "torch.distributed.reduce_scatter_tensor",
               "torch.distributed.broadcast", "torch.distributed.all_to_all_single", "torch.distributed.reduce")
BROADCASTS = 0 if "torch.distributed.broadcast" in collective_tables.unseen_collectives() else 1  # per dtype
ALL_TO_ALLS = 0 if "torch.distributed.all_to_all_single" in collective_tables.unseen_collectives() else 2
REDUCES = 0 if "torch.distributed.reduce" in collective_tables.unseen_collectives() else 1


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("collectives")
    result = torchrun_on_sim(SCRIPT, out)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def test_every_collective_is_checked_against_every_ranks_inputs_and_passes(reports):
    for report in reports:
        checked = report["checked"]
        assert checked["verdict"] == "clean"
        collectives = sum(checked["handled"].get(name, 0) for name in COLLECTIVES)
        # reductions (no average of int32); per dtype 2 gathers, a reduce-scatter, a reduce, a broadcast, 2 all-to-alls
        # (one with uneven splits); per floating dtype a premul_sum all-reduce and reduce-scatter
        assert collectives == 4 + 4 + 3 + 3 * (3 + REDUCES + BROADCASTS + ALL_TO_ALLS) + 2 * 2
        assert "collective" not in " ".join(checked["skipped"])  # none skipped: all checked
        assert checked["counts"]["forward passed"] == checked["counts"]["forward compared"]


def test_a_result_that_differs_from_the_ranks_inputs_fails_on_the_rank_that_holds_it(reports):
    assert reports[0]["tampered"][0]["verdict"] == "pass"
    failed = reports[1]["tampered"][0]
    assert failed["verdict"] == "FAIL" and failed["max_abs_diff"] == "0.5"
    assert failed["error_info"].startswith("1 of 4 elements differ from the sum of 2 ranks' inputs by up to 0.5")


def test_the_check_can_be_switched_off_and_then_counts_the_collectives_skipped(reports):
    for report in reports:
        skipped = report["off"]["skipped"]["collective (OP_AUTOCOMPARE_COLLECTIVES=0)"]
        assert skipped == 7 + REDUCES + BROADCASTS + ALL_TO_ALLS + 2  # float32: 2 premul_sum
        assert report["off"]["verdict"] == "clean"


def test_an_inf_another_rank_sent_is_received_not_born_here(reports):
    assert reports[0]["overflow"].startswith("first inf/nan received from another rank (this rank sent finite "
                                             "values): torch.distributed.all_reduce (forward)")
    assert reports[1]["overflow"] == ""  # rank 1 sent it: made before the tool started, by no call it saw


def test_asynchronous_collectives_are_checked_when_waited_for_and_a_late_fault_is_found_on_its_rank(reports):
    # all_reduce, all_gather_into_tensor, reduce_scatter_tensor with async_op=True, waited for last first; then an
    # all-reduce that completes late with a bit flipped on rank 1 (a check at the call would read it unflipped)
    base = [torch.arange(12, dtype=torch.float32) * (rank + 1) / 7 for rank in (0, 1)]
    for rank, report in enumerate(reports):
        summed, gathered, scattered = report["async_received"]  # what the program got: the collectives' own
        assert summed == (base[0] + base[1]).tolist() and gathered == torch.cat(base).tolist()
        assert scattered == (base[0] + base[1])[rank * 6:(rank + 1) * 6].tolist()
        assert report["async"]["not_checked"] == ""  # every one checked: none given up, none left open
    assert reports[0]["async"]["verdict"] == "clean" and reports[0]["async"]["counts"].get("forward failed", 0) == 0
    assert reports[1]["async"]["verdict"] == "found" and reports[1]["async"]["counts"]["forward failed"] == 1


def test_a_faulty_all_to_all_or_reduce_fails_on_the_rank_that_received_it(reports):
    # the all-to-all against the rows each rank sent, the reduce on its destination rank
    assert reports[0]["faulty"] == {"verdict": "clean", "failed": []}
    assert reports[1]["faulty"]["verdict"] == "found"
    assert reports[1]["faulty"]["failed"] == ["torch.distributed.all_to_all_single"] * bool(ALL_TO_ALLS) + \
        ["torch.distributed.reduce"] * REDUCES


def test_the_functional_collectives_dtensor_calls_are_checked_and_a_faulty_one_fails_on_its_rank(reports):
    # torch.ops._c10d_functional's all_reduce, all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single (they
    # were skipped: a tensor-parallel layer's all-reduce went unchecked with a clean verdict)
    base = [torch.arange(12, dtype=torch.float32) * (rank + 1) / 7 for rank in (0, 1)]
    for rank, report in enumerate(reports):
        functional = report["functional"]
        assert functional["verdict"] == "clean" and functional["not_checked"] == "", functional
        assert {name: n for name, n in functional["handled"].items() if "wrap" not in name and "wait" not in name} == {
            f"_c10d_functional.{name}": 1 for name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
                                                       "all_to_all_single")}
        assert list(functional["skipped"]) == ["collective (op_tools has no check for this one)"]  # waits, wrappers
        summed, gathered, scattered, exchanged = functional["received"]  # what the program got: the collectives' own
        assert summed == (base[0] + base[1]).tolist() and gathered == torch.cat(base).tolist()
        assert scattered == (base[0] + base[1])[rank * 6:(rank + 1) * 6].tolist()
        assert exchanged == torch.cat([b[rank * 6:(rank + 1) * 6] for b in base]).tolist()
    assert reports[0]["functional_faulty"] == {"verdict": "clean", "failed": []}
    assert reports[1]["functional_faulty"] == {"verdict": "found", "failed": ["_c10d_functional.all_reduce"]}


def test_collectives_inside_a_coalescing_manager_are_said_not_checked_not_failed_at_their_calls(reports):
    # they run at the manager's exit, in one batch: at their calls nothing has arrived (a false failure before)
    for report in reports:
        coalesced = report["coalesced"]
        assert coalesced["values"] == [[1.0, 3.0, 5.0, 7.0]] * 2  # the program's all-reduces, as without the tool
        assert coalesced["verdict"] == "unchecked" and coalesced["failed"] == [], coalesced
        assert "2 calls not checked (collective inside a _coalescing_manager (run later, in one batch with the " \
               "others)), the first torch.distributed.all_reduce" in coalesced["not_checked"], coalesced


def test_an_inf_another_rank_sent_through_an_asynchronous_all_reduce_is_found_at_its_wait(reports):
    assert reports[0]["async_overflow"].startswith("first inf/nan received from another rank (this rank sent finite "
                                                   "values): torch.distributed.all_reduce (forward)")
    assert reports[1]["async_overflow"] == ""


def test_a_tool_on_one_rank_only_waits_for_the_others_no_longer_than_the_timeout_then_stops_checking(reports):
    alone = reports[0]["one_sided"]
    assert alone["verdict"] == "unchecked"  # never clean: the first all-reduce could not be checked
    assert ("1 call not checked (the tool failed), the first torch.distributed.all_reduce: RuntimeError: gathering "
            "every rank's inputs failed or timed out after 10 s (is the tool running on every rank?)") \
        in alone["not_checked"]
    # the second all-reduce is not checked either, with why (no wait for the ranks again)
    assert ("1 call not checked (collective (checks stopped: gathering the ranks' inputs failed or timed out, is the "
            "tool running on every rank?)), the first torch.distributed.all_reduce") in alone["not_checked"]
    assert alone["skipped"] == {}
    assert reports[0]["one_sided_values"] == reports[1]["one_sided_values"] == [4.0] * 4  # the run went on


def test_a_collective_binds_what_it_sends_and_receives_by_name():
    import torch.distributed as dist

    t, out = torch.ones(4), torch.zeros(8)
    call = collective_call("torch.distributed.all_reduce", dist.all_reduce, (t,), {"op": dist.ReduceOp.AVG})
    assert call is not None and call.sent[0] is t and call.received[0] is t and call.reduce_op == "avg"
    gather = collective_call("torch.distributed.all_gather_into_tensor", dist.all_gather_into_tensor, (out, t),
                             {"async_op": True})
    assert gather is not None and gather.sent[0] is t and gather.received[0] is out and gather.asynchronous
    assert collective_call("torch.add", torch.add, (t, t), {}) is None


def test_a_collective_without_a_check_says_so_not_where_the_ranks_are():
    from op_tools.tools.autocompare import skip_reason

    # both ranks of a torchrun on one host were told "the other ranks' data is not on this host"
    assert [skip_reason(name) for name in ("torch.distributed.barrier", "_c10d_functional.wait_tensor")] == \
        ["collective (op_tools has no check for this one)"] * 2
    for name in ("torch.distributed.all_reduce", "_c10d_functional.all_reduce"):
        assert skip_reason(name) is None  # checked against every rank's inputs


def test_the_collectives_a_torch_does_not_dispatch_are_named_and_said_once(monkeypatch, tmp_path, caplog):
    import torch.distributed as dist

    from op_tools.core import engine

    def broadcast(tensor, src=None, group=None, async_op=False):  # as torch 2.11's: no __torch_function__ dispatch
        return None

    def all_reduce(tensor, op=None, group=None, async_op=False):  # as torch 2.13's: dispatched to the modes
        if has_torch_function((tensor,)):
            return handle_torch_function(all_reduce, (tensor,), tensor, op=op, group=group, async_op=async_op)
        return None

    with monkeypatch.context() as patched:
        patched.setattr(dist, "broadcast", broadcast)
        patched.setattr(dist, "all_reduce", all_reduce)
        collective_tables.unseen_collectives.cache_clear()
        try:
            unseen = collective_tables.unseen_collectives()
        finally:
            collective_tables.unseen_collectives.cache_clear()
    assert "torch.distributed.broadcast" in unseen and "torch.distributed.all_reduce" not in unseen
    # a tool's first collective says which ones it cannot see, once per process
    monkeypatch.setattr(engine, "unseen_collectives", lambda: ("torch.distributed.broadcast",))
    monkeypatch.setattr(engine, "_unseen_said", False)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        for _ in range(2):  # the recording handles CPU calls
            with op_tools.OpCapture(mode="stats", results_dir=str(tmp_path / "results")):
                for _ in range(2):
                    dist.all_reduce(torch.ones(2))
    finally:
        dist.destroy_process_group()
    said = [r.getMessage() for r in caplog.records if "no tool sees them" in r.getMessage()]
    assert len(said) == 1 and "torch.distributed.broadcast dispatch no __torch_function__" in said[0], said


def test_where_no_collective_reaches_a_tool_the_unseen_ones_are_said_when_a_tool_starts_in_a_distributed_run(
        monkeypatch, tmp_path, caplog):
    # torch 2.4's collectives dispatch no __torch_function__ at all: no first collective would ever say it
    import torch.distributed as dist

    from op_tools.core import engine

    monkeypatch.setattr(engine, "unseen_collectives", lambda: ("torch.distributed.all_reduce",))
    monkeypatch.setattr(engine, "_unseen_said", False)
    with op_tools.OpOverflowCheck():  # no process group: nothing to say
        torch.ones(2) + 1
    assert not [r for r in caplog.records if "no tool sees them" in r.getMessage()]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        for _ in range(2):
            with op_tools.OpOverflowCheck():
                torch.ones(2) + 1
    finally:
        dist.destroy_process_group()
    said = [r.getMessage() for r in caplog.records if "no tool sees them" in r.getMessage()]
    assert len(said) == 1 and "torch.distributed.all_reduce dispatch no __torch_function__" in said[0], said


def test_a_collective_that_moves_tensors_unchecked_leaves_the_verdict_unchecked_not_clean(sim, group, tmp_path):
    import torch.distributed as dist

    x, n = torch.ones(4, device=sim), torch.ones(4, dtype=torch.int32, device=sim)
    with op_tools.OpAutoCompare(results_dir=str(tmp_path)) as compare:
        dist.gather(x, [torch.empty(4, device=sim)], dst=0)  # no check for a gather
        dist.all_reduce(n, op=dist.ReduceOp.BAND)  # no host reference for a bitwise reduction
    assert compare.verdict() == "unchecked"
    assert compare.not_checked() == (
        "1 call not checked (a torch.distributed collective op_tools has no check for), the first "
        "torch.distributed.gather; 1 call not checked (collective with ReduceOp band (no host reference for it)), "
        "the first torch.distributed.all_reduce")
    with op_tools.OpAutoCompare(results_dir=str(tmp_path), collectives=False) as off:  # asked for: skipped
        dist.all_reduce(n, op=dist.ReduceOp.BAND)
    assert off.verdict() == "clean" and dict(off.skipped) == {"collective (OP_AUTOCOMPARE_COLLECTIVES=0)": 1}


def test_a_collective_of_no_elements_passes_opselfchecks_sums_instead_of_failing_the_tool(sim, group, tmp_path):
    # PowerSGD's hook all-reduces its uncompressed gradients in one flat tensor, empty where it compressed every one:
    # the sums' largest excess was taken over no chunks ("amax(): Expected reduction dim"), a tool failure per call
    import torch.distributed as dist

    with op_tools.OpSelfCheck(results_dir=str(tmp_path)) as check:
        dist.all_reduce(torch.empty(0, device=sim))
        dist.all_reduce(torch.ones(4, device=sim))
    assert check.verdict() == "clean", check.not_checked()
    assert check.handled["torch.distributed.all_reduce"] == 2


@pytest.mark.parametrize("factor", [0.5, -0.25, "tensor"])
def test_a_premul_sum_collective_is_checked_and_a_fault_in_it_found(sim, group, tmp_path, factor):
    # FSDP2 reduce-scatters with PREMUL_SUM on NCCL where its data-parallel size is not the group's (HSDP): each rank's
    # tensor times a factor, then summed. Its op was named "other" and its collectives said not checked
    import torch.distributed as dist

    import ditorch.sim

    scale = torch.tensor(0.75, device=sim) if factor == "tensor" else factor

    def premul_all_reduce():
        t = torch.linspace(-1, 1, 4096, device=sim)
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(scale))
        return t

    assert torch.allclose(premul_all_reduce().cpu(), torch.linspace(-1, 1, 4096) * float(scale))
    for tool in ("OpAutoCompare", "OpSelfCheck"):
        options = {"budget": 1.0} if tool == "OpSelfCheck" else {}
        with getattr(op_tools, tool)(results_dir=str(tmp_path), **options) as clean:
            premul_all_reduce()
        assert clean.verdict() == "clean", (tool, clean.not_checked())
        assert clean.handled["torch.distributed.all_reduce"] == 1
        with ditorch.sim.faults("allreduce:noise=1e-2"), \
                getattr(op_tools, tool)(results_dir=str(tmp_path), **options) as faulty:
            premul_all_reduce()
        assert faulty.verdict() == "found", (tool, faulty.not_checked())
