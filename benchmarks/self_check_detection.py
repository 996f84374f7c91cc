"""How soon OpSelfCheck names a fault, and what it checks, at real size under its budget.

A transformers Llama (hidden 512, 4 layers, vocab 8192, batch 2x256, AdamW) trains on sim under
``OpSelfCheck(budget=...)`` with one of sim's faults on: for each fault, the step of the first finding (or "not in
N steps"), the op and module named, and per step the calls checked, left for the budget, and handled by the engine
(the others ran untouched while the budget was spent: a paused tool costs a call a comparison), and the cost; a
clean run first (its findings are false alarms). Faults: noise of 1e-2 in every matrix product, a bit flipped in
every 50th (forward or backward), noise in a tenth of them (intermittent), noise of 1e-2 in the MLPs' activation
(checked by a sample rerun on the host), in AdamW's update, in the reciprocal root of transformers' RMSNorm (its
module checked whole), and in one product alone (the last layer's ``down_proj``).

The cost: the median step under the tool over the median step without it, the same fault on (sim's injection costs
the same in both), the steps without it half before and half after the tool's; and its first step over the same
(every call site's first call is checked there, the later steps check what the budget allows). Every step runs,
found or not, so that the tool's steady state is timed.

    python benchmarks/self_check_detection.py [--steps 10] [--budget 0.02] [--size real|tiny]
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import statistics
import sys
import time

os.environ.setdefault("DITORCH_QUIET", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.dirname(os.path.abspath(__file__))]

from training_monitor_cost import build_step  # noqa: E402

import op_tools  # noqa: E402

SIZES = {"real": (512, 1376, 4, 8, 8192, 2, 256), "tiny": (64, 176, 2, 4, 128, 2, 16)}
FAULTS = ("", "mm:noise=1e-2", "mm:bitflip=50", "mm:noise=1e-2,p=0.1", "silu:noise=1e-2",
          "_foreach_addcdiv_:noise=1e-2",  # AdamW's update of the weights
          "rsqrt:noise=1e-2",  # transformers' RMSNorm (arithmetic): its module's forward checked whole
          "mm@model.layers.3.mlp.down_proj:noise=1e-2")  # one product of 29: found when its site's turn comes


def detect(size: str, fault: str, steps: int, budget: float) -> dict:
    import ditorch.sim

    model, step = build_step("sim", *SIZES[size])
    with ditorch.sim.faults(fault):
        step(None)  # warm: the first step's allocations and caches in neither figure
        plain = _timed(step, steps // 2)
        with op_tools.OpSelfCheck(budget=budget) as check:
            checked = _timed(step, steps)
        plain += _timed(step, steps - steps // 2)  # around the tool's steps: a drift of the machine in both
    findings = check.findings
    return {"fault": fault or "(clean)", "found": findings[0] if findings else None, "findings": len(findings),
            "checked": check.counts["checked"] / steps,
            "budget_skipped": (check.counts["not checked (budget)"] + check.paused_calls) / steps,
            "handled": sum(check.handled.values()) / steps,
            "cost": statistics.median(checked) / statistics.median(plain),
            "first": checked[0] / statistics.median(plain)}


def _timed(step, steps: int) -> list[float]:
    """The wall seconds of ``steps`` steps, each from the same heap (a collection inside one is noise)."""
    times = []
    for _ in range(steps):
        gc.collect()
        begun = time.perf_counter()
        step(None)
        times.append(time.perf_counter() - begun)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--budget", type=float, default=0.02)
    parser.add_argument("--size", choices=sorted(SIZES), default="real")
    args = parser.parse_args()
    import ditorch.sim

    ditorch.sim.register()
    logging.getLogger("op_tools").setLevel(logging.ERROR)  # the findings' own lines: printed below, once
    print(f"OpSelfCheck(budget={args.budget}) on a {args.size} Llama step on sim, at most {args.steps} steps")
    print(f"{'fault':<44}{'first finding':<64}{'checked/step':>13}{'budget/step':>13}{'handled/step':>13}"
          f"{'cost':>7}{'1st step':>9}")
    for fault in FAULTS:
        row = detect(args.size, fault, args.steps, args.budget)
        found = row["found"]
        if not fault:
            what = f"{row['findings']} findings (false alarms)"
        elif found is None:
            what = f"not in {args.steps} steps"
        else:
            op = ".".join(found.op.split(".")[-2 if found.op.endswith(".forward") else -1:])  # a module's: its class
            what = f"step {found.step}: {op} ({found.phase}) in {found.module or '-'}"
        print(f"{row['fault']:<44}{what:<64}{row['checked']:>13.1f}{row['budget_skipped']:>13.1f}"
              f"{row['handled']:>13.1f}{row['cost']:>6.2f}x{row['first']:>8.2f}x")
        summary = "clean" if not fault else ("not found" if found is None else f"found at step {found.step}")
        print(f"summary: self_check_detection: {args.size} {row['fault']}: {summary}")


if __name__ == "__main__":
    main()
