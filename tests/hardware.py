"""What hardware the tests run on, asked so that ditorch's own patches cannot change the answer."""

from __future__ import annotations

import functools


@functools.cache
def cuda_gpu_present() -> bool:
    """A CUDA (or ROCm) GPU is visible to this build of torch. Asked of torch's C API, not of ``torch.cuda``,
    which ditorch's transfer may have mapped onto another device by the time a test runs."""
    import torch

    return bool(torch.backends.cuda.is_built() and torch._C._cuda_getDeviceCount() > 0)


# Hides every GPU from a child process, for a test whose premise is a machine without an accelerator.
NO_GPU = {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": ""}
