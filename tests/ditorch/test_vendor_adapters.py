"""Vendor adapters, exercised against STAND-IN vendor packages (tests/ditorch/vendor_standins/).

The real torch_npu, torch_mlu, torch_musa and torch_dipu cannot be installed here. The stand-ins
register a device name and a device module and compute nothing: these tests check ditorch's
adapter logic (detection order, reported names, the vendor transfer being used, the gaps patched),
not the vendors' packages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from subprocess_env import ROOT, child_env

STANDINS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vendor_standins")

REPORT = """
import json, sys, torch, ditorch
report = {"name": ditorch.backend.name, "device_type": ditorch.backend.device_type, "arch": ditorch.arch,
          "framework": ditorch.framework.__name__, "ccl": ditorch.backend.ccl,
          "cuda_available": torch.cuda.is_available(), "device_count": torch.cuda.device_count()}
torch.cuda.set_stream("stream-1")
report["stream"] = getattr(torch, ditorch.backend.device_type).state["stream"]
torch.cuda.set_device("cuda:1")
report["current"] = getattr(torch, ditorch.backend.device_type).current_device()
transfer = {"npu": "torch_npu.contrib.transfer_to_npu", "mlu": "torch_mlu.utils.model_transfer"}
report["vendor_transfer"] = transfer.get(ditorch.backend.name) in sys.modules
try:
    torch.cuda.jiterator._create_jit_fn("code")
except NotImplementedError as error:
    report["jiterator"] = str(error)
original = vars(torch.cuda).get("set_stream")
ditorch.deactivate()
report["restored"] = vars(torch.cuda).get("set_stream") is not original
print(json.dumps(report))
"""

SCENARIOS = {
    "detected": {},  # every stand-in installed: the first row of the table (npu) wins
    "mlu": {"DITORCH_BACKEND": "mlu"},
    "musa": {"DITORCH_BACKEND": "musa"},
    "dipu": {"DITORCH_BACKEND": "dipu"},
}


@pytest.fixture(scope="module")
def reports() -> dict:
    running = {}
    for name, env_vars in SCENARIOS.items():
        env = child_env(env_vars, drop=("DITORCH_",), path=(STANDINS,))
        running[name] = subprocess.Popen([sys.executable, "-c", REPORT], env=env, cwd=ROOT, text=True,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    finished = {}
    for name, process in running.items():
        stdout, stderr = process.communicate(timeout=180)
        assert process.returncode == 0, stderr[-3000:]
        finished[name] = (json.loads(stdout.strip().splitlines()[-1]), stderr)
    return finished


@pytest.mark.parametrize("scenario, name, arch, framework, ccl", [
    ("detected", "npu", "ascend", "torch_npu", "hccl"), ("mlu", "mlu", "camb", "torch_mlu", "cncl"),
    ("musa", "musa", "musa", "torch_musa", "mccl"), ("dipu", "dipu", "dipu", "torch_dipu", "dicl"),
])
def test_vendor_backend_is_reported_with_its_arch_framework_and_ccl(reports, scenario, name, arch, framework, ccl):
    report, stderr = reports[scenario]
    assert (report["name"], report["device_type"], report["arch"], report["framework"], report["ccl"]) == (
        name, name, arch, framework, ccl)
    assert f"ditorch: {arch} {framework}:0.0-standin pid: " in stderr


@pytest.mark.parametrize("scenario", ["detected", "mlu"])
def test_vendor_with_a_transfer_utility_gets_it_and_then_the_gap_patches(reports, scenario):
    report, _ = reports[scenario]
    assert report["vendor_transfer"]
    assert report["stream"] == "stream-1" and report["current"] == 1  # setters reach the device module
    assert "torch.cuda.jiterator._create_jit_fn is not available on the " + report["name"] in report["jiterator"]
    assert report["restored"]


@pytest.mark.parametrize("scenario", ["musa", "dipu"])
def test_privateuse1_vendor_without_a_transfer_gets_the_generic_transfer(reports, scenario):
    report, _ = reports[scenario]
    assert report["cuda_available"] and report["device_count"] == 2
    assert report["stream"] == "stream-1" and report["current"] == 1
    assert f"not available on the {scenario} backend" in report["jiterator"]
    assert report["restored"]


def test_nccl_is_rewritten_to_the_backend_collective_library():
    from ditorch.transfer import DeviceMap, _ccl_name

    remap = DeviceMap("npu")
    assert _ccl_name("nccl", "hccl", remap) == "hccl"
    assert _ccl_name("cpu:gloo,cuda:nccl", "hccl", remap) == "cpu:gloo,npu:hccl"
    assert _ccl_name("gloo", "hccl", remap) == "gloo"
