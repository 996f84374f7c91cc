"""A CUDA-written DDP script (nccl, device_ids=[local_rank]), run by test_distributed under torchrun on sim."""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import ditorch  # noqa: F401 - the device layer


def main() -> None:
    dist.init_process_group("nccl")
    rank, local_rank = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    # More ranks than devices share them; on sim each process has its own device 0 (autograd of a
    # Python PrivateUse1 backend knows one device only).
    device_index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(device_index)
    torch.manual_seed(rank)  # different initial weights per rank: DDP must broadcast rank 0's
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)).cuda()
    ddp = DistributedDataParallel(model, device_ids=[device_index])
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    torch.manual_seed(100 + rank)  # different data per rank: gradients must be averaged
    for _ in range(3):
        x = torch.randn(4, 8, device="cuda")
        loss = ddp(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu().tolist()
    report = {"rank": rank, "backend": dist.get_backend(), "device": str(next(model.parameters()).device),
              "params": params}
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
