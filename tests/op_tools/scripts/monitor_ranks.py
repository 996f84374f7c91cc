"""Run by tests/op_tools/test_training_monitor_ranks.py under torchrun (2 processes) on sim: a tiny Llama trained
STEPS AdamW steps under TrainingMonitor, each rank on its half of a fixed global batch, once per plan:

- ``fsdp2``: ``fully_shard`` per decoder layer and on the root;
- ``ddp``: DistributedDataParallel;
- ``ddp_mismatch``: DDP, one step more, rank 1 adding to one gradient after DDP's reduction from step
  ``PERTURBED_FROM`` on (an optimizer pre-step hook of ours, registered before the monitor starts, runs before the
  monitor's);
- ``fsdp1``: FullyShardedDataParallel per decoder layer and on the root, ``use_orig_params=True``;
- ``tp``: tensor parallel over both ranks (``parallelize_module``: q/k/v and gate/up column-wise, o and down
  row-wise), both ranks on the whole global batch (the two halves): tensor parallelism splits the model, not the data.

The monitor writes its files under ``OUT/<plan>/``; what only the script can see goes to ``OUT/rank<N>.json``, per
plan and step: the norms of this rank's local gradient shards (FSDP2) and local gradient and weight shards (TP), and
the norms of the gradients a plain copy of the model computes on this rank's half batch, which is what DDP holds
before its reduction.
"""

import os
import sys

import rank_reports  # tests/, on the path torchrun's children get
import tiny_models
import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

import op_tools

STEPS, BATCH, SEQ = 3, 2, 16
PERTURBED = "module.model.layers.1.mlp.up_proj.weight"
PERTURBED_FROM = 2


def tiny_llama():
    torch.manual_seed(0)
    return tiny_models.tiny_llama()


def batches(rank: int) -> list:
    """``rank``'s batches: a data-parallel rank's half of the global batch of each step."""
    generator = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, 128, (BATCH, SEQ), generator=generator) for _ in range(STEPS)]


def train(model, data, results_dir: str, device: str = "cuda", before_step=None,
          foreach: bool | None = None) -> op_tools.TrainingMonitor:
    """AdamW steps on ``data`` under a TrainingMonitor (the test's single-process reference runs this too);
    ``before_step(model, step)``, when given, runs at each optimizer pre-step hook, before the monitor's."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)
    state = {"step": 0}
    hook = register_optimizer_step_pre_hook(lambda *_: before_step(model, state["step"])) if before_step else None
    try:
        with op_tools.TrainingMonitor(results_dir=results_dir, model=model, tensorboard=False,
                                      state_every=1) as monitor:  # every figure at every step
            for ids in data:
                tiny_models.lm_step(model, optimizer, ids.to(device))
                state["step"] += 1
    finally:
        if hook is not None:
            hook.remove()
    return monitor


def fsdp2(rank: int, out: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    model = tiny_llama()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    local: list[dict] = []

    def local_shard_norms(model, step):
        local.append({name: p.grad.to_local().double().norm().item() for name, p in model.named_parameters()})

    train(model, batches(rank), os.path.join(out, "fsdp2"), before_step=local_shard_norms)
    return {"local_grad_norms": local}


def plain_grad_norms(plain: torch.nn.Module, replica: torch.nn.parallel.DistributedDataParallel,
                     ids: torch.Tensor) -> dict:
    """The gradient norms of a plain copy of ``replica``'s module on ``ids``: what this rank accumulates before the
    reduction (``autograd.grad``, not ``backward``: the monitor reads backward's roots as the loss)."""
    plain.load_state_dict(replica.module.state_dict())
    loss = plain(input_ids=ids, labels=ids).loss
    grads = torch.autograd.grad(loss, list(plain.parameters()))
    return {name: g.double().norm().item() for (name, _), g in zip(plain.named_parameters(), grads)}


def ddp(rank: int, out: str) -> dict:
    model = torch.nn.parallel.DistributedDataParallel(tiny_llama().cuda())
    plain = tiny_llama().cuda()
    data = batches(rank)
    local: list[dict] = []
    train(model, data, os.path.join(out, "ddp"),
          before_step=lambda model, step: local.append(plain_grad_norms(plain, model, data[step].cuda())))
    return {"local_grad_norms": local}


def ddp_mismatch(rank: int, out: str) -> dict:
    def perturb(model, step):
        if rank == 1 and step >= PERTURBED_FROM:
            dict(model.named_parameters())[PERTURBED].grad.add_(1e-3)

    model = torch.nn.parallel.DistributedDataParallel(tiny_llama().cuda())
    data = batches(rank) + batches(rank)[:1]  # a step after the mismatch: the rule fires once
    train(model, data, os.path.join(out, "ddp_mismatch"), before_step=perturb)
    return {}


def fsdp1(rank: int, out: str) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model = FullyShardedDataParallel(tiny_llama(), device_id=torch.device("cuda", torch.cuda.current_device()),
                                     auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}), use_orig_params=True)
    train(model, batches(rank), os.path.join(out, "fsdp1"))
    return {}


def tp(rank: int, out: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    model = tiny_llama().cuda()
    # 4 query and 2 key/value heads: 2 and 1 per rank; the attention's reshapes infer the local head count
    plan = {**dict.fromkeys(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                             "mlp.up_proj"), ColwiseParallel()),
            "self_attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)
    local: list[dict] = []

    def local_shard_norms(model, step):
        local.append({name: {"placements": str(p.placements), "grad": p.grad.to_local().double().norm().item(),
                             "weight": p.to_local().double().norm().item()}
                      for name, p in model.named_parameters() if hasattr(p, "placements")})

    whole = [torch.cat(halves) for halves in zip(batches(0), batches(1))]
    # AdamW's foreach kernels refuse a list mixing DTensors and plain tensors (the embedding, norms, head): one
    # parameter at a time, the same arithmetic
    train(model, whole, os.path.join(out, "tp"), before_step=local_shard_norms, foreach=False)
    return {"local_norms": local}


PLANS = {"fsdp2": fsdp2, "ddp": ddp, "ddp_mismatch": ddp_mismatch, "fsdp1": fsdp1, "tp": tp}


def main() -> None:
    out, plans = sys.argv[1], sys.argv[2].split(",")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank = dist.get_rank()
    report = {}
    for plan in plans:
        try:
            report[plan] = PLANS[plan](rank, out)
        except Exception as error:  # the test shows what failed, per plan, and goes on with the next plan
            import traceback

            report[plan] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-3000:]}
        dist.barrier()
    rank_reports.finish(os.path.join(out, f"rank{rank}.json"), report)


if __name__ == "__main__":
    # The device layer, imported here: the test imports this module's model, data and loop for its reference run.
    import ditorch  # noqa: F401

    main()
