"""OpAutoCompare(compiled="check"): torch.compile'd code keeps running compiled, each compiled graph's run is compared
as one call (forward and backward) with the graph dynamo traced rerun in float64 on the host, and a failing graph is
narrowed down to its first diverging node, named with its op, module path and source line."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
from subprocess_env import child_env

import op_tools

pytestmark = pytest.mark.children_import("transformers")
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One interpreter for every case: dynamo's first import and each compilation cost seconds.
CHILD = """
import copy, json, logging, sys
import torch
import torch.nn.functional as F
from torch import nn
import ditorch.sim, op_tools
ditorch.sim.register()
sys.path.append(TESTS)
from tiny_models import tiny_llama

lines = []
handler = type("H", (logging.Handler,), {"emit": lambda s, r: lines.append(r.getMessage())})()
logging.getLogger("op_tools").addHandler(handler)
report = {}

def failures(tool):
    return [{k: f[k] for k in ("op", "phase", "module", "error_info", "location")} for f in tool.failures]

def account(tool):
    return {"counts": dict(tool.counts), "handled": sorted(tool.handled), "failures": failures(tool),
            "skipped": dict(tool.skipped), "verdict": tool.verdict(), "summary": tool.summary(),
            "versus_eager": tool.versus_eager}

# A Llama, compiled with aot_eager (sim's faults apply inside its graphs)
def llama_step(model, ids):
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return out.loss.item(), grads

torch.manual_seed(0)
llama = torch.compile(tiny_llama(hidden=32, layers=1).to("sim"), backend="aot_eager")
ids = torch.randint(0, 128, (2, 16)).to("sim")
plain = llama_step(llama, ids)
with op_tools.OpAutoCompare(compiled="check") as tool:
    checked = llama_step(llama, ids)
report["llama"] = account(tool)
report["llama"]["unchanged"] = checked[0] == plain[0] and all(torch.equal(a, b) for a, b in zip(checked[1], plain[1]))
# A fault of sim's enters a graph when AOTAutograd traces it (it traces through sim's dispatch), as a kernel's fault
# is in the kernel: the model is compiled again inside the fault's scope (dynamo would reuse the clean graph for
# another instance of the model).
torch._dynamo.reset()
with ditorch.sim.faults("silu:noise=1e-2"), op_tools.OpAutoCompare(compiled="versus_eager") as tool:
    llama_step(llama, ids)
report["llama_silu"] = account(tool)

# A CNN with BatchNorm (its running statistics written inside the graph) and in-place ReLU, trained one step
torch.manual_seed(0)
cnn = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                    nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                    nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)).to("sim")
twin = copy.deepcopy(cnn)
x, y = torch.randn(4, 3, 8, 8).to("sim"), torch.randint(0, 4, (4,)).to("sim")

def cnn_step(model):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return [loss.item(), *[p.grad.cpu().tolist() for p in model.parameters()],
            *[b.cpu().tolist() for b in model.buffers()]]

plain = cnn_step(torch.compile(twin, backend="aot_eager"))
compiled_cnn = torch.compile(cnn, backend="aot_eager")
with op_tools.OpAutoCompare(compiled="check") as tool:
    checked = cnn_step(compiled_cnn)
report["cnn"] = account(tool)
report["cnn"]["unchanged"] = checked == plain

# A graph break: two graphs, the code between them run eagerly (and checked op by op)
def broken(a, w):
    h = F.silu(a @ w)
    torch._dynamo.graph_break()
    return (h * 2).sum()

a, w = torch.randn(4, 8).to("sim"), torch.randn(8, 8).to("sim").requires_grad_()
with op_tools.OpAutoCompare(compiled="check") as tool:
    torch.compile(broken, backend="aot_eager")(a, w).backward()
report["graph_break"] = account(tool)

# Dropout in training: the graph draws random numbers, so it is not rerun
drop = torch.compile(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)).to("sim"), backend="aot_eager")
with op_tools.OpAutoCompare(compiled="check") as tool:
    drop(a).sum().backward()
report["dropout"] = account(tool)
# beside a tool that needs every op, compiled code runs eagerly, and the checking tool compares it op by op
with op_tools.OpObserve(), op_tools.OpAutoCompare(compiled="check") as tool:
    torch.compile(broken, backend="aot_eager")(a, w).backward()
report["beside_observe"] = account(tool)

# Inductor on the host (its C++ code): a clean MLP, then the same with a fault in one lowering, put there by a
# post-grad pass (a test-only pass: silu's exp, or silu itself, scaled by 1.01 before Inductor fuses the graph).
# CPU calls are not handled by default (the host is the reference's side): this seam turns them on for the test.
from torch._inductor import config as inductor_config

def faulty_exp(graph):
    for node in list(graph.nodes):
        if node.target in (torch.ops.aten.exp.default, torch.ops.aten.silu.default):
            with graph.inserting_after(node):
                scaled = graph.call_function(torch.ops.aten.mul.Tensor, (node, 1.01))
            node.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)

class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, h):
        return self.down(F.silu(self.up(h)) * 2)

def faulty_sigmoid(graph):  # in silu's backward alone (Inductor's forward computes silu without a sigmoid)
    for node in list(graph.nodes):  # torch 2.11's backward computes the sigmoid as a reciprocal of 1 + exp(-x)
        if node.target in (torch.ops.aten.sigmoid.default, torch.ops.aten.reciprocal.default):
            with graph.inserting_after(node):
                scaled = graph.call_function(torch.ops.aten.mul.Tensor, (node, 1.01))
            node.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)

for name, fault in (("inductor", None), ("inductor_fault", faulty_exp), ("inductor_backward", faulty_sigmoid)):
    torch._dynamo.reset()
    torch.manual_seed(0)
    mlp, h = torch.compile(Mlp(), backend="inductor"), torch.randn(8, 16)
    with inductor_config.patch(post_grad_custom_post_pass=fault, fx_graph_cache=False):
        tool = op_tools.OpAutoCompare(compiled="versus_eager")
        tool.handles_cpu_calls = True
        with tool:
            mlp(h).pow(2).mean().backward()
    report[name] = account(tool)
report["lines"] = lines
report["stance"] = torch._dynamo.eval_frame._stance.stance
report["callback_restored"] = not hasattr(torch._dynamo.eval_frame._callback_from_stance, "__wrapped_by_op_tools__")
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("compiled_check")
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD).replace("TESTS", repr(TESTS))],
                          env=child_env({"DITORCH_QUIET": "1", "OP_TOOLS_RESULTS_DIR": str(cwd)}), cwd=cwd,
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_clean_compiled_llama_is_compared_graph_by_graph_forward_and_backward_and_passes(report):
    llama = report["llama"]
    assert llama["failures"] == [] and llama["verdict"] == "clean", llama
    assert llama["counts"]["forward compared"] >= 1 and llama["counts"]["backward compared"] >= 1, llama
    # the graph ran compiled: its ops were not handled one by one
    assert llama["handled"][0].startswith("compiled:forward#"), llama["handled"]
    assert not {"torch.nn.functional.silu", "torch.nn.functional.linear"} & set(llama["handled"]), llama["handled"]
    assert llama["unchanged"]  # the loss and every gradient as without the tool, bit for bit


def test_a_silu_fault_in_a_compiled_llama_is_narrowed_to_its_node_module_and_source_line(report):
    found = report["llama_silu"]["failures"]
    assert [f["phase"] for f in found] == ["forward", "backward"], found
    for failure in found:
        assert failure["op"].startswith("compiled:"), failure
        assert failure["module"] == "model.layers.0.mlp.act_fn", failure
        assert failure["error_info"].startswith("first diverging node "), failure
        assert "(torch.nn.functional.silu, model.layers.0.mlp.act_fn in " in failure["error_info"], failure
        path, _, line = failure["location"].rpartition(":")
        assert path.endswith(os.path.join("transformers", "activations.py")) and line.isdigit(), failure
    assert report["llama_silu"]["verdict"] == "found"
    # versus_eager: the fault is the device's kernel, so eager errs as much as compiled
    assert "; compiled error " in found[0]["error_info"], found[0]
    assert 0.2 < report["llama_silu"]["versus_eager"]["compiled:forward#1"] < 5, report["llama_silu"]["versus_eager"]
    assert "compiled against eager in the device's dtype: 1 graphs, compiled errs more than 2x eager in 0" in \
        report["llama_silu"]["summary"], report["llama_silu"]["summary"]
    narrowed = [line for line in report["lines"] if line.startswith("OpAutoCompare: compiled:forward#")]
    assert len(narrowed) == 1 and "first diverging node" in narrowed[0], narrowed  # once per graph


def test_a_fault_in_a_compiled_backward_alone_is_reported_on_the_graph_and_said(report):
    found = report["inductor_backward"]["failures"]
    assert [f["phase"] for f in found] == ["backward"], found
    # the graph's nodes, run one by one on the device with their own gradients, agree: the compiled backward is wrong
    said = [line for line in report["lines"] if "failed in backward" in line]
    assert len(said) == 1 and "no node's gradients diverge when its nodes run one by one on the device" in said[0]


def test_a_backward_kernels_fault_is_narrowed_to_its_node_by_the_nodes_own_gradients(sim):
    import torch
    import torch.nn.functional as F  # noqa: N812

    import ditorch.sim
    from op_tools.numerics.graph_reference import first_diverging_gradient

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def step(x, w):
        return (F.silu(x @ w) * 2).sum()

    torch._dynamo.reset()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8, 16, generator=generator).to(sim)
    w = torch.randn(16, 16, generator=generator).to(sim).requires_grad_()
    torch.compile(step, backend=keep)(x, w)
    upstream = (torch.ones((), device=sim),)
    assert first_diverging_gradient(graphs[0], (x, w), upstream, None) is None
    with ditorch.sim.faults("sigmoid:noise=1e-2"):  # on sim, in silu's backward only (its forward is one kernel)
        found = first_diverging_gradient(graphs[0], (x, w), upstream, None)
    assert found is not None and found.op == "torch.nn.functional.silu", found
    assert found.location.endswith("test_compiled_check.py:" + str(step.__code__.co_firstlineno + 1)), found
    assert w.grad is None  # the user's tensors untouched


def test_with_inductor_a_clean_graph_passes_and_a_faulty_lowering_is_named_by_its_fused_kernel(report):
    clean = report["inductor"]
    assert clean["failures"] == [] and clean["verdict"] == "clean", clean
    assert clean["counts"]["forward compared"] == 3 and clean["counts"]["backward compared"] == 3, clean
    found = report["inductor_fault"]["failures"]
    assert [f["phase"] for f in found] == ["forward", "backward"], found
    for failure in found:
        assert failure["op"] == "compiled:Mlp.forward#1" and failure["module"] == "Mlp", failure
        # the node-by-node run on the device agrees (the fault is in the compiled code): the kernel is named
        assert failure["error_info"].startswith("first diverging kernel cpp_fused_mul_silu_"), failure
        assert "its result for node mul (" in failure["error_info"], failure
    # versus_eager: the eager run of the same graph is right, the compiled one errs thousands of times more
    assert report["inductor_fault"]["versus_eager"]["compiled:Mlp.forward#1"] > 1000, report["inductor_fault"]
    assert "compiled errs more than 2x eager in 1 (the most: compiled:Mlp.forward#1," in \
        report["inductor_fault"]["summary"], report["inductor_fault"]["summary"]
    narrowed = [line for line in report["lines"] if line.startswith("OpAutoCompare: compiled:Mlp.forward#1 failed")]
    assert len(narrowed) == 1 and "first diverging kernel cpp_fused_" in narrowed[0], narrowed


def test_a_compiled_cnn_with_batchnorm_and_inplace_relu_passes_and_trains_as_without_the_tool(report):
    cnn = report["cnn"]
    assert cnn["failures"] == [] and cnn["verdict"] == "clean", cnn
    assert cnn["handled"][0] == "compiled:graph#0", cnn["handled"]  # torch's modules only: no function named
    assert cnn["counts"]["forward compared"] >= 1 and cnn["counts"]["backward compared"] >= 1, cnn
    assert cnn["unchanged"]  # loss, gradients and running statistics: written once, as without the tool


def test_each_graph_around_a_graph_break_is_a_call_of_its_own(report):
    broken = report["graph_break"]
    regions = [name for name in broken["handled"] if name.startswith("compiled:")]
    assert len(regions) == 2 and regions[0].startswith("compiled:broken#"), broken["handled"]
    assert broken["counts"]["forward compared"] == 2 and broken["failures"] == [], broken


def test_a_compiled_graph_that_draws_random_numbers_is_skipped_and_said(report):
    dropout = report["dropout"]
    assert dropout["skipped"] == {"random (a compiled graph with torch.nn.functional.dropout)": 1}, dropout
    assert dropout["handled"] == ["compiled:graph#1", "torch.Tensor.sum"], dropout  # the sum: compared


def test_the_tool_says_compiled_code_runs_compiled_and_puts_dynamo_back_after(report):
    said = [line for line in report["lines"] if "torch.compile'd code runs compiled" in line]
    assert said and said[0].startswith("OpAutoCompare: torch.compile'd code runs compiled, each compiled graph "
                                       "checked as one call"), report["lines"]
    assert report["stance"] == "default" and report["callback_restored"]


def test_an_unknown_compiled_setting_is_named_with_its_keyword_or_variable(monkeypatch):
    with pytest.raises(ValueError, match=r"OpAutoCompare\(compiled='sometimes'\): unknown choice 'sometimes'; "
                                         r"expected 'eager', 'check' or 'versus_eager'"):
        op_tools.OpAutoCompare(compiled="sometimes")
    monkeypatch.setenv("OP_AUTOCOMPARE_COMPILED", "sometimes")
    with pytest.raises(ValueError, match="OP_AUTOCOMPARE_COMPILED='sometimes': unknown choice 'sometimes'; "
                                         "expected eager, check or versus_eager"):
        op_tools.OpAutoCompare().start()


def test_beside_a_tool_that_needs_every_op_compiled_code_runs_eagerly_and_is_compared_op_by_op(report):
    beside = report["beside_observe"]
    assert "torch.nn.functional.silu" in beside["handled"], beside["handled"]  # broken()'s, run eagerly
    assert not any(name.startswith("compiled:") for name in beside["handled"]), beside["handled"]
    assert beside["failures"] == [] and beside["verdict"] == "clean", beside
    assert ("OpAutoCompare: torch.compile'd code runs eagerly, not checked as compiled: another tool active beside "
            "this one needs every op") in "\n".join(report["lines"]), report["lines"]


def test_the_module_hooks_go_back_under_their_first_keys_so_a_compiled_graph_serves_the_next_tool():
    # dynamo guards on the keys of torch's global hook tables: new keys at each tool's start recompiled every graph
    from torch.nn.modules import module as torch_module

    from op_tools.core import module_path

    keys = []
    for _ in range(2):
        module_path.acquire()
        keys.append((list(torch_module._global_forward_pre_hooks), list(torch_module._global_forward_hooks)))
        module_path.release()
        assert not any(hook is module_path._enter for hook in torch_module._global_forward_pre_hooks.values())
        assert not any(hook is module_path._leave for hook in torch_module._global_forward_hooks.values())
    assert keys[0] == keys[1] and keys[0][0], keys


def test_a_compiled_graph_writing_its_input_in_place_is_compared_on_that_write(sim):
    """``x.add_(1.5)`` inside a compiled function returns nothing of ``x``: the graph's outputs alone passed a fault in
    that write (a silent pass); the inputs the graph writes are compared too, as an in-place op's."""
    import torch

    import ditorch.sim

    def scale(x, y):
        x.add_(1.5)
        return (y * 2).sum()

    found = {}
    for fault in ("", "add.*:noise=1e-2"):
        torch._dynamo.reset()  # on sim a fault enters a graph when it is traced
        x, y = torch.randn(16).to(sim), torch.randn(16).to(sim)
        with ditorch.sim.faults(fault), op_tools.OpAutoCompare(compiled="check") as tool:
            torch.compile(scale, backend="aot_eager")(x, y)
        found[fault] = ([f["op"] for f in tool.failures], tool.verdict())
    assert found[""] == ([], "clean"), found
    assert found["add.*:noise=1e-2"] == (["compiled:scale#1"], "found"), found


def test_a_compiled_optimizer_step_is_said_not_checked_never_passed(sim):
    """A compiled optimizer step writes the parameters and their state, which dynamo makes tensors the graph holds,
    and returns nothing: nothing of it was compared, yet it passed (an injected fault in its sqrt found nothing). It
    is counted as not checked, and the tools' own step hooks run outside dynamo (traced, they broke the compilation
    of the tool's judging)."""
    import torch

    import ditorch.sim

    def train(tool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.SiLU(), torch.nn.Linear(16, 4)).to(sim)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step = torch.compile(optimizer.step, backend="aot_eager")
        x = torch.randn(4, 8).to(sim)
        with tool:
            for _ in range(2):
                model(x).square().mean().backward()
                step()
                optimizer.zero_grad()
        return [p.detach().cpu() for p in model.parameters()]

    torch._dynamo.reset()
    plain = train(contextlib.nullcontext())
    torch._dynamo.reset()
    with ditorch.sim.faults("(_foreach_)?sqrt.*:noise=1e-2"):
        checked = train(tool := op_tools.OpAutoCompare(compiled="check"))
    assert tool.failures == [] and tool.verdict() == "unchecked", tool.not_checked()
    assert tool.not_checked().startswith("2 calls not checked (a compiled graph writing tensors it holds"), \
        tool.not_checked()
    torch._dynamo.reset()
    assert all(torch.equal(a, b) for a, b in zip(train(op_tools.OpAutoCompare(compiled="check")), plain))
    assert not all(torch.equal(a, b) for a, b in zip(checked, plain))  # the fault was in the step


OWN_FUNCTIONS = """
import json, sys
import torch
import ditorch, op_tools  # sim through ditorch's transfer: "cuda" is sim
sys.path.append(TESTS)
from tiny_models import tiny_llama

torch.manual_seed(0)
model = tiny_llama(hidden=32, layers=2).cuda()
ids = torch.randint(0, 128, (2, 16)).cuda()
compiled = torch.compile(model, backend="aot_eager")
compiled(input_ids=ids, labels=ids, use_cache=False).loss.backward()  # compiled once before the tool too
with op_tools.OpAutoCompare(compiled="check") as tool:
    compiled(input_ids=ids, labels=ids, use_cache=False).loss.backward()
print(json.dumps({"failures": len(tool.failures), "not_checked": tool.not_checked(),
                  "regions": sorted(name for name in tool.handled if name.startswith("compiled:"))}))
"""


def test_the_tools_own_functions_are_never_compiled_as_the_programs(tmp_path):
    """The eager code between a compiled Llama's graphs (transformers' mask building, after a graph break) runs under
    dynamo's frame hook: the tool handling its calls had its own functions compiled by dynamo as the program's, which
    failed inside dynamo (a call counted not checked: "InternalTorchDynamoError: NameError: name
    '___tuple_iterator_getitem' is not defined"). The tool works with the hook off."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(OWN_FUNCTIONS).replace("TESTS", repr(TESTS))],
                          env=child_env({"DITORCH_BACKEND": "sim", "DITORCH_QUIET": "1",
                                         "OP_TOOLS_RESULTS_DIR": str(tmp_path)}),
                          cwd=tmp_path, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["failures"] == 0 and report["not_checked"] == "", report
    assert report["regions"], report


def _two(block: type):
    """A model of two ``block``s, run one after the other (``blocks.0``, ``blocks.1``)."""
    from torch import nn

    class Blocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([block(), block()])

        def forward(self, x):
            for each in self.blocks:
                x = each(x)
            return x

    return Blocks()


def test_calls_in_code_dynamo_gave_up_on_are_checked_with_their_module(sim):
    """A frame with a graph break in a loop is run eagerly by dynamo, under its frame hook: the mode's
    __torch_function__ and the module-path hooks called from there were compiled as frames of their own, traced down
    their "dynamo traces" branch, so the tool saw none of those calls (a fault in them passed unseen) and named no
    block. They are never compiled as frames now."""
    import torch
    from torch import nn

    import ditorch.sim

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            h = self.lin(x)
            for _ in range(1):
                h = h * 2  # run eagerly: dynamo gives the frame up (a graph break in a loop)
                torch._dynamo.graph_break()
            return h

    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = _two(Block).to(sim), torch.randn(4, 8).to(sim)
    with ditorch.sim.faults("mul.Tensor:noise=1e-1"), op_tools.OpAutoCompare(compiled="check") as tool:
        torch.compile(model, backend="aot_eager")(x).sum()
    assert [(f["op"], f["module"]) for f in tool.failures] == [("torch.Tensor.mul", "blocks.0"),
                                                                 ("torch.Tensor.mul", "blocks.1")], tool.failures


def test_a_graph_run_for_each_of_two_alike_layers_names_each_layers_module(sim):
    """Dynamo records a node's module from the compiled frame's own module (``L['self']``): a frame resumed inside a
    layer after a graph break is one graph, run for every layer, and its diverging node was named ``act`` for both
    (the layer's path was left out: layers 0 and 1 read alike). It is named under the layer running the call."""
    import torch
    from torch import nn

    import ditorch.sim

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.act = nn.Linear(8, 8), nn.SiLU()

        def forward(self, x):
            h = self.lin(x)
            torch._dynamo.graph_break()  # what follows is a frame of its own, resumed in the block
            return self.act(h) * 2

    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = _two(Block).to(sim), torch.randn(4, 8).to(sim)
    with ditorch.sim.faults("silu:noise=1e-1"), op_tools.OpAutoCompare(compiled="check") as tool:
        torch.compile(model, backend="aot_eager")(x).sum()
    found = [(f["module"], f["error_info"].split(";")[0]) for f in tool.failures]
    assert [module for module, _ in found] == ["blocks.0.act", "blocks.1.act"], tool.failures
    assert all(f"torch.nn.functional.silu, {module} in " in said for module, said in found), found


def test_a_layer_compiled_in_place_never_names_a_module_the_model_does_not_have(sim):
    """``layer.compile()`` (regional compilation): each layer's graph is named under that layer. Where the module
    running the graph's call is not the frame's own (no module hooks ran for it), the path inside the frame is named
    alone, never a module no model holds (``model.act``)."""
    import torch
    from torch import nn

    import ditorch.sim

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.act = nn.Linear(8, 8), nn.SiLU()

        def forward(self, x):
            return self.act(self.lin(x))

    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = _two(Block)

        def forward(self, x):
            return self.model(x)

    torch._dynamo.reset()
    torch.manual_seed(0)
    root, x = Root().to(sim), torch.randn(4, 8).to(sim)
    for block in root.model.blocks:
        block.compile(backend="aot_eager")
    with ditorch.sim.faults("silu:noise=1e-1"), op_tools.OpAutoCompare(compiled="check") as tool:
        root(x).sum()
    assert [f["module"] for f in tool.failures] == ["model.blocks.0.act", "model.blocks.1.act"], tool.failures
