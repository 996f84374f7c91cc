"""Per-op facts in one registry: a user's own op declared random or writing is treated so by OpAutoCompare."""

import contextlib
import os

import pytest
import torch
from torch.overrides import handle_torch_function, has_torch_function

import op_tools
from op_tools.ops.op_facts import OpFacts, op_facts


@pytest.fixture(autouse=True)
def _no_autocompare_variables(monkeypatch):
    for name in list(os.environ):
        if "AUTOCOMPARE" in name:
            monkeypatch.delenv(name)


def noisy_dropout(x, p=0.5, training=True):
    """A user's op that draws random numbers when it trains."""
    if has_torch_function((x,)):
        return handle_torch_function(noisy_dropout, (x,), x, p, training)
    return x * (torch.rand_like(x) > p) / (1 - p) if training and p > 0 else x * 1.0


def undeclared_noise(x):
    if has_torch_function((x,)):
        return handle_torch_function(undeclared_noise, (x,), x)
    return x + torch.rand_like(x)


def scale_(x, factor):
    """A user's op that writes its first argument in place, through a kernel op_tools does not see."""
    if has_torch_function((x,)):
        return handle_torch_function(scale_, (x, factor), x, factor)
    with torch.no_grad():
        x.mul_(factor)


def undeclared_scale_(x, factor):
    if has_torch_function((x,)):
        return handle_torch_function(undeclared_scale_, (x, factor), x, factor)
    with torch.no_grad():
        x.mul_(factor)


def test_a_declared_random_op_is_skipped_as_random_before_it_runs_and_compared_when_it_draws_nothing(sim):
    op_tools.register_op_facts(noisy_dropout, draws_when=((1, "p", 0.5), (2, "training", True)))
    x = torch.ones(16, device=sim)
    with op_tools.OpAutoCompare() as tool:
        noisy_dropout(x, 0.3)
        noisy_dropout(x, 0.3, training=False)
    assert dict(tool.skipped) == {"random": 1}  # known by its declaration, not caught after the device drew
    assert tool.counts["forward compared"] == 1 and tool.failures == []

    with op_tools.OpAutoCompare() as tool:
        undeclared_noise(x)
    assert "random" not in tool.skipped  # caught only once the device's generator moved


def test_a_declared_write_is_compared(sim):
    import ditorch.sim

    op_tools.register_op_facts(scale_, writes=((0, "x"),))
    x, y = torch.ones(8, device=sim), torch.ones(8, device=sim)
    with op_tools.OpAutoCompare() as tool, ditorch.sim.faults("mul_:noise=1e-2"):
        scale_(x, 3.0)
        undeclared_scale_(y, 3.0)  # may write anything: its writes are not compared
    assert [f["op"] for f in tool.failures] == [f"{__name__}.scale_"]
    assert tool.failures[0]["failing"] == "written input[0]"


def test_declared_facts_merge_by_name_namespace_and_short_name():
    op_tools.register_op_facts("facts_test_op", rounded_once=True)
    op_tools.register_op_facts("facts_lib.*", random=True)
    op_tools.register_op_facts("facts_lib.facts_test_op", algorithm_ratio=8)
    facts = op_facts("facts_lib.facts_test_op_")  # the in-place variant takes its out-of-place op's short-name facts
    assert (facts.rounded_once, facts.random, facts.algorithm_ratio) == (True, True, None)
    assert op_facts("facts_lib.facts_test_op").algorithm_ratio == 8.0
    assert op_facts("other.facts_test_op") == OpFacts(rounded_once=True)
    assert op_facts("no.such_op") == OpFacts()


@pytest.mark.parametrize("op, facts, error, named", [
    ("mylib.op", {"randm": True}, TypeError, "randm"),
    ("mylib.op", {"random": "yes"}, ValueError, "random"),
    ("mylib.op", {"writes": 0}, ValueError, "writes"),
    ("mylib.op", {"writes": (("x", 0),)}, ValueError, "writes"),
    ("mylib.op", {"draws_when": (1, "p", 0.5)}, ValueError, "draws_when"),
    ("mylib.op", {"algorithm_ratio": 0.5}, ValueError, "algorithm_ratio"),
    ("mylib..op", {"random": True}, ValueError, "op="),
    (3, {"random": True}, TypeError, "op="),
])
def test_bad_arguments_raise_naming_them(op, facts, error, named):
    with pytest.raises(error, match=named):
        op_tools.register_op_facts(op, **facts)
    assert op_facts("mylib.op") == OpFacts()


def test_the_registry_holds_what_op_tools_knows_of_torch_ops():
    assert op_facts("torch.Tensor.view").view and op_facts("torch.Tensor.to").conversion
    assert op_facts("torch.nn.functional.batch_norm").writes == ((1, "running_mean"), (2, "running_var"))
    assert op_facts("torch.nn.functional.batch_norm").writes_when == (5, "training", False)
    assert op_facts("torch.Tensor.bernoulli_").random and op_facts("torch.nn.init.kaiming_uniform_").random
    assert op_facts("torch.nn.functional.dropout").draws_when == ((1, "p", 0.5), (2, "training", True))
    assert op_facts("torch.dropout_").draws_when == ((1, "p", 0.0), (2, "train", True))
    assert op_facts("torch.nn.functional.multi_head_attention_forward").composite
    assert op_facts("mm").lower_precision == "matmul" and op_facts("convolution_backward").lower_precision == "conv"
    assert op_facts("torch.nn.functional.scaled_dot_product_attention").algorithm_ratio == 16.0
    assert op_facts("torch.empty_like").uninitialised and op_facts("torch.Tensor.resize_").uninitialised
    assert op_facts("torch.Tensor.mul_").rounded_once and not op_facts("torch.mm").rounded_once


def test_functional_collectives_are_collectives_and_those_that_move_no_tensor_never_compared():
    from op_tools.tools.autocompare import skip_reason

    for name in ("_c10d_functional._wrap_tensor_autograd.default", "_c10d_functional.wait_tensor.default",
                 "torch.distributed.barrier"):
        assert op_facts(name).collective, name
        assert skip_reason(name).startswith("collective"), name
    assert not op_facts("torch.nn.functional.linear").collective
    # the collectives with a known signature are checked against every rank's inputs instead
    for name in ("torch.distributed.all_reduce", "_c10d_functional.all_reduce.default",
                 "_c10d_functional_autograd.all_to_all_single"):
        assert op_facts(name).collective and skip_reason(name) is None, name


def test_a_functional_collectives_result_is_read_only_once_waited_for():
    assert op_facts("_c10d_functional.all_reduce.default").async_result
    assert op_facts("_c10d_functional.all_gather_into_tensor.default").async_result
    waited = op_facts("_c10d_functional.wait_tensor.default")
    assert waited.completes and not waited.async_result and waited.collective
    assert not op_facts("torch.distributed.all_reduce").async_result  # returns once done (or hands back a Work)


def test_every_tensor_method_torch_tags_as_an_in_place_view_is_a_view():
    # They change a tensor's shape or strides, not its values: run on a copy (OpFallback's CPU one, OpDtypeCast's
    # wider one), the caller's tensor kept its shape and took the copy's values, or the user's call raised.
    import torch

    tagged = []
    for name in dir(torch.Tensor):
        packet = getattr(torch.ops.aten, name, None) if name.endswith("_") and not name.startswith("__") else None
        if isinstance(packet, torch._ops.OpOverloadPacket) and any(
                torch.Tag.inplace_view in getattr(packet, overload).tags for overload in packet.overloads()):
            tagged.append(name)
    assert "unsqueeze_" in tagged and "resize_" in tagged
    assert [name for name in tagged if not op_facts(f"torch.Tensor.{name}").view] == []
    assert op_facts("torch.as_strided_").view and op_facts("torch.resize_as_").view


# Each op said to compute nothing (``alias_only``), called as a program calls it
ALIAS_ONLY_CALLS = {
    "torch.Tensor.view": lambda x: x.view(4, 6), "torch.Tensor.view_as": lambda x: x.view_as(torch.empty(6, 4)),
    "torch.Tensor.transpose": lambda x: x.transpose(0, 2), "torch.Tensor.permute": lambda x: x.permute(2, 0, 1),
    "torch.Tensor.unsqueeze": lambda x: x.unsqueeze(1), "torch.Tensor.squeeze": lambda x: x[:1].squeeze(0),
    "torch.Tensor.t": lambda x: x[0].t(), "torch.Tensor.T.__get__": lambda x: x[0].T,
    "torch.Tensor.mT.__get__": lambda x: x.mT, "torch.Tensor.movedim": lambda x: x.movedim(0, 2),
    "torch.Tensor.moveaxis": lambda x: x.moveaxis(0, 2), "torch.Tensor.swapaxes": lambda x: x.swapaxes(0, 1),
    "torch.Tensor.swapdims": lambda x: x.swapdims(1, 2), "torch.Tensor.unflatten": lambda x: x.unflatten(2, (2, 2)),
    "torch.Tensor.detach": lambda x: x.detach(), "torch.transpose": lambda x: torch.transpose(x, 1, 2),
    "torch.permute": lambda x: torch.permute(x, (1, 2, 0)), "torch.unsqueeze": lambda x: torch.unsqueeze(x, 0),
    "torch.squeeze": lambda x: torch.squeeze(x[:, :1], 1), "torch.t": lambda x: torch.t(x[1]),
    "torch.movedim": lambda x: torch.movedim(x, 1, 0), "torch.detach": lambda x: torch.detach(x),
}


def test_an_op_said_to_compute_nothing_aliases_its_input_and_passes_its_gradient_on_rearranged():
    # OpOverflowCheck does not handle them: an op named here by mistake (an expansion, whose gradient is a sum; a
    # reshape, which may copy) would go unchecked. Each must return its input's memory, and its backward must give
    # the upstream gradient's values back, rearranged, none summed nor made.
    declared = {key for key, facts in op_tools.ops.op_facts._DECLARED.items() if facts.get("alias_only")}
    assert declared == set(ALIAS_ONLY_CALLS)
    for name, call in ALIAS_ONLY_CALLS.items():
        x = torch.arange(24, dtype=torch.float64).reshape(2, 3, 4).requires_grad_()
        out = call(x)
        assert out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr(), name
        if name.endswith("detach"):
            continue
        upstream = torch.randn(out.shape, dtype=torch.float64)
        (grad,) = torch.autograd.grad(out, x, upstream)
        assert sorted(grad[grad != 0].tolist()) == sorted(upstream.flatten().tolist()), name
    for name in ("torch.Tensor.expand", "torch.Tensor.reshape", "torch.Tensor.select", "torch.Tensor.__getitem__"):
        assert op_facts(name).view and not op_facts(name).alias_only, name


class _ViewsMade(torch.overrides.TorchFunctionMode):
    """The names of the calls (as the tools see them: the outermost) that return a new tensor holding their input's
    memory; an input handed back as it is (``atleast_1d`` of a vector) is no new view, and the tools hand it back."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from op_tools.ops.arguments import iter_tensors
        from op_tools.ops.naming import resolve_op_name

        result = func(*args, **(kwargs or {}))
        given = list(iter_tensors((args, kwargs)))
        memory = {t.untyped_storage().data_ptr() for t in given if t.layout == torch.strided and t.numel()}
        if any(not any(o is t for t in given) and o.layout == torch.strided and o.numel()
               and o.untyped_storage().data_ptr() in memory for o in iter_tensors(result)):
            self.names.add(resolve_op_name(func))
        return result


# Views torch's operator database makes in no first sample (its atleast_3d's is 3-d already; swapaxes and adjoint
# are aliases of ops whose samples it runs), each a view the tools had lost
_VIEWS_BESIDE_OP_DB = (lambda x: torch.atleast_3d(x), lambda x: torch.adjoint(x), lambda x: torch.ops.aten.alias(x),
                       lambda x: torch.swapaxes(x, 0, 1), lambda x: x.unsafe_split(2), lambda x: torch.split(x, 2))
# Calls whose result holds their input's memory only where they compute nothing (a dropout of an unbatched input
# out of training: its input unsqueezed, passed through and squeezed back)
_VIEWS_ONLY_IN_PASSING = {"torch.nn.functional.dropout3d", "torch.nn.functional.dropout2d"}


def test_every_call_that_returns_a_view_of_its_input_is_known_as_a_view():
    # OpFallback and OpDtypeCast run a call on copies; a view made of a copy is no view of the caller's tensor, so
    # writes through it were lost, verdict clean: torch.split (seen as torch.functional.split, a name no list had),
    # tensor_split, swapaxes, unflatten, broadcast_to, atleast_3d, adjoint, aten.alias. Swept over the first sample of
    # each op in torch's operator database (function, method and alias), so a view a later torch adds is caught here.
    from torch.testing._internal.common_methods_invocations import op_db

    made = _ViewsMade()
    for info in op_db:
        if torch.float32 not in info.dtypes:
            continue
        try:
            # its generator itself: sample_inputs' tracking reads the source of every frame on the stack per sample
            sample = next(iter(info.sample_inputs_func(info, "cpu", torch.float32, False)))
        except Exception:  # noqa: BLE001 - an op whose samples need what this machine lacks (LAPACK, scipy)
            continue
        variants = [info.op, info.method_variant, *(f for a in info.aliases for f in (a.op, a.method_variant))]
        for variant in filter(None, variants):
            with contextlib.suppress(Exception), made:
                variant(sample.input, *sample.args, **sample.kwargs)
    for call in _VIEWS_BESIDE_OP_DB:
        with made:
            call(torch.zeros(4, 6))
    seen = {"torch.functional.split", "torch.functional.atleast_3d", "torch.swapaxes", "torch.unflatten",
            "torch.broadcast_to", "torch.adjoint", "aten.alias", "torch.Tensor.unsafe_split"}
    assert seen <= made.names  # the sweep sees the views it is for
    assert sorted(name for name in made.names - _VIEWS_ONLY_IN_PASSING if not op_facts(name).view) == []
    assert not op_facts("torch.nn.functional.unfold").view  # im2col, though aten's unfold is a view
    assert not op_facts("torch.Tensor.add_").view and not op_facts("torch.add").view  # writes, or makes, a tensor
