"""Composite ops that PyTorch runs one way for a device's plain tensors and another for a tensor subclass.

A sim tensor is a tensor subclass (``SimTensor``), so a composite op that checks ``areAnyTensorSubclassLike`` takes
its "composite compliant" path on sim, where a CUDA tensor takes the fast one: a script that runs on CUDA can then
fail on sim alone. Each kernel here, registered on ``AutogradPrivateUse1`` (above the composite), runs the op as
PyTorch runs it for a plain device tensor. While torch.compile traces (fake tensors: no values to read) the
composite runs as it would.

- ``ctc_loss`` with lengths as tensors: CUDA's path reads the lengths on the host (a synchronisation where they are
  on the device) and divides by them on the device for ``reduction="mean"``; the composite path divides the loss on
  the device by the lengths where they are, and a device refuses a CPU tensor there.
"""

from __future__ import annotations

import torch

from .tensor import _tracing

_MEAN = 1  # at::Reduction::Mean


def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, reduction=_MEAN, zero_infinity=False):
    """``aten::ctc_loss.Tensor`` as PyTorch runs it for plain tensors: the lengths as host lists."""
    aten = torch.ops.aten
    if _tracing():
        return aten.ctc_loss.Tensor.decompose(log_probs, targets, input_lengths, target_lengths, blank, reduction,
                                              zero_infinity)
    # PyTorch's own checks, in its words (LossCTC.cpp)
    if input_lengths.is_floating_point() or input_lengths.is_complex() or input_lengths.dtype == torch.bool:
        raise RuntimeError("input_lengths must be integral")
    if target_lengths.is_floating_point() or target_lengths.is_complex() or target_lengths.dtype == torch.bool:
        raise RuntimeError("target_lengths must be integral")
    lengths = [t.to("cpu", torch.long).contiguous().tolist() for t in (input_lengths, target_lengths)]
    return aten.ctc_loss.IntList(log_probs, targets, *lengths, blank, reduction, zero_infinity)


KERNELS = {"ctc_loss.Tensor": ctc_loss}


def register() -> torch.library.Library:
    """The kernels above on ``AutogradPrivateUse1``; the library, which must be kept alive."""
    library = torch.library.Library("aten", "IMPL")
    for name, kernel in KERNELS.items():
        library.impl(name, kernel, "AutogradPrivateUse1")
    return library
