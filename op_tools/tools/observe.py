"""OpObserve: show each handled call's arguments and results (DEBUG: ``OP_TOOLS_VERBOSE=1``); save nothing."""

from __future__ import annotations

import logging

from ..core.engine import OpCall, OpTool, feature
from ..output import reporting


@feature("dump_op_args")
class OpObserve(OpTool):
    """Print a table of every handled call's inputs and outputs.

    Keyword arguments (each overrides its variable): ``ops``, ``disable`` (``OP_OBSERVE_LIST``/``_DISABLE_LIST``:
    lists of op names, patterns or functions), and ``results_dir``, ``verbose``, ``print_stack``, ``strict``,
    ``print_ranks`` as every tool.

    >>> import op_tools, torch
    >>> with op_tools.OpObserve():
    ...     y = torch.ones(2, device="sim") + 1      # with OP_TOOLS_VERBOSE=1: a table per call (DEBUG)
    """

    hook_name = "OpObserveHook"
    env_prefix = "OP_OBSERVE"
    handles_transformed = True  # it shows what a call is: shapes and dtypes

    def after(self, call: OpCall) -> None:
        if self._logger.isEnabledFor(logging.DEBUG):
            rows = reporting.call_rows(call.name, call.args, call.kwargs, call.result)
            self._logger.debug(reporting.header(call.name, call.forward_id, call.location) + "\n"
                           + reporting.call_table(call.name, rows))
