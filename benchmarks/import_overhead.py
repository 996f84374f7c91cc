"""What the device layer costs: the time `import ditorch` adds to `import torch`, and per training step.

Import: fresh interpreters time `import torch`, then `import ditorch`, from inside (wall and process
CPU time), for the host (nothing detected) and for DITORCH_BACKEND=sim (registers the sim device).

Per step: one process, one model, stepped with the transfer active (show-as-cuda on, the default)
and deactivated in alternating rounds (ditorch.deactivate()/activate between them), median per
step. Two workloads: a tiny Llama step on host tensors (every op and every `.device` read passes the
patched attributes) and an MLP step on the sim device, its batch moved each step to "cuda" when
active and to "sim" when not. Timing ratios on a shared machine move by a few % either way, so it
also prints the counted cost: calls into ditorch's patched attributes in one step (cProfile) times
the median CPU time such a call adds (`t.device` and `t.to(...)`, active minus deactivated).

    python benchmarks/import_overhead.py [--rounds 15] [--imports 7]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

IMPORT_PROBE = """
import json, time
w0, c0 = time.perf_counter(), time.process_time()
import torch
w1, c1 = time.perf_counter(), time.process_time()
import ditorch
w2, c2 = time.perf_counter(), time.process_time()
print(json.dumps({"torch": [w1 - w0, c1 - c0], "ditorch": [w2 - w1, c2 - c1]}))
"""


def import_times(backend: str | None, runs: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DITORCH_")}
    env.update(DITORCH_QUIET="1", PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    if backend:
        env["DITORCH_BACKEND"] = backend
    samples = []
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", IMPORT_PROBE], env=env, capture_output=True, text=True,
                             check=True).stdout
        samples.append(json.loads(out.strip().splitlines()[-1]))
    return {key: [statistics.median(s[key][i] for s in samples) for i in (0, 1)] for key in ("torch", "ditorch")}


def _llama_step(device: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config).to(device)
    host_ids = torch.randint(0, 128, (2, 32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(target: str):
        ids = host_ids.to(target)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    return step


def _mlp_step(device: str):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 8)).to(device)
    host_x, host_y = torch.randn(32, 64), torch.randint(0, 8, (32,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(target: str):
        x, y = host_x.to(target), host_y.to(target)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def step_times(build, devices: dict, rounds: int, steps: int) -> dict:
    """Median (wall, CPU) seconds per step of one model, with the transfer deactivated ("baseline")
    and active ("active"); ``devices`` names the device each addresses (the batch moves there per step)."""
    from ditorch import activation

    backend, config = activation.active_backend(), _config()
    activation.deactivate()
    step = build(devices["baseline"])  # one model for both: separately built models differ in memory placement
    for _ in range(3):
        step(devices["baseline"])  # warm-up
    results = {"baseline": [], "active": []}
    for round_index in range(rounds):
        order = ("baseline", "active") if round_index % 2 == 0 else ("active", "baseline")
        for name in order:
            if name == "baseline":
                activation.deactivate()
            else:
                activation.activate(backend, config, forced=True)
            target = devices[name]
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(steps):
                step(target)
            results[name].append(((time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps))
    activation.activate(backend, config, forced=True)
    return {name: [statistics.median(r[i] for r in runs) for i in (0, 1)] for name, runs in results.items()}


def patched_calls_per_step(build, device: str) -> int:
    """How many calls one step makes into ditorch's patched attributes (wrappers, the device property)."""
    import cProfile
    import pstats

    step = build(device)
    step(device)
    profile = cProfile.Profile()
    profile.enable()
    step(device)
    profile.disable()
    ditorch_dir = os.path.join(ROOT, "ditorch")
    stats = pstats.Stats(profile).stats
    return sum(calls for (path, _, name), (calls, *_rest) in stats.items()
               if path.startswith(ditorch_dir) and not path.startswith(os.path.join(ditorch_dir, "sim"))
               and name not in ("__call__",))  # DeviceMap.__call__ runs inside a counted wrapper


def per_call_cost(rounds: int) -> float:
    """Median seconds a patched call adds: `t.device` and `t.to(same device)`, active minus deactivated."""
    import torch

    from ditorch import activation

    backend, config = activation.active_backend(), _config()
    x = torch.ones(2, device="sim")
    results = {"baseline": [], "active": []}
    for round_index in range(rounds):
        for name in (("baseline", "active") if round_index % 2 == 0 else ("active", "baseline")):
            activation.deactivate()
            if name == "active":
                activation.activate(backend, config, forced=True)
            target = "cuda" if name == "active" else "sim"
            start = time.process_time()
            for _ in range(20000):
                x.device  # noqa: B018 - the read is what is timed
                x.to(target)
            results[name].append((time.process_time() - start) / 40000)
    activation.activate(backend, config, forced=True)
    return max(statistics.median(results["active"]) - statistics.median(results["baseline"]), 0.0)


def _config():
    from ditorch.env import DeviceLayerConfig

    return DeviceLayerConfig(backend="sim", quiet=True, disable_mock=False, show_device_as_cuda=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--imports", type=int, default=7)
    args = parser.parse_args()

    if args.imports:
        print(f"import time, median of {args.imports} fresh interpreters (wall ms / process CPU ms)")
    for label, backend in (("host (nothing detected)", None), ("DITORCH_BACKEND=sim", "sim")) if args.imports else ():
        times = import_times(backend, args.imports)
        torch_wall, torch_cpu = (t * 1e3 for t in times["torch"])
        added_wall, added_cpu = (t * 1e3 for t in times["ditorch"])
        print(f"  {label:<24} import torch {torch_wall:7.1f} / {torch_cpu:7.1f}   import ditorch adds "
              f"{added_wall:6.1f} / {added_cpu:6.1f}  ({added_wall / torch_wall:.1%} of import torch, wall)")

    os.environ.update(DITORCH_BACKEND="sim", DITORCH_QUIET="1", DITORCH_SHOW_DEVICE_AS_CUDA="1")
    import torch

    import ditorch

    assert ditorch.is_active() and ditorch.backend.name == "sim"
    torch.set_num_threads(1)  # steady timings: per-step overhead, not kernel parallelism
    print(f"\nper step, median of {args.rounds} alternating rounds, transfer active (show-as-cuda) vs deactivated")
    print(f"  {'workload':<34}{'baseline ms':>12}{'active ms':>11}{'ratio':>8}{'cpu ratio':>11}")
    workloads = (
        ("tiny Llama train step, host", _llama_step, {"baseline": "cpu", "active": "cpu"}, 20),
        ("MLP train step, sim device", _mlp_step, {"baseline": "sim", "active": "cuda"}, 20),
    )
    cost = per_call_cost(args.rounds)
    estimates = []
    for label, build, devices, steps in workloads:
        times = step_times(build, devices, args.rounds, steps)
        base, active = times["baseline"], times["active"]
        print(f"  {label:<34}{base[0] * 1e3:12.3f}{active[0] * 1e3:11.3f}{active[0] / base[0]:8.3f}"
              f"{active[1] / base[1]:11.3f}")
        calls = patched_calls_per_step(build, devices["active"])
        estimates.append(f"  {label:<34}{calls:5d} patched calls x {cost * 1e6:.2f} us = "
                         f"{calls * cost * 1e3:.3f} ms/step ({calls * cost / base[1]:.2%} of the CPU time of a step)")
    # Timing ratios on a busy machine carry a few % of noise either way; the counted cost does not.
    print("\ncounted: calls into patched attributes per step x median added CPU time per call")
    print("\n".join(estimates))


if __name__ == "__main__":
    main()
