"""Optimizers and ``clip_grad_norm_`` take the foreach path on sim, as they do on CUDA.

``torch.optim`` (``_default_to_fused_or_foreach``) and ``torch.nn.utils.clip_grad_norm_``
(``torch.utils._foreach_utils._has_foreach_support``) choose the foreach kernels only for tensors
whose exact ``type`` is listed in their ``_foreach_supported_types``; a sim tensor is a
``SimTensor``, so without this they would take the per-tensor path that CUDA never takes. Listing
the class is what PyTorch itself does for DTensor; ``uninstall`` takes it out again.
"""

from __future__ import annotations

import importlib

from .tensor import SimTensor

# torch.optim deletes its `optimizer` attribute; the module itself is still importable by name.
_LISTS = tuple(importlib.import_module(module)._foreach_supported_types
               for module in ("torch.optim.optimizer", "torch.utils._foreach_utils"))


def install() -> None:
    for types in _LISTS:
        if SimTensor not in types:
            types.append(SimTensor)


def uninstall() -> None:
    for types in _LISTS:
        while SimTensor in types:
            types.remove(SimTensor)


def installed() -> bool:
    return all(SimTensor in types for types in _LISTS)
