"""Which module's forward is running on this thread, for faults scoped to a module (``silu@model.layers.1:nan``).

Global module forward hooks (``torch.nn.modules.module.register_module_forward_pre_hook`` and
``register_module_forward_hook``) keep, per thread, the stack of module paths being run; no model is changed.
Paths are named as op_tools names them (``op_tools/core/module_path.py``; ditorch never imports op_tools, so the
few lines are repeated here): names from ``named_modules()`` of the outermost module entered (a
``LlamaForCausalLM``: ``model.layers.1.mlp.act_fn``), under a DDP/FSDP/DataParallel root from the module it wraps,
the root itself by its class, a module run inside another without being registered in it as
``<parent path>.<ClassName>``, and ``""`` outside any module.

One difference: a module entered outside any forward that an earlier forward named (the first module of the
forward activation checkpointing recomputes on autograd's thread) keeps that name (``model.layers.1.mlp``), where
op_tools names it as a root, by its class. So a fault in a module hits its recomputed forward as it hit the first.

The hooks are installed only while some fault has a module scope (``track(True)``). Backward runs on autograd's
threads, outside any forward, so a scoped fault hits forward calls only (the recomputed forward included).

>>> in_scope("model.layers.1.mlp.act_fn", "model.layers.1"), in_scope("model.layers.10.mlp", "model.layers.1")
(True, False)
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch.nn.modules import module as _module

# .stack: [(module, path)], innermost last; .generation: the tracking it belongs to; .prefix: the path an earlier
# forward gave the root of the stack, "" when it is named by its class
_local = threading.local()
_lock = threading.Lock()
_generation = 0  # bumped at each start of tracking: a stack left by an earlier one (stopped mid-forward) is stale
_handles: list = []
_WRAPPERS = frozenset({"DistributedDataParallel", "DataParallel", "FullyShardedDataParallel"})
_names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # root -> {id(module): path or None}


def in_scope(path: str, scope: str) -> bool:
    """Whether ``path`` is ``scope`` or a module under it, component by component (``model.layers.1`` holds
    ``model.layers.1.mlp`` but not ``model.layers.10``)."""
    return path == scope or path.startswith(scope + ".")


def current() -> str:
    """The path of the innermost module running on this thread, ``""`` outside any (or when not tracking)."""
    stack = getattr(_local, "stack", None)
    return stack[-1][1] if stack and _local.generation == _generation else ""


def tracking() -> bool:
    return bool(_handles)


def track(on: bool) -> None:
    """Install the global hooks (``on``) or remove them; nothing when already so."""
    global _generation
    with _lock:
        if on and not _handles:
            _generation += 1
            _handles.append(_module.register_module_forward_pre_hook(_enter))
            _handles.append(_module.register_module_forward_hook(_leave, always_call=True))
        elif not on and _handles:
            for handle in _handles:
                handle.remove()
            _handles.clear()


def _path_in(root: torch.nn.Module, module: torch.nn.Module) -> str | None:
    names = _names.get(root)
    if names is None or id(module) not in names:
        base = root.module if type(root).__name__ in _WRAPPERS and isinstance(root.module, torch.nn.Module) else root
        names = _names[root] = {id(m): name for name, m in base.named_modules(remove_duplicate=False)}
        names.setdefault(id(module), None)  # not registered under the root: not looked for again
    return names[id(module)]


def _enter(module: torch.nn.Module, _args) -> None:
    stack = getattr(_local, "stack", None)
    if stack is None or _local.generation != _generation:
        stack = _local.stack = []
        _local.generation = _generation
    if not stack:
        known = _known_path(module)
        _local.prefix = known
        stack.append((module, known or type(module).__name__))
        return
    root, parent_path = stack[0][0], stack[-1][1]
    path = _path_in(root, module)
    if path is None:
        path = f"{parent_path}.{type(module).__name__}"
    elif path == "":
        path = stack[0][1]  # the root entered again (a recursive call)
    elif _local.prefix:
        path = f"{_local.prefix}.{path}"
    stack.append((module, path))


def _known_path(module: torch.nn.Module) -> str:
    """The path an earlier forward gave ``module`` under another root (``""``: none, it is a root of its own)."""
    for names in list(_names.values()):
        path = names.get(id(module))
        if path:
            return path
    return ""


def _leave(module: torch.nn.Module, _args, _output) -> None:
    stack = getattr(_local, "stack", None)
    if not stack or _local.generation != _generation:
        return
    for i in range(len(stack) - 1, -1, -1):  # normally the top; deeper when an exception skipped some exits
        if stack[i][0] is module:
            del stack[i:]
            return
