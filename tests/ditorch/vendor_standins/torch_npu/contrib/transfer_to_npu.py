"""STAND-IN for torch_npu.contrib.transfer_to_npu: the real one rewrites cuda to npu on import;
this one only maps torch.cuda.is_available and records that it ran."""

import torch

torch.cuda.is_available = torch.npu.is_available
APPLIED = True
