import pytest
import torch

import op_tools


def scale(x, factor):
    return x * factor


def test_feature_runs_only_when_the_condition_holds(sim, logged, monkeypatch):
    monkeypatch.setenv("OP_TOOLS_VERBOSE", "1")
    original = torch.add
    op_tools.apply_feature("torch.add", "dump_op_args", condition_func=lambda a, b, **kw: a.numel() > 2)
    try:
        torch.add(torch.ones(2, device=sim), 1)
        torch.add(torch.ones(3, device=sim), 1)
    finally:
        op_tools.remove_feature("torch.add")
    assert torch.add is original
    out = logged()
    assert out.count("torch.add    forward_id:") == 1 and "torch.Size([3])" in out


def test_methods_functionals_and_module_functions(sim, tmp_path):
    ops = ["torch.Tensor.sort", torch.nn.functional.linear, f"{__name__}.scale"]
    originals = [torch.Tensor.sort, torch.nn.functional.linear, scale]
    op_tools.apply_feature(ops, "op_capture")
    try:
        x = torch.randn(2, 3, device=sim)
        x.sort()
        torch.nn.functional.linear(x, torch.randn(4, 3, device=sim))
        globals()["scale"](x, 2)
    finally:
        op_tools.remove_feature(ops)
    assert [torch.Tensor.sort, torch.nn.functional.linear, globals()["scale"]] == originals
    captured = sorted(p.name for p in (tmp_path / "results" / "op_capture_results").iterdir()
                      if not p.name.startswith("index_"))  # the folders of the calls, not the index beside them
    assert captured == sorted(["torch.Tensor.sort", "torch.nn.functional.linear", f"{__name__}.scale"])


def test_a_module_in_the_list_stands_for_each_function_in_it_as_in_the_original(sim, tmp_path, monkeypatch):
    (tmp_path / "fused_ops.py").write_text("def fused_mul_add(a, b):\n    return a * b + 1\n\n\n"
                                           "def fused_scale(a):\n    return a * 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import fused_ops

    originals = (fused_ops.fused_mul_add, fused_ops.fused_scale)
    op_tools.apply_feature([fused_ops], "op_capture")
    try:
        x = torch.randn(2, 3, device=sim)
        fused_ops.fused_scale(fused_ops.fused_mul_add(x, x))
    finally:
        op_tools.remove_feature([fused_ops])
    assert (fused_ops.fused_mul_add, fused_ops.fused_scale) == originals
    captured = {p.name for p in (tmp_path / "results" / "op_capture_results").iterdir() if p.is_dir()}
    assert captured == {"fused_ops.fused_mul_add", "fused_ops.fused_scale"}


def test_reapplying_replaces_the_feature_with_a_message(sim, logged):
    op_tools.apply_feature("torch.sin", "dump_op_args")
    op_tools.apply_feature("torch.sin", "fallback")
    try:
        y = torch.sin(torch.zeros(2, device=sim))
    finally:
        op_tools.remove_feature("torch.sin")
    assert "torch.sin: feature dump_op_args replaced by fallback" in logged()
    assert y.device.type == sim and torch.sin.__module__ != __name__


def test_unknown_feature_or_name_is_a_value_error_listing_valid_ones():
    with pytest.raises(ValueError, match="valid features: ") as info:
        op_tools.apply_feature("torch.add", "teleport")
    for name in ("cast_dtype", "dump_op_args", "fallback", "op_capture", "overflow_check"):
        assert name in str(info.value)
    with pytest.raises(ValueError, match="cannot resolve 'torch.no_such_function'"):
        op_tools.apply_feature("torch.no_such_function", "fallback")
    # a misspelt op is named with the closest names its owner has (it gave the expected form only)
    with pytest.raises(ValueError, match=r"did you mean 'torch.nn.functional.glu' or 'torch.nn.functional.gelu'\?$"):
        op_tools.apply_feature("torch.nn.functional.gleu", "fallback")
    with pytest.raises(ValueError, match=r"did you mean 'torch.nn.functional.gelu'\?$"):  # a module misspelt
        op_tools.apply_feature("torch.nn.fucntional.gelu", "fallback")


def test_a_misspelt_feature_is_an_assertion_error_as_in_the_original():
    with pytest.raises(AssertionError, match="unknown feature 'falback'; valid features: .*fallback") as info:
        op_tools.apply_feature("torch.add", feature="falback")
    assert isinstance(info.value, ValueError)
    assert torch.add.__module__ != __name__ and not hasattr(torch.add, "__op_tools_original__")  # nothing patched


def test_a_later_opposite_decision_on_an_op_is_announced_too(sim, logged, monkeypatch):
    monkeypatch.setenv("OP_TOOLS_VERBOSE", "1")
    monkeypatch.setenv("OP_OBSERVE_DISABLE_LIST", "torch.hypot")
    x = torch.ones(2, device=sim)
    with op_tools.OpObserve():
        torch.hypot(x, x)
    monkeypatch.delenv("OP_OBSERVE_DISABLE_LIST")
    op_tools.apply_feature("torch.hypot", "dump_op_args")
    try:
        torch.hypot(x, x)
    finally:
        op_tools.remove_feature("torch.hypot")
    out = logged()
    assert "skip OpObserveHook on torch.hypot" in out
    assert "apply OpObserveHook on torch.hypot" in out and out.count("torch.hypot    forward_id:") == 1


def test_a_tool_with_a_list_of_its_own_handles_the_ops_it_is_applied_to(sim):
    # OpSelfCheck's own list (the ops with an invariant, exp not among them) left torch.exp untouched, and its verdict
    # said "no call of the ops it checks ran on a device"
    import ditorch.sim
    from op_tools.core import features

    op_tools.apply_feature("torch.exp", "self_check")
    try:
        tool = features._patched["torch.exp"][4]
        with ditorch.sim.faults("exp:noise=1e-1"):
            torch.exp(torch.randn(32, 16, device=sim))
    finally:
        op_tools.remove_feature("torch.exp")
    assert [(f.op, f.check) for f in tool.findings] == [("torch.exp", "float64 rerun of a sample")]
    assert tool.verdict() == "found"


def test_a_condition_that_declines_every_call_is_named_as_why_nothing_was_checked(sim):
    # It said "OpOverflowCheck(ops=...) matched no call: torch.nn.functional.gelu": gelu ran twice, and the user
    # never passed ops=; the condition declined both calls.
    from op_tools.core import features

    op_tools.apply_feature("torch.nn.functional.gelu", "overflow_check", condition_func=lambda *a, **k: False)
    try:
        tool = features._patched["torch.nn.functional.gelu"][4]
        x = torch.randn(4, device=sim)
        torch.nn.functional.gelu(x), torch.nn.functional.gelu(x)
    finally:
        op_tools.remove_feature("torch.nn.functional.gelu")
    assert tool.not_checked() == "condition_func declined every call (2 of torch.nn.functional.gelu)"
    assert tool.verdict() == "unchecked"
