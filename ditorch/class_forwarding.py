"""Stand-ins for torch's classes that forward construction and ``isinstance`` to the class they stand for.

Used by the transfer (``torch.Generator``) and by the ``torch.cuda`` mapping (a class the device module
answers); a module of its own so that both import it and neither imports the other for it.
"""

from __future__ import annotations

from typing import Callable


class ForwardingClassMeta(type):
    """Metaclass of a stand-in for a class: calling it builds ``_target`` from rewritten arguments,
    and ``isinstance`` answers for ``_target``'s instances (torch's C classes cannot be subclassed)."""

    _target: type

    def __call__(cls, *args, **kwargs):
        return cls._build(*args, **kwargs)

    def __instancecheck__(cls, instance) -> bool:
        return isinstance(instance, cls._target)

    def __subclasscheck__(cls, subclass) -> bool:
        return issubclass(subclass, cls._target)


def forwarding_class(name: str, target: type, build: Callable) -> type:
    return ForwardingClassMeta(name, (), {"_target": target, "_build": staticmethod(build),
                                          "__doc__": target.__doc__, "__module__": target.__module__})
