"""Run by test_rank_labels.py under torchrun (2 processes, sim): a tiny model trained under several tools.

Each session's console goes to ``<out>/<session><rank>.txt`` (op_tools' handler writes to the current sys.stdout),
so that the two ranks' lines never interleave. Session ``all``: OpTimeMeasure, OpCapture (stats) and OpAutoCompare
for 3 steps, every rank printing. Session ``only0``: OP_TOOLS_PRINT_RANKS=0, OpObserve and OpOverflowCheck for 1
step, then an op making nan from finite inputs (a WARNING, which every rank shows). Session ``basic``: the script
configures logging itself (``logging.basicConfig``, as PyTorch's examples do), OpObserve for 1 step.
"""

import logging
import os
import sys

import torch

import ditorch  # noqa: F401 - sim, shown as cuda
import op_tools

out, rank = sys.argv[1], int(os.environ["RANK"])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(4, 8).cuda()


def train(steps: int) -> None:
    for _ in range(steps):
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def session(name: str):
    if sys.stdout is not sys.__stdout__:
        sys.stdout.close()
    sys.stdout = open(os.path.join(out, f"{name}{rank}.txt"), "w", encoding="utf-8")  # noqa: SIM115


session("all")
train(1)  # a step before the tools start: their steps count from their own start
with op_tools.OpTimeMeasure(), op_tools.OpCapture(mode="stats"), op_tools.OpAutoCompare():
    train(3)

os.environ["OP_TOOLS_PRINT_RANKS"] = "0"
session("only0")
with op_tools.OpObserve(), op_tools.OpOverflowCheck():
    train(1)
    torch.log(-torch.ones(2, device="cuda"))

del os.environ["OP_TOOLS_PRINT_RANKS"]
session("basic")
logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", force=True)
with op_tools.OpObserve():
    train(1)
logging.getLogger().handlers[0].flush()
sys.stdout.close()
sys.stdout = sys.__stdout__
