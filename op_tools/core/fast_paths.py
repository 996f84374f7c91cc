"""PyTorch's fused inference paths, taken under a tool as without it.

In evaluation (eval mode, no grad), ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` run one fused kernel
(``torch._native_multi_head_attention``, ``torch._transformer_encoder_layer_fwd``) unless
``torch.overrides.has_torch_function(tensor_args)``, which any TorchFunctionMode on the stack makes True. Under a
tool's mode they took the unfused path: other numbers than the run without the tool, and the fused kernel that run
uses was never handled (a fault in it passed as clean). While a tool's mode is pushed, ``torch.overrides.
has_torch_function`` answers those forwards as if the tools' modes were not on the stack; a user's own mode, or an
argument with its own ``__torch_function__``, still refuses the fast path as without the tools. Every other caller
(``HigherOrderOperator.__call__``, ``torch.sym_*``) gets torch's own answer.

``nn.TransformerEncoder``'s own check (its nested-tensor path) is left as it is: the tools do not read nested tensors.
"""

from __future__ import annotations

import sys

import torch
from torch.overrides import _get_current_function_mode_stack, _pop_mode, _push_mode

from .shared_install import SharedInstall

# The modes the tools push (engine._ToolMode), set by the engine: the modes left out of the answer.
TOOL_MODES: tuple[type, ...] = ()

_original = torch.overrides.has_torch_function


def _fast_path_checks() -> frozenset:
    """The code of the forwards whose fast path asks ``torch.overrides.has_torch_function``."""
    return frozenset(forward.__code__ for forward in (torch.nn.MultiheadAttention.forward,
                                                      torch.nn.TransformerEncoderLayer.forward))


_checks: frozenset = frozenset()


def has_torch_function(args) -> bool:
    """``torch.overrides.has_torch_function`` while a tool's mode is pushed (see the module's docstring)."""
    if sys._getframe(1).f_code not in _checks:
        return _original(args)
    stack = _get_current_function_mode_stack()
    if not stack or not all(isinstance(mode, TOOL_MODES) for mode in stack):
        return _original(args)  # a user's mode would see the fused call's parts: the fast path stays refused
    popped = [_pop_mode() for _ in stack]
    try:
        return _original(args)
    finally:
        for mode in reversed(popped):
            _push_mode(mode)


def _install() -> None:
    global _checks
    if torch.overrides.has_torch_function is not _original:  # another's patch in place: left as it is (the fast
        return  # path then stays refused under a tool, as before this module), never replaced nor lost
    _checks = _fast_path_checks()
    torch.overrides.has_torch_function = has_torch_function


def _remove() -> None:
    if torch.overrides.has_torch_function is has_torch_function:  # not what another patched over it since
        torch.overrides.has_torch_function = _original


# While a tool's mode is pushed.
_answering = SharedInstall(_install, _remove)
acquire, release = _answering.acquire, _answering.release
