"""What the examples share: a tiny Llama-shaped model in plain PyTorch (no download, no transformers), its
training loop, and the device they run on (``pick_device``).

Embedding, then per layer RMSNorm, causal self-attention, RMSNorm and
a GELU-gated MLP (as in Gemma), then a final RMSNorm and the vocabulary projection. The ops are the ones a real Llama
step runs (``linear``, ``matmul``, ``softmax``, ``gelu``, ``rsqrt``, ``cross_entropy``), at toy sizes.

>>> import torch
>>> from tiny_model import train
>>> losses = train("cpu", steps=2)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812 - the usual alias

VOCAB = 128


class RMSNorm(torch.nn.Module):
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class Block(torch.nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm = RMSNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = torch.nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = RMSNorm(hidden)
        self.gate = torch.nn.Linear(hidden, 2 * hidden, bias=False)
        self.up = torch.nn.Linear(hidden, 2 * hidden, bias=False)
        self.down = torch.nn.Linear(2 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(hidden, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        # Attention written out (not scaled_dot_product_attention, whose CPU and device kernels round
        # differently), so that a correct device computes exactly what the CPU does.
        scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
        future = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        attn = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1) @ v
        x = x + self.out(attn.transpose(1, 2).reshape(batch, seq, hidden))
        h = self.mlp_norm(x)
        return x + self.down(F.gelu(self.gate(h), approximate="tanh") * self.up(h))


class TinyLlama(torch.nn.Module):
    def __init__(self, hidden: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, hidden)
        self.blocks = torch.nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.norm = RMSNorm(hidden)
        self.head = torch.nn.Linear(hidden, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The next-token cross-entropy loss of ``ids`` (batch, seq)."""
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def pick_device() -> str:
    """``"cuda"`` when ``import ditorch`` found an accelerator (CUDA idioms then address it), else ``"sim"``.

    ``DITORCH_BACKEND=sim`` counts as an accelerator; with no accelerator the simulated device is
    registered here (it reads ``DITORCH_SIM_FAULTS``).
    """
    import ditorch

    if ditorch.backend.name != "cpu" and torch.cuda.is_available():
        return "cuda"
    import ditorch.sim as sim

    sim.register()
    return "sim"


def make_batch(batch: int = 2, seq: int = 16, seed: int = 0) -> torch.Tensor:
    """Token ids drawn on the CPU with ``seed`` (the same batch for every device)."""
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def build(seed: int = 0, **sizes) -> TinyLlama:
    """A ``TinyLlama`` built on the CPU with ``seed``: the same weights wherever it is moved afterwards."""
    torch.manual_seed(seed)
    return TinyLlama(**sizes)


def train(device: str, steps: int = 3, batch: int = 2, seq: int = 16, seed: int = 0) -> list[float]:
    """Build the model with ``seed``, train ``steps`` AdamW steps on ``device``; return the losses."""
    model = build(seed).to(device)
    ids = make_batch(batch, seq, seed).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = model(ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses
