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

The hooks are installed only while some fault has a module scope (``track(True)``); compiled code then runs eagerly
(``_compiled_code_eager``), and ``_orig_mod`` (the compiled module's wrapper) is no part of a path, so a scoped fault
fires in a compiled model as in eager. Backward runs on autograd's
threads, outside any forward, so a scoped fault hits forward calls only (the recomputed forward included).

>>> in_scope("model.layers.1.mlp.act_fn", "model.layers.1"), in_scope("model.layers.10.mlp", "model.layers.1")
(True, False)
"""

from __future__ import annotations

import sys
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
            _compiled_code_eager(True)
        elif not on and _handles:
            for handle in _handles:
                handle.remove()
            _handles.clear()
            _compiled_code_eager(False)


_forced_eager = False  # whether tracking set torch.compile's stance to force_eager (and so puts it back)


def _compiled_code_eager(on: bool) -> None:
    """While a fault has a module scope, compiled code runs eagerly (``set_stance("force_eager")``): a compiled graph
    runs its kernels after tracing, outside the hooks of the modules they came from, so a scoped fault would miss
    them (and dynamo tracing the hooks fails). Only where dynamo is loaded: importing it costs a second, and without
    it nothing was compiled yet. The stance is put back only if it is still the one set here."""
    global _forced_eager
    if "torch._dynamo" not in sys.modules:
        return
    stance = torch._dynamo.eval_frame._stance.stance
    if on and stance == "default":
        torch.compiler.set_stance("force_eager")
        _forced_eager = True
    elif not on and _forced_eager:
        _forced_eager = False
        if stance == "force_eager":
            torch.compiler.set_stance("default")


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
