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


def sim_missing() -> str | None:
    """Why the sim device cannot run under this torch (it needs the Python PrivateUse1 hooks of 2.10), or None: the
    skip reason of the tests that need it, asked without importing ``ditorch.sim`` (which refuses to import)."""
    import torch

    if torch.torch_version.TorchVersion(torch.__version__) < "2.10":
        return f"needs the sim device: ditorch.sim needs PyTorch >= 2.10; this is torch {torch.__version__}"
    return None
