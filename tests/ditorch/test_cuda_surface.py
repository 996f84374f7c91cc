"""The torch.cuda surface on the sim device and on the host: every public callable is answered, mapped or
refused as ditorch says (so a gap is a choice), and what scripts and PyTorch itself call works.

Each backend runs tests/ditorch/scripts/cuda_surface.py in a fresh interpreter (both at once); the vendor
adapters get the same check through their stand-ins in test_vendor_adapters.py.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from subprocess_env import ROOT, child_env

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "cuda_surface.py")
BACKENDS = ("sim", "cpu")
# What PyTorch's own code asks of torch.cuda (or of the device's module) in ordinary training: the
# optimizers' and SyncBatchNorm's graph-capture checks, fork_rng, checkpointing, FSDP's memory report.
ASKED_BY_PYTORCH = ("is_available", "is_initialized", "device_count", "current_device", "set_device", "device",
                    "synchronize", "get_rng_state", "set_rng_state", "manual_seed_all", "current_stream", "Stream",
                    "Event", "stream", "is_current_stream_capturing", "memory_summary", "get_device_properties",
                    "is_bf16_supported")


@pytest.fixture(scope="module")
def reports() -> dict:
    running = {backend: subprocess.Popen([sys.executable, SCRIPT, "--common"], cwd=ROOT, text=True,
                                         env=child_env({"DITORCH_BACKEND": backend, "DITORCH_QUIET": "1"},
                                                       drop=("DITORCH_",)),
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
               for backend in BACKENDS}
    finished = {}
    for backend, process in running.items():
        stdout, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr[-3000:]
        finished[backend] = (json.loads(stdout.strip().splitlines()[-1]), stderr)
    return finished


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_public_torch_cuda_callable_is_answered_mapped_or_refused_as_classified(reports, backend):
    from ditorch import cuda_api

    coverage = reports[backend][0]["coverage"]
    assert set(coverage) == set(cuda_api.surface())
    for api, (status, behaviour) in coverage.items():
        assert status in (cuda_api.ANSWERED, cuda_api.MAPPED, cuda_api.REFUSED)
        assert (behaviour == "refused") is (status == cuda_api.REFUSED), (api, behaviour)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_lstm_and_a_float32_autocast_warn_of_nothing_a_cuda_run_would_not(reports, backend):
    # cuDNN's check met a tensor shown as cuda and warned twice that torch has no cuDNN; sim's autocast refused float32
    assert reports[backend][0]["warnings"] == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_what_pytorch_itself_asks_of_torch_cuda_is_never_refused(reports, backend):
    coverage = reports[backend][0]["coverage"]
    refused = [name for name in ASKED_BY_PYTORCH if coverage[f"torch.cuda.{name}"][0] == "refused"]
    assert refused == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_cuda_calls_common_in_scripts_work(reports, backend):
    failed = {name: outcome for name, outcome in reports[backend][0]["common"].items() if outcome != "ok"}
    assert failed == {}


@pytest.mark.parametrize("backend", BACKENDS)
def test_pytorch_flows_reaching_torch_cuda_work(reports, backend):
    """Optimizer steps, GradScaler with autocast, checkpointing, DataLoader workers with pinned memory."""
    failed = {name: outcome for name, outcome in reports[backend][0]["flows"].items() if outcome != "ok"}
    assert failed == {}


@pytest.mark.parametrize("backend", BACKENDS)
def test_degraded_answers_are_said_once_on_the_ditorch_logger(reports, backend):
    stderr = reports[backend][1]
    assert stderr.count(f"torch.cuda.set_per_process_memory_fraction on the {backend} backend") == 1
    assert stderr.count(f"torch.cuda.utilization on the {backend} backend: not measured") == 1


# -- in this process, on the sim device -----------------------------------------------------------

@pytest.fixture
def transfer(sim):
    import ditorch
    from ditorch import activation, backends
    from ditorch.env import DeviceLayerConfig

    ditorch.deactivate()
    config = DeviceLayerConfig(backend="sim", quiet=True, disable_mock=False, show_device_as_cuda=False)
    activation.activate(backends.detect("sim"), config, forced=True)
    yield
    activation.deactivate()


def test_nvtx_ranges_become_profiler_ranges(transfer):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        assert torch.cuda.nvtx.range_push("forward") == 0
        assert torch.cuda.nvtx.range_push("attention") == 1
        torch.ones(2, device="cuda") * 2
        assert torch.cuda.nvtx.range_pop() == 1 and torch.cuda.nvtx.range_pop() == 0
        assert torch.cuda.nvtx.range_pop() == -1  # nothing open: CUDA's NVTX answers a negative depth too
        with torch.cuda.nvtx.range("step {}", 3):
            torch.ones(2, device="cuda") + 1
    names = {event.name for event in prof.events()}
    assert {"forward", "attention", "step 3"} <= names


def test_memory_fraction_is_checked_like_cuda_and_kept(transfer, caplog):
    from ditorch import cuda_fallbacks

    cuda_fallbacks._noted.discard(("sim", "set_per_process_memory_fraction"))
    with pytest.raises(ValueError, match="Invalid fraction value: 1.5. Allowed range: 0~1"):
        torch.cuda.set_per_process_memory_fraction(1.5)
    with pytest.raises(TypeError, match="must be `float`"):
        torch.cuda.set_per_process_memory_fraction(1)
    with caplog.at_level(logging.WARNING, logger="ditorch"):
        torch.cuda.set_per_process_memory_fraction(0.25, "cuda:0")
        torch.cuda.set_per_process_memory_fraction(0.25, 0)
    assert torch.cuda.get_per_process_memory_fraction(0) == 0.25
    assert [r.getMessage() for r in caplog.records if "memory_fraction" in r.getMessage()] == [
        "ditorch: torch.cuda.set_per_process_memory_fraction on the sim backend: the limit (0.25) is kept but not "
        "enforced: this device has no allocator limit ditorch can set"]
    torch.cuda.set_per_process_memory_fraction(1.0)


def test_memory_summary_reports_the_device_statistics(transfer):
    block = torch.empty(1000, device="cuda")
    summary = torch.cuda.memory_summary()
    assert summary.startswith("ditorch: memory of sim:0 (from ditorch.sim.device_module")
    allocated = f"{torch.cuda.memory_allocated():,}"
    assert any(line.startswith("allocated bytes") and allocated in line for line in summary.splitlines())
    assert torch.cuda.memory_stats_as_nested_dict()["allocated_bytes"]["all"]["current"] >= block.numel() * 4


def test_the_sim_module_itself_answers_what_pytorch_asks_it(sim):
    assert torch.sim.is_current_stream_capturing() is False
    assert "allocated bytes" in torch.sim.memory_summary()


def test_a_name_with_neither_a_device_function_nor_a_fallback_is_refused(sim):
    import types

    from ditorch import cuda_api
    from ditorch.backends import Backend

    bare = Backend("bare", "bare", "bare", torch, None, types.ModuleType("torch.bare"), types.ModuleType("adapter"))
    assert cuda_api.resolve("torch.cuda.nvtx.range_push", bare)[0] == cuda_api.MAPPED
    assert cuda_api.resolve("torch.cuda.memory_cached", bare)[0] == cuda_api.REFUSED  # needs memory_reserved
    assert cuda_api.resolve("torch.cuda.current_blas_handle", bare) == (cuda_api.REFUSED, None)
