"""OpDtypeCast: run handled ops in a wider dtype (OP_DTYPE_CAST_DICT) and cast the results back."""

from __future__ import annotations

import os

import torch

from . import reporting
from .arguments import iter_items, map_tensors
from .config import DTYPE_CAST_DICT
from .engine import OpCall, OpTool, feature, tool_work
from .naming import CONVERSIONS, VIEW_OPS


@feature("cast_dtype")
class OpDtypeCast(OpTool):
    """Cast inputs whose dtype is in ``OP_DTYPE_CAST_DICT``, run, cast outputs back to the original dtype.

    >>> with op_tools.OpDtypeCast():   # default torch.float16->torch.float32,torch.bfloat16->torch.float32
    ...     y = torch.nn.functional.silu(x_fp16)      # computed in float32, returned as float16
    """

    hook_name = "OpDtypeCastHook"
    env_prefix = "OP_DTYPE_CAST"

    def configure(self) -> None:
        self.cast = DTYPE_CAST_DICT.read()
        self.config_text = os.environ.get(DTYPE_CAST_DICT.name, DTYPE_CAST_DICT.default)

    def accepts(self, name: str) -> bool:
        # Views must alias their base; explicit conversions mean what they say.
        return name not in VIEW_OPS and name not in CONVERSIONS and not name.startswith("torch.Tensor.__get")

    def run(self, call: OpCall):
        with tool_work():
            pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (original, cast copy)

            def widen(t: torch.Tensor) -> torch.Tensor:
                target = self.cast.get(t.dtype)
                if target is None or target == t.dtype:
                    return t
                wide = t.to(target)  # differentiable: gradients reach the original
                pairs.append((t, wide))
                return wide

            args, kwargs = map_tensors(call.args, widen), map_tensors(call.kwargs, widen)
        if not pairs:
            return call.func(*call.args, **call.kwargs)
        result = call.func(*args, **kwargs)
        with tool_work():
            back = {wide.dtype: original.dtype for original, wide in pairs}
            originals = {id(wide): original for original, wide in pairs}
            rows = [{"name": call.name, "target": f"input{path}", "action": f"{o.dtype} -> {w.dtype}",
                     "config": self.config_text}
                    for (path, o), (_, w) in zip(_tensor_items(call.args, call.kwargs), _tensor_items(args, kwargs))
                    if o is not w]
            for original, wide in pairs:
                if wide._version > 0:  # written by an in-place op or out=: the caller's tensor must change
                    original.copy_(wide)

            def narrow(t: torch.Tensor) -> torch.Tensor:
                original = originals.get(id(t))
                if original is not None:
                    return original
                if t.dtype in back:
                    return t.to(back[t.dtype])
                return t

            out = map_tensors(result, narrow)
            for (path, raw), (_, final) in zip(iter_items(reporting.as_tuple(result)),
                                                iter_items(reporting.as_tuple(out))):
                if isinstance(raw, torch.Tensor) and raw.dtype != final.dtype:
                    rows.append({"name": call.name, "target": f"output{path}",
                                 "action": f"{raw.dtype} -> {final.dtype}", "config": self.config_text})
            call.state["rows"] = rows
            return out

    def after(self, call: OpCall) -> None:
        rows = call.state.pop("rows", None)
        if rows and self.common.verbose:
            reporting.console(reporting.table(rows, ("name", "target", "action", "config")).get_string())


def _tensor_items(args, kwargs):
    items = [(p, v) for p, v in iter_items(tuple(args)) if isinstance(v, torch.Tensor)]
    items += [(p, v) for p, v in iter_items(kwargs) if isinstance(v, torch.Tensor)]
    return items
