"""Injected faults make the sim device misbehave in exactly the way asked, and only then."""

import subprocess
import sys

import pytest
import torch
from subprocess_env import child_env

import ditorch.sim
from ditorch.sim import SimUnsupportedError


@pytest.mark.usefixtures("sim")
def test_unsupported_raises_like_a_missing_vendor_kernel():
    x = torch.randn(4, 4, device="sim")
    with ditorch.sim.faults("mm:unsupported"):
        with pytest.raises(RuntimeError, match=r"aten::mm.default is not supported"):
            x @ x
        assert (x + x).shape == (4, 4)  # other ops unaffected
    assert (x @ x).shape == (4, 4)  # restored on exit


@pytest.mark.usefixtures("sim")
def test_unsupported_can_target_one_dtype():
    with ditorch.sim.faults(".*@float64:unsupported"):
        assert (torch.ones(2, device="sim") * 2).dtype == torch.float32
        with pytest.raises(SimUnsupportedError, match="for torch.float64"):
            torch.ones(2, device="sim", dtype=torch.float64)
        with pytest.raises(SimUnsupportedError):
            torch.ones(2, device="sim").double()


@pytest.mark.usefixtures("sim")
def test_noise_perturbs_every_element_by_the_relative_error():
    a, b = torch.randn(8, 8, device="sim"), torch.randn(8, 8, device="sim")
    exact = (a @ b).cpu()
    with ditorch.sim.faults("mm:noise=1e-3"):
        noisy = (a @ b).cpu()
    relative = ((noisy - exact) / exact).abs()
    assert torch.allclose(relative, torch.full_like(relative, 1e-3), rtol=1e-3)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    with ditorch.sim.faults("mm:noise=1e-3"):
        a @ b
    assert torch.equal(torch.rand(3), expected), "noise must not consume the user's random stream"


@pytest.mark.usefixtures("sim")
@pytest.mark.parametrize("kind,check", [("nan", torch.isnan), ("inf", torch.isinf)])
def test_poisoned_outputs(kind, check):
    x = torch.randn(3, device="sim")
    with ditorch.sim.faults(f"gelu:{kind}"):
        assert check(torch.nn.functional.gelu(x).cpu()).all()
        assert torch.isfinite(torch.relu(x).cpu()).all()
        y = x.clone()
        with ditorch.sim.faults(f"add_.Tensor:{kind}"):
            y.add_(1)  # in-place: the mutated tensor is poisoned
        assert check(y.cpu()).all()


@pytest.mark.usefixtures("sim")
def test_an_in_place_foreach_op_has_the_tensors_it_wrote_poisoned():
    """An optimizer's in-place foreach ops return nothing: what they write is their output, and a fault hits it (a
    vendor's fused optimizer kernels are where such a fault lives)."""
    params = [torch.zeros(4, device="sim"), torch.zeros(3, device="sim")]
    with ditorch.sim.faults("_foreach_add_:nan"):
        torch._foreach_add_(params, 1.0)
    assert all(torch.isnan(p.cpu()).all() for p in params)
    exact = [torch.ones(4, device="sim")]
    with ditorch.sim.faults("_foreach_mul_@float32:noise=1e-2"):
        torch._foreach_mul_(exact, 2.0)
    assert torch.allclose((exact[0].cpu() - 2).abs(), torch.full((4,), 2e-2))


@pytest.mark.usefixtures("sim")
def test_views_are_never_poisoned_and_faults_reach_backward():
    x = torch.randn(2, 3, device="sim", requires_grad=True)
    with ditorch.sim.faults("t:nan"):
        assert torch.isfinite(x.t().detach().cpu()).all()
    with ditorch.sim.faults("(unsafe_split|_unsafe_view).*:nan"):  # views whose schema does not say so: x was poisoned
        torch.unsafe_split(x.detach(), 1, 1), torch.unsafe_chunk(x.detach(), 3, 1)
        torch.ops.aten._unsafe_view(x.detach(), (3, 2))
        assert torch.isfinite(x.detach().cpu()).all()
    with ditorch.sim.faults("gelu_backward:nan"):
        out = torch.nn.functional.gelu(x)
        assert torch.isfinite(out.detach().cpu()).all()
        out.sum().backward()
    assert torch.isnan(x.grad.cpu()).all()


@pytest.mark.usefixtures("sim")
def test_slow_fault_delays_the_op():
    import time

    x = torch.ones(2, device="sim")
    with ditorch.sim.faults("exp:slow=50"):
        start = time.perf_counter()
        x.exp()
        assert time.perf_counter() - start >= 0.045


@pytest.mark.usefixtures("sim")
def test_inject_fault_and_clear():
    ditorch.sim.inject_fault("relu", "nan")
    assert torch.isnan(torch.relu(torch.ones(2, device="sim")).cpu()).all()
    ditorch.sim.clear_faults()
    assert torch.relu(torch.ones(2, device="sim")).cpu().tolist() == [1.0, 1.0]


def test_faults_from_the_environment():
    code = ("import torch, ditorch.sim; ditorch.sim.register(); x = torch.ones(2, device='sim'); "
            "print(torch.isnan((x * x).cpu()).all().item(), (x + x).cpu().tolist())")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env=child_env({"DITORCH_SIM_FAULTS": "aten::mul.Tensor:nan"}))
    assert result.stdout.split() == ["True", "[2.0,", "2.0]"], result.stderr


@pytest.mark.parametrize("spec,why", [
    ("mm", "has no ':kind'"),
    ("mm:explode", "unknown fault kind 'explode'"),
    ("mm:noise=lots", "noise needs a number"),
    ("mm:nan=3", "nan takes no value"),
    ("mm@float65:nan", "unknown dtype 'float65'"),
    ("(mm:nan", "invalid regular expression"),
    ("mm:bitflip=0", "bitflip needs a whole number of calls >= 1"),
    ("mm:bitflip=2.5", "bitflip needs a whole number of calls >= 1"),
    ("mm:noise=1e-2,p=2", "p='2' is not a fraction in (0, 1]"),
    ("mm:nan,rank=-1", "rank='-1' is not a rank >= 0"),
    ("mm:nan,every=3", "unknown option 'every'"),
    ("mm:slow=5,p=0.5", "p= applies to bitflip, inf, nan, noise, not slow"),
])
def test_malformed_fault_spec_names_variable_and_form(spec, why):
    with pytest.raises(ValueError) as error:
        ditorch.sim.parse_faults(spec, "DITORCH_SIM_FAULTS")
    message = str(error.value)
    assert message.startswith(f"DITORCH_SIM_FAULTS={spec!r}") and why in message
    assert "expected 'pattern[@dtype]:kind[,p=<fraction>][,rank=<r>]'" in message


def test_malformed_fault_variable_fails_registration():
    result = subprocess.run([sys.executable, "-c", "import ditorch.sim; ditorch.sim.register()"],
                            capture_output=True, text=True, timeout=120,
                            env=child_env({"DITORCH_SIM_FAULTS": "mm:boom"}))
    assert result.returncode != 0 and "ValueError: DITORCH_SIM_FAULTS='mm:boom'" in result.stderr


@pytest.mark.usefixtures("sim")
@pytest.mark.parametrize("multithreading", [True, False], ids=["device thread", "calling thread"])
def test_a_backward_ops_error_is_raised_by_backward(multithreading):
    # As a device reports an op it has no kernel for: from backward() itself, with the op's own error (before the
    # sim device guard took the pending exception, raising in autograd's device thread aborted the process, and sim
    # deferred such errors to a later call).
    x = torch.randn(4, 4, device="sim", requires_grad=True)
    loss = (x @ x).sum()
    with ditorch.sim.faults("mm:unsupported"), torch.autograd.set_multithreading_enabled(multithreading):
        with pytest.raises(SimUnsupportedError, match="aten::mm.default is not supported on this device"):
            loss.backward()
    torch.sim.synchronize()  # nothing left to report
    assert x.grad is None and (x + 1).shape == (4, 4)


@pytest.mark.parametrize(("spec", "words"), [
    ("torch.nn.functional.gelu:nan", ["'torch.nn.functional.gelu' matches no aten op", "not torch functions",
                                      "did you mean 'gelu' (aten::gelu)?"]),
    ("torch.Tensor.add_:inf", ["'torch.Tensor.add_' matches no aten op", "did you mean 'add_'"]),
    ("gleu:noise=1e-3", ["'gleu' matches no aten op; did you mean ", "'gelu'"]),
])
def test_a_fault_pattern_matching_no_aten_op_is_warned_about_with_the_aten_name(spec, words, sim, caplog,
                                                                                  monkeypatch):
    from ditorch.sim import fault_injection

    monkeypatch.setattr(fault_injection, "_checked_patterns", set())
    with caplog.at_level("WARNING", logger="ditorch"), ditorch.sim.faults(spec):
        pass
    (message,) = [r.getMessage() for r in caplog.records if r.name == "ditorch"]
    for word in words:
        assert word in message


@pytest.mark.parametrize(("spec", "call", "words"), [
    ("linear:nan", lambda x: torch.nn.functional.linear(x, x), ["(aten::linear); aten::linear.out only in calls"]),
    ("softmax:nan", lambda x: x.softmax(-1), ["(aten::softmax.int); aten::softmax.int_out only"]),
    ("layer_norm:inf", lambda x: torch.nn.functional.layer_norm(x, (4,)), ["(aten::layer_norm):"]),
    ("einsum:nan", lambda x: torch.einsum("ij,jk->ik", x, x), ["(aten::einsum):"]),  # not its JIT-only sublist form
])
def test_a_fault_on_an_op_pytorch_decomposes_before_the_device_is_warned_about(spec, call, words, sim, caplog,
                                                                              monkeypatch):
    """A composite op (CompositeImplicitAutograd) runs as other aten ops before a device sees it: the fault would
    silently never fire, and a tool's clean verdict would look like a miss."""
    from ditorch.sim import fault_injection

    monkeypatch.setattr(fault_injection, "_checked_patterns", set())
    x = torch.randn(4, 4, device=sim)
    with caplog.at_level("WARNING", logger="ditorch"), ditorch.sim.faults(spec):
        assert torch.isfinite(call(x)).all().item()  # what the warning says: it did not fire
        with torch.inference_mode():  # no autograd key to run the composite: the device gets the op whole
            assert not torch.isfinite(call(x)).all().item()
    (message,) = [r.getMessage() for r in caplog.records if r.name == "ditorch"]
    assert f"spec: {spec.partition(':')[0]!r} matches only ops that PyTorch runs as other aten ops" in message
    assert "fires on them only under torch.inference_mode(); name the ops they run as (torch.profiler" in message
    for word in words:
        assert word in message


def test_fault_patterns_that_match_ops_pass_without_a_word(sim, caplog, monkeypatch):
    from ditorch.sim import fault_injection

    monkeypatch.setattr(fault_injection, "_checked_patterns", set())
    with caplog.at_level("WARNING", logger="ditorch"), ditorch.sim.faults(
            "gelu:nan;aten::mm:noise=1e-3;add.Tensor:inf;(soft|_soft)max:nan;.*@float64:unsupported;(mul|div)_:unversioned;"
            "allreduce:bitflip=1,rank=1"):  # the last: sim's collective (its process group's method)
        pass
    assert not [r for r in caplog.records if r.name == "ditorch"]


def test_a_misspelt_fault_in_the_variable_is_warned_about_when_sim_registers(tmp_path):
    code = ("import logging, sys; logging.basicConfig(stream=sys.stdout, format='%(name)s %(message)s')\n"
            "import ditorch.sim; ditorch.sim.register()\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=child_env({"DITORCH_SIM_FAULTS": "torch.nn.functional.gelu:nan", "DITORCH_QUIET": "1"}))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ditorch DITORCH_SIM_FAULTS: 'torch.nn.functional.gelu' matches no aten op" in done.stdout


def _first_nan_modules(model, run) -> list:
    """The modules whose forward output holds a nan, in the order their forwards finished."""
    found = []

    def record(name):
        def hook(_module, _args, output):
            value = output[0] if isinstance(output, tuple) else output
            if isinstance(value, torch.Tensor) and value.is_floating_point() and torch.isnan(value).any():
                found.append(name)
        return hook

    handles = [m.register_forward_hook(record(name)) for name, m in model.named_modules()]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return found


def test_a_fault_scoped_to_a_module_hits_that_module_only(sim):
    from tiny_models import tiny_llama

    import op_tools

    model = tiny_llama().to(sim)
    ids = torch.randint(0, 128, (2, 16), device=sim)
    with ditorch.sim.faults("silu@model.layers.1:nan"), op_tools.OpOverflowCheck() as check:
        nan_modules = _first_nan_modules(model, lambda: model(input_ids=ids, labels=ids).loss.backward())
    assert nan_modules[0] == "model.layers.1.mlp.act_fn"  # layer 0 ran silu too, and stayed finite
    assert not [name for name in nan_modules if name.startswith("model.layers.0")]
    found = check.first_overflow  # op_tools names the module as the fault's scope did
    assert (found.name, found.phase, found.module) == ("torch.nn.functional.silu", "forward",
                                                       "model.layers.1.mlp.act_fn")
    with ditorch.sim.faults("silu:nan"):
        unscoped = _first_nan_modules(model, lambda: model(input_ids=ids))
    assert unscoped[0] == "model.layers.0.mlp.act_fn"


def test_a_module_scope_matches_whole_path_components(sim):
    from ditorch.sim.module_scope import in_scope

    assert in_scope("model.layers.1", "model.layers.1") and in_scope("model.layers.1.mlp.act_fn", "model.layers.1")
    assert not in_scope("model.layers.10", "model.layers.1") and not in_scope("model.layers.10.mlp", "model.layers.1")
    assert not in_scope("model", "model.layers.1") and not in_scope("", "model.layers.1")

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.SiLU())
                                              for _ in range(11))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    model = Stack().to(sim)
    outputs = {}
    hooks = [layer.register_forward_hook(lambda m, i, o, n=n: outputs.__setitem__(n, o.detach()))
             for n, layer in enumerate(model.layers)]
    x = torch.randn(2, 4, device=sim)
    model(x)
    exact = dict(outputs)
    with ditorch.sim.faults("silu@layers.1:noise=0.5"):
        model(x)
    for hook in hooks:
        hook.remove()
    assert torch.equal(outputs[0].cpu(), exact[0].cpu())
    relative = (outputs[1].cpu() / exact[1].cpu() - 1).abs()  # every element of layers.1's silu off by 50%
    assert torch.allclose(relative, torch.full((2, 4), 0.5), rtol=1e-4)
    # layers.10 ran on what layers.9 handed it, and its own silu was left alone
    assert torch.equal(outputs[10].cpu(), model.layers[10](outputs[9]).cpu())


def test_a_scoped_fault_hits_forward_calls_only(sim):
    layer = torch.nn.Sequential(torch.nn.Linear(4, 4)).to(sim)
    x = torch.randn(3, 4, device=sim)
    with ditorch.sim.faults("mm@0:nan"):  # a Linear's forward is addmm; its weight gradient an mm in backward
        layer(x).sum().backward()
    assert torch.isfinite(layer[0].weight.grad.cpu()).all()
    layer.zero_grad()
    with ditorch.sim.faults("mm:nan"):
        layer(x).sum().backward()
    assert torch.isnan(layer[0].weight.grad.cpu()).all()


def test_a_scoped_fault_hits_the_forward_that_checkpointing_recomputes(sim):
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    from ditorch.sim import module_scope

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear, self.act = torch.nn.Linear(4, 4), torch.nn.SiLU()

        def forward(self, x):
            return self.act(self.linear(x))

    class Checkpointed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(Block() for _ in range(2))

        def forward(self, x):
            for layer in self.layers:
                x = checkpoint(layer, x, use_reentrant=False)
            return x

    model = Checkpointed().to(sim)
    paths, poisoned = [], []  # for each run of layers.1's act: first the forward, then its recomputation
    act = model.layers[1].act
    act.register_forward_pre_hook(lambda *_: paths.append(module_scope.current()))
    act.register_forward_hook(lambda m, i, out: poisoned.append(bool(torch.isinf(out.detach().cpu()).all())))
    model.layers[0].act.register_forward_hook(lambda m, i, out: poisoned.append(bool(torch.isinf(out.cpu()).any())))
    x = torch.randn(3, 4, device=sim, requires_grad=True)
    # early stop off: the recomputation runs each block to its end, so the hook sees the act's output again
    with ditorch.sim.faults("silu@layers.1:inf"), set_checkpoint_early_stop(False):
        model(x).sum().backward()  # recomputed outside any forward, on autograd's thread: named as in the forward
    assert paths == ["layers.1.act", "layers.1.act"]
    # forward: layers.0 clean, layers.1 poisoned; backward recomputes layers.1 (poisoned again), then layers.0
    assert poisoned == [False, True, True, False]


def test_module_tracking_hooks_exist_only_while_a_fault_is_scoped(sim):
    from ditorch.sim import module_scope

    assert not module_scope.tracking()
    with ditorch.sim.faults("silu:nan;mm@float64:unsupported"):
        assert not module_scope.tracking()
        with ditorch.sim.faults("silu@model.layers.1:nan"):
            assert module_scope.tracking() and module_scope.current() == ""
        assert not module_scope.tracking()
    ditorch.sim.inject_fault("silu", "nan", module="model.layers.1")
    assert module_scope.tracking() and [str(f) for f in ditorch.sim.fault_injection.TABLE.current()] == [
        "silu@model.layers.1:nan"]
    ditorch.sim.clear_faults()
    assert not module_scope.tracking()


@pytest.mark.parametrize(("spec", "dtype", "module"), [
    ("mm@float64:unsupported", torch.float64, None),
    ("mm@torch.half:unsupported", torch.float16, None),
    ("silu@model.layers.1:noise=1e-2", None, "model.layers.1"),
    ("silu@model.layers.1@bfloat16:nan", torch.bfloat16, "model.layers.1"),
    ("silu@float16@LlamaForCausalLM:nan", torch.float16, "LlamaForCausalLM"),
])
def test_an_at_part_is_a_dtype_when_it_names_one_else_a_module_path(spec, dtype, module):
    (fault,) = ditorch.sim.parse_faults(spec)
    assert (fault.dtype, fault.module) == (dtype, module)


@pytest.mark.parametrize(("spec", "why"), [
    ("silu@fp16:nan", "unknown dtype 'fp16'"),
    ("silu@flaot16:nan", "unknown dtype 'flaot16'; did you mean 'float16'?"),
    ("silu@float16@half:nan", "names two dtypes"),
    ("silu@model.layers.1@model.layers.2:nan", "names two module paths"),
    ("silu@model..1:nan", "'model..1' is neither a dtype nor a module path"),
    ("add_@model.layers.1:unversioned", "unversioned applies to every call of its ops"),
])
def test_a_malformed_scope_names_the_variable(spec, why):
    with pytest.raises(ValueError) as error:
        ditorch.sim.parse_faults(spec, "DITORCH_SIM_FAULTS")
    message = str(error.value)
    assert message.startswith(f"DITORCH_SIM_FAULTS={spec!r}: ") and why in message


def test_a_scoped_fault_from_the_environment(tmp_path):
    code = ("import torch, ditorch.sim; ditorch.sim.register()\n"
            "model = torch.nn.Sequential(torch.nn.SiLU(), torch.nn.Sequential(torch.nn.SiLU())).to('sim')\n"
            "x = torch.ones(2, device='sim')\n"
            "print(torch.isnan(model[0](x).cpu()).any().item(), torch.isnan(model(x).cpu()).all().item())\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=child_env({"DITORCH_SIM_FAULTS": "silu@1:nan", "DITORCH_QUIET": "1"}))
    assert done.stdout.split() == ["False", "True"], done.stderr[-2000:]


def _mm_calls(sim, calls: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    a, b = torch.randn(8, 16, generator=generator), torch.randn(16, 4, generator=generator)
    return [(a.to(sim) @ b.to(sim)).cpu() for _ in range(calls)]


def test_a_bitflip_flips_one_top_mantissa_bit_of_one_element_every_nth_call(sim):
    clean = _mm_calls(sim, 1)[0]
    with ditorch.sim.faults("mm:bitflip=3"):
        outs = _mm_calls(sim, 9)
    changed = [i for i, out in enumerate(outs) if not torch.equal(out, clean)]
    assert changed == [2, 5, 8]
    for i in changed:
        differs = (outs[i] != clean).nonzero()
        assert len(differs) == 1  # one element
        where = tuple(differs[0].tolist())
        flipped = outs[i][where].view(torch.int32) ^ clean[where].view(torch.int32)
        assert int(flipped) == 1 << 22  # the mantissa's top bit, nothing else


def test_an_intermittent_fault_hits_about_its_fraction_of_calls(sim):
    clean = _mm_calls(sim, 1)[0]
    with ditorch.sim.faults("mm:noise=1e-2,p=0.25"):
        outs = _mm_calls(sim, 200)
    hit = sum(not torch.equal(out, clean) for out in outs)
    assert 30 <= hit <= 70, hit  # 50 expected; the draws come from the faults' private generator
    assert str(ditorch.sim.parse_faults("mm:noise=1e-2,p=0.25,rank=1")[0]) == "mm:noise=0.01,p=0.25,rank=1"


def test_a_fault_kept_to_one_rank_applies_on_that_rank_only(sim, monkeypatch):
    clean = _mm_calls(sim, 1)[0]
    monkeypatch.setenv("RANK", "0")
    with ditorch.sim.faults("mm:nan,rank=1"):
        assert torch.equal(_mm_calls(sim, 1)[0], clean)
    monkeypatch.setenv("RANK", "1")
    with ditorch.sim.faults("mm:nan,rank=1"):
        assert torch.isnan(_mm_calls(sim, 1)[0]).all()


@pytest.mark.usefixtures("sim")
def test_the_same_faults_corrupt_the_same_elements_whatever_ran_before():
    # Each activation of faults starts their draws over: a test's verdict does not depend on which noisy tests ran
    # before it in the process (a backward fault at the edge of detection was missed in one order of the suite).
    x = torch.randn(64, device="sim")

    def noisy():
        with ditorch.sim.faults("mul:noise=1e-2"):
            return (x * 2).cpu()

    first = noisy()
    with ditorch.sim.faults("add:noise=1e-2"):
        for _ in range(3):
            x + 1  # draws of another fault in between
    assert torch.equal(noisy(), first) and not torch.equal(first, (x * 2).cpu())


def test_a_noise_fault_on_a_collective_makes_its_result_off_by_the_noise(sim):
    # the signs were drawn on the CPU and multiplied into the collective's sim tensor: the collective raised
    import torch.distributed as dist

    from ditorch.sim import distributed

    distributed.register()
    dist.init_process_group("simccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        x = torch.full((64,), 2.0, device=sim)
        with ditorch.sim.faults("allreduce:noise=1e-2"):
            dist.all_reduce(x)
    finally:
        dist.destroy_process_group()
    off = (x.cpu() / 2 - 1).abs()
    assert torch.allclose(off, torch.full((64,), 1e-2))


def test_a_slow_fault_on_a_collective_makes_it_complete_late_with_its_output_fault_applied_then(sim):
    # a slow link: async_op=True returns at once, and what the caller reads before waiting is not what arrives
    import time

    import torch.distributed as dist

    from ditorch.sim import distributed

    distributed.register()
    dist.init_process_group("simccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        x = torch.ones(64, device=sim)
        with ditorch.sim.faults("allreduce:slow=300;allreduce:nan"):
            begun = time.perf_counter()
            work = dist.all_reduce(x, async_op=True)
            returned = time.perf_counter() - begun
            before = work.is_completed(), bool(x.isnan().any())
            work.wait()
            waited = time.perf_counter() - begun
    finally:
        dist.destroy_process_group()
    assert returned < 0.2 and waited > 0.29 and before == (False, False)
    assert work.is_completed() and bool(x.isnan().all())
