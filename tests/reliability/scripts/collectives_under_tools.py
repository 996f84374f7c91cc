"""Under torchrun on sim: collectives captured and timed by name, every tool's results in a per-rank folder."""

import os

import torch
import torch.distributed as dist

import ditorch  # noqa: F401 - maps init_process_group("nccl") to the sim's collective library
import op_tools

COLLECTIVES = "torch.distributed.all_reduce,torch.distributed.all_gather,torch.distributed.reduce_scatter," \
              "torch.distributed.broadcast"


def collectives(rank: int, world: int) -> None:
    x = torch.full((4,), float(rank + 1), device="cuda")
    dist.all_reduce(x)
    gathered = [torch.empty(4, device="cuda") for _ in range(world)]
    dist.all_gather(gathered, x)
    out = torch.empty(4, device="cuda")
    dist.reduce_scatter(out, [x.clone() for _ in range(world)])
    dist.broadcast(x, src=0)
    assert x.cpu().tolist() == [3.0] * 4 and out.cpu().tolist() == [6.0] * 4


def main() -> None:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ["OP_CAPTURE_LIST"] = os.environ["OP_TIME_MEASURE_LIST"] = COLLECTIVES
    with op_tools.OpCapture(), op_tools.OpTimeMeasure():
        collectives(rank, world)
    os.environ["OP_AUTOCOMPARE_LIST"] = "torch.nn.functional.linear"
    with op_tools.OpAutoCompare():
        torch.nn.functional.linear(torch.ones(2, 3, device="cuda"), torch.ones(4, 3, device="cuda"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
