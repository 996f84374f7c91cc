"""Real models train on the sim device with exactly the CPU's numbers."""

import pytest
import torch
from tiny_models import tiny_gpt2, train_llama, train_mlp


def test_mlp_losses_equal_cpu_step_by_step(sim):
    assert train_mlp(sim, steps=5) == train_mlp("cpu", steps=5)


def test_tiny_llama_losses_equal_cpu_step_by_step(sim):
    on_sim = train_llama(sim, steps=3)
    assert on_sim == train_llama("cpu", steps=3)
    assert on_sim[-1] < on_sim[0]


def test_tiny_gpt2_with_tied_embeddings_equals_cpu(sim):
    # PyTorch picks scaled_dot_product_attention's math kernel on a PrivateUse1 device and a fused
    # one on the CPU; with the CPU held to the same kernel the runs agree bit for bit.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    on_sim = train_llama(sim, steps=3, model_factory=tiny_gpt2)
    with sdpa_kernel(SDPBackend.MATH):
        assert on_sim == train_llama("cpu", steps=3, model_factory=tiny_gpt2)


@pytest.mark.usefixtures("sim")
def test_moving_a_module_keeps_tied_parameters_tied():
    model = tiny_gpt2()
    weight = model.transformer.wte.weight
    model.to("sim")
    assert model.lm_head.weight is model.transformer.wte.weight is weight  # moved in place, as for CUDA
    assert isinstance(weight, torch.nn.Parameter) and weight.device.type == "sim"


@pytest.mark.usefixtures("sim")
def test_autocast_follows_the_cuda_policy():
    linear = torch.nn.Linear(8, 8).to("sim")
    x = torch.randn(4, 8, device="sim")
    for dtype in (torch.bfloat16, torch.float16):
        with torch.autocast("sim", dtype=dtype):
            y = linear(x)
            assert y.dtype == dtype  # matmul-like: low precision
            assert torch.softmax(y, -1).dtype == torch.float32  # numerically sensitive: float32
            assert torch.nn.functional.layer_norm(y, (8,)).dtype == torch.float32
            assert (y + 1).dtype == dtype  # everything else: unchanged
            assert torch.cat([y, x]).dtype == torch.float32  # several inputs: the widest
        y.float().sum().backward()
        assert linear.weight.grad.dtype == torch.float32  # casts are differentiable
        linear.weight.grad = None
    with torch.autocast("sim", dtype=torch.bfloat16, enabled=False):
        assert linear(x).dtype == torch.float32


@pytest.mark.usefixtures("sim")
def test_grad_scaler_and_optimizers_run_on_sim():
    model = torch.nn.Linear(4, 1).to("sim")
    scaler = torch.amp.GradScaler("sim")
    for optimizer_class in (torch.optim.AdamW, torch.optim.SGD, torch.optim.Adam):
        optimizer = optimizer_class(model.parameters(), lr=0.1)
        with torch.autocast("sim", dtype=torch.float16):
            loss = model(torch.randn(3, 4, device="sim")).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    assert scaler.get_scale() > 0
    assert all(p.device.type == "sim" for p in model.parameters())
