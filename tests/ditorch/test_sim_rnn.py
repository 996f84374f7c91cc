"""nn.LSTM and nn.GRU run on sim through its fused cell kernels, as on a GPU, and train like the CPU.

On a device PyTorch's RNN code calls the fused cells (``_thnn_fused_lstm_cell``, ``_thnn_fused_gru_cell``
and their backward ops), which compute each gate's pre-activation as
``((input_gates + hidden_gates) + input_bias) + hidden_bias`` (RNN.cu's order); the CPU's own path sums
the biases inside the gate matmuls (oneDNN for LSTM). The two therefore differ by float32 rounding only:
measured here, identical losses (to the last printed bit) and gradients within 4e-7 of the largest
gradient, i.e. a few units in the last place. The tolerance below is 1e-5 of the largest gradient (about
80 ulp): tight enough that any wrong gate order, bias or workspace layout (errors of order 1e-1) fails.
"""

import pytest
import torch

import ditorch.sim

pytestmark = pytest.mark.usefixtures("sim")

VOCAB = 64


class RecurrentLM(torch.nn.Module):
    def __init__(self, cell, dim=16, hidden=32):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, dim)
        self.rnn = cell(dim, hidden, num_layers=2, batch_first=True)
        self.head = torch.nn.Linear(hidden, VOCAB)

    def forward(self, ids):
        return self.head(self.rnn(self.embed(ids))[0])


def train(cell, device, steps=3):
    """Losses and per-step gradients of a 2-layer recurrent language model trained with SGD."""
    torch.manual_seed(0)
    model = RecurrentLM(cell)
    ids = torch.randint(0, VOCAB, (4, 12))
    model.to(device)
    ids = ids.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, grads = [], []
    for _ in range(steps):
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        loss.backward()
        grads.append({name: p.grad.cpu().clone() for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, grads


def assert_gradients_close(actual, expected, relative=1e-5):
    for name, grad in expected.items():
        scale = grad.abs().max().item()
        assert (actual[name] - grad).abs().max().item() <= relative * scale, name


@pytest.mark.parametrize("cell", [torch.nn.LSTM, torch.nn.GRU])
def test_recurrent_language_model_trains_on_sim_as_on_the_cpu(cell):
    sim_losses, sim_grads = train(cell, "sim")
    cpu_losses, cpu_grads = train(cell, "cpu")
    assert sim_losses == pytest.approx(cpu_losses, rel=1e-6)
    assert sim_losses[-1] < sim_losses[0]
    for sim_step, cpu_step in zip(sim_grads, cpu_grads):
        assert_gradients_close(sim_step, cpu_step)


@pytest.mark.parametrize("cell", [torch.nn.LSTM, torch.nn.GRU])
@pytest.mark.parametrize("options", [
    {"num_layers": 2, "bidirectional": True, "batch_first": True},
    {"bias": False},
])
def test_rnn_forward_and_backward_match_the_cpu(cell, options):
    torch.manual_seed(0)
    module = cell(4, 5, **options)
    x = torch.randn(2, 3, 4)
    expected, _ = module(x)
    expected.pow(2).sum().backward()
    expected_grads = {name: p.grad.clone() for name, p in module.named_parameters()}
    module.zero_grad()
    module.to("sim")
    x_sim = x.to("sim").requires_grad_()
    out, _ = module(x_sim)
    out.pow(2).sum().backward()
    torch.testing.assert_close(out.detach().cpu(), expected.detach(), rtol=1e-5, atol=1e-6)
    assert_gradients_close({name: p.grad.cpu() for name, p in module.named_parameters()}, expected_grads)
    assert x_sim.grad is not None and x_sim.grad.device.type == "sim"


@pytest.mark.parametrize("cell, fused", [(torch.nn.LSTMCell, "_thnn_fused_lstm_cell"),
                                         (torch.nn.GRUCell, "_thnn_fused_gru_cell")])
def test_rnn_cells_run_through_the_fused_kernels(cell, fused):
    torch.manual_seed(0)
    module = cell(4, 5)
    x = torch.randn(3, 4)
    expected = module(x)
    expected = expected[0] if isinstance(expected, tuple) else expected
    module.to("sim")
    out = module(x.to("sim"))
    out = out[0] if isinstance(out, tuple) else out
    torch.testing.assert_close(out.detach().cpu(), expected.detach(), rtol=1e-5, atol=1e-6)
    out.sum().backward()
    assert module.weight_ih.grad.device.type == "sim"
    with ditorch.sim.faults(f"{fused}:unsupported"):  # proves the device's kernel is what ran
        with pytest.raises(RuntimeError, match=f"aten::{fused}.default is not supported"):
            module(x.to("sim"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_rnn_accumulates_in_float32(dtype):
    # The fused cells compute in float32 for float16/bfloat16 inputs: close to a float32 run.
    torch.manual_seed(0)
    module = torch.nn.LSTM(8, 16)
    x = torch.randn(5, 2, 8)
    with torch.no_grad():  # a graph holding the parameters would stop Module.to from swapping them
        expected, _ = module(x)
    module.to("sim", dtype)
    out, _ = module(x.to("sim", dtype))
    assert out.dtype == dtype
    torch.testing.assert_close(out.float().cpu(), expected, rtol=0, atol=4 * torch.finfo(dtype).eps)
    out.float().sum().backward()
    assert module.weight_hh_l0.grad.dtype == dtype and torch.isfinite(module.weight_hh_l0.grad.cpu()).all()
