"""A CUDA-written DDP script as torchrun runs it on a node with one GPU per rank (set_device(local_rank), nccl with
device_id, device_ids=[local_rank]), run by test_distributed under torchrun on sim and on the host."""

import os
import sys

import rank_reports  # tests/, on the path torchrun's children get
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

STEPS = 3


def model_and_batches(seed: int, data_seed: int):
    """The model (as seeded on ``seed``) and this rank's batches (drawn on ``data_seed``), on the CPU."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    torch.manual_seed(data_seed)
    return model, [torch.randn(4, 8) for _ in range(STEPS)]


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank = dist.get_rank()
    model, batches = model_and_batches(rank, 100 + rank)  # DDP must broadcast rank 0's weights; data differs per rank
    model = model.cuda()
    ddp = DistributedDataParallel(model, device_ids=[local_rank])
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    losses = []
    for x in batches:
        loss = ddp(x).pow(2).mean()  # x on the CPU: DDP copies it to device_ids[0]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu().tolist()
    report = {"rank": rank, "backend": dist.get_backend(), "device": str(next(model.parameters()).device),
              "device_count": torch.cuda.device_count(), "current_device": torch.cuda.current_device(),
              "as_device": str(torch.device("cuda", torch.cuda.current_device())), "losses": losses,
              "params": params}
    rank_reports.finish(os.path.join(sys.argv[1], f"rank{rank}.json"), report)


if __name__ == "__main__":
    # The device layer, imported here: the test imports this module's model and data for its reference run.
    import ditorch  # noqa: F401

    main()
