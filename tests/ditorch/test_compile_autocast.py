"""torch.compile on sim with nanoGPT's defaults (issue 35 item 1): a factory on an input's device inside the compiled
code (``torch.arange(t, device=idx.device)``), the default backend, bf16 autocast, a float16 GradScaler.

One child interpreter (the backend is chosen at import) compiles each case once and reports; the tests read the
report. Eager runs on sim are the reference.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from subprocess_env import env_without_settings

CHILD = """
import copy, json, logging
import torch, ditorch
import torch._functorch.config as functorch_config
from torch._dynamo.utils import counters
from tiny_models import NanoGPT

report = {}
equal = lambda a, b: bool(torch.equal(a.cpu(), b.cpu()))
torch.manual_seed(0)
idx = torch.randint(0, 64, (2, 16), device="cuda")
targets = torch.randint(0, 64, (2, 16), device="cuda")

positions = lambda idx: torch.arange(0, idx.size(1), device=idx.device) + idx
written = lambda idx: torch.zeros(idx.shape, dtype=idx.dtype, device=idx.device).add_(idx) * 2
report["factories"] = {"arange, aot_eager": equal(torch.compile(positions, backend="aot_eager")(idx), positions(idx)),
                       "arange, default": equal(torch.compile(positions)(idx), positions(idx)),
                       "written in place": equal(torch.compile(written, backend="aot_eager")(idx), written(idx))}
with torch.autocast("cuda", dtype=torch.bfloat16):
    report["factories"]["arange, default, bf16 autocast"] = equal(torch.compile(positions)(idx), positions(idx))


def train(model, dtype, steps=2):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cuda", enabled=dtype is torch.float16)
    losses = []
    for _ in range(steps):
        with torch.autocast("cuda", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = model(idx, targets)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def eager_and_compiled(dtype):
    eager, compiled = copy.deepcopy(base), copy.deepcopy(base)
    return {"eager": train(eager, dtype), "compiled": train(torch.compile(compiled), dtype),
            "params_equal": all(equal(a, b) for a, b in zip(eager.parameters(), compiled.parameters()))}


base = NanoGPT().cuda()
for name, dtype in (("float32", None), ("bfloat16", torch.bfloat16), ("float16", torch.float16)):
    report[name] = eager_and_compiled(dtype)
functorch_config.backward_pass_autocast = "off"  # the backward traced as eager runs it: outside autocast
torch._dynamo.reset()  # else the graphs compiled for bfloat16 above run again
report["bfloat16, backward outside autocast"] = eager_and_compiled(torch.bfloat16)
functorch_config.backward_pass_autocast = "same_as_forward"
with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):  # the issue's call
    report["no_grad, bfloat16"] = equal(torch.compile(base)(idx, targets), base(idx, targets))
report["graph_breaks"] = sum(counters["graph_break"].values())

# A graph break runs its op eagerly, through sim's __torch_dispatch__: dynamo must not trace the device's code.
traced = []
logging.getLogger("torch._dynamo").setLevel(logging.INFO)
logging.getLogger("torch._dynamo").addHandler(
    type("H", (logging.Handler,), {"emit": lambda s, r: traced.append(r.getMessage())})())

def with_a_break(x):
    y = torch.nn.functional.linear(x, x)
    total = y.sum().item()
    return torch.arange(0, x.size(1), device=x.device) * total + y

x = torch.randn(8, 8, device="cuda")
with torch.autocast("cuda", dtype=torch.bfloat16):
    report["graph break, equal"] = equal(torch.compile(with_a_break)(x), with_a_break(x))
report["frames traced"] = [m.split("start tracing ", 1)[1] for m in traced if "start tracing" in m]
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def run():
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD)], capture_output=True, text=True,
                          env=env_without_settings({"DITORCH_QUIET": "1", "DITORCH_BACKEND": "sim"}), timeout=280)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_factories_on_an_inputs_device_compile_as_eager_runs_them(run):
    report, _ = run
    # fake tensors of factories (plain, on sim) met SimTensors holding CPU fakes: a device mismatch, a graph
    # break, then dynamo compiling sim's own __torch_dispatch__ (the issue's "autocast state changed")
    assert report["factories"] == dict.fromkeys(report["factories"], True), report["factories"]
    assert len(report["factories"]) == 4


def test_nanogpt_compiled_trains_in_float32_as_eager_bit_for_bit(run):
    report, _ = run
    assert report["float32"]["compiled"] == report["float32"]["eager"], report["float32"]
    assert report["float32"]["params_equal"], report["float32"]


@pytest.mark.parametrize("name, eps", [("bfloat16", 2 ** -7), ("float16", 2 ** -10)])  # torch.finfo(dtype).eps
def test_nanogpt_compiled_trains_under_autocast_within_the_dtypes_rounding(run, name, eps):
    # The forward is eager's bit for bit (first loss). AOTAutograd traces the backward under the forward's autocast
    # (torch._functorch.config.backward_pass_autocast="same_as_forward", as on CUDA), eager's backward runs outside
    # it: some gradients round differently, by the autocast dtype's rounding; the next test turns that off.
    eager, compiled = run[0][name]["eager"], run[0][name]["compiled"]
    assert compiled[0] == eager[0], (name, eager, compiled)
    assert all(abs(c - e) <= eps * abs(e) for c, e in zip(compiled, eager)), (name, eager, compiled)


def test_nanogpt_compiled_trains_in_bfloat16_as_eager_bit_for_bit_with_the_backward_outside_autocast(run):
    result = run[0]["bfloat16, backward outside autocast"]
    assert result["compiled"] == result["eager"] and result["params_equal"], result


def test_the_issues_no_grad_bfloat16_forward_and_every_model_above_compile_without_a_graph_break(run):
    report, _ = run
    assert report["no_grad, bfloat16"]
    assert report["graph_breaks"] == 0, report  # compiled, not run eagerly after a fallback


def test_no_traceback_is_printed(run):
    _, stderr = run
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr[-4000:]


def test_a_graph_breaks_eager_op_runs_sim_without_dynamo_tracing_the_device(run):
    report, _ = run
    assert report["graph break, equal"]
    assert report["frames traced"], report  # the handler saw dynamo's frames
    assert not [frame for frame in report["frames traced"] if "ditorch/sim/" in frame], report["frames traced"]
