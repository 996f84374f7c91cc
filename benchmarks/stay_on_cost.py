"""What the tools meant to stay on for a whole run cost a real-size training step: time, and what a real device
would charge the host per step (synchronisations, copies, kernels), counted on sim.

Conditions, each a round of ``--steps`` consecutive steps with the tool started before the round and stopped after,
after one step more that starts it cold:

    (a) no tool
    (b) TrainingMonitor(model=model)
    (c) OpOverflowCheck()
    (d) OpCapture(mode="stats"): the run recording
    (e) OpSelfCheck(): invariants on the device within its 2% budget (issue 38)

The step is a transformers Llama (hidden 512, intermediate 1376, 4 layers, 8 heads, vocab 8192; batch 2x256), forward,
backward, AdamW step, ``zero_grad()`` and ``loss.item()`` (one synchronisation of the step's own). After a warm-up round
each, ``--rounds`` rounds alternate, order rotated; the medians of the per-step wall time are printed against (a). These
tools stay on for a whole run, so the figure judged against their targets is the steady state: the first step after each
start (its caches filled, OpSelfCheck's sweep of every call site) is timed apart, its median printed as its own column,
and the counts are those of the steady steps. On sim the per-step counts come beside them
(``benchmarks/device_charges.py``): on a fast device a tool's synchronisations and copies, not its arithmetic, set its
cost, and sim's host memory cannot show that in time. On every device, one more round per condition counts the objects
promoted into the collector's oldest generation per step (``tests/gc_promotions.py``): each costs about four visits of a
full collection of the program's heap (averaged over rounds started at four points of the collector's cycle).

``--profile DIR``: one more round per condition under cProfile, with every thread's CPU time beside it
(``host_profile.py``: on a GPU, autograd's device thread runs the tools' backward hooks), written to
``DIR/stay_on_<device>_<condition>.txt``: where the host time of each tool's steps goes, from one command on a lent GPU.

    python benchmarks/stay_on_cost.py [--device sim|cpu|cuda] [--size real|tiny] [--rounds 3] [--steps 3]
        [--tools TrainingMonitor,OpOverflowCheck,OpCapture,OpSelfCheck] [--profile DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("DITORCH_QUIET", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.dirname(os.path.abspath(__file__))]

import device_charges  # noqa: E402
import gc_promotions  # noqa: E402
import host_profile  # noqa: E402
import torch  # noqa: E402
from training_monitor_cost import build_step  # noqa: E402

import op_tools  # noqa: E402

# --size: hidden, intermediate, layers, heads, vocab, batch, sequence length
SIZES = {"real": (512, 1376, 4, 8, 8192, 2, 256), "tiny": (64, 176, 2, 4, 128, 2, 16)}
TOOLS = {
    "TrainingMonitor": lambda model, results: op_tools.TrainingMonitor(model=model, results_dir=results),
    "OpOverflowCheck": lambda model, results: op_tools.OpOverflowCheck(results_dir=results),
    "OpCapture": lambda model, results: op_tools.OpCapture(mode="stats", results_dir=results),
    "OpSelfCheck": lambda model, results: op_tools.OpSelfCheck(results_dir=results),
}
TARGETS = {"TrainingMonitor": {"sim": 1.03, "cuda": 1.05}, "OpOverflowCheck": {"sim": 1.5, "cuda": 1.5},
           "OpCapture": {"sim": 1.5, "cuda": 1.5},  # issue 33, wall time against (a)
           "OpSelfCheck": {"sim": 1.05, "cuda": 1.02}}  # issue 38


def run_round(model, step, tool: str | None, steps: int, results: str,
              promoted: gc_promotions.Promotions | host_profile.HostProfile | None = None,
              cpu_calls: bool = False, phase: int = 0) -> tuple[float, list[float], dict | None]:
    """Wall seconds of the first step under ``tool`` (None: no tool) and of each of the ``steps`` steps after it, and
    their counts per step; the objects promoted over those ``steps`` counted into ``promoted`` (a counting round:
    its times are not used), or the steps profiled by it (a ``host_profile.HostProfile``). ``cpu_calls``: the tool
    handles the CPU's calls, which the tools leave alone by default (``--device cpu``: a tiny model's CPU kernels take
    microseconds, as a GPU's launches do, so each tool's host work per call shows on any machine, as in
    ``engine_cost.py``). ``phase``: allocations made first, which start the round at that point of the collector's
    cycle (``gc_promotions.PHASES``)."""
    gc.collect()
    gc.freeze()  # the survivors (imports, the model) are never scanned again: a collection costs the round's garbage
    shift = gc_promotions.phase_shift(phase)  # noqa: F841 - alive for the round
    monitor = None
    made = TOOLS[tool](model, results) if tool else None
    if made is not None and cpu_calls:
        made.handles_cpu_calls = True
    started = made.start() if made is not None else None
    if tool == "TrainingMonitor":
        monitor = started
    times = []
    try:
        begin = time.perf_counter()
        step(monitor)  # the tool's first step: its caches filled (OpSelfCheck: every call site checked once)
        first = time.perf_counter() - begin
        before = device_charges.counts()
        with promoted if promoted is not None else contextlib.nullcontext():
            for _ in range(steps):
                begin = time.perf_counter()
                step(monitor)
                times.append(time.perf_counter() - begin)
        after = device_charges.counts()
    finally:
        if started is not None:
            started.stop()
    return first, times, device_charges.per_step(before, after, steps)


def prepare(script: str, args: argparse.Namespace) -> tuple | None:
    """The model's sizes for ``args.size`` on ``args.device`` (sim registered, the tools' messages quietened), the
    conditions printed; None, said, where ``cuda`` is asked for and absent."""
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"{script}: no CUDA GPU here")
        return None
    if args.device == "sim":
        import ditorch.sim

        ditorch.sim.register()
    logging.getLogger("op_tools").setLevel(logging.WARNING)
    sizes = SIZES[args.size]
    print(f"torch {torch.__version__}, {args.device}, {os.cpu_count()} cpus, {torch.get_num_threads()} threads; "
          f"Llama hidden {sizes[0]}, {sizes[2]} layers, vocab {sizes[4]}, batch {sizes[5]}x{sizes[6]}, AdamW; "
          f"{args.rounds} alternating rounds of {args.steps} steps after a warm-up round each")
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="sim", help="sim (default), cpu or cuda")
    parser.add_argument("--size", choices=sorted(SIZES), default="real")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="training steps per round")
    parser.add_argument("--tools", default=",".join(TOOLS), help="comma-separated, of " + ", ".join(TOOLS))
    parser.add_argument("--profile", metavar="DIR", help="one more round per condition under cProfile, with every "
                        "thread's CPU time, written to DIR/stay_on_<device>_<condition>.txt")
    args = parser.parse_args()
    tools = [t for t in args.tools.split(",") if t]
    if unknown := set(tools) - set(TOOLS):
        parser.error(f"--tools: unknown {', '.join(sorted(unknown))}; expected {', '.join(TOOLS)}")
    sizes = prepare("stay_on_cost", args)
    if sizes is None:
        return
    results = tempfile.mkdtemp(prefix="stay_on_cost_")
    cpu_calls = args.device == "cpu"  # the CPU's calls are the ones to measure the tools on
    conditions: list[str | None] = [None, *tools]
    times: dict[str | None, list[float]] = {c: [] for c in conditions}
    firsts: dict[str | None, list[float]] = {c: [] for c in conditions}
    charged: dict[str | None, dict | None] = {}
    promotions: dict[str | None, float] = {}
    try:
        with contextlib.redirect_stdout(sys.stderr):
            model, step = build_step(args.device, *sizes)
            for condition in conditions:  # warm-up: AdamW's state, the allocator, the tools' first calls
                run_round(model, step, condition, 1, results, cpu_calls=cpu_calls)
            for r in range(args.rounds):
                for condition in conditions[r % len(conditions):] + conditions[:r % len(conditions)]:
                    first, round_times, charged[condition] = run_round(model, step, condition, args.steps, results,
                                                                       cpu_calls=cpu_calls)
                    times[condition].append(statistics.median(round_times))
                    firsts[condition].append(first)
            for condition in conditions:  # which objects a collection finds alive depends on where it falls: the
                counts = []  # count of one round moved by 40% from one phase of the collector's cycle to another
                for phase in gc_promotions.PHASES:
                    promoted = gc_promotions.Promotions()
                    run_round(model, step, condition, args.steps, results, promoted, cpu_calls, phase)
                    counts.append(promoted.count / args.steps)
                promotions[condition] = statistics.mean(counts)
            per_object = gc_promotions.full_collection_seconds_per_object()
            profiles = [profile(model, step, condition, args, results, cpu_calls) for condition in conditions] \
                if args.profile else []
    finally:
        shutil.rmtree(results, ignore_errors=True)
    plain, plain_first = statistics.median(times[None]), statistics.median(firsts[None])
    print(f"{'condition':<22}{'ms/step':>10}{'x (a)':>8}{'first x':>9}{device_charges.header()}{'promoted':>10}"
          f"{'GC ms':>8}")
    for condition in conditions:
        ms = statistics.median(times[condition])
        counted = device_charges.cells(charged[condition]) + \
            f"{promotions[condition]:>10,.0f}{promotions[condition] * 4 * per_object * 1e3:>8.1f}"
        print(f"{condition or 'no tool':<22}{ms * 1e3:>10.1f}{ms / plain:>8.2f}"
              f"{statistics.median(firsts[condition]) / plain_first:>9.2f}{counted}")
    for tool in tools:
        ratio = statistics.median(times[tool]) / plain
        target = TARGETS[tool].get(args.device)
        verdict = f" (target <= {target}: {'met' if ratio <= target else 'NOT met'})" if target else ""
        counted = device_charges.summary(charged[tool])
        first = statistics.median(firsts[tool]) / plain_first
        print(f"summary: stay_on_cost: {args.device}: {tool} {ratio:.2f}x the step{verdict}, {first:.2f}x the "
              f"first step after a start"
              + (f"; {counted}" if counted else "") + f"; {promotions[tool]:,.0f} objects promoted per step "
              f"(full collections of this process's heap: ~{promotions[tool] * 4 * per_object * 1e3:.1f} ms a step)")
    if profiles:
        print(f"summary: stay_on_cost: {args.device}: where the host time goes (cProfile, every thread's CPU time): "
              + ", ".join(profiles))


def profile(model, step, condition: str | None, args: argparse.Namespace, results: str, cpu_calls: bool) -> str:
    """One round of ``condition`` profiled (``host_profile``), its report written under ``args.profile``; the path."""
    profiled = host_profile.HostProfile()
    run_round(model, step, condition, args.steps, results, profiled, cpu_calls)  # the steady steps profiled
    os.makedirs(args.profile, exist_ok=True)
    path = os.path.join(args.profile, f"stay_on_{args.device}_{condition or 'no_tool'}.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"stay_on_cost.py --device {args.device} --size {args.size}: {condition or 'no tool'}, {args.steps} "
                f"steps after its first, torch {torch.__version__}\n" + profiled.report())
    return path


if __name__ == "__main__":
    main()
