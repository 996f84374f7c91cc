"""Which ops a model runs for a given input size, with which shapes, how often: OpCapture in summary mode.

``OP_CAPTURE_MODE=summary`` records only names, argument shapes/dtypes/strides and counts (no tensor is
saved) and writes, at the end, a CSV (one row per op and argument signature) and the same in PyTorch's
operator input log format (``cnt: 4, ((T([8, 128, 64], f32), ...``). This script runs the tiny model
forward and backward for the size you give and prints the ops by number of calls. What is counted
are the calls the model's Python code makes; backward runs inside autograd and adds no rows.

    python examples/op_statistics.py --batch 8 --seq 128
    python examples/op_statistics.py --batch 1 --seq 512 --hidden 128 --layers 4

Only calls on the device are seen (op_tools takes the CPU as correct): on a machine without an
accelerator the script runs on the simulated device.
"""

import argparse
import collections
import csv
import os

os.environ.setdefault("OP_CAPTURE_MODE", "summary")
os.environ.setdefault("OP_TOOLS_VERBOSE", "0")  # the script prints its own short table; the files have it all

import torch  # noqa: E402
from prettytable import PrettyTable  # noqa: E402
from tiny_model import VOCAB, build, pick_device  # noqa: E402

import ditorch  # noqa: E402, F401 - maps "cuda" onto the detected device
import op_tools  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()

    device = pick_device()
    model = build(hidden=args.hidden, layers=args.layers).to(device)
    ids = torch.randint(0, VOCAB, (args.batch, args.seq)).to(device)
    with op_tools.OpCapture() as capture:
        model(ids).backward()

    results = os.environ.get("OP_TOOLS_RESULTS_DIR", "op_tools_results")
    stem = os.path.join(results, "op_capture_results", f"summary_{capture.stem}")
    with open(stem + ".csv", newline="") as f:
        rows = list(csv.DictReader(f))
    calls, signatures, first_shapes = collections.Counter(), collections.Counter(), {}
    for row in rows:
        calls[row["op"]] += int(row["count"])
        signatures[row["op"]] += 1
        first_shapes.setdefault(row["op"], row["shapes"])  # rows come most frequent first
    table = PrettyTable(["op", "calls", "signatures", "most frequent shapes"])
    table.align = "l"
    for op, n in calls.most_common():
        shapes = first_shapes[op]
        table.add_row([op, n, signatures[op], shapes if len(shapes) <= 60 else shapes[:57] + "..."])
    print(f"forward and backward, batch {args.batch} x seq {args.seq}, hidden {args.hidden}, {args.layers} layers, "
          f"on {device}: {sum(calls.values())} calls of {len(calls)} ops")
    print(table)
    print(f"per signature: {stem}.csv\nPyTorch operator input log format: {stem}.txt")


if __name__ == "__main__":
    main()
