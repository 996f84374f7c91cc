"""The tools on training recipes the zoo (tests/zoo.py) has not: parametrizations, evaluation with PyTorch's fused
inference paths, ... Each a few calls on sim: a clean recipe fails nothing and keeps its numbers."""

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.nn.utils import parametrizations

import op_tools


def test_normalize_into_out_is_compared_on_what_it_wrote(sim):
    """F.normalize(..., out=u) is a Python function: no aten schema says it writes ``out``. The host copy taken of
    ``u`` (its zeros) served as its result: a false failure."""
    torch.manual_seed(0)
    x = torch.randn(16, device=sim)
    with op_tools.OpAutoCompare() as tool:
        for _ in range(2):
            x, into = x * 3, torch.ones(16, device=sim)  # results: their host copies are kept, into's ones too
            result = F.normalize(x, dim=0, out=into)
            assert result is into
    assert tool.failures == [] and tool.counts["forward passed"] == 6, tool.failures


def test_a_spectral_norm_training_step_is_clean_under_autocompare(sim):
    """spectral_norm's power iteration normalises into its ``u`` and ``v`` buffers (``out=``) at every training
    forward: each iteration's input copy of the buffer was compared as its result."""
    torch.manual_seed(0)
    model = nn.Sequential(parametrizations.spectral_norm(nn.Linear(16, 16)), nn.Tanh(), nn.Linear(16, 4)).to(sim)
    x, y = torch.randn(8, 16, device=sim), torch.randint(0, 4, (8,), device=sim)
    with op_tools.OpAutoCompare() as tool:
        for _ in range(2):
            F.cross_entropy(model(x), y).backward()
    assert tool.failures == [], [(f["op"], f["error_info"]) for f in tool.failures[:3]]
    assert tool.verdict() == "clean"


def _eval_attention(kind: str, device: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "MultiheadAttention":
        return nn.MultiheadAttention(8, 2, batch_first=True).to(device).eval()
    return nn.TransformerEncoderLayer(8, 2, 16, batch_first=True).to(device).eval()


def _evaluate(module: nn.Module, device: str) -> torch.Tensor:
    torch.manual_seed(1)
    x = torch.randn(2, 5, 8, device=device)
    padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2], device=device)
    with torch.no_grad():
        if isinstance(module, nn.MultiheadAttention):
            return module(x, x, x, key_padding_mask=padding)[0]
        return module(x, src_key_padding_mask=padding)


FUSED = {"MultiheadAttention": "_native_multi_head_attention",
         "TransformerEncoderLayer": "_transformer_encoder_layer_fwd"}


@pytest.mark.parametrize("kind", FUSED)
def test_an_evaluation_under_a_tool_takes_the_fused_path_it_takes_without_it(sim, kind):
    """In eval mode without grad these modules run one fused kernel unless torch.overrides.has_torch_function, which
    any mode on the stack made True: under a tool they computed another way (other numbers), and a fault in the fused
    kernel the run uses passed as clean."""
    import ditorch.sim

    module = _eval_attention(kind, sim)
    expected = _evaluate(module, sim)
    for tool_class in (op_tools.OpObserve, op_tools.OpAutoCompare, op_tools.OpCapture, op_tools.OpOverflowCheck):
        with tool_class():
            assert torch.equal(_evaluate(module, sim).cpu(), expected.cpu()), tool_class.__name__
    assert torch.overrides.has_torch_function is torch._C._has_torch_function  # torch's own again once stopped
    with ditorch.sim.faults(f"{FUSED[kind]}:noise=1e-2"), op_tools.OpAutoCompare() as tool:
        _evaluate(module, sim)
    assert tool.failures and tool.failures[0]["op"] == f"torch.{FUSED[kind]}", tool.failures[:1]


def test_under_a_users_own_mode_the_fused_path_stays_refused_as_without_the_tool(sim):
    """A user's TorchFunctionMode would see the fused call's parts: with a tool on top of it the module keeps the path
    it takes under that mode alone."""
    from torch.overrides import TorchFunctionMode

    class Passing(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    module = _eval_attention("MultiheadAttention", sim)
    with Passing():
        expected = _evaluate(module, sim)
        with op_tools.OpAutoCompare():
            result = _evaluate(module, sim)
    assert torch.equal(result.cpu(), expected.cpu())


def _record_fused_sgd(folder, monkeypatch, fault: str | None = None):
    """Two fused SGD steps with momentum, recorded (OpCapture in stats mode) under ``folder``."""
    import contextlib

    import ditorch.sim

    monkeypatch.setenv("OP_TOOLS_RESULTS_DIR", str(folder))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).to("sim")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, fused=True)
    x, y = torch.randn(8, 8, device="sim"), torch.randint(0, 4, (8,), device="sim")
    with ditorch.sim.faults(fault) if fault else contextlib.nullcontext(), op_tools.OpCapture(mode="stats"):
        for _ in range(2):
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    return str(folder)


def test_two_identical_fused_sgd_runs_agree(sim, tmp_path, monkeypatch):
    """At its first step fused SGD fills its momentum buffers, torch.empty_like's memory, without reading them: their
    statistics (whatever each run's memory held) were compared as its inputs, a divergence between identical runs."""
    from op_tools.offline.compare_runs import compare

    result = compare(_record_fused_sgd(tmp_path / "a", monkeypatch), _record_fused_sgd(tmp_path / "b", monkeypatch))
    assert result.first_divergence() is None, result.first_divergence()


def test_a_fault_in_a_fused_optimizer_step_is_found_in_that_step(sim, tmp_path, monkeypatch):
    """A fused optimizer's step returns nothing: its records held no outputs, so a fault in it showed first in the
    next forward's linear, said to come from outside the recording. What its schema says it wrote is its result."""
    from op_tools.offline.compare_runs import compare

    result = compare(_record_fused_sgd(tmp_path / "a", monkeypatch),
                     _record_fused_sgd(tmp_path / "b", monkeypatch, fault="_fused_sgd_:noise=1e-2"))
    found = result.first_divergence()
    assert found is not None and found.op == "torch._fused_sgd_", found


def test_a_patch_of_has_torch_function_made_while_a_tool_runs_outlives_the_next_starts(sim):
    """The tools answer torch.overrides.has_torch_function for two forwards while their mode is on; another
    library's patch made meanwhile must survive their stop and their next start and stop."""
    theirs_called = []
    with op_tools.OpObserve():
        ours = torch.overrides.has_torch_function

        def theirs(args):
            theirs_called.append(1)
            return ours(args)

        torch.overrides.has_torch_function = theirs
    try:
        assert torch.overrides.has_torch_function is theirs
        with op_tools.OpObserve():
            assert torch.overrides.has_torch_function is theirs
        assert torch.overrides.has_torch_function is theirs
        torch.overrides.has_torch_function((torch.ones(1),))
        assert theirs_called
    finally:
        from op_tools.core import fast_paths

        torch.overrides.has_torch_function = fast_paths._original
