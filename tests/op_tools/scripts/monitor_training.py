"""Run by test_training_monitor_config.py as ``python -m op_tools monitor ... monitor_training.py STEPS [ENDING]``:
a tiny model trained STEPS SGD steps on the CPU, then ``sys.exit(ENDING)``, or a RuntimeError when ENDING is
``raise``."""

import sys

import torch

steps, ending = int(sys.argv[1]), (sys.argv[2] if len(sys.argv) > 2 else "0")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(8, 4)
for _ in range(steps):
    model(x).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
print("trained", steps, "steps")
if ending == "raise":
    raise RuntimeError("the script failed")
sys.exit(int(ending))
