"""What the shared engine alone costs per handled call: a tool that handles every call and does nothing with it.

Every tool pays this before its own work; on a fast device, where a step's kernels take a few µs each, it sets the
floor of every tool (on an H200 the engine alone was 2.04x a real-size Llama step, issue 33). Conditions, each a
round of ``--steps`` steps with the tool started before the round and stopped after:

    (a) no tool
    (b) a bare pass-through ``TorchFunctionMode``: what torch charges any tool built on a function mode
    (c) the engine, forward: a tool whose ``after`` returns at once (no backward hooks)
    (d) the engine, forward and backward: the same with an ``after_backward`` that returns at once (a backward
        hook on every output's autograd node, as OpAutoCompare, OpOverflowCheck and the recording have)
    (e) the bare mode of (b) putting a no-op Python post-hook on every output's node: PyTorch's own price of the
        hooks (d) registers and runs, the rest of (d) over (c) being op_tools' own

``--autograd-threads off`` runs every round with ``torch.autograd.set_multithreading_enabled(False)``: backward on
the calling thread, not on autograd's thread per device (on a GPU: whether handing the hooks to that thread costs).

The step is ``stay_on_cost.py``'s (a transformers Llama, forward, backward, AdamW, ``loss.item()``). On the CPU the
tool handles CPU calls too (the tools leave them alone by default): a tiny model's CPU kernels take microseconds, as a
GPU's launches do, so ``--device cpu --size tiny`` shows the engine's host cost on any machine. Prints the medians
per step and the microseconds per handled call of (b), (c) and (d): their time over (a)'s, over the calls (c) handles
per step (the others are metadata queries and calls it skips, part of its cost).

    python benchmarks/engine_cost.py [--device cpu|sim|cuda] [--size tiny|real] [--rounds 5] [--steps 5]
        [--autograd-threads on|off]
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
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.dirname(os.path.abspath(__file__))]

import torch  # noqa: E402
from stay_on_cost import SIZES, prepare  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from training_monitor_cost import build_step  # noqa: E402

from op_tools.core.engine import OpCall, OpTool  # noqa: E402


class OpEngineForward(OpTool):
    """Handles every call, CPU ones too, and does nothing with it."""

    hook_name = "OpEngineForwardHook"

    def configure(self) -> None:
        self.handles_cpu_calls = True

    def after(self, call: OpCall) -> None:
        return None


class OpEngineBackward(OpEngineForward):
    """The same, with a backward hook on every output's node that does nothing."""

    hook_name = "OpEngineBackwardHook"

    def after_backward(self, call: OpCall, grad_inputs: tuple, grad_outputs: tuple) -> None:
        return None


class PassThrough(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _no_op_hook(*grads) -> None:
    return None


class NodeHooks(TorchFunctionMode):
    """A bare mode that hooks each output's node with a Python function doing nothing."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.grad_fn is not None:
            out.grad_fn.register_hook(_no_op_hook)
        return out


CONDITIONS = {"no tool": None, "bare TorchFunctionMode": PassThrough, "engine, forward": OpEngineForward,
              "engine, forward+backward": OpEngineBackward, "bare mode + node hooks": NodeHooks}
_MODES = (PassThrough, NodeHooks)


def run_round(step, tool: type | None, steps: int, results: str) -> tuple[float, float]:
    """The median wall seconds per step over ``steps`` steps under ``tool``, and the calls it handled per step."""
    gc.collect()
    gc.freeze()  # the survivors (imports, the model) are never scanned again: a collection costs the round's garbage
    if tool in _MODES:
        with tool():
            return run_round(step, None, steps, results)[0], 0.0
    started = tool(results_dir=results).start() if tool else None
    times = []
    try:
        for _ in range(steps):
            begin = time.perf_counter()
            step(None)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times.append(time.perf_counter() - begin)
    finally:
        if started is not None:
            started.stop()
    return statistics.median(times), (sum(started.handled.values()) / steps if started is not None else 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu (default), sim or cuda")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="training steps per round")
    parser.add_argument("--autograd-threads", choices=("on", "off"), default="on",
                        help="off: backward on the calling thread (torch.autograd.set_multithreading_enabled)")
    args = parser.parse_args()
    threads = contextlib.nullcontext() if args.autograd_threads == "on" else \
        torch.autograd.set_multithreading_enabled(False)
    sizes = prepare("engine_cost", args)
    if sizes is None:
        return
    results = tempfile.mkdtemp(prefix="engine_cost_")
    times: dict[str, list[float]] = {c: [] for c in CONDITIONS}
    handled: dict[str, float] = {}
    names = list(CONDITIONS)
    try:
        with contextlib.redirect_stdout(sys.stderr), threads:
            _, step = build_step(args.device, *sizes)
            for name in names:  # warm-up: AdamW's state, the allocator, the first calls' decisions
                run_round(step, CONDITIONS[name], 1, results)
            for r in range(args.rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    seconds, handled[name] = run_round(step, CONDITIONS[name], args.steps, results)
                    times[name].append(seconds)
    finally:
        shutil.rmtree(results, ignore_errors=True)
    plain = statistics.median(times["no tool"])
    calls = handled["engine, forward"]
    print(f"{'condition':<28}{'ms/step':>10}{'x (a)':>8}{'µs/call':>10}   ({calls:.0f} handled calls a step)")
    for name in names:
        ms = statistics.median(times[name])
        print(f"{name:<28}{ms * 1e3:>10.2f}{ms / plain:>8.2f}{(ms - plain) / calls * 1e6:>10.1f}")
    threads_said = "" if args.autograd_threads == "on" else " (autograd threads off)"
    for name in names[1:]:
        ms = statistics.median(times[name])
        print(f"summary: engine_cost: {args.device} {args.size}{threads_said}: {name} {ms / plain:.2f}x the step, "
              f"{(ms - plain) / calls * 1e6:.1f} µs per handled call ({calls:.0f} a step)")


if __name__ == "__main__":
    main()
