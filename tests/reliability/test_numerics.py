"""Tools never change the numbers a run computes: 5 training steps give bit-identical losses under each tool."""

from __future__ import annotations

import functools

import pytest
from tiny_models import tiny_llama, train_llama

import op_tools

one_layer_llama = functools.partial(tiny_llama, layers=1)
TOOLS = [op_tools.OpCapture, op_tools.OpObserve, op_tools.OpOverflowCheck, op_tools.OpTimeMeasure,
         op_tools.OpAutoCompare]


@pytest.fixture(scope="module")
def losses_without_tool(sim):
    return train_llama(sim, steps=5, model_factory=one_layer_llama)


@pytest.mark.parametrize("tool", TOOLS, ids=lambda t: t.__name__)
def test_five_step_losses_are_bit_identical_under_the_tool(tool, losses_without_tool, sim, capsys):
    with tool():
        losses = train_llama(sim, steps=5, model_factory=one_layer_llama)
    assert losses == losses_without_tool  # exact float equality, not allclose
    assert len(set(losses)) == 5  # the model did train: five different losses
