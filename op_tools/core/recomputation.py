"""``torch.utils.checkpoint(..., use_reentrant=False)`` under the tools: its recomputation in backward handled as its
forward was.

The checkpoint runs its forward again inside ``backward()``, where no tool's mode is on the stack (PyTorch takes a
``__torch_function__`` mode off the stack while it handles the ``backward`` call itself, pytorch/pytorch#147995). A
tool that changes what the forward saves for backward (OpFallback saves the CPU's tensors) then fails the checkpoint's
check of the recomputed tensors. PyTorch's way in is the checkpoint's ``context_fn``: its second context wraps the
recomputation.
"""

from __future__ import annotations

import contextlib

from ..ops.checkpoint_recomputation import recomputing
from . import gradient_communication


def checkpoint_context_fn() -> tuple:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: the recomputation in backward
    runs under the tools started then, as the forward did under them.

    >>> with op_tools.OpFallback():
    ...     y = checkpoint(block, x, use_reentrant=False, context_fn=op_tools.checkpoint_context_fn)
    ...     y.sum().backward()
    """
    return contextlib.nullcontext(), _under_started_tools()


@contextlib.contextmanager
def _under_started_tools():
    # The modes are looked up when the recomputation starts (on autograd's thread, with none on its stack).
    with recomputing(), gradient_communication.entered(gradient_communication.modes_to_enter() or []):
        yield
