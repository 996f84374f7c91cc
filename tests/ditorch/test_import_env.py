"""What `import ditorch` does under each environment variable, each in a process of its own that has not imported
ditorch (forked from the suite's server, tests/forked_python.py: torch imported, nothing of ditorch).

Every scenario's process is started at once (module fixture) and the tests read their results.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from hardware import NO_GPU
from subprocess_env import ROOT, child_env


def start_python(code: str, env_vars: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], env=child_env(env_vars, drop=("DITORCH_",)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


SIM_REPORT = """
import torch, ditorch
print(ditorch.backend.name, ditorch.backend.device_type, ditorch.arch, ditorch.framework.__name__, ditorch.backend.ccl)
print(torch.cuda.is_available(), torch.ones(1, device="cuda").device, torch.ones(1).device)
"""
DISABLED = """
import torch, ditorch
print(ditorch.backend.name, ditorch.is_active(), torch.cuda.is_available())
try:
    torch.ones(1, device="cuda")
except (RuntimeError, AssertionError):
    print("cuda refused")
"""
RELOAD = """
import importlib, torch, ditorch
from ditorch import activation
count = activation.patch_count()
import ditorch
importlib.reload(ditorch)
print(activation.patch_count() == count, torch.ones(1, device="cuda").to("cuda").device)
"""
SCENARIOS = {
    "forced_sim": (SIM_REPORT, {"DITORCH_BACKEND": "sim"}),
    "quiet": (SIM_REPORT, {"DITORCH_BACKEND": "sim", "DITORCH_QUIET": "1", "DITORCH_SHOW_DEVICE_AS_CUDA": "0"}),
    # Premise: no accelerator. Where there is a GPU, it is hidden from these two.
    "disable_mock": (DISABLED, {"DITORCH_BACKEND": "sim", "DITORCH_DISABLE_MOCK": "1", **NO_GPU}),
    "host": ("import torch, ditorch; print(ditorch.backend.name, ditorch.arch, torch.cuda.is_available())", NO_GPU),
    "reload": (RELOAD, {"DITORCH_BACKEND": "sim"}),
    "count": ("import torch, ditorch; print(torch.cuda.device_count(), torch.ones(1, device='cuda:1').device)",
              {"DITORCH_BACKEND": "sim", "DITORCH_SIM_DEVICE_COUNT": "2", "DITORCH_SHOW_DEVICE_AS_CUDA": "0"}),
    "bad_backend": ("import torch, ditorch", {"DITORCH_BACKEND": "gpu"}),
    "bad_count": ("import torch, ditorch", {"DITORCH_BACKEND": "sim", "DITORCH_SIM_DEVICE_COUNT": "0"}),
}


@pytest.fixture(scope="module")
def results() -> dict:
    running = {name: start_python(code, env) for name, (code, env) in SCENARIOS.items()}
    finished = {}
    for name, process in running.items():
        stdout, stderr = process.communicate(timeout=180)
        finished[name] = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    return finished



def test_forced_sim_prints_the_banner_and_transfers(results):
    result = results["forced_sim"]
    assert result.returncode == 0, result.stderr
    assert re.search(r"^ditorch: sim torch:\S+ pid: \d+$", result.stderr, re.M)
    assert result.stdout.splitlines() == ["sim sim sim torch simccl", "True cuda:0 cpu"]


def test_quiet_silences_the_banner_and_show_as_cuda_off_shows_the_real_device(results):
    result = results["quiet"]
    assert result.returncode == 0, result.stderr
    assert "ditorch:" not in result.stderr
    assert result.stdout.splitlines()[1] == "True sim:0 cpu"


def test_disable_mock_detects_but_patches_nothing(results):
    result = results["disable_mock"]
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["sim False False", "cuda refused"]


def test_without_an_accelerator_the_host_is_used_with_one_line_saying_so(results):
    result = results["host"]
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "cpu cpu False"
    assert len(re.findall("no accelerator found", result.stderr)) == 1


def test_importing_twice_and_reloading_is_harmless(results):
    result = results["reload"]
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True cuda:0"
    assert result.stderr.count("ditorch: sim") == 1


def test_sim_device_count_gives_more_devices(results):
    result = results["count"]
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "2 sim:1"


@pytest.mark.parametrize("scenario, message", [
    ("bad_backend", r"ValueError: DITORCH_BACKEND='gpu': expected one of npu, mlu, dipu, musa, cuda"),
    ("bad_count", r"ValueError: DITORCH_SIM_DEVICE_COUNT='0': expected a positive integer"),
])
def test_malformed_values_fail_the_import_clearly(results, scenario, message):
    result = results[scenario]
    assert result.returncode != 0
    assert re.search(message, result.stderr), result.stderr
