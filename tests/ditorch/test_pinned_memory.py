"""pin_memory() on the sim device and on the host, where PyTorch has no pinned-memory allocator to give."""

import json
import subprocess
import sys

import pytest
import torch
from subprocess_env import child_env


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



def test_staging_gives_cpp_callers_pinned_cpu_tensors_while_held(sim):
    import gc

    from ditorch import pinned_memory

    # DDP's reducer calls empty_like(..., pin_memory=true) from C++, which reaches empty_strided's CPU kernel.
    empty_strided = torch.ops.aten.empty_strided.default
    release = pinned_memory.hold_staging()
    try:
        staged = empty_strided([2, 3], [1, 2], dtype=torch.int32, pin_memory=True)
        plain = empty_strided([2, 3], [3, 1], pin_memory=False)
        assert (staged.shape, staged.stride(), staged.dtype, staged._is_view()) == ((2, 3), (1, 2), torch.int32, False)
        assert staged.is_pinned() and not plain.is_pinned() and plain.dtype == torch.get_default_dtype()
        assert not staged[:, :1].clone().is_pinned()
        staged.copy_(torch.arange(6, dtype=torch.int32).reshape(2, 3))
        assert torch.equal(staged.to(sim).cpu(), torch.arange(6, dtype=torch.int32).reshape(2, 3))
        del staged
        gc.collect()
        assert not pinned_memory._staged  # forgotten with its storage: a later tensor there is not pinned
    finally:
        release()
    with pytest.raises(NotImplementedError, match="getPinnedMemoryAllocator"):  # PyTorch's kernel again
        empty_strided([2], [1], pin_memory=True)


PINNING_SCRIPT = """
import json, torch, ditorch
x = torch.arange(12.0).reshape(3, 4).t()
pinned = x.pin_memory()
grown = torch.ones(2, requires_grad=True, pin_memory=True)
data = torch.utils.data.TensorDataset(torch.randn(8, 2), torch.arange(8))
batches = [b.cuda(non_blocking=True) for b, _ in torch.utils.data.DataLoader(data, 4, pin_memory=True)]
checks = {
    "copy": torch.equal(pinned, x) and pinned.is_contiguous() and not pinned.is_pinned() and not x.is_pinned(),
    "to_device": torch.equal(pinned.to("cuda", non_blocking=True).cpu(), x) and pinned.cuda().is_cuda,
    "factories": (torch.empty(2, 3, pin_memory=True).shape == (2, 3)
                  and torch.equal(torch.zeros(2, pin_memory=True, device="cpu"), torch.zeros(2))
                  and torch.equal(torch.tensor([1.0, 2.0], pin_memory=True), torch.tensor([1.0, 2.0]))
                  and torch.equal(x.new_ones(2, pin_memory=True), torch.ones(2))),
    "leaf": grown.is_leaf and grown.requires_grad,
    "loader": torch.equal(torch.cat([b.cpu() for b in batches]), data.tensors[0]),
}
ditorch.deactivate()
try:
    torch.zeros(2).pin_memory()
    checks["undone"] = ditorch.backend.name == "sim"  # sim's device keeps its own kernel for good
except RuntimeError:
    checks["undone"] = ditorch.backend.name == "cpu"  # PyTorch's own again: no accelerator to pin for
print(json.dumps(checks))
"""


@pytest.mark.parametrize("backend", ["cpu", "sim"])
def test_a_script_that_pins_memory_runs_on_the_host_and_on_sim(backend):
    # nanoGPT's get_batch: x.pin_memory().to(device, non_blocking=True); the host run is the reference run.
    done = subprocess.run([sys.executable, "-c", PINNING_SCRIPT], capture_output=True, text=True, timeout=120,
                          env=child_env({"DITORCH_BACKEND": backend, "DITORCH_QUIET": "1"}))
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout) == dict.fromkeys(["copy", "to_device", "factories", "leaf", "loader", "undone"],
                                                    True)
