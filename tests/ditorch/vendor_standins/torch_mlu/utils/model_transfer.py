"""STAND-IN for torch_mlu.utils.model_transfer: records that it ran."""

APPLIED = True
