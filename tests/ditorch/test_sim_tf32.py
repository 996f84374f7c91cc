"""TF32 emulation on sim: off, bit-identical to the CPU; on, float32 matmuls and convolutions read TF32."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from ditorch.sim.tf32 import round_to_tf32

pytestmark = pytest.mark.usefixtures("sim")


def tf32_reference(x: torch.Tensor) -> torch.Tensor:
    """Round to 11 significant bits, ties to even, independently of the code under test (numpy)."""
    mantissa, exponent = np.frexp(x.double().numpy())
    return torch.from_numpy(np.ldexp(np.round(mantissa * 2048), exponent - 11)).float()


@pytest.fixture
def tf32_on():
    torch.sim.matmul.allow_tf32 = True
    torch.sim.conv.allow_tf32 = True
    yield
    torch.sim.matmul.allow_tf32 = False
    torch.sim.conv.allow_tf32 = False


def test_rounding_is_to_nearest_even_and_keeps_inf_and_nan():
    ulp = 2.0 ** -10  # TF32's spacing at 1.0
    cases = {
        1 + ulp / 2: 1.0,  # a tie goes to the even neighbour (1.0)
        1 + 3 * ulp / 2: 1 + 2 * ulp,  # a tie from an odd neighbour goes up
        1 + ulp / 2 + 2.0 ** -23: 1 + ulp,  # just above half: up
        -(1 + 3 * ulp / 2): -(1 + 2 * ulp),
        torch.finfo(torch.float32).max: float("inf"),  # beyond TF32's largest value
        (2 - ulp) * 2.0 ** 127: (2 - ulp) * 2.0 ** 127,  # TF32's largest value is kept
        float("inf"): float("inf"), float("-inf"): float("-inf"),
    }
    values = torch.tensor(list(cases), dtype=torch.float32)
    assert round_to_tf32(values).tolist() == list(cases.values())
    assert torch.isnan(round_to_tf32(torch.tensor([float("nan")]))).all()
    x = torch.randn(1000)
    assert torch.equal(round_to_tf32(x), tf32_reference(x))


def test_off_by_default_matmul_and_conv_are_bit_identical_to_the_cpu():
    assert torch.sim.float32_reduced_precision() == {}
    assert not torch.sim.matmul.allow_tf32 and not torch.sim.conv.allow_tf32
    a, b = torch.randn(32, 48), torch.randn(48, 16)
    assert torch.equal((a.to("sim") @ b.to("sim")).cpu(), a @ b)
    x, w = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3)
    assert torch.equal(torch.nn.functional.conv2d(x.to("sim"), w.to("sim")).cpu(), torch.nn.functional.conv2d(x, w))


@pytest.mark.usefixtures("tf32_on")
def test_matmul_reads_tf32_operands_and_accumulates_in_float32():
    assert torch.sim.float32_reduced_precision() == {"matmul": "tf32", "conv": "tf32"}
    torch.manual_seed(0)
    a, b, bias = torch.randn(32, 64), torch.randn(64, 16), torch.randn(16)
    on_sim = (a.to("sim") @ b.to("sim")).cpu()
    assert torch.equal(on_sim, tf32_reference(a) @ tf32_reference(b))
    relative = ((on_sim.double() - (a.double() @ b.double())) / (a.double() @ b.double())).abs().median()
    assert 1e-5 < relative < 2e-3  # measured 3e-4: TF32 keeps 11 significant bits
    # linear reaches the device as addmm: the bias (the accumulator) stays float32
    linear = torch.nn.functional.linear(a.to("sim"), b.t().to("sim"), bias.to("sim")).cpu()
    assert torch.equal(linear, torch.addmm(bias, tf32_reference(a), tf32_reference(b)))
    batched = torch.randn(3, 8, 64)
    assert torch.equal(torch.bmm(batched.to("sim"), b.expand(3, 64, 16).to("sim")).cpu(),
                       torch.bmm(tf32_reference(batched), tf32_reference(b).expand(3, 64, 16)))
    vector = torch.randn(64)
    assert torch.equal((a.to("sim") @ vector.to("sim")).cpu(), a @ vector)  # mv: cuBLAS gemv keeps float32


@pytest.mark.usefixtures("tf32_on")
def test_backward_matmuls_read_tf32_too():
    a = torch.randn(16, 32, device="sim", requires_grad=True)
    b = torch.randn(32, 8, device="sim")
    grad = torch.randn(16, 8)
    (a @ b).backward(grad.to("sim"))
    assert torch.equal(a.grad.cpu(), tf32_reference(grad) @ tf32_reference(b.cpu()).t())


@pytest.mark.usefixtures("tf32_on")
def test_convolution_forward_and_backward_read_tf32():
    torch.manual_seed(0)
    x, w, bias = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3), torch.randn(4)
    x_sim = x.to("sim").requires_grad_()
    out = torch.nn.functional.conv2d(x_sim, w.to("sim"), bias.to("sim"), padding=1)
    expected = torch.nn.functional.conv2d(tf32_reference(x), tf32_reference(w), bias, padding=1)
    assert torch.equal(out.detach().cpu(), expected)
    assert not torch.equal(expected, torch.nn.functional.conv2d(x, w, bias, padding=1))
    grad = torch.randn_like(expected)
    out.backward(grad.to("sim"))
    expected_grad = torch.nn.grad.conv2d_input(x.shape, tf32_reference(w), tf32_reference(grad), padding=1)
    torch.testing.assert_close(x_sim.grad.cpu(), expected_grad, rtol=0, atol=1e-6)


@pytest.mark.usefixtures("tf32_on")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_dtypes_are_unaffected(dtype):
    a, b = torch.randn(16, 32, dtype=dtype), torch.randn(32, 8, dtype=dtype)
    assert torch.equal((a.to("sim") @ b.to("sim")).cpu(), a @ b)


def test_switches_are_independent_and_reported():
    torch.sim.conv.allow_tf32 = True
    try:
        assert torch.sim.float32_reduced_precision() == {"conv": "tf32"}
        a, b = torch.randn(8, 8), torch.randn(8, 8)
        assert torch.equal((a.to("sim") @ b.to("sim")).cpu(), a @ b)  # matmul still float32
    finally:
        torch.sim.conv.allow_tf32 = False
    assert torch.sim.float32_reduced_precision() == {}


def test_variables_turn_on_tf32_and_select_the_attention_algorithm():
    code = ("import torch, ditorch.sim; ditorch.sim.register(); "
            "print(torch.sim.float32_reduced_precision(), ditorch.sim.get_sdpa_algorithm())")
    env = {**os.environ, "DITORCH_SIM_TF32": "matmul", "DITORCH_SIM_SDPA": "chunked:8"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.stdout.strip() == "{'matmul': 'tf32'} SdpaAlgorithm(name='chunked', block_size=8)", result.stderr


@pytest.mark.parametrize("name, value", [("DITORCH_SIM_TF32", "gemm"), ("DITORCH_SIM_TF32", "2"),
                                         ("DITORCH_SIM_SDPA", "flash"), ("DITORCH_SIM_SDPA", "chunked:0")])
def test_malformed_variables_name_the_variable_and_form(name, value):
    from ditorch.env import VARIABLES, read

    with pytest.raises(ValueError) as error:
        read(name, {name: value})
    assert str(error.value) == f"{name}={value!r}: expected {VARIABLES[name].form}"


@pytest.fixture
def cuda_switch_off_after():
    yield
    torch.set_float32_matmul_precision("highest")  # every backend's, in both APIs (allow_tf32 = False: CUDA's only)


def _turn_on_through_the_new_api():
    torch.backends.cuda.matmul.fp32_precision = "tf32"


@pytest.mark.usefixtures("cuda_switch_off_after")
@pytest.mark.parametrize("turn_on", [lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", True),
                                     lambda: torch.set_float32_matmul_precision("high"),
                                     _turn_on_through_the_new_api],
                         ids=["allow_tf32", "precision_high", "fp32_precision"])
def test_cudas_matmul_switch_drives_sim_matmuls_as_it_drives_cublas(turn_on):
    torch.manual_seed(0)
    a, b = torch.randn(64, 256), torch.randn(256, 32)
    exact = a.double() @ b.double()

    def on_sim():
        return (a.to("sim") @ b.to("sim")).cpu()

    def median_relative_error():
        return ((on_sim().double() - exact) / exact).abs().median().item()

    assert median_relative_error() < 1e-6  # float32: 2.3e-7 measured
    turn_on()
    assert torch.sim.matmul.allow_tf32 and torch.sim.float32_reduced_precision() == {"matmul": "tf32"}
    assert 1e-4 < median_relative_error() < 2e-3  # TF32's 11 significant bits: 2.9e-4 measured
    assert torch.equal(on_sim(), tf32_reference(a) @ tf32_reference(b))
    torch.backends.cuda.matmul.allow_tf32 = False
    assert median_relative_error() < 1e-6 and torch.sim.float32_reduced_precision() == {}


@pytest.mark.usefixtures("cuda_switch_off_after")
def test_sims_matmul_switch_is_cudas():
    torch.sim.matmul.allow_tf32 = True
    assert torch.backends.cuda.matmul.allow_tf32 and torch.get_float32_matmul_precision() == "high"
    torch.sim.matmul.allow_tf32 = False
    assert not torch.backends.cuda.matmul.allow_tf32 and torch.get_float32_matmul_precision() == "highest"


def test_the_switch_set_before_import_ditorch_holds_on_sim():
    code = ("import torch; torch.backends.cuda.matmul.allow_tf32 = True; import ditorch; "
            "print(torch.sim.float32_reduced_precision())")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DITORCH_")}
    env.update(DITORCH_BACKEND="sim", DITORCH_QUIET="1")  # DITORCH_SIM_TF32 unset: 0
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.stdout.strip() == "{'matmul': 'tf32'}", result.stderr
