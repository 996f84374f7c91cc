"""OpOverflowCheck: inf/nan and statistics of every handled call's tensors, forward and backward.

It names the first op, in execution order, whose outputs hold inf/nan while its inputs are finite
(``tool.first_overflow``); with ``OP_OVERFLOW_CHECK_RAISE=1`` it raises ``OverflowDetectedError`` there (for
an op found in backward: as ``backward()`` returns, since raising inside autograd's device threads is unsafe).
"""

from __future__ import annotations

import dataclasses

import torch

from . import reporting
from .arguments import iter_items
from .config import OVERFLOW_CHECK_RAISE
from .engine import OpCall, OpTool, OpToolsAbortError, feature

STAT_COLUMNS = ("name", "inf_or_nan", "min", "max", "mean", "std", "norm")


class OverflowDetectedError(OpToolsAbortError):
    """The first op producing inf/nan from finite inputs (OP_OVERFLOW_CHECK_RAISE=1)."""


@dataclasses.dataclass(frozen=True)
class Overflow:
    name: str
    forward_id: int
    phase: str  # "forward" or "backward"
    location: str

    def __str__(self) -> str:
        return (f"first inf/nan from finite inputs: {self.name} ({self.phase}) forward_id: {self.forward_id}\n"
                f"{self.location}")


def tensor_stats(name: str, t: torch.Tensor) -> dict:
    """inf/nan flag and min, max, mean, std, norm of ``t`` (computed in float32 or wider)."""
    row = {"name": name, "inf_or_nan": False}
    if t.numel() == 0 or t.is_complex():
        return row
    wide = t.detach()
    if not wide.is_floating_point() or wide.element_size() < 4:
        wide = wide.float()
    row["inf_or_nan"] = not bool(torch.isfinite(wide).all())
    row.update(min=wide.min().item(), max=wide.max().item(), mean=wide.mean().item(),
               std=wide.std(correction=0).item(), norm=wide.norm().item())
    return row


def stats_rows(prefix: str, values) -> list[dict]:
    return [tensor_stats(prefix + path, v) for path, v in iter_items(tuple(values)) if isinstance(v, torch.Tensor)]


@feature("overflow_check")
class OpOverflowCheck(OpTool):
    """Check every handled call's inputs, outputs and gradients for inf/nan.

    >>> with op_tools.OpOverflowCheck() as check:
    ...     loss = model(x).sum(); loss.backward()
    >>> print(check.first_overflow)     # None, or the op, forward_id, phase and source line
    """

    hook_name = "OpOverflowCheckHook"
    env_prefix = "OP_OVERFLOW_CHECK"

    def configure(self) -> None:
        self.raise_on_overflow = OVERFLOW_CHECK_RAISE.read()
        self.first_overflow: Overflow | None = None
        self._pending: Overflow | None = None

    def after(self, call: OpCall) -> None:
        with torch.no_grad():
            inputs = stats_rows(f"{call.name} input", tuple(call.args) + tuple(call.kwargs.values()))
            outputs = stats_rows(f"{call.name} output", reporting.as_tuple(call.result))
        if self.common.verbose:
            rows = reporting.call_rows(call.name, call.args, call.kwargs, call.result)
            reporting.console(reporting.header(call.name, call.forward_id, call.location) + "\n"
                              + reporting.table(rows, reporting.ARG_COLUMNS).get_string() + "\n"
                              + reporting.table(inputs + outputs, STAT_COLUMNS).get_string())
        self._check(call, inputs, outputs, "forward")

    def after_backward(self, call: OpCall, grad_inputs: tuple, grad_outputs: tuple) -> None:
        self._check_gradients(call, grad_inputs, grad_outputs, self.common.verbose)

    def inner_node_backward(self, call: OpCall, grad_inputs: tuple, grad_outputs: tuple) -> None:
        # Inside a composite function: an inf/nan born there is the function's.
        self._check_gradients(call, grad_inputs, grad_outputs, False)

    def _check_gradients(self, call: OpCall, grad_inputs: tuple, grad_outputs: tuple, print_table: bool) -> None:
        with torch.no_grad():
            ins = stats_rows(f"{call.name} grad_inputs", grad_inputs)
            outs = stats_rows(f"{call.name} grad_outputs", grad_outputs)
        if print_table:
            reporting.console(reporting.header(call.name, call.forward_id, call.location, "backward") + "\n"
                              + reporting.table(ins + outs, STAT_COLUMNS).get_string())
        # Backward runs from grad_outputs (upstream) to grad_inputs.
        self._check(call, outs, ins, "backward")

    def backward_done(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            raise OverflowDetectedError(str(pending))

    def _check(self, call: OpCall, sources: list[dict], results: list[dict], phase: str) -> None:
        if self.first_overflow is not None:
            return
        if any(r["inf_or_nan"] for r in results) and not any(r["inf_or_nan"] for r in sources):
            self.first_overflow = Overflow(call.name, call.forward_id, phase, call.location)
            reporting.console(f"\nOpOverflowCheck: {self.first_overflow}")
            if self.raise_on_overflow:
                if phase == "backward":  # raised when backward() returns, on the caller's thread
                    self._pending = self.first_overflow
                else:
                    raise OverflowDetectedError(str(self.first_overflow))
