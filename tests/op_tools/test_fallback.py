import gc
import weakref

import pytest
import torch
from tiny_models import train_llama

import op_tools

FAULTS = "rsqrt:unsupported;.*@float64:unsupported"


def test_llama_step_fails_on_the_device_and_matches_cpu_under_fallback(sim):
    import ditorch.sim

    cpu = train_llama("cpu", steps=2)
    with ditorch.sim.faults(FAULTS):
        with pytest.raises(ditorch.sim.SimUnsupportedError):
            train_llama(sim, steps=1)
        with op_tools.OpFallback():
            assert train_llama(sim, steps=2) == cpu


def test_only_listed_ops_fall_back(sim, monkeypatch):
    import ditorch.sim

    monkeypatch.setenv("OP_FALLBACK_LIST", "torch.rsqrt")
    cpu = train_llama("cpu", steps=1)
    with ditorch.sim.faults(FAULTS), op_tools.OpFallback():
        assert train_llama(sim, steps=1) == cpu


def test_in_place_and_out_update_the_device_tensors(sim):
    x = torch.ones(3, device=sim, dtype=torch.float16)
    out = torch.empty(3, device=sim, dtype=torch.float16)
    with op_tools.OpFallback():
        returned = x.add_(2)
        torch.mul(x, 2, out=out)
    assert returned is x and x.device.type == sim and x.dtype == torch.float16
    assert torch.equal(x.cpu(), torch.full((3,), 3.0, dtype=torch.float16))
    assert torch.equal(out.cpu(), torch.full((3,), 6.0, dtype=torch.float16))


def test_gradients_reach_device_parameters(sim):
    w = torch.nn.Parameter(torch.ones(2, 3, device=sim))
    with op_tools.OpFallback():
        loss = torch.nn.functional.linear(torch.ones(4, 3, device=sim), w).pow(2).sum()
    assert loss.device.type == sim
    loss.backward()
    assert w.grad.device.type == sim and torch.equal(w.grad.cpu(), torch.full((2, 3), 24.0))


def test_device_moves_are_never_fallen_back(sim, logged, monkeypatch):
    monkeypatch.setenv("OP_TOOLS_VERBOSE", "1")
    x = torch.ones(2, device=sim)
    with op_tools.OpFallback():
        assert x.cpu().device.type == "cpu"
        assert x.to("cpu").device.type == "cpu"
        y = x.view(2, 1)
    assert y._base is x or y.data_ptr() == x.data_ptr()
    out = logged()
    assert "skip OpFallbackHook on torch.Tensor.cpu" in out and "apply OpFallbackHook on torch.Tensor.cpu" not in out


def half_unfriendly(x):
    """Stands in for a CPU kernel without float16 support."""
    if x.device.type == "cpu" and x.dtype == torch.float16:
        raise RuntimeError('"half_unfriendly" not implemented for \'Half\'')
    return x * 2


def test_float16_is_upcast_when_the_cpu_rejects_it(sim):
    op_tools.apply_feature(f"{__name__}.half_unfriendly", "fallback")
    try:
        y = half_unfriendly(torch.ones(3, device=sim, dtype=torch.float16))
    finally:
        op_tools.remove_feature(f"{__name__}.half_unfriendly")
    assert y.device.type == sim and y.dtype == torch.float16
    assert torch.equal(y.cpu(), torch.full((3,), 2.0, dtype=torch.float16))


def half_unfriendly_sum(a, b):
    """Stands in for a CPU kernel without float16 support, of two tensors."""
    if a.device.type == "cpu" and torch.float16 in (a.dtype, b.dtype):
        raise RuntimeError('"half_unfriendly_sum" not implemented for \'Half\'')
    return a + b


def test_a_float32_output_stays_float32_when_the_cpu_rejects_float16(sim):
    # Every float32 output of the retry was handed back in float16, the result of float16 + float32 too.
    x16, x32 = torch.ones(3, device=sim, dtype=torch.float16), torch.full((3,), 0.5, device=sim)
    plain = half_unfriendly_sum(x16, x32), half_unfriendly_sum(x16, x16)
    op_tools.apply_feature(f"{__name__}.half_unfriendly_sum", "fallback")
    try:
        tooled = half_unfriendly_sum(x16, x32), half_unfriendly_sum(x16, x16)
    finally:
        op_tools.remove_feature(f"{__name__}.half_unfriendly_sum")
    assert [(t.dtype, t.cpu().tolist()) for t in tooled] == [(t.dtype, t.cpu().tolist()) for t in plain]
    assert [t.dtype for t in tooled] == [torch.float32, torch.float16]


def test_an_embedding_with_sparse_gradients_falls_back_and_trains_as_on_the_device(sim):
    # Tensor.to's backward converts the gradient to the input's layout, which PyTorch refuses for a sparse one: the
    # user's backward() failed under the tool. The move's own backward keeps the gradient's layout.
    def train(tool):
        torch.manual_seed(0)
        embedding = torch.nn.Embedding(20, 4, sparse=True).to(sim)
        optimizer = torch.optim.SGD(embedding.parameters(), lr=0.5)
        index = torch.tensor([1, 3, 3, 7], device=sim)
        with tool:
            loss = embedding(index).square().sum()
            loss.backward()
        grad = embedding.weight.grad
        optimizer.step()
        return loss.item(), grad.layout, grad.coalesce().to_dense().cpu(), embedding.weight.detach().cpu()

    import contextlib

    plain = train(contextlib.nullcontext())
    with_tool = train(op_tools.OpFallback(ops=["torch.nn.functional.embedding"]))
    assert with_tool[0] == plain[0] and with_tool[1] == plain[1] == torch.sparse_coo
    assert torch.equal(with_tool[2], plain[2]) and torch.equal(with_tool[3], plain[3])


def test_batch_norm_running_statistics_reach_the_device_buffers(sim):
    # BatchNorm's kernel writes running_mean and running_var without moving their version counter: the write is known
    # from call_writes, not from the CPU copies' versions.
    def train(device, tool):
        torch.manual_seed(0)
        norm = torch.nn.BatchNorm1d(4).to(device)
        with tool:
            norm(torch.randn(8, 4).to(device) * 3 + 1)
        return {name: buffer.cpu() for name, buffer in norm.state_dict().items()}

    import contextlib

    cpu = train("cpu", contextlib.nullcontext())
    with_tool = train(sim, op_tools.OpFallback())
    assert not torch.equal(cpu["running_mean"], torch.zeros(4))
    for name, value in cpu.items():
        assert torch.equal(with_tool[name], value), name


def test_calls_under_inference_mode_fall_back(sim):
    # Inference tensors keep no version counter: reading one raised out of the user's call.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.GELU()).to(sim).eval()
    x, written = torch.randn(3, 6).to(sim), torch.zeros(3).to(sim)
    with torch.inference_mode():
        plain = model(x).cpu()
    with op_tools.OpFallback() as tool:
        with torch.inference_mode():
            y = model(x)
            written.add_(2)  # an in-place write under inference_mode still reaches the device tensor
        z = y + 1  # an inference tensor used outside inference_mode
    assert y.device.type == sim and y.is_inference() and torch.allclose(y.cpu(), plain)
    assert torch.allclose(z.cpu(), plain + 1) and torch.equal(written.cpu(), torch.full((3,), 2.0))
    assert tool.handled["torch.nn.functional.linear"] == 1


def _checkpointed_training(sim, tool, **checkpoint_options):
    """A non-reentrant checkpoint around a block with dropout: its weight's gradient."""
    from torch.nn import functional
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 8).to(sim)
    x = torch.randn(4, 8).to(sim)
    def block(t):
        return functional.dropout(functional.gelu(linear(t)), 0.5)

    with tool:
        y = checkpoint(block, x, use_reentrant=False, **checkpoint_options)
        y.sum().backward()
    return linear.weight.grad.cpu()


def test_a_non_reentrant_checkpoint_recomputes_under_the_tool_with_its_context_fn(sim):
    # PyTorch runs backward() with no TorchFunctionMode: the recomputation ran on the device while the forward had
    # saved the CPU's tensors, and the checkpoint's check failed the user's backward().
    import contextlib

    plain = _checkpointed_training(sim, contextlib.nullcontext())
    tool = op_tools.OpFallback()
    with_tool = _checkpointed_training(sim, tool, context_fn=op_tools.checkpoint_context_fn)
    assert torch.allclose(with_tool, plain)
    assert tool.handled["torch.nn.functional.linear"] == 2  # the forward and its recomputation


def test_a_non_reentrant_checkpoint_without_the_context_fn_says_what_to_pass(sim, logged):
    from torch.utils.checkpoint import CheckpointError

    with pytest.raises(CheckpointError):
        _checkpointed_training(sim, op_tools.OpFallback())
    assert "context_fn=op_tools.checkpoint_context_fn" in logged()


def _outcome(make):
    """What a script observes of ``make()``: its result's values, or its exception's type and message."""
    try:
        return ("returned", make().cpu().tolist())
    except Exception as error:  # noqa: BLE001 - the user's exception is what is compared
        return ("raised", type(error), str(error))


def test_a_call_mixing_devices_raises_the_devices_error_under_the_tool(sim):
    # On the CPU a call of a CPU tensor and a device tensor runs: the user's mistake, which the device refuses,
    # vanished under the tool. The device decides, as without it; index ops, which CUDA lets take CPU indices, and
    # CPU scalars still fall back.
    calls = {"add": lambda: torch.ones(3) + torch.ones(3, device=sim),
             "mm": lambda: torch.mm(torch.ones(2, 2), torch.ones(2, 2, device=sim)),
             "index_select": lambda: torch.ones(3, device=sim).index_select(0, torch.tensor([1]))}
    plain = {name: _outcome(call) for name, call in calls.items()}
    with op_tools.OpFallback() as tool:
        tooled = {name: _outcome(call) for name, call in calls.items()}
        scalar = torch.tensor(2.0) * torch.ones(2, device=sim)
        x = torch.zeros(4, device=sim)
        x[torch.tensor([1, 2])] = torch.tensor([5.0, 6.0])
    assert all(outcome[0] == "raised" for outcome in plain.values())
    assert tooled == plain
    assert scalar.device.type == sim and torch.equal(x.cpu(), torch.tensor([0.0, 5.0, 6.0, 0.0]))
    assert tool.handled["torch.Tensor.mul"] == 1 and tool.handled["torch.Tensor.__setitem__"] == 1
    assert not tool.unsupported and not tool.unchecked


def _scaled_by_lengths(x, lengths):
    """Takes its lengths on the CPU, as ``pack_padded_sequence`` and ``ctc_loss`` do on CUDA."""
    return x * float(lengths.sum())


def test_a_call_mixing_devices_that_the_device_accepts_runs_there_and_is_counted_not_fallen_back(sim):
    from op_tools.core import features

    name = f"{__name__}._scaled_by_lengths"
    op_tools.apply_feature(name, "fallback")
    try:
        tool = features._patched[name][4]
        y = _scaled_by_lengths(torch.ones(2, device=sim), torch.tensor([1, 2]))
    finally:
        op_tools.remove_feature(name)
    assert y.device.type == sim and torch.equal(y.cpu(), torch.full((2,), 3.0))
    assert "1 call not checked (calls mixing devices run on the device)" in tool.not_checked()


def _device_only(x):
    """Stands in for an op with no CPU kernel."""
    if x.device.type == "cpu":
        raise RuntimeError("device_only has no CPU kernel")
    return x * 2


def test_an_op_the_cpu_cannot_run_runs_on_the_device_and_is_counted_not_fallen_back(sim):
    # The CPU's failure is the tool's, not the user's: it killed the run. The device runs the call, as without the
    # tool (the user's own error then comes from there, unchanged), and the closing line counts it not fallen back.
    from op_tools.core import features

    name = f"{__name__}._device_only"
    op_tools.apply_feature(name, "fallback")
    try:
        tool = features._patched[name][4]
        y = _device_only(torch.ones(3, device=sim))
        wrong = _outcome(lambda: _device_only(torch.ones(3, device=sim), 2))
    finally:
        op_tools.remove_feature(name)
    assert y.device.type == sim and torch.equal(y.cpu(), torch.full((3,), 2.0))
    assert wrong == _outcome(lambda: _device_only(torch.ones(3, device=sim), 2)) and wrong[1] is TypeError
    assert tool.unchecked[name] == 1 and "device_only has no CPU kernel" in tool.not_checked()


IN_PLACE_VIEWS = {"unsqueeze_": lambda x: x.unsqueeze_(0), "t_": lambda x: x.t_(), "resize_": lambda x: x.resize_(3),
                  "as_strided_": lambda x: x.as_strided_((3,), (2,)), "squeeze_": lambda x: x[:1].squeeze_()}


def in_place_views(device, tool):
    """Each in-place view op on a fresh tensor: whether it returned its argument, and what that holds then."""
    out = {}
    for name, change in IN_PLACE_VIEWS.items():
        x = torch.arange(6.0, device=device).view(2, 3).clone()
        with tool:
            returned = change(x)
        out[name] = (returned is x or returned._base is x, returned.shape, returned.stride(), returned.cpu().tolist())
    return out


def test_in_place_view_ops_change_the_device_tensor_as_without_the_tool(sim):
    # Run on a CPU copy, the device tensor kept its shape: unsqueeze_ and t_ raised, resize_ and as_strided_ left a
    # (2, 3) tensor holding the new values twice over.
    import contextlib

    assert in_place_views(sim, op_tools.OpFallback()) == in_place_views(sim, contextlib.nullcontext())


# Views of a (4, 6) tensor that the tools ran on copies: a write through one was lost, verdict clean (torch.split
# is seen as torch.functional.split, a name no list had)
VIEWS_WRITTEN = {
    "torch.split": lambda x: torch.split(x, 2)[0], "torch.split, sizes": lambda x: torch.split(x, [1, 3])[1],
    "torch.tensor_split": lambda x: torch.tensor_split(x, 2)[1], "torch.hsplit": lambda x: torch.hsplit(x, 2)[0],
    "torch.vsplit": lambda x: torch.vsplit(x, 2)[1], "torch.swapaxes": lambda x: torch.swapaxes(x, 0, 1),
    "torch.unflatten": lambda x: torch.unflatten(x, 1, (2, 3)),
    "torch.broadcast_to": lambda x: torch.broadcast_to(x, (4, 6)),
    "Tensor.broadcast_to": lambda x: x.broadcast_to((4, 6)), "torch.atleast_3d": lambda x: torch.atleast_3d(x),
    "torch.adjoint": lambda x: torch.adjoint(x), "aten.alias": lambda x: torch.ops.aten.alias(x),
    "Tensor.unsafe_split": lambda x: x.unsafe_split(2)[1],
}


def writes_through_views(device, dtype, tool):
    """What a tensor holds after a write through each view of it, and what a write through meshgrid's pieces (each
    an expansion: its elements share memory) raises."""
    out = {}
    for name, view in VIEWS_WRITTEN.items():
        x = torch.zeros(4, 6, device=device, dtype=dtype)
        with tool, torch.no_grad():
            view(x).add_(1.0)
        out[name] = x.cpu().tolist()
    y = torch.zeros(3, device=device, dtype=dtype)
    with tool, torch.no_grad():
        try:
            torch.meshgrid(y, y, indexing="ij")[0].add_(1.0)
        except RuntimeError as error:
            out["meshgrid"] = str(error).splitlines()[0]
    return out


def test_writes_through_views_reach_the_device_tensor_as_without_the_tool(sim):
    import contextlib

    plain = writes_through_views(sim, torch.float32, contextlib.nullcontext())
    assert "more than one element of the written-to tensor" in plain["meshgrid"]
    assert writes_through_views(sim, torch.float32, op_tools.OpFallback()) == plain


def writes_through_a_tensor_passed_twice(device, dtype, tool):
    """``x.mul_(x)`` and ``add(x, x, out=x)``: what x holds after each, and its version counter."""
    x = torch.full((3,), 3.0, device=device, dtype=dtype)
    seen = []
    with tool:
        for write in (lambda: x.mul_(x), lambda: torch.add(x, x, out=x), lambda: x.addcmul_(x, x)):
            returned = write()
            seen.append((returned is x, x.cpu().tolist(), x._version))
    return seen


def test_a_tensor_passed_twice_is_one_tensor_on_the_cpu(sim):
    # Each occurrence had its own CPU copy: the write went to one, and the other, unwritten, was carried back
    # last (x.mul_(x) left x as it was), moving the version counter once per copy.
    import contextlib

    plain = writes_through_a_tensor_passed_twice(sim, torch.float32, contextlib.nullcontext())
    assert plain == writes_through_a_tensor_passed_twice(sim, torch.float32, op_tools.OpFallback())


def outputs_resized(device, dtype, tool):
    """``out=`` tensors of the wrong size, which the op resizes: their shapes, values and version counters."""
    x = torch.tensor([3.0, 1.0, 2.0], device=device, dtype=dtype)
    out, values, indices = (torch.empty(0, device=device, dtype=dtype), torch.empty(0, device=device, dtype=dtype),
                            torch.empty(0, device=device, dtype=torch.long))
    with tool:
        torch.add(x, 1, out=out)
        torch.sort(x, out=(values, indices))
    return [(t.shape, t.cpu().tolist(), t._version) for t in (out, values, indices)]


def test_out_tensors_are_resized_as_without_the_tool(sim):
    # The op resized the CPU copy, and its values could not be copied into the device tensor: the user's call raised.
    import contextlib

    plain = outputs_resized(sim, torch.float32, contextlib.nullcontext())
    assert plain == outputs_resized(sim, torch.float32, op_tools.OpFallback())


def test_a_call_the_device_refuses_for_its_dtypes_raises_the_same_error_under_the_tool(sim):
    # linear of a float32 input by a float16 weight: the CPU refuses it as the device does; the float32 retry, meant
    # for a CPU without a float16 kernel, ran it and handed back a result where the user's run raised
    x, w = torch.randn(2, 3, device=sim), torch.randn(4, 3, device=sim, dtype=torch.float16)
    with pytest.raises(RuntimeError) as plain:
        torch.nn.functional.linear(x, w)
    with op_tools.OpFallback() as fallback, pytest.raises(RuntimeError) as tooled:
        torch.nn.functional.linear(x, w)
    assert str(tooled.value) == str(plain.value)
    assert fallback.raised == {"torch.nn.functional.linear": 1}
    # unchanged: raised outside the tool's handler of the CPU's error, it carried that error as its context ("During
    # handling of the above exception, another exception occurred")
    assert tooled.value.__context__ is plain.value.__context__ is None


def versions_after_steps(device, tool):
    """The version counters a short training step leaves: writes that move them (add_, out=, index_put_, stft's own
    steps on its result) and writes that do not (foreach ops, BatchNorm's running statistics, foreach optimizers)."""
    torch.manual_seed(0)
    linear, norm = torch.nn.Linear(3, 3).to(device), torch.nn.BatchNorm1d(3).to(device)
    sgd = torch.optim.SGD([linear.weight], lr=0.1, foreach=True)
    adamw = torch.optim.AdamW([linear.bias], lr=0.1, foreach=True)
    ys, zs = [torch.randn(3, device=device) for _ in range(2)], [torch.randn(3, device=device) for _ in range(2)]
    x, out = torch.randn(3, device=device), torch.empty(0, device=device)
    with tool:
        torch._foreach_add_(ys, zs)
        for _ in range(2):
            norm(linear(torch.randn(4, 3, device=device))).sum().backward()
            sgd.step()
            adamw.step()
        x.add_(1)
        torch.mul(x, 2, out=out)
        x.index_put_((torch.tensor([0, 2], device=device),), torch.zeros(2, device=device))
        spectrum = torch.stft(torch.randn(16, device=device), 8, window=torch.hann_window(8, device=device),
                              return_complex=True)
    tensors = {"ys": ys[0], "running_mean": norm.running_mean, "weight": linear.weight, "bias": linear.bias,
               "exp_avg": adamw.state[linear.bias]["exp_avg"], "x": x, "out": out, "stft": spectrum}
    return {name: t._version for name, t in tensors.items()}


def test_version_counters_end_as_the_op_leaves_them(sim):
    # The tool writes a CPU result back with copy_, which moves the counter once: a foreach op, BatchNorm's running
    # statistics and a foreach optimizer's step move it not at all on the device, stft's result twice.
    import contextlib

    plain = versions_after_steps(sim, contextlib.nullcontext())
    assert plain["ys"] == plain["running_mean"] == plain["weight"] == 0 and plain["x"] == 2 and plain["stft"] == 2
    assert versions_after_steps(sim, op_tools.OpFallback()) == plain


def test_gradients_through_the_cpu_equal_a_cpu_runs_bit_for_bit(sim):
    # sum()'s gradient is an expanded (stride-0) tensor: moved between devices as a contiguous one, the CPU's
    # backward kernels (mm's, BatchNorm's) rounded otherwise than in a CPU run.
    def gradients(device):
        torch.manual_seed(0)
        x = torch.randn(4, 6).to(device).requires_grad_()
        (x.t() @ x).sum().backward()
        norm = torch.nn.BatchNorm1d(4).to(device)
        inputs = torch.randn(8, 4).to(device).requires_grad_()
        norm(inputs).sum().backward()
        return [t.cpu() for t in (x.grad, inputs.grad, norm.weight.grad, norm.bias.grad)]

    cpu = gradients("cpu")
    with op_tools.OpFallback():
        tooled = gradients(sim)
    for name, expected, got in zip(("x", "inputs", "weight", "bias"), cpu, tooled):
        assert torch.equal(got, expected), name


def _exp_output_written(device, dtype):
    x = torch.randn(4, device=device, dtype=dtype, requires_grad=True)
    y = x.exp()  # saves its output
    y.add_(1)
    y.sum().backward()


def _sin_input_written(device, dtype):
    x = torch.randn(4, device=device, dtype=dtype, requires_grad=True)
    z = x * 1
    y = z.sin()  # saves its input
    z.add_(1)
    y.sum().backward()


def _linear_input_written(device, dtype):
    x = torch.randn(2, 3, 4, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(5, 4, device=device, dtype=dtype, requires_grad=True)
    h = x * 1
    y = torch.nn.functional.linear(h, w)  # saves a view of its input, flattened to 6 x 4: not the input itself
    h.add_(1)
    y.sum().backward()


def _saved_and_written_apart(device, dtype):
    x = torch.randn(4, device=device, dtype=dtype, requires_grad=True)
    y = x.exp()
    z = y + 1
    z.add_(1)  # not a tensor any backward needs
    torch.nn.functional.relu(z * 2, inplace=True).sum().backward()
    return x.grad


MODIFIED = "one of the variables needed for gradient computation has been modified by an inplace operation"


@pytest.mark.parametrize("program", [_exp_output_written, _sin_input_written, _linear_input_written])
@pytest.mark.parametrize("tool", ["OpFallback", "OpDtypeCast"])
def test_a_write_into_a_tensor_the_backward_needs_raises_as_without_the_tool(sim, tool, program, monkeypatch):
    # The op ran on stand-ins (CPU copies, float32 copies): its node saved those, which the program's write never
    # reached, so backward ran on values the program had overwritten, and the user's mistake was hidden
    monkeypatch.setenv("OP_DTYPE_CAST_DICT", "torch.float16->torch.float32")
    with pytest.raises(RuntimeError, match=MODIFIED):
        program(sim, torch.float16)
    with getattr(op_tools, tool)() as running, pytest.raises(RuntimeError, match=MODIFIED) as raised:
        program(sim, torch.float16)
    assert any(name in str(raised.value) for name in ("exp", "sin", "linear"))
    assert running.handled  # the op ran through the tool


@pytest.mark.parametrize("tool", ["OpFallback", "OpDtypeCast"])
def test_saved_tensors_no_write_reached_leave_backward_alone_and_the_programs_own_hooks_run(sim, tool, monkeypatch):
    monkeypatch.setenv("OP_DTYPE_CAST_DICT", "torch.float16->torch.float32")
    torch.manual_seed(0)
    plain = _saved_and_written_apart(sim, torch.float16)
    packed = []

    def pack(t):
        packed.append(t.shape)
        return t

    with getattr(op_tools, tool)():
        torch.manual_seed(0)
        tooled = _saved_and_written_apart(sim, torch.float16)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            x = torch.randn(4, device=sim, dtype=torch.float16, requires_grad=True)
            x.exp().sum().backward()
    torch.testing.assert_close(tooled.cpu(), plain.cpu())  # widened: within float16's rounding
    assert packed, "the program's saved-tensor hooks were bypassed"


def test_the_cpu_graph_of_a_call_whose_result_is_dropped_is_freed(sim):
    # The saved-tensor hooks once held the output a node saves as itself: the node held it and it held the node, a
    # cycle through C++ that the garbage collector cannot see, so every call's graph stayed alive (13 objects a step)
    import gc

    x = torch.randn(64, device=sim, requires_grad=True)
    w = torch.randn(64, device=sim)
    with op_tools.OpFallback():
        for _ in range(20):
            y = torch.exp(x) * w
        gc.collect()
        before = len(gc.get_objects())
        for _ in range(200):
            y = torch.exp(x) * w
        gc.collect()
        assert len(gc.get_objects()) - before < 100
    y.sum().backward()
    assert torch.equal(x.grad.cpu(), (torch.exp(x.detach()) * w).cpu())


def _row_added_to_its_matrix(device, dtype):
    x = torch.arange(6.0, device=device, dtype=dtype).reshape(2, 3)
    x.add_(x[0])  # reads what it writes: refused
    return x


def _shifted_out(device, dtype):
    x = torch.arange(6.0, device=device, dtype=dtype)
    torch.add(x[:-1], 1, out=x[1:])
    return x


def _disjoint_rows(device, dtype):
    x = torch.arange(6.0, device=device, dtype=dtype).reshape(2, 3)
    x[0].add_(x[1])  # one storage, no element shared: runs
    x.mul_(x)  # the same view: runs
    return x


OVERLAP = "some elements of the input tensor and the written-to tensor refer to a single memory location"


@pytest.mark.parametrize("program", [_row_added_to_its_matrix, _shifted_out])
@pytest.mark.parametrize("tool", ["OpFallback", "OpDtypeCast"])
def test_a_call_writing_memory_another_argument_shares_raises_the_devices_error_under_the_tool(sim, tool, program,
                                                                                              monkeypatch):
    # Copies of each argument share no memory: the call ran on them and returned what the device refuses to compute
    monkeypatch.setenv("OP_DTYPE_CAST_DICT", "torch.float16->torch.float32")
    with pytest.raises(RuntimeError, match=OVERLAP):
        program(sim, torch.float16)
    with getattr(op_tools, tool)(), pytest.raises(RuntimeError, match=OVERLAP):
        program(sim, torch.float16)
    with getattr(op_tools, tool)() as running:  # one storage, no element shared: handled as before
        assert torch.equal(_disjoint_rows(sim, torch.float16).cpu(), _disjoint_rows("cpu", torch.float16))
    assert running.handled and running.not_checked() == "", running.not_checked()  # none run on the device instead


# A tool runs the calls OpFallback or OpDtypeCast runs in the device's place, whatever the order the tools started in
# and however each dispatches (a mode; wrappers of the functions a LIST names): it met only their inner calls, as tool
# work, when started first, and its summary left them out with a clean verdict.
@pytest.mark.parametrize("changer", ["OpFallback", "OpDtypeCast"])
@pytest.mark.parametrize("order", ["started first", "started last"])
@pytest.mark.parametrize("listed", [False, True], ids=["every op", "a LIST of names"])
def test_another_tool_sees_each_call_run_in_the_devices_place_once(sim, tmp_path, changer, order, listed):
    x = torch.randn(4, 4, device=sim, dtype=torch.float16)
    ops = ["torch.nn.functional.gelu", "torch.Tensor.matmul"] if listed else None
    changing = getattr(op_tools, changer)(ops=ops, results_dir=str(tmp_path))
    timing = op_tools.OpTimeMeasure(ops=ops, results_dir=str(tmp_path))
    tools = [timing, changing] if order == "started first" else [changing, timing]
    for tool in tools:
        tool.start()
    try:
        y = torch.nn.functional.gelu(x)
        z = y.matmul(y)
    finally:
        for tool in reversed(tools):
            tool.stop()
    assert z.dtype == torch.float16 and z.device.type == sim
    assert timing.handled["torch.nn.functional.gelu"] == timing.handled["torch.Tensor.matmul"] == 1
    assert changing.handled["torch.nn.functional.gelu"] == changing.handled["torch.Tensor.matmul"] == 1
    assert {"torch.nn.functional.gelu", "torch.Tensor.matmul"} <= set(timing.measurements.totals)


# OpFallback and OpDtypeCast on one op under autocast: the call is widened and run on the CPU, whichever started first
# and however they dispatch. Under a mode, OpFallback's CPU run replayed the device's autocast inside OpDtypeCast's
# autocast-off block: a float32 result holding float16 values, silently. As wrappers of a LIST, OpFallback started last
# handed OpDtypeCast the CPU's call, none of its: the cast was lost ("matched no call").
@pytest.mark.parametrize("order", ["OpFallback,OpDtypeCast", "OpDtypeCast,OpFallback"])
@pytest.mark.parametrize("listed", [False, True], ids=["every op", "a LIST of names"])
def test_fallback_and_dtype_cast_on_one_op_under_autocast_widen_it(sim, tmp_path, order, listed):
    torch.manual_seed(0)
    x, w = torch.randn(8, 64, device=sim), torch.randn(16, 64, device=sim)
    exact = x.cpu().double() @ w.cpu().double().t()
    ops = ["torch.nn.functional.linear"] if listed else None
    tools = [getattr(op_tools, name)(ops=ops, results_dir=str(tmp_path)) for name in order.split(",")]
    with torch.autocast(sim, dtype=torch.float16):
        plain = torch.nn.functional.linear(x, w)
        for tool in tools:
            tool.start()
        try:
            y = torch.nn.functional.linear(x, w)
        finally:
            for tool in reversed(tools):
                tool.stop()
    assert plain.dtype == torch.float16 and y.dtype == torch.float32 and y.device.type == sim
    assert (plain.cpu().double() - exact).abs().max() > 1e-3  # float16's rounding, which the widened call has not
    assert (y.cpu().double() - exact).abs().max() < 1e-4, (y.cpu().double() - exact).abs().max()
    assert [tool.handled["torch.nn.functional.linear"] for tool in tools] == [1, 1]


def test_a_tool_declining_a_call_handed_on_does_not_keep_its_tensors(sim, tmp_path):
    # the tool under OpFallback remembered the handed-on run as a function to skip, and with it the call's tensors
    import gc
    import weakref

    timing = op_tools.OpTimeMeasure(disable=["torch.nn.functional.gelu"], results_dir=str(tmp_path)).start()
    falling = op_tools.OpFallback(results_dir=str(tmp_path)).start()
    x = torch.randn(4, device=sim)
    torch.nn.functional.gelu(x)
    falling.stop()
    timing.stop()
    alive = weakref.ref(x)
    del x
    gc.collect()
    assert alive() is None


# A tool under OpFallback or OpDtypeCast reruns the call it is handed (OpAutoCompare's float64 reference, OpDtypeCast's
# meta run) as the torch function, never as the other tool's run of it: OpAutoCompare's reference came back on the
# device through OpFallback (every call "not checked"), OpDtypeCast's meta run went to OpFallback, OpAutoCompare's
# reference under OpDtypeCast was widened and counted as a cast, and OpDtypeCast's table of meta runs, keyed on each
# call's own run, missed every time and kept the calls' tensors alive past stop().
@pytest.mark.parametrize("lower, upper", [("OpAutoCompare", "OpFallback"), ("OpAutoCompare", "OpDtypeCast"),
                                          ("OpDtypeCast", "OpFallback")])
def test_a_tool_under_another_that_runs_calls_reruns_the_torch_function(sim, tmp_path, lower, upper):
    below = getattr(op_tools, lower)(results_dir=str(tmp_path))
    above = getattr(op_tools, upper)(results_dir=str(tmp_path))
    w = torch.randn(8, 8, device=sim, dtype=torch.float16, requires_grad=True)
    kept = []
    below.start()
    above.start()  # its mode on top: it hands its runs to the one below
    try:
        for _ in range(3):
            x = torch.randn(8, 8, device=sim, dtype=torch.float16)
            torch.matmul(x, w).float().sum().backward()
            kept.append(weakref.ref(x))
            del x
    finally:
        above.stop()
        below.stop()
    gc.collect()
    assert below.not_checked() == "" and above.not_checked() == "", (below.not_checked(), above.not_checked())
    assert below.handled["torch.matmul"] == above.handled["torch.matmul"] == 3
    if lower == "OpAutoCompare":
        assert below.verdict() == "clean" and below.counts["backward compared"] >= 3, below.counts
    else:
        assert len(below._expected) == 1, list(below._expected)  # one meta run for the three calls
        assert not any(ref() is not None for ref in kept)
    if upper == "OpDtypeCast":
        assert above.cast_calls == 3  # the program's calls, not the reference's reruns


# A tool whose backward hooks keep its calls kept, through them, what OpFallback's or OpDtypeCast's run of the call
# held (the other tool's call, its arguments and result) and what OpOverflowCheck's in-place calls wrote: a cycle
# through the run's autograd.Function node, which no collection breaks; the step's tensors outlived stop().
@pytest.mark.parametrize("order", ["OpOverflowCheck,OpFallback", "OpFallback,OpOverflowCheck",
                                   "OpOverflowCheck,OpDtypeCast", "OpDtypeCast,OpOverflowCheck"])
def test_a_step_under_a_tool_and_one_that_runs_calls_leaves_nothing_alive(sim, tmp_path, order):
    def step():
        tools = [getattr(op_tools, name)(results_dir=str(tmp_path)) for name in order.split(",")]
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16)).to(sim).half()
        x = torch.randn(4, 8, device=sim, dtype=torch.float16, requires_grad=True)
        for tool in tools:
            tool.start()
        try:
            y = model(x).clone()
            y.add_(1.0)
            y.float().sum().backward()
        finally:
            for tool in reversed(tools):
                tool.stop()
        return [weakref.ref(y), weakref.ref(x), weakref.ref(model[0].weight)]

    kept = step()
    gc.collect()
    assert [ref() is not None for ref in kept] == [False, False, False]
