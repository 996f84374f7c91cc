"""What a run recording (OpCapture, ``OP_CAPTURE_MODE=stats``) costs a Llama training step: bytes per step, and
time against the same step without it, measured side by side in alternating rounds.

The step is forward, backward, AdamW step and ``loss.item()`` of a Llama built from a config (no download):
hidden 512, 4 layers, batch 2 x 128 by default. Recording computes each tensor's statistics on its device and reads
them back once per call, and writes a JSON line per call (forward, backward, optimizer).

    python benchmarks/record_cost.py [--device cpu|sim] [--hidden 512] [--layers 4] [--seq 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("DITORCH_QUIET", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import torch  # noqa: E402
from overhead import make_step  # noqa: E402

import op_tools  # noqa: E402


def timed_steps(step, steps: int, record: bool) -> tuple[float, float, float]:
    """``(seconds, bytes, records)`` per step over ``steps`` steps, recorded or not."""
    results = tempfile.mkdtemp(prefix="record_cost_")
    os.environ.update(OP_TOOLS_RESULTS_DIR=results, OP_TOOLS_VERBOSE="0", OP_CAPTURE_MODE="stats")
    tool = op_tools.OpCapture() if record else contextlib.nullcontext()
    try:
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), tool:
            start = time.perf_counter()
            for _ in range(steps):
                step()
            wall = time.perf_counter() - start
        size = tool.recorder.file.bytes_written if record else 0
        records = tool.recorder.records if record else 0
    finally:
        shutil.rmtree(results, ignore_errors=True)
    return wall / steps, size / steps, records / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu, sim, cuda, ... (default cpu)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.device == "sim":
        import ditorch.sim

        ditorch.sim.register()
    step = make_step(args.device, hidden=args.hidden, seq=args.seq, layers=args.layers, batch=args.batch)
    step()  # AdamW's state, the first allocations: time steady-state steps
    samples: dict[bool, list] = {False: [], True: []}
    for _ in range(args.rounds):
        for record in (False, True):
            samples[record].append(timed_steps(step, args.steps, record))
    print(f"torch {torch.__version__}, {args.device}, {os.cpu_count()} cpus; Llama hidden {args.hidden}, "
          f"{args.layers} layers, batch {args.batch}x{args.seq}, AdamW; median of {args.rounds} alternating rounds "
          f"of {args.steps} steps")
    print(f"{'':<26}{'s/step':>10}{'records/step':>14}{'KB/step':>10}{'bytes/record':>14}")
    for record in (False, True):
        s = samples[record]
        seconds, size, records = (statistics.median(x[i] for x in s) for i in range(3))
        label = "recorded (stats mode)" if record else "not recorded"
        per_record = f"{size / records:.0f}" if records else ""
        print(f"{label:<26}{seconds:>10.4f}{records:>14.0f}{size / 1e3:>10.1f}{per_record:>14}")
    plain, recorded = (statistics.median(x[0] for x in samples[r]) for r in (False, True))
    print(f"recording / not recorded: {recorded / plain:.2f}x the step time")


if __name__ == "__main__":
    main()
