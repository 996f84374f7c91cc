"""The recipes people train with, small enough for CI: each a short training run returning its losses.

Every workload seeds itself, builds on the CPU, moves to ``device`` and trains; the same call on the same device
gives the same losses bit for bit, so a tool that changes a run's numbers is caught by comparing them.
``forward_fault``/``backward_fault`` name a sim fault (``DITORCH_SIM_FAULTS`` form) in one of the workload's ops
and the op OpAutoCompare must name first (a suffix of the op's name); 1e-3 relative in float32, larger in
float16/bfloat16 where 1e-3 is below one rounding step.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F  # noqa: N812
from tiny_models import tiny_gpt2, tiny_llama, train_steps
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    run: Callable[[str], list]  # run(device) -> losses
    forward_fault: tuple[str, str]  # (fault spec, suffix of the op found first)
    backward_fault: tuple[str, str] | None  # None: the op's backward never reaches a handled thread


def _device_type(device: str) -> str:
    return torch.device(device).type


def cnn_batchnorm(device: str) -> list:
    """A CNN with BatchNorm and in-place ReLU (a ResNet's pattern), trained two steps, then evaluated."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    )
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 4, (4,))
    model.to(device)
    x, y = x.to(device), y.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(2):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    model.eval()  # the running statistics the training steps wrote are used now
    with torch.no_grad():
        losses.append(F.cross_entropy(model(x), y).item())
    return losses


def amp_gradscaler(device: str) -> list:
    """float16 autocast with GradScaler (unscale_, clip_grad_norm_) and cross_entropy on float16 logits."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 10))
    x, y = torch.randn(8, 16), torch.randint(0, 10, (8,))
    model.to(device)
    x, y = x.to(device), y.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(_device_type(device))
    losses = []
    for _ in range(2):
        with torch.autocast(_device_type(device), dtype=torch.float16):
            logits = model(x)
            loss = F.cross_entropy(logits, y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


class _RecurrentLM(nn.Module):
    def __init__(self, cell: type) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.rnn = cell(16, 16, num_layers=2, batch_first=True)
        self.head = nn.Linear(16, 32)

    def forward(self, ids):
        return self.head(self.rnn(self.embed(ids))[0])


def _recurrent(cell: type, device: str) -> list:
    torch.manual_seed(0)
    model = _RecurrentLM(cell)
    ids = torch.randint(0, 32, (2, 6))
    model.to(device)
    ids = ids.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(2):
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def lstm_lm(device: str) -> list:
    """A two-layer nn.LSTM language model."""
    return _recurrent(nn.LSTM, device)


def gru_lm(device: str) -> list:
    """A two-layer nn.GRU language model."""
    return _recurrent(nn.GRU, device)


def _transformers_lm(device: str, model, steps: int = 2) -> list:
    return train_steps(model, device, steps)


def gpt2_dropout(device: str) -> list:
    """GPT-2 with its default dropout (0.1 on embeddings, attention and residuals), in training mode."""
    torch.manual_seed(0)
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=32, bos_token_id=0,
                        eos_token_id=0)
    return _transformers_lm(device, GPT2LMHeadModel(config))


def transformer_encoder(device: str) -> list:
    """nn.TransformerEncoderLayer with dropout 0.1, batch first, and a linear head."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
    head = nn.Linear(32, 4)
    x, y = torch.randn(2, 6, 32), torch.randint(0, 4, (2, 6))
    layer.to(device), head.to(device)
    x, y = x.to(device), y.to(device)
    optimizer = torch.optim.AdamW([*layer.parameters(), *head.parameters()], lr=1e-3)
    losses = []
    for _ in range(2):
        loss = F.cross_entropy(head(layer(x)).flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def llama_bf16(device: str) -> list:
    """A Llama entirely in bfloat16 (weights and activations) with AdamW."""
    torch.manual_seed(0)
    return _transformers_lm(device, tiny_llama(hidden=32).to(torch.bfloat16))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, h):
        return h + self.down(F.gelu(self.up(h)))


def _checkpointed(device: str, reentrant: bool) -> list:
    torch.manual_seed(0)
    stem, blocks, head = nn.Linear(16, 16), nn.ModuleList(_Block() for _ in range(2)), nn.Linear(16, 4)
    x, y = torch.randn(4, 16), torch.randint(0, 4, (4,))
    stem.to(device), blocks.to(device), head.to(device)
    x, y = x.to(device), y.to(device)
    optimizer = torch.optim.SGD([*stem.parameters(), *blocks.parameters(), *head.parameters()], lr=0.1)
    losses = []
    for _ in range(2):
        h = stem(x)  # a block's input requires grad: the reentrant mode needs one to give its parameters gradients
        for block in blocks:
            h = checkpoint(block, h, use_reentrant=reentrant)
        loss = F.cross_entropy(head(h), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def checkpoint_nonreentrant(device: str) -> list:
    """Gradient checkpointing, torch.utils.checkpoint(use_reentrant=False)."""
    return _checkpointed(device, reentrant=False)


def checkpoint_reentrant(device: str) -> list:
    """Gradient checkpointing, torch.utils.checkpoint(use_reentrant=True)."""
    return _checkpointed(device, reentrant=True)


def llama_float32(device: str) -> list:
    torch.manual_seed(0)
    return _transformers_lm(device, tiny_llama(hidden=32))


def gpt2(device: str) -> list:
    torch.manual_seed(0)
    return _transformers_lm(device, tiny_gpt2(hidden=32))


ZOO = (
    Workload("cnn_batchnorm", cnn_batchnorm, ("convolution:noise=1e-3", "conv2d"),
             ("convolution_backward:noise=1e-3", "conv2d")),
    Workload("amp_gradscaler", amp_gradscaler, ("gelu:noise=1e-2", "gelu"), ("gelu_backward:noise=1e-2", "gelu")),
    Workload("lstm_lm", lstm_lm, ("_thnn_fused_lstm_cell:noise=1e-3", "lstm"),
             ("_thnn_fused_lstm_cell_backward_impl:noise=1e-3", "lstm")),
    Workload("gru_lm", gru_lm, ("_thnn_fused_gru_cell:noise=1e-3", "gru"),
             ("_thnn_fused_gru_cell_backward:noise=1e-3", "gru")),
    Workload("gpt2_dropout", gpt2_dropout, ("tanh:noise=1e-3", "tanh"), ("tanh_backward:noise=1e-3", "tanh")),
    Workload("transformer_encoder", transformer_encoder, ("native_layer_norm:noise=1e-3", "layer_norm"),
             ("native_layer_norm_backward:noise=1e-3", "layer_norm")),
    Workload("llama_bf16", llama_bf16, ("silu:noise=5e-2", "silu"),
             ("_softmax_backward_data:noise=5e-2", "scaled_dot_product_attention")),
    Workload("checkpoint_nonreentrant", checkpoint_nonreentrant, ("gelu:noise=1e-3", "gelu"),
             ("gelu_backward:noise=1e-3", "gelu")),
    # The reentrant mode recomputes the block inside backward on autograd's device thread, where no tool runs:
    # its ops are compared in forward only (the summary counts it).
    Workload("checkpoint_reentrant", checkpoint_reentrant, ("gelu:noise=1e-3", "gelu"), None),
)
# The two transformers models in float32, with faults: what sim's GPU numerics runs beside the recipes (issue 34)
IN_FLOAT32 = (Workload("llama_float32", llama_float32, ("silu:noise=1e-3", "silu"),
                       ("_softmax_backward_data:noise=1e-3", "scaled_dot_product_attention")),
              Workload("gpt2", gpt2, ("tanh:noise=1e-3", "tanh"), ("tanh_backward:noise=1e-3", "tanh")))
# what the `gpu` tests run on CUDA: every recipe and the two transformers models in float32
ON_CUDA = ZOO + IN_FLOAT32


def cuda_baseline(workload: Workload) -> tuple[list, bool]:
    """The recipe's losses on CUDA without a tool, and whether a second run repeats them (atomics and cuDNN's
    algorithms may not): a tool changed nothing if its run's losses equal these, or the recipe is not repeatable."""
    expected = workload.run("cuda")
    return expected, workload.run("cuda") == expected
