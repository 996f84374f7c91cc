"""``torch.autocast("sim")``: CUDA's autocast policy, as kernels on the AutocastPrivateUse1 key.

Matmul-like ops run in the autocast dtype, numerically sensitive ones in float32, and ops taking
several tensors in their widest type; every other op passes through unchanged.
"""

from __future__ import annotations

import torch
from torch._C import DispatchKey, DispatchKeySet

from ..show_as_cuda import real_device as _real_device

# Op names per policy, as CUDA's autocast lists them (aten/src/ATen/autocast_mode.cpp).
LOWER_PRECISION = (
    "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "convolution", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv",
    "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
)
FLOAT32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
    "rsqrt", "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm", "group_norm",
    "frobenius_norm", "nuclear_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss",
    "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss",
    "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm",
    "logsumexp", "prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "sum", "norm", "rms_norm",
)
WIDEST = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sampler", "index_put",
    "scatter_add", "tensordot", "cat", "stack", "index_copy",
)

_KEY = "AutocastPrivateUse1"
_EXCLUDE = DispatchKeySet(DispatchKey.AutocastPrivateUse1)  # type: ignore[attr-defined]  # missing from torch's stub


def _eligible(x, device_type: str) -> bool:
    return (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64
            and _real_device(x).type == device_type)


def _cast(x, dtype: torch.dtype, device_type: str):
    if _eligible(x, device_type):
        return x if x.dtype == dtype else x.to(dtype)
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(v, dtype, device_type) for v in x)
    return x


def _widest(args, device_type: str):
    widest = None
    for x in args:
        for t in (x if isinstance(x, (list, tuple)) else (x,)):
            if _eligible(t, device_type):
                widest = t.dtype if widest is None else torch.promote_types(widest, t.dtype)
    return widest


def _kernel(op, policy: str, device_type: str):
    def kernel(*args, **kwargs):
        if policy == "lower":
            dtype = torch.get_autocast_dtype(device_type)
        elif policy == "float32":
            dtype = torch.float32
        else:
            dtype = _widest(args, device_type)
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            if dtype is not None:
                args = _cast(args, dtype, device_type)
                kwargs = {k: _cast(v, dtype, device_type) for k, v in kwargs.items()}
            return op(*args, **kwargs)

    return kernel


def register(device_type: str) -> list[torch.library.Library]:
    """Register the policy kernels and pass every other op through; keep the returned libraries alive."""
    passthrough = torch.library.Library("_", "IMPL")
    passthrough.fallback(torch.library.fallthrough_kernel, _KEY)
    lib = torch.library.Library("aten", "IMPL")
    for policy, names in (("lower", LOWER_PRECISION), ("float32", FLOAT32), ("widest", WIDEST)):
        for name in names:
            packet = getattr(torch.ops.aten, name, None)
            if packet is None:
                continue
            for overload in packet.overloads():
                op = getattr(packet, overload)
                if any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments):
                    continue  # out= and in-place variants keep the dtype they were given
                qualified = name if overload == "default" else f"{name}.{overload}"
                lib.impl(qualified, _kernel(op, policy, device_type), _KEY)
    return [passthrough, lib]
