"""How soon OpSelfCheck names a fault, and what it checks, at real size under its budget.

A transformers Llama (hidden 512, 4 layers, vocab 8192, batch 2x256, AdamW) trains on sim under
``OpSelfCheck(budget=...)`` with one of sim's faults on: for each fault, the step of the first finding (or "not in
N steps"), the op and module named, and per step the calls checked, left for the budget, and handled by the engine
(the others ran untouched while the budget was spent: a paused tool costs a call a comparison); a clean run first (its
findings are false alarms). Faults: noise of 1e-2 in every matrix product, a bit flipped in every 50th (forward or
backward), noise in a tenth of them (intermittent), noise of 1e-2 in the MLPs' activation (checked by a sample
rerun on the host), in AdamW's update, and in one product alone (the last layer's ``down_proj``).

    python benchmarks/self_check_detection.py [--steps 10] [--budget 0.02] [--size real|tiny]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

os.environ.setdefault("DITORCH_QUIET", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.dirname(os.path.abspath(__file__))]

from training_monitor_cost import build_step  # noqa: E402

import op_tools  # noqa: E402

SIZES = {"real": (512, 1376, 4, 8, 8192, 2, 256), "tiny": (64, 176, 2, 4, 128, 2, 16)}
FAULTS = ("", "mm:noise=1e-2", "mm:bitflip=50", "mm:noise=1e-2,p=0.1", "silu:noise=1e-2",
          "_foreach_addcdiv_:noise=1e-2",  # AdamW's update of the weights
          "mm@model.layers.3.mlp.down_proj:noise=1e-2")  # one product of 29: found when its site's turn comes


def detect(size: str, fault: str, steps: int, budget: float) -> dict:
    import ditorch.sim

    model, step = build_step("sim", *SIZES[size])
    with ditorch.sim.faults(fault), op_tools.OpSelfCheck(budget=budget) as check:
        for _ in range(steps):
            step(None)
            if fault and check.findings:
                break
    findings = check.findings
    done = findings[0].step + 1 if findings else steps
    return {"fault": fault or "(clean)", "found": findings[0] if findings else None, "findings": len(findings),
            "checked": check.counts["checked"] / done,
            "budget_skipped": (check.counts["not checked (budget)"] + check.paused_calls) / done,
            "handled": sum(check.handled.values()) / done}


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
    print(f"{'fault':<30}{'first finding':<64}{'checked/step':>13}{'budget/step':>13}{'handled/step':>13}")
    for fault in FAULTS:
        row = detect(args.size, fault, args.steps, args.budget)
        found = row["found"]
        if not fault:
            what = f"{row['findings']} findings (false alarms)"
        elif found is None:
            what = f"not in {args.steps} steps"
        else:
            what = f"step {found.step}: {found.op.rpartition('.')[2]} ({found.phase}) in {found.module or '-'}"
        print(f"{row['fault']:<30}{what:<64}{row['checked']:>13.1f}{row['budget_skipped']:>13.1f}"
              f"{row['handled']:>13.1f}")
        summary = "clean" if not fault else ("not found" if found is None else f"found at step {found.step}")
        print(f"summary: self_check_detection: {args.size} {row['fault']}: {summary}")


if __name__ == "__main__":
    main()
