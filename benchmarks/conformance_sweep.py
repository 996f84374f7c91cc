"""The whole op_db on sim: how long the conformance sweep takes, its pass rate, and every row that does not pass.

Runs ``python -m op_tools.conformance`` on the sim device (forward and backward) as a user would, times
it, and prints the figures recorded in docs/conformance.md. Not a test: sim computes with the CPU's
kernels, so what does not pass is a gap of sim or of the reference, each explained in the docs.

    python benchmarks/conformance_sweep.py                      # every OpInfo in float32 (tens of minutes)
    python benchmarks/conformance_sweep.py --ops 'nn.functional.*' --dtypes float32,bfloat16 --jobs 2
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from op_tools.offline.conformance.report import COUNTED, format_rate, pass_rate  # noqa: E402
from op_tools.offline.conformance.results import CSV_FILE, read_csv  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default="", help="the OpInfos (default: all)")
    parser.add_argument("--dtypes", default="float32")
    parser.add_argument("--limit-samples", default="")
    parser.add_argument("--jobs", default="1")
    parser.add_argument("--timeout", default="600", help="per op x dtype, seconds")
    parser.add_argument("--output", default="", help="the run's folder (default: the command's, under "
                                                     "OP_TOOLS_RESULTS_DIR)")
    args = parser.parse_args()
    command = [sys.executable, "-m", "op_tools.conformance", "--device", "sim", "--setup", "ditorch.sim:register",
               "--dtypes", args.dtypes, "--jobs", args.jobs, "--timeout", args.timeout]
    command += ["--output", args.output] if args.output else []
    command += ["--ops", args.ops] if args.ops else []
    command += ["--limit-samples", args.limit_samples] if args.limit_samples else []
    env = dict(os.environ, DITORCH_QUIET="1", PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get(
        "PYTHONPATH")])))
    env.pop("DITORCH_SIM_FAULTS", None)
    print("running:", " ".join(command), flush=True)
    start = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    found = re.search(r"; results in (.+)$", result.stdout, re.MULTILINE)
    if result.returncode not in (0, 3, 4) or found is None:  # 3: a row failed, 4: some not checked, listed below
        print(result.stdout[-3000:], result.stderr[-3000:], sep="\n")
        return result.returncode or 1
    folder = found.group(1)
    rows = read_csv(os.path.join(folder, CSV_FILE))
    ops = len({(r.op, r.dtype) for r in rows})
    print(f"\n{ops} op x dtype, {len(rows)} rows, in {seconds:.0f} s wall ({seconds / max(ops, 1):.2f} s per "
          f"op x dtype) on {os.cpu_count()} cpus, --jobs {args.jobs}")
    for direction in ("forward", "backward", None):
        chosen = [r for r in rows if direction is None or r.direction == direction]
        counts = collections.Counter(r.status for r in chosen)
        print(f"{direction or 'both':>8}: pass rate {format_rate(pass_rate(counts))} of "
              f"{sum(counts[s] for s in COUNTED)} rows that ran; " + ", ".join(f"{s} {n}" for s, n in counts.items()))
    for status in ("mismatch", "unsupported", "crash", "unchecked", "skipped"):
        chosen = [r for r in rows if r.status == status]
        if chosen:
            print(f"\n{status} ({len(chosen)}):")
            for r in chosen:
                print(f"  {r.op} {r.dtype} {r.direction}: {r.detail[:160]}")
    print(f"\nreport: {os.path.join(folder, 'conformance.html')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
