"""The generic CUDA-to-device transfer, row by row, on the sim device (in this process)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import warnings

import pytest
import torch
from hardware import cuda_gpu_present
from subprocess_env import child_env

REAL_DEVICE = torch._C.TensorBase.device.__get__
CUDA_SPELLINGS = ["cuda", "cuda:0", torch.device("cuda"), torch.device("cuda", 0), 0]


def _activate(show_as_cuda: bool):
    import ditorch
    from ditorch import activation, backends
    from ditorch.env import DeviceLayerConfig

    ditorch.deactivate()  # whatever `import ditorch` put in place for this process (nothing, on a host)
    backend = backends.detect("sim")
    config = DeviceLayerConfig(backend="sim", quiet=True, disable_mock=False, show_device_as_cuda=show_as_cuda)
    activation.activate(backend, config, forced=True)
    return backend


@pytest.fixture
def transfer(sim):
    """The sim transfer in place, tensors showing their real device; undone afterwards."""
    from ditorch import activation

    yield _activate(show_as_cuda=False)
    activation.deactivate()


@pytest.fixture
def shown_as_cuda(sim):
    from ditorch import activation

    yield _activate(show_as_cuda=True)
    activation.deactivate()


def on_sim(tensor) -> bool:
    return REAL_DEVICE(tensor).type == "sim"


# -- device arguments ---------------------------------------------------------------------------

@pytest.mark.parametrize("device", CUDA_SPELLINGS, ids=str)
@pytest.mark.parametrize("factory", [
    lambda d: torch.ones(2, device=d), lambda d: torch.zeros(2, 3, device=d), lambda d: torch.empty(2, device=d),
    lambda d: torch.full((2,), 1.5, device=d), lambda d: torch.randn(2, device=d),
    lambda d: torch.randint(0, 5, (3,), device=d), lambda d: torch.arange(4, device=d),
    lambda d: torch.tensor([1.0, 2.0], device=d), lambda d: torch.eye(2, device=d),
    lambda d: torch.linspace(0, 1, 3, device=d), lambda d: torch.zeros_like(torch.ones(2), device=d),
], ids=["ones", "zeros", "empty", "full", "randn", "randint", "arange", "tensor", "eye", "linspace", "zeros_like"])
def test_factories_put_cuda_tensors_on_the_device(transfer, factory, device):
    assert on_sim(factory(device))


@pytest.mark.parametrize("device", CUDA_SPELLINGS[:4], ids=str)
def test_tensor_to_and_new_factories_accept_cuda(transfer, device):
    x = torch.arange(3.0)
    assert on_sim(x.to(device)) and on_sim(x.to(device=device)) and on_sim(x.to(device, torch.float16))
    assert x.to(device, torch.float16).dtype == torch.float16
    for made in (x.new_zeros(2, device=device), x.new_ones(2, device=device), x.new_empty(2, device=device),
                 x.new_full((2,), 3.0, device=device), x.new_tensor([1.0], device=device)):
        assert on_sim(made)
    assert torch.equal(x.to(device).cpu(), x)


def test_module_to_to_empty_and_device_keyword(transfer):
    model = torch.nn.Linear(3, 2).to("cuda")
    assert all(on_sim(p) for p in model.parameters())
    empty = torch.nn.Linear(3, 2, device="meta").to_empty(device="cuda")
    assert all(on_sim(p) for p in empty.parameters())
    assert on_sim(torch.nn.Linear(3, 2, device="cuda").weight)
    assert on_sim(torch.nn.Linear(3, 2, device=torch.device("cuda:0")).weight)


@pytest.mark.parametrize("location", ["cuda", "cuda:0", torch.device("cuda"), {"cpu": "cuda:0"}], ids=str)
def test_torch_load_maps_cuda_locations(transfer, location):
    buffer = io.BytesIO()
    torch.save({"w": torch.arange(4.0)}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, map_location=location)
    assert on_sim(loaded["w"]) and torch.equal(loaded["w"].cpu(), torch.arange(4.0))


def save_as_on_cuda(obj, path) -> None:
    """Stand-in for a checkpoint from a CUDA machine: a save-time tagger that labels storages "cuda:0"."""
    registry = torch.serialization._package_registry
    entry = (0, lambda storage: "cuda:0", lambda storage, location: None)
    registry.insert(0, entry)
    try:
        torch.save(obj, path)
    finally:
        registry.remove(entry)


def test_checkpoint_saved_on_cuda_loads_on_the_device_without_map_location(transfer, tmp_path):
    save_as_on_cuda({"w": torch.arange(3.0)}, tmp_path / "cuda.pt")
    loaded = torch.load(tmp_path / "cuda.pt")
    assert on_sim(loaded["w"]) and torch.equal(loaded["w"].cpu(), torch.arange(3.0))


@pytest.fixture
def two_devices(sim):
    from ditorch.sim.tensor import DeviceSelection, set_device_count

    count = DeviceSelection.count
    set_device_count(2)
    yield
    DeviceSelection.set_current(0)
    set_device_count(count)


@pytest.mark.parametrize("saved_on", ["the device", "a CUDA machine"])
def test_torch_load_dict_map_location_moves_what_cuda_0_saved_to_cuda_1(two_devices, shown_as_cuda, saved_on,
                                                                         tmp_path):
    # The DDP tutorial's map_location={"cuda:0": f"cuda:{rank}"}. The device tags its storages "sim:0" (a vendor's
    # "npu:0"), the device the saving script saw as cuda:0; a CUDA machine tags them "cuda:0".
    if saved_on == "the device":
        torch.save({"w": torch.arange(3.0, device="cuda:0")}, tmp_path / "rank0.pt")
    else:
        save_as_on_cuda({"w": torch.arange(3.0)}, tmp_path / "rank0.pt")
    loaded = torch.load(tmp_path / "rank0.pt", map_location={"cuda:0": "cuda:1"}, weights_only=True)["w"]
    assert REAL_DEVICE(loaded) == torch.device("sim", 1) and torch.equal(loaded.cpu(), torch.arange(3.0))


@pytest.mark.parametrize("map_location", [None, "cuda", {"cuda:0": "cuda:0"}], ids=str)
def test_checkpoint_saved_on_cuda_keeps_views_and_tied_weights_on_one_device_storage(transfer, map_location,
                                                                                     tmp_path):
    base = torch.arange(10.0)
    embedding, head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False)
    head.weight = embedding.weight
    state = torch.nn.ModuleDict({"embedding": embedding, "head": head}).state_dict()
    save_as_on_cuda({"base": base, "view": base[2:5], "model": state}, tmp_path / "cuda.pt")
    loaded = torch.load(tmp_path / "cuda.pt", map_location=map_location, weights_only=True)
    tied = loaded["model"]["embedding.weight"], loaded["model"]["head.weight"]
    assert all(on_sim(t) for t in (loaded["base"], loaded["view"], *tied))
    assert tied[0].untyped_storage().data_ptr() == tied[1].untyped_storage().data_ptr()
    loaded["base"][3] = -1.0
    assert loaded["view"].cpu().tolist() == [2.0, -1.0, 4.0]


@pytest.mark.parametrize("saved_on", ["cpu", "cuda"])
@pytest.mark.parametrize("weights_only", [True, False])
def test_torch_load_calls_a_callable_map_location_as_cuda_does(shown_as_cuda, saved_on, weights_only):
    buffer = io.BytesIO()
    torch.save({"w": torch.arange(4.0, device=saved_on)}, buffer)
    for map_location, lands_on_sim in [(lambda s, loc: s, False), (lambda s, loc: s.cuda(), True),
                                       (lambda s, loc: s.cuda(0), True)]:
        buffer.seek(0)
        loaded = torch.load(buffer, map_location=map_location, weights_only=weights_only)["w"]
        assert on_sim(loaded) is lands_on_sim and torch.equal(loaded.cpu(), torch.arange(4.0))


def test_a_storage_moved_to_the_device_outside_torch_load_says_why_it_cannot(transfer):
    with pytest.raises(RuntimeError, match="a storage cannot be moved to sim:0.*move a tensor instead"):
        torch.ones(2).untyped_storage().cuda()


@pytest.mark.skipif(not hasattr(torch, "Event"), reason="torch.Stream and torch.Event came with PyTorch 2.5")
def test_device_generic_streams_and_events_take_a_cuda_device(shown_as_cuda):
    shown = torch.zeros(1, device="cuda").device
    for device in ["cuda", "cuda:0", torch.device("cuda"), shown]:
        stream, event = torch.Stream(device=device), torch.Event(device, enable_timing=True)
        assert stream.device.type == event.device.type == "sim" and isinstance(stream, torch.Stream)
        with stream:
            event.record()
        assert event.query()
    assert isinstance(torch.accelerator.current_stream(), torch.Stream)  # one C++ made, not the stand-in
    # Instances of the class itself: C++ takes no other type as an argument. A stand-in's event given to
    # elapsed_time was refused ("expected other to be a torch.Event object") on every backend, a vendor's whose
    # guard times events included; here it reaches the device's own answer (a Python backend's guard cannot time).
    original = torch.Event.__mro__[1]
    first, second = torch.Event("cuda", enable_timing=True), torch.Event("cuda", enable_timing=True)
    assert type(first) is original and type(torch.Stream("cuda")) is torch.Stream.__mro__[1]
    first.record()
    second.record()
    with pytest.raises(RuntimeError, match="Backend doesn't support elapsedTime"):
        first.elapsed_time(second)

    class Timed(torch.Event):  # a subclass of the stand-in makes its own instances, as torch's own do
        pass

    assert type(Timed("cuda")) is Timed and Timed("cuda").device.type == "sim"


def test_legacy_tensor_types_read_and_convert_as_on_cuda(shown_as_cuda):
    # x.device showed cuda:0 while x.type() said torch.sim.FloatTensor (an apex-era `x.type() ==
    # "torch.cuda.HalfTensor"` took the other branch), and x.type(torch.cuda.HalfTensor) raised "Cannot initialize
    # CUDA without ATen_cuda library".
    x = torch.randn(3, device="cuda")
    assert (x.type(), x.half().type(), torch.ones(1).type()) == ("torch.cuda.FloatTensor", "torch.cuda.HalfTensor",
                                                                 "torch.FloatTensor")
    for dtype in (torch.cuda.HalfTensor, "torch.cuda.HalfTensor", torch.float16):
        half = x.type(dtype)
        assert half.dtype == torch.float16 and half.device.type == "cuda" and torch.equal(half.cpu(), x.cpu().half())
    assert x.type(torch.FloatTensor).device.type == "cpu"
    linear = torch.nn.Linear(2, 2).cuda().type(torch.cuda.DoubleTensor)  # Module.type passes it to each tensor
    assert linear.weight.dtype == torch.float64 and linear.weight.device.type == "cuda"


def test_legacy_tensor_types_name_the_real_device_where_tensors_show_it(transfer):
    x = torch.randn(3, device="cuda")
    assert x.type() == "torch.sim.FloatTensor" and x.type(torch.cuda.HalfTensor).type() == "torch.sim.HalfTensor"


def test_generator_on_cuda_draws_what_the_host_generator_draws(transfer):
    generator = torch.Generator(device="cuda")
    assert isinstance(generator, torch.Generator)
    generator.manual_seed(7)
    drawn = torch.randn(4, generator=generator, device="cuda")
    assert on_sim(drawn)
    assert torch.equal(drawn.cpu(), torch.randn(4, generator=torch.Generator().manual_seed(7)))


def test_default_device_and_device_context(transfer):
    with torch.device("cuda"):
        assert on_sim(torch.zeros(2)) and on_sim(torch.nn.Linear(2, 2).weight)
    assert not on_sim(torch.zeros(2))
    torch.set_default_device("cuda:0")
    try:
        assert on_sim(torch.ones(2))
    finally:
        torch.set_default_device(None)
    assert not on_sim(torch.ones(2))


# -- .cuda() and is_cuda -----------------------------------------------------------------------

def test_tensor_cuda_module_cuda_and_is_cuda(transfer):
    x = torch.ones(2)
    for moved in (x.cuda(), x.cuda(0), x.cuda("cuda:0"), x.cuda(device=torch.device("cuda"))):
        assert on_sim(moved) and moved.is_cuda
    assert not x.is_cuda
    already = x.cuda()
    assert already.cuda() is already
    model = torch.nn.Sequential(torch.nn.Linear(2, 2)).cuda()
    assert all(p.is_cuda and on_sim(p) for p in model.parameters())


# -- torch.cuda answered by torch.sim -------------------------------------------------------------

def test_torch_cuda_queries_answer_for_the_device(transfer):
    assert torch.cuda.is_available() and torch.cuda.is_initialized()
    assert torch.cuda.device_count() == torch.sim.device_count()
    assert torch.cuda.current_device() == 0
    torch.cuda.set_device(0)
    torch.cuda.set_device("cuda:0")
    torch.cuda.synchronize()
    torch.cuda.synchronize("cuda")
    assert torch.cuda.get_device_name() == "sim" == torch.cuda.get_device_name("cuda:0")
    assert torch.cuda.get_device_capability(0) == torch.sim.get_device_capability()
    assert torch.cuda.get_device_properties("cuda").total_memory > 0
    assert torch.cuda.is_bf16_supported()
    with torch.cuda.device(0):
        assert torch.cuda.current_device() == 0


ACCELERATOR_INDEX = """
import json, torch, ditorch
from ditorch.show_as_cuda import real_device
seen = []
def note():
    seen.append([torch.accelerator.current_device_index(), torch.cuda.current_device()])
note()
torch.accelerator.set_device_index(1); note()
on_index = str(real_device(torch.ones(1, device="cuda")))
torch.cuda.set_device(0); note()
with torch.accelerator.device_index(1):
    note()
    with torch.cuda.device(0):
        note()
    note()
note()
torch.accelerator.set_device_index("cuda:1"); note()
torch.accelerator.set_device_index(-1); note()
acc = torch.accelerator.current_accelerator(check_available=True)
agrees = (torch.get_device_module(acc) is torch.get_device_module("cuda") and acc.index is None
          and torch.accelerator.device_count() == torch.cuda.device_count() == 2
          and real_device(torch.ones(1, device=acc)) == real_device(torch.ones(1).cuda()) == torch.device("sim", 1))
print(json.dumps({"seen": seen, "on_index": on_index, "agrees": agrees}))
"""


@pytest.mark.parametrize("show_as_cuda", ["1", "0"])
def test_accelerator_device_index_is_the_one_torch_cuda_selects(show_as_cuda):
    # A Python backend's device guard in C++ keeps index 0 whatever is set: torch.accelerator reads sim's own.
    done = subprocess.run([sys.executable, "-c", ACCELERATOR_INDEX], capture_output=True, text=True, timeout=120,
                          env=child_env({"DITORCH_BACKEND": "sim", "DITORCH_SIM_DEVICE_COUNT": "2",
                                         "DITORCH_SHOW_DEVICE_AS_CUDA": show_as_cuda, "DITORCH_QUIET": "1"}))
    assert done.returncode == 0, done.stderr[-2000:]
    # (torch.accelerator's index, torch.cuda's) after each step; set_device_index(-1) is documented as a no-op
    assert json.loads(done.stdout) == {"seen": [[0, 0], [1, 1], [0, 0], [1, 1], [0, 0], [1, 1], [0, 0], [1, 1],
                                                [1, 1]], "on_index": "sim:1", "agrees": True}


def test_torch_cuda_seeds_drive_the_device_random_numbers(transfer):
    torch.cuda.manual_seed(3)
    first = torch.rand(3, device="cuda").cpu()
    torch.cuda.manual_seed_all(3)
    assert torch.equal(torch.rand(3, device="cuda").cpu(), first)
    state = torch.cuda.get_rng_state()
    again = torch.rand(3, device="cuda").cpu()
    torch.cuda.set_rng_state(state)
    assert torch.equal(torch.rand(3, device="cuda").cpu(), again)
    assert torch.cuda.initial_seed() == 3


def test_torch_cuda_set_rng_state_takes_cudas_philox_layout(transfer):
    from ditorch import host_rng

    def philox(seed, offset):
        return torch.tensor([seed, offset], dtype=torch.int64).view(torch.uint8)

    torch.cuda.set_rng_state(philox(7, 64))  # a CUDA generator's state (seed, offset), as a CUDA checkpoint holds
    first = torch.rand(8, device="cuda").cpu()
    torch.cuda.set_rng_state(philox(7, 64))
    assert torch.equal(torch.rand(8, device="cuda").cpu(), first)
    torch.cuda.set_rng_state(philox(7, 68))
    assert not torch.equal(torch.rand(8, device="cuda").cpu(), first)
    torch.cuda.set_rng_state(philox(7, 64))
    assert torch.equal(host_rng.philox_state(), philox(7, 64))  # read back as set, until the stream is drawn from
    torch.rand(1, device="cuda")
    assert torch.equal(host_rng.philox_state(), philox(7, 68))
    torch.cuda.manual_seed(3)
    assert torch.equal(host_rng.philox_state(), philox(3, 0))
    assert torch.cuda.get_rng_state().numel() == torch.get_rng_state().numel()  # still the CPU generator's


def test_torch_cuda_memory_statistics_count_device_tensors(transfer):
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    block = torch.empty(1024, device="cuda")
    assert torch.cuda.memory_allocated() - before == block.numel() * 4
    assert torch.cuda.max_memory_allocated() >= torch.cuda.memory_allocated()
    assert torch.cuda.memory_stats()["allocated_bytes.all.current"] == torch.cuda.memory_allocated()
    torch.cuda.empty_cache()
    del block
    assert torch.cuda.memory_allocated() == before


def test_torch_cuda_streams_and_events(transfer):
    stream = torch.cuda.Stream()
    assert isinstance(stream, torch.cuda.Stream) and isinstance(torch.cuda.current_stream(), torch.cuda.Stream)
    with torch.cuda.stream(stream):
        assert torch.cuda.current_stream() is stream
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.ones(8, device="cuda").sum()
    end.record()
    end.synchronize()
    assert start.elapsed_time(end) >= 0


def test_torch_cuda_submodules_answer_with_the_device_module(transfer):
    block = torch.empty(256, device="cuda")
    assert torch.cuda.memory.memory_allocated() == torch.sim.memory_allocated() >= block.numel() * 4
    torch.cuda.random.manual_seed(5)
    assert torch.cuda.random.initial_seed() == 5
    assert isinstance(torch.cuda.streams.Stream(), torch.sim.Stream)


@pytest.mark.parametrize("call, api", [
    (lambda: torch.cuda.jiterator._create_jit_fn("template <typename T> T f(T x) { return x; }"),
     "torch.cuda.jiterator._create_jit_fn"),
    (lambda: torch.cuda.CUDAGraph(), "torch.cuda.CUDAGraph"),
    (lambda: torch.cuda.caching_allocator_alloc(64), "torch.cuda.caching_allocator_alloc"),
    (lambda: torch.cuda.current_blas_handle(), "torch.cuda.current_blas_handle"),
    (lambda: torch.cuda.memory._record_memory_history(), "torch.cuda.memory._record_memory_history"),
], ids=["jiterator", "CUDAGraph", "caching_allocator", "blas_handle", "memory_history"])
def test_cuda_api_the_device_lacks_raises_naming_it_and_the_backend(transfer, call, api):
    with pytest.raises(NotImplementedError, match=rf"{api.replace('.', '[.]')} is not available on the sim backend"):
        call()


# -- autocast, GradScaler ------------------------------------------------------------------------

def test_autocast_cuda_runs_device_autocast(transfer):
    a, b = torch.randn(4, 4, device="cuda"), torch.randn(4, 4, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert (a @ b).dtype == torch.bfloat16
        assert torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.bfloat16
    with torch.autocast(device_type="cuda"):
        assert (a @ b).dtype == torch.float16
    with pytest.warns(FutureWarning), torch.cuda.amp.autocast(dtype=torch.bfloat16):
        assert (a @ b).dtype == torch.bfloat16


def test_autocast_state_without_a_device_is_the_devices_as_cudas_is_on_cuda(transfer):
    a = torch.randn(4, 4, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # get/set_autocast_gpu_dtype: deprecated, still called
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert torch.is_autocast_enabled() and torch.get_autocast_gpu_dtype() == torch.bfloat16
        assert not torch.is_autocast_enabled()
        torch.set_autocast_gpu_dtype(torch.bfloat16)
        torch.set_autocast_enabled(True)
        try:
            assert (a @ a).dtype == torch.bfloat16 and torch.get_autocast_dtype("cuda") == torch.bfloat16
        finally:
            torch.set_autocast_enabled(False)
            torch.set_autocast_gpu_dtype(torch.float16)
    assert (a @ a).dtype == torch.float32


def test_multihead_attention_under_autocast_leaves_its_fast_path_as_on_cuda(transfer):
    # Its eval fast path is skipped where torch.is_autocast_enabled(): the projections then run in bfloat16
    attention = torch.nn.MultiheadAttention(16, 2, batch_first=True).cuda().eval()
    x = torch.randn(2, 5, 16, device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        assert attention(x, x, x)[0].dtype == torch.bfloat16


@pytest.mark.parametrize("make", [
    lambda: torch.amp.GradScaler("cuda"), lambda: torch.amp.GradScaler(), lambda: torch.cuda.amp.GradScaler(),
], ids=["amp-cuda", "amp-default", "cuda-amp"])
def test_grad_scaler_for_cuda_scales_on_the_device(transfer, make):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.cuda.amp.GradScaler is deprecated, still used
        scaler = make()
    model = torch.nn.Linear(4, 1).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(torch.ones(2, 4, device="cuda")).sum()
    scaler.scale(loss).backward()
    before = model.weight.detach().cpu().clone()
    scaler.step(optimizer)
    scaler.update()
    assert on_sim(scaler._scale) and not torch.equal(model.weight.detach().cpu(), before)


# -- distributed, profiler -------------------------------------------------------------------------

def test_init_process_group_nccl_uses_the_sim_collective_library(transfer, tmp_path):
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert dist.get_backend() == "simccl"
        x = torch.full((3,), 2.0, device="cuda")
        dist.all_reduce(x)
        assert on_sim(x) and torch.equal(x.cpu(), torch.full((3,), 2.0))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_profiler_with_cuda_activity_does_not_crash(transfer):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        (torch.ones(4, device="cuda") * 2).sum()
    assert any("mul" in event.key for event in prof.key_averages())


# -- show as cuda ------------------------------------------------------------------------------------

def test_show_device_as_cuda_reports_cuda_without_a_torch_function_mode(shown_as_cuda):
    x = torch.ones(2, device="cuda")
    assert x.device == torch.device("cuda", 0) and x.device.type == "cuda"
    assert "device='cuda:0'" in repr(x) and x.is_cuda and on_sim(x)
    assert torch.ones(2).device.type == "cpu"
    assert on_sim(torch.zeros(2, device=x.device))  # the shown device leads back to the real one
    assert torch._C._len_torch_function_stack() == 0
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        assert (torch.randn(2, 2, device="cuda") @ torch.randn(2, 2, device="cuda")).dtype == torch.bfloat16


def test_show_device_as_cuda_trains_a_model(shown_as_cuda):
    from tiny_models import mlp

    torch.manual_seed(0)
    model = mlp().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(8, 16, device="cuda"), torch.randint(0, 4, (8,), device="cuda")
    for _ in range(2):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    assert torch.isfinite(loss).item() and all(on_sim(p) for p in model.parameters())


def test_fsdp_devices_from_the_accelerator_are_cuda_while_tensors_show_as_cuda(sim):
    from torch.distributed.fsdp import _init_utils
    from torch.distributed.fsdp._fully_shard import _fsdp_init, _fully_shard

    from ditorch import activation

    _activate(show_as_cuda=True)
    try:
        from torch.distributed.fsdp._init_utils import _get_device_from_device_id  # bound by name while active

        handle = _init_utils._FSDPDeviceHandle.from_device(torch.device("cuda"))
        assert _get_device_from_device_id(0, 0, handle) == torch.device("cuda", 0)
        assert _get_device_from_device_id(torch.device("sim", 0), 0, handle) == torch.device("cuda", 0)
        mesh = type("Mesh", (), {"device_type": "sim"})()
        assert _fully_shard._get_device_from_mesh(mesh) == _fsdp_init._get_device_from_mesh(mesh) == torch.device(
            "cuda", 0)
        mesh.device_type = "cuda"  # a "cuda" mesh already works: left as it is
        assert _fully_shard._get_device_from_mesh(mesh) == torch.device("cuda", 0)
    finally:
        activation.deactivate()
    assert _get_device_from_device_id(0, 0, handle) == torch.device("sim", 0)  # kept by name, it maps nothing more


# -- deactivate ---------------------------------------------------------------------------------------

def _snapshot():
    from ditorch import cuda_api, transfer

    owners = {}
    for row in transfer.ROWS:
        owner = transfer._resolve(row.owner)
        for name in row.names:
            owners[(row.owner, name)] = vars(owner).get(name, "<absent>")
    for name in cuda_api.mapped_names():
        owners[("torch.cuda", name)] = vars(torch.cuda).get(name, "<absent>")
    owners[("torch.Tensor", "device")] = vars(torch.Tensor).get("device", "<absent>")
    return owners


def test_deactivate_restores_every_patched_attribute(sim):
    import ditorch
    from ditorch import activation

    ditorch.deactivate()
    before = _snapshot()
    _activate(show_as_cuda=True)
    assert torch.cuda.is_available() and activation.patch_count() > 50
    assert ditorch.deactivate()
    after = _snapshot()
    assert [key for key in before if before[key] is not after[key]] == []
    assert torch.cuda.is_available() is cuda_gpu_present() and not ditorch.deactivate()  # CUDA's own answer
    if not cuda_gpu_present():
        with pytest.raises((RuntimeError, AssertionError)):  # "cuda" is CUDA again: none here
            torch.ones(2, device="cuda")
    assert torch.ones(2).device.type == "cpu"


def test_activating_twice_patches_once(sim):
    from ditorch import activation

    _activate(show_as_cuda=False)
    try:
        count = activation.patch_count()
        assert _activate_again() is False and activation.patch_count() == count
        assert on_sim(torch.ones(1, device="cuda").to("cuda"))
    finally:
        activation.deactivate()


def _activate_again() -> bool:
    from ditorch import activation, backends
    from ditorch.env import DeviceLayerConfig

    config = DeviceLayerConfig(backend="sim", quiet=True, disable_mock=False, show_device_as_cuda=False)
    return activation.activate(backends.detect("sim"), config, forced=True)
