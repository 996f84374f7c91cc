"""Which ``nn.Module`` is running: ``model.layers.3.mlp.down_proj``, for the reports of every tool.

Global module forward hooks (``torch.nn.modules.module.register_module_forward_pre_hook`` and
``register_module_forward_hook``) keep, per thread, the stack of module paths being run; no model is changed.
Names come from ``named_modules()`` of the outermost module entered (the root: a ``LlamaForCausalLM``), computed
once per root and refreshed when a module not seen before runs under it; under a DDP/FSDP/DataParallel root the
names come from the module it wraps, and ``torch.compile``'s ``_orig_mod`` is left out, so that runs with and
without them name their layers alike. The root itself is
named by its class (``LlamaForCausalLM``); a module run inside another without being registered in it (a module
kept in a plain list, a function's local module) is ``<parent path>.<ClassName>``; outside any module the path is
``""``. A path names its parents (``model.layers.3`` holds ``model.layers.3.mlp``) except where it has no dot: the
root's children (``model``, ``lm_head``) and a DDP root's model; for those the module each last ran inside is kept,
and ``enclosing()`` gives a path's parents to the reports that add submodules' time up.

Backward calls are attributed through the forward call that created their autograd nodes (the engine keeps the
path on the ``OpCall``), so they need no backward hooks. Under ``torch.utils.checkpoint`` the recomputation runs
inside ``backward()``, where a tool's mode is off the stack: a tool with a mode does not handle those calls (they
repeat forward calls it handled); targeted wrappers do, and name them from the module recomputed (``act_fn``), as
the recomputation enters it with no module around it.

The hooks are installed only while some tool holds the tracker (``acquire()``/``release()``, counted), and cost
a thread-local list append and pop per module call.
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import torch
from torch.nn.modules import module as _module

from ..ops.torch_versions import is_compiling
from . import compiled_regions
from .shared_install import SharedInstall


class _ThreadState(threading.local):
    """Per thread: ``stack``, [(module, path)] innermost last, and ``generation``, the tracking it belongs to.
    Defaults on the class: every call's ``current()`` reads them, and a missing attribute costs ~1 µs to look up."""

    stack: list | None = None
    generation = -1


_local = _ThreadState()
_generation = 0  # bumped at each start of tracking: a stack left by an earlier one (stopped mid-forward) is stale
_handles: list = []
# Wrappers whose own names would prefix every path ("module.model.layers.0"): named from the module they wrap, so
# that a run with DDP and one without name their layers alike.
_WRAPPERS = frozenset({"DistributedDataParallel", "DataParallel", "FullyShardedDataParallel"})
# root module -> {id(module): path} for the modules registered under it
_names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# path -> the path of the module it last ran inside, for the paths with no dot other than roots ("model" ->
# "LlamaForCausalLM"): the parent their name does not show. Kept past release(): tools read it at stop().
_parents: dict[str, str] = {}


# Called with each outermost module entered while tracking (gradient_communication.py hooks DDP models there).
root_listeners: list = []


def parameter_names() -> dict[int, str]:
    """id(parameter) -> its name under the outermost modules entered while tracking (``model.layers.0.mlp.up_proj.
    weight``, named from the module a DDP/FSDP wrapper wraps)."""
    names: dict[int, str] = {}
    for root in list(_names.keys()):
        base = root.module if type(root).__name__ in _WRAPPERS and isinstance(root.module, torch.nn.Module) else root
        for name, parameter in base.named_parameters(remove_duplicate=False):
            names.setdefault(id(parameter), name)
    return names


def path_of(module: torch.nn.Module) -> str | None:
    """The path of ``module`` under the outermost modules entered while tracking (a module run under one since it was
    last named), None where it is under none."""
    for root in list(_names.keys()):
        path = _names[root].get(id(module))
        if path is not None:
            return path or type(module).__name__
    return None


def enclosing(path: str) -> list[str]:
    """The paths of the modules ``path`` is inside, innermost first: ``model.layers.3.mlp`` is inside
    ``model.layers.3``, ``model.layers``, ``model`` and the root ``LlamaForCausalLM``; ``[]`` for a root or ``""``.

    >>> enclosing("model.layers.3.mlp")  # once a LlamaForCausalLM ran while tracking
    ['model.layers.3', 'model.layers', 'model', 'LlamaForCausalLM']
    """
    found: list[str] = []
    while True:
        head, dot, _ = path.rpartition(".")
        path = head if dot else _parents.get(path, "")
        if not path or path in found:  # a root; or a module that ran inside its own child (a recursive model)
            return found
        found.append(path)


def is_known(path: str) -> bool:
    """Whether a module of a root run while tracking is named ``path``."""
    return any(path in names.values() for names in list(_names.values()))


def current() -> str:
    """The path of the innermost module running on this thread, ``""`` outside any (or when not tracking)."""
    stack = _local.stack
    return stack[-1][1] if stack and _local.generation == _generation else ""


def _install() -> None:
    global _generation
    _generation += 1
    if _handles:  # installed before: back under the same keys (see _remove)
        for handle, hook in zip(_handles, (_enter, _leave)):
            handle.hooks_dict_ref()[handle.id] = hook
            for extra in handle.extra_dict_ref:  # always_call's table
                extra()[handle.id] = True
        return
    _handles.append(_module.register_module_forward_pre_hook(_enter))
    try:
        _handles.append(_module.register_module_forward_hook(_leave, always_call=True))
    except TypeError:  # PyTorch < 2.1: no always_call; _leave also unwinds what an exception left
        _handles.append(_module.register_module_forward_hook(_leave))


def _remove() -> None:
    # The handles are kept: the next install puts the hooks back under the same keys of torch's global hook tables.
    # Dynamo guards on those keys, so a graph compiled while one tool ran serves the next tool without recompiling.
    for handle in _handles:
        handle.remove()


# Start tracking (install the global hooks) unless already tracking; stop once every acquire() was released.
_tracking = SharedInstall(_install, _remove)
acquire, release = _tracking.acquire, _tracking.release


def _unwrapped(name: str) -> str:
    """A module's name without ``torch.compile``'s ``_orig_mod`` components (a compiled model, or a compiled layer in
    one), so that compiled and eager runs name their layers alike: ``_orig_mod.h.1`` is ``h.1``."""
    return name if "_orig_mod" not in name else ".".join(p for p in name.split(".") if p != "_orig_mod")


def _path_in(root: torch.nn.Module, module: torch.nn.Module) -> str | None:
    names = _names.get(root)
    if names is None or id(module) not in names:
        base = root.module if type(root).__name__ in _WRAPPERS and isinstance(root.module, torch.nn.Module) else root
        names = _names[root] = {id(m): _unwrapped(name) for name, m in base.named_modules(remove_duplicate=False)}
        names.setdefault(id(module), None)  # not registered under the root: not looked for again
    return names[id(module)]


_is_compiling = is_compiling


def _enter(module: torch.nn.Module, _args) -> None:
    if _is_compiling():  # dynamo inlines the hooks of the modules it traces: the compiled graph runs none of them
        return
    stack = _local.stack
    if stack is None or _local.generation != _generation:
        stack = _local.stack = []
        _local.generation = _generation
    if not stack:  # the root, by its class (a torch.compile'd model's: the model's, as when not compiled)
        root_path = type(getattr(module, "_orig_mod", module)).__name__
        _parents.pop(root_path, None)  # a root has none, whatever ran under that name before
        stack.append((module, root_path))
        for listener in root_listeners:
            listener(module)
        return
    root, parent_path = stack[0][0], stack[-1][1]
    path = _path_in(root, module)
    if path is None:
        path = f"{parent_path}.{type(module).__name__}"
    elif path == "":
        path = type(module).__name__  # the root entered again (a recursive call), or the model a DDP root wraps
    if "." not in path and path not in (stack[0][1], parent_path):  # its name does not say which module it is in
        _parents[path] = parent_path
    stack.append((module, path))


@contextlib.contextmanager
def inside(path: str):
    """Calls made inside run "in" ``path`` (what is not a module's forward: a DDP model's gradient bucket)."""
    stack = _local.stack
    if stack is None or _local.generation != _generation:
        stack = _local.stack = []
        _local.generation = _generation
    stack.append((None, path))
    try:
        yield
    finally:
        stack.pop()


def _leave(module: torch.nn.Module, _args, _output) -> None:
    if _is_compiling():
        return
    stack = _local.stack
    if not stack:
        return
    for i in range(len(stack) - 1, -1, -1):  # normally the top; deeper when an exception skipped some exits
        if stack[i][0] is module:
            del stack[i:]
            return


compiled_regions.frame_skipped_hooks += [_enter, _leave]
