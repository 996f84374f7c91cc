"""Per-op overhead of the sim device over the same op on the CPU.

Runs each op on CPU and on sim alternately, several rounds, and prints the median time per call
(wall and process CPU time) and the difference: the cost of the sim device's Python dispatch.

    python benchmarks/sim_overhead.py [--rounds 7] [--calls 300]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ditorch.sim  # noqa: E402

OPS = {
    "add": lambda a, b: a + b,
    "mul_": lambda a, b: a.mul_(1.0),
    "matmul": lambda a, b: a @ b,
    "view+t": lambda a, b: a.view(-1).view(a.shape).t(),
    "softmax": lambda a, b: torch.softmax(a, -1),
}


def time_calls(fn, a, b, calls: int) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        fn(a, b)
    return (time.perf_counter() - wall) / calls, (time.process_time() - cpu) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    ditorch.sim.register()
    torch.set_num_threads(1)  # per-op overhead, not kernel parallelism
    print(f"torch {torch.__version__}, {os.cpu_count()} cpus, median of {args.rounds} alternating rounds")
    print(f"{'op':<9}{'size':>6} {'cpu us':>9} {'sim us':>9} {'overhead us':>12} {'ratio':>7} "
          f"{'cpu-time overhead us':>21}")
    for size in (16, 256, 1024):
        for name, fn in OPS.items():
            cpu_a, cpu_b = torch.randn(size, size), torch.randn(size, size)
            sim_a, sim_b = cpu_a.to("sim"), cpu_b.to("sim")
            calls = max(args.calls // (1 + size // 256) ** 2, 10)
            results = {"cpu": [], "sim": []}
            for _ in range(args.rounds):
                for device, (a, b) in (("cpu", (cpu_a, cpu_b)), ("sim", (sim_a, sim_b))):
                    results[device].append(time_calls(fn, a, b, calls))
            cpu_wall = statistics.median(r[0] for r in results["cpu"]) * 1e6
            sim_wall = statistics.median(r[0] for r in results["sim"]) * 1e6
            cpu_proc = statistics.median(r[1] for r in results["cpu"]) * 1e6
            sim_proc = statistics.median(r[1] for r in results["sim"]) * 1e6
            print(f"{name:<9}{size:>6} {cpu_wall:>9.1f} {sim_wall:>9.1f} {sim_wall - cpu_wall:>12.1f} "
                  f"{sim_wall / cpu_wall:>7.2f} {sim_proc - cpu_proc:>21.1f}")


if __name__ == "__main__":
    main()
