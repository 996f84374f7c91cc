"""A training script written for CUDA, unchanged but for `import ditorch`.

It uses the CUDA idioms a real script does: `.cuda()`, `device="cuda"`, `torch.autocast("cuda")`,
`torch.cuda.amp.GradScaler`, `torch.cuda.synchronize`, memory statistics and a checkpoint reloaded
with `map_location="cuda"`. Run it on the simulated device, and on the host for reference:

    DITORCH_BACKEND=sim python examples/cuda_training.py
    DITORCH_BACKEND=cpu python examples/cuda_training.py

Each prints one `loss <step> <value>` line per step; the two runs print the same losses.
"""

import argparse
import os
import tempfile

import torch
import torch.nn.functional as F  # noqa: N812 - the usual alias

import ditorch  # noqa: F401 - makes the CUDA idioms below address the detected device


def build_model() -> torch.nn.Module:
    # Only ops that CUDA's and the CPU's autocast policies treat alike (linear in bfloat16, GELU as
    # given), so that the host reference run computes exactly what the device run does.
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    assert torch.cuda.is_available(), "this script needs a CUDA device"
    torch.manual_seed(0)
    torch.cuda.manual_seed_all(0)
    model = build_model().cuda()
    inputs = torch.randn(32, 16, device="cuda")
    labels = torch.randint(0, 4, (32,), device="cuda:0")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**8)
    torch.cuda.reset_peak_memory_stats()

    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(inputs)
        loss = F.cross_entropy(logits.float(), labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        torch.cuda.synchronize()
        print(f"loss {step} {loss.item():.10f}")

    print(f"device {torch.cuda.get_device_name()} allocated {torch.cuda.memory_allocated()} "
          f"peak {torch.cuda.max_memory_allocated()}")

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "checkpoint.pt")
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
        state = torch.load(path, map_location="cuda", weights_only=True)
    restored = build_model().cuda()
    restored.load_state_dict(state["model"])
    with torch.no_grad():
        same = torch.equal(restored(inputs), model(inputs))
    print(f"checkpoint reloaded on {next(restored.parameters()).device}: outputs equal {same}")


if __name__ == "__main__":
    main()
