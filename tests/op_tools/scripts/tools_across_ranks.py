"""Run by tests/op_tools/test_tools_across_ranks.py under torchrun (2 processes) on sim: each op_tools tool over a
step of a DDP tiny Llama, two identical recordings of a DDP step (``OUT/recording_a``, ``OUT/recording_b``) and one
whose gradient all-reduce is noisy on rank 1 (``OUT/recording_link``), and
OpOverflowCheck and OpAutoCompare over a tensor-parallel MLP (DTensor), and OpSelfCheck over FSDP2 steps of a tiny
Llama (``fully_shard``). Writes each tool's verdict (and what it found) per rank to ``OUT/rank<N>.json``.
"""

import os
import sys

import rank_reports  # tests/, on the path torchrun's children get
import tiny_models
import torch
import torch.distributed as dist

import ditorch  # noqa: F401 - the device layer
import op_tools

TOOLS = ("OpAutoCompare", "OpCapture", "OpObserve", "OpTimeMeasure", "OpOverflowCheck", "OpFallback", "OpDtypeCast",
         "OpSelfCheck")


def ddp_step(model, optimizer, generator) -> None:
    ids = torch.randint(0, 128, (2, 16), generator=generator).cuda()
    tiny_models.lm_step(model, optimizer, ids)


def tensor_parallel_mlp():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    class MLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

        def forward(self, x):
            return self.down(torch.nn.functional.silu(self.up(x)))

    torch.manual_seed(0)
    model = MLP().cuda()
    parallelize_module(model, init_device_mesh("cuda", (dist.get_world_size(),)),
                       {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model


def fsdp2_llama():
    """A tiny Llama, ``fully_shard`` on each decoder layer and on the root (tests/ditorch/scripts/parallel_llama.py)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = tiny_models.tiny_llama().cuda()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def collectives_under_self_check(fault: str, rank: int, asynchronous: bool = False) -> dict:
    """The six collectives OpSelfCheck checks, in float32 and bfloat16, under sim's ``fault`` (a faulty link). Values
    of magnitude 1 to 2: a flipped top mantissa bit moves one by a quarter at least, above the rounding the checks
    allow for 1024 of them (an element near 0 flipped moves the sums by less: no check sees that). ``asynchronous``:
    each with async_op=True, waited for last first."""
    x = (torch.rand(1024, generator=torch.Generator().manual_seed(rank)) + 1).cuda()
    size = dist.get_world_size()
    works = []
    with ditorch.sim.faults(fault), op_tools.OpSelfCheck(budget=1.0) as check:
        for tensor in (x, x.bfloat16()):
            works += [dist.all_reduce(tensor.clone(), async_op=asynchronous),
                      dist.all_reduce(tensor.clone(), op=dist.ReduceOp.AVG, async_op=asynchronous),
                      dist.reduce_scatter_tensor(tensor.new_empty(tensor.numel() // size), tensor,
                                                 async_op=asynchronous),
                      dist.all_gather_into_tensor(tensor.new_empty(tensor.numel() * size), tensor,
                                                  async_op=asynchronous),
                      dist.broadcast(tensor.clone(), src=0, async_op=asynchronous),
                      dist.reduce(tensor.clone(), dst=1, async_op=asynchronous),
                      dist.all_to_all_single(torch.empty_like(tensor), tensor, async_op=asynchronous)]
            sent = [[300, 724], [100, 924]]  # uneven: rank 0 sends 300 and 724 elements, rank 1 100 and 924
            received = [sent[source][rank] for source in range(size)]
            works.append(dist.all_to_all_single(tensor.new_empty(sum(received)), tensor, output_split_sizes=received,
                                                input_split_sizes=sent[rank], async_op=asynchronous))
        for work in reversed(works):
            if work is not None:
                work.wait()
    return {"verdict": check.verdict(), "counts": dict(check.counts),
            "found": sorted({(f.op, f.rank) for f in check.findings}), "findings": len(check.findings)}


def nan_sent_under_self_check(rank: int) -> dict:
    """An all-reduce to which rank 0 sends a nan (a diverged rank): every rank rightly receives nan there."""
    x = torch.randn(1024, generator=torch.Generator().manual_seed(rank)).cuda()
    if rank == 0:
        x[3] = float("nan")
    with op_tools.OpSelfCheck(budget=1.0) as check:
        dist.all_reduce(x)
    return {"verdict": check.verdict(), "counts": {k: v for k, v in check.counts.items() if v},
            "findings": len(check.findings)}


def main() -> None:
    out = sys.argv[1]
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank = dist.get_rank()
    report: dict = {"ddp": {}, "tp": {}, "fsdp2": {}}
    torch.manual_seed(0)
    model = tiny_models.tiny_llama().cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(100 + rank)
    for name in TOOLS:
        # the model is float32, which OpDtypeCast's default table leaves alone (a run it casts nothing in is unchecked)
        casts = {"casts": {torch.float32: torch.float64}} if name == "OpDtypeCast" else {}
        with getattr(op_tools, name)(results_dir=os.path.join(out, "results"), **casts) as tool:
            ddp_step(ddp, optimizer, generator)
        report["ddp"][name] = {"verdict": tool.verdict(), "found": tool.found(), "not_checked": tool.not_checked()}
    # OpSelfCheck over DDP steps with noisy matmuls on rank 1 alone (sim's rank= fault): found there, clean on rank 0
    with ditorch.sim.faults("mm:noise=1e-2,rank=1"), op_tools.OpSelfCheck() as check:
        ddp_step(ddp, optimizer, generator)
    first = check.findings[0] if check.findings else None
    report["ddp"]["OpSelfCheck noise"] = {"verdict": check.verdict(), "findings": len(check.findings),
                                          "first": None if first is None else [first.op, first.module, first.rank,
                                                                               first.step]}
    # DDP with a communication hook of its own (fp16 compression): each bucket's all-reduce is waited for through its
    # future, followed, and checked on what arrived before the optimizer's step; noise on rank 1 found there
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.manual_seed(0)
    compressed = torch.nn.parallel.DistributedDataParallel(tiny_models.tiny_llama().cuda(), device_ids=[local_rank])
    compressed.register_comm_hook(None, default_hooks.fp16_compress_hook)
    compressed_optimizer = torch.optim.SGD(compressed.parameters(), lr=0.1)
    for name in ("OpAutoCompare", "OpSelfCheck"):
        with ditorch.sim.faults("allreduce:noise=1e-1,rank=1"), \
                getattr(op_tools, name)(results_dir=os.path.join(out, "results_fp16_hook")) as tool:
            ddp_step(compressed, compressed_optimizer, generator)
        found = [f["op"] for f in tool.failures] if name == "OpAutoCompare" else [f.op for f in tool.findings]
        report["ddp"][f"{name} fp16 hook"] = {"not_checked": tool.not_checked(), "found": sorted(set(found)),
                                              "all_reduces": tool.handled["torch.distributed.all_reduce"]}
    # DDP with PowerSGD, a bucket per parameter: its first two steps all-reduce plainly, the next ones compress, issuing
    # the all-reduces of P and Q in callbacks, which wait for them. On sim these deadlocked (gloo's threads ran the
    # callbacks); then the callbacks' collectives were said not checked. Sim's futures, like NCCL's, are complete
    # when taken: the callbacks run at once, in program order, and their collectives are checked; noise on rank 1's
    # all-reduces is found there
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    torch.manual_seed(0)
    powered = torch.nn.parallel.DistributedDataParallel(tiny_models.tiny_llama().cuda(), device_ids=[local_rank],
                                                        bucket_cap_mb=0.001)
    powered.register_comm_hook(powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                                           start_powerSGD_iter=2, min_compression_rate=0.5),
                               powerSGD_hook.powerSGD_hook)
    powered_optimizer = torch.optim.SGD(powered.parameters(), lr=0.1)
    for _ in range(2):  # past the plain steps: every step from here compresses
        ddp_step(powered, powered_optimizer, generator)
    for name in ("OpAutoCompare", "OpSelfCheck"):
        for faults in ("", "allreduce:noise=1e-1,rank=1"):
            with ditorch.sim.faults(faults), \
                    getattr(op_tools, name)(results_dir=os.path.join(out, "results_powersgd")) as tool:
                ddp_step(powered, powered_optimizer, generator)
            found = [f["op"] for f in tool.failures] if name == "OpAutoCompare" else [f.op for f in tool.findings]
            report["ddp"][f"{name} powerSGD {'noise' if faults else 'clean'}"] = {
                "verdict": tool.verdict(), "not_checked": tool.not_checked(), "found": sorted(set(found)),
                "all_reduces": tool.handled["torch.distributed.all_reduce"]}
    # two identical recordings, the model built (fresh memory, initialisers) inside them; and a third whose gradient
    # all-reduce delivers noise on rank 1 (a faulty link)
    for run, link in (("a", ""), ("b", ""), ("link", "allreduce:noise=1e-2,rank=1")):
        # every parameter of SGD's foreach step recorded: past 16 its outputs would be not compared (exit 4)
        recording = op_tools.OpCapture(results_dir=os.path.join(out, f"recording_{run}"), mode="stats",
                                       stats_max_tensors=64)
        with ditorch.sim.faults(link), recording:
            torch.manual_seed(0)
            replica = torch.nn.parallel.DistributedDataParallel(tiny_models.tiny_llama().cuda(),
                                                                device_ids=[local_rank])
            ddp_step(replica, torch.optim.SGD(replica.parameters(), lr=0.1), torch.Generator().manual_seed(rank))
    mlp = tensor_parallel_mlp()
    x = torch.randn(4, 16).cuda()
    with ditorch.sim.faults("silu:nan" if rank == 1 else ""):
        with op_tools.OpOverflowCheck(results_dir=os.path.join(out, "results")) as check:
            mlp(x).square().mean().backward()
    report["tp"]["OpOverflowCheck"] = {"verdict": check.verdict(), "first": str(check.first_overflow),
                                       "seen": str(check.first_seen)}
    mlp.zero_grad()
    with op_tools.OpCapture(results_dir=os.path.join(out, "recording_tp"), mode="stats") as capture:
        mlp(x).square().mean().backward()
    report["tp"]["OpCapture"] = {"verdict": capture.verdict(), "not_checked": capture.not_checked()}
    mlp.zero_grad()
    with op_tools.OpAutoCompare(results_dir=os.path.join(out, "results")) as compare:
        mlp(x).square().mean().backward()
    report["tp"]["OpAutoCompare"] = {"verdict": compare.verdict(), "found": compare.found(),
                                     "not_checked": compare.not_checked(), "counts": dict(compare.counts)}
    mlp.zero_grad()
    # the float64 reference on the device: DTensor calls compared on the CPU (their whole tensors), the others there
    with op_tools.OpAutoCompare(results_dir=os.path.join(out, "results_device"), reference="device") as compare:
        mlp(x).square().mean().backward()
    report["tp"]["OpAutoCompare device"] = {"verdict": compare.verdict(), "not_checked": compare.not_checked(),
                                            "places": {f"{p}: {why}": n for (p, why), n in
                                                       compare.reference_place.items()}}
    mlp.zero_grad()
    with op_tools.OpSelfCheck(budget=1.0) as check:  # DTensor products: checked on each rank's local part
        mlp(x).square().mean().backward()
        # an activation on a sequence-sharded DTensor (sequence parallel): checked on the local shard
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = mlp.up.weight.device_mesh
        sharded = distribute_tensor(torch.randn(8, 16).cuda(), mesh, [Shard(0)])
        torch.nn.functional.silu(sharded)
        weight = distribute_tensor(torch.randn(16).cuda(), mesh, [Replicate()])
        torch.nn.functional.layer_norm(sharded, (16,), weight, weight)  # its rows whole on every rank
    report["tp"]["OpSelfCheck"] = {"verdict": check.verdict(), "counts": dict(check.counts),
                                   "findings": len(check.findings)}
    with op_tools.OpSelfCheck(budget=1.0) as check:  # normalised over the sharded dimension: each rank has half a row
        torch.nn.functional.layer_norm(distribute_tensor(torch.randn(8, 16).cuda(), mesh, [Shard(1)]), (16,))
    report["tp"]["OpSelfCheck sharded rows"] = {"verdict": check.verdict(), "counts": dict(check.counts)}
    mlp.zero_grad()
    with ditorch.sim.faults("mm:noise=1e-2,rank=1"), op_tools.OpSelfCheck(budget=1.0) as check:
        mlp(x).square().mean().backward()
    report["tp"]["OpSelfCheck noise"] = {"verdict": check.verdict(),
                                         "found": sorted({(f.op, f.module, f.rank) for f in check.findings})}
    mlp.zero_grad()
    with ditorch.sim.faults("silu:noise=1e-2" if rank == 1 else ""):
        with op_tools.OpAutoCompare(results_dir=os.path.join(out, "results_tp_noise")) as compare:
            mlp(x).square().mean().backward()
    report["tp"]["OpAutoCompare noise"] = {"verdict": compare.verdict(), "failures": compare.failures}
    # OpFallback and OpDtypeCast over the tensor-parallel step and an in-place write of a sharded DTensor (FSDP2's
    # initialisers): OpFallback crashed the run there (its overlap check read a DTensor's storage, its backward made
    # strided views of DTensor gradients); now a DTensor's call runs on the device, said not fallen back
    mlp.zero_grad()
    plain = mlp(x).square().mean()
    for name in ("OpFallback", "OpDtypeCast"):
        mlp.zero_grad()
        casts = {"casts": {torch.float32: torch.float64}} if name == "OpDtypeCast" else {}
        with getattr(op_tools, name)(results_dir=os.path.join(out, "results_tp_changers"), **casts) as tool:
            loss = mlp(x).square().mean()
            loss.backward()
            filled = distribute_tensor(torch.zeros(4, 4).cuda(), mesh, [Shard(0)]).fill_(1.0)
        report["tp"][name] = {"verdict": tool.verdict(), "not_checked": tool.not_checked(),
                              "loss": abs(loss.item() - plain.item()) <= 1e-6 * abs(plain.item()),
                              "filled": filled.full_tensor().sum().item(),
                              "grads": all(p.grad is not None and bool(p.grad.full_tensor().isfinite().all())
                                           for p in mlp.parameters())}
    # OpSelfCheck over two FSDP2 steps: the forward's parameters are unsharded plain tensors
    sharded = fsdp2_llama()
    optimizer = torch.optim.SGD(sharded.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(100 + rank)
    with op_tools.OpSelfCheck(budget=1.0) as check:
        for _ in range(2):
            ddp_step(sharded, optimizer, generator)
    report["fsdp2"]["OpSelfCheck"] = {"verdict": check.verdict(), "counts": dict(check.counts),
                                      "findings": len(check.findings)}
    with ditorch.sim.faults("mm:noise=1e-2,rank=1"), op_tools.OpSelfCheck(budget=1.0) as check:
        for _ in range(2):
            ddp_step(sharded, optimizer, generator)
    first = check.findings[0] if check.findings else None
    report["fsdp2"]["OpSelfCheck noise"] = {"verdict": check.verdict(),
                                            "found": sorted({(f.op, f.module, f.rank) for f in check.findings}),
                                            "first_step": None if first is None else first.step}
    # OpOverflowCheck over an FSDP2 step with every empty tensor holding nan (a GPU's reused memory may): FSDP2 stages
    # each all-gather in such a buffer, its own part copied in (fsdp.all_gather_copy_in), the rest filled unread
    with ditorch.sim.faults("empty:nan;empty_like:nan"), op_tools.OpOverflowCheck() as overflow:
        ddp_step(sharded, optimizer, generator)
    report["fsdp2"]["OpOverflowCheck, empties nan"] = {"verdict": overflow.verdict(),
                                                       "not_checked": overflow.not_checked()}
    # FSDP2's all-gathers made asynchronous (each unshard waited for by FSDP2 before the layer runs): checked at
    # those waits, against every rank's shard
    for module in (*sharded.model.layers, sharded):
        module._set_unshard_async_op(True)
    with op_tools.OpAutoCompare(results_dir=os.path.join(out, "results_fsdp2_async")) as compare:
        ddp_step(sharded, optimizer, generator)
    report["fsdp2"]["OpAutoCompare async unshard"] = {
        "verdict": compare.verdict(), "not_checked": compare.not_checked(), "skipped": dict(compare.skipped),
        "collectives": {name: n for name, n in compare.handled.items() if name.startswith("torch.distributed.")}}
    report["collectives"] = {fault or "clean": collectives_under_self_check(fault, rank)
                             for fault in ("", "allreduce:bitflip=1,rank=1", "all_to_all_single:bitflip=1,rank=1",
                                           "reduce:bitflip=1,rank=1")}
    report["collectives"]["nan sent by rank 0"] = nan_sent_under_self_check(rank)
    report["collectives"]["async, late"] = collectives_under_self_check("allreduce:slow=200;allreduce:bitflip=1,rank=1",
                                                                      rank, asynchronous=True)
    rank_reports.finish(os.path.join(out, f"rank{rank}.json"), report)


if __name__ == "__main__":
    main()
