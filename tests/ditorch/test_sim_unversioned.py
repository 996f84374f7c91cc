"""The `unversioned` fault: matched in-place and out= ops on sim write without bumping version counters."""

import warnings

import pytest
import torch

import ditorch.sim
from ditorch.sim.version_counter import WRITES

pytestmark = pytest.mark.usefixtures("sim")


def test_in_place_op_writes_without_a_version_bump_on_sim_only():
    x, on_cpu = torch.zeros(3, device="sim"), torch.zeros(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # PyTorch's kernel-override warning is silenced
        with ditorch.sim.faults("add_:unversioned"):
            x.add_(1)
            on_cpu.add_(1)
            assert x.cpu().tolist() == [1.0, 1.0, 1.0]
            assert x._version == 0
            assert on_cpu._version == 1  # other devices keep the default behaviour
            x.mul_(2)
            assert x._version == 1  # ops the pattern does not match still bump
    x.add_(1)
    assert x._version == 2 and x.cpu().tolist() == [3.0, 3.0, 3.0]  # cleared: bumps again
    assert WRITES.overloads == {}


def test_autograd_still_records_an_unversioned_op():
    leaf = torch.ones(3, device="sim", requires_grad=True)
    with ditorch.sim.faults("mul_:unversioned"):
        y = leaf.clone()
        y.mul_(3)
        assert type(y.grad_fn).__name__ == "MulBackward0" and y._version == 0
        y.sum().backward()
    assert leaf.grad.cpu().tolist() == [3.0, 3.0, 3.0]


def test_unversioned_write_hides_a_modification_autograd_would_have_caught():
    # What makes the fault worth having: a saved tensor changed in place goes unnoticed.
    x = torch.randn(3, device="sim", requires_grad=True)
    y = x.exp()  # exp saves its output for backward
    y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    y = x.exp()
    with ditorch.sim.faults("add_:unversioned"):
        y.add_(1)
    y.sum().backward()  # silently wrong, as on hardware whose kernel skips the bump
    assert x.grad is not None


def test_out_variants_and_the_dtype_filter():
    a = torch.ones(2, device="sim")
    with ditorch.sim.faults("add:unversioned"):  # add.out is an overload of add
        out = torch.empty(2, device="sim")
        torch.add(a, a, out=out)
        assert out.cpu().tolist() == [2.0, 2.0] and out._version == 0
        resized = torch.empty(0, device="sim")
        torch.add(a, a, out=resized)
        assert resized.shape == (2,) and resized._version == 0
        on_cpu = torch.empty(2)
        torch.add(a.cpu(), a.cpu(), out=on_cpu)
        assert on_cpu._version == 1
    with ditorch.sim.faults("add_@float64:unversioned"):
        single, double = torch.zeros(2, device="sim"), torch.zeros(2, device="sim", dtype=torch.float64)
        single.add_(1)
        double.add_(1)
        assert (single._version, double._version) == (1, 0)


def test_foreach_op_under_the_fault_writes_unversioned_on_sim_and_bumps_on_the_cpu():
    # A device's foreach ops have no ADInplaceOrView kernel: unversioned on sim with or without the
    # fault (as on CUDA); the CPU's per-tensor fallback keeps bumping.
    with ditorch.sim.faults("_foreach_add_:unversioned"):
        on_sim, on_cpu = [torch.zeros(2, device="sim")], [torch.zeros(2)]
        torch._foreach_add_(on_sim, 1.0)
        torch._foreach_add_(on_cpu, 1.0)
        assert on_sim[0].cpu().tolist() == [1.0, 1.0] and on_sim[0]._version == 0
        assert on_cpu[0]._version == 1


def test_every_in_place_op_can_be_unversioned_and_training_still_works():
    model = torch.nn.Linear(4, 2).to("sim")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
    with ditorch.sim.faults(".*:unversioned"):
        assert len(WRITES.overloads) > 1000  # every aten overload with an in-place/out= bump
        versions = [p._version for p in model.parameters()]
        model(torch.randn(3, 4, device="sim")).sum().backward()
        optimizer.step()  # add_ on every parameter
        assert [p._version for p in model.parameters()] == versions
        cpu = torch.zeros(2)
        cpu.resize_(2)
        assert cpu._version == 0  # resize_ bumps only when the size changes, as by default
        cpu.resize_(4)
        assert cpu._version == 1


def test_spec_parsing_and_inject_fault():
    assert str(ditorch.sim.parse_faults("add_@float16:unversioned")[0]) == "add_@float16:unversioned"
    with pytest.raises(ValueError, match="unversioned takes no value"):
        ditorch.sim.parse_faults("add_:unversioned=1")
    ditorch.sim.inject_fault("sub_", "unversioned")
    x = torch.zeros(1, device="sim")
    x.sub_(1)
    assert x._version == 0
    ditorch.sim.set_faults("mul_:unversioned")  # replacing the faults drops sub_'s kernel
    x.sub_(1)
    assert x._version == 1
    ditorch.sim.clear_faults()
