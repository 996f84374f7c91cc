"""Cost of OpTimeMeasure on a tiny-Llama training step, against the same step with no tool.

Alternating rounds (no tool, OpTimeMeasure with the per-call tables off, and with them on but sent to
/dev/null); each round times ``--steps`` training steps (forward, backward, AdamW step). Prints the
median wall and process CPU time per step, the ratios to no tool, the share of the step's wall time
that the measured op times add up to, and the time ``stop()`` takes to write the files.

    python benchmarks/time_measure_cost.py [--device sim|cuda] [--rounds 7] [--steps 3]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
from overhead import make_step  # noqa: E402 - one tiny-Llama step for every benchmark

import op_tools  # noqa: E402


def run_round(step, steps: int, mode: str) -> dict:
    os.environ["OP_TOOLS_VERBOSE"] = "1" if mode == "verbose" else "0"
    tool = None if mode == "none" else op_tools.OpTimeMeasure()
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        if tool:
            tool.start()
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            step()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        finish = 0.0
        if tool:
            finish = time.perf_counter()
            tool.stop()
            finish = time.perf_counter() - finish
    result = {"wall": wall / steps, "cpu": cpu / steps, "finish": finish, "measured": 0.0}
    if tool:
        totals = tool.measurements.totals.values()
        result["measured"] = sum(t.forward_ns + t.backward_ns for t in totals) / 1e9 / steps
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="sim")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if args.device == "sim":
        import ditorch.sim

        ditorch.sim.register()
    os.environ["OP_TOOLS_RESULTS_DIR"] = tempfile.mkdtemp(prefix="time_measure_cost_")
    step = make_step(args.device)
    modes = ("none", "quiet", "verbose")
    for mode in modes:  # warm-up: first-call costs (allocations, name resolution, announcements)
        run_round(step, 1, mode)
    results = {mode: [] for mode in modes}
    for _ in range(args.rounds):
        for mode in modes:
            results[mode].append(run_round(step, args.steps, mode))
    print(f"torch {torch.__version__}, device {args.device}, {os.cpu_count()} cpus, tiny Llama step "
          f"(hidden 64, 2 layers, batch 2x16, AdamW), median of {args.rounds} alternating rounds of {args.steps} steps")
    base = {k: statistics.median(r[k] for r in results["none"]) for k in ("wall", "cpu")}
    print(f"{'mode':<26}{'wall ms/step':>13}{'x none':>8}{'cpu ms/step':>13}{'x none':>8}"
          f"{'op sum / wall':>15}{'stop() ms':>11}")
    labels = {"none": "no tool", "quiet": "OpTimeMeasure VERBOSE=0", "verbose": "OpTimeMeasure VERBOSE=1"}
    for mode in modes:
        wall = statistics.median(r["wall"] for r in results[mode])
        cpu = statistics.median(r["cpu"] for r in results[mode])
        measured = statistics.median(r["measured"] / r["wall"] for r in results[mode])
        finish = statistics.median(r["finish"] for r in results[mode])
        print(f"{labels[mode]:<26}{wall * 1e3:>13.1f}{wall / base['wall']:>8.2f}{cpu * 1e3:>13.1f}"
              f"{cpu / base['cpu']:>8.2f}{measured:>15.2f}{finish * 1e3:>11.1f}")


if __name__ == "__main__":
    main()
