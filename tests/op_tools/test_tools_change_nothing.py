"""A tool changes nothing a script can observe, and compares only what has a reference.

The ditorch cases run in a child process (``DITORCH_BACKEND=sim`` patches ``torch.Tensor`` for the whole process):
one child per script below, every tool in it, each test reading its tool's part.
"""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from subprocess_env import env_without_settings

import op_tools
from op_tools.numerics.comparison import compare_outputs

TOOLS = sorted(cls.__name__ for cls in op_tools.FEATURES.values())


def _run_child(code: str, tmp_path) -> dict:
    """Run ``code`` with every tool's name as its arguments, on sim shown as cuda; its last line, read as JSON."""
    env = env_without_settings({"DITORCH_BACKEND": "sim", "DITORCH_QUIET": "1", "OP_TOOLS_VERBOSE": "0",
                                "OP_TOOLS_RESULTS_DIR": str(tmp_path / "results")})
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *TOOLS], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _nothing_cast(tool: str, warning: str) -> bool:
    """OpDtypeCast's closing line over a float32 program, which its default table (float16, bfloat16) leaves as it
    is: said, and the numbers are unchanged."""
    return tool == "OpDtypeCast" and "(0 cast)" in warning and "no call was cast: none had an input in a dtype" in \
        warning


# Every tool started around reads of tensor properties: what each read gives inside the tool, and outside it.
PROPERTIES = """
    import contextlib, json, logging, sys
    import torch, ditorch, op_tools

    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("op_tools").addHandler(handler)

    x = torch.randn(2, 3, device="cuda", requires_grad=True)
    tensors = {"leaf": x, "result": x * 2 + 1, "ints": torch.arange(3, device="cuda"), "host": torch.ones(2)}

    def reads(t):
        return [t.is_cuda, t.is_cpu, str(t.device), t.device.type, t.get_device(), str(t.dtype), t.is_leaf,
                t.requires_grad, list(t.shape), list(t.stride()), t.grad_fn is None, str(t.layout),
                t.__reduce_ex__(2)[1][2] if t.is_cuda else "", str(torch.device(t.device)),
                str(torch._C._nn._parse_to(t.device)[0])]

    def everything():
        seen = {label: reads(t) for label, t in tensors.items()}
        seen["computed inside"] = reads(x * 2 + 1)
        seen["a product"] = reads(torch.nn.functional.linear(x, x))  # one call each tool handles (OpSelfCheck's)
        return seen

    report = {"outside": everything()}
    for name in sys.argv[1:]:
        warnings.clear()
        with getattr(op_tools, name)():
            report[name] = everything()
        report[name + " warnings"] = list(warnings)

    # The program's own torch-function mode, entered before a tool starts: the calls it sees of a training step.
    class Seen(torch.overrides.TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            getter = getattr(func, "__qualname__", "").endswith("__get__")
            self.calls.append("a property read" if getter else getattr(func, "__name__", repr(func)))
            return func(*args, **(kwargs or {}))

    linear = torch.nn.Linear(3, 3, device="cuda")

    def a_step(tool):
        with Seen() as seen:
            with tool or contextlib.nullcontext():
                torch.nn.functional.gelu(linear(x)).sum().backward()
        return seen.calls

    report["seen by the program's mode"] = {"none": a_step(None)}
    for name in sys.argv[1:]:
        report["seen by the program's mode"][name] = a_step(getattr(op_tools, name)())
    print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def properties(tmp_path_factory):
    return _run_child(PROPERTIES, tmp_path_factory.mktemp("properties"))


@pytest.mark.parametrize("tool", TOOLS)
def test_tensor_properties_read_the_same_inside_a_tool_as_outside(properties, tool):
    assert properties["outside"]["leaf"][:3] == [True, False, "cuda:0"]  # ditorch shows the sim device as cuda
    assert properties[tool] == properties["outside"]
    assert [w for w in properties[tool + " warnings"] if not _nothing_cast(tool, w)] == []


@pytest.mark.parametrize("tool", TOOLS)
def test_a_programs_own_torch_function_mode_sees_its_calls_not_the_tools(properties, tool):
    seen = properties["seen by the program's mode"]
    assert {"linear", "gelu", "sum", "backward"} <= set(seen["none"])
    if tool in ("OpFallback", "OpDtypeCast"):  # asked to run calls otherwise: the runs in the device's place are
        # theirs, and their checks of a call's tensors read its metadata first
        assert set(seen[tool]) <= {*seen["none"], "a property read"}
    else:  # not the thousands of torch calls a tool's own work makes (statistics, references, events)
        assert seen[tool] == seen["none"]


@pytest.mark.usefixtures("sim")
def test_tensor_operators_are_compared_with_no_tool_failure(logged):
    a, b = torch.randn(3, 3, device="sim"), torch.randn(3, 3, device="sim")
    mask, ints = a > 0, torch.arange(9, device="sim").view(3, 3)
    operators = [lambda: a == b, lambda: a != b, lambda: a < b, lambda: -a, lambda: +a, lambda: abs(a),
                 lambda: a @ b, lambda: a[0], lambda: ~mask, lambda: mask & mask, lambda: mask | mask,
                 lambda: mask ^ mask, lambda: ints << 1, lambda: ints >> 1, lambda: a ** 2, lambda: 2 ** a,
                 lambda: 1 - a, lambda: 2 / a, lambda: a // 2, lambda: 2 // a, lambda: 2 % a]
    with op_tools.OpAutoCompare() as compare:
        for operator in operators:
            operator()
    assert "failed on" not in logged()
    assert compare.counts["forward compared"] == len(operators)
    assert compare.counts["forward passed"] == len(operators)
    assert not compare.skipped


def test_only_in_place_operators_write_their_operand():
    from op_tools.ops.writes import call_writes

    x = torch.ones(2, dtype=torch.bool)
    assert call_writes("torch.Tensor.__invert__").written((x,), {}) == []
    assert call_writes("torch.Tensor.__eq__").written((x, x), {}) == []
    assert call_writes("torch.Tensor.__iand__").written((x, x), {}) == [x]


def test_every_tensor_operator_names_an_aten_op():
    from op_tools.ops.naming import OPERATOR_ATEN_OPS

    for operator, aten in OPERATOR_ATEN_OPS.items():
        assert isinstance(getattr(torch.ops.aten, aten), torch._ops.OpOverloadPacket), operator


@pytest.mark.usefixtures("sim")
def test_calls_returning_devices_are_not_failed_against_the_cpu(logged):
    t = torch.ones(2, device="sim")
    with op_tools.OpAutoCompare() as compare:
        assert torch.device(t.device) == t.device
        assert torch._C._nn._parse_to(t.device)[0] == t.device
    assert compare.failures == []
    assert "failed on" not in logged()


def test_a_device_in_a_result_is_compared_through_the_device_mapping():
    x = torch.ones(2)
    passed = compare_outputs((torch.device("sim", 0), x), (torch.device("cpu"), x))
    assert [c.passed for c in passed] == [True, True]
    assert not compare_outputs(torch.device("cpu"), torch.device("meta"))[0].passed


# One step of transformers' Trainer on a tiny Llama, without a tool and under each: the loss, what a callback reads
# of the parameters after the step, and what op_tools warned of.
TRAINER_STEP = """
    import json, logging, sys, tempfile
    import torch, ditorch, op_tools
    from tiny_models import tiny_llama
    from transformers import Trainer, TrainerCallback, TrainingArguments

    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage()[:300])
    logging.getLogger("op_tools").addHandler(handler)

    class Batches(torch.utils.data.Dataset):
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    class Reads(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            p = model.model.embed_tokens.weight
            self.seen = [p.is_cuda, str(p.device), str(p.dtype), p.is_leaf, p.requires_grad, p.grad is None]

    def one_step(tool):
        torch.manual_seed(0)
        reads = Reads()
        with tempfile.TemporaryDirectory() as out:
            args = TrainingArguments(output_dir=out, max_steps=1, per_device_train_batch_size=2, report_to=[],
                                     use_cpu=False, save_strategy="no", logging_strategy="no", disable_tqdm=True)
            trainer = Trainer(model=tiny_llama(layers=1), args=args, train_dataset=Batches(), callbacks=[reads])
            warnings.clear()
            if tool is None:
                loss = trainer.train().training_loss
            else:
                with tool:
                    loss = trainer.train().training_loss
        found = {"loss": loss, "reads": reads.seen, "warnings": list(warnings)}
        if isinstance(tool, op_tools.OpAutoCompare):
            found["compared"] = tool.counts["forward compared"]
        return found

    report = {"none": one_step(None)}
    for name in sys.argv[1:]:
        report[name] = one_step(getattr(op_tools, name)())
    print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def trainer_steps(tmp_path_factory):
    pytest.importorskip("accelerate")
    return _run_child(TRAINER_STEP, tmp_path_factory.mktemp("trainer"))


@pytest.mark.parametrize("tool", TOOLS)
def test_a_transformers_trainer_step_under_a_tool_is_unchanged_and_clean(trainer_steps, tool):
    plain, under = trainer_steps["none"], trainer_steps[tool]
    assert plain["reads"][:2] == [True, "cuda:0"]  # the Trainer put the model on the (sim) cuda device
    # no failure, no call the tool failed on, nothing unchecked (but OpDtypeCast's: its table met no dtype to cast)
    assert [w for w in under["warnings"] if not _nothing_cast(tool, w)] == []
    assert under["loss"] == plain["loss"]
    assert under["reads"] == plain["reads"]
    if tool == "OpAutoCompare":
        assert under["compared"] > 100
