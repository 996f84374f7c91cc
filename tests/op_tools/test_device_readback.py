"""DeviceReadback: per-call values read back in batches, in put order, without synchronising until drained."""

import pytest
import torch

from op_tools.numerics.device_readback import DeviceReadback


def charged(work):
    before = torch.sim.device_counts()
    result = work()
    return result, torch.sim.device_counts() - before


def put_and_read(readback, sim, puts: int, width: int):
    """``puts`` values ``[k] * width`` put with token ``k``, then what is ready, and what that charged."""
    def work():
        for k in range(puts):
            readback.put(torch.full((width,), float(k), device=sim), token=k)
        return list(readback.ready())

    return charged(work)


def test_values_come_back_in_put_order_one_copy_per_batch_and_no_synchronisation(sim):
    readback = DeviceReadback(batch=4)
    ready, counts = put_and_read(readback, sim, puts=10, width=2)
    # sim's events complete at once: the two full batches are ready, the last two puts wait for a send
    assert ready == [(k, [float(k), float(k)]) for k in range(8)] and len(readback) == 2
    assert (counts.synchronizations, counts.device_to_host_copies) == (0, 2)
    rest, counts = charged(lambda: list(readback.drain()))
    assert rest == [(8, [8.0, 8.0]), (9, [9.0, 9.0])] and len(readback) == 0
    assert (counts.synchronizations, counts.device_to_host_copies) == (1, 1)  # the drain's one wait


def test_lists_of_scalars_of_mixed_dtypes_are_joined_when_sent(sim):
    readback = DeviceReadback(batch=64)
    half, wide = torch.tensor(1.5, dtype=torch.bfloat16, device=sim), torch.tensor(float("inf"), device=sim)
    _, counts = charged(lambda: readback.put([half, wide], token="a"))
    assert counts.kernel_launches == 0  # nothing joined before the batch is sent
    assert list(readback.drain()) == [("a", [1.5, float("inf")])]


def test_a_change_of_device_sends_the_batch_so_order_holds(sim):
    readback = DeviceReadback(batch=64)
    readback.put(torch.ones(1, device=sim), token="device")
    readback.put(torch.zeros(1), token="host")  # host values: no copy, no event
    readback.put(torch.full((1,), 2.0, device=sim), token="device again")
    assert [token for token, _ in readback.drain()] == ["device", "host", "device again"]


def test_a_device_module_without_events_reads_each_batch_with_one_blocking_copy(sim, monkeypatch):
    monkeypatch.delattr(torch.sim, "Event")
    readback = DeviceReadback(batch=2)
    ready, counts = put_and_read(readback, sim, puts=4, width=1)
    assert [token for token, _ in ready] == [0, 1, 2, 3] and counts.synchronizations == 2


def test_a_batch_below_one_is_refused():
    with pytest.raises(ValueError, match="batch must be at least 1, not 0"):
        DeviceReadback(batch=0)


@pytest.mark.parametrize("place", ["cpu", "sim"])
def test_reduced_rows_of_a_batch_give_the_numbers_each_call_computed_alone(sim, place):
    # A run recording's fingerprints: the block sums of every call of a batch multiplied by the weights at once, in
    # place of one product per call; the same numbers, in each put's order (float32 and float64 rows apart).
    from op_tools.numerics.tensor_stats import calls_stats

    device = torch.device(sim if place == "sim" else "cpu")
    generator = torch.Generator().manual_seed(3)
    calls = [[torch.randn(n, generator=generator).to(device, dtype) for n, dtype in shapes]
             for shapes in [[(5000, torch.float32)], [(7, torch.float64), (3000, torch.float32)],
                            [(100, torch.bfloat16), (1021 * 3 + 5, torch.float32), (64, torch.float64)]]]
    readback = DeviceReadback(batch=64)
    alone = []
    with torch.no_grad():
        for k, tensors in enumerate(calls):
            alone.append([v for _, parts in calls_stats(tensors) for v in torch.cat(parts).tolist()])
            readback.put([part for _, parts in calls_stats(tensors, deferred=True) for part in parts], token=k)
        read, counts = charged(lambda: list(readback.drain()))
    assert [token for token, _ in read] == [0, 1, 2] and [values for _, values in read] == alone
    if place == "sim":  # two kinds of rows (float32, float64): a join, the tails' add, a product and a sum each, then
        assert counts.kernel_launches == 2 * 4 + 1  # one join


def test_host_values_of_a_batch_are_reduced_together_as_a_devices_are():
    # The CPU device's puts: one reduction per kind of rows a batch, not one a put (a recording's fingerprints on the
    # CPU spent a quarter of its time in a product and a sum per call).
    from op_tools.numerics.device_readback import Reduced

    reductions = []

    def reduce(rows):
        reductions.append(len(rows))
        return torch.stack(rows).sum(1, keepdim=True)

    readback = DeviceReadback(batch=4)
    for k in range(4):
        readback.put([torch.tensor([float(k)]), Reduced(torch.full((3,), float(k)), reduce, 1)], token=k)
    assert list(readback.ready()) == [(k, [float(k), 3.0 * k]) for k in range(4)]
    assert reductions == [4]
