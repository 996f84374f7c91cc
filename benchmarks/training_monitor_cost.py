"""What op_tools.TrainingMonitor costs a real-size transformers Llama training step, on the CPU and on the sim device.

A training step is forward, backward, ``monitor.log_loss(loss)`` when a monitor runs (the loop
docs/tools/training_monitor.md shows), AdamW's ``optimizer.step()``, ``zero_grad()`` and ``loss.item()``. Three
conditions, in one process:

    (a) no monitor
    (b) TrainingMonitor(model=model): the default selection, every step monitored (target: at most 1.10x (a))
    (c) TrainingMonitor(model=model, every=10): one step in ten monitored

A round is ``--steps`` consecutive steps of one condition: the monitor counts its steps from ``start()``, so it is
started before a round and stopped after it, outside the timed steps (its start and stop, which open and close its
files, are timed apart). With the default 10 steps a round of (c) holds exactly one monitored step. After one
warm-up round per condition, ``--rounds`` rounds of each condition alternate, their order rotated each round (a
condition is not always the one after a stop). Each step is timed alone (wall and process CPU time).

Printed per condition, each against (a): "step", the cost of a step in a long run: the median step of each kind
(plain, monitored, and the monitored steps that also read weights, updates and moments: every ``state_every``-th)
weighted by the kind's share of a long run's steps (``per_step``), which a busy machine's slow moments move less
than a mean; its CPU time, the same way; the median monitored step; the median over rounds of a round's mean step,
and how far the rounds' means spread ((max - min) / median); the monitor's start+stop. The ``summary:`` lines give
"step" against (a).

Sizes: ``real`` (a transformers LlamaForCausalLM of hidden 512, intermediate 1376, 4 layers, 8 heads, vocab 32000;
batch 2x128; about 0.5 s a step on 2 CPU cores) and ``tiny`` (hidden 64, 2 layers, vocab 128; batch 2x16).

    python benchmarks/training_monitor_cost.py [--size real|tiny] [--rounds 5] [--steps 10] [--devices cpu,sim,cuda]
    python benchmarks/training_monitor_cost.py --vocab 8192 --layers 2 --seq 64    # a smaller real-shaped step
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
from typing import Any

os.environ.setdefault("DITORCH_QUIET", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import torch  # noqa: E402

import op_tools  # noqa: E402

# --size: hidden, intermediate, layers, heads, vocab, batch, sequence length
SIZES = {"real": (512, 1376, 4, 8, 32000, 2, 128), "tiny": (64, 176, 2, 4, 128, 2, 16)}
# condition -> (label, TrainingMonitor keywords; None: no monitor)
CONDITIONS: dict[str, tuple[str, dict[str, Any] | None]] = {
    "none": ("(a) no monitor", None),
    "default": ("(b) TrainingMonitor(model=model)", {}),
    "every10": ("(c) TrainingMonitor(model=model, every=10)", {"every": 10}),
}
TARGETS = {"cpu": 1.10, "sim": 1.10, "cuda": 1.05}  # (b) against (a), wall time per step (issue 27)
STATE_EVERY = op_tools.TrainingMonitorConfig.resolve().state_every  # what the monitors here use


def build_step(device: str, hidden: int, intermediate: int, layers: int, heads: int, vocab: int, batch: int,
               seq: int, wrap=None, seed: int | None = None):
    """The model and a training step on ``device``, built once; ``step(monitor)`` logs the loss to ``monitor``.
    ``wrap``: a function of the model returning the module to train (DDP's); ``seed``: the batch's own (a rank's)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=seq)
    model: torch.nn.Module = LlamaForCausalLM(config)
    model.to(device)
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=generator).to(device)
    if wrap is not None:
        model = wrap(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(monitor: op_tools.TrainingMonitor | None) -> None:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if monitor is not None:
            monitor.log_loss(loss)
        optimizer.step()
        optimizer.zero_grad()
        loss.item()

    return model, step


def run_round(model, step, condition: str, steps: int, results_dir: str) -> tuple[list[tuple], float]:
    """``steps`` steps under ``condition``: (wall seconds, CPU seconds, monitored) per step, and the monitor's
    start+stop seconds."""
    keywords = CONDITIONS[condition][1]
    gc.collect()  # every round starts from the same heap: a collection inside a timed step is noise
    gc.freeze()  # the survivors (imports, the model) are never scanned again: a collection costs the round's garbage
    begin = time.perf_counter()
    monitor = None if keywords is None else op_tools.TrainingMonitor(model=model, results_dir=results_dir,
                                                                     **keywords).start()
    start_stop = time.perf_counter() - begin
    samples = []
    try:
        for k in range(steps):
            wall, cpu = time.perf_counter(), time.process_time()
            step(monitor)
            samples.append((time.perf_counter() - wall, time.process_time() - cpu, kind_of(monitor, k)))
    finally:
        begin = time.perf_counter()
        if monitor is not None:
            monitor.stop()
        start_stop += time.perf_counter() - begin
    return samples, start_stop


def kind_of(monitor: op_tools.TrainingMonitor | None, k: int) -> str:
    """What the monitor does at its step ``k``: nothing ("plain"), gradients, the loss and the layers ("monitored"),
    or those and the weights, updates and moments too ("state": every ``state_every``-th monitored step)."""
    if monitor is None or k % monitor.every:
        return "plain"
    return "state" if (k // monitor.every) % monitor.state_every == 0 else "monitored"


def shares(keywords: dict | None) -> dict[str, float]:
    """The share of each kind of step in a long run under ``keywords``."""
    if keywords is None:
        return {"plain": 1.0}
    every = keywords.get("every", 1)
    state = 1 / (every * keywords.get("state_every", STATE_EVERY))
    return {"plain": 1 - 1 / every, "monitored": 1 / every - state, "state": state}


def per_step(samples: list[tuple], column: int, keywords: dict | None) -> float:
    """The cost of a step in a long run, robust to a busy machine's slow moments: the median step of each kind,
    weighted by the kind's share of a long run's steps (default: 0.9 monitored, 0.1 state; every=10: 0.9 plain, 0.09
    monitored, 0.01 state). A round restarts the monitor, so a kind a round never meets (every=10's monitored steps
    that are not state steps) is counted at the costliest kind it does meet: an upper bound."""
    medians = {kind: statistics.median(v) for kind in ("plain", "monitored", "state")
               if (v := [s[column] for s in samples if s[2] == kind])}
    costliest = max(medians.values())
    return sum(share * medians.get(kind, costliest) for kind, share in shares(keywords).items())


def measure(device: str, sizes: tuple, rounds: int, steps: int, results_dir: str) -> dict[str, dict[str, float]]:
    """Every condition's figures on ``device`` (seconds): the step (``per_step``), its CPU time, the median monitored
    step, the median round mean, the rounds' spread and the monitor's start+stop."""
    model, step = build_step(device, *sizes)
    order = list(CONDITIONS)
    for condition in order:  # warm-up: AdamW's state, the allocator, first calls, the monitor's first files
        run_round(model, step, condition, steps, results_dir)
    samples: dict[str, list[tuple]] = {c: [] for c in order}
    means: dict[str, list[float]] = {c: [] for c in order}
    start_stops: dict[str, list[float]] = {c: [] for c in order}
    for r in range(rounds):
        for condition in order[r % len(order):] + order[:r % len(order)]:
            round_samples, start_stop = run_round(model, step, condition, steps, results_dir)
            samples[condition] += round_samples
            means[condition].append(statistics.fmean(s[0] for s in round_samples))
            start_stops[condition].append(start_stop)
    figures = {}
    for c in order:
        monitored = [s[0] for s in samples[c] if s[2] != "plain"]
        keywords = CONDITIONS[c][1]
        figures[c] = {"step": per_step(samples[c], 0, keywords), "cpu": per_step(samples[c], 1, keywords),
                      "monitored": statistics.median(monitored) if monitored else float("nan"),
                      "mean": statistics.median(means[c]),
                      "spread": (max(means[c]) - min(means[c])) / statistics.median(means[c]),
                      "start_stop": statistics.median(start_stops[c])}
    return figures


HOOKS = ("_before_step", "_after_step", "_after_forward", "_output_grad", "_accumulated")  # the monitor's own work


def own_time(model, step, results_dir: str, steps: int) -> tuple[float, float, float]:
    """The time spent inside the monitor's hooks (``HOOKS``, wrapped here with a clock) per step, over ``steps``
    consecutive monitored steps of one default monitor: the median monitored step's, the median state step's and
    their long-run mean. Less noisy than the A/B ratio on a shared host: it times only the monitor's work (not what
    that work does to the caches around it)."""
    from op_tools.tools.training_monitor import TrainingMonitor

    spent = [0.0]
    originals = {name: getattr(TrainingMonitor, name) for name in HOOKS}

    def clocked(method):
        def hook(*args, **kwargs):
            begin = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - begin
        return hook

    for name, method in originals.items():
        setattr(TrainingMonitor, name, clocked(method))
    per_step: list[tuple[str, float]] = []
    for _ in range(2):  # warm-up: AdamW's state, the allocator
        step(None)
    try:
        monitor = TrainingMonitor(model=model, results_dir=results_dir).start()
        try:
            for k in range(steps):
                spent[0] = 0.0
                step(monitor)
                per_step.append((kind_of(monitor, k), spent[0]))
        finally:
            monitor.stop()
    finally:
        for name, method in originals.items():
            setattr(TrainingMonitor, name, method)
    monitored = statistics.median(t for kind, t in per_step if kind == "monitored")
    state = statistics.median(t for kind, t in per_step if kind == "state")
    long_run = shares(CONDITIONS["default"][1])
    return monitored, state, long_run["monitored"] * monitored + long_run["state"] * state


def report(device: str, figures: dict[str, dict[str, float]], rounds: int, steps: int) -> None:
    base = figures["none"]
    print(f"\n{device}: {rounds} alternating rounds of {steps} steps per condition, after 1 warm-up round each")
    print(f"{'condition':<44}{'step ms':>9}{'x (a)':>7}{'cpu ms':>9}{'x (a)':>7}{'monitored ms':>13}"
          f"{'round mean ms':>14}{'x (a)':>7}{'spread':>7}{'start+stop ms':>14}")
    for condition, (label, _) in CONDITIONS.items():
        f = figures[condition]
        print(f"{label:<44}{f['step'] * 1e3:>9.1f}{f['step'] / base['step']:>7.2f}{f['cpu'] * 1e3:>9.1f}"
              f"{f['cpu'] / base['cpu']:>7.2f}{f['monitored'] * 1e3:>13.1f}{f['mean'] * 1e3:>14.1f}"
              f"{f['mean'] / base['mean']:>7.2f}{f['spread'] * 100:>6.0f}%{f['start_stop'] * 1e3:>14.1f}")
    for condition in ("default", "every10"):
        ratio = figures[condition]["step"] / base["step"]
        target = TARGETS[device]
        verdict = f" (target <= {target}: {'met' if ratio <= target else 'NOT met'})" if condition == "default" else ""
        print(f"summary: training_monitor_cost: {device}: {CONDITIONS[condition][0][4:]} {ratio:.2f}x the step "
              f"without it ({base['step'] * 1e3:.1f} -> {figures[condition]['step'] * 1e3:.1f} ms){verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="real")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds per condition")
    parser.add_argument("--steps", type=int, default=10, help="training steps per round (10: one monitored step "
                        "per round under every=10)")
    parser.add_argument("--devices", default="cpu,sim",
                        help="comma-separated, measured in this order: cpu, sim, cuda (on a CUDA GPU: make gpu-check)")
    parser.add_argument("--vocab", type=int, help="vocabulary size (default: the --size's)")
    parser.add_argument("--layers", type=int, help="decoder layers (default: the --size's)")
    parser.add_argument("--batch", type=int, help="sequences per batch (default: the --size's)")
    parser.add_argument("--seq", type=int, help="sequence length (default: the --size's)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's choice)")
    args = parser.parse_args()
    hidden, intermediate, layers, heads, vocab, batch, seq = SIZES[args.size]
    layers, vocab, batch, seq = args.layers or layers, args.vocab or vocab, args.batch or batch, args.seq or seq
    devices = [d for d in args.devices.split(",") if d]
    if unknown := set(devices) - {"cpu", "sim", "cuda"}:
        parser.error(f"--devices: unknown {', '.join(sorted(unknown))}; expected cpu, sim and/or cuda")
    if "cuda" in devices and not torch.cuda.is_available():
        parser.error("--devices cuda: no CUDA GPU here")
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.getLogger("op_tools").setLevel(logging.WARNING)  # not a line per monitor stop; warnings still shown
    print(f"torch {torch.__version__}, {os.cpu_count()} cpus, {torch.get_num_threads()} threads; transformers "
          f"LlamaForCausalLM hidden {hidden}, intermediate {intermediate}, {layers} layers, {heads} heads, vocab "
          f"{vocab}; batch {batch}x{seq}; AdamW; step = forward, backward, optimizer.step(), loss.item()")
    results = tempfile.mkdtemp(prefix="training_monitor_cost_")
    try:
        for device in devices:
            if device == "sim":  # registered only now: the CPU figures are taken without it
                import ditorch.sim

                ditorch.sim.register()
            with contextlib.redirect_stdout(sys.stderr):  # anything a model or tool prints stays off the table
                figures = measure(device, (hidden, intermediate, layers, heads, vocab, batch, seq), args.rounds,
                                  args.steps, results)
                model, step = build_step(device, hidden, intermediate, layers, heads, vocab, batch, seq)
                own = own_time(model, step, results, 2 * STATE_EVERY)
                del model, step
            report(device, figures, args.rounds, args.steps)
            plain = figures["none"]["step"]
            print(f"summary: training_monitor_cost: {device}: TrainingMonitor(model=model)'s own work "
                  f"{own[2] * 1e3:.1f} ms per step, {own[2] / plain:.1%} of a step ({own[0] * 1e3:.1f} ms at a "
                  f"monitored step, {own[1] * 1e3:.1f} ms at a state step, 1 in {STATE_EVERY})")
    finally:
        shutil.rmtree(results, ignore_errors=True)


if __name__ == "__main__":
    main()
