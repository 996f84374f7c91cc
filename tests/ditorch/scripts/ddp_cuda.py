"""A CUDA-written DDP script as torchrun runs it on a node with one GPU per rank (set_device(local_rank), nccl with
device_id, device_ids=[local_rank]), run by test_distributed under torchrun on sim and on the host; then the same
model beside a layer it never uses, under DDP(find_unused_parameters=True); then the DDP module compiled. With the
argument ``sync_batch_norm`` (sim only: the host has no kernels for SyncBatchNorm's statistics), a small CNN with
SyncBatchNorm under DDP, each rank with its rows of one global batch."""

import os
import sys
import traceback

import rank_reports  # tests/, on the path torchrun's children get
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

STEPS = 3
SYNC_BN_ROWS = (3, 5)  # each rank's rows of SyncBatchNorm's global batch: unequal, so the counts weigh the ranks


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


def sync_batch_norm_model() -> torch.nn.Module:
    torch.manual_seed(0)
    # no bias before a batch norm (it would take it away: its gradient is 0 but for rounding)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1, bias=False), torch.nn.BatchNorm2d(4),
                               torch.nn.ReLU(), torch.nn.Conv2d(4, 2, 1, bias=False), torch.nn.BatchNorm2d(2))


def sync_batch_norm_batch(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The global batch, on the CPU."""
    torch.manual_seed(1)
    return torch.randn(sum(SYNC_BN_ROWS), 3, 5, 5).to(dtype)


def rows_of(x: torch.Tensor, rank: int, rows=SYNC_BN_ROWS) -> torch.Tensor:
    start = sum(rows[:rank])
    return x[start:start + rows[rank]]


def _listed(t):
    return None if t is None else t.detach().float().cpu().tolist()  # None: no gradient (an empty batch's)


def sync_batch_norm_step(norm, x: torch.Tensor, module=None) -> dict:
    """One forward and backward of ``module`` (``norm`` where None) on ``x`` with the loss ``sum(y**3)`` (``y**2``
    would sum to a constant after a batch norm, its input gradients near 0): the output,
    the input's gradient, ``norm``'s parameters' gradients and buffers after it."""
    x = x.requires_grad_()
    y = (module or norm)(x)
    y.float().pow(3).sum().backward()
    return {"output": _listed(y), "output_dtype": str(y.dtype), "input_grad": _listed(x.grad),
            "channels_last": y.is_contiguous(memory_format=torch.channels_last),
            "grads": {name: _listed(p.grad) for name, p in norm.named_parameters()},
            "buffers": {name: _listed(b) for name, b in norm.named_buffers()}}


def sync_batch_norm(rank: int, local_rank: int) -> dict:
    """SyncBatchNorm (convert_sync_batchnorm) in a small CNN under DDP on channels-last inputs, each rank with its rows
    of the global batch; a lone SyncBatchNorm on float16 and bfloat16 inputs with float32 parameters (autocast's
    case), and one where rank 1's batch is empty."""
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(sync_batch_norm_model()).cuda()
    x = rows_of(sync_batch_norm_batch(), rank).cuda().to(memory_format=torch.channels_last)
    report = {"cnn": sync_batch_norm_step(model, x, DistributedDataParallel(model, device_ids=[local_rank]))}
    for dtype in (torch.float16, torch.bfloat16):
        x = rows_of(sync_batch_norm_batch(dtype), rank).cuda()
        report[str(dtype)] = sync_batch_norm_step(torch.nn.SyncBatchNorm(3).cuda(), x)
    x = rows_of(sync_batch_norm_batch(), rank, rows=(4, 0)).cuda()
    report["empty_rank1"] = sync_batch_norm_step(torch.nn.SyncBatchNorm(3).cuda(), x)
    return {"sync_batch_norm": report}


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
    if "sync_batch_norm" in sys.argv[2:]:
        try:  # its failure is its test's, not the DDP test's
            report.update(sync_batch_norm(rank, local_rank))
        except Exception:
            report["sync_batch_norm"] = {"error": traceback.format_exc()}
    rank_reports.finish(os.path.join(sys.argv[1], f"rank{rank}.json"), report)


if __name__ == "__main__":
    # The device layer, imported here: the test imports this module's model and data for its reference run.
    import ditorch  # noqa: F401

    main()
