"""The ditorch demo: from a loss that drifts on the device to the wrong operator found and worked around.

    make demo            # or: python examples/demo.py

1. train a tiny Llama-shaped model on the accelerator and on the CPU, and compare the losses;
2. OpAutoCompare reruns every op of one step on the CPU in float64 and names the ops that are wrong;
3. OpFallback (``OP_FALLBACK_LIST``) runs those ops on the CPU: the losses match again;
4. OpTimeMeasure says where the time of a step goes, and writes a trace to open in a browser.

Where ditorch finds no accelerator the demo runs on ``sim``, the simulated device, told to get one
kernel wrong: ``DITORCH_SIM_FAULTS`` (default ``gelu:noise=1e-2``; try ``rsqrt:noise=1e-3``). The tools'
full console output goes to ``op_tools_results/demo_tool_output.txt``; the demo prints short tables.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # before the imports: the run time printed at the end is the whole run's

import contextlib  # noqa: E402
import csv  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
from prettytable import PrettyTable  # noqa: E402

import ditorch  # noqa: E402 - detects the accelerator and maps CUDA onto it
import op_tools  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_model import train  # noqa: E402 - after the path is set

DEFAULT_FAULT = "gelu:noise=1e-2"
STEPS = 4
ROUNDING = 1e-5  # relative loss differences below this are what correct kernels that round differently give
RESULTS_DIR = os.environ.setdefault("OP_TOOLS_RESULTS_DIR", "op_tools_results")
TOOL_OUTPUT = os.path.join(RESULTS_DIR, "demo_tool_output.txt")


def heading(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def pick_device() -> tuple[str, str]:
    """(device to use, its name to show): ``cuda`` where ditorch found an accelerator (it maps CUDA onto it),
    else the simulated device with a fault."""
    if ditorch.backend.name != "cpu" and torch.cuda.is_available():
        label = ditorch.backend.device_type
        print(f"accelerator found: {label} (ditorch maps \"cuda\" onto it); no fault is injected")
        return "cuda", label
    fault = os.environ.setdefault("DITORCH_SIM_FAULTS", DEFAULT_FAULT)
    import ditorch.sim as sim

    sim.register()  # reads DITORCH_SIM_FAULTS
    print("no accelerator here: the demo runs on 'sim', the simulated device (docs/sim_device.md),\n"
          f"told to compute one kernel wrong: DITORCH_SIM_FAULTS={fault!r}")
    return "sim", "sim"


@contextlib.contextmanager
def tool_output_to_file():
    """The tools' own console output (per-op lines, full tables) goes to TOOL_OUTPUT, not the screen."""
    os.makedirs(RESULTS_DIR, exist_ok=True)
    with open(TOOL_OUTPUT, "a") as log, contextlib.redirect_stdout(log):
        yield


def show(columns, rows) -> None:
    table = PrettyTable(columns)
    table.align = "l"
    for row in rows:
        table.add_row(row)
    print(table)


def compare_losses(device: str, label: str, on_device: list[float], on_cpu: list[float]) -> float:
    show(["step", f"loss on {device} ({label})", "loss on cpu", "difference"],
         [[i, f"{d:.7f}", f"{c:.7f}", f"{d - c:+.1e}" if d != c else "0 (identical)"]
          for i, (d, c) in enumerate(zip(on_device, on_cpu))])
    return max(abs(d - c) for d, c in zip(on_device, on_cpu))


def short_location(location: str) -> str:
    path, _, rest = location.partition(":")
    text = f"{os.path.basename(path)}:{rest}"
    return text if len(text) <= 50 else text[:47] + "..."  # the failures table within 100 columns


def main() -> None:
    os.environ.setdefault("OP_TOOLS_VERBOSE", "0")  # no per-call tables: the summaries say what matters
    print("ditorch demo: train on the device, find a wrong op (OpAutoCompare), work around it (OpFallback),\n"
          "and see where the time goes (OpTimeMeasure).")
    device, label = pick_device()
    on_cpu = train("cpu", STEPS)

    heading(f"1. Train {STEPS} steps on {label} and on the CPU")
    drift = compare_losses(label, "as is", train(device, STEPS), on_cpu)
    if drift == 0:
        print(f"identical: {label} computes what the CPU computes. OpAutoCompare checks every op anyway.")
    elif drift < ROUNDING * max(map(abs, on_cpu)):
        print(f"the losses differ by up to {drift:.1e}, as other kernels' rounding does. "
              "OpAutoCompare checks every op anyway.")
    else:
        print(f"the losses differ by up to {drift:.1e}: some op on {label} computes wrong. Which one?")

    heading("2. OpAutoCompare: which op computes wrong?")
    print("one training step, every op rerun on the CPU in float64 and compared, forward and backward")
    with tool_output_to_file(), op_tools.OpAutoCompare() as compare:
        train(device, 1)
    counts = compare.counts
    print(f"forward: {counts['forward compared']} calls compared, {counts['forward failed']} failed; "
          f"backward: {counts['backward compared']} compared, {counts['backward failed']} failed")
    wrong_ops = list(dict.fromkeys(f["op"] for f in compare.failures))
    if compare.failures:
        print("failing calls in execution order (the first is where to look):")
        show(["order", "op", "phase", "source line"],
             [[f["order"], f["op"], f["phase"], short_location(f["location"])] for f in compare.failures[:5]])
        if len(compare.failures) > 5:
            print(f"... and {len(compare.failures) - 5} more")
        print(f"why the first fails: {compare.failures[0]['error_info']}\n"
              "  (its relative error, against what a correct kernel in that dtype gets on the CPU)")
    else:
        print("no op failed: every op matches the float64 CPU reference.")

    if wrong_ops:
        heading("3. OpFallback: run the failing op on the CPU")
        os.environ["OP_FALLBACK_LIST"] = ",".join(wrong_ops)
        print(f"OP_FALLBACK_LIST={os.environ['OP_FALLBACK_LIST']}\n"
              "  (the same variable works for a script: OP_FALLBACK_LIST=... python train.py)")
        with tool_output_to_file(), op_tools.OpFallback():
            fixed = train(device, STEPS)
        drift = compare_losses(label, "with fallback", fixed, on_cpu)
        print("identical to the CPU run: the fallback works around the wrong kernel." if drift == 0 else
              f"now within {drift:.1e} of the CPU run.")
        saved = os.path.join(RESULTS_DIR, "op_capture_results", wrong_ops[0])
        print(f"next: the failing calls are saved, real inputs included, for a kernel engineer to replay:\n"
              f"  python op_tools/run_op_from_data.py \\\n      {saved} --acc_check")  # a shell line, within 100

    else:
        heading("3. OpFallback: nothing to fall back")

    heading("4. OpTimeMeasure: where does the time of a step go?")
    fallback = op_tools.OpFallback() if wrong_ops else contextlib.nullcontext()
    with tool_output_to_file(), fallback, op_tools.OpTimeMeasure() as timer:
        train(device, 1)
    with open(timer.written["summary"], newline="") as f:
        summary = list(csv.DictReader(f))
    print(f"{sum(int(r['calls']) for r in summary)} calls of {len(summary)} ops timed; the largest:")
    show(["op", "calls", "total ms", "share", "forward mean ms", "backward mean ms"],
         [[r["name"], r["calls"], f"{float(r['total_ms']):.2f}", r["share"], f"{float(r['forward_mean_ms']):.3f}",
           f"{float(r['backward_mean_ms']):.3f}" if r["backward_mean_ms"] else "-"] for r in summary[:6]])
    if label == "sim":
        print("(sim runs each op as a Python dispatch of tens of microseconds: these times show how to read\n"
              " the summary, not how fast a real chip is)")

    heading("Files written")
    files = [("OpAutoCompare: every comparison", compare_csv_path()),
             ("OpAutoCompare: failing calls, for replay",
              os.path.join(RESULTS_DIR, "op_capture_results", wrong_ops[0]) if wrong_ops else "-"),
             ("OpTimeMeasure: per-op summary", timer.written["summary"]),
             ("OpTimeMeasure: trace (drop it on https://ui.perfetto.dev)", timer.written["trace"]),
             ("the tools' full console output", TOOL_OUTPUT)]
    for what, where in files:  # the path on its own line: whole and copyable within 100 columns
        print(f"{what}:\n  {where}")
    print(f"\ndemo done in {time.perf_counter() - STARTED:.0f} s. "
          "Next: docs/quickstart.md, then the scripts in examples/.")


def compare_csv_path() -> str:
    """The CSV OpAutoCompare wrote in this run (its name holds this process's id)."""
    folder = os.path.join(RESULTS_DIR, "op_autocompare_result")
    mine = [n for n in sorted(os.listdir(folder)) if f"_pid{os.getpid()}_" in n]
    return os.path.join(folder, mine[-1]) if mine else "-"


if __name__ == "__main__":
    main()
