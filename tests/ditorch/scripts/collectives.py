"""Every c10d collective on the group a CUDA script gets from ``init_process_group("nccl")`` under ditorch (sim's
simccl, or the host's gloo), sync and async, float32/bf16/fp16/int32, on the device and on the CPU, checked against
values worked out by hand for two ranks. Writes ``<out>/rank<N>.json``: ``{"checks": {name: "ok" | what went
wrong}, ...}``. Run by tests/ditorch/test_collectives.py under ``torchrun --nproc_per_node=2``."""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import ditorch

R = dist.ReduceOp
FP32_VARIABLE = "DITORCH_REDUCE_LOW_PRECISION_IN_FP32"
checks: dict = {}
messages: dict = {}


def check(name: str, fn) -> None:
    try:
        problem = fn()
        checks[name] = "ok" if problem is None else f"wrong: {problem}"
    except Exception as error:  # the report says what failed; the test asserts on it
        checks[name] = f"error: {type(error).__name__}: {error}"[:400]


def same(actual, expected):
    """None when ``actual`` (any device) holds exactly ``expected`` (a list, or a CPU tensor)."""
    actual = actual.detach().cpu()
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    return None if torch.equal(actual, expected) else f"{actual.tolist()} != {expected.tolist()}"


def first(*problems):
    return next((p for p in problems if p is not None), None)


rank_env = int(os.environ["RANK"])
# Rank r holds [r + 1, 2r + 3, 4]: rank 0 [1, 3, 4], rank 1 [2, 5, 4].
ALL_REDUCE = {  # op -> (floating result, integer result); None: not defined for that kind
    "SUM": ([3, 8, 8], [3, 8, 8]), "PRODUCT": ([2, 15, 16], [2, 15, 16]), "MIN": ([1, 3, 4], [1, 3, 4]),
    "MAX": ([2, 5, 4], [2, 5, 4]), "AVG": ([1.5, 4, 4], [1, 4, 4]),  # integers: truncated, as NCCL's average
    "BAND": (None, [0, 1, 4]), "BOR": (None, [3, 7, 4]), "BXOR": (None, [3, 6, 0]),
    "PREMUL_SUM": ([1.5, 4, 4], None),  # factor 0.5
}
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "i32": torch.int32}


def own(rank: int, dtype, device) -> torch.Tensor:
    return torch.tensor([rank + 1, 2 * rank + 3, 4], dtype=dtype, device=device)


def reduce_op(name: str):
    return dist._make_nccl_premul_sum(0.5) if name == "PREMUL_SUM" else getattr(R, name)


def run_async(work, async_op: bool):
    if async_op:
        if work is None:
            return "async_op=True returned no work"
        work.wait()
        if not work.is_completed():
            return "is_completed() is False after wait()"
    return None


def all_reduce_table(rank, device, tag, group=None, skip=()) -> None:
    for dtype_name, dtype in DTYPES.items():
        for op_name, (floating, integral) in ALL_REDUCE.items():
            expected = floating if dtype.is_floating_point else integral
            if expected is None or op_name in skip:
                continue
            for async_op in (False, True):
                def one(dtype=dtype, op_name=op_name, expected=expected, async_op=async_op):
                    t = own(rank, dtype, device)
                    work = dist.all_reduce(t, op=reduce_op(op_name), group=group, async_op=async_op)
                    return first(run_async(work, async_op), same(t, expected))

                check(f"{tag}all_reduce.{op_name}.{dtype_name}.{device}.{'async' if async_op else 'sync'}", one)


def collectives(rank, device, dtype_name) -> None:
    dtype = DTYPES[dtype_name]
    x = own(rank, dtype, device)  # rank 0 [1, 3, 4], rank 1 [2, 5, 4]
    x0, x1 = own(0, dtype, "cpu"), own(1, dtype, "cpu")

    def one_round(async_op: bool) -> None:
        suffix = f"{dtype_name}.{device}.{'async' if async_op else 'sync'}"

        def reduce():
            t = x.clone()
            work = dist.reduce(t, dst=0, op=R.SUM, async_op=async_op)
            return first(run_async(work, async_op), same(t, [3, 8, 8]) if rank == 0 else None)

        def broadcast():
            t = x.clone()
            return first(run_async(dist.broadcast(t, src=1, async_op=async_op), async_op), same(t, x1))

        def all_gather():
            out = [torch.empty_like(x) for _ in range(2)]
            work = dist.all_gather(out, x, async_op=async_op)
            return first(run_async(work, async_op), same(out[0], x0), same(out[1], x1))

        def all_gather_into_tensor():
            out = torch.empty(6, dtype=dtype, device=device)
            work = dist.all_gather_into_tensor(out, x, async_op=async_op)
            return first(run_async(work, async_op), same(out, torch.cat([x0, x1])))

        def reduce_scatter():
            out = torch.empty_like(x)
            work = dist.reduce_scatter(out, [x, x + 100], async_op=async_op)
            return first(run_async(work, async_op), same(out, (x0 + x1) + 200 * rank))

        def reduce_scatter_tensor():
            out = torch.empty_like(x)
            work = dist.reduce_scatter_tensor(out, torch.cat([x, x + 100]), async_op=async_op)
            return first(run_async(work, async_op), same(out, (x0 + x1) + 200 * rank))

        def all_to_all_single():
            out = torch.empty(4, dtype=dtype, device=device)
            work = dist.all_to_all_single(out, torch.arange(4, dtype=dtype, device=device) + 10 * rank,
                                          async_op=async_op)
            return first(run_async(work, async_op), same(out, [[0, 1, 10, 11], [2, 3, 12, 13]][rank]))

        def all_to_all_single_unequal():
            # rank 0 sends [0 | 1, 2], rank 1 sends [10, 11 | 12]: rank 0 gets [0, 10, 11], rank 1 [1, 2, 12]
            splits = [[1, 2], [2, 1]][rank]
            out = torch.empty(3, dtype=dtype, device=device)
            work = dist.all_to_all_single(out, torch.arange(3, dtype=dtype, device=device) + 10 * rank,
                                          output_split_sizes=splits, input_split_sizes=splits, async_op=async_op)
            return first(run_async(work, async_op), same(out, [[0, 10, 11], [1, 2, 12]][rank]))

        def all_to_all():
            out = [torch.empty(2, dtype=dtype, device=device) for _ in range(2)]
            inputs = [torch.full((2,), 10 * rank + j, dtype=dtype, device=device) for j in range(2)]
            work = dist.all_to_all(out, inputs, async_op=async_op)
            return first(run_async(work, async_op), same(out[0], [rank, rank]), same(out[1], [10 + rank, 10 + rank]))

        def gather():
            out = [torch.empty_like(x) for _ in range(2)] if rank == 0 else None
            work = dist.gather(x, out, dst=0, async_op=async_op)
            return first(run_async(work, async_op), *((same(out[0], x0), same(out[1], x1)) if rank == 0 else ()))

        def scatter():
            out = torch.empty_like(x)
            inputs = [x0.to(device), x1.to(device)] if rank == 0 else None
            work = dist.scatter(out, inputs, src=0, async_op=async_op)
            return first(run_async(work, async_op), same(out, [x0, x1][rank]))

        for fn in (reduce, broadcast, all_gather, all_gather_into_tensor, reduce_scatter, reduce_scatter_tensor,
                   all_to_all_single, all_to_all_single_unequal, all_to_all, gather, scatter):
            check(f"{fn.__name__}.{suffix}", fn)

    for async_op in (False, True):
        one_round(async_op)

    def send_recv():
        if rank == 0:
            dist.send(x, dst=1)
            return None
        t = torch.zeros_like(x)
        dist.recv(t, src=0)
        return same(t, x0)

    def isend_irecv():
        t = torch.zeros_like(x)
        works = [dist.isend(x, dst=1 - rank), dist.irecv(t, src=1 - rank)]
        for work in works:
            work.wait()
        return same(t, [x1, x0][rank])

    def isend_irecv_futures():
        # Both ranks take their send's future before they receive (NCCL's returns at once; sim's waited for the
        # transfer, which needs the peer's receive: a deadlock), read the received tensor in a callback, then wait
        # for the works too (gloo's send works, waited twice, waited for another transfer).
        t = torch.zeros_like(x)
        send = dist.isend(x, dst=1 - rank)
        sent = send.get_future()
        receive = dist.irecv(t, src=1 - rank)
        doubled = receive.get_future().then(lambda future: future.value()[0] * 2)
        sent.wait()
        twice = doubled.wait()
        send.wait()
        receive.wait()
        return first(same(t, [x1, x0][rank]), same(twice, [x1, x0][rank] * 2))

    def batch_isend_irecv():
        t = torch.zeros_like(x)
        ops = [dist.P2POp(dist.isend, x, 1 - rank), dist.P2POp(dist.irecv, t, 1 - rank)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return same(t, [x1, x0][rank])

    def coalesced():
        group = dist.group.WORLD
        gathered = torch.empty(6, dtype=dtype, device=device)
        group.allgather_into_tensor_coalesced([gathered], [x]).wait()
        scattered = torch.empty_like(x)
        opts = dist.ReduceScatterOptions()
        group.reduce_scatter_tensor_coalesced([scattered], [torch.cat([x, x + 100])], opts).wait()
        a, b = x.clone(), x[:2].clone()
        group.allreduce_coalesced([a, b], dist.AllreduceCoalescedOptions()).wait()
        return first(same(gathered, torch.cat([x0, x1])), same(scattered, (x0 + x1) + 200 * rank),
                     same(a, [3, 8, 8]), same(b, [3, 8]))

    def coalescing_manager():  # the fast paths of torch.distributed._coalescing_manager
        a, b = x.clone(), x.clone()
        with dist._coalescing_manager(async_ops=True) as manager:
            dist.all_reduce(a)
            dist.all_reduce(b, op=R.MAX)  # the manager takes the first op for all
        manager.wait()
        out = torch.empty(6, dtype=dtype, device=device)
        with dist._coalescing_manager():
            dist.all_gather_into_tensor(out, x)
        return first(same(a, [3, 8, 8]), same(b, [3, 8, 8]), same(out, torch.cat([x0, x1])))

    point_to_point = (send_recv, isend_irecv, isend_irecv_futures) if ditorch.backend.name != "cpu" else \
        (send_recv, isend_irecv)  # gloo's send works have no future ("Work::getFuture not implemented")
    for fn in (*point_to_point, batch_isend_irecv, coalesced, coalescing_manager):
        check(f"{fn.__name__}.{dtype_name}.{device}", fn)


def functional(rank, device) -> None:
    group = dist.group.WORLD
    x = own(rank, torch.float32, device)

    def funcol_collectives():
        reduced = funcol.wait_tensor(funcol.all_reduce(x, "sum", group))
        averaged = funcol.wait_tensor(funcol.all_reduce(x, "avg", group))
        gathered = funcol.wait_tensor(funcol.all_gather_tensor(x, 0, group))
        scattered = funcol.wait_tensor(funcol.reduce_scatter_tensor(torch.cat([x, x + 100]), "sum", 0, group))
        return first(same(reduced, [3, 8, 8]), same(averaged, [1.5, 4, 4]),
                     same(gathered, [1, 3, 4, 2, 5, 4]), same(scattered, [3 + 200 * rank, 8 + 200 * rank,
                                                                            8 + 200 * rank]))

    check(f"funcol.{device}", funcol_collectives)


def device_mesh(rank, device_type) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    def mesh():
        m = init_device_mesh(device_type, (2,))
        group = m.get_group()
        t = funcol.wait_tensor(funcol.all_reduce(torch.ones(2, device=device_type), "sum", group))
        return first(None if group.group_name else "the mesh's group has no name", same(t, [2, 2]))

    check(f"init_device_mesh.{device_type}", mesh)


def async_truth(rank, device) -> None:
    def is_completed_tells_the_truth():
        t = own(rank, torch.int32, device)
        if rank == 1:
            time.sleep(0.5)  # rank 0's all_reduce cannot finish before rank 1 joins
        work = dist.all_reduce(t, op=R.AVG, async_op=True)  # integers: SUM in gloo, then divided
        early = work.is_completed()
        work.wait()
        if rank == 0 and early:
            return "is_completed() was True before the other rank joined"
        if not work.is_completed():
            return "is_completed() is False after wait()"
        return same(t, [1, 4, 4])

    check(f"async_is_completed.{device}", is_completed_tells_the_truth)


def all_gather_into_one_row(rank) -> None:
    """NCCL's all_gather_into_tensor takes any output of world_size times the input's elements: SyncBatchNorm gathers
    each rank's ``(n,)`` statistics into a ``(1, world_size * n)`` tensor (gloo on the host refuses that shape)."""
    x = own(rank, torch.float32, "cuda")

    def into_one_row():
        out = torch.empty(1, 6, device="cuda")
        dist.all_gather_into_tensor(out, x)
        return same(out, torch.cat([own(0, torch.float32, "cpu"), own(1, torch.float32, "cpu")]).reshape(1, 6))

    check("all_gather_into_tensor.one_row.cuda", into_one_row)


def unsupported(rank) -> None:
    def message(name, fn):
        try:
            fn()
            messages[name] = "no error"
        except Exception as error:  # the message is what is checked
            messages[name] = str(error)

    group = dist.group.WORLD
    message("meta", lambda: dist.all_reduce(torch.ones(2, device="meta")))
    message("band_float", lambda: dist.all_reduce(torch.ones(2), op=R.BAND))
    message("allgather_coalesced", lambda: group.allgather_coalesced([[torch.ones(1)] * 2], [torch.ones(1)]))
    message("split_group", lambda: group.split_group([0]))


def low_precision_in_fp32(rank, device, group, tag) -> None:
    def fp16_avg():
        t = torch.full((2,), 60000.0, dtype=torch.float16, device=device)  # a float16 sum overflows: inf
        dist.all_reduce(t, op=R.AVG, group=group)
        return same(t, [60000.0, 60000.0])

    def fp16_reduce_scatter_avg():
        out = torch.empty(1, dtype=torch.float16, device=device)
        work = dist.reduce_scatter_tensor(out, torch.full((2,), 60000.0, dtype=torch.float16, device=device),
                                          op=R.AVG, group=group, async_op=True)
        work.wait()
        return same(out, [60000.0])

    def fp16_reduce_avg():
        t = torch.full((2,), 60000.0, dtype=torch.float16, device=device)
        dist.reduce(t, dst=0, op=R.AVG, group=group)
        return same(t, [60000.0, 60000.0]) if rank == 0 else None

    for fn in (fp16_avg, fp16_reduce_scatter_avg, fp16_reduce_avg):
        check(f"{tag}{fn.__name__}.{device}", fn)


def main() -> None:
    out_dir = sys.argv[1]
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    backend = ditorch.backend.name
    devices = ["cuda", "cpu"] if backend != "cpu" else ["cuda"]  # on the host "cuda" is the CPU
    skip = ("PREMUL_SUM",) if backend == "cpu" else ()  # gloo has no PREMUL_SUM; ditorch adapts AVG only
    for device in devices:
        all_reduce_table(rank, device, "", skip=skip)
        for dtype_name in DTYPES:
            collectives(rank, device, dtype_name)
        functional(rank, device)
        async_truth(rank, device)
    device_mesh(rank, "cuda")
    unsupported_on_world = backend == "sim"
    if backend == "sim":
        device_mesh(rank, "sim")
        all_gather_into_one_row(rank)
        unsupported(rank)
        # A group made while the variable is set carries its low-precision reductions in float32.
        os.environ[FP32_VARIABLE] = "1"
        group = dist.new_group([0, 1])
        del os.environ[FP32_VARIABLE]
        for device in devices:
            low_precision_in_fp32(rank, device, group, "fp32.")
            all_reduce_table(rank, device, "fp32.", group=group)
        # and the world group, made without it, does not: the check above can fail
        t = torch.full((2,), 60000.0, dtype=torch.float16, device="cuda")
        dist.all_reduce(t, op=R.AVG)
        plain_fp16_avg = t.cpu().tolist()
    else:
        low_precision_in_fp32(rank, "cuda", None, "fp32.")  # the host: DITORCH_REDUCE_LOW_PRECISION_IN_FP32=1
        plain_fp16_avg = None
    report = {"rank": rank, "backend": dist.get_backend(), "group_class": type(dist.group.WORLD).__name__,
              "group_name": dist.group.WORLD.group_name, "checks": checks, "messages": messages,
              "unsupported_checked": unsupported_on_world, "plain_fp16_avg": plain_fp16_avg}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
