"""op_tools: operator-level debugging tools for PyTorch on any device.

Each tool is a context manager (or ``start()``/``stop()``) over one engine that intercepts torch
calls whose arguments are on a non-CPU device::

    import op_tools
    with op_tools.OpCapture():        # OpObserve, OpOverflowCheck, OpFallback, OpDtypeCast
        train_step()

Settings are keyword arguments, environment variables or a TOML file (``OP_TOOLS_CONFIG``), in that
order of precedence: ``op_tools.OpCapture(ops=["torch.nn.functional.linear"], mode="summary")``. An unchanged
script runs under a tool with ``python -m op_tools capture train.py``.

``op_tools`` does not import ``ditorch``: it works with plain PyTorch on CUDA or any backend.
"""

from .config.training_monitor import TrainingMonitorConfig  # its variables' keywords and the [monitor] section
from .config.variables import VARIABLES
from .core.engine import FEATURES, OpCall, OpTool, OpToolsAbortError, feature, register_backward_hooks, tool_work
from .core.features import apply_feature, remove_feature
from .core.recomputation import checkpoint_context_fn
from .numerics.comparison import ToleranceSpec, compare_outputs
from .ops.op_facts import register_op_facts
from .output.capture_format import load_op_args
from .tools.autocompare import OpAutoCompare
from .tools.capture import OpCapture
from .tools.dtype_cast import OpDtypeCast
from .tools.fallback import OpFallback
from .tools.observe import OpObserve
from .tools.overflow_check import OpOverflowCheck, OverflowDetectedError
from .tools.self_check import OpSelfCheck
from .tools.time_measure import OpTimeMeasure
from .tools.training_monitor import TrainingMonitor

__all__ = [
    "FEATURES", "VARIABLES", "OpAutoCompare",
    "OpCall", "OpCapture", "OpDtypeCast", "OpFallback", "OpObserve", "OpOverflowCheck", "OpSelfCheck",
    "OpTimeMeasure", "OpTool", "OpToolsAbortError", "OverflowDetectedError", "apply_feature", "feature", "load_op_args",
    "register_backward_hooks", "register_op_facts", "remove_feature", "tool_work", "ToleranceSpec",
    "checkpoint_context_fn",
    "compare_outputs", "TrainingMonitor", "TrainingMonitorConfig",
]
