"""``apply_feature`` / ``remove_feature``: one tool on chosen functions only, optionally under a condition."""

from __future__ import annotations

import difflib
import functools
import inspect
import threading
from typing import Any, Callable

from ..config.tool_registry import FEATURES, find_tool, normalised_name, short_name, tool_aliases
from ..ops.naming import function_from_name, resolve_op_name
from ..output import reporting
from .engine import OpTool, finish_unstopped, in_tool_work, tool_work

# name -> (owner, attribute, original function, feature, tool)
_patched: dict[str, tuple[Any, str, Any, str, Any]] = {}
_lock = threading.Lock()


class UnknownFeatureError(ValueError, AssertionError):
    """``apply_feature`` with a feature name that no tool has. An ``AssertionError`` too: the original ditorch
    asserted the name, and its scripts catch that."""


def tool_class(name: str) -> type[OpTool]:
    """The tool class ``name`` stands for; ``UnknownFeatureError`` listing the names otherwise."""
    cls = find_tool(name)
    if cls is None:
        close = difflib.get_close_matches(normalised_name(name), list(tool_aliases()), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise UnknownFeatureError(f"unknown feature {name!r}; valid features: "
                                  + ", ".join(sorted({short_name(c) for c in FEATURES.values()} | set(FEATURES)))
                                  + " (or the class names: " + ", ".join(sorted(c.__name__ for c in FEATURES.values()))
                                  + ")" + hint)
    return cls


def _as_list(ops) -> list:
    """``ops`` as a list of names and functions; a module stands for every function it holds, as the original
    ditorch took one (its ``apply_hook_to_ops``), named through the module so that calls made through it are seen."""
    listed = list(ops) if isinstance(ops, (list, tuple, set)) else [ops]
    return [entry for op in listed for entry in (_module_functions(op) if inspect.ismodule(op) else [op])]


def _module_functions(module) -> list[str]:
    return [f"{module.__name__}.{name}" for name, _ in inspect.getmembers(module, inspect.isroutine)
            if not name.startswith("__")]


def _resolve(op) -> tuple[str, Any, str, Any]:
    name = op if isinstance(op, str) else resolve_op_name(op)
    if name in _patched:
        owner, attr, original, _, _ = _patched[name]
        return name, owner, attr, original
    owner, attr, func = function_from_name(name, suggest=True)
    if not callable(func):
        raise ValueError(f"{name!r} is not a function")
    return name, owner, attr, func


def apply_feature(ops, feature: str, condition_func: Callable[..., bool] | None = None, **settings) -> None:
    """Run ``feature`` on calls of ``ops`` (names, functions or modules, or a list of them: a module stands for each
    function in it) when ``condition_func`` is true.

    Features: a tool's class name (``OpCapture``), its short name (``capture``) or the original ditorch's feature name
    (``op_capture``, ``dump_op_args``, ``measure_op_time``, ``cast_dtype``, ``fallback``, ``overflow_check``,
    ``autocompare``): ``tool_aliases()``. ``settings``: the tool's keyword arguments (``mode="summary"``).
    Applying to an op that has a feature replaces it; ``remove_feature`` restores it.

    ``condition_func`` is called with the op's own arguments (``condition_func(*args, **kwargs)``); one that raises
    (a wrong signature) is reported once per op with the op's signature, and the call runs without the tool
    (``OP_TOOLS_STRICT=1``: the error propagates).

    >>> op_tools.apply_feature("torch.add", "fallback", condition_func=lambda a, b, **kw: a.dtype == torch.half)
    >>> op_tools.apply_feature(["torch.Tensor.sort", torch.nn.functional.linear], "dump_op_args")
    >>> op_tools.remove_feature(["torch.add", "torch.Tensor.sort", torch.nn.functional.linear])
    """
    cls = tool_class(feature)
    if condition_func is not None and not callable(condition_func):
        raise ValueError("condition_func must be callable (or None)")
    targets = [_resolve(op) for op in _as_list(ops)]  # all resolve, or nothing is patched
    if cls.env_prefix and "ops" not in settings:  # the ops applied to are its LIST: a tool with a list of its own
        # (OpSelfCheck's ops with an invariant) handles them too, where it ran them untouched, saying none ran
        settings = {**settings, "ops": [name for name, *_ in targets]}
    tool = cls(**settings)
    tool.ensure_configured()
    with _lock:
        replaced = []
        for name, owner, attr, original in targets:
            previous = _patched.get(name)
            if previous is not None:
                reporting.logger.info("%s: feature %s replaced by %s", name, previous[3], feature)
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
                try:
                    wanted = condition_func(*args, **kwargs)
                except Exception as error:
                    if tool.common.strict:
                        raise
                    _report_condition_failure(condition_func, original, name, error)
                    # run without the tool, so not checked: the verdict says so (a wrong kernel there passed)
                    tool.count_unchecked(name, f"condition_func raised {type(error).__name__}: {error}")
                    return original(*args, **kwargs)
            if not wanted:
                tool.declined[name] += 1
                return original(*args, **kwargs)
        return tool.handle(original, args, kwargs, name=name)

    with_feature.__op_tools_original__ = original  # type: ignore[attr-defined]  # a mark: the function it wraps
    return with_feature


_reported_conditions: set = set()
_report_lock = threading.Lock()


def _report_condition_failure(condition_func, original, name: str, error: Exception) -> None:
    """Once per (condition, op): what raised, how the condition is called, and the op's signature."""
    key = (id(condition_func), name)
    with _report_lock:
        if key in _reported_conditions:
            return
        _reported_conditions.add(key)
    reporting.logger.warning(
        "apply_feature(%r): condition_func %s raised %s: %s; it is called with the op's own arguments, as "
        "condition_func(*args, **kwargs) for %s; the call runs without the tool (reported once; "
        "OP_TOOLS_STRICT=1 raises)", name, _describe(condition_func), type(error).__name__, error,
        op_signature(original, name))


def _describe(func) -> str:
    try:
        return f"{getattr(func, '__qualname__', func)}{inspect.signature(func)}"
    except (TypeError, ValueError):
        return repr(func)


def op_signature(func, name: str) -> str:
    """``torch.add(input, other, *, alpha=1, out=None)``: from the signature, else the docstring's first line."""
    try:
        return f"{name}{inspect.signature(func)}"
    except (TypeError, ValueError):
        pass
    for line in (getattr(func, "__doc__", None) or "").splitlines():
        line = line.strip()
        if "(" in line:
            head, _, params = line.split(" -> ")[0].partition("(")
            if name.startswith("torch.Tensor.") and not params.startswith("self"):
                params = "self, " + params if params != ")" else "self)"
            return f"{name.rpartition('.')[0]}.{head}({params}"
        if line:
            break
    return f"{name}(...)"
