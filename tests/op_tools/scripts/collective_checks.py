"""Run by tests/op_tools/test_collective_checks.py under torchrun (2 processes) on sim: each collective OpAutoCompare
checks against every rank's inputs, in float32, bfloat16 and int32; a result tampered with on rank 1 after the
collective ran; asynchronous collectives, one completing late with a bit flipped on rank 1; OpOverflowCheck on an
all-reduce (and an asynchronous one) that receives rank 1's inf. Writes ``OUT/rank<N>.json``."""

import datetime
import os
import sys

import rank_reports  # tests/, on the path torchrun's children get
import torch
import torch.distributed as dist

import ditorch  # noqa: F401 - the device layer
import ditorch.sim
import op_tools
from op_tools.numerics import collective_reference
from op_tools.ops.collectives import collective_call


def collectives(rank: int, world: int, dtype: torch.dtype) -> None:
    base = (torch.arange(12, dtype=torch.float32).reshape(3, 4) * (rank + 1) / 7).to(dtype).cuda()
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX, dist.ReduceOp.MIN):
        if op == dist.ReduceOp.AVG and not dtype.is_floating_point:
            continue
        t = base.clone()
        dist.all_reduce(t, op=op)
    gathered = torch.empty(world * 3, 4, dtype=dtype).cuda()
    dist.all_gather_into_tensor(gathered, base)
    parts = [torch.empty_like(base) for _ in range(world)]
    dist.all_gather(parts, base)
    scattered = torch.empty(3 * 4 // world * world // world, dtype=dtype).cuda()
    dist.reduce_scatter_tensor(scattered, base.reshape(-1)[: scattered.numel() * world])
    if dtype.is_floating_point:  # each rank's tensor times a factor, then summed (FSDP2's HSDP reduce-scatter on NCCL)
        dist.all_reduce(base.clone(), op=dist._make_nccl_premul_sum(0.5))
        dist.reduce_scatter_tensor(scattered, base.reshape(-1)[: scattered.numel() * world],
                                   op=dist._make_nccl_premul_sum(-0.25))
    root = base.clone()
    dist.broadcast(root, src=1)
    dist.reduce(base.clone(), dst=1)  # the sum arrives on rank 1: checked there
    # all-to-all: 6 of the 12 elements to each rank; then uneven (rank 0 sends 5 and 7, rank 1 sends 2 and 10)
    dist.all_to_all_single(torch.empty(12, dtype=dtype).cuda(), base.reshape(-1))
    sent = [[5, 7], [2, 10]]
    received = [sent[source][rank] for source in range(world)]
    dist.all_to_all_single(torch.empty(sum(received), dtype=dtype).cuda(), base.reshape(-1),
                           output_split_sizes=received, input_split_sizes=sent[rank])


def asynchronous(rank: int, world: int) -> list:
    """The collectives with async_op=True, waited for last first (the first wait checks them all, in call order);
    then an all-reduce that completes late with a bit flipped in what rank 1 received (sim's slow link)."""
    base = (torch.arange(12, dtype=torch.float32) * (rank + 1) / 7).cuda()
    summed, gathered, scattered = base.clone(), torch.empty(world * 12).cuda(), torch.empty(12 // world).cuda()
    works = [dist.all_reduce(summed, async_op=True), dist.all_gather_into_tensor(gathered, base, async_op=True),
             dist.reduce_scatter_tensor(scattered, base, async_op=True)]
    for work in reversed(works):
        work.wait()
    with ditorch.sim.faults("allreduce:slow=200;allreduce:bitflip=1,rank=1"):
        late = base.clone()
        dist.all_reduce(late, async_op=True).wait()
    return [summed.cpu().tolist(), gathered.cpu().tolist(), scattered.cpu().tolist()]


def functional(rank: int, world: int) -> list:
    """The functional collectives DTensor and FSDP2 call (``torch.ops._c10d_functional``), waited for as DTensor
    does: what each received."""
    import torch.distributed._functional_collectives as funcol

    base = (torch.arange(12, dtype=torch.float32) * (rank + 1) / 7).cuda()
    group = dist.group.WORLD
    results = [funcol.all_reduce(base, "sum", group), funcol.all_gather_tensor(base, 0, group),
               funcol.reduce_scatter_tensor(base, "sum", 0, group), funcol.all_to_all_single(base, None, None, group)]
    return [funcol.wait_tensor(r).cpu().tolist() for r in results]


def main() -> None:
    out = sys.argv[1]
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    collective_reference.TIMEOUT = datetime.timedelta(seconds=10)  # the one-sided case below waits this long
    report: dict = {}
    with op_tools.OpAutoCompare(results_dir=os.path.join(out, "results")) as compare:
        for dtype in (torch.float32, torch.bfloat16, torch.int32):
            collectives(rank, world, dtype)
    report["checked"] = {"verdict": compare.verdict(), "counts": dict(compare.counts),
                         "skipped": dict(compare.skipped), "handled": dict(compare.handled)}
    with op_tools.OpAutoCompare(results_dir=os.path.join(out, "off"), collectives=False) as off:
        collectives(rank, world, torch.float32)
    report["off"] = {"verdict": off.verdict(), "counts": dict(off.counts), "skipped": dict(off.skipped)}
    with op_tools.OpAutoCompare(results_dir=os.path.join(out, "async")) as compare:
        received = asynchronous(rank, world)
    report["async"] = {"verdict": compare.verdict(), "counts": dict(compare.counts), "found": compare.found(),
                       "not_checked": compare.not_checked()}
    report["async_received"] = received
    with op_tools.OpAutoCompare(results_dir=os.path.join(out, "functional")) as compare:
        received = functional(rank, world)
    report["functional"] = {"verdict": compare.verdict(), "not_checked": compare.not_checked(),
                            "skipped": dict(compare.skipped), "received": received,
                            "handled": {n: k for n, k in compare.handled.items() if "c10d" in n}}
    with ditorch.sim.faults("allreduce:bitflip=1,rank=1"), \
            op_tools.OpAutoCompare(results_dir=os.path.join(out, "functional_faulty")) as compare:
        functional(rank, world)
    report["functional_faulty"] = {"verdict": compare.verdict(), "failed": [f["op"] for f in compare.failures]}
    # All-reduces inside a _coalescing_manager: run at its exit, as one batch, not at their calls
    coalesced = [(torch.arange(4, dtype=torch.float32) + rank).cuda() for _ in range(2)]
    with op_tools.OpAutoCompare(results_dir=os.path.join(out, "coalesced")) as compare:
        with dist._coalescing_manager():
            for t in coalesced:
                dist.all_reduce(t)
    report["coalesced"] = {"verdict": compare.verdict(), "not_checked": compare.not_checked(),
                           "failed": [f["op"] for f in compare.failures],
                           "values": [t.cpu().tolist() for t in coalesced]}
    # A faulty all-to-all and reduce on rank 1 (a bit flipped in what it received)
    scattered = (torch.arange(12, dtype=torch.float32) + 1 + 100 * rank).cuda()
    with ditorch.sim.faults("all_to_all_single:bitflip=1,rank=1;reduce:bitflip=1,rank=1"), \
            op_tools.OpAutoCompare(results_dir=os.path.join(out, "faulty")) as compare:
        dist.all_to_all_single(torch.empty(12).cuda(), scattered)
        dist.reduce(scattered, dst=1)
    report["faulty"] = {"verdict": compare.verdict(), "failed": [f["op"] for f in compare.failures]}
    # A wrong result: the all-reduce ran, then rank 1's copy is changed before the check reads it.
    t = torch.full((4,), float(rank + 1)).cuda()
    bound = collective_call("torch.distributed.all_reduce", dist.all_reduce, (t,), {})
    copies = collective_reference.sent_copies(bound)
    dist.all_reduce(t)
    if rank == 1:
        t[2] += 0.5
    report["tampered"] = [c.row() for c in collective_reference.verify(bound, copies)]
    # An inf sent by rank 1 only: rank 0 receives it.
    sent = torch.tensor([1.0, float("inf") if rank == 1 else 2.0]).cuda()
    with op_tools.OpOverflowCheck(results_dir=os.path.join(out, "results")) as check:
        dist.all_reduce(sent)
    report["overflow"] = str(check.first_overflow).splitlines()[0] if check.first_overflow else ""
    sent = torch.tensor([1.0, float("inf") if rank == 1 else 2.0]).cuda()
    with op_tools.OpOverflowCheck(results_dir=os.path.join(out, "results")) as check:
        dist.all_reduce(sent, async_op=True).wait()
    report["async_overflow"] = str(check.first_overflow).splitlines()[0] if check.first_overflow else ""
    # The tool on rank 0 only: its check waits for rank 1 no longer than the timeout, then the checks stop.
    one_sided = torch.ones(4).cuda()
    if rank == 0:
        with op_tools.OpAutoCompare(results_dir=os.path.join(out, "one_sided")) as alone:
            dist.all_reduce(one_sided)
            dist.all_reduce(one_sided)
        report["one_sided"] = {"verdict": alone.verdict(), "not_checked": alone.not_checked(),
                               "skipped": dict(alone.skipped)}
    else:
        dist.all_reduce(one_sided)
        dist.all_reduce(one_sided)
    report["one_sided_values"] = one_sided.cpu().tolist()
    rank_reports.finish(os.path.join(out, f"rank{rank}.json"), report)


if __name__ == "__main__":
    main()
