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
SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")

REPORT = """
import json, sys, torch
import torch.distributed.tensor  # before ditorch (a script that imports DTensor first): ditorch's patch of it runs now
import ditorch
import cuda_surface  # tests/ditorch/scripts
report = {"name": ditorch.backend.name, "device_type": ditorch.backend.device_type, "arch": ditorch.arch,
          "framework": ditorch.framework.__name__, "ccl": ditorch.backend.ccl,
          "cuda_available": torch.cuda.is_available(), "device_count": torch.cuda.device_count()}
if ditorch.backend.name == "dipu":  # DIPU maps CUDA itself (the stand-in's few answers), ditorch nothing
    torch.cuda.set_device("cuda:1")
    patched = sorted(n for n, v in vars(torch.cuda).items() if "ditorch" in str(getattr(v, "__module__", "")))
    report.update(current=torch.cuda.current_device(), module_is_cuda=ditorch.backend.device_module is torch.cuda,
                  cuda_patched=patched)
    print(json.dumps(report))
    sys.exit(0)
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
report["coverage"] = cuda_surface.coverage_report()
report["module_names"] = sorted(vars(ditorch.backend.device_module))
report["capturing"] = torch.cuda.is_current_stream_capturing()
report["nvtx_depth"] = [torch.cuda.nvtx.range_push("step"), torch.cuda.nvtx.range_pop()]
if ditorch.backend.name == "npu":
    report["capability"] = torch.cuda.get_device_capability()
    report["cuda_graph"] = torch.cuda.CUDAGraph.__name__
    npu = torch.npu
    precision = [npu.float32_reduced_precision()]
    npu.matmul.allow_hf32 = True
    precision.append(npu.float32_reduced_precision())
    npu.matmul.allow_hf32 = npu.conv.allow_hf32 = False
    precision.append(npu.float32_reduced_precision())
    del npu.conv.allow_hf32  # as a torch_npu whose switch has a setter only: the documented default (on)
    precision.append(npu.float32_reduced_precision())
    report["float32_reduced_precision"] = precision
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
        env = child_env(env_vars, drop=("DITORCH_",), path=(STANDINS, SCRIPTS))
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
    ("musa", "musa", "musa", "torch_musa", "mccl"), ("dipu", "cuda", "MLU", "torch_dipu", "dicl"),
])
def test_vendor_backend_is_reported_with_its_arch_framework_and_ccl(reports, scenario, name, arch, framework, ccl):
    report, stderr = reports[scenario]
    assert (report["name"], report["device_type"], report["arch"], report["framework"], report["ccl"]) == (
        scenario if scenario != "detected" else "npu", name, arch, framework, ccl)
    assert f"ditorch: {arch} {framework}:0.0-standin pid: " in stderr


@pytest.mark.parametrize("scenario", ["detected", "mlu"])
def test_vendor_with_a_transfer_utility_gets_it_and_then_the_gap_patches(reports, scenario):
    report, _ = reports[scenario]
    assert report["vendor_transfer"]
    assert report["stream"] == "stream-1" and report["current"] == 1  # setters reach the device module
    assert "torch.cuda.jiterator._create_jit_fn is not available on the " + report["name"] in report["jiterator"]
    assert report["restored"]


def test_dipu_is_left_to_its_own_cuda_mapping_as_the_original_ditorch_left_it(reports):
    # DIPU runs on the XPU key and maps torch.cuda itself: ditorch assumed a PrivateUse1 name and failed at import
    # for every DIPU user ("torch_dipu is installed but torch.privateuseone does not exist")
    report, _ = reports["dipu"]
    assert report["cuda_available"] and report["device_count"] == 2 and report["current"] == 1
    assert report["module_is_cuda"] and report["cuda_patched"] == []


@pytest.mark.parametrize("scenario", ["musa"])
def test_privateuse1_vendor_without_a_transfer_gets_the_generic_transfer(reports, scenario):
    report, _ = reports[scenario]
    assert report["cuda_available"] and report["device_count"] == 2
    assert report["stream"] == "stream-1" and report["current"] == 1
    assert f"not available on the {scenario} backend" in report["jiterator"]
    assert report["restored"]


@pytest.mark.parametrize("scenario", [name for name in SCENARIOS if name != "dipu"])  # dipu: ditorch maps nothing
def test_each_torch_cuda_name_ditorch_maps_is_answered_by_the_device_module_else_its_fallback_else_refused(
        reports, scenario):
    from ditorch import cuda_api
    from ditorch.cuda_fallbacks import FALLBACKS

    report, _ = reports[scenario]
    assert report["coverage"], "no torch.cuda name mapped"
    for api, (status, behaviour) in report["coverage"].items():
        name = api.rsplit(".", 1)[-1]
        fallback = FALLBACKS.get(name)
        expected = (cuda_api.ANSWERED if name in report["module_names"] else
                    cuda_api.MAPPED if fallback and set(fallback.needs) <= set(report["module_names"]) else
                    cuda_api.REFUSED)
        assert status == expected, api
        assert (behaviour == "refused") is (status == cuda_api.REFUSED), (api, behaviour)
    # What PyTorch itself asks of torch.cuda, and profiling markers, work whatever the vendor module lacks.
    assert report["capturing"] is False and report["nvtx_depth"] == [0, 0]


def test_npu_answers_the_original_ditorchs_capability_and_keeps_torch_npus_graph_class(reports):
    # torch_npu answers None unless TORCH_NPU_DEVICE_CAPABILITY is set (`capability[0] >= 8` raised TypeError); its
    # transfer puts NPUGraph in torch.cuda.CUDAGraph, which ditorch replaced with a refusal
    report, stderr = reports["detected"]
    assert report["capability"] == [8, 0] and report["cuda_graph"] == "NPUGraph", report
    assert "torch.cuda.get_device_capability() answers (8, 0), as the original ditorch did" in stderr


def test_npu_takes_a_launchers_cuda_visible_devices_as_its_own_where_unset():
    # torch_npu reads ASCEND_RT_VISIBLE_DEVICES only: a CUDA launcher's mask was ignored (every rank saw every card)
    code = "import os, torch, ditorch; print(os.environ.get('ASCEND_RT_VISIBLE_DEVICES'))"
    for given, expected in (({"CUDA_VISIBLE_DEVICES": "2,3"}, "2,3"),
                            ({"CUDA_VISIBLE_DEVICES": "2,3", "ASCEND_RT_VISIBLE_DEVICES": "0"}, "0"), ({}, "None")):
        env = child_env(given, drop=("DITORCH_", "CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES"),
                        path=(STANDINS, SCRIPTS))
        done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, text=True, capture_output=True,
                              timeout=120)
        assert done.returncode == 0 and done.stdout.split() == [expected], (given, done.stderr[-2000:])


def test_npu_reports_the_float32_op_families_its_hf32_switches_put_in_reduced_precision(reports):
    report, _ = reports["detected"]
    assert report["name"] == "npu"
    # torch_npu's defaults (conv on, matmul off); matmul switched on; both off; conv's switch unreadable.
    assert report["float32_reduced_precision"] == [
        {"conv": "hf32"}, {"matmul": "hf32", "conv": "hf32"}, {}, {"conv": "hf32"}]


def test_npu_keeps_its_own_float32_reduced_precision_when_torch_npu_has_one(monkeypatch):
    import types

    from ditorch.adapters import npu, vendor
    from ditorch.patches import Patches

    own = types.ModuleType("torch.npu")  # a torch.npu that has the function (no real torch_npu here)
    own.float32_reduced_precision = lambda: {"matmul": "hf32"}
    monkeypatch.setattr(vendor, "activate_with_vendor_transfer", lambda *args: None)
    patches = Patches()
    npu.activate(types.SimpleNamespace(device_module=own), None, patches, forced=False)
    assert len(patches) == 1  # torch.cuda.get_device_capability's answer where torch_npu gives None; no other
    assert own.float32_reduced_precision() == {"matmul": "hf32"}
    patches.undo()


def test_nccl_is_rewritten_to_the_backend_collective_library():
    from ditorch.transfer import DeviceMap, _ccl_name

    remap = DeviceMap("npu")
    assert _ccl_name("nccl", "hccl", remap) == "hccl"
    assert _ccl_name("cpu:gloo,cuda:nccl", "hccl", remap) == "cpu:gloo,npu:hccl"
    assert _ccl_name("gloo", "hccl", remap) == "gloo"


def test_the_stream_classes_the_transfer_puts_in_torch_cuda_pass_the_check_of_torch_2_4s_dynamo(monkeypatch):
    # MOCK: torch 2.2-2.5's torch._streambase (abstract bases) and a backend's own Event and Stream in torch.cuda;
    # that dynamo asserts on first load (an optimizer's constructor loads it) that they derive from those bases
    import abc
    import types

    import torch

    from ditorch import activation

    streambase = types.ModuleType("torch._streambase")
    streambase._EventBase = type("_EventBase", (abc.ABC,), {})
    streambase._StreamBase = type("_StreamBase", (abc.ABC,), {})
    monkeypatch.setitem(sys.modules, "torch._streambase", streambase)
    event, stream = type("Event", (), {}), type("Stream", (), {})
    monkeypatch.setattr(torch.cuda, "Event", event)
    monkeypatch.setattr(torch.cuda, "Stream", stream)
    activation._streams_known_to_dynamo()
    assert issubclass(event, streambase._EventBase) and issubclass(stream, streambase._StreamBase)
    assert event.__mro__ == (event, object)  # registered, not rebased: nothing else about the class changes
