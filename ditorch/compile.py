"""``torch.compile`` on a device that inductor cannot generate code for.

Inductor emits Triton or C++ for the devices it knows; a Python PrivateUse1 device (the sim device) is not one
of them, so ``torch.compile(model)`` (backend ``"inductor"``, the default) would end in a traceback at the first
call. An adapter that knows this declares ``COMPILE_FALLBACK`` (the sim adapter: ``"aot_eager"``, AOTAutograd's
graphs run op by op); the transfer row built here sends inductor requests there, with one line on the
``ditorch`` logger, and passes every other backend as it is. Numbers equal eager's: the fallback runs the
device's own kernels.

>>> import torch, ditorch                        # doctest: +SKIP  (DITORCH_BACKEND=sim)
>>> torch.compile(torch.nn.Linear(2, 2).cuda())  # doctest: +SKIP  (logs: ... runs "aot_eager" instead)
"""

from __future__ import annotations

import functools
import logging
import threading

logger = logging.getLogger("ditorch")

_INDUCTOR = "inductor"
_said = threading.Event()  # the fallback is said once per process


def fallback_backend(adapter) -> str | None:
    """The backend ``adapter`` runs instead of inductor, or None where inductor targets the device."""
    return getattr(adapter, "COMPILE_FALLBACK", None)


def with_fallback(compile_fn, device_name: str, fallback: str):
    """``torch.compile`` that runs ``fallback`` where ``backend`` is inductor (the default); other backends as asked.

    Inductor's ``mode`` and ``options`` mean nothing to the fallback and are dropped, said in the same line.
    """

    @functools.wraps(compile_fn)
    def compile(model=None, *args, backend=None, mode=None, options=None, **kwargs):  # noqa: A001 - torch's name
        if backend is not None and backend != _INDUCTOR:  # None means inductor; another backend, as it is
            return compile_fn(model, *args, backend=backend, mode=mode, options=options, **kwargs)
        if not _said.is_set():
            _said.set()
            dropped = ", ".join(f"{name}={value!r}" for name, value in (("mode", mode), ("options", options))
                                if value is not None)
            logger.warning("ditorch: torch.compile: inductor cannot generate code for the %s device; "
                           "running backend %r instead (numbers as eager's)%s", device_name, fallback,
                           f"; ignoring {dropped}" if dropped else "")
        return compile_fn(model, *args, backend=fallback, **kwargs)

    return compile
