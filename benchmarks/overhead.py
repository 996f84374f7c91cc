"""What op_tools cost on a tiny-Llama training step on the sim device, measured side by side.

Conditions, each timed over ``--steps`` training steps (forward, backward, AdamW step) per round:

(a) no tool;
(b) a bare pass-through ``TorchFunctionMode`` (the floor of any tool built on a function mode);
(c) each tool active with its ``OP_<TOOL>_LIST`` naming an op the step never calls: the cost of deciding to
    skip every op (target: at most 1.10x (a)). A list of plain names wraps the named functions (targeted
    dispatch, ``op_tools/core/targeting.py``), so the decision is made once at ``start()``;
(c') the same list written as a regular expression: the tool pushes a function mode and decides per call;
(d) each tool doing its work on every op (``OP_TOOLS_VERBOSE=0``: files are written, per-call
    tables are not printed);
(e) a tool started and stopped around every step, its LIST naming an op no torch function has
    (``torch.nn.functional.sliu``, a typo): what a start costs per step (target: at most 1.05x (a)).

Phase 1 alternates (a), (b), every (c) and every (c') in each round; phase 2 alternates (a) and every (d)
(fewer rounds: some tools cost several times the step); phase 3 alternates (a) and every (e). Each phase prints
the medians of wall time and process CPU time per step and their ratio to the (a) of the same phase.

    python benchmarks/overhead.py [--rounds 15] [--work-rounds 3] [--steps 3]
    python benchmarks/overhead.py --per-step-only --steps 10    # (e) alone

On a GPU, the launch-bound step (Llama hidden 256, 4 layers, batch 8x128: the host's launches, not the kernels,
set its pace, so a tool's per-call host work and synchronisations show in full), phase 2 only, with the targets
(OpTimeMeasure <= 1.5x, OpOverflowCheck <= 3x) in its summary lines; without a CUDA GPU it says so and exits 0:

    python benchmarks/overhead.py --device cuda --size launch-bound --work-only [--autocast bf16]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
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
from tiny_models import tiny_llama  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

import op_tools  # noqa: E402

TOOLS = {
    "OpCapture": ("OP_CAPTURE", op_tools.OpCapture),
    "OpObserve": ("OP_OBSERVE", op_tools.OpObserve),
    "OpOverflowCheck": ("OP_OVERFLOW_CHECK", op_tools.OpOverflowCheck),
    "OpTimeMeasure": ("OP_TIME_MEASURE", op_tools.OpTimeMeasure),
    "OpAutoCompare": ("OP_AUTOCOMPARE", op_tools.OpAutoCompare),
    "OpFallback": ("OP_FALLBACK", op_tools.OpFallback),
    "OpDtypeCast": ("OP_DTYPE_CAST", op_tools.OpDtypeCast),
}
UNUSED_OP = "torch.nn.functional.conv2d"  # a real function a Llama step never calls
UNUSED_PATTERN = r"torch\.nn\.functional\.conv2d"
UNKNOWN_OP = "torch.nn.functional.sliu"  # a typo: no torch function has this name
PER_STEP_TOOLS = ("OpObserve", "OpAutoCompare")  # (e): tools a user starts around a step
PER_STEP_TARGET = 1.05
# --size: hidden, layers, batch, sequence length
SIZES = {"tiny": (64, 2, 2, 16), "launch-bound": (256, 4, 8, 128)}
TARGETS = {"OpTimeMeasure": 1.5, "OpOverflowCheck": 3.0}  # on the launch-bound GPU step, x (a) in wall time


class PassThrough(TorchFunctionMode):
    """(b): a function mode that only calls the function."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class CountCalls(PassThrough):
    """How many calls a function mode sees per step: turns a step's overhead into a cost per call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def make_step(device: str, hidden: int = 64, seq: int = 16, layers: int = 2, batch: int = 2,
              autocast: torch.dtype | None = None):
    """A Llama training step (forward, backward, AdamW step, ``loss.item()``) on ``device``, built once."""
    torch.manual_seed(0)
    model = tiny_llama(hidden=hidden, layers=layers).to(device)
    ids = torch.randint(0, 128, (batch, seq)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    device_type = torch.device(device).type

    def step() -> None:
        with torch.autocast(device_type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        loss.item()

    return step


def context_for(condition: str):
    """The context manager that sets up ``condition``: 'none', 'bare', 'skip:<Tool>', 'mode:<Tool>', 'work:<Tool>' or
    'perstep:<Tool>' (one of them per step)."""
    if condition == "none":
        return contextlib.nullcontext()
    if condition == "bare":
        return PassThrough()
    kind, tool = condition.split(":")
    prefix, cls = TOOLS[tool]
    for other, _ in TOOLS.values():
        os.environ.pop(f"{other}_LIST", None)
    if kind in ("skip", "mode", "perstep"):
        os.environ[f"{prefix}_LIST"] = {"skip": UNUSED_OP, "mode": UNUSED_PATTERN, "perstep": UNKNOWN_OP}[kind]
    return cls()


def run_round(step, steps: int, condition: str) -> tuple[float, float]:
    if condition.startswith("perstep:"):
        return _run_round_started_per_step(step, steps, condition)
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        context = context_for(condition)
        gc.collect()  # every condition starts from the same heap: a collection in a timed round is noise
        gc.freeze()  # survivors (imports, the model) are never scanned again: a collection costs the round's garbage
        with context:
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(steps):
                step()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return wall / steps, cpu / steps


def _run_round_started_per_step(step, steps: int, condition: str) -> tuple[float, float]:
    """(e): a new tool started and stopped around each step, as a training loop that checks every step does."""
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        gc.collect()
        gc.freeze()  # survivors (imports, the model) are never scanned again: a collection costs the round's garbage
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            with context_for(condition):
                step()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return wall / steps, cpu / steps


def measure(step, conditions: list[str], rounds: int, steps: int) -> dict[str, tuple[float, float]]:
    for condition in conditions:  # warm-up: first-call costs (name resolution, announcements, allocations)
        run_round(step, 1, condition)
    samples: dict[str, list[tuple[float, float]]] = {c: [] for c in conditions}
    for _ in range(rounds):
        for condition in conditions:
            samples[condition].append(run_round(step, steps, condition))
    return {c: (statistics.median(w for w, _ in s), statistics.median(p for _, p in s)) for c, s in samples.items()}


def report(title: str, medians: dict[str, tuple[float, float]], labels: dict[str, str], calls: int) -> None:
    base_wall, base_cpu = medians["none"]
    print(f"\n{title}")
    print(f"{'condition':<40}{'wall ms/step':>13}{'x (a)':>7}{'cpu ms/step':>12}{'x (a)':>7}{'cpu us/call':>12}")
    for condition, (wall, cpu) in medians.items():
        print(f"{labels.get(condition, condition):<40}{wall * 1e3:>13.1f}{wall / base_wall:>7.2f}"
              f"{cpu * 1e3:>12.1f}{cpu / base_cpu:>7.2f}{(cpu - base_cpu) / calls * 1e6:>12.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="alternating rounds of phase 1 (a, b, c)")
    parser.add_argument("--work-rounds", type=int, default=3, help="alternating rounds of phase 2 (a, d)")
    parser.add_argument("--steps", type=int, default=3, help="training steps per round")
    parser.add_argument("--tools", default=",".join(TOOLS), help="comma-separated subset of " + ", ".join(TOOLS))
    parser.add_argument("--skip-only", action="store_true", help="phase 1 only")
    parser.add_argument("--work-only", action="store_true", help="phase 2 only")
    parser.add_argument("--per-step-only", action="store_true", help="phase 3 only")
    parser.add_argument("--device", default="sim", help="sim (default) or cuda")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny",
                        help="tiny: hidden 64, 2 layers, batch 2x16; launch-bound: hidden 256, 4 layers, batch 8x128")
    parser.add_argument("--hidden", type=int, help="hidden size of the Llama (default: the --size's)")
    parser.add_argument("--seq", type=int, help="sequence length of the batch (default: the --size's)")
    parser.add_argument("--autocast", choices=["bf16", "fp16"], help="run the step under torch.autocast")
    args = parser.parse_args()
    tools = [t for t in args.tools.split(",") if t]
    hidden, layers, batch, seq = SIZES[args.size]
    hidden, seq = args.hidden or hidden, args.seq or seq
    if args.device == "sim":
        import ditorch.sim

        ditorch.sim.register()
    elif torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print(f"op_tools overhead on {args.device}: skipped: no CUDA GPU (torch.cuda.is_available() is False)")
        return
    results = tempfile.mkdtemp(prefix="op_tools_overhead_")
    os.environ["OP_TOOLS_RESULTS_DIR"] = results
    os.environ["OP_TOOLS_VERBOSE"] = "0"
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.autocast)
    step = make_step(args.device, hidden, seq, layers, batch, autocast)
    step()
    with CountCalls() as counter:
        step()
    device = torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else f"{args.device} device"
    what = (f"Llama step (hidden {hidden}, {layers} layers, batch {batch}x{seq}, AdamW"
            f"{', autocast ' + args.autocast if autocast else ''})")
    print(f"torch {torch.__version__}, {device}, {os.cpu_count()} cpus, {what}: {counter.calls} torch calls per "
          f"step, {args.steps} steps per round\n<name>: {UNUSED_OP} (the step never calls it); <pattern>: "
          f"{UNUSED_PATTERN}")
    labels = {"none": "(a) no tool", "bare": "(b) bare TorchFunctionMode"}
    labels.update({f"skip:{t}": f"(c) {t}, LIST=<name>" for t in tools})
    labels.update({f"mode:{t}": f"(c') {t}, LIST=<pattern>" for t in tools})
    labels.update({f"work:{t}": f"(d) {t}, every op" for t in tools})
    labels.update({f"perstep:{t}": f"(e) {t} per step, LIST=<typo>" for t in PER_STEP_TOOLS})
    per_step = [t for t in PER_STEP_TOOLS if t in tools]
    only = {p for p, chosen in (("skip", args.skip_only), ("work", args.work_only), ("per-step", args.per_step_only))
            if chosen}
    runs = lambda phase: not only or phase in only  # noqa: E731
    try:
        if runs("skip"):
            skip = measure(step, ["none", "bare", *(f"skip:{t}" for t in tools), *(f"mode:{t}" for t in tools)],
                           args.rounds, args.steps)
            report(f"phase 1: median of {args.rounds} alternating rounds (target for (c): x (a) <= 1.10)", skip,
                   labels, counter.calls)
        if runs("work"):
            work = measure(step, ["none", *(f"work:{t}" for t in tools)], args.work_rounds, args.steps)
            report(f"phase 2: median of {args.work_rounds} alternating rounds, OP_TOOLS_VERBOSE=0", work, labels,
                   counter.calls)
            targets = TARGETS if args.device.startswith("cuda") and args.size == "launch-bound" else {}
            print_summary(work, f"{args.device} {args.size}{' ' + args.autocast if autocast else ''}", targets)
        if runs("per-step") and per_step:
            started = measure(step, ["none", *(f"perstep:{t}" for t in per_step)], args.rounds, args.steps)
            report(f"phase 3: median of {args.rounds} alternating rounds, a tool started per step with "
                   f"LIST={UNKNOWN_OP} (target for (e): x (a) <= {PER_STEP_TARGET})", started, labels, counter.calls)
            print_summary(started, f"{args.device} {args.size} started per step",
                          {t: PER_STEP_TARGET for t in per_step})
    finally:
        shutil.rmtree(results, ignore_errors=True)


def print_summary(work: dict[str, tuple[float, float]], setting: str, targets: dict[str, float]) -> None:
    """One ``summary:`` line per tool (collected by scripts/gpu_check.sh): its wall-time ratio, and its target."""
    base_wall = work["none"][0]
    for condition, (wall, _) in work.items():
        if condition == "none":
            continue
        tool = condition.split(":")[1]
        ratio = wall / base_wall
        target = targets.get(tool)
        verdict = f" (target <= {target}: {'met' if ratio <= target else 'NOT met'})" if target else ""
        print(f"summary: overhead {setting}: {tool} {ratio:.2f}x the step without it{verdict}")


if __name__ == "__main__":
    main()
