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
    assert found.module == "model.layers.0.mlp.act_fn" and "in model.layers.0.mlp.act_fn" in str(found)


def test_names_the_op_where_nan_appears_in_backward(sim):
    import ditorch.sim

    with ditorch.sim.faults("embedding_dense_backward:nan"), op_tools.OpOverflowCheck() as check:
        train_llama(sim, steps=1)
    found = check.first_overflow
    assert (found.name, found.phase) == ("torch.nn.functional.embedding", "backward")
    assert "embed_tokens(input_ids)" in found.location
    assert found.module == "model.embed_tokens"  # the module of the forward call whose backward it is


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


def test_statistics_table_has_the_original_columns(sim, logged, monkeypatch):
    monkeypatch.setenv("OP_TOOLS_VERBOSE", "1")
    x = torch.tensor([1.0, 2.0, float("inf")], device=sim)
    with op_tools.OpOverflowCheck() as check:
        x * 2
    out = logged()
    for column in ("inf_or_nan", "min", "max", "mean", "std", "norm"):
        assert f" {column} " in out
    assert check.first_overflow is None  # the input already held inf


def _count_device_reads(monkeypatch) -> list:
    """Each read of sim data by the host (a host synchronisation on a real device), appended as it happens: a scalar
    read (``.item()``, ``bool()``) or a copy to the CPU, as aten ops reach the sim device's ``run_op``."""
    import ditorch.sim.tensor

    reads = []
    real = ditorch.sim.tensor.run_op

    def spy(func, args, kwargs):
        name = func._schema.name
        on_sim = [isinstance(a, torch.Tensor) and a.device.type == "sim" for a in args]
        if (name == "aten::_local_scalar_dense" or (name == "aten::_to_copy" and any(on_sim)
                                                    and torch.device(kwargs.get("device") or "sim").type == "cpu")
                or (name == "aten::copy_" and not on_sim[0] and on_sim[1])):
            reads.append(name)
        return real(func, args, kwargs)

    monkeypatch.setattr(ditorch.sim.tensor, "run_op", spy)
    return reads


def _reads_per_step(tool, reads) -> list[tuple[str, int]]:
    """Wrap the tool's per-call steps: ``(step, device reads during it)`` for each invocation."""
    per_call = []

    def counted(step_name):
        step = getattr(tool, step_name)

        def wrapper(*args):
            before = len(reads)
            try:
                return step(*args)
            finally:
                per_call.append((step_name, len(reads) - before))

        setattr(tool, step_name, wrapper)

    for step_name in ("after", "after_backward", "inner_node_backward"):
        counted(step_name)
    return per_call


@pytest.mark.parametrize("verbose", ["0", "1"])
def test_at_most_one_host_synchronisation_per_handled_call(sim, monkeypatch, verbose, logged):
    monkeypatch.setenv("OP_TOOLS_VERBOSE", verbose)
    reads = _count_device_reads(monkeypatch)
    check = op_tools.OpOverflowCheck()
    per_call = _reads_per_step(check, reads)
    with check:
        train_llama(sim, steps=1)
    assert check.first_overflow is None
    steps = {name for name, _ in per_call}
    assert {"after", "after_backward", "inner_node_backward"} <= steps and len(per_call) > 200
    assert max(n for _, n in per_call) == 1  # the spy sees the one read; never more than one per call
    assert sum(n for _, n in per_call) > 0.5 * len(per_call)
    if verbose == "1":
        assert "torch.nn.functional.silu    forward_id" in logged() and "| output[0] |" in logged()


def test_statistics_are_computed_for_the_overflowing_call_and_nothing_is_read_after_it(sim, monkeypatch, logged):
    import ditorch.sim

    reads = _count_device_reads(monkeypatch)
    check = op_tools.OpOverflowCheck()
    per_call = _reads_per_step(check, reads)
    x, w = torch.ones(2, 4, device=sim), torch.randn(4, 4, device=sim)
    with ditorch.sim.faults("silu:inf"), check:
        h = torch.nn.functional.linear(x, w)
        torch.nn.functional.silu(h) * 2 + 1
    assert check.first_overflow.name == "torch.nn.functional.silu"
    assert [n for _, n in per_call] == [1, 2, 0, 0]  # linear, silu (flags, then its statistics), mul, add
    out = logged()
    assert "OpOverflowCheck: first inf/nan from finite inputs: torch.nn.functional.silu (forward)" in out
    assert "|    name   | inf_or_nan |" in out  # the op is named in the line above the table
    assert "| output[0] |    True    |" in out and "|  input[0] |   False    |" in out


def test_statistics_keep_the_values_of_the_original_computation(sim):
    from op_tools.tools.overflow_check import statistics_rows

    values = torch.tensor([[1.0, -2.0], [3.5, float("nan")]])
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        t = values.to(dtype)
        finite = t[0]
        (row, finite_row, ints, empty) = statistics_rows([("t", t.to(sim)), ("f", finite.to(sim)),
                                                          ("i", torch.arange(4, device=sim)),
                                                          ("e", torch.empty(0, device=sim))])
        assert row["inf_or_nan"] and not finite_row["inf_or_nan"] and not ints["inf_or_nan"]
        wide = finite.double() if dtype == torch.float64 else finite.float()
        assert finite_row["min"] == wide.min().item() and finite_row["max"] == wide.max().item()
        assert finite_row["mean"] == wide.mean().item() and finite_row["norm"] == wide.norm().item()
        assert finite_row["std"] == wide.std(correction=0).item()
        assert (ints["min"], ints["max"], ints["mean"]) == (0.0, 3.0, 1.5)
        assert empty == {"name": "e", "inf_or_nan": False}


def test_a_backend_without_foreach_norm_is_checked_tensor_by_tensor(sim, monkeypatch):
    import ditorch.sim

    def unsupported(*args, **kwargs):
        raise NotImplementedError("_foreach_norm is not implemented for this backend")

    monkeypatch.setattr(torch, "_foreach_norm", unsupported)
    monkeypatch.setattr("op_tools.tools.overflow_check._no_foreach_norm", set())
    with ditorch.sim.faults("silu:nan"), op_tools.OpOverflowCheck() as check:
        train_llama(sim, steps=1)
    assert (check.first_overflow.name, check.first_overflow.phase) == ("torch.nn.functional.silu", "forward")
