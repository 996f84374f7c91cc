import pytest
import torch
from tiny_models import train_llama

import op_tools


def test_llama_losses_are_bit_identical_and_nothing_is_reported(sim):
    base = train_llama(sim, steps=2)
    with op_tools.OpOverflowCheck() as check:
        assert train_llama(sim, steps=2) == base
    assert check.first_overflow is None


def test_names_the_op_where_nan_appears_in_forward(sim):
    import ditorch.sim

    with ditorch.sim.faults("silu:nan"), op_tools.OpOverflowCheck() as check:
        train_llama(sim, steps=1)
    found = check.first_overflow
    assert (found.name, found.phase) == ("torch.nn.functional.silu", "forward")
    assert "modeling" in found.location or "activations.py" in found.location


def test_names_the_op_where_nan_appears_in_backward(sim):
    import ditorch.sim

    with ditorch.sim.faults("embedding_dense_backward:nan"), op_tools.OpOverflowCheck() as check:
        train_llama(sim, steps=1)
    found = check.first_overflow
    assert (found.name, found.phase) == ("torch.nn.functional.embedding", "backward")
    assert "embed_tokens(input_ids)" in found.location


def test_nan_inside_a_composite_function_backward_names_the_function(sim):
    # cross_entropy records log_softmax and nll_loss nodes; the nan is born in the inner one.
    import ditorch.sim

    with ditorch.sim.faults("_log_softmax_backward_data:nan"), op_tools.OpOverflowCheck() as check:
        train_llama(sim, steps=1)
    found = check.first_overflow
    assert (found.name, found.phase) == ("torch.nn.functional.cross_entropy", "backward")


@pytest.mark.parametrize("listing", [None, "torch.nn.functional.silu,torch.nn.functional.embedding"])
@pytest.mark.parametrize("fault", ["silu:nan", "embedding_dense_backward:nan"])
def test_raise_stops_at_the_first_overflow(sim, monkeypatch, fault, listing):
    # With a list of plain names the tool wraps those functions (and backward(), where it raises) instead of a mode.
    import ditorch.sim

    monkeypatch.setenv("OP_OVERFLOW_CHECK_RAISE", "1")
    if listing:
        monkeypatch.setenv("OP_OVERFLOW_CHECK_LIST", listing)
    with ditorch.sim.faults(fault), op_tools.OpOverflowCheck():
        with pytest.raises(op_tools.OverflowDetectedError, match="first inf/nan from finite inputs"):
            train_llama(sim, steps=1)


def test_statistics_table_has_the_original_columns(sim, capsys, monkeypatch):
    monkeypatch.setenv("OP_TOOLS_VERBOSE", "1")
    x = torch.tensor([1.0, 2.0, float("inf")], device=sim)
    with op_tools.OpOverflowCheck() as check:
        x * 2
    out = capsys.readouterr().out
    for column in ("inf_or_nan", "min", "max", "mean", "std", "norm"):
        assert f" {column} " in out
    assert check.first_overflow is None  # the input already held inf
