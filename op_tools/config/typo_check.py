"""Typos caught at a tool's ``start()``: variables that look like op_tools' but are not, and op names in the LIST
and DISABLE_LIST settings that no torch function has. Each is a WARNING of logger ``op_tools`` with the closest
right name, given once per process; nothing is refused (a misspelling must not stop a long run). Each variable name
and each distinct list is checked once per process: a tool started per step pays a set lookup, not the search for
the closest name (tens of milliseconds over every torch name).

``DITORCH_*`` variables are ditorch's: ``import ditorch`` checks them (``ditorch.env``); op_tools never imports it.
"""

from __future__ import annotations

import difflib
import functools
import logging
import os
import re
import threading

import torch

from ..numerics.comparison import TOLERANCE_VAR, dtype_key
from ..ops.naming import function_from_name, import_path
from .settings import origin
from .variables import PLAIN_NAME, REFERENCE_CAST_VAR, TOOL_PREFIXES, VARIABLES

_OURS = re.compile(r"^OP_|AUTOCOMPARE|_OP_DTYPE_CAST|ERROR_TOLERANCE")
_logger = logging.getLogger("op_tools")  # reporting's logger; config sits below output
_warned: set = set()
_lock = threading.Lock()
_checked_variables: set[str] = set()  # names in os.environ already checked
_checked_lists: set[tuple] = set()  # (tool's prefix, LIST entries, DISABLE_LIST entries) already checked


def warn_once(key, message: str, *args) -> None:
    """Log ``message`` as a WARNING of logger ``op_tools`` the first time ``key`` is seen in this process."""
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    _logger.warning(message, *args)


# --- variables ---

@functools.cache
def dtype_keys() -> tuple[str, ...]:
    """``FLOAT16``, ``BFLOAT16``, …: the ``<DTYPE>`` of the tolerance variables."""
    return tuple(sorted({dtype_key(v) for v in vars(torch).values() if isinstance(v, torch.dtype)}))


_OP_NAMESPACES = ("torch", "torch.Tensor", "torch.nn.functional", "torch.linalg", "torch.special", "torch.fft")


@functools.cache
def op_names() -> tuple[str, ...]:
    """Every public-looking function name op_tools could report (``torch.add``, ``torch.Tensor.add_``, …)."""
    names = set()
    for path in _OP_NAMESPACES:
        for attr in dir(import_path(path)):
            if not attr.startswith("__") or attr in ("__getitem__", "__setitem__"):
                names.add(f"{path}.{attr}")
    return tuple(sorted(names))


@functools.cache
def op_keys() -> frozenset:
    """``<OPNAME>`` values that name an op: the last part of an op name, upper-cased."""
    return frozenset(name.rsplit(".", 1)[-1].upper() for name in op_names())


def unknown_variable(name: str) -> str | None:
    """The warning for ``name`` if it looks like an op_tools variable and is not one, else ``None``."""
    if name in VARIABLES or name.startswith("DITORCH_") or not _OURS.search(name):
        return None
    declared = [n for n in VARIABLES if "<" not in n]
    tolerance, cast = TOLERANCE_VAR.match(name), REFERENCE_CAST_VAR.match(name)
    if tolerance or cast:
        if tolerance:
            op, dtype = tolerance.group("op"), tolerance.group("dtype")
        else:
            assert cast is not None  # one of the two matched
            op, dtype = cast.group(1), None
        good_op = op is None or op in op_keys()
        good_dtype = dtype is None or dtype in dtype_keys()
        if good_op and good_dtype:
            return None
        fixed = name
        if dtype is not None and not good_dtype:
            fixed = fixed[: -len(dtype)] + _closest(dtype, dtype_keys(), dtype)
        if not good_op:
            fixed = _closest(op, op_keys(), op) + fixed[len(op):]
        return _message(name, fixed if fixed != name else None)
    candidates = [*declared, "AUTOCOMPARE_ERROR_TOLERANCE", *(f"AUTOCOMPARE_ERROR_TOLERANCE_{d}" for d in dtype_keys())]
    parts = name.split("_")
    for k in range(1, min(3, len(parts)) + 1):  # the name may start with an <OPNAME>
        op = "_".join(parts[:k])
        candidates += [f"{op}_AUTOCOMPARE_ERROR_TOLERANCE", f"{op}_OP_DTYPE_CAST_DICT",
                       *(f"{op}_AUTOCOMPARE_ERROR_TOLERANCE_{d}" for d in dtype_keys())]
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.75)
    if not close and not name.startswith(("OP_TOOLS_", *TOOL_PREFIXES)) and "AUTOCOMPARE" not in name:
        return None  # another program's OP_ variable (1Password's OP_SESSION_…): not ours to judge
    return _message(name, close[0] if close else None)


def _closest(word: str, choices, default: str) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    return close[0] if close else default


def _message(name: str, suggestion: str | None) -> str:
    hint = f"; did you mean {suggestion}?" if suggestion else " (docs/env_variables.md lists them)"
    return f"{name} is not a variable op_tools reads{hint}"


def check_environment(environ=None) -> None:
    """Warn about every variable that looks like op_tools' and is not (each name of ``os.environ`` once per
    process: one set difference when nothing was set since the last start)."""
    names = set(os.environ if environ is None else environ)
    if environ is None:
        names -= _checked_variables
        _checked_variables.update(names)
    for name in sorted(names):
        message = unknown_variable(name)
        if message is not None:
            warn_once(("variable", name), "%s", message)


# --- op names in LIST / DISABLE_LIST ---

@functools.lru_cache(maxsize=1024)  # the search costs tens of milliseconds; a name's answer never changes
def unknown_op(entry: str) -> str | None:
    """Why the LIST entry ``entry`` names no op, with a suggestion; ``None`` for a known name or a pattern (a regular
    expression is not checked: it may be meant to match nothing yet)."""
    if not PLAIN_NAME.fullmatch(entry):
        return None
    if entry.startswith("torch."):
        try:
            function_from_name(entry)
            return None
        except ValueError:
            pass
        close = difflib.get_close_matches(entry, op_names(), n=3, cutoff=0.75)
    elif "." not in entry:  # a short name: the tools name ops in full
        close = [n for n in (f"{p}.{entry}" for p in _OP_NAMESPACES) if n in set(op_names())][:3]
    else:
        return None  # a function of another package (apply_feature names): importing it here could run its code
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    return f"no op is named {entry!r}{hint}"


def check_op_lists(tool) -> None:
    """Warn about entries of the tool's LIST and DISABLE_LIST that name no op (once per process and entry); a list
    checked before costs a set lookup."""
    lists = (("ops", tool.filter.allow), ("disable", tool.filter.deny))
    key = (tool.env_prefix, *(tuple(p.pattern for p in patterns or ()) for _, patterns in lists))
    if key in _checked_lists:
        return
    _checked_lists.add(key)
    for keyword, patterns in lists:
        for pattern in patterns or ():
            why = unknown_op(pattern.pattern)
            if why is not None:
                warn_once(("op", tool.env_prefix, keyword, pattern.pattern), "%s: %s", origin(tool, keyword), why)
