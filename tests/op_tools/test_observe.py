import os
import re

import torch
from tiny_models import train_llama

import op_tools
from op_tools.output import reporting


def test_observe_logs_header_location_and_argument_table(sim, logged, monkeypatch):
    monkeypatch.setenv("OP_TOOLS_VERBOSE", "1")
    x = torch.ones(2, 3, device=sim)
    with op_tools.OpObserve():
        y = torch.add(x, 2, alpha=3)
    out = logged()
    assert "torch.add    forward_id:" in out
    assert f"{os.path.basename(__file__)}:" in out and "y = torch.add(x, 2, alpha=3)" in out
    for column in reporting.CONSOLE_ARG_COLUMNS:  # the original's columns less numel, layout, data_ptr: 120 wide
        assert f" {column} " in out
    for cell in ("inputs[0]", "[alpha]", "outputs[0]"):  # the op is named in the header line above the table
        assert re.search(rf"\|\s+{re.escape(cell)}\s+\|", out), cell
    assert str(y.shape) in out


def test_print_stack_shows_the_whole_user_stack(sim, logged, monkeypatch):
    monkeypatch.setenv("OP_TOOLS_VERBOSE", "1")
    monkeypatch.setenv("OP_TOOLS_PRINT_STACK", "1")

    def inner(x):
        return x.sin()

    with op_tools.OpObserve():
        inner(torch.ones(2, device=sim))
    out = logged()
    assert "return x.sin()" in out and "inner(torch.ones(2, device=sim))" in out


def test_verbose_0_silences_the_tables(sim, logged):
    with op_tools.OpObserve():
        torch.ones(2, device=sim).sin()
    out = logged()
    assert "forward_id" not in out and "+---" not in out


def test_llama_losses_are_bit_identical_under_observe(sim):
    base = train_llama(sim, steps=2)
    with op_tools.OpObserve():
        assert train_llama(sim, steps=2) == base
