"""GradScaler's iterations as the tools see them: when it scaled a loss, when it unscaled the gradients, and what
its ``update()`` found.

Float16 training multiplies the loss by a large scale (65536 at first) so that small gradients survive; the scaled
backward then overflows now and then by design, GradScaler finds the inf when it unscales the gradients, skips the
optimizer step and halves the scale. A tool that judges inf/nan must know that such an iteration happened, and which
calls were in it; its op calls alone do not say it (``scale()`` is a plain multiplication, and a skipped iteration is
no ``optimizer.step()``, so the step counter does not move). While at least one listener is registered
(``listen``/``unlisten``, counted), ``GradScaler.scale``, ``unscale_`` and ``update`` are wrappers that tell every
listener, on the calling thread, in the order of the program's calls:

- ``loss_scaled(scaler)``: ``scaler.scale(loss)`` returned (the backward of that result is a scaled backward);
- ``gradients_unscaled(scaler)``: ``scaler.unscale_(optimizer)`` (or ``step``, which calls it) is about to run;
- ``scale_updated(scaler, values)``: ``scaler.update()`` returned. ``values`` is a 1-D float32 tensor on the
  scaler's device, computed there and never read here: the scale the iteration ran with, the scale after the update,
  then the iteration's ``found_inf`` flags (nonzero: GradScaler skipped its optimizer steps), read by the listener
  with its other device values (no host synchronisation added).

A disabled scaler tells nothing. Another patcher of these methods (TrainingMonitor patches ``scale`` and
``update``) may wrap the wrappers and put back, when it stops, what it found: a wrapper is put back only where it
is still the class's method, one left behind passes calls through while no listener is registered and is reused by
the next install, and a call through two of them (one wrapping another's patch of the other) tells once.

The values are taken with the torch function modes off (``DisableTorchFunction``): they are the tools', not the
program's calls. Per iteration: a copy of a 0-d tensor and one join on the device; nothing per op call.

>>> listen(tool); ...; unlisten(tool)     # doctest: +SKIP
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any, Callable, Protocol

import torch

from ..ops.torch_versions import GradScaler
from .shared_install import SharedInstall

_logger = logging.getLogger("op_tools")


class LossScaleListener(Protocol):
    def loss_scaled(self, scaler: Any) -> None: ...

    def gradients_unscaled(self, scaler: Any) -> None: ...

    def scale_updated(self, scaler: Any, values: torch.Tensor | None) -> None: ...


_listeners: list[LossScaleListener] = []
_lock = threading.Lock()
_originals: dict[str, Callable] = {}
_installed: dict[str, Callable] = {}


class _Inside(threading.local):
    depth = 0  # > 0 inside one of the wrappers on this thread: an inner one (wrapped by another's patch) only calls


_inside = _Inside()


def listen(listener: LossScaleListener) -> None:
    with _lock:
        _listeners.append(listener)
    _wrapping.acquire()


def unlisten(listener: LossScaleListener) -> None:
    with _lock:
        if listener not in _listeners:
            return
        _listeners.remove(listener)
    _wrapping.release()


def _current() -> list[LossScaleListener]:
    with _lock:
        return list(_listeners)


def _outermost(wrapper: Callable) -> Callable:
    """``wrapper(original)`` made to run only outside another of these wrappers on this thread (else the original)."""
    def wrap(original: Callable) -> Callable:
        told = wrapper(original)

        @functools.wraps(original)
        def method(scaler, *args, **kwargs):
            if _inside.depth:
                return original(scaler, *args, **kwargs)
            _inside.depth += 1
            try:
                return told(scaler, *args, **kwargs)
            finally:
                _inside.depth -= 1
        method._op_tools_loss_scaling = True  # type: ignore[attr-defined]
        return method
    return wrap


@_outermost
def _scale(original: Callable) -> Callable:
    def scale(scaler, outputs):
        scaled = original(scaler, outputs)
        if scaler.is_enabled():
            for listener in _current():
                listener.loss_scaled(scaler)
        return scaled
    return scale


@_outermost
def _unscale(original: Callable) -> Callable:
    def unscale_(scaler, optimizer):
        if scaler.is_enabled():
            for listener in _current():
                listener.gradients_unscaled(scaler)
        return original(scaler, optimizer)
    return unscale_


@_outermost
def _update(original: Callable) -> Callable:
    def update(scaler, *args, **kwargs):
        listeners = _current() if scaler.is_enabled() else []
        if not listeners:
            return original(scaler, *args, **kwargs)
        before, found_infs = _iteration_values(scaler)
        result = original(scaler, *args, **kwargs)
        values = None
        if before is not None:
            with torch.no_grad(), torch._C.DisableTorchFunction():
                values = torch.cat([before, scaler._scale.detach().reshape(1).float(), *found_infs])
        for listener in listeners:
            listener.scale_updated(scaler, values)
        return result
    return update


def _iteration_values(scaler) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """The scale the iteration ran with (a copy: ``update`` writes the scaler's in place) and its ``found_inf``
    flags, as ``update`` itself gathers them, on the scale's device; ``(None, [])`` where the scaler's state is not
    what this torch's GradScaler keeps (no iteration is then told skipped)."""
    try:
        scale = scaler._scale
        states = scaler._per_optimizer_states
        with torch.no_grad(), torch._C.DisableTorchFunction():
            found = [f.detach().reshape(1).float().to(device=scale.device, non_blocking=True)
                     for state in states.values() for f in state["found_inf_per_device"].values()]
            if scale is None or not found:  # update() raises its own error
                return None, []
            return scale.detach().reshape(1).float().clone(), found
    except (AttributeError, KeyError, TypeError) as error:  # another torch's GradScaler: said once, never raised
        if not _unreadable:
            _unreadable.append(error)
            _logger.warning("op_tools: GradScaler's state could not be read (%s: %s): no iteration is told skipped",
                            type(error).__name__, error)
        return None, []


_unreadable: list[Exception] = []


def _install() -> None:
    for name, wrap in (("scale", _scale), ("unscale_", _unscale), ("update", _update)):
        current = vars(GradScaler)[name]
        if getattr(current, "_op_tools_loss_scaling", False):  # left behind by an earlier install: it serves
            continue
        _originals[name] = current
        _installed[name] = wrap(current)
        setattr(GradScaler, name, _installed[name])


def _remove() -> None:
    for name, original in _originals.items():
        if vars(GradScaler).get(name) is _installed[name]:  # else another patch wraps it: left, passing calls through
            setattr(GradScaler, name, original)
    _originals.clear()
    _installed.clear()


# While a listener is registered: GradScaler's scale, unscale_ and update tell the listeners.
_wrapping = SharedInstall(_install, _remove)
