"""pin_memory() on a process with the sim device, which PyTorch would refuse (no pinned allocator in Python hooks)."""

import torch


def test_pin_memory_gives_an_equal_contiguous_copy_that_moves_to_sim(sim):
    x = torch.arange(12.0).reshape(3, 4).t()
    pinned = x.pin_memory()
    assert torch.equal(pinned, x) and pinned.is_contiguous() and pinned.data_ptr() != x.data_ptr()
    moved = pinned.to(sim, non_blocking=True)
    assert moved.device.type == "sim" and torch.equal(moved.cpu(), x)


def test_pin_memory_keeps_autograd(sim):
    x = torch.ones(3, requires_grad=True)
    (x.pin_memory() * 2).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))


def test_dataloader_pins_batches_for_the_sim_device(sim):
    data = torch.utils.data.TensorDataset(torch.randn(8, 2), torch.arange(8))
    batches = [(x.to(sim, non_blocking=True), y) for x, y in torch.utils.data.DataLoader(data, 4, pin_memory=True)]
    assert len(batches) == 2 and torch.equal(torch.cat([x.cpu() for x, _ in batches]), data.tensors[0])

