"""A tiny Llama trained by FSDP2 (`fully_shard` on `init_device_mesh("cuda", ...)`, or on its default mesh), FSDP1
(`FullyShardedDataParallel(device_id=torch.device("cuda", n))` or `device_id=torch.cuda.current_device()`) and
tensor parallel (`parallelize_module`, Colwise/Rowwise), FSDP2 on a model built on the meta device and initialised
by DTensor random ops (PyTorch's FSDP2 example), written for
CUDA and run under torchrun (2 processes) by tests/ditorch/test_parallel_training.py on sim and on the host.
On sim also: attention on DTensors sharded over heads (fsdp_tp_example.py's plan), with sim's math and chunked
algorithms, and DDP with PowerSGD's communication hook over several buckets (its callbacks wait for collectives of
their own); last, FSDP2's example checkpoint save followed at once by destroy_process_group.

Each training mode writes, per rank, its losses and a checksum of the full parameters after training to
``OUT/<mode>.rank<N>.json``; the test compares them with a single-process run on the same global batch.
``dtensor_random`` writes what DTensor's random ops drew on each rank.
"""

import json
import os
import sys
import types

import tiny_models  # tests/, on the path torchrun's children get
import torch
import torch.distributed as dist

STEPS, BATCH, SEQ = 3, 2, 16


def tiny_llama():
    torch.manual_seed(0)
    return tiny_models.tiny_llama()


def batches(rank: int) -> list:
    """``rank``'s batches (a data-parallel rank's half of the global batch)."""
    generator = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, 128, (BATCH, SEQ), generator=generator) for _ in range(STEPS)]


def train(model, parameters, data, device, foreach=None) -> list:
    optimizer = torch.optim.SGD(parameters, lr=0.5, foreach=foreach)
    return [tiny_models.lm_step(model, optimizer, ids.to(device)) for ids in data]


def fsdp2(rank, local_rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    model = tiny_llama()  # on the host: fully_shard moves it (`param.data = param.to(device)`)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    losses = train(model, model.parameters(), batches(rank), "cuda")
    full = {name: p.full_tensor() for name, p in model.named_parameters()}
    return losses, full


def fsdp2_default_mesh(rank, local_rank):
    from torch.distributed.fsdp import fully_shard

    model = tiny_llama().cuda()  # no mesh: FSDP2 makes one on the accelerator and takes the current device
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    losses = train(model, model.parameters(), batches(rank), "cuda")
    full = {name: p.full_tensor() for name, p in model.named_parameters()}
    return losses, full


def fsdp2_meta_init(rank, out):
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = tiny_llama()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cuda")
    model.init_weights()  # transformers' reset_parameters: each weight a DTensor random op on its shards
    initial = {name: p.full_tensor().cpu() for name, p in model.named_parameters()}
    if rank == 0:  # the test trains one process from these
        torch.save(initial, os.path.join(out, "fsdp2_meta_init.initial.pt"))
    losses = train(model, model.parameters(), batches(rank), "cuda")
    full = {name: p.full_tensor() for name, p in model.named_parameters()}
    return losses, full


def dtensor_random() -> dict:
    """Draws of DTensor random ops on this rank, then of the user's stream reseeded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    torch.manual_seed(0)
    replicated = [distribute_tensor(torch.empty(8, 8, device="cuda"), mesh, [Replicate()]).normal_() for _ in "ab"]
    sharded = distribute_tensor(torch.empty(8, 8, device="cuda"), mesh, [Shard(0)]).normal_()
    torch.cuda.manual_seed(0)
    return {"replicated": [t.to_local().tolist() for t in replicated], "sharded": sharded.to_local().tolist(),
            "reseeded": torch.randn(4, device="cuda").tolist()}


def fsdp1(rank, local_rank):
    from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType

    model = FullyShardedDataParallel(tiny_llama(), device_id=torch.device("cuda", local_rank))
    losses = train(model, model.parameters(), batches(rank), "cuda")
    with FullyShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        full = model.state_dict()
    return losses, full


def fsdp1_current_device(rank, local_rank):
    from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType

    # device_id as PyTorch's FSDP tutorial gives it, an ordinal: the current device's
    model = FullyShardedDataParallel(tiny_llama().cuda(), device_id=torch.cuda.current_device())
    losses = train(model, model.parameters(), batches(rank), "cuda")
    with FullyShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        full = model.state_dict()
    return losses, full


def ddp_powersgd(rank, local_rank):
    """DDP with PowerSGD's hook, each parameter a bucket: its first two steps all-reduce plainly, the third compresses
    (an all-reduce of the uncompressed tensors, then of P and of Q, each issued in the last one's callback, which
    waits for it)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(tiny_llama().cuda(), device_ids=[local_rank], bucket_cap_mb=0.001)
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                        min_compression_rate=0.5)
    model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    losses = train(model, model.parameters(), batches(rank), "cuda")
    return losses, dict(model.module.named_parameters())


class CausalAttentionLM(torch.nn.Module):
    """An embedding, one causal attention block written as PyTorch's llama2_model.py writes it (q, k and v viewed
    into heads, then ``scaled_dot_product_attention(..., is_causal=True)``), and a head."""

    def __init__(self, vocab: int = 128, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, dim)
        self.wq, self.wk, self.wv, self.wo = (torch.nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, self.heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        logits = self.head(x + self.wo(attended.transpose(1, 2).contiguous().view(b, s, -1)))
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return types.SimpleNamespace(loss=loss)


def attention_lm():
    torch.manual_seed(0)
    return CausalAttentionLM()


def tensor_parallel_attention(rank, local_rank, algorithm: str = "math"):
    """fsdp_tp_example.py's plan: q, k and v stay DTensors sharded over heads into the attention call."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import ditorch.sim

    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    model = attention_lm().cuda()
    plan = {"wq": ColwiseParallel(use_local_output=False), "wk": ColwiseParallel(use_local_output=False),
            "wv": ColwiseParallel(use_local_output=False), "wo": RowwiseParallel()}
    parallelize_module(model, mesh, plan)
    with ditorch.sim.sdpa_algorithm(algorithm, block_size=4):
        losses = train(model, model.parameters(), batches(0), "cuda", foreach=False)
    full = {name: p.full_tensor() if hasattr(p, "full_tensor") else p for name, p in model.named_parameters()}
    return losses, full


def fsdp2_save(rank, local_rank, out):
    """FSDP2's example checkpoint (its dtensor_api save): every parameter gathered on every rank, kept by rank 0 alone,
    which saves it; the other ranks drop theirs unread and go straight on to destroy_process_group."""
    from torch.distributed.fsdp import fully_shard

    model = tiny_llama().cuda()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    losses = train(model, model.parameters(), batches(rank), "cuda")
    saved = {}
    for name, sharded in model.state_dict().items():
        full = sharded.full_tensor()
        if rank == 0:
            saved[name] = full.cpu()
        else:
            del full
    if rank == 0:
        torch.save(saved, os.path.join(out, "fsdp2_save.pt"))
    return {"losses": losses}


def tensor_parallel(rank, local_rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    model = tiny_llama().cuda()
    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)
    # Every rank trains on the same batch. foreach=False: the plan leaves norms and embeddings plain tensors, and
    # PyTorch's foreach kernels refuse a list mixing them with DTensors (on CUDA as well).
    losses = train(model, model.parameters(), batches(0), "cuda", foreach=False)
    full = {name: p.full_tensor() if hasattr(p, "full_tensor") else p for name, p in model.named_parameters()}
    return losses, full


MODES = {"fsdp2": fsdp2, "fsdp2_default_mesh": fsdp2_default_mesh, "fsdp1": fsdp1,
         "fsdp1_current_device": fsdp1_current_device, "tp": tensor_parallel,
         "tp_attention": tensor_parallel_attention,
         "tp_attention_chunked": lambda rank, local_rank: tensor_parallel_attention(rank, local_rank, "chunked"),
         "ddp_powersgd": ddp_powersgd}


def run_mode(mode: str, rank: int, local_rank: int, out: str) -> dict:
    if mode == "dtensor_random":
        return dtensor_random()
    if mode == "fsdp2_save":
        return fsdp2_save(rank, local_rank, out)
    losses, full = fsdp2_meta_init(rank, out) if mode == "fsdp2_meta_init" else MODES[mode](rank, local_rank)
    return {"losses": losses, "params": checksum(full)}


def checksum(full: dict) -> dict:
    """Per parameter: sum and sum of squares in float64, comparable across runs within float32 reassociation."""
    out = {}
    for name, tensor in sorted(full.items()):
        values = tensor.detach().to("cpu", torch.float64)
        out[name.replace("_fsdp_wrapped_module.", "")] = [values.sum().item(), values.square().sum().item()]
    return out


def main() -> None:
    out, modes = sys.argv[1], sys.argv[2].split(",")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank = dist.get_rank()
    for index, mode in enumerate(modes):
        if index:  # no barrier after the last: fsdp2_save, last, leaves unwaited collectives to destroy_process_group
            dist.barrier()
        try:
            report = run_mode(mode, rank, local_rank, out)
        except Exception as error:  # the test shows what failed, per mode, and goes on with the next mode
            import traceback

            report = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-3000:]}
        with open(os.path.join(out, f"{mode}.rank{rank}.json"), "w") as f:
            json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    # The device layer, imported here: the test imports this module's model and data for its reference run.
    import ditorch  # noqa: F401

    main()
