"""Native CUDA or ROCm: torch already speaks CUDA, so there is nothing to patch."""

from __future__ import annotations

import sys

import torch

from ..backends import Backend


def load() -> Backend:
    arch = "rocm" if torch.version.hip else "cuda"
    return Backend("cuda", "cuda", arch, torch, "nccl", torch.cuda, sys.modules[__name__])


def activate(backend, config, patches, forced: bool) -> None:
    """Nothing to do: CUDA idioms already address this device."""
