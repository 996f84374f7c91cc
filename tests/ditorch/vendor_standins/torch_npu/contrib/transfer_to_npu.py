"""STAND-IN for torch_npu.contrib.transfer_to_npu: the real one rewrites cuda to npu on import;
this one only maps torch.cuda.is_available and torch.cuda.CUDAGraph (the real one's NPUGraph) and records that
it ran."""

import torch

torch.cuda.is_available = torch.npu.is_available
torch.cuda.CUDAGraph = torch.npu.NPUGraph  # as every transfer_to_npu from v2.1.0 to master does
APPLIED = True
