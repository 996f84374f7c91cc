"""The sim device and CUDA in one process: what works, what is refused, and why the suite isolates GPU tests.

Registering any PrivateUse1 device makes it PyTorch's accelerator for the rest of the process
(at::getAccelerator), and from then on every CUDA backward trips the autograd engine's stream assert
(pytorch/pytorch#161129). So ``ditorch.sim.register()`` refuses where CUDA is already in use, warns where a
GPU could still be used, and the suite runs each ``gpu`` test in its own interpreter (tests/conftest.py).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from hardware import NO_GPU
from subprocess_env import ROOT, child_env


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=child_env({"DITORCH_QUIET": "1", **env},
                                                                      drop=("DITORCH_",)),
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


REFUSAL = "sim: CUDA is already in use in this process, so the sim device is not registered"


def test_sim_refuses_to_register_where_cuda_is_in_use_saying_why():
    # Stands in for a CUDA build that has run CUDA work (no GPU here): the two facts register() reads.
    code = """
import torch, ditorch.sim
torch.backends.cuda.is_built = lambda: True
torch.cuda._initialized = True
try:
    ditorch.sim.register()
except RuntimeError as error:
    print(error)
print(ditorch.sim.is_registered(), torch._C._get_privateuse1_backend_name())
"""
    done = run_python(code, **NO_GPU)
    assert done.returncode == 0, done.stderr
    message, state = done.stdout.strip().splitlines()
    assert message.startswith(REFUSAL) and "pytorch/pytorch#161129" in message
    assert "DITORCH_BACKEND=sim python script.py" in message
    assert state == "False privateuseone"  # nothing registered, PrivateUse1 left free


@pytest.mark.gpu
def test_with_a_gpu_the_cuda_row_is_detected_and_nothing_is_patched():
    done = run_python("import torch, ditorch; print(ditorch.backend.name, ditorch.is_active(), "
                      "torch.cuda.is_available())")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["cuda", "False", "True"] and "no accelerator found" not in done.stderr


@pytest.mark.gpu
def test_a_gpu_test_runs_where_cuda_is_the_accelerator_and_its_backward_works():
    import torch

    assert torch.accelerator.current_accelerator().type == "cuda"  # the suite's sim is not in this process
    x = torch.randn(4, 4, device="cuda", requires_grad=True)
    (x * 2).sum().backward()
    assert torch.equal(x.grad.cpu(), torch.full((4, 4), 2.0))


@pytest.mark.gpu
def test_sim_refuses_to_register_after_cuda_work():
    done = run_python("import torch, ditorch.sim; torch.ones(1, device='cuda'); ditorch.sim.register()")
    assert done.returncode != 0 and REFUSAL in done.stderr


@pytest.mark.gpu
def test_sim_registered_beside_a_gpu_warns_and_trains_on_sim():
    code = """
import torch, ditorch.sim
ditorch.sim.register()
model = torch.nn.Linear(4, 2).to("sim")
model(torch.ones(3, 4, device="sim")).sum().backward()
print(model.weight.grad.device)
"""
    done = run_python(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "sim:0"
    assert "sim: registered in a process that can use a CUDA GPU" in done.stderr


@pytest.mark.gpu
def test_cuda_backward_beside_a_registered_sim_still_fails_inside_pytorch():
    """The PyTorch limit the refusal and the isolation exist for. If this starts passing, PyTorch has lifted
    it: ditorch.sim.register() can then stop refusing and the suite can stop isolating GPU tests."""
    code = """
import torch, ditorch.sim
ditorch.sim.register()
x = torch.randn(4, device="cuda", requires_grad=True)
(x * 2).sum().backward()
"""
    done = run_python(code)
    if done.returncode == 0:
        pytest.fail("CUDA backward now works beside a PrivateUse1 device: lift the refusal in ditorch.sim.register()")
    assert "opt_ready_stream && opt_parent_stream" in done.stderr
