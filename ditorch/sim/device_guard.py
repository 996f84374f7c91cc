"""Sim's device guard: PyTorch's Python device guard, with a user's exception in backward carried to its caller.

A Python PrivateUse1 backend's device guard (``torch._C._acc.DeviceGuard``) answers every question the engine asks
it (``getDevice``, ``exchangeStream``) by calling its Python ``type_``, some of them from ``noexcept`` C++ methods.
When a Python hook raises during backward (``Tensor.register_hook``, a module's full backward hook), the autograd
engine unwinds with that exception still pending in the interpreter, and the stream guard of the failed node,
destroyed on the way, calls ``type_``: CPython refuses a call while an exception is pending, the ``noexcept`` method
throws, and the process aborts ("terminate called without an active exception"). A device whose guard is C++ (CUDA,
Ascend) reports the hook's exception from ``backward()`` instead, unchanged.

So sim's ``type_`` first takes any pending exception (``TAKEN``): a call to ``PyErr_Occurred`` through
``ctypes.pythonapi``, which raises the pending exception, if there is one, where ``type_`` can catch it. The engine
then fails the backward with nothing pending (``run_backward`` "returned NULL without setting an exception"), and
``raise_taken`` (called by ``multi_device.SimEngine`` there) raises the taken exception in its place: the hook's own
exception object, with the hook's traceback.
"""

from __future__ import annotations

import ctypes
import logging
import threading

import torch

# Any pythonapi function fails when an exception is pending (ctypes checks after each call): the probe that raises it.
_probe = ctypes.pythonapi.PyErr_Occurred
_probe.restype = ctypes.c_void_p  # an address: no reference taken
_PRIVATE_USE1 = torch._C._autograd.DeviceType.PrivateUse1


class _Taken:
    """Exceptions taken from unwinding C++ by the guard, until backward's caller raises them."""

    def __init__(self) -> None:
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()

    def add(self, error: BaseException) -> None:
        tb = error.__traceback__
        if tb is not None and tb.tb_frame.f_code is SimDeviceGuard.type_.__code__:
            error.__traceback__ = tb.tb_next  # the guard's frame is not the user's: the traceback ends where it was
        with self._lock:
            self.errors.append(error)
        if torch._C._current_graph_task_id() == -1:  # not in a backward: no run_backward will raise it; said here
            logging.getLogger("ditorch").warning(
                "sim: %s: %s was pending when PyTorch asked the device guard; the call that raised it will fail "
                "with a SystemError", type(error).__name__, error)

    def pop(self) -> BaseException | None:
        with self._lock:
            return self.errors.pop(0) if self.errors else None


TAKEN = _Taken()


class SimDeviceGuard(torch._C._acc.DeviceGuard):
    """PyTorch's Python device guard (one device, index 0, as ``_DummyDeviceGuard``), safe to call while an
    exception is pending."""

    def type_(self):
        try:
            _probe()  # first: with an exception pending, any other call would fail before it is taken
        except BaseException as pending:  # noqa: BLE001 - whatever was unwinding, the user's to see
            TAKEN.add(pending)
        return _PRIVATE_USE1


def raise_taken() -> None:
    """Raise the first exception the guard took (a user's hook's, during backward), if any: called where backward
    failed with nothing pending."""
    error = TAKEN.pop()
    if error is not None:
        raise error
