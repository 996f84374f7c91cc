"""OpAutoCompare's sensitivity matches the output dtype: an op rounded once (elementwise, activations, casts) into
bfloat16 or float16 fails at 2 ulps, passes at 1; reductions and matmuls keep their looser rule."""

import os

import pytest
import torch
from tiny_models import tiny_llama

import op_tools
from op_tools.numerics.comparison import compare_outputs


@pytest.fixture(autouse=True)
def _no_autocompare_variables(monkeypatch):
    for name in list(os.environ):
        if "AUTOCOMPARE" in name or name.endswith("_OP_DTYPE_CAST_DICT"):
            monkeypatch.delenv(name)


def _ulps_off(values: torch.Tensor, dtype: torch.dtype, ulps: int):
    """``values`` (float64, exactly representable in ``dtype``) in ``dtype``, the first two ``ulps`` steps down."""
    device = values.to(dtype)
    device.view(torch.int16)[:2] -= ulps  # positive values: one step of the bit pattern is one ulp
    return device


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rounded_once_output_fails_at_two_ulps_and_passes_at_one(dtype):
    torch.manual_seed(0)
    exact = torch.randn(4096, dtype=torch.float64).abs().to(dtype).double()
    eps = torch.finfo(dtype).eps
    exact[0] = 2 - eps  # the top of a binade: 2 ulps are the smallest relative error there
    exact[1] = 1 + eps  # the bottom: 1 ulp is the largest
    correct = exact.to(dtype)
    for ulps, passes in ((1, True), (2, False)):
        device = _ulps_off(exact, dtype, ulps)
        [silu] = compare_outputs(device, exact, correct, op_name="torch.nn.functional.silu", prefix="output")
        assert silu.passed is passes, (ulps, silu.device_error, silu.error_info)
        # a matmul's result sums: 2 ulps of one element are within its rule
        [mm] = compare_outputs(device, exact, correct, op_name="torch.mm", prefix="output")
        assert mm.passed
        # a gradient may sum over broadcast dimensions: the summed rule
        [grad] = compare_outputs(device, exact, correct, op_name="torch.Tensor.mul", prefix="grad")
        assert grad.passed
    assert "2 ulps" in silu.error_info


def test_rounded_once_passes_correct_rounding_of_tiny_and_subnormal_values():
    torch.manual_seed(0)
    exact = torch.randn(4096, dtype=torch.float64)
    exact[:64] *= 1e-6  # float16 subnormals beside values of magnitude 1
    [mixed] = compare_outputs(exact.half(), exact, exact.half(), op_name="torch.Tensor.mul", prefix="output")
    tiny = exact * 1e-7  # every value subnormal in float16
    [subnormal] = compare_outputs(tiny.half(), tiny, tiny.half(), op_name="torch.Tensor.to", prefix="output")
    assert mixed.passed and subnormal.passed, (mixed.error_info, subnormal.error_info)
    half_ulp = torch.finfo(torch.float16).eps / 2
    assert mixed.device_error <= half_ulp and subnormal.device_error <= half_ulp


def test_rounded_once_allows_an_op_the_cpu_computes_less_exactly():
    """A same-dtype run that is itself off by several ulps (a kernel computing in the narrow dtype) is the witness."""
    torch.manual_seed(0)
    exact = torch.randn(4096, dtype=torch.float64)
    less_exact = (exact * (1 + 2.0 ** -5)).bfloat16()  # ~4 ulps off, as the device
    [c] = compare_outputs(less_exact, exact, less_exact, op_name="torch.pow", prefix="output")
    assert c.passed and c.cpu_error > 2 * torch.finfo(torch.bfloat16).eps


@pytest.mark.parametrize("dtype, noise", [(torch.bfloat16, "1e-2"), (torch.float16, "1e-3")],
                         ids=["bf16", "fp16"])
def test_llama_autocast_step_finds_a_silu_fault_of_about_one_ulp_first(sim, dtype, noise):
    """The issue's recipe: silu off by ~1 ulp (times 1 +- 2^-7 in bfloat16) in a tiny Llama under autocast."""
    import ditorch.sim

    torch.manual_seed(0)
    model = tiny_llama().to(sim)
    ids = torch.randint(0, 128, (2, 16)).to(sim)
    with op_tools.OpAutoCompare() as tool:
        with ditorch.sim.faults(f"silu:noise={noise}"), torch.autocast("sim", dtype=dtype):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    assert tool.failures, "the silu fault was not found"
    first = tool.failures[0]
    assert first["op"] == "torch.nn.functional.silu" and first["phase"] == "forward", first
    assert all(f["op"] == "torch.nn.functional.silu" for f in tool.failures), tool.failures


def test_relative_error_is_the_same_on_the_chunked_torch_path_as_with_numpy(monkeypatch):
    from op_tools.numerics import error_statistics

    monkeypatch.setattr(error_statistics, "_CHUNK_HOST", 1 << 12)  # several chunks at a test's size
    torch.manual_seed(0)
    exact = torch.randn(error_statistics.TORCH_MIN + 5, dtype=torch.float64)
    exact[:100] *= 1e-6  # below 2^-8 of the typical magnitude: measured against that
    device = (exact * (1 + 2.0 ** -7 * torch.randn_like(exact))).bfloat16()
    relative = (2.0 ** -8, torch.finfo(torch.bfloat16).tiny)
    chunked = error_statistics.error_stats(device, exact, 1e-3, 1e-3, relative)
    with_numpy = error_statistics._numpy_stats(device.double().numpy(), exact.numpy(), 1e-3, 1e-3, relative)
    assert chunked == pytest.approx(with_numpy, rel=1e-12)
    assert error_statistics.normalised_error(device, exact, relative=relative) == pytest.approx(chunked[2], rel=1e-12)


def test_a_signalling_nan_is_compared_without_numpy_warning_the_user(sim):
    # numpy's cast of a float32 signalling nan (uninitialised memory: FSDP2's buffers) to float64 warned "invalid
    # value encountered in cast", six RuntimeWarnings per rank on the user's console
    import warnings

    from op_tools.numerics import error_statistics

    raw = torch.tensor([0x7F800001, 0x3F800000, 0x40000000], dtype=torch.int32)
    signalling, exact = raw.view(torch.float32), torch.tensor([float("nan"), 1.0, 2.0], dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert error_statistics.error_stats(signalling, exact, 1e-3, 1e-3) is None  # not finite: judged elsewhere
        error_statistics.normalised_error(signalling, exact)
        with op_tools.OpAutoCompare() as tool:
            torch.nn.functional.relu(signalling.to(sim))
    assert tool.verdict() == "clean", tool.closing_line()


@pytest.mark.parametrize("op, kernel", [("tanh", "tanh_backward"), ("sigmoid", "sigmoid_backward")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_saturating_gradients_fault_is_found_beside_the_cancellation_a_correct_run_has(sim, op, kernel, dtype):
    # The gradient comes from the saved narrow output: near saturation 1 - y^2 cancels and a correct run errs by much
    # of the mean gradient there. 4x that worst element's error passed a 10% fault on every element (inputs of
    # standard deviation 4, most of them saturated); the largest elements, far from saturation, show it.
    import ditorch.sim

    verdicts = []
    for seed, fault in ((0, ""), (1, ""), (2, ""), (0, f"{kernel}:noise=1e-1")):
        generator = torch.Generator().manual_seed(seed)
        x = (torch.randn(64, 256, generator=generator) * 4).to(dtype).to(sim).requires_grad_()
        upstream = torch.randn(64, 256, generator=generator).to(dtype).to(sim)
        with op_tools.OpAutoCompare() as tool:
            y = getattr(torch, op)(x)
            with ditorch.sim.faults(fault):
                y.backward(upstream)
        verdicts.append(tool.verdict())
    assert verdicts == ["clean", "clean", "clean", "found"], tool.failures
    if dtype == torch.bfloat16:  # float16's 3 more bits keep the cancellation within the worst element's 4x
        assert "on the bulk" in tool.failures[0]["error_info"]
