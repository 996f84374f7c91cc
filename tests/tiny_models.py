"""Small real models and a training loop shared by the tests (no downloads)."""

from __future__ import annotations

import torch


def tiny_llama(vocab: int = 128, hidden: int = 64, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


def tiny_gpt2(vocab: int = 128, hidden: int = 64, layers: int = 2):
    from transformers import GPT2Config, GPT2LMHeadModel

    # No dropout: on a device PyTorch runs native_dropout, whose rounding differs from the CPU path.
    config = GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=4, n_positions=64,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def mlp():
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4)
    )


class NanoGPT(torch.nn.Module):
    """The shape of karpathy's nanoGPT ``model.GPT``, one block, no dropout: token and position embeddings (the
    positions from ``torch.arange(..., device=idx.device)`` inside the forward), causal
    ``F.scaled_dot_product_attention``, LayerNorm, a GELU MLP, an untied head and the cross-entropy loss."""

    def __init__(self, vocab: int = 64, block: int = 16, width: int = 32, heads: int = 2):
        super().__init__()
        nn = torch.nn
        self.heads = heads
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(block, width)
        self.ln_1, self.ln_2, self.ln_f = nn.LayerNorm(width), nn.LayerNorm(width), nn.LayerNorm(width)
        self.c_attn, self.c_proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        batch, steps = idx.shape
        pos = torch.arange(0, steps, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        q, k, v = (z.view(batch, steps, self.heads, -1).transpose(1, 2)
                   for z in self.c_attn(self.ln_1(x)).split(x.size(-1), dim=2))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(batch, steps, -1))
        x = x + self.mlp(self.ln_2(x))
        logits = self.lm_head(self.ln_f(x))
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def train_llama(device: str, steps: int = 3, seed: int = 0, autocast_dtype=None, model_factory=tiny_llama):
    """Build on CPU with ``seed``, move to ``device``, train ``steps`` AdamW steps; return the losses."""
    torch.manual_seed(seed)
    return train_steps(model_factory(), device, steps, autocast_dtype)


def train_steps(model, device: str, steps: int, autocast_dtype=None) -> list:
    """Move a language model to ``device`` and train it ``steps`` AdamW steps on one random batch; the losses."""
    ids = torch.randint(0, 128, (2, 16))
    model.to(device)
    ids = ids.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return [lm_step(model, optimizer, ids, autocast_dtype) for _ in range(steps)]


def lm_step(model, optimizer, ids: torch.Tensor, autocast_dtype=None) -> float:
    """One optimizer step of a language model on token ids (the labels too), under autocast when asked; the loss."""
    with torch.autocast(ids.device.type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def train_mlp(device: str, steps: int = 5, seed: int = 0):
    torch.manual_seed(seed)
    model = mlp()
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    model.to(device)
    x, y = x.to(device), y.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses
