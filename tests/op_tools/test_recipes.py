"""The tools on training recipes the zoo (tests/zoo.py) has not: parametrizations, evaluation with PyTorch's fused
inference paths, ... Each a few calls on sim: a clean recipe fails nothing and keeps its numbers."""

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
