"""Targeted dispatch: a tool whose LIST names functions exactly wraps those functions instead of pushing a mode.

A ``TorchFunctionMode`` sees every torch call of its thread, and PyTorch's C++→Python dispatch to it costs
5–12 µs a call (6–14% of a tiny training step on sim) before a tool can even decide to skip the call. When
``OP_<TOOL>_LIST`` is a list of plain names (``torch.nn.functional.linear,torch.Tensor.add``), the calls the tool
may handle are known at ``start()``: the tool wraps those functions (under every public name they have in torch's
namespaces) and every other call runs untouched.

What a mode would see is kept: only the thread that started the tool is handled; a torch call made inside a
handled call (the body of a Python-implemented function, a tool's own work) is not; two tools on one function
stack as their modes would, the later started seeing the call first. The ``torch.distributed`` collectives are seen on
every thread, as the modes are entered for them on any thread (``gradient_communication.py``): a backward pass runs
on autograd's threads, where DDP's gradient buckets, FSDP's reduce-scatters and a tensor-parallel layer's gradient
all-reduces are made. A name imported before the tool started (``from torch.nn.functional import linear`` in
the program's modules, or in a library's outside torch) is a module global holding the function: it is wrapped too, as
the original ditorch's modes saw such calls. What a wrapper cannot see: a reference kept elsewhere (a bound method
``add = x.add``, a function in a dict or a class), the calls torch's own modules make through their own names, and
the other calls PyTorch makes from its autograd threads. A LIST entry written as a regular expression (any character
other than letters, digits, ``_`` and ``.``) selects the mode and sees those too.
"""

from __future__ import annotations

import contextlib
import functools
import re
import sys
import threading
from types import ModuleType
from typing import Any

from torch import Tensor

from ..ops.naming import OPERATOR_METHODS, alias_namespaces, function_from_name, name_as, resolve_op_name

_local = threading.local()  # .tools: {name: (tools of this thread, in start order)}, .busy: inside a handled call
_NO_TOOLS: dict = {}
_EVERY_THREAD = "torch.distributed."  # the names whose calls are handled on every thread: the collectives
_every_thread: dict[str, tuple] = {}  # their tools, of every thread that started one, in start order
_lock = threading.Lock()


class _Wrapped:
    """One function wrapped for targeted dispatch, at each of its places, and how many activations use it."""

    def __init__(self, name: str, places: list[tuple[Any, str]]) -> None:
        self.name, self.users = name, 0
        # (owner, attr, what was there, whether the owner itself held it, the wrapper put there)
        self.places = [(owner, attr, getattr(owner, attr), attr in vars(owner), _wrapper(name, getattr(owner, attr)))
                       for owner, attr in places]

    def install(self) -> None:
        for owner, attr, _, _, wrapper in self.places:
            setattr(owner, attr, wrapper)

    def restore(self) -> None:
        for owner, attr, original, own, wrapper in self.places:
            if vars(owner).get(attr) is wrapper:  # leave whatever was patched over it since
                if own:
                    setattr(owner, attr, original)
                else:  # inherited (Tensor.__add__ from TensorBase): inherit it again
                    delattr(owner, attr)
            name_as(wrapper, None)


_wrapped: dict[str, _Wrapped] = {}


def _wrapper(name: str, original):
    # A collective inside a handled call is handled too: the modes are entered for it there as well
    # (gradient_communication.py), where ``backward()``, which a tool handles, all-reduces DDP's buckets
    anywhere = name.startswith(_EVERY_THREAD)

    def targeted(*args, **kwargs):
        tools = getattr(_local, "tools", _NO_TOOLS).get(name) or _every_thread.get(name)
        busy = getattr(_local, "busy", False)
        if not tools or busy and not anywhere:
            return original(*args, **kwargs)
        _local.busy = True  # what a mode does by stepping aside while it runs a call: nested calls are not seen
        try:
            func = original
            for tool in tools[:-1]:  # the latest started sees the call first, as the top of a mode stack would
                func = _through(tool, func, name)
            return tools[-1].handle(func, args, kwargs, name=name)
        finally:
            _local.busy = busy

    functools.update_wrapper(targeted, original)
    name_as(targeted, name)  # a mode (another tool) seeing the wrapper names it as the function
    return targeted


def plan(names: tuple[str, ...]) -> tuple[dict[str, list], list[str]]:
    """For each name, the places to wrap (none when it is wrapped already); and why any name cannot be wrapped.

    A name outside torch that does not name a function, names it under another name than op_tools reports, or
    cannot be patched where it lives is a reason: the tool then uses a mode, which applies the LIST to every call as
    before. A name in torch's namespaces that names no function is left out, with no reason: no call has it.
    """
    targets: dict[str, list] = {}
    problems: list[str] = []
    for name in names:
        if name in _wrapped:
            targets[name] = []
            continue
        try:
            owner, attr, func = function_from_name(name)
        except ValueError:
            # A torch name: no call is reported under it, so nothing to wrap and no mode (left out of the plan).
            # Another package's function may be imported later: the mode will see it.
            if not _NAMED_BY_OP_TOOLS.match(name):
                problems.append(f"no function is named {name!r}")
            continue
        if not callable(func):
            problems.append(f"{name!r} is not a function")
            continue
        short = name.rpartition(".")[2]
        reported = "torch.Tensor." + OPERATOR_METHODS[short] if owner is Tensor and short in OPERATOR_METHODS \
            else resolve_op_name(func)
        if reported != name:
            problems.append(f"{name!r} is reported as {reported!r}")
            continue
        known = _places_of.get(name)
        if known is None or known[0] is not func:
            known = _places_of[name] = (func, _places(owner, attr, func))
        targets[name] = known[1]
    # the imported names of what a mode sees: not those of a Python function of torch calls that a mode never sees
    # (torch.utils.checkpoint.checkpoint: transformers' own name for it, wrapped, would hide its layers' calls)
    seen = [name for name, places in targets.items() if places and
            (name.startswith(_EVERY_THREAD) or id(_places_of[name][0]) in _overridable())]
    if seen:
        imported = _imported_names([_places_of[name][0] for name in seen])
        for name in seen:
            targets[name] = [*targets[name], *imported[id(_places_of[name][0])]]
    return targets, problems


@functools.cache
def _overridable() -> frozenset[int]:
    """The ids of the functions that hand their calls to a torch-function mode (tens of milliseconds, once)."""
    import torch.overrides

    return frozenset(id(f) for functions in torch.overrides.get_overridable_functions().values() for f in functions)


def _imported_names(funcs: list) -> dict[int, list[tuple[Any, str]]]:
    """For each of ``funcs``, by id: the globals of modules outside torch (and op_tools, ditorch) that hold it, names
    imported before the tool started. One search of every module for them all (tens of milliseconds), made again
    only when modules were imported since: a tool started per step pays a length check, and a name a module binds
    later with no import (``global mm; mm = torch.matmul`` in a function) is not seen. ``__main__`` is searched at
    each start (a notebook's cells bind names in it). A global rebound since the search is left out. Plain modules
    only: an object in ``sys.modules`` with its own attribute rules (a lazy module) is no place to wrap."""
    global _searched
    if _searched[0] != len(sys.modules):
        _searched = (len(sys.modules), {})
    known = _searched[1]
    wanted = {id(f): f for f in funcs if id(f) not in known or known[id(f)][0] is not f}
    main = sys.modules.get("__main__")
    if wanted:
        found: dict[int, list] = {key: [] for key in wanted}
        for module in {id(m): m for m in list(sys.modules.values())}.values():  # a module under two names once
            if module is not main:
                for key, place in _held_in(module, wanted):
                    found[key].append(place)
        known.update({key: (wanted[key], places) for key, places in found.items()})
    in_main: dict[int, list] = {}
    for key, place in _held_in(main, {id(f): f for f in funcs}):
        in_main.setdefault(key, []).append(place)
    return {id(f): [(module, attr) for module, attr in [*known[id(f)][1], *in_main.get(id(f), ())]
                    if vars(module).get(attr) is f] for f in funcs}


def _held_in(module, wanted: dict[int, Any]) -> list[tuple[int, tuple[Any, str]]]:
    """``(id(func), (module, attr))`` for each global of the plain module ``module`` outside torch holding one of
    ``wanted``."""
    if type(module) is not ModuleType:
        return []
    namespace = module.__dict__
    name = namespace.get("__name__")
    if type(name) is not str or name.partition(".")[0] in _OWN_PACKAGES or \
            wanted.keys().isdisjoint(map(id, list(namespace.values()))):  # most modules: one pass in C
        return []
    return [(id(value), (module, attr)) for attr, value in list(namespace.items())
            if id(value) in wanted and value is wanted[id(value)]]


_OWN_PACKAGES = frozenset({"torch", "op_tools", "ditorch"})  # torch's own names are _places'
_searched: tuple[int, dict[int, tuple[Any, list]]] = (0, {})  # (modules searched, {id(func): (func, its places)})


# A name in torch's namespaces, or a short one: op_tools reports every call it sees under where its function lives,
# so such a name that names no function (a typo, warned about by typo_check.py) can match no call.
_NAMED_BY_OP_TOOLS = re.compile(r"torch\.|[^.]*$")
# name -> (function, its places): the search over torch's namespaces costs milliseconds, paid once per name and
# function (a tool started per step); an alias added to torch's namespaces later is not seen
_places_of: dict[str, tuple[Any, list]] = {}


def _places(owner, attr: str, func) -> list[tuple[Any, str]]:
    """``(owner, attr)`` first, then every other public name of ``func`` in torch's namespaces, and the operators
    a mode sees as this method."""
    places = [(owner, attr)]
    if owner is Tensor:
        places += [(Tensor, dunder) for dunder, method in OPERATOR_METHODS.items()
                   if method == attr and hasattr(Tensor, dunder)]
    for namespace in alias_namespaces():
        for other in dir(namespace):
            if (namespace, other) != (owner, attr) and getattr(namespace, other, None) is func:
                places.append((namespace, other))
    return places



class Targeting:
    """A tool started with targeted dispatch on one thread: ``exit()`` undoes ``enter()``."""

    def __init__(self, tool, targets: dict[str, list]) -> None:
        self.tool = tool
        self.targets = targets
        self.thread = threading.get_ident()

    def enter(self) -> None:
        """Wrap what is not wrapped yet; ``AttributeError``/``TypeError`` (a read-only place) undoes it all."""
        done = []
        with _lock:
            try:
                for name, places in self.targets.items():
                    entry = _wrapped.get(name)
                    if entry is None:
                        entry = _Wrapped(name, places)
                        try:
                            entry.install()
                        except (AttributeError, TypeError):
                            entry.restore()
                            raise
                        _wrapped[name] = entry
                    entry.users += 1
                    done.append(name)
            except (AttributeError, TypeError):
                _release(done)
                raise
        if not hasattr(_local, "tools"):
            _local.tools = {}
        for name in self.targets:
            # A tool that runs calls in the device's place (OpFallback) hands the others its call
            # (``OpTool._run_beneath``) from the innermost place: started after them, it would run first and they
            # would meet only its run's inner calls, as tool work. One that moves the call off its device is
            # innermost of all: outside it, OpDtypeCast would meet the CPU's call, none of its.
            tools = (*_local.tools.get(name, ()), self.tool)
            _local.tools[name] = tuple(sorted(tools, key=lambda t: (not t.runs_off_device, not t.replaces_runs)))
            if name.startswith(_EVERY_THREAD):
                with _lock:
                    _every_thread[name] = (*_every_thread.get(name, ()), self.tool)

    def exit(self) -> None:
        if threading.get_ident() != self.thread:
            raise RuntimeError("op_tools: a tool must be stopped on the thread that started it")
        for name in self.targets:
            tools = list(_local.tools[name])
            del tools[len(tools) - 1 - tools[::-1].index(self.tool)]
            if tools:
                _local.tools[name] = tuple(tools)
            else:
                del _local.tools[name]
            if name.startswith(_EVERY_THREAD):
                with _lock:
                    others = list(_every_thread[name])
                    others.remove(self.tool)
                    if others:
                        _every_thread[name] = tuple(others)
                    else:
                        del _every_thread[name]
        with _lock:
            _release(self.targets)


def _release(names) -> None:
    for name in names:
        entry = _wrapped[name]
        entry.users -= 1
        if entry.users == 0:
            entry.restore()
            del _wrapped[name]


@contextlib.contextmanager
def calls_inside_handled():
    """Within a handled call: the calls it makes are handled too (``OpTool.run_inside``), as under a mode."""
    busy, _local.busy = getattr(_local, "busy", False), False
    try:
        yield
    finally:
        _local.busy = busy


def _through(tool, func, name: str):
    def through(*args, **kwargs):
        return tool.handle(func, args, kwargs, name=name)

    functools.update_wrapper(through, func)
    return through
