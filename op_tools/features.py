"""``apply_feature`` / ``remove_feature``: one tool on chosen functions only, optionally under a condition."""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

from . import reporting
from .engine import FEATURES, finish_unstopped, in_tool_work, tool_work
from .naming import function_from_name, resolve_op_name

# name -> (owner, attribute, original function, feature, tool)
_patched: dict[str, tuple[Any, str, Any, str, Any]] = {}
_lock = threading.Lock()


class UnknownFeatureError(ValueError, AssertionError):
    """``apply_feature`` with a feature name that no tool has. An ``AssertionError`` too: the original ditorch
    asserted the name, and its scripts catch that."""


def _as_list(ops) -> list:
    return list(ops) if isinstance(ops, (list, tuple, set)) else [ops]


def _resolve(op) -> tuple[str, Any, str, Any]:
    name = op if isinstance(op, str) else resolve_op_name(op)
    if name in _patched:
        owner, attr, original, _, _ = _patched[name]
        return name, owner, attr, original
    owner, attr, func = function_from_name(name)
    if not callable(func):
        raise ValueError(f"{name!r} is not a function")
    return name, owner, attr, func


def apply_feature(ops, feature: str, condition_func: Callable[..., bool] | None = None) -> None:
    """Run ``feature`` on calls of ``ops`` (names or functions, or a list of them) when ``condition_func`` is true.

    Features: the names in ``op_tools.FEATURES`` (``fallback``, ``cast_dtype``, ``op_capture``, ``dump_op_args``,
    ``overflow_check``, …). Applying to an op that has a feature replaces it; ``remove_feature`` restores it.

    >>> op_tools.apply_feature("torch.add", "fallback", condition_func=lambda a, b, **kw: a.dtype == torch.half)
    >>> op_tools.apply_feature(["torch.Tensor.sort", torch.nn.functional.linear], "dump_op_args")
    >>> op_tools.remove_feature(["torch.add", "torch.Tensor.sort", torch.nn.functional.linear])
    """
    tool_class = FEATURES.get(feature)
    if tool_class is None:
        raise UnknownFeatureError(f"unknown feature {feature!r}; valid features: {', '.join(sorted(FEATURES))}")
    if condition_func is not None and not callable(condition_func):
        raise ValueError("condition_func must be callable (or None)")
    targets = [_resolve(op) for op in _as_list(ops)]  # all resolve, or nothing is patched
    tool = tool_class()
    tool.ensure_configured()
    with _lock:
        replaced = []
        for name, owner, attr, original in targets:
            previous = _patched.get(name)
            if previous is not None:
                reporting.console(f"{name}: feature {previous[3]} replaced by {feature}")
                replaced.append(previous[4])
            setattr(owner, attr, _wrap(tool, original, name, condition_func))
            _patched[name] = (owner, attr, original, feature, tool)
    _finish_unused(replaced)


def remove_feature(ops=None) -> None:
    """Restore the original functions of ``ops`` (all patched functions when ``None``)."""
    with _lock:
        names = list(_patched) if ops is None else [op if isinstance(op, str) else _name_of_patched(op)
                                                     for op in _as_list(ops)]
        removed = []
        for name in names:
            entry = _patched.pop(name, None)
            if entry is not None:
                owner, attr, original, _, tool = entry
                setattr(owner, attr, original)
                removed.append(tool)
    _finish_unused(removed)


def _finish_unused(tools) -> None:
    """Write the results of tools no patched function uses any more (instead of at exit)."""
    in_use = {id(entry[4]) for entry in _patched.values()}
    for tool in {id(t): t for t in tools}.values():
        if id(tool) not in in_use:
            finish_unstopped(tool)


def _name_of_patched(op) -> str:
    for name, (owner, attr, original, _, _) in _patched.items():
        if op is original or getattr(owner, attr, None) is op:
            return name
    return resolve_op_name(op)


def _wrap(tool, original, name: str, condition_func):
    @functools.wraps(original)
    def with_feature(*args, **kwargs):
        if in_tool_work():
            return original(*args, **kwargs)
        if condition_func is not None:
            with tool_work():  # the condition's own torch calls are no op for any tool
                wanted = condition_func(*args, **kwargs)
            if not wanted:
                return original(*args, **kwargs)
        return tool.handle(original, args, kwargs, name=name)

    with_feature.__op_tools_original__ = original
    return with_feature
