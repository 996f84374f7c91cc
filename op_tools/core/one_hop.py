"""A function run under a tool's mode with its own torch-function check skipped: one hop of dispatch.

A mode handling ``multi_head_attention_forward`` that wants the torch calls inside it handled too must run the
function with the mode active, and without the function's own check (``if has_torch_function(...): return
handle_torch_function(...)``) handing the call to the mode again. torch 2.13 has this hop
(``torch._C._skip_one_hop_torch_function``). Older torch has not (2.11, which the lent GPUs run, and the vendors'
releases): there a Python function runs from a copy of itself whose globals answer False for the check's names and
look every other name up in its module at each use (``_Unchecked``). Its body goes on under the mode, and each
function it calls checks as usual. A function that is no plain Python function with such a check cannot be
descended into there (``skipping`` gives None): it runs whole.
"""

from __future__ import annotations

import builtins
import functools
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

_native = getattr(torch._C, "_skip_one_hop_torch_function", None)
_CHECKS = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")
Runner = Callable[[tuple, dict], Any]


def _never(*args, **kwargs) -> bool:
    return False


class _Unchecked(dict):
    """A function's globals in which the torch-function checks answer False. The rest is looked up in its module at
    each use (``__missing__``: CPython reads a ``dict`` subclass's globals through ``__getitem__``), so a name the
    module rebinds later (a user's patch) is the one the body sees."""

    def __init__(self, module: dict) -> None:
        super().__init__(dict.fromkeys(_CHECKS, _never), __builtins__=module.get("__builtins__", builtins))
        self.module = module

    def __missing__(self, name: str):
        return self.module[name]


_bodies: weakref.WeakKeyDictionary[Callable, Runner | None] = weakref.WeakKeyDictionary()


def skipping(func: Callable) -> Runner | None:
    """``run(args, kwargs)``: ``func`` called with its own torch-function check skipped, the calls it makes
    dispatched as usual; None where this torch cannot skip it."""
    if _native is not None:
        return functools.partial(_native, func, ())
    try:
        return _bodies[func]
    except (KeyError, TypeError):  # TypeError: not weakly referenceable (a builtin), never a Python body
        pass
    body = _copy_unchecked(func)
    runner = None if body is None else (lambda args, kwargs: body(*args, **kwargs))
    try:
        _bodies[func] = runner
    except TypeError:
        pass
    return runner


def _copy_unchecked(func: Callable) -> types.FunctionType | None:
    if type(func) is not types.FunctionType or not set(_CHECKS).intersection(func.__code__.co_names):
        return None
    body = types.FunctionType(func.__code__, _Unchecked(func.__globals__), func.__name__, func.__defaults__,
                              func.__closure__)
    body.__kwdefaults__ = func.__kwdefaults__
    body.__qualname__ = func.__qualname__
    body.__module__ = func.__module__
    return body
