"""Train a 1-layer tiny Llama on sim under the tools named on the command line, for reliability tests.

    python train_under_tools.py MODE [steps]

MODE: ``loop`` (OpCapture then OpTimeMeasure, again and again, until killed: files are written all the time),
``sigterm`` (start OpTimeMeasure and OpAutoCompare, never stop them, print ``ready`` and wait for a signal), ``exit``
(the same, then return normally), ``sigterm-in-call`` (OpAutoCompare on one large product run again and again until a
signal: the signal comes during a handled call), ``both`` (one step under OpCapture and OpTimeMeasure, stopped; print
what was written as JSON), ``memory-<Tool>`` (steps under the tool; print RSS and live CPU tensors as JSON).
"""

import gc
import json
import os
import sys
import time

import torch
from tiny_models import tiny_llama

import ditorch.sim
import op_tools

ditorch.sim.register()


def make_step():
    torch.manual_seed(0)
    model = tiny_llama(layers=1).to("sim")
    ids = torch.randint(0, 128, (2, 16)).to("sim")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    return step


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def live_cpu_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is torch.Tensor and o.device.type == "cpu")


def main() -> None:
    mode = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    if mode == "sigterm-in-call":  # no model: nearly all of the process's time is inside the tool's handled calls
        a = torch.randn(512, 512).to("sim")
        op_tools.OpAutoCompare().start()
        torch.mm(a, a)
        print("ready", flush=True)
        while not os.path.exists(os.environ["GO_FILE"]):  # idle until its test begins: no core taken from the others
            time.sleep(0.05)
        while True:
            torch.mm(a, a)
    step = make_step()
    step()  # AdamW's state exists from here on
    if mode == "loop":
        while True:
            for tool in (op_tools.OpCapture(), op_tools.OpTimeMeasure()):
                with tool:
                    step()
            print("round", flush=True)
    elif mode in ("sigterm", "exit"):
        op_tools.OpTimeMeasure().start()
        op_tools.OpAutoCompare().start()
        step()
        print("ready", flush=True)
        if mode == "sigterm":
            time.sleep(120)
    elif mode == "both":
        capture, timer = op_tools.OpCapture(), op_tools.OpTimeMeasure()
        with capture, timer:
            step()
        print(json.dumps({"capture_files": capture.store.files_written, "time_files": sorted(timer.written.values())}))
    elif mode.startswith("memory-"):
        tool = getattr(op_tools, mode.split("-", 1)[1])()
        before = live_cpu_tensors()
        rss = []
        with tool:
            for i in range(steps):
                step()
                if (i + 1) % 10 == 0:
                    rss.append(rss_mb())
        tool = None
        print(json.dumps({"rss_mb": rss, "cpu_tensors_before": before, "cpu_tensors_after": live_cpu_tensors()}))


if __name__ == "__main__":
    main()
