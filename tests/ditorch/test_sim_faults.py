"""Injected faults make the sim device misbehave in exactly the way asked, and only then."""

import subprocess
import sys

import pytest
import torch
from subprocess_env import child_env

import ditorch.sim
from ditorch.sim import SimUnsupportedError


@pytest.mark.usefixtures("sim")
def test_unsupported_raises_like_a_missing_vendor_kernel():
    x = torch.randn(4, 4, device="sim")
    with ditorch.sim.faults("mm:unsupported"):
        with pytest.raises(RuntimeError, match=r"aten::mm.default is not supported"):
            x @ x
        assert (x + x).shape == (4, 4)  # other ops unaffected
    assert (x @ x).shape == (4, 4)  # restored on exit


@pytest.mark.usefixtures("sim")
def test_unsupported_can_target_one_dtype():
    with ditorch.sim.faults(".*@float64:unsupported"):
        assert (torch.ones(2, device="sim") * 2).dtype == torch.float32
        with pytest.raises(SimUnsupportedError, match="for torch.float64"):
            torch.ones(2, device="sim", dtype=torch.float64)
        with pytest.raises(SimUnsupportedError):
            torch.ones(2, device="sim").double()


@pytest.mark.usefixtures("sim")
def test_noise_perturbs_every_element_by_the_relative_error():
    a, b = torch.randn(8, 8, device="sim"), torch.randn(8, 8, device="sim")
    exact = (a @ b).cpu()
    with ditorch.sim.faults("mm:noise=1e-3"):
        noisy = (a @ b).cpu()
    relative = ((noisy - exact) / exact).abs()
    assert torch.allclose(relative, torch.full_like(relative, 1e-3), rtol=1e-3)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    with ditorch.sim.faults("mm:noise=1e-3"):
        a @ b
    assert torch.equal(torch.rand(3), expected), "noise must not consume the user's random stream"


@pytest.mark.usefixtures("sim")
@pytest.mark.parametrize("kind,check", [("nan", torch.isnan), ("inf", torch.isinf)])
def test_poisoned_outputs(kind, check):
    x = torch.randn(3, device="sim")
    with ditorch.sim.faults(f"gelu:{kind}"):
        assert check(torch.nn.functional.gelu(x).cpu()).all()
        assert torch.isfinite(torch.relu(x).cpu()).all()
        y = x.clone()
        with ditorch.sim.faults(f"add_.Tensor:{kind}"):
            y.add_(1)  # in-place: the mutated tensor is poisoned
        assert check(y.cpu()).all()


@pytest.mark.usefixtures("sim")
def test_views_are_never_poisoned_and_faults_reach_backward():
    x = torch.randn(2, 3, device="sim", requires_grad=True)
    with ditorch.sim.faults("t:nan"):
        assert torch.isfinite(x.t().detach().cpu()).all()
    with ditorch.sim.faults("gelu_backward:nan"):
        out = torch.nn.functional.gelu(x)
        assert torch.isfinite(out.detach().cpu()).all()
        out.sum().backward()
    assert torch.isnan(x.grad.cpu()).all()


@pytest.mark.usefixtures("sim")
def test_slow_fault_delays_the_op():
    import time

    x = torch.ones(2, device="sim")
    with ditorch.sim.faults("exp:slow=50"):
        start = time.perf_counter()
        x.exp()
        assert time.perf_counter() - start >= 0.045


@pytest.mark.usefixtures("sim")
def test_inject_fault_and_clear():
    ditorch.sim.inject_fault("relu", "nan")
    assert torch.isnan(torch.relu(torch.ones(2, device="sim")).cpu()).all()
    ditorch.sim.clear_faults()
    assert torch.relu(torch.ones(2, device="sim")).cpu().tolist() == [1.0, 1.0]


def test_faults_from_the_environment():
    code = ("import torch, ditorch.sim; ditorch.sim.register(); x = torch.ones(2, device='sim'); "
            "print(torch.isnan((x * x).cpu()).all().item(), (x + x).cpu().tolist())")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env=child_env({"DITORCH_SIM_FAULTS": "aten::mul.Tensor:nan"}))
    assert result.stdout.split() == ["True", "[2.0,", "2.0]"], result.stderr


@pytest.mark.parametrize("spec,why", [
    ("mm", "has no ':kind'"),
    ("mm:explode", "unknown fault kind 'explode'"),
    ("mm:noise=lots", "noise needs a number"),
    ("mm:nan=3", "nan takes no value"),
    ("mm@float65:nan", "unknown dtype 'float65'"),
    ("(mm:nan", "invalid regular expression"),
])
def test_malformed_fault_spec_names_variable_and_form(spec, why):
    with pytest.raises(ValueError) as error:
        ditorch.sim.parse_faults(spec, "DITORCH_SIM_FAULTS")
    message = str(error.value)
    assert message.startswith(f"DITORCH_SIM_FAULTS={spec!r}") and why in message
    assert "expected 'pattern[@dtype]:kind'" in message


def test_malformed_fault_variable_fails_registration():
    result = subprocess.run([sys.executable, "-c", "import ditorch.sim; ditorch.sim.register()"],
                            capture_output=True, text=True, timeout=120,
                            env=child_env({"DITORCH_SIM_FAULTS": "mm:boom"}))
    assert result.returncode != 0 and "ValueError: DITORCH_SIM_FAULTS='mm:boom'" in result.stderr


@pytest.mark.usefixtures("sim")
def test_backward_op_errors_are_reported_after_backward_not_fatal():
    # Raising inside autograd's device thread would abort the process; the sim device reports the
    # error at its next call outside backward instead, with the failed op's name.
    x = torch.randn(4, 4, device="sim", requires_grad=True)
    loss = (x @ x).sum()
    with ditorch.sim.faults("mm:unsupported"):
        with pytest.raises(SimUnsupportedError, match="the backward op aten::mm.default failed"):
            loss.backward()
            torch.sim.synchronize()
    assert (x + 1).shape == (4, 4)  # reported once, then the device works again


@pytest.mark.parametrize(("spec", "words"), [
    ("torch.nn.functional.gelu:nan", ["'torch.nn.functional.gelu' matches no aten op", "not torch functions",
                                      "did you mean 'gelu' (aten::gelu)?"]),
    ("torch.Tensor.add_:inf", ["'torch.Tensor.add_' matches no aten op", "did you mean 'add_'"]),
    ("gleu:noise=1e-3", ["'gleu' matches no aten op; did you mean ", "'gelu'"]),
])
def test_a_fault_pattern_matching_no_aten_op_is_warned_about_with_the_aten_name(spec, words, sim, caplog,
                                                                                  monkeypatch):
    from ditorch.sim import fault_injection

    monkeypatch.setattr(fault_injection, "_checked_patterns", set())
    with caplog.at_level("WARNING", logger="ditorch"), ditorch.sim.faults(spec):
        pass
    (message,) = [r.getMessage() for r in caplog.records if r.name == "ditorch"]
    for word in words:
        assert word in message


def test_fault_patterns_that_match_ops_pass_without_a_word(sim, caplog, monkeypatch):
    from ditorch.sim import fault_injection

    monkeypatch.setattr(fault_injection, "_checked_patterns", set())
    with caplog.at_level("WARNING", logger="ditorch"), ditorch.sim.faults(
            "gelu:nan;aten::mm:noise=1e-3;add.Tensor:inf;.*@float64:unsupported;(mul|div)_:unversioned"):
        pass
    assert not [r for r in caplog.records if r.name == "ditorch"]


def test_a_misspelt_fault_in_the_variable_is_warned_about_when_sim_registers(tmp_path):
    code = ("import logging, sys; logging.basicConfig(stream=sys.stdout, format='%(name)s %(message)s')\n"
            "import ditorch.sim; ditorch.sim.register()\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=child_env({"DITORCH_SIM_FAULTS": "torch.nn.functional.gelu:nan", "DITORCH_QUIET": "1"}))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ditorch DITORCH_SIM_FAULTS: 'torch.nn.functional.gelu' matches no aten op" in done.stdout
