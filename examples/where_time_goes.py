"""Where the time goes: OpTimeMeasure times every op of a training step, forward and backward.

It prints a summary (one row per op, the largest total first) and writes a per-call CSV, the summary
as CSV and a trace to open in https://ui.perfetto.dev (or chrome://tracing). On the simulated device
softmax is made slow on purpose (20 ms per call, as ``DITORCH_SIM_FAULTS="_softmax:slow=20"`` would;
a ``DITORCH_SIM_FAULTS`` you set replaces it), so that one op clearly tops the summary:

    python examples/where_time_goes.py
    python examples/where_time_goes.py --steps 3

On an accelerator ditorch finds, the script times the real device and injects nothing.
"""

import argparse
import csv
import json
import os

os.environ.setdefault("OP_TOOLS_VERBOSE", "0")  # no table per call: the summary and the files

import torch  # noqa: E402
from tiny_model import build, make_batch, pick_device  # noqa: E402

import ditorch  # noqa: E402 - maps "cuda" onto the detected device
import ditorch.sim  # noqa: E402 - the simulated device (registered only where it is used)
import op_tools  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1)
    args = parser.parse_args()
    device = pick_device()
    if ditorch.backend.name in ("cpu", "sim") and "DITORCH_SIM_FAULTS" not in os.environ:
        ditorch.sim.inject_fault("_softmax", "slow", 20)  # aten's name for the softmax kernel

    model = build().to(device)
    ids = make_batch(batch=4, seq=32).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step() -> None:
        model(ids).backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # warm-up, untimed: first calls pay one-off costs (kernel loading, caches) that are not the op's
    with op_tools.OpTimeMeasure() as timer:
        for _ in range(args.steps):
            step()

    with open(timer.written["summary"], newline="") as f:
        top = next(csv.DictReader(f))
    with open(timer.written["trace"]) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    print(f"\nslowest op: {top['name']} ({top['share']} of the measured time, {top['calls']} calls)")
    print(f"trace with {len(events)} spans: {timer.written['trace']}  (open it in https://ui.perfetto.dev)")


if __name__ == "__main__":
    main()
