"""Optimizers and clip_grad_norm_ take the foreach path on sim, as on CUDA, with CUDA's version facts."""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from ditorch.sim import foreach_path

pytestmark = pytest.mark.usefixtures("sim")


class CalledNames(TorchFunctionMode):
    """The names of the torch functions called inside the block."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.add(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def train(device, steps=3, foreach=None, watch=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    x = torch.randn(4, 8)
    model.to(device)
    x = x.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=foreach)
    for _ in range(steps):
        model(x).pow(2).mean().backward()
        with watch or CalledNames():
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
        optimizer.zero_grad()
    return [p.detach().cpu() for p in model.parameters()]


def test_adamw_and_clip_grad_norm_take_the_foreach_path_and_match_the_cpu_foreach_run():
    seen = CalledNames()
    on_sim = train("sim", watch=seen)
    foreach_calls = {name for name in seen.names if name.startswith("_foreach_")}
    assert {"_foreach_lerp_", "_foreach_addcdiv_", "_foreach_norm", "_foreach_mul_"} <= foreach_calls
    on_cpu = train("cpu", foreach=True)
    assert all(torch.equal(a, b) for a, b in zip(on_sim, on_cpu))


@pytest.mark.parametrize("optimizer_class", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW])
def test_default_optimizers_choose_foreach_for_sim_parameters_reversibly(optimizer_class):
    from torch.optim.optimizer import _default_to_fused_or_foreach

    params = list(torch.nn.Linear(3, 3).to("sim").parameters())
    assert _default_to_fused_or_foreach(params, differentiable=False) == (False, True)
    foreach_path.uninstall()
    try:
        assert _default_to_fused_or_foreach(params, differentiable=False) == (False, False)
    finally:
        foreach_path.install()
    assert foreach_path.installed()
    optimizer = optimizer_class(params, lr=0.1)
    for p in params:
        p.grad = torch.ones_like(p)
    seen = CalledNames()
    with seen:
        optimizer.step()
    assert any(name.startswith("_foreach_") for name in seen.names)


def test_foreach_in_place_ops_leave_versions_unchanged_on_sim_as_on_cuda():
    # A device's foreach kernel writes its targets without an ADInplaceOrView bump (CUDA's fused
    # _foreach_lerp_ included); the CPU's per-tensor fallback bumps each target.
    for device, bumps in (("sim", 0), ("cpu", 1)):
        targets, ends = [torch.zeros(3, device=device)], [torch.ones(3, device=device)]
        torch._foreach_lerp_(targets, ends, 0.5)
        assert targets[0]._version == bumps, device
        assert targets[0].cpu().tolist() == [0.5, 0.5, 0.5]
    plain = torch.zeros(3, device="sim")
    plain.lerp_(torch.ones(3, device="sim"), 0.5)
    assert plain._version == 1  # an ordinary in-place op bumps on sim as everywhere
