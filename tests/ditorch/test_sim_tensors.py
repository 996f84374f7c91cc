"""The sim device behaves as a device: factories, moves, views, in-place ops, out=, errors."""

import io

import pytest
import torch

from ditorch.show_as_cuda import real_device


def test_factories_create_sim_tensors(sim):
    for tensor in (
        torch.randn(2, 3, device=sim), torch.zeros(4, device="sim:0"), torch.tensor([1.0, 2.0], device=sim),
        torch.arange(5, device=sim), torch.full((2,), 7, device=sim), torch.empty(3, device=sim),
    ):
        assert tensor.device == torch.device("sim", 0)
    base = torch.ones(2, 2, device=sim)
    for derived in (torch.zeros_like(base), torch.rand_like(base), base.new_ones(3), base.new_empty(1),
                    base.new_tensor([1, 2])):
        assert derived.device.type == "sim"
    assert torch.tensor([[1, 2]], device=sim).cpu().tolist() == [[1, 2]]


def test_values_move_between_cpu_and_sim_unchanged():
    cpu = torch.randn(5, 7)
    on_sim = cpu.to("sim")
    assert on_sim.is_sim and not on_sim.is_cpu
    assert torch.equal(on_sim.cpu(), cpu)
    assert torch.equal(on_sim.to("cpu", torch.float64), cpu.double())
    target = torch.empty(5, 7)
    target.copy_(on_sim)
    assert torch.equal(target, cpu)
    back = torch.empty(5, 7, device="sim").copy_(cpu)
    assert torch.equal(back.cpu(), cpu)


@pytest.mark.usefixtures("sim")
def test_repr_names_the_device_as_a_device_tensor():
    text = repr(torch.tensor([[1.5, 2.0], [3.0, 4.0]], device="sim"))
    assert text.startswith("tensor([[1.5000, 2.0000],\n        [3.0000, 4.0000]]")
    assert text.endswith("device='sim:0')")
    assert "grad_fn=<MulBackward0>" in repr(torch.ones(2, device="sim", requires_grad=True) * 2)
    assert f"{torch.tensor(1.25, device='sim'):.1f}" == "1.2"
    # a parameter as a CPU's or CUDA's prints (it printed as tensor(SimTensor(...)))
    on_host = torch.nn.Parameter(torch.tensor([[1.5, 2.0], [3.0, 4.0]]))
    on_sim = torch.nn.Parameter(on_host.detach().to("sim"))
    assert repr(on_sim) == repr(on_host).replace("requires_grad", "device='sim:0', requires_grad")


@pytest.mark.usefixtures("sim")
def test_numpy_refuses_as_it_does_for_cuda():
    with pytest.raises(TypeError, match="can't convert sim:0 device type tensor to numpy"):
        torch.ones(2, device="sim").numpy()


@pytest.mark.usefixtures("sim")
def test_mixing_devices_raises_like_cuda():
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device.*sim:0 and cpu"):
        torch.ones(3, device="sim") + torch.ones(3)
    with pytest.raises(RuntimeError, match="same device"):
        torch.mm(torch.ones(2, 2, device="sim"), torch.ones(2, 2))
    # As on CUDA, a 0-dim CPU tensor is a scalar, and CPU indices are accepted.
    assert (torch.ones(3, device="sim") + torch.tensor(2.0)).cpu().tolist() == [3.0, 3.0, 3.0]
    assert torch.arange(5, device="sim")[torch.tensor([4, 0])].cpu().tolist() == [4, 0]


@pytest.mark.usefixtures("sim")
def test_a_packed_sequence_keeps_its_batch_sizes_on_the_cpu_as_on_cuda():
    # CUDA takes a sequence's lengths on the CPU (it requires them there) and keeps a PackedSequence's batch sizes on
    # the CPU, where an LSTM reads them; an LSTM over variable-length sequences is a common recipe.
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    torch.manual_seed(0)
    lstm = torch.nn.LSTM(4, 6, batch_first=True)
    x, lengths = torch.randn(3, 5, 4), torch.tensor([5, 3, 2])

    def run(device):
        leaf = x.clone().requires_grad_()
        packed = pack_padded_sequence(leaf.to(device), lengths, batch_first=True)
        padded, found = pad_packed_sequence(lstm.to(device)(packed)[0], batch_first=True)
        padded.square().sum().backward()
        return packed.batch_sizes.device, padded.detach().cpu(), leaf.grad, found

    on_cpu, on_sim = run("cpu"), run("sim")
    assert on_sim[0] == torch.device("cpu") and on_sim[3].tolist() == [5, 3, 2]
    assert torch.allclose(on_sim[1], on_cpu[1], atol=1e-6) and torch.allclose(on_sim[2], on_cpu[2], atol=1e-6)
    with pytest.raises(RuntimeError, match="same device"):  # a state on the CPU is still the user's mistake
        torch.nn.LSTM(4, 6).to("sim")(torch.randn(5, 3, 4, device="sim"), (torch.zeros(1, 3, 6), torch.zeros(1, 3, 6)))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("lengths_on", ["cpu", "sim"])
@pytest.mark.usefixtures("sim")
def test_ctc_loss_takes_its_lengths_on_the_cpu_or_the_device_as_on_cuda(reduction, lengths_on):
    # CUDA reads a plain tensor's lengths on the host; sim's tensors are a subclass, for which PyTorch's composite
    # divided the mean's losses on the device by the lengths where they were: on the CPU, "same device" refused it
    torch.manual_seed(0)
    log_probs, targets = torch.randn(20, 2, 5).log_softmax(2), torch.randint(1, 5, (2, 6))
    lengths = (torch.full((2,), 20), torch.tensor([6, 4]))

    def run(device, lengths_device):
        leaf = log_probs.clone().requires_grad_()
        loss = torch.nn.functional.ctc_loss(leaf.to(device), targets.to(device),
                                            *(t.to(lengths_device) for t in lengths), reduction=reduction)
        loss.sum().backward()
        return loss.detach().cpu(), leaf.grad

    (loss, grad), (expected, expected_grad) = run("sim", lengths_on), run("cpu", "cpu")
    assert torch.allclose(loss, expected, atol=1e-6) and torch.allclose(grad, expected_grad, atol=1e-6)
    with pytest.raises(RuntimeError, match="input_lengths must be integral"):  # PyTorch's checks, in its words
        torch.nn.functional.ctc_loss(log_probs.to("sim"), targets.to("sim"), lengths[0].float(), lengths[1])


@pytest.mark.usefixtures("sim")
def test_views_alias_their_base():
    base = torch.arange(12.0, device="sim").view(3, 4)
    transposed = base.t()
    assert transposed.shape == (4, 3) and transposed.stride() == (1, 4)
    assert base.transpose(0, 1).stride() == (1, 4)
    narrow = base.narrow(1, 1, 2)
    assert narrow.storage_offset() == 1 and narrow.stride() == (4, 1)
    narrow.add_(100)
    assert base.cpu()[:, 1:3].min() >= 100 and base.cpu()[:, 0].max() < 100
    strided = base.as_strided((2, 2), (4, 1), 1)
    assert strided.cpu().tolist() == base.cpu().as_strided((2, 2), (4, 1), 1).tolist()
    flat = base.t().contiguous().view(-1)
    assert flat.cpu().tolist() == base.cpu().t().contiguous().view(-1).tolist()
    assert transposed._base is base._base  # views chain to the root, as on CPU


@pytest.mark.usefixtures("sim")
def test_inplace_ops_return_the_same_tensor_and_track_versions():
    x = torch.zeros(3, device="sim")
    version = x._version
    assert x.add_(1) is x
    assert x._version > version
    assert x.cpu().tolist() == [1.0, 1.0, 1.0]


@pytest.mark.usefixtures("sim")
def test_inplace_metadata_changes_reach_the_device_tensor():
    x = torch.arange(6.0, device="sim").view(2, 3)
    x.t_()
    assert x.shape == (3, 2) and x.stride() == (1, 3)
    x.unsqueeze_(0)
    assert x.shape == (1, 3, 2)
    y = torch.zeros(2, device="sim")
    y.resize_(4, 5)
    assert y.shape == (4, 5) and y._data.shape == (4, 5)
    y.fill_(2)
    assert y.sum().item() == 40


@pytest.mark.usefixtures("sim")
def test_out_argument_writes_into_the_given_tensor():
    a, b = torch.ones(2, 3, device="sim"), torch.full((2, 3), 2.0, device="sim")
    out = torch.empty(2, 3, device="sim")
    assert torch.add(a, b, out=out) is out
    assert out.cpu().tolist() == [[3.0] * 3] * 2
    grown = torch.empty(0, device="sim")
    torch.mul(a, b, out=grown)
    assert grown.shape == (2, 3) and grown.cpu().sum().item() == 12
    values, indices = torch.empty(0, device="sim"), torch.empty(0, dtype=torch.long, device="sim")
    torch.max(torch.tensor([[1.0, 5.0], [7.0, 2.0]], device="sim"), 1, out=(values, indices))
    assert values.cpu().tolist() == [5.0, 7.0] and indices.cpu().tolist() == [1, 0]


@pytest.mark.usefixtures("sim")
def test_type_promotion_matches_cpu():
    i = torch.arange(3, device="sim")
    f = torch.ones(3, device="sim", dtype=torch.float16)
    assert (i + f).dtype == torch.float16
    assert (i / 2).dtype == torch.float32
    assert (f + torch.tensor(1.0, dtype=torch.float64)).dtype == torch.float16


@pytest.mark.usefixtures("sim")
def test_autograd_reaches_sim_leaves():
    w = torch.randn(3, 3, device="sim", requires_grad=True)
    x = torch.randn(2, 3, device="sim")
    (x @ w).relu().sum().backward()
    assert w.grad is not None and w.grad.device.type == "sim"
    expected_w = w.detach().cpu().requires_grad_()
    (x.cpu() @ expected_w).relu().sum().backward()
    assert torch.equal(w.grad.cpu(), expected_w.grad)


@pytest.mark.usefixtures("sim")
def test_data_assignment_replaces_values():
    p = torch.nn.Parameter(torch.zeros(2, device="sim"))
    p.data = torch.ones(3, device="sim")
    assert p.shape == (3,) and p.cpu().tolist() == [1.0, 1.0, 1.0]
    module = torch.nn.Linear(2, 2).to("sim").to(torch.bfloat16)
    assert module.weight.dtype == torch.bfloat16 and module.weight._data.dtype == torch.bfloat16


@pytest.mark.usefixtures("sim")
def test_save_and_load_keep_values_and_devices():
    state = {"w": torch.randn(3, 4, device="sim"), "step": 3}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    for map_location, device in ((None, "sim:0"), ("cpu", "cpu"), ("sim", "sim:0")):
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=True, map_location=map_location)
        assert str(loaded["w"].device) == device
        assert torch.equal(loaded["w"].cpu(), state["w"].cpu())
    cpu_buffer = io.BytesIO()
    torch.save({"w": torch.arange(4.0)}, cpu_buffer)
    for map_location in ("sim", torch.device("sim:0"), {"cpu": "sim:0"}):
        cpu_buffer.seek(0)
        loaded = torch.load(cpu_buffer, weights_only=True, map_location=map_location)
        assert loaded["w"].device.type == "sim"
        assert loaded["w"].cpu().tolist() == [0.0, 1.0, 2.0, 3.0]


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.mark.usefixtures("sim")
def test_load_gives_each_empty_tensor_a_storage_of_its_own():
    # every empty storage's address is 0: the load's shared copies gave all of them the first one's
    buffer = io.BytesIO()
    torch.save({"a": torch.empty(0), "b": torch.empty(0)}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, map_location="sim", weights_only=True)
    loaded["a"].resize_(3).fill_(1)
    loaded["b"].resize_(3).fill_(2)
    assert loaded["a"].cpu().tolist() == [1.0, 1.0, 1.0] and loaded["b"].cpu().tolist() == [2.0, 2.0, 2.0]


@pytest.mark.usefixtures("sim")
@pytest.mark.parametrize("saved_on", ["sim", "cpu"])
def test_load_onto_sim_shows_a_torch_function_mode_none_of_the_devices_own_work(saved_on):
    # The device's copies and views of the loaded storages are its own work, as a CUDA load's are C++: a tool's
    # mode saw them (OpAutoCompare compared the uint8 storage's views as dtype, and failed torch.Tensor.view).
    from torch.overrides import TorchFunctionMode

    class Seen(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: set = set()

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.names.add(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    weight = torch.randn(4, 4, device=saved_on)
    buffer = io.BytesIO()
    torch.save({"weight": weight, "row": weight[1]}, buffer)
    buffer.seek(0)
    with Seen() as seen:
        torch.load(buffer, map_location="sim", weights_only=True)
    assert not seen.names & {"to", "view", "as_strided", "detach", "__getitem__", "set_", "copy_"}, seen.names


@pytest.mark.usefixtures("sim")
@pytest.mark.parametrize("saved_on, map_location", [("sim", None), ("sim", "sim"), ("cpu", "sim")])
def test_load_keeps_a_view_on_its_base_storage(saved_on, map_location):
    # As torch.load on CUDA: one device storage per storage in the file (it held one, for the base and its view).
    base = torch.arange(1000.0, device=saved_on)
    buffer = io.BytesIO()
    torch.save({"base": base, "view": base[2:8:2]}, buffer)
    buffer.seek(0)
    before = torch.sim.memory_allocated()
    loaded = torch.load(buffer, weights_only=True, map_location=map_location)
    assert torch.sim.memory_allocated() - before == 4000  # the storage once, not the base and the view apart
    view = loaded["view"]
    assert real_device(view).type == "sim" and _shares_storage(view, loaded["base"])
    assert (view.storage_offset(), view.stride(), view.cpu().tolist()) == (2, (2,), [2.0, 4.0, 6.0])
    loaded["base"][4] = -1.0
    assert view.cpu().tolist() == [2.0, -1.0, 6.0]


@pytest.mark.usefixtures("sim")
@pytest.mark.parametrize("saved_on, map_location", [("sim", None), ("cpu", "sim")])
def test_load_keeps_tied_weights_of_a_state_dict_in_one_storage(saved_on, map_location):
    embedding, head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False)
    head.weight = embedding.weight  # a language model's tied input and output embeddings
    model = torch.nn.ModuleDict({"embedding": embedding, "head": head}).to(saved_on)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    before = torch.sim.memory_allocated()
    state = torch.load(buffer, weights_only=True, map_location=map_location)
    assert torch.sim.memory_allocated() - before == 10 * 4 * 4
    assert _shares_storage(state["embedding.weight"], state["head.weight"])
    assert torch.equal(state["head.weight"].cpu(), embedding.weight.detach().cpu())


def test_views_and_aliases_share_one_storage_as_on_a_device(sim):
    t = torch.randn(4, device=sim)
    assert t[1:].untyped_storage() is t.untyped_storage()
    assert t.data.untyped_storage() is t.untyped_storage() is t.detach().untyped_storage()
    assert torch.randn(4, device=sim).untyped_storage() is not t.untyped_storage()


def test_deepcopy_of_a_module_on_sim_copies_its_parameters(sim):
    import copy

    model = torch.nn.Linear(3, 2).to(sim)
    twin = copy.deepcopy(model)  # an EMA model's usual start; crashed the process before
    assert twin.weight.device.type == sim and twin.weight.data_ptr() != model.weight.data_ptr()
    assert torch.equal(twin.weight.cpu(), model.weight.cpu())
    with torch.no_grad():
        twin.weight.add_(1)
    assert not torch.equal(twin.weight.cpu(), model.weight.cpu())


@pytest.mark.usefixtures("sim")
def test_assigning_a_sim_tensor_as_data_moves_the_host_parameter_itself():
    # FSDP1 (device_id=) and FSDP2 move a host module so: `param.data = param.to(device)`.
    param = torch.nn.Parameter(torch.arange(3.0))
    param.marked_by_a_library = True
    same_object = param
    param.data = param.to("sim")
    assert same_object is param and isinstance(param, torch.nn.Parameter) and param.requires_grad
    assert real_device(param) == torch.device("sim", 0) and param.marked_by_a_library
    (param * 2).sum().backward()
    assert real_device(param.grad) == torch.device("sim", 0) and param.grad.cpu().tolist() == [2.0, 2.0, 2.0]
    plain = torch.zeros(2)
    plain.data = torch.ones(2)  # what PyTorch accepts stays PyTorch's
    assert plain.tolist() == [1.0, 1.0]
    with pytest.raises(RuntimeError, match="cannot assign a tensor on cpu as .data of a tensor on sim:0"):
        param.data = torch.zeros(3)


def test_conjugate_and_negative_views_compute_as_on_the_cpu(sim):
    # sim's kernels run inside __torch_dispatch__, where the conjugate and negative fallbacks are off: a kernel read a
    # view's memory as it lies (torch.exp(x.conj()) gave exp(x)).
    x = torch.randn(3, 4, dtype=torch.complex64)
    y = torch.randn(5)
    on_sim, real = x.to(sim), y.to(sim)
    assert torch.allclose(torch.exp(on_sim.conj()).cpu(), torch.exp(x.conj()))
    assert torch.allclose((on_sim.conj().T @ on_sim).cpu(), x.conj().T @ x, atol=1e-5)
    assert torch.allclose((on_sim.conj() * on_sim).cpu(), x.conj() * x)
    assert torch.equal(torch.exp(real._neg_view()).cpu(), torch.exp(-y))
    view = on_sim.conj()
    view.mul_(2)  # written through the view: the CPU's fallback writes back through the bit
    assert torch.allclose(on_sim.cpu(), x * 2)


def test_a_conjugate_or_negative_view_says_so_as_on_a_device(sim):
    # ifft of a real tensor gives a conjugate view (_fft_r2c, then _conj), as x.conj() does: sim's wrapper said it was
    # none while the memory under it was one, and view_as_real (how a tool reads a complex tensor) refused it
    x = torch.randn(8)
    on_sim = torch.fft.ifft(x.to(sim))
    assert torch.fft.ifft(x).is_conj() and on_sim.is_conj()
    assert torch.equal(torch.view_as_real(on_sim.conj()).cpu(), torch.view_as_real(torch.fft.ifft(x).conj()))
    assert torch.equal(on_sim.resolve_conj().cpu(), torch.fft.ifft(x).resolve_conj())
    assert torch.randn(3, dtype=torch.complex64).to(sim).conj().is_conj()
    assert torch.randn(3).to(sim)._neg_view().is_neg()


def test_a_nested_tensor_is_refused_by_name_with_the_way_round_it(sim):
    # nn.TransformerEncoder in evaluation turns a padded batch into a nested tensor, which a wrapper tensor cannot
    # hold: PyTorch's message was an internal error ("NestedTensorImpl doesn't support sizes. Please file an issue")
    def encoder(nested: bool) -> torch.nn.Module:
        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
        return torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested).eval()

    x, mask = torch.randn(2, 5, 16), torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    with torch.no_grad():
        expected = encoder(True)(x, src_key_padding_mask=mask)
        with pytest.raises(NotImplementedError, match="nested tensors are not supported on the sim device.*"
                                                      "enable_nested_tensor=False"):
            encoder(True).to(sim)(x.to(sim), src_key_padding_mask=mask.to(sim))
        result = encoder(False).to(sim)(x.to(sim), src_key_padding_mask=mask.to(sim))  # as the message says
    assert torch.allclose(result.cpu()[~mask], expected[~mask], atol=1e-5)


def test_sparse_coo_tensors_compute_as_on_the_cpu(sim):
    # A sparse COO tensor on sim is a wrapper of the CPU's (before, wrapping it read its storage, which a sparse
    # tensor has not: every sparse op failed); an embedding with sparse gradients trains as on the CPU.
    dense = torch.randn(6, 5)
    dense[dense < 0.3] = 0
    on_sim = dense.to(sim).to_sparse()
    assert on_sim.layout == torch.sparse_coo and real_device(on_sim) == torch.device("sim", 0)
    assert torch.equal((on_sim + on_sim).to_dense().cpu(), 2 * dense)
    assert torch.equal(on_sim.coalesce().values().cpu(), dense.to_sparse().coalesce().values())
    assert torch.allclose(torch.sparse.mm(on_sim, dense.T.to(sim)).cpu(), dense @ dense.T)
    assert on_sim.cpu().layout == torch.sparse_coo

    def train(device):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(20, 4, sparse=True).to(device)
        opt = torch.optim.SGD(emb.parameters(), lr=0.5)
        index = torch.tensor([1, 3, 3, 7], device=device)
        emb(index).square().sum().backward()
        grad_layout = emb.weight.grad.layout
        opt.step()
        return grad_layout, emb.weight.detach().cpu()

    (layout, weight), (cpu_layout, cpu_weight) = train(sim), train("cpu")
    assert layout == cpu_layout == torch.sparse_coo and torch.equal(weight, cpu_weight)
    with pytest.raises(NotImplementedError, match="layout torch.sparse_csr are not supported on the sim device"):
        dense.to(sim).to_sparse_csr()


def _sparse_gradients_accumulated(device) -> tuple:
    """Two backwards into an Embedding(sparse=True), SGD with momentum over three steps, then sparse tensors resized in
    place: what each left, on the host."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4, sparse=True).to(device)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        for index in ([1, 2], [2, step]):  # the second backward adds its gradient to the first's, in place
            emb(torch.tensor(index, device=device)).square().sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # a sparse gradient's zero_: no entries left
    grad = emb.weight.grad
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 1, 1], [2, 0, 2]]), torch.tensor([3.0, 4.0, 5.0]), (2, 3))
    resized = sparse.to(device).clone()  # on the CPU, to() hands back the tensor itself
    resized.sparse_resize_((4, 5), 2, 0)
    cleared = sparse.to(device).clone()
    cleared.sparse_resize_and_clear_((3, 3), 2, 0)
    return (emb.weight.detach().cpu(), grad.layout, grad._nnz(), tuple(resized.shape), resized.stride(),
            resized.to_dense().cpu(), tuple(cleared.shape), cleared._nnz())


def test_sparse_gradients_accumulate_and_sparse_tensors_resize_in_place_as_on_the_cpu(sim):
    # A sparse tensor written in place (a second backward accumulating into an embedding's sparse gradient) had its
    # metadata mirrored as a strided one's: its CPU tensor's storage read, which a sparse tensor has not (raised).
    on_sim, on_cpu = _sparse_gradients_accumulated(sim), _sparse_gradients_accumulated("cpu")
    assert torch.equal(on_sim[0], on_cpu[0])
    assert on_sim[1:5] == on_cpu[1:5] and on_sim[1] == torch.sparse_coo
    assert torch.equal(on_sim[5], on_cpu[5]) and on_sim[6:] == on_cpu[6:]


def test_to_the_host_with_a_dtype_in_inference_mode_gives_a_host_tensor(sim):
    # Under inference mode Tensor.to reaches the device as itself (no autograd key decomposes it), its device given
    # positionally: sim wrapped the host result as a sim tensor, and .numpy() on it raised (OpAutoCompare's narrowing
    # of a compiled graph run under inference mode failed so).
    x = torch.randn(3, device=sim)
    with torch.inference_mode():
        made = torch.randn(3, device=sim)
        for t in (x, made):
            for moved in (t.to("cpu", torch.float64), t.to(device="cpu", dtype=torch.float64),
                          t.to(torch.device("cpu"), torch.float64, copy=True)):
                assert real_device(moved).type == "cpu" and moved.dtype == torch.float64
                assert torch.equal(moved, t.cpu().double())
            on_sim = t.to(torch.float16)
            assert real_device(on_sim).type == "sim" and on_sim.dtype == torch.float16
            assert t.to(sim) is t


def test_views_in_inference_mode_behave_as_the_cpus(sim):
    # A view of a normal tensor made in inference mode is a normal tensor sharing its base's version counter; sim made
    # it an inference tensor, which autograd refused the counter: every view (x[1:], x.view, detach) raised.
    def views(device):
        x = torch.arange(6.0, device=device, requires_grad=True)
        with torch.inference_mode():
            view, alias, made = x[1:], x.detach(), x.reshape(2, 3) + 1
            facts = [t.is_inference() for t in (view, alias, made)]
            view.add_(1)  # written through the view: its base's counter moves
        return facts, x._version, made.cpu(), x.detach().cpu()

    on_sim, on_cpu = views(sim), views("cpu")
    assert on_sim[:2] == on_cpu[:2] == ([False, False, True], 1)
    assert torch.equal(on_sim[2], on_cpu[2]) and torch.equal(on_sim[3], on_cpu[3])
