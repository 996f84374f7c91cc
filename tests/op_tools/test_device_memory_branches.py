"""The branches a real device takes, run on sim through its switches: statistics computed on device memory
(``ditorch.sim.device_memory()``, ``DITORCH_SIM_DEVICE_MEMORY=1``), a device without float64 kernels
(``.*@float64:unsupported``) and timing events on a stream that is not the current one."""

from __future__ import annotations

import pytest
import torch

import ditorch.sim
import op_tools
from op_tools.numerics import error_statistics
from op_tools.numerics.device_timing import EventClock, clock_for
from op_tools.tools import autocompare

LARGE = autocompare.DEVICE_STATISTICS_MIN  # outputs from this size are compared on their device


@pytest.fixture
def fresh_float64_probe():
    """The float64 probe answers once per process and device type: each test asks it again."""
    saved = dict(autocompare.LEARNT.float64)
    autocompare.LEARNT.float64.clear()
    yield
    autocompare.LEARNT.float64.clear()
    autocompare.LEARNT.float64.update(saved)


def test_the_switch_makes_sim_storage_device_memory(sim):
    x = torch.ones(3, device=sim)
    assert x.untyped_storage().device.type == "cpu" and not autocompare._in_device_memory(x)
    with ditorch.sim.device_memory():
        assert x.untyped_storage().device == torch.device(sim, 0)
        assert autocompare._in_device_memory(x)
        assert (x * 2).sum().item() == 6  # ops still compute
    assert x.untyped_storage().device.type == "cpu"


@pytest.mark.parametrize("batch", [1, 64])
def test_a_large_output_in_device_memory_is_compared_on_the_device_and_a_fault_fails(sim, fresh_float64_probe,
                                                                                       batch):
    """Judged when it returns (``verdict_batch=1``), a large output is compared where it lies; judged later with
    others, it is copied to the host as it was (the device's tensor may be written before then)."""
    x = torch.randn(LARGE, device=sim)
    with ditorch.sim.device_memory(), op_tools.OpAutoCompare(verdict_batch=batch) as tool:
        torch.nn.functional.silu(x)  # correct: passes
        with ditorch.sim.faults("silu:noise=1e-2"):
            torch.nn.functional.silu(x)
    # the probe ran on the device, for the comparison on it
    assert autocompare.LEARNT.float64 == ({"sim": True} if batch == 1 else {})
    assert tool.counts["forward compared"] == 2, tool.counts
    assert tool.counts["forward passed"] == 1 and tool.counts["forward failed"] == 1
    assert tool.counts["forward not checked"] == 0


def test_a_device_without_float64_compares_large_outputs_on_the_host(sim, fresh_float64_probe):
    x = torch.randn(LARGE, device=sim)
    with ditorch.sim.device_memory(), op_tools.OpAutoCompare(verdict_batch=1) as tool, \
            ditorch.sim.faults("silu:noise=1e-2;.*@float64:unsupported"):
        torch.nn.functional.silu(x)
    assert autocompare.LEARNT.float64 == {"sim": False}
    assert tool.counts["forward compared"] == tool.counts["forward failed"] == 1, tool.counts


def test_the_variable_turns_the_switch_on_for_the_whole_run(run_script):
    done = run_script("print(torch.ones(2, device='sim').untyped_storage().device)",
                      {"DITORCH_SIM_DEVICE_MEMORY": "1", "DITORCH_QUIET": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "sim:0"


@pytest.mark.parametrize("relative", [None, (2.0 ** -8, 1e-38)])  # the summed and the rounded-once measures
@pytest.mark.parametrize("size", [8, LARGE + 3])  # one chunk (whole tensors), and a tail chunk after full ones
def test_statistics_on_device_memory_equal_the_host_ones(sim, size, relative, monkeypatch):
    monkeypatch.setattr(error_statistics, "_CHUNK_DEVICE", 1 << 10)  # several device chunks at a test's size
    torch.manual_seed(0)
    reference = torch.randn(size, dtype=torch.float64)
    device = (reference * (1 + 1e-3 * torch.randn(size, dtype=torch.float64))).float()
    on_host = error_statistics._torch_stats(device, reference, 1e-5, 1e-5, relative)
    on_sim = error_statistics.error_stats(device.to(sim), reference, 1e-5, 1e-5, relative)
    assert on_sim == pytest.approx(on_host, rel=1e-12)
    assert error_statistics.normalised_error(device.to(sim), reference) == pytest.approx(
        error_statistics.normalised_error(device, reference), rel=1e-12)


def test_event_clock_times_work_on_a_side_stream(sim):
    clock = clock_for(torch.device(sim, 0), synchronise=False)
    assert isinstance(clock, EventClock)
    side = torch.sim.Stream()
    with torch.sim.stream(side):
        start = clock.mark()
        torch.ones(64, 64, device=sim).matmul(torch.ones(64, 64, device=sim))
        end = clock.mark()
    start_ns, duration_ns = clock.span(start, end)
    assert duration_ns > 0 and start_ns >= clock.origin_ns


def test_an_event_clocks_spans_start_when_the_host_marked_them_however_long_its_first_wait(sim, monkeypatch):
    """The clock's origin is the host instant its origin event was recorded at, not the end of the wait for it: a
    span timed by events and one timed by the host's clock (a CPU call's) lie on one timeline, in order."""
    import time

    waits = []
    wait = torch.sim.Event.synchronize

    def slow_wait(event):  # a loaded host: each wait returns 5 ms late
        waits.append(event)
        time.sleep(0.005)
        return wait(event)

    monkeypatch.setattr(torch.sim.Event, "synchronize", slow_wait)
    clock = clock_for(torch.device(sim, 0), synchronise=False)
    assert isinstance(clock, EventClock) and waits
    monkeypatch.setattr(torch.sim.Event, "synchronize", wait)
    before = time.perf_counter_ns()
    start = clock.mark()
    after = time.perf_counter_ns()
    start_ns, _ = clock.span(start, clock.mark())
    assert before - 50_000 <= start_ns <= after + 50_000, (before, start_ns, after)
