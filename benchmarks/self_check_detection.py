"""How soon OpSelfCheck names a fault, and what it checks, at real size under its budget.

A transformers Llama (hidden 512, 4 layers, vocab 8192, batch 2x256, AdamW) trains on sim under
``OpSelfCheck(budget=...)`` with one of sim's faults on: for each fault, the step of the first finding (or "not in
N steps"), the op and module named, and per step the calls checked, left for the budget, and handled by the engine
(the others ran untouched while the budget was spent: a paused tool costs a call a comparison), and the cost; a
clean run first (its findings are false alarms). Faults: noise of 1e-2 in every matrix product, a bit flipped in
every 50th (forward or backward), noise in a tenth of them (intermittent), noise of 1e-2 in the MLPs' activation
(checked by a sample rerun on the host), in AdamW's update, in the reciprocal root of transformers' RMSNorm (its
module checked whole), and in one product alone (the last layer's ``down_proj``), from the start and from the
second step. ``--ranks 2``: DDP over two ranks under torchrun, a fault on rank 1 alone (in every product, in one
module's), each rank's first finding.

The cost: the median step under the tool over the median step without it, the same fault on (sim's injection costs
the same in both), the steps without it half before and half after the tool's; and its first step over the same
(every call site's first call is checked there, the later steps check what the budget allows). Every step runs,
found or not, so that the tool's steady state is timed.

    python benchmarks/self_check_detection.py [--steps 10] [--budget 0.02] [--size real|tiny] [--late-steps 60]
                                              [--faults 8] [--ranks 1|2]
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

import two_ranks  # noqa: E402
from training_monitor_cost import build_step  # noqa: E402

import op_tools  # noqa: E402

SIZES = {"real": (512, 1376, 4, 8, 8192, 2, 256), "tiny": (64, 176, 2, 4, 128, 2, 16)}
FAULTS = ("", "mm:noise=1e-2", "mm:bitflip=50", "mm:noise=1e-2,p=0.1", "silu:noise=1e-2",
          "_foreach_addcdiv_:noise=1e-2",  # AdamW's update of the weights
          "rsqrt:noise=1e-2",  # transformers' RMSNorm (arithmetic): its module's forward checked whole
          "mm@model.layers.3.mlp.down_proj:noise=1e-2")  # one product of 29: its site's first call checked
LATE = "mm@model.layers.3.mlp.down_proj:noise=1e-2"  # the same, from the second step: found when its site's turn comes


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


def late(size: str, fault: str, steps: int, budget: float) -> tuple[object, int]:
    """The first finding of ``fault`` switched on after the tool's first step, and the steps run (at most ``steps``):
    the fault waits for its site's turn (the first step's checks paid back by a pause, then a round over the
    sites)."""
    import ditorch.sim

    model, step = build_step("sim", *SIZES[size])
    step(None)
    with op_tools.OpSelfCheck(budget=budget) as check:
        step(None)
        with ditorch.sim.faults(fault):
            for taken in range(1, steps):
                step(None)
                if check.findings:
                    return check.findings[0], taken + 1
    return None, steps


def _timed(step, steps: int) -> list[float]:
    """The wall seconds of ``steps`` steps, each from the same heap (a collection inside one is noise)."""
    times = []
    for _ in range(steps):
        gc.collect()
        begun = time.perf_counter()
        step(None)
        times.append(time.perf_counter() - begun)
    return times


RANK_FAULTS = ("", "mm:noise=1e-2,rank=1", "mm@model.layers.3.mlp.down_proj:noise=1e-2,rank=1")


def rank_worker(args: argparse.Namespace) -> None:
    """One rank of a DDP run under torchrun (sim through ``DITORCH_BACKEND=sim``): for each of ``RANK_FAULTS``, the
    first finding on this rank in ``args.steps`` steps, written to ``<args.out>.<rank>``."""
    import json

    import torch
    import torch.distributed as dist

    import ditorch.sim

    rank, local_rank = two_ranks.join()
    logging.getLogger("op_tools").setLevel(logging.ERROR)
    def ddp(model):
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])

    _, step = build_step("cuda", *SIZES[args.size], wrap=ddp, seed=100 + rank)
    step(None)
    rows = []
    for fault in RANK_FAULTS:
        with ditorch.sim.faults(fault), op_tools.OpSelfCheck(budget=args.budget) as check:
            for _ in range(args.steps):  # every step on both ranks: DDP's collectives pair them
                step(None)
        first = check.findings[0] if check.findings else None
        rows.append({"fault": fault, "findings": len(check.findings), "steps": args.steps,
                     "first": None if first is None else [first.op, first.module, first.step, first.rank]})
    with open(f"{args.out}.{rank}", "w") as f:
        json.dump(rows, f)
    dist.destroy_process_group()


def by_rank(args: argparse.Namespace) -> None:
    """``RANK_FAULTS`` on a 2-rank DDP run, each rank's first finding."""
    import json
    import tempfile

    scratch = tempfile.mkdtemp(prefix="self_check_detection_")
    out = os.path.join(scratch, "rank")
    arguments = ["--size", args.size, "--steps", str(args.steps), "--budget", str(args.budget), "--out", out]
    if two_ranks.launch(__file__, arguments, {"OP_TOOLS_RESULTS_DIR": os.path.join(scratch, "results")}) != 0:
        sys.exit("self_check_detection: the ranks failed")
    ranks = []
    for rank in range(2):
        with open(f"{out}.{rank}") as f:
            ranks.append(json.load(f))
    print(f"OpSelfCheck(budget={args.budget}), DDP over 2 ranks on sim, a {args.size} Llama, {args.steps} steps: each "
          "rank's first finding")
    for rows in zip(*ranks):
        what = ["clean" if row["first"] is None else
                f"step {row['first'][2]}: {row['first'][0].rpartition('.')[2]} in {row['first'][1]}" for row in rows]
        print(f"{rows[0]['fault'] or '(clean)':<52}rank 0: {what[0]:<48}rank 1: {what[1]}")
        print(f"summary: self_check_detection: {args.size} 2 ranks {rows[0]['fault'] or '(clean)'}: rank 0 "
              f"{rows[0]['findings']} findings, rank 1 {rows[1]['findings']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--budget", type=float, default=0.02)
    parser.add_argument("--size", choices=sorted(SIZES), default="real")
    parser.add_argument("--late-steps", type=int, default=60, help="steps for the fault begun late (0: not run)")
    parser.add_argument("--faults", type=int, default=len(FAULTS),
                        help=f"the first N of the {len(FAULTS)} runs (the clean one first)")
    parser.add_argument("--ranks", type=int, choices=(1, 2), default=1, help="2: DDP over two ranks (torchrun)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        rank_worker(args)
        return
    if args.ranks == 2:
        by_rank(args)
        return
    import ditorch.sim

    ditorch.sim.register()
    logging.getLogger("op_tools").setLevel(logging.ERROR)  # the findings' own lines: printed below, once
    print(f"OpSelfCheck(budget={args.budget}) on a {args.size} Llama step on sim, at most {args.steps} steps")
    print(f"{'fault':<44}{'first finding':<64}{'checked/step':>13}{'budget/step':>13}{'handled/step':>13}"
          f"{'cost':>7}{'1st step':>9}")
    for fault in FAULTS[:args.faults]:
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
    if args.late_steps:
        found, taken = late(args.size, LATE, args.late_steps, args.budget)
        what = f"not in {taken} steps" if found is None else f"step {found.step}: in {found.module}"
        print(f"{'(the last, from step 1)':<44}{what}")


if __name__ == "__main__":
    main()
