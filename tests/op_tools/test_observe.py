import os

import torch
from tiny_models import train_llama

import op_tools


def test_observe_prints_header_location_and_argument_table(sim, capsys, monkeypatch):
    monkeypatch.setenv("OP_TOOLS_VERBOSE", "1")
    x = torch.ones(2, 3, device=sim)
    with op_tools.OpObserve():
        y = torch.add(x, 2, alpha=3)
    out = capsys.readouterr().out
    assert "torch.add    forward_id:" in out
    assert f"{os.path.basename(__file__)}:" in out and "y = torch.add(x, 2, alpha=3)" in out
    for column in ("name", "device", "dtype", "numel", "shape", "stride", "requires_grad", "layout", "data_ptr",
                   "value"):
        assert f" {column} " in out
    assert "torch.add inputs[0]" in out and "torch.add [alpha]" in out and "torch.add outputs[0]" in out
    assert str(y.data_ptr()) in out


def test_print_stack_shows_the_whole_user_stack(sim, capsys, monkeypatch):
    monkeypatch.setenv("OP_TOOLS_VERBOSE", "1")
    monkeypatch.setenv("OP_TOOLS_PRINT_STACK", "1")

    def inner(x):
        return x.sin()

    with op_tools.OpObserve():
        inner(torch.ones(2, device=sim))
    out = capsys.readouterr().out
    assert "return x.sin()" in out and "inner(torch.ones(2, device=sim))" in out


def test_verbose_0_silences_the_tables(sim, capsys):
    with op_tools.OpObserve():
        torch.ones(2, device=sim).sin()
    out = capsys.readouterr().out
    assert "forward_id" not in out and "+---" not in out


def test_llama_losses_are_bit_identical_under_observe(sim):
    base = train_llama(sim, steps=2)
    with op_tools.OpObserve():
        assert train_llama(sim, steps=2) == base
