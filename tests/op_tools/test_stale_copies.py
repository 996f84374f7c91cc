"""Host copies are never stale: writes the version counter does not show (sim's ``unversioned`` fault stands in for
GradScaler's unscale, BatchNorm's running statistics and CUDA's ``_foreach_lerp_``), writes through an alias with
its own counter (``.data``), and copies made by another tool instance."""

import os

import pytest
import torch

import op_tools
from op_tools.tools.capture import load_op_args


@pytest.fixture(autouse=True)
def _no_autocompare_variables(monkeypatch):
    for name in list(os.environ):
        if "AUTOCOMPARE" in name or name.endswith("_OP_DTYPE_CAST_DICT"):
            monkeypatch.delenv(name)


def test_an_input_written_without_a_version_bump_is_read_again(sim):
    import ditorch.sim

    x = torch.randn(64, device=sim)
    with op_tools.OpAutoCompare() as tool:
        torch.exp(x)  # x's copy is cached
        with ditorch.sim.faults("add_:unversioned"):
            version = x._version
            x.add_(1.0)
            assert x._version == version  # the write the counter does not show
        torch.exp(x)
    assert tool.failures == [] and tool.counts["forward compared"] == 3 and tool.stale_copies == 0


def test_a_write_through_an_alias_is_seen(sim):
    import ditorch.sim

    p = torch.randn(64, device=sim, requires_grad=True)
    with op_tools.OpAutoCompare() as tool:
        torch.exp(p)
        with ditorch.sim.faults("mul_:unversioned"):  # as through .data on a GPU: p's counter does not move
            version = p._version
            p.data.mul_(2)
            assert p._version == version
        torch.exp(p).sum().backward()
    assert tool.failures == [] and tool.counts["backward compared"] >= 1 and tool.stale_copies == 0


def test_batchnorm_running_statistics_are_compared_and_read_again(sim):
    import ditorch.sim

    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(8).to(sim)
    x = torch.randn(16, 8, device=sim)
    with op_tools.OpAutoCompare() as tool:
        bn(x)  # writes running_mean/var in place, no version bump
        bn.eval()
        bn(x)  # reads them
    assert tool.failures == []
    rows = [row[3].name for row in tool.rows if row[0] == "torch.nn.functional.batch_norm"]
    assert rows.count("written input[1]") == 1 and rows.count("written input[2]") == 1  # training call only
    bn.train()
    with op_tools.OpAutoCompare() as tool, ditorch.sim.faults("native_batch_norm:noise=1e-3"):
        bn(x)
    assert [f["op"] for f in tool.failures] == ["torch.nn.functional.batch_norm"]


def test_copies_of_one_tool_instance_are_never_taken_by_the_next(sim):
    x = torch.randn(100, device=sim)
    y = torch.randn(100, device=sim) * 3
    with op_tools.OpAutoCompare():
        torch.exp(y)
    with op_tools.OpAutoCompare() as tool:
        torch.exp(x)
        torch.exp(y)
    assert tool.failures == []


def test_a_stale_copy_is_caught_before_the_verdict(sim):
    """A write no call shows at all (here: behind the tool's back, in its own tool work) is found by re-reading the
    inputs of a call that would fail, and counted; the verdict is on the real values."""
    import ditorch.sim
    from op_tools.core.engine import tool_work

    x = torch.randn(64, device=sim)
    with op_tools.OpAutoCompare() as tool:
        torch.exp(x)
        with tool_work(), ditorch.sim.faults("copy_:unversioned"):  # no call shows it, no counter moves
            x.copy_(torch.randn(64, device=sim))
        torch.exp(x)
    assert tool.failures == [] and tool.stale_copies == 1


@pytest.mark.parametrize("batch", [1, 64])
def test_a_kernel_writing_an_input_it_only_reads_is_found_with_that_inputs_copy_from_the_cache(sim, batch):
    """A kernel that writes an input its schema says it only reads, then computes from it (sim's ``scratch`` fault:
    a vendor kernel using an input as scratch, with no version bump), gives a wrong result. That input's host copy
    came from the cache (made when the call producing it was compared), so the failing call's re-read finds it
    changed: a write before the call would make it stale, as in ``test_a_stale_copy_is_caught_before_the_verdict``.
    The op rerun on the device from the copy as cached reproduces the call's result, so the change was the call's
    own and the failure stands. The next call reads the written input and is right: it passes, against the input as
    re-read (judged one by one, the re-read copy is the cache's; judged in a batch, its cached copy is re-read)."""
    import ditorch.sim

    x0 = torch.randn(256)
    with ditorch.sim.faults("exp:scratch=-0.5"), op_tools.OpAutoCompare(verdict_batch=batch) as tool:
        a = x0.to(sim) * 1.0  # produced under the tool: its copy is cached
        y = torch.exp(a)
        b = a + 1
    assert torch.equal(a.cpu(), x0 * 0.5) and torch.allclose(y.cpu(), (x0 * 0.5).exp())  # the fault acted
    assert torch.allclose(b.cpu(), x0 * 0.5 + 1)
    assert [f["op"] for f in tool.failures] == ["torch.exp"]
    assert tool.inputs_written == {"torch.exp": 1}
    assert "1 failing calls changed an input they do not declare written (torch.exp: 1)" in tool.summary()


@pytest.mark.parametrize("batch", [1, 64])
def test_a_backward_kernel_writing_its_upstream_gradient_is_found_with_that_gradients_copy_from_the_cache(sim, batch):
    """The same for a backward kernel: ``tanh_backward`` halves the upstream gradient it is given, then computes
    from it. That gradient's host copy came from the cache (made when the backward producing it, mul's, was
    compared); the rerun of tanh's forward and backward on the device tells the kernel's own write from a stale copy."""
    import ditorch.sim

    x0 = torch.randn(256)
    with ditorch.sim.faults("tanh_backward:scratch=-0.5"), op_tools.OpAutoCompare(verdict_batch=batch) as tool:
        x = x0.to(sim).requires_grad_()
        (torch.tanh(x * 2.0) * torch.linspace(1, 2, 256, device=sim)).sum().backward()
    right = 2 * (1 - torch.tanh(x0 * 2.0) ** 2) * torch.linspace(1, 2, 256)
    assert torch.allclose(x.grad.cpu(), right / 2, rtol=1e-4, atol=1e-6)  # the fault acted
    assert [(f["op"], f["phase"]) for f in tool.failures] == [("torch.tanh", "backward")]
    assert tool.inputs_written == {"torch.tanh": 1}


@pytest.mark.parametrize("batch", [1, 64])
def test_a_backward_kernel_writing_an_upstream_gradient_no_call_made_is_found(sim, batch):
    """``y`` is used twice, so its gradient is the sum autograd makes of two, which no call made and no cache holds.
    Copied after ``tanh_backward`` ran, it held what the kernel wrote, and the comparison agreed with the kernel:
    the upstream gradient is copied as it arrives, before the node runs."""
    import ditorch.sim

    x0 = torch.randn(256)
    with ditorch.sim.faults("tanh_backward:scratch=-0.5"), op_tools.OpAutoCompare(verdict_batch=batch) as tool:
        x = x0.to(sim).requires_grad_()
        y = torch.tanh(x * 2.0)
        (y * 3.0 + y).sum().backward()
    assert torch.allclose(x.grad.cpu(), 4 * (1 - torch.tanh(x0 * 2.0) ** 2), rtol=1e-4, atol=1e-6)  # 8 halved
    assert [(f["op"], f["phase"]) for f in tool.failures] == [("torch.tanh", "backward")]
    assert tool.stale_copies == 0 and not tool.inputs_written  # its copy came from no cache: nothing re-read


@pytest.mark.parametrize("batch", [1, 64])
def test_a_gradient_passed_on_by_a_backward_that_wrote_it_is_compared_as_passed_on(sim, batch):
    """``index_add``'s backward passes its upstream gradient on to ``self`` unchanged and computes ``source``'s with
    ``index_select``, which here writes that upstream first. With ``alpha=0`` ``source``'s gradient is 0 either way:
    only the gradient passed on is wrong, and it is compared as it was passed on, not as the upstream arrived."""
    import ditorch.sim

    with ditorch.sim.faults("index_select:scratch=-0.5"), op_tools.OpAutoCompare(verdict_batch=batch) as tool:
        x = torch.randn(8, 4, device=sim, requires_grad=True)
        source = torch.randn(3, 4, device=sim, requires_grad=True)
        out = torch.index_add(x, 0, torch.tensor([0, 2, 5], device=sim), source, alpha=0)
        (out * torch.linspace(1, 2, 32, device=sim).reshape(8, 4)).sum().backward()
    assert torch.allclose(x.grad.cpu(), torch.linspace(1, 2, 32).reshape(8, 4) / 2)  # the fault acted
    failing = [(f["op"], f["phase"], f["failing"]) for f in tool.failures]
    assert failing == [("torch.index_add", "backward", "input[0].grad")]


def test_a_storage_resized_away_and_back_is_not_the_memory_its_copy_was_made_from(sim):
    """FSDP2 frees each unsharded parameter after use (``untyped_storage().resize_(0)``) and allocates it again
    before the next use (``resize_(n)``): the same storage object, other memory, no version bump, no call a tool
    sees. A copy made before is not reused for it: the 26 views a rank and step of FSDP2's parameters on sim failed
    against their step-before copies, and passed only when re-read (``tests/ditorch/scripts/parallel_llama.py``)."""
    import ditorch.sim
    from op_tools.core.engine import tool_work

    with op_tools.OpAutoCompare(verdict_batch=1) as tool:
        w = torch.randn(256, device=sim) * 1.0  # its copy is cached
        storage = w.untyped_storage()
        before, nbytes = storage.data_ptr(), storage.nbytes()
        held = []  # blocks that take the freed memory, until the storage gets other memory (as FSDP2's mostly do)
        for _ in range(16):
            storage.resize_(0)
            held.append(torch.empty(256, device=sim))
            storage.resize_(nbytes)
            if storage.data_ptr() != before:
                break
        assert storage.data_ptr() != before
        with tool_work(), ditorch.sim.faults("fill_:unversioned"):  # what the new memory holds, unseen
            w.fill_(7.0)
        w.view(16, 16)
    assert tool.failures == [] and tool.stale_copies == 0


def test_capture_never_references_a_tensor_written_without_a_version_bump(sim, tmp_path):
    import ditorch.sim

    x = torch.zeros(8, device=sim)
    with op_tools.OpCapture():
        x.sin()
        with ditorch.sim.faults("add_:unversioned"):
            x.add_(1)
        x.sin()
    root = tmp_path / "results" / "op_capture_results" / "torch.Tensor.sin"
    files = sorted(root.glob("*/*/*/input.pth"), key=lambda f: int(f.parts[-3]))
    assert [load_op_args(str(f))["args"][0][0].item() for f in files] == [0.0, 1.0]


def test_a_failing_in_place_op_is_not_mistaken_for_a_stale_copy(sim):
    import ditorch.sim

    x = torch.randn(64, device=sim)
    with op_tools.OpAutoCompare() as tool:
        torch.exp(x)  # x's copy is cached, and serves the in-place op below as its input
        with ditorch.sim.faults("mul_:noise=1e-3"):
            x.mul_(2)
    assert [f["op"] for f in tool.failures] == ["torch.Tensor.mul_"] and tool.stale_copies == 0


def test_a_targeted_tool_never_reuses_copies_the_calls_it_does_not_see_could_have_changed(sim, monkeypatch):
    import zoo

    # only linear is wrapped: AdamW's foreach updates of the weights (no version bump on sim) are never seen
    monkeypatch.setenv("OP_AUTOCOMPARE_LIST", "torch.nn.functional.linear")
    expected = zoo.llama_float32(sim)
    with op_tools.OpAutoCompare() as tool:
        losses = zoo.llama_float32(sim)
    assert not tool.sees_every_call and losses == expected
    assert tool.failures == [] and tool.stale_copies == 0 and tool.counts["forward compared"] > 10


def test_a_conjugate_or_negative_view_is_not_the_tensor_it_views():
    # x.conj() reads x's memory with x's offset, sizes and strides, and holds other values: a value derived from x
    # (its host copy, its flag, its statistics) is not x.conj()'s. (On sim the bit lies on the CPU data, not the sim
    # tensor; on a GPU it is the tensor's own.)
    from op_tools.numerics.current_values import CurrentValues, locate

    x = torch.randn(8, dtype=torch.complex64)
    values = CurrentValues(16, 0)
    values.put(locate(x), "x's")
    assert values.find(locate(x)) == "x's"
    assert values.find(locate(x.conj())) is None and values.find(locate(x._neg_view())) is None


def test_a_gradient_passed_on_is_read_again_with_its_stale_upstream(sim):
    """addcmul's backward passes its upstream gradient on to ``h`` and multiplies it for ``a``; that gradient, cached
    as mul's, is doubled behind the tools' back (a hook on autograd's thread, no version bump): ``a``'s gradient then
    fails against the stale copy, and the re-read must replace ``h``'s copy too, or ``h`` fails falsely."""
    import ditorch.sim

    h, a, b = (torch.randn(16, 8, device=sim, requires_grad=True) for _ in range(3))
    with op_tools.OpAutoCompare() as tool:
        y = torch.addcmul(h, a, b)
        y.register_hook(lambda g: g.mul_(2))  # the same tensor, written in place
        z = y * 3
        with ditorch.sim.faults("mul_:unversioned"):
            z.backward(torch.ones(16, 8, device=sim))
    assert tool.failures == [] and tool.counts["backward compared"] == 2, (tool.failures, dict(tool.counts))
    assert tool.stale_copies >= 1  # the upstream gradient was read again
