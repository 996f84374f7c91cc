"""Bytes and files OpCapture writes for one tiny-Llama training step on sim: dedup on against one file per argument.

With ``OP_CAPTURE_DEDUP=1`` (the default) a tensor seen again unchanged (a weight used by several ops,
an output that is the next op's input) is stored once and referenced; ``OP_CAPTURE_DEDUP=0`` writes
every argument in full. The step is the same in both runs (same seed, same model); the script counts
what lands on disk (``.pth`` files and their bytes) and times the step, alternating the two settings.

    python benchmarks/capture_storage.py [--rounds 3]
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

import ditorch.sim  # noqa: E402
import op_tools  # noqa: E402


def folder_size(root: str) -> tuple[int, int]:
    """(files, bytes) of the ``.pth`` files under ``root``."""
    files = size = 0
    for directory, _, names in os.walk(root):
        for name in names:
            if name.endswith(".pth"):
                files += 1
                size += os.path.getsize(os.path.join(directory, name))
    return files, size


def capture_one_step(step, dedup: bool) -> tuple[int, int, float, float]:
    results = tempfile.mkdtemp(prefix="capture_storage_")
    os.environ.update(OP_TOOLS_RESULTS_DIR=results, OP_TOOLS_VERBOSE="0", OP_CAPTURE_DEDUP="1" if dedup else "0")
    try:
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
            wall, cpu = time.perf_counter(), time.process_time()
            with op_tools.OpCapture():
                step()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        files, size = folder_size(results)
    finally:
        shutil.rmtree(results, ignore_errors=True)
    return files, size, wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    ditorch.sim.register()
    step = make_step("sim")
    step()  # the first step creates AdamW's state: capture a steady-state step
    samples: dict[bool, list] = {True: [], False: []}
    for _ in range(args.rounds):
        for dedup in (True, False):
            samples[dedup].append(capture_one_step(step, dedup))
    print(f"torch {torch.__version__}, sim device, {os.cpu_count()} cpus, OpCapture (full) of one tiny Llama step "
          f"(hidden 64, 2 layers, batch 2x16, AdamW); median of {args.rounds} alternating rounds")
    print(f"{'OP_CAPTURE_DEDUP':<20}{'files':>8}{'MB':>10}{'wall s':>10}{'cpu s':>10}")
    for dedup in (True, False):
        s = samples[dedup]
        files = statistics.median(x[0] for x in s)
        size = statistics.median(x[1] for x in s)
        print(f"{'1 (dedup)' if dedup else '0 (file per arg)':<20}{files:>8.0f}{size / 1e6:>10.2f}"
              f"{statistics.median(x[2] for x in s):>10.2f}{statistics.median(x[3] for x in s):>10.2f}")
    on, off = (statistics.median(x[1] for x in samples[d]) for d in (True, False))
    print(f"dedup writes {on / off:.2f} of the bytes ({off / on:.2f}x less)")


if __name__ == "__main__":
    main()
