"""The ditorch demo: train a tiny Llama on the accelerator (the simulated one when there is none).

    make demo            # or: python examples/demo.py
"""

from __future__ import annotations

import os
import sys
import time

import torch

import ditorch  # noqa: F401 - detects the accelerator and maps CUDA onto it

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def heading(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def pick_device() -> str:
    """`cuda` where ditorch found an accelerator (it maps CUDA onto it), else the simulated device."""
    if torch.cuda.is_available():
        return "cuda"
    import ditorch.sim

    ditorch.sim.register()
    print("no accelerator here: using the simulated device 'sim' (see docs/sim_device.md)")
    return "sim"


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config)


def train(device: str, steps: int = 4, seed: int = 0) -> list[float]:
    """Build on the CPU with ``seed``, train ``steps`` AdamW steps on ``device``; return the losses."""
    torch.manual_seed(seed)
    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 16))
    model.to(device)
    ids = ids.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def main() -> None:
    device = pick_device()
    heading(f"1. Train a tiny Llama on {device} and on the CPU")
    start = time.perf_counter()
    on_device = train(device)
    elapsed = time.perf_counter() - start
    on_cpu = train("cpu")
    for step, (d, c) in enumerate(zip(on_device, on_cpu)):
        print(f"step {step}: loss on {device} {d:.6f}   on cpu {c:.6f}")
    print(f"{len(on_device)} steps on {device} in {elapsed:.2f}s; "
          f"{'identical to' if on_device == on_cpu else 'different from'} the CPU run")


if __name__ == "__main__":
    main()
