"""A CUDA-written DDP script as torchrun runs it on a node with one GPU per rank (set_device(local_rank), nccl with
device_id, device_ids=[local_rank]), run by test_distributed under torchrun on sim and on the host; then the same
model beside a layer it never uses, under DDP(find_unused_parameters=True); then the DDP module compiled."""

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


class WithUnusedLayer(torch.nn.Module):
    def __init__(self, used: torch.nn.Module) -> None:
        super().__init__()
        self.used, self.unused = used, torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.used(x)


def train(ddp, batches) -> list:
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    losses = []
    for x in batches:
        loss = ddp(x).pow(2).mean()  # x on the CPU: DDP copies it to device_ids[0]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # a gradient DDP never wrote stays None
        losses.append(loss.item())
    return losses


def with_unused_layer(rank: int, local_rank: int) -> dict:
    """DDP finding unused parameters (transformers' Trainer's default): the used ones train as above, the unused
    layer gets no gradient."""
    model, batches = model_and_batches(rank, 100 + rank)
    model = WithUnusedLayer(model).cuda()
    train(DistributedDataParallel(model, device_ids=[local_rank], find_unused_parameters=True), batches)
    return {"unused_grads": [p.grad is None for p in model.unused.parameters()],
            "params_beside_unused": torch.cat([p.detach().reshape(-1) for p in model.used.parameters()]).cpu().tolist()}


def compiled_ddp(rank: int, local_rank: int) -> dict:
    """The DDP module compiled (``torch.compile(DDP(model))``; AOTAutograd's graphs, sim's compile fallback), trained
    as above. Dynamo once failed on sim's process group (``UnsafeScriptObjectError``)."""
    model, batches = model_and_batches(rank, 100 + rank)
    model = model.cuda()
    train(torch.compile(DistributedDataParallel(model, device_ids=[local_rank]), backend="aot_eager"), batches)
    return {"compiled_params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu().tolist()}


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank = dist.get_rank()
    model, batches = model_and_batches(rank, 100 + rank)  # DDP must broadcast rank 0's weights; data differs per rank
    model = model.cuda()
    losses = train(DistributedDataParallel(model, device_ids=[local_rank]), batches)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu().tolist()
    report = {"rank": rank, "backend": dist.get_backend(), "device": str(next(model.parameters()).device),
              "device_count": torch.cuda.device_count(), "current_device": torch.cuda.current_device(),
              "as_device": str(torch.device("cuda", torch.cuda.current_device())), "losses": losses,
              "params": params, **with_unused_layer(rank, local_rank), **compiled_ddp(rank, local_rank)}
    rank_reports.finish(os.path.join(sys.argv[1], f"rank{rank}.json"), report)


if __name__ == "__main__":
    # The device layer, imported here: the test imports this module's model and data for its reference run.
    import ditorch  # noqa: F401

    main()
