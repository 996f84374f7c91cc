"""OpObserve: print each handled call's arguments and results; save nothing."""

from __future__ import annotations

from . import reporting
from .engine import OpCall, OpTool, feature


@feature("dump_op_args")
class OpObserve(OpTool):
    """Print a table of every handled call's inputs and outputs.

    >>> import op_tools, torch
    >>> with op_tools.OpObserve():
    ...     y = torch.ones(2, device="sim") + 1      # prints `apply OpObserveHook on torch.Tensor.add` and a table
    """

    hook_name = "OpObserveHook"
    env_prefix = "OP_OBSERVE"

    def after(self, call: OpCall) -> None:
        if self.common.verbose:
            rows = reporting.call_rows(call.name, call.args, call.kwargs, call.result)
            reporting.console(reporting.header(call.name, call.forward_id, call.location) + "\n"
                              + reporting.table(rows, reporting.ARG_COLUMNS).get_string())
