"""The sim device's own kernels: ops it computes itself instead of running the CPU's kernel.

``run_op`` runs ``KERNELS.get(op, op)`` on the CPU tensors behind the sim tensors. An entry is a
function with the op's signature, written with torch ops on CPU tensors: the fused RNN cells
(the CPU has no kernel for them, a device must), the chunked attention, and while a TF32 switch
is on the matmuls and convolutions that round their float32 operands first. Injected faults,
device checks and errors raised in backward apply to these kernels as to any other.

>>> @device_kernel("_thnn_fused_gru_cell")          # doctest: +SKIP
... def fused_gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None): ...
"""

from __future__ import annotations

import torch

KERNELS: dict = {}  # OpOverload -> function run instead of the op's CPU kernel
REGISTERED_PER_OP: list = []  # overloads with a fixed kernel: also registered on PrivateUse1 itself


def overload(name: str):
    """``"mm"`` -> ``aten.mm.default``, ``"add.out"`` -> ``aten.add.out``."""
    packet, _, overload_name = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload_name or "default")


def device_kernel(*names: str):
    """Make the decorated function the sim device's kernel for the aten overloads ``names``."""

    def register(fn):
        for name in names:
            op = overload(name)
            KERNELS[op] = fn
            REGISTERED_PER_OP.append(op)
        return fn

    return register


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a CUDA kernel computes in for ``dtype`` (``acc_type<T, is_cuda=true>``)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
