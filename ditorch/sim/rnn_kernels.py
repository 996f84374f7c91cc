"""The fused LSTM and GRU cells, as a device computes them.

On a device (CUDA, XPU, PrivateUse1) PyTorch's ``nn.LSTM``/``nn.GRU``/``LSTMCell``/``GRUCell``
(aten/src/ATen/native/RNN.cpp) hand the gate matmuls' results to fused cell kernels that have no
CPU kernel. These compute what aten/src/ATen/native/cuda/RNN.cu computes, element for element and
in its order of operations, with torch ops on the host: the gate pre-activation is
``((input_gates + hidden_gates) + input_bias) + hidden_bias`` in the accumulate type (float32 for
float16/bfloat16), LSTM gates in the order input, forget, cell, output and GRU gates in the order
reset, update, new. The workspace each forward saves for its backward has CUDA's layout:

- LSTM: ``(batch, 4*hidden)``, the activated gates ``[i, f, c, o]``;
- GRU: ``(batch, 5*hidden)``, ``[r, z, n, hx, hidden_gates_n + hidden_bias_n]``.

The CPU's own RNN path is unfused (``linear_hh(hx) + linear_ih(input)`` with the biases inside
the matmuls, then ``chunk``), so a sim run differs from a CPU run in the last bits, as a GPU run
does.
"""

from __future__ import annotations

import torch

from .kernels import accumulate_dtype, device_kernel


def _check_sizes(name: str, input_gates, hidden_gates, input_bias, hidden_bias, factor: int, prev) -> None:
    # The checks of RNN.cu's checkSizes, worded as PyTorch's TensorArg checks are.
    if input_gates.dim() != 2:
        raise RuntimeError(f"{name}: expected input_gates to be 2-dimensional, got {input_gates.dim()}")
    if input_gates.shape != hidden_gates.shape:
        raise RuntimeError(f"{name}: input_gates {tuple(input_gates.shape)} and hidden_gates "
                           f"{tuple(hidden_gates.shape)} differ in size")
    gates_size = input_gates.size(1)
    for bias in (input_bias, hidden_bias):
        if bias is not None and (bias.dim() != 1 or bias.numel() != gates_size):
            raise RuntimeError(f"{name}: expected a bias of {gates_size} elements, got {tuple(bias.shape)}")
    if prev.dim() != 2 or prev.numel() != input_gates.size(0) * gates_size // factor:
        raise RuntimeError(f"{name}: the previous state {tuple(prev.shape)} does not match gates "
                           f"{tuple(input_gates.shape)}")


def _pre_activations(input_gates, hidden_gates, input_bias, hidden_bias, acc):
    """``((input + hidden) + input_bias) + hidden_bias`` in the accumulate type, as RNN.cu sums."""
    gates = input_gates.to(acc) + hidden_gates.to(acc)
    if input_bias is not None:
        gates = gates + input_bias.to(acc)
    if hidden_bias is not None:
        gates = gates + hidden_bias.to(acc)
    return gates


@device_kernel("_thnn_fused_lstm_cell")
def fused_lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    """``(hy, cy, workspace)`` of one LSTM step."""
    _check_sizes("_thnn_fused_lstm_cell", input_gates, hidden_gates, input_bias, hidden_bias, 4, cx)
    dtype, acc = input_gates.dtype, accumulate_dtype(input_gates.dtype)
    i, f, c, o = _pre_activations(input_gates, hidden_gates, input_bias, hidden_bias, acc).chunk(4, 1)
    i, f, c, o = i.sigmoid(), f.sigmoid(), c.tanh(), o.sigmoid()
    cy = f * cx.to(acc) + i * c
    hy = o * cy.tanh()
    workspace = torch.cat([i, f, c, o], 1).to(dtype)
    return hy.to(dtype).contiguous(), cy.to(dtype).contiguous(), workspace


@device_kernel("_thnn_fused_lstm_cell_backward_impl")
def fused_lstm_cell_backward(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    """``(grad_gates, grad_cx, grad_bias)``; ``grad_gates`` is the gradient of both gate inputs."""
    if grad_hy is None and grad_cy is None:
        return None, None, None
    dtype, acc = workspace.dtype, accumulate_dtype(workspace.dtype)
    i, f, c, o = (gate.to(acc) for gate in workspace.chunk(4, 1))
    go = grad_hy.to(acc) if grad_hy is not None else 0.0
    goc = grad_cy.to(acc) if grad_cy is not None else 0.0
    tanh_cy = cy.to(acc).tanh()
    grad_o = go * tanh_cy
    grad_c_total = go * o * (1 - tanh_cy * tanh_cy) + goc
    grad_i = grad_c_total * c
    grad_f = grad_c_total * cx.to(acc)
    grad_c = grad_c_total * i
    grad_cx = grad_c_total * f
    grad_i = grad_i * (1 - i) * i
    grad_f = grad_f * (1 - f) * f
    grad_c = grad_c * (1 - c * c)
    grad_o = grad_o * (1 - o) * o
    grad_gates = torch.cat([grad_i, grad_f, grad_c, grad_o], 1).to(dtype)
    grad_bias = grad_gates.sum(0) if has_bias else None
    return grad_gates, grad_cx.to(dtype).contiguous(), grad_bias


@device_kernel("_thnn_fused_gru_cell")
def fused_gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    """``(hy, workspace)`` of one GRU step."""
    _check_sizes("_thnn_fused_gru_cell", input_gates, hidden_gates, input_bias, hidden_bias, 3, hx)
    dtype, acc = input_gates.dtype, accumulate_dtype(input_gates.dtype)
    input_r, input_z, input_n = input_gates.to(acc).chunk(3, 1)
    hidden_r, hidden_z, hidden_n = hidden_gates.to(acc).chunk(3, 1)
    bias_i = input_bias.to(acc).chunk(3) if input_bias is not None else (None, None, None)
    bias_h = hidden_bias.to(acc).chunk(3) if hidden_bias is not None else (None, None, None)
    r = _pre_activations(input_r, hidden_r, bias_i[0], bias_h[0], acc).sigmoid()
    z = _pre_activations(input_z, hidden_z, bias_i[1], bias_h[1], acc).sigmoid()
    hidden_n = hidden_n + bias_h[2] if bias_h[2] is not None else hidden_n
    n = input_n + bias_i[2] if bias_i[2] is not None else input_n
    n = (n + r * hidden_n).tanh()
    hy = n + z * (hx.to(acc) - n)
    workspace = torch.cat([r.to(dtype), z.to(dtype), n.to(dtype), hx, hidden_n.to(dtype)], 1)
    return hy.to(dtype).contiguous(), workspace


@device_kernel("_thnn_fused_gru_cell_backward")
def fused_gru_cell_backward(grad_hy, workspace, has_bias):
    """``(grad_input_gates, grad_hidden_gates, grad_hx, grad_input_bias, grad_hidden_bias)``."""
    if grad_hy.dim() != 2 or workspace.shape != (grad_hy.size(0), grad_hy.size(1) * 5):
        raise RuntimeError(f"_thnn_fused_gru_cell_backward: workspace {tuple(workspace.shape)} does not "
                           f"match grad_hy {tuple(grad_hy.shape)}")
    dtype, acc = grad_hy.dtype, accumulate_dtype(grad_hy.dtype)
    r, z, n, hx, hidden_n = (part.to(acc) for part in workspace.chunk(5, 1))
    go = grad_hy.to(acc)
    grad_z = go * (hx - n) * (1 - z) * z
    grad_hx = go * z
    grad_n = go * (1 - z) * (1 - n * n)
    grad_hidden_n = grad_n * r
    grad_r = grad_n * hidden_n * (1 - r) * r
    grad_input_gates = torch.cat([grad_r, grad_z, grad_n], 1).to(dtype)
    grad_hidden_gates = torch.cat([grad_r, grad_z, grad_hidden_n], 1).to(dtype)
    if not has_bias:
        return grad_input_gates, grad_hidden_gates, grad_hx.to(dtype).contiguous(), None, None
    return (grad_input_gates, grad_hidden_gates, grad_hx.to(dtype).contiguous(),
            grad_input_gates.sum(0), grad_hidden_gates.sum(0))
