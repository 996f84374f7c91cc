"""Gradient communication as calls the tools see: DDP's gradient buckets, and the collectives FSDP (or any hook)
makes during backward.

A tool handles calls through a ``__torch_function__`` mode, and ``backward()`` runs with no mode on the stack (the
mode is off the stack while it handles the ``backward`` call itself), so what runs inside backward is not handled:

- DDP reduces its gradient buckets in its C++ reducer, where no tool sees them: a NaN another rank sent arrives in
  the gradients unannounced, and nothing times or checks the all-reduce. DDP's communication hook API is the place
  to see them: ``bucket_all_reduce`` is registered on a ``DistributedDataParallel`` model the first time it runs
  forward while a tool that tracks modules is started (``module_path.root_listeners``); a model with a hook of its
  own keeps it (said once). While a tool is started, a bucket is divided by the group's size and all-reduced
  synchronously (the numbers of DDP's default: divide, then sum) with the tools' modes entered, inside the module
  path ``DistributedDataParallel (gradient bucket <i>)``; otherwise the hook is DDP's own default,
  ``allreduce_hook`` (asynchronous, overlapping backward). It stays registered when the tools stop: DDP cannot
  unregister one.
- FSDP's reduce-scatters (FSDP1's and FSDP2's post-backward), and any collective a backward hook makes, call
  ``torch.distributed``'s functions: while a tool is started (``acquire``/``release``, counted), the collectives of
  ``collectives.py``'s table are wrappers in the ``torch.distributed`` namespace that enter the started tools' modes
  missing from the stack, then call the function; the originals are put back with the last tool.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from typing import Any, Callable

import torch

from ..ops.collectives import COLLECTIVE_NAMES
from . import module_path
from .shared_install import SharedInstall

_hooked: weakref.WeakSet = weakref.WeakSet()
# The modes of the tools started now, in start order: set by the engine (engine.started_modes), which imports this
# module, not the other way round.
started_modes: Callable[[], list] = list
_logger = logging.getLogger("op_tools")
BUCKET_PATH = "DistributedDataParallel (gradient bucket {})"


def modes_to_enter() -> list | None:
    """The started tools' modes missing from this thread's stack (autograd runs DDP's hook with none), or None when
    no tool is started ([] when those started have none: their wrappers see the calls)."""
    from torch.overrides import _get_current_function_mode_stack

    modes = started_modes()
    if not modes:  # tools started without a mode (targeted dispatch) see them through their wrappers, on any thread
        return [] if _wrapping.in_use() else None
    present = _get_current_function_mode_stack()
    return [mode for mode in modes if all(mode is not other for other in present)]


@contextlib.contextmanager
def entered(modes: list):
    """The tools' ``modes`` pushed on this thread's stack for the block (their calls handled there)."""
    with contextlib.ExitStack() as stack:
        for mode in modes:
            stack.enter_context(mode)
        yield


def bucket_all_reduce(process_group, bucket):  # unannotated: DDP accepts no annotation but its own types
    """DDP's default gradient all-reduce, as a call the tools see while a tool is started."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    modes = modes_to_enter()
    if modes is None:
        return default_hooks.allreduce_hook(process_group, bucket)
    group: Any = process_group if process_group is not None else dist.group.WORLD
    tensor = bucket.buffer()
    with torch._C.DisableTorchFunction():  # DDP's own division, which its C++ reducer does unseen
        tensor.div_(group.size())
    with entered(modes), module_path.inside(BUCKET_PATH.format(bucket.index())):
        dist.all_reduce(tensor, group=group)
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(tensor)
    return done


def _hook_ddp(module: torch.nn.Module) -> None:
    if type(module).__name__ != "DistributedDataParallel" or module in _hooked:
        return
    _hooked.add(module)
    try:
        module.register_comm_hook(module.process_group, bucket_all_reduce)  # type: ignore[operator]
    except RuntimeError as error:  # "can only be called once": the user's own hook, or a builtin one
        _logger.warning("op_tools: a DistributedDataParallel model has a communication hook of its own (%s): its "
                        "gradient buckets are seen where that hook calls torch.distributed (an asynchronous call "
                        "checked at its wait, or before the optimizer's step where the hook takes its future)",
                        str(error).splitlines()[0])
    except Exception:  # noqa: BLE001 - a DDP that refuses the hook still trains; the tools just do not see its buckets
        _logger.exception("op_tools: a DistributedDataParallel model refused op_tools' communication hook: its "
                          "gradient buckets are not seen by the tools")


module_path.root_listeners.append(_hook_ddp)


_originals: dict[str, Callable] = {}


def _install() -> None:
    import torch.distributed as dist

    for name in COLLECTIVE_NAMES:
        original = getattr(dist, name, None)
        if callable(original):
            _originals[name] = original
            setattr(dist, name, _entering_tools(original))


def _remove() -> None:
    import torch.distributed as dist

    for name, original in _originals.items():
        setattr(dist, name, original)
    _originals.clear()


def _entering_tools(original: Callable) -> Callable:
    @functools.wraps(original)
    def collective(*args, **kwargs):
        modes = modes_to_enter()
        if not modes:
            return original(*args, **kwargs)
        with entered(modes):
            return original(*args, **kwargs)

    return collective


# While a tool is started: the table's collectives enter the tools' modes where none is on the stack.
_wrapping = SharedInstall(_install, _remove)
acquire, release = _wrapping.acquire, _wrapping.release
