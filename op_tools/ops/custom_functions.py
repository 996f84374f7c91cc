"""Custom ``torch.autograd.Function``s whose backward no tool follows.

A custom Function's ``apply`` is no torch function: no tool handles it, and its ``backward()`` runs on autograd's
thread, where no tool runs, so no tool sees the calls it makes (a reentrant ``torch.utils.checkpoint`` is one: the
whole checkpointed region's backward); OpAutoCompare compares nothing there, OpOverflowCheck checks the node as one
call. A call reading its result sees its node as the grad_fn of an input; that is where the tools find it. The
Functions PyTorch uses to hand gradients on unchanged (module backward hooks, DDP's and FSDP2's bookkeeping,
DTensor's wrapping) compute nothing there.
"""

from __future__ import annotations

import functools

import torch
from torch.autograd.function import BackwardCFunction

# Functions whose backward returns the gradients it gets, values unchanged
PASS_THROUGH = frozenset({
    "torch.nn.modules._functions.BackwardHookFunction",  # register_full_backward_hook's
    "torch.nn.parallel.distributed._DDPSink",
    "torch.distributed.fsdp._fully_shard._fsdp_state.RegisterPreBackwardFunction",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group.RegisterPostBackwardFunction",
    "torch.distributed.tensor._api._ToTorchTensor",  # DTensor.to_local()
    "torch.distributed.tensor._api._FromTorchTensor",  # DTensor.from_local()
    "op_tools.ops.moves.Moved",  # OpFallback's and OpDtypeCast's copies: the call's own node, its backward a move
})

_names: dict[type, str | None] = {}  # node class -> its Function's name, None for a pass-through one


def custom_node(t: torch.Tensor):
    """``t``'s autograd node where a custom Function made it, else None."""
    node = t.grad_fn
    return node if isinstance(node, BackwardCFunction) else None


def unfollowed_function(t: torch.Tensor, followed) -> str | None:
    """The name of the custom Function that made ``t``, where its backward computes gradients no tool follows (its
    node not among ``followed``: those the tool's own calls made, whose backward it follows, such as a compiled
    graph's run); else None."""
    node = custom_node(t)
    if node is None or node in followed:
        return None
    return function_name(node)


def function_name(node) -> str | None:
    """The name of the custom Function whose node ``node`` is (``CheckpointFunction``), None for one that hands
    gradients on unchanged (``PASS_THROUGH``)."""
    kind = type(node)
    if kind not in _names:
        function = node._forward_cls  # set by FunctionMeta on every node class
        name = f"{function.__module__}.{function.__qualname__}"
        _names[kind] = None if name in PASS_THROUGH else function.__name__
    return _names[kind]


def checkpointed_module(node) -> torch.nn.Module | None:
    """The module a reentrant ``torch.utils.checkpoint`` ran, where ``node`` is its ``CheckpointFunction``'s node and
    what it ran is a module, its bound method (``decoder_layer.__call__``) or a ``functools.partial`` of one, or of a
    function given the module first (transformers' ``GradientCheckpointingLayer``: ``partial(forward, self)``); else
    None."""
    run = getattr(node, "run_function", None)
    while isinstance(run, functools.partial):
        if run.args and isinstance(run.args[0], torch.nn.Module):
            return run.args[0]
        run = run.func
    run = getattr(run, "__self__", run)
    return run if isinstance(run, torch.nn.Module) else None
