"""Calls that draw random numbers: known by name, by their arguments, or caught by a generator's state moving.

A rerun of such a call on the CPU draws other numbers (another generator, another stream): comparing the two
says nothing, and the rerun would consume the user's random stream. OpAutoCompare never reruns them; it
counts them as not comparable. A random call written in Python out of torch calls (``COMPOSITES``: attention with
dropout) is run with those calls handled one by one, so the ones that draw nothing are compared; a random call
that is one op with more inside (``scaled_dot_product_attention`` with ``dropout_p``) is compared with its draws
replayed where they can be (``op_facts``' ``replays_dropout``), else says why not in its reason.

>>> random_reason("torch.nn.functional.dropout", (x,), {"p": 0.1, "training": True})
'random'
>>> random_reason("torch.nn.functional.dropout", (x,), {"p": 0.1, "training": False}) is None   # the identity
True
"""

from __future__ import annotations

from typing import Callable

import torch

from .op_facts import OpsWith, op_facts

# Which ops draw is in ``op_facts`` (``random``, ``draws_when``, ``random_note``); those written in Python out of
# torch calls (``composite``), OpAutoCompare runs with their calls handled one by one.
COMPOSITES = OpsWith("composite")


def random_reason(name: str, args: tuple, kwargs: dict) -> str | None:
    """``'random'`` when this call draws random numbers (by its name, or its probability and training arguments)."""
    facts = op_facts(name)
    if facts.random:
        return "random"
    if facts.draws_when is None:
        return None
    probability, training = facts.draws_when
    if training is not None and not _value(args, kwargs, training):
        return None
    if probability[0] is None:
        return "random"
    return "random" if _positive(_value(args, kwargs, probability)) else None


def skip_text(name: str) -> str:
    """The skip reason of a random call that is not run as a composite: ``'random'``, or what its one op hides."""
    return op_facts(name).random_note or "random"


def _value(args: tuple, kwargs: dict, where):
    position, keyword, default = where
    return args[position] if position < len(args) else kwargs.get(keyword, default)


def _positive(p) -> bool:
    try:
        return p is None or float(p) > 0
    except (TypeError, ValueError):
        return True  # a tensor probability or something unexpected: assume it draws


class GeneratorProbe:
    """A cheap token of a device's default generator: compare two to know whether a call drew random numbers.

    CUDA-like generators expose their Philox offset (no synchronisation); others their state bytes (the sim
    device's generator is the CPU's: 5 KB, about a microsecond).
    """

    def __init__(self, device: torch.device) -> None:
        self._read = _reader(device)

    def token(self):
        return self._read() if self._read is not None else None


def _reader(device: torch.device):
    generator: torch.Generator | None
    if device.type == "cpu":
        generator = torch.default_generator
    else:
        module = getattr(torch, device.type, None)
        generators = getattr(module, "default_generators", None)
        index = device.index if device.index is not None else _current(module)
        generator = generators[index] if generators is not None and index is not None and index < len(generators) \
            else None
        if generator is None:
            get_state = getattr(module, "get_rng_state", None)
            if not callable(get_state):
                return None
            return lambda: bytes(get_state().numpy())
    try:
        generator.get_offset()
    except (RuntimeError, AttributeError):
        return lambda: bytes(generator.get_state().numpy())
    return generator.get_offset


def _current(module) -> int | None:
    current = getattr(module, "current_device", None)
    try:
        return current() if callable(current) else 0
    except Exception:  # noqa: BLE001 - a device module that cannot answer: use its first generator
        return 0


def device_rng(device: torch.device) -> tuple[Callable[[], torch.Tensor], Callable[[torch.Tensor], None]] | None:
    """``(get_state, set_state)`` of the device's default generator, through its device module; None without one."""
    if device.type == "cpu":
        return torch.get_rng_state, torch.set_rng_state
    module = getattr(torch, device.type, None)
    get_state, set_state = getattr(module, "get_rng_state", None), getattr(module, "set_rng_state", None)
    if not callable(get_state) or not callable(set_state):
        return None
    index = device.index if device.index is not None else _current(module)
    return (lambda: get_state(index)), (lambda state: set_state(state, index))


def cpu_generator_token() -> bytes:
    """The CPU default generator's state: the CPU reference must leave it as it found it."""
    return bytes(torch.default_generator.get_state().numpy())
