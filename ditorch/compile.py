"""``torch.compile`` on a device that inductor cannot generate code for.

Inductor emits Triton or C++ for the devices it knows; a Python PrivateUse1 device (the sim device) is not one
of them, so ``torch.compile(model)`` (backend ``"inductor"``, the default) would end in a traceback at the first
call. An adapter that knows this declares ``COMPILE_FALLBACK`` (the sim adapter: ``"aot_eager"``, AOTAutograd's
graphs run op by op); the transfer row built here sends inductor requests there, with one line on the
``ditorch`` logger, and passes every other backend as it is. Numbers equal eager's: the fallback runs the
device's own kernels.

An adapter may also declare ``COMPILE_CONFIG``, dynamo settings the device needs whatever the backend, set at the
first ``torch.compile`` and said once (sim: ``optimize_ddp=False``, see its adapter), and ``COMPILE_PREPARE``, run
then too (sim: its process group's collectives hidden from dynamo's tracer).

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


def compile_config(adapter) -> dict:
    """The ``torch._dynamo.config`` settings ``adapter`` needs for any backend (``COMPILE_CONFIG``)."""
    return dict(getattr(adapter, "COMPILE_CONFIG", {}))


def compile_prepare(adapter):
    """What ``adapter`` does once dynamo is loaded, before the first compile (``COMPILE_PREPARE``), or None."""
    return getattr(adapter, "COMPILE_PREPARE", None)


_configured = threading.Event()


def _configure(config: dict, prepare) -> str:
    """Apply ``config`` and run ``prepare`` once per process; what was set, for the line that says so ("" when
    nothing was)."""
    if (not config and prepare is None) or _configured.is_set():
        return ""
    _configured.set()
    import torch._dynamo  # imported by torch.compile anyway; not at `import ditorch`

    for name, value in config.items():
        setattr(torch._dynamo.config, name, value)
    if prepare is not None:
        prepare()
    return ", ".join(f"torch._dynamo.config.{name}={value!r}" for name, value in config.items())


def with_fallback(compile_fn, device_name: str, fallback: str, config: dict | None = None, prepare=None):
    """``torch.compile`` that runs ``fallback`` where ``backend`` is inductor (the default); other backends as asked.

    Inductor's ``mode`` and ``options`` mean nothing to the fallback and are dropped, said in the same line.
    ``config`` (dynamo settings) is applied and ``prepare`` run at the first call, whatever the backend.
    """

    @functools.wraps(compile_fn)
    def compile(model=None, *args, backend=None, mode=None, options=None, **kwargs):  # noqa: A001 - torch's name
        settings = _configure(config or {}, prepare)
        if backend is not None and backend != _INDUCTOR:  # None means inductor; another backend, as it is
            if settings:
                logger.info("ditorch: torch.compile on the %s device: %s", device_name, settings)
            return compile_fn(model, *args, backend=backend, mode=mode, options=options, **kwargs)
        if not _said.is_set():
            _said.set()
            dropped = ", ".join(f"{name}={value!r}" for name, value in (("mode", mode), ("options", options))
                                if value is not None)
            logger.warning("ditorch: torch.compile: inductor cannot generate code for the %s device; "
                           "running backend %r instead (numbers as eager's)%s%s", device_name, fallback,
                           f"; ignoring {dropped}" if dropped else "", f"; {settings}" if settings else "")
        elif settings:
            logger.info("ditorch: torch.compile on the %s device: %s", device_name, settings)
        return compile_fn(model, *args, backend=fallback, **kwargs)

    return compile
