"""What OpAutoCompare costs: a tiny-Llama training step under it against the floor of doing the work twice.

The floor is one training step on the device (sim) plus the same step on the CPU in float64: what any
tool that compares every op with a float64 CPU run must at least spend. The three are measured side by
side, in alternating rounds; medians of wall time and of process CPU time are printed with the ratio.

    python benchmarks/autocompare_cost.py [--rounds 7] [--steps 1]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
os.environ["OP_TOOLS_VERBOSE"] = "0"  # the benchmark's condition: verbose output off
os.environ.setdefault("OP_TOOLS_RESULTS_DIR", os.path.join(tempfile.gettempdir(), "autocompare_cost_results"))

import torch  # noqa: E402
from tiny_models import tiny_llama  # noqa: E402

import ditorch.sim  # noqa: E402
import op_tools  # noqa: E402


class Trainer:
    """A tiny Llama, its batch and an AdamW optimizer on one device in one dtype."""

    def __init__(self, device: str, dtype: torch.dtype) -> None:
        torch.manual_seed(0)
        self.model = tiny_llama().to(device=device, dtype=dtype)
        self.ids = torch.randint(0, 128, (2, 16)).to(device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    def step(self) -> float:
        loss = self.model(input_ids=self.ids, labels=self.ids).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss.item()


def timed(fn) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=1, help="training steps per measurement")
    args = parser.parse_args()
    ditorch.sim.register()
    device, reference, compared = Trainer("sim", torch.float32), Trainer("cpu", torch.float64), \
        Trainer("sim", torch.float32)
    tool = op_tools.OpAutoCompare()

    def run(trainer: Trainer) -> None:
        for _ in range(args.steps):
            trainer.step()

    def run_compared() -> tuple[float, float]:
        tool.start()
        try:
            return timed(lambda: run(compared))
        finally:
            with contextlib.redirect_stdout(io.StringIO()):  # the end-of-run summary is not the step's cost
                tool.stop()

    for _ in range(2):  # warm-up: first-call costs of each path
        run(device), run(reference), run_compared()
    samples = {"device": [], "cpu float64": [], "OpAutoCompare": []}
    for _ in range(args.rounds):
        samples["device"].append(timed(lambda: run(device)))
        samples["cpu float64"].append(timed(lambda: run(reference)))
        samples["OpAutoCompare"].append(run_compared())
    medians = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in samples.items()}
    floor = tuple(medians["device"][i] + medians["cpu float64"][i] for i in (0, 1))
    print(f"tiny Llama training step (forward, backward, AdamW), {args.steps} step(s) per sample, "
          f"median of {args.rounds} alternating rounds, torch {torch.__version__}, {os.cpu_count()} CPUs")
    print(f"{'':<26}{'wall ms':>10}{'cpu ms':>10}")
    for name, (wall, cpu) in medians.items():
        print(f"{name:<26}{wall * 1e3:>10.1f}{cpu * 1e3:>10.1f}")
    print(f"{'floor (device + float64)':<26}{floor[0] * 1e3:>10.1f}{floor[1] * 1e3:>10.1f}")
    tool_wall, tool_cpu = medians["OpAutoCompare"]
    print(f"{'OpAutoCompare / floor':<26}{tool_wall / floor[0]:>9.2f}x{tool_cpu / floor[1]:>9.2f}x")


if __name__ == "__main__":
    main()
