"""torch.sim answers the torch.cuda API with real values."""

import subprocess
import sys
import time

import pytest
import torch
from subprocess_env import child_env


@pytest.mark.usefixtures("sim")
def test_device_module_basics():
    assert torch.sim.is_available() and torch.sim.device_count() == 1
    assert torch.sim.current_device() == 0
    assert torch.sim.get_device_name() == "sim"
    assert torch.sim.get_device_capability() == (1, 0)
    assert torch.sim.get_device_properties(0).total_memory > 0
    assert torch.sim.is_bf16_supported()
    torch.sim.synchronize()
    with pytest.raises(RuntimeError, match="invalid device ordinal 3"):
        torch.sim.set_device(3)


@pytest.mark.usefixtures("sim")
def test_the_device_initialises_lazily_as_cuda_does(monkeypatch):
    from ditorch.sim.tensor import DeviceSelection

    for first_use in (lambda: torch.ones(1, device="sim"), torch.sim.current_device, lambda: torch.sim.set_device(0),
                      torch.sim.synchronize):
        monkeypatch.setattr(DeviceSelection, "initialized", False)
        torch.sim.is_available(), torch.sim.device_count()  # queries that initialise nothing, on CUDA too
        assert not torch.sim.is_initialized()
        first_use()
        assert torch.sim.is_initialized()


@pytest.mark.usefixtures("sim")
def test_device_mesh_sets_the_device_from_local_rank_until_the_device_is_used(monkeypatch):
    """PyTorch's FSDP2 example never sets the device (its `torch.accelerator.device_index(rank)` is a context manager,
    never entered): DeviceMesh sets it from LOCAL_RANK because the device is not yet initialised. A device that said
    it was left rank 1 on device 0, and FSDP2 failed ("found at least two devices, sim:1 and sim:0")."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ditorch.sim import distributed
    from ditorch.sim.tensor import DeviceSelection

    distributed.register()
    monkeypatch.setattr(DeviceSelection, "count", 2)
    monkeypatch.setattr(DeviceSelection, "initialized", False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    dist.init_process_group("simccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        init_device_mesh("sim", (1,))
        assert torch.sim.current_device() == 1
    finally:
        dist.destroy_process_group()
        DeviceSelection.set_current(0)


@pytest.mark.usefixtures("sim")
def test_memory_statistics_follow_live_tensors():
    torch.sim.reset_peak_memory_stats()
    before = torch.sim.memory_allocated()
    x = torch.empty(1024, 1024, device="sim")  # 4 MiB
    view = x[:10]
    assert torch.sim.memory_allocated() - before == 4 * 1024 * 1024
    del x
    assert torch.sim.memory_allocated() - before == 4 * 1024 * 1024  # the view keeps the storage
    del view
    assert torch.sim.memory_allocated() == before
    assert torch.sim.max_memory_allocated() >= before + 4 * 1024 * 1024
    torch.sim.reset_peak_memory_stats()
    assert torch.sim.max_memory_allocated() == before


@pytest.mark.usefixtures("sim")
def test_an_allocation_past_the_device_memory_raises_cuda_out_of_memory():
    import ditorch.sim

    with ditorch.sim.total_memory(torch.sim.memory_allocated() + (1 << 20)):
        assert torch.sim.get_device_properties().total_memory == torch.sim.mem_get_info()[1]
        held = torch.empty(1 << 19, dtype=torch.uint8, device="sim")
        before = torch.sim.memory_allocated()
        with pytest.raises(torch.cuda.OutOfMemoryError, match=r"sim out of memory. Tried to allocate 1.00 MiB"):
            torch.ones(1 << 20, dtype=torch.uint8, device="sim")
        assert torch.sim.memory_allocated() == before  # refused: nothing counted
        del held
        torch.ones(1 << 20, dtype=torch.uint8, device="sim")  # fits once freed
    with pytest.raises(torch.OutOfMemoryError, match="sim out of memory"):  # past the host's memory, too
        torch.empty(4 * torch.sim.get_device_properties().total_memory, dtype=torch.uint8, device="sim")


def test_the_device_memory_comes_from_the_environment():
    code = ("import torch, ditorch.sim; ditorch.sim.register(); "
            "print(torch.sim.get_device_properties().total_memory)")
    assert _run(code, DITORCH_SIM_TOTAL_MEMORY="3MiB").stdout.split() == [str(3 << 20)]
    malformed = _run(code, DITORCH_SIM_TOTAL_MEMORY="3MB")
    assert "ValueError: DITORCH_SIM_TOTAL_MEMORY='3MB'" in malformed.stderr


@pytest.mark.parametrize("count", ["1", "2"])
def test_a_fresh_process_peaks_at_no_memory(count):
    code = ("import torch, ditorch.sim; ditorch.sim.register(); "
            "print(torch.sim.max_memory_allocated(), torch.sim.memory_stats()['reserved_bytes.all.peak'])")
    result = _run(code, DITORCH_SIM_DEVICE_COUNT=count)
    assert result.stdout.split() == ["0", "0"], result.stderr


@pytest.mark.usefixtures("sim")
def test_data_parallel_says_it_is_not_supported_and_what_to_use():
    model = torch.nn.Linear(2, 2).to("sim")
    if hasattr(torch._C, "_scatter"):  # a CUDA build's torch: its C scatter and gather exist, and one device runs
        assert torch.nn.DataParallel(model, device_ids=[0])(torch.ones(3, 2, device="sim")).shape == (3, 2)
        return
    with pytest.raises(NotImplementedError, match="DataParallel is not supported.*DistributedDataParallel"):
        torch.nn.DataParallel(model, device_ids=[0])


@pytest.mark.usefixtures("sim")
def test_events_measure_elapsed_time_in_milliseconds():
    start, end = torch.sim.Event(enable_timing=True), torch.sim.Event(enable_timing=True)
    start.record()
    time.sleep(0.02)
    end.record()
    end.synchronize()
    assert 15 <= start.elapsed_time(end) < 1000
    stream = torch.sim.Stream()
    with torch.sim.stream(stream):
        assert torch.sim.current_stream() is stream
    assert torch.sim.current_stream() is torch.sim.default_stream()


@pytest.mark.usefixtures("sim")
def test_seeds_drive_the_same_numbers_as_cpu():
    torch.manual_seed(7)
    on_sim = torch.randn(4, device="sim").cpu()
    torch.manual_seed(7)
    assert torch.equal(on_sim, torch.randn(4))
    torch.sim.manual_seed(3)
    assert torch.sim.initial_seed() == 3


def _run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=child_env(env), timeout=120)


def test_device_count_comes_from_the_environment():
    code = ("import torch, ditorch.sim; ditorch.sim.register(); "
            "x = torch.ones(2, device='sim:1'); print(torch.sim.device_count(), x.device, (x + x).device)")
    result = _run(code, DITORCH_SIM_DEVICE_COUNT="2")
    assert result.stdout.split() == ["2", "sim:1", "sim:1"], result.stderr
    mixed = _run("import torch, ditorch.sim; ditorch.sim.register(); "
                 "torch.ones(2, device='sim:0') + torch.ones(2, device='sim:1')", DITORCH_SIM_DEVICE_COUNT="2")
    assert "found at least two devices, sim:0 and sim:1" in mixed.stderr


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_malformed_device_count_names_the_variable(value):
    result = _run("import ditorch.sim; ditorch.sim.register()", DITORCH_SIM_DEVICE_COUNT=value)
    assert result.returncode != 0
    assert f"ValueError: DITORCH_SIM_DEVICE_COUNT={value!r}" in result.stderr
    assert "positive integer" in result.stderr


def test_one_device_per_local_rank_under_torchrun_unless_the_count_is_set():
    code = "import torch, ditorch.sim; ditorch.sim.register(); print(torch.sim.device_count())"
    assert _run(code, LOCAL_WORLD_SIZE="4").stdout.split() == ["4"]
    assert _run(code, LOCAL_WORLD_SIZE="4", DITORCH_SIM_DEVICE_COUNT="2").stdout.split() == ["2"]
    bad = _run(code, LOCAL_WORLD_SIZE="x")
    assert "LOCAL_WORLD_SIZE='x': expected a positive integer" in bad.stderr


DATA_ON_THE_CURRENT_DEVICE = """
import numpy as np, torch, ditorch
from ditorch.show_as_cuda import real_device
torch.cuda.set_device(1)
made = {}
for device in ("cuda", "sim"):  # the script's CUDA name, and sim's own
    made.update({
        f"tensor {device}": torch.tensor([1.0, 2.0], device=device),
        f"as_tensor {device}": torch.as_tensor(np.ones(2), device=device),
        f"asarray {device}": torch.asarray([1.0], device=device),
        f"new_tensor {device}": torch.ones(1).new_tensor([1.0], device=device),
        f"sparse_coo_tensor {device}": torch.sparse_coo_tensor([[0]], [1.0], (2,), device=device),
    })
compiled = torch.compile(lambda x: x + torch.tensor([1.0, 2.0], device="cuda"), backend="eager")
made["compiled"] = compiled(torch.zeros(2, device="cuda"))
made["sum"] = made["tensor cuda"] + torch.zeros(2, device="cuda")  # once: sim:0 and sim:1, refused
with torch.device("meta"):  # the factories stay the ones `with torch.device` knows by identity
    meta = torch.tensor([1.0]).device
print(sorted({str(real_device(t)) for t in made.values()}), len(made), meta)
"""


def test_tensors_made_from_data_land_on_the_current_device():
    # torch.tensor(data, device="cuda") copies its host tensor to the device in C++, which fills the index from a
    # Python backend's guard (always 0): it landed on sim:0 after set_device(1), and mixing it with the program's
    # other tensors raised; under torchrun, rank 1's metric went to the wrong device.
    result = _run(DATA_ON_THE_CURRENT_DEVICE, DITORCH_BACKEND="sim", DITORCH_QUIET="1", DITORCH_SIM_DEVICE_COUNT="2")
    assert result.stdout.split() == ["['sim:1']", "12", "meta"], result.stderr[-3000:]


BACKWARD_ON_DEVICE_1 = """
import threading, torch, ditorch.sim
ditorch.sim.register()
torch.sim.set_device(1)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 1)).to("sim")
reference = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
reference.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
x = torch.randn(3, 4)
model(x.to("sim")).sum().backward()
reference(x).sum().backward()
same = all(torch.equal(p.grad.cpu(), q.grad) and p.grad.device == torch.device("sim", 1)
           for p, q in zip(model.parameters(), reference.parameters()))
a = torch.ones(3, device="sim:0", requires_grad=True)
grads = []
def other_thread():  # backward from a thread that never registered sim, across two sim devices
    grads.append(torch.autograd.grad(((a * 2).to("sim:1") * 3).sum(), a)[0])
thread = threading.Thread(target=other_thread); thread.start(); thread.join()
print(same, grads[0].device, grads[0].cpu().tolist())
"""


def test_backward_runs_on_a_sim_device_past_index_0():
    # PyTorch's engine has one device queue for a Python backend; sim runs such backwards on the calling thread.
    result = _run(BACKWARD_ON_DEVICE_1, DITORCH_SIM_DEVICE_COUNT="2")
    assert result.stdout.split() == ["True", "sim:0", "[6.0,", "6.0,", "6.0]"], result.stderr[-2000:]


def test_backward_on_sim_works_after_a_host_backward_ran_before_registration():
    # The engine sizes its device queues at the first backward of the process; a CPU reference run may come first.
    code = ("import torch\n"
            "x = torch.ones(2, requires_grad=True); (x * 2).sum().backward()\n"
            "import ditorch.sim; ditorch.sim.register()\n"
            "p = torch.ones(3, device='sim', requires_grad=True); (p * 3).sum().backward()\n"
            "print(p.grad.cpu().tolist())")
    result = _run(code, DITORCH_SIM_FAULTS="mul:unsupported")  # the check sim makes at registration sees no fault
    assert 'File "<string>", line 4' in result.stderr and "SimUnsupportedError" in result.stderr, result.stderr
    result = _run(code)
    assert result.stdout.split() == ["[3.0,", "3.0,", "3.0]"], result.stderr[-2000:]
