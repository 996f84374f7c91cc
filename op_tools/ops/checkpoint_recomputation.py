"""Whether a call is a checkpoint's recomputation: ``torch.utils.checkpoint`` running a forward again inside backward.

A call made while backward runs (``torch._C._current_graph_task_id() != -1``) is either such a recomputation (a
second run of a forward call, which a recording keeps apart) or a call of its own that backward makes: DDP's
gradient all-reduce from its communication hook, FSDP's collectives, a tensor hook's ops. Only the first is a
recomputation. It runs below a frame of ``torch/utils/checkpoint.py`` (the non-reentrant checkpoint's unpack hook,
the reentrant one's ``CheckpointFunction.backward``), or under ``core/recomputation.checkpoint_context_fn``, which
marks the thread (``recomputing``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import types

import torch

_CHECKPOINT_FILE = os.path.join(os.path.dirname(torch.utils.__file__), "checkpoint.py")
_state = threading.local()


@contextlib.contextmanager
def recomputing():
    """Mark this thread as running a checkpoint's recomputation for the block."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def in_recomputation() -> bool:
    """Whether the call being made runs a checkpoint's forward again: only while backward runs, then marked or below
    a frame of ``torch.utils.checkpoint`` (a walk up this thread's stack: only for calls made in backward)."""
    if torch._C._current_graph_task_id() == -1:
        return False
    if getattr(_state, "depth", 0):
        return True
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename == _CHECKPOINT_FILE:
            return True
        frame = frame.f_back
    return False
