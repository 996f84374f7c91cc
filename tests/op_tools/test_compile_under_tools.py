"""A torch.compile'd model under a tool: compiled regions run eagerly while the tool is active, so the tool sees the
calls the eager model makes, and says so in one line; a call met while the compiler traces counts as not checked."""

from __future__ import annotations

import json

# One interpreter for every case: dynamo's first import and each compilation cost seconds.
CHILD = """
import json, logging
import torch
from op_tools.core import compiled_regions
from op_tools.core.engine import OpTool

lines = []
handler = type("H", (logging.Handler,), {"emit": lambda s, r: lines.append(r.getMessage())})()
logging.getLogger("op_tools").addHandler(handler)
logging.getLogger("op_tools").setLevel(logging.INFO)

def tiny(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).to(device)

def calls_seen(tool, model, x):
    with tool:
        model(x).sum().backward()
    return dict(tool.handled), tool.not_checked()

report = {"dynamo_loaded_first": "torch._dynamo" in sys.modules}
model, x = tiny("sim"), torch.randn(4, 8, device="sim")
# Compiled for the first time inside the tool, dynamo not loaded at its start: torch.compile is watched.
with op_tools.OpObserve() as tool:
    late = torch.compile(model, backend="aot_eager")
    late(x).sum()
report["late"] = {"calls": dict(tool.handled), "lines": len([l for l in lines if "torch.compile" in l])}
torch._dynamo.reset()
compiled = torch.compile(model, backend="aot_eager")
compiled(x)  # compiled before any tool starts: dynamo is loaded
for name in ("OpAutoCompare", "OpCapture", "OpObserve"):
    del lines[:]
    eager = calls_seen(getattr(op_tools, name)(), model, x)
    seen = calls_seen(getattr(op_tools, name)(), compiled, x)
    report[name] = {"eager": eager, "compiled": seen,
                    "compile_lines": [l for l in lines if "torch.compile" in l]}
report["stance_after"] = torch._dynamo.eval_frame._stance.stance
# Reports name a compiled model's modules as the eager model's: no "_orig_mod." (torch.compile's wrapper)
import ditorch.sim
failing = {}
for label, m in (("eager", model), ("compiled", compiled)):
    with ditorch.sim.faults("relu:noise=1e-1"), op_tools.OpAutoCompare() as tool:
        m(x)
    failing[label] = sorted({f["module"] for f in tool.failures})
report["failing_modules"] = failing


# Where the stance cannot be forced, the calls the compiler traces run, and are counted as not checked.
class CountOnCpu(OpTool):
    def configure(self):
        self.handles_cpu_calls = True

torch._dynamo.reset()
compiled_regions._force_eager = lambda: False
cpu_model = tiny("cpu")
traced = torch.compile(cpu_model, backend="eager")
tool = CountOnCpu()
with tool:
    traced(torch.randn(4, 8))
report["traced"] = {"compiled": dict(tool.compiled), "not_checked": tool.not_checked(), "verdict": tool.verdict()}
print(json.dumps(report))
"""


def test_tools_see_the_calls_of_a_compiled_model_as_of_the_eager_one(run_script):
    done = run_script(CHILD, {"OP_TOOLS_VERBOSE": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for name in ("OpAutoCompare", "OpCapture", "OpObserve"):
        (eager_calls, eager_unchecked), (compiled_calls, compiled_unchecked) = (report[name]["eager"],
                                                                                report[name]["compiled"])
        assert eager_calls and compiled_calls == eager_calls, (name, report[name])
        assert compiled_unchecked == eager_unchecked == "", (name, report[name])
        # dynamo is loaded when each of the two activations (eager model, compiled model) starts: one line each
        assert len(report[name]["compile_lines"]) == 2, report[name]["compile_lines"]
        assert all(line.startswith(f"{name}: torch.compile'd code runs eagerly while the tool is active")
                   for line in report[name]["compile_lines"])
    assert report["stance_after"] == "default"  # the stance before is back after the last tool stopped
    assert report["failing_modules"] == {"eager": ["1"], "compiled": ["1"]}, report["failing_modules"]
    assert not report["dynamo_loaded_first"]
    assert report["late"] == {"calls": report["OpObserve"]["eager"][0], "lines": 1}, report  # forward only: 4 calls
    traced = report["traced"]
    assert sum(traced["compiled"].values()) >= 3, traced  # two linears and a relu, traced by dynamo
    assert "inside torch.compile'd regions not checked" in traced["not_checked"], traced
    assert traced["verdict"] == "unchecked", traced


# What the two scripts below start with: the tools' lines kept, a small model on sim.
LINES_AND_MODEL = """
import logging
lines = []
handler = type("H", (logging.Handler,), {"emit": lambda s, r: lines.append(r.getMessage())})()
logging.getLogger("op_tools").addHandler(handler)
logging.getLogger("op_tools").setLevel(logging.INFO)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).to("sim")
x = torch.randn(4, 8, device="sim")
"""

FULLGRAPH = LINES_AND_MODEL + """
compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
compiled(x)  # compiled before the tool starts, through dynamo's fullgraph path
with op_tools.OpObserve() as tool:
    compiled(x)
print(sum(tool.handled.values()), sum("runs eagerly while the tool is active" in line for line in lines))
"""


def test_a_model_compiled_with_fullgraph_is_said_to_run_eagerly_under_a_tool(run_script):
    # dynamo counts no frame for a fullgraph compilation (its counters' "frames"): its graphs are counted instead
    done = run_script(FULLGRAPH, {})
    assert done.returncode == 0, done.stderr[-4000:]
    handled, said = map(int, done.stdout.split()[-2:])
    assert handled == 2 and said == 1, done.stdout  # linear and relu seen, and said once


COMPILED_BEFORE_RUN_INSIDE = LINES_AND_MODEL + """
import torch._dynamo  # loaded, nothing compiled yet: torch.compile is not watched
compiled = torch.compile(model, backend="aot_eager")  # made before the tool, first run inside it
with op_tools.OpObserve():
    model(x)  # no compiled code runs: nothing to say
said_before = sum("runs eagerly while the tool is active" in line for line in lines)
with op_tools.OpObserve() as tool:
    compiled(x)
    compiled(x)
print(sum(tool.handled.values()), said_before, sum("runs eagerly while the tool is active" in line for line in lines))
"""


def test_a_model_compiled_before_the_tool_and_first_run_inside_it_is_said_to_run_eagerly(run_script):
    # it said nothing: dynamo was loaded and had compiled nothing when the tool started, so torch.compile was not
    # watched, and the compiled model ran eagerly without its line
    done = run_script(COMPILED_BEFORE_RUN_INSIDE, {})
    assert done.returncode == 0, done.stderr[-4000:]
    handled, said_before, said = map(int, done.stdout.split()[-3:])
    assert (handled, said_before, said) == (4, 0, 1), done.stdout  # two calls of linear and relu; said once


STARTED_INSIDE = """
import json
results = {}
for name in ("OpObserve", "OpAutoCompare", "OpOverflowCheck"):
    @torch.compile(backend="aot_eager")
    def step(x):
        with getattr(op_tools, name)() as tool:
            y = torch.nn.functional.relu(x * 2) + 1
        return y, tool

    x = torch.randn(4, device="sim")
    y, tool = step(x)
    results[name] = {"right": torch.equal(y.cpu(), torch.relu(x.cpu() * 2) + 1), "verdict": tool.verdict(),
                     "not_checked": tool.not_checked()}
print(json.dumps(results))
"""


def test_a_tool_started_inside_a_compiled_function_lets_it_compile_and_says_its_calls_not_checked(run_script):
    # dynamo traced start() into torch.compiler.set_stance, a callable it forbids: "AssertionError: Attempt to trace
    # forbidden callable", and the user's compiled function failed where it ran without the tool
    done = run_script(STARTED_INSIDE, {})
    assert done.returncode == 0, done.stderr[-4000:]
    for name, result in json.loads(done.stdout.strip().splitlines()[-1]).items():
        assert result["right"] and result["verdict"] == "unchecked", (name, result)
        assert "inside torch.compile'd regions not checked" in result["not_checked"], (name, result)
