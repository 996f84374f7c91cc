"""``torch.compile`` on a device that inductor cannot generate code for.

Inductor emits Triton or C++ for the devices it knows; a Python PrivateUse1 device (the sim device) is not one
of them, so ``torch.compile(model)`` (backend ``"inductor"``, the default) would end in a traceback at the first
call. An adapter that knows this declares ``COMPILE_FALLBACK`` (the sim adapter: ``"aot_eager"``, AOTAutograd's
graphs run op by op); the transfer row built here sends inductor requests there, with one line on the
``ditorch`` logger, and passes every other backend as it is. Numbers equal eager's: the fallback runs the
device's own kernels.

An adapter may also declare ``COMPILE_PREPARE``, what the device needs whatever the backend, run at the first
``torch.compile`` and said once (sim: dynamo's ``optimize_ddp=False``, its process group hidden from dynamo's tracer).

>>> import torch, ditorch                        # doctest: +SKIP  (DITORCH_BACKEND=sim)
>>> torch.compile(torch.nn.Linear(2, 2).cuda())  # doctest: +SKIP  (logs: ... runs "aot_eager" instead)
"""

from __future__ import annotations

import functools
import logging
import threading

logger = logging.getLogger("ditorch")

_INDUCTOR = "inductor"
_said: set[str] = set()  # the settings dropped, each said once per process ("" for none: the fallback itself)
_said_lock = threading.Lock()


def fallback_backend(adapter) -> str | None:
    """The backend ``adapter`` runs instead of inductor, or None where inductor targets the device."""
    return getattr(adapter, "COMPILE_FALLBACK", None)


def compile_prepare(adapter):
    """What ``adapter`` does at the first ``torch.compile`` (``COMPILE_PREPARE``: returns what it set), or None."""
    return getattr(adapter, "COMPILE_PREPARE", None)


_prepared = threading.Event()


def _prepare_once(prepare) -> str:
    """Run ``prepare`` once per process; what it set, for the line that says so ("" when nothing was)."""
    if prepare is None or _prepared.is_set():
        return ""
    _prepared.set()
    return prepare()


def with_fallback(compile_fn, device_name: str, fallback: str, prepare=None):
    """``torch.compile`` that runs ``fallback`` where ``backend`` is inductor (the default); other backends as asked.

    Inductor's ``mode`` and ``options`` mean nothing to the fallback and are dropped, said in the same line.
    ``prepare`` (the adapter's ``COMPILE_PREPARE``) runs at the first call, whatever the backend.
    """

    @functools.wraps(compile_fn)
    def compile(model=None, *args, backend=None, mode=None, options=None, **kwargs):  # noqa: A001 - torch's name
        settings = _prepare_once(prepare)
        if backend is not None and backend != _INDUCTOR:  # None means inductor; another backend, as it is
            if settings:
                logger.info("ditorch: torch.compile on the %s device: %s", device_name, settings)
            return compile_fn(model, *args, backend=backend, mode=mode, options=options, **kwargs)
        dropped = ", ".join(f"{name}={value!r}" for name, value in (("mode", mode), ("options", options))
                            if value is not None)
        with _said_lock:  # the fallback once, and each other mode or options dropped once (a later
            # torch.compile(mode="max-autotune") after a plain one went unsaid)
            first = dropped not in _said and (bool(dropped) or not _said)
            _said.add(dropped)
        if first:
            logger.warning("ditorch: torch.compile: inductor cannot generate code for the %s device; "
                           "running backend %r instead (eager's kernels, traced: under autocast the backward keeps the "
                           "forward's autocast, as compiled code on CUDA does)%s%s", device_name, fallback,
                           f"; ignoring {dropped}" if dropped else "", f"; {settings}" if settings else "")
        elif settings:
            logger.info("ditorch: torch.compile on the %s device: %s", device_name, settings)
        return compile_fn(model, *args, backend=fallback, **kwargs)

    return compile
