"""sim counts what a real device charges the host: synchronisations, copies each way, kernel launches."""

import pytest
import torch


def charged(work):
    """The counts ``work()`` added (the counters are per process: a difference, never an absolute)."""
    before = torch.sim.device_counts()
    work()
    return torch.sim.device_counts() - before


@pytest.fixture
def x(sim):
    return torch.arange(6.0, device=sim)


def test_a_blocking_copy_to_the_host_is_one_synchronisation_and_its_bytes(x):
    counts = charged(lambda: x.cpu())
    assert (counts.synchronizations, counts.device_to_host_copies, counts.device_to_host_bytes) == (1, 1, 24)
    assert counts.kernel_launches == 0


def test_a_non_blocking_copy_to_the_host_does_not_synchronise_until_the_event_is_waited_for(x):
    def work():
        x.to("cpu", non_blocking=True)
        event = torch.sim.Event()
        event.record()
        assert event.query()  # polling never blocks
        event.synchronize()

    counts = charged(work)
    assert (counts.synchronizations, counts.device_to_host_copies) == (1, 1)  # the event's wait, not the copy


def test_a_non_blocking_copy_into_pinned_memory_does_not_synchronise_into_pageable_memory_does(x):
    pinned, pageable = torch.empty(6).pin_memory(), torch.empty(6)
    assert charged(lambda: pinned.copy_(x, non_blocking=True)).synchronizations == 0
    assert charged(lambda: pageable.copy_(x, non_blocking=True)).synchronizations == 1


def test_copies_to_the_device_count_their_bytes_and_synchronise_unless_non_blocking(sim):
    host = torch.ones(3, dtype=torch.float64)
    blocking, non_blocking = charged(lambda: host.to(sim)), charged(lambda: host.to(sim, non_blocking=True))
    assert (blocking.synchronizations, blocking.host_to_device_copies, blocking.host_to_device_bytes) == (1, 1, 24)
    assert (non_blocking.synchronizations, non_blocking.host_to_device_bytes) == (0, 24)


@pytest.mark.parametrize("read", [lambda t: t.sum().item(), lambda t: bool(t.sum()), lambda t: t.tolist(),
                                  lambda t: t[t > 2], lambda t: t.nonzero(), lambda t: torch.equal(t, t)],
                         ids=["item", "bool", "tolist", "boolean mask", "nonzero", "equal"])
def test_reading_values_or_data_dependent_sizes_synchronises_once(x, read):
    assert charged(lambda: read(x)).synchronizations == 1


def test_device_math_launches_kernels_and_views_do_not(x):
    math, views = charged(lambda: (x * 2 + 1).exp()), charged(lambda: x.view(2, 3).t()[0])
    assert (math.kernel_launches, math.synchronizations, math.device_to_host_copies) == (3, 0, 0)
    assert views.kernel_launches == 0


def test_a_device_stream_or_event_synchronize_counts_and_a_reset_starts_again(sim):
    counts = charged(lambda: (torch.sim.synchronize(), torch.sim.current_stream().synchronize()))
    assert counts.synchronizations == 2
    torch.sim.reset_device_counts()
    assert torch.sim.device_counts() == torch.sim.DeviceCounts()


def test_backward_on_autograds_device_thread_is_counted(sim):
    w = torch.randn(4, 4, device=sim, requires_grad=True)
    loss = (w @ w).sum()
    counts = charged(loss.backward)
    assert counts.kernel_launches > 0 and counts.synchronizations == 0


def test_an_asynchronous_sim_lands_a_non_blocking_copy_only_when_the_device_gets_there(sim):
    import ditorch.sim

    x = torch.arange(3.0, device=sim)
    with ditorch.sim.asynchronous(lag=3):
        host = x.to("cpu", non_blocking=True)
        event = torch.sim.Event()
        event.record()
        assert torch.isnan(host).all() and not event.query()  # read too early: what a GPU's memory held
        y = x
        for _ in range(3):
            y = y + 1  # three kernels later the device has reached the event
        assert event.query() and host.tolist() == [0.0, 1.0, 2.0]
        late = x.to("cpu", non_blocking=True)
        torch.sim.synchronize()  # or the device is synchronised
        assert late.tolist() == [0.0, 1.0, 2.0]
        blocking = x.cpu()  # a blocking copy has landed when it returns
        assert blocking.tolist() == [0.0, 1.0, 2.0]


def test_an_asynchronous_sim_is_set_by_its_variable_and_refuses_a_negative_lag(sim):
    import ditorch.sim
    from ditorch.env import read

    with pytest.raises(ValueError, match="lag=-1"):
        with ditorch.sim.asynchronous(lag=-1):
            pass
    assert read("DITORCH_SIM_ASYNC", {"DITORCH_SIM_ASYNC": "16"}) == 16
    with pytest.raises(ValueError, match="DITORCH_SIM_ASYNC"):
        read("DITORCH_SIM_ASYNC", {"DITORCH_SIM_ASYNC": "-2"})
