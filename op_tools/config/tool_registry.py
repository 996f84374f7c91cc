"""The registry of tools: ``FEATURES`` (filled by the ``@feature`` class decorator) and the names each tool goes by.

The engine, the settings, ``apply_feature`` and ``python -m op_tools`` all read it; it imports none of them, so
each can import it from the top (the engine's import of the settings no longer closes a circle through it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Protocol

if TYPE_CHECKING:  # annotations only: at run time the registry holds whatever classes @feature is given
    from ..core.engine import OpTool

FEATURES: dict[str, type[OpTool]] = {}


class ToolClass(Protocol):
    """What the settings read of a tool's class: an ``OpTool`` subclass, or the config class of a tool that handles
    no op (``NON_OP_TOOLS``)."""

    env_prefix: ClassVar[str]  # OP_<TOOL>: the prefix of its op lists (LIST, DISABLE_LIST); "": it has none
    keywords: ClassVar[dict]  # its own keyword arguments -> the variable each stands for


# Tools that handle no op (TrainingMonitor), by short name -> their config class (a ToolClass with a ``tool_name``):
# apply_feature does not take them, but the config file has a section for each and ``python -m op_tools`` runs them.
NON_OP_TOOLS: dict[str, type[ToolClass]] = {}


def non_op_tool(name: str):
    """Class decorator: register the config class of a tool that handles no op under its short name ``name``."""

    def register(cls):
        NON_OP_TOOLS[name] = cls
        return cls

    return register


def tool_name(cls: type[ToolClass]) -> str:
    """The class users call: an op tool's own; for a config class in ``NON_OP_TOOLS``, its ``tool_name``."""
    return getattr(cls, "tool_name", cls.__name__)


def feature(name: str):
    """Class decorator: make a tool available to ``apply_feature`` under ``name``."""

    def register(cls):
        cls.feature = name
        FEATURES[name] = cls
        return cls

    return register


def short_name(cls: type[ToolClass]) -> str:
    """The tool's name on the command line and in the config file: ``OP_TIME_MEASURE`` -> ``time_measure``; a tool
    that handles no op, the name it is registered by (``monitor``)."""
    registered = [name for name, other in NON_OP_TOOLS.items() if other is cls]
    return registered[0] if registered else cls.env_prefix.removeprefix("OP_").lower()


def tool_sections() -> dict[str, type[ToolClass]]:
    """Section name -> tool class (a config class for a tool that handles no op), for every registered tool."""
    return {**{short_name(cls): cls for cls in FEATURES.values() if cls.env_prefix}, **NON_OP_TOOLS}


def tool_aliases() -> dict[str, type[OpTool]]:
    """Every name a tool goes by, normalised (lower case, ``-`` as ``_``) -> its class: the class name
    (``OpCapture``), the short name (``capture``, as ``python -m op_tools`` and the config file take it), the
    original ditorch's feature name (``op_capture``, ``dump_op_args``, ``measure_op_time``, ``cast_dtype``) and
    ``op_<short>``."""
    table: dict[str, type[OpTool]] = {}
    for cls in FEATURES.values():
        for name in (cls.__name__, short_name(cls), cls.feature, "op_" + short_name(cls)):
            table.setdefault(normalised_name(name), cls)
    return table


def normalised_name(name: str) -> str:
    """A tool name as ``tool_aliases`` keys it: ``" Dump-Op-Args"`` -> ``dump_op_args``."""
    return name.strip().lower().replace("-", "_")


def find_tool(name: str) -> type[OpTool] | None:
    """The tool class ``name`` stands for (see ``tool_aliases``), or ``None``."""
    return tool_aliases().get(normalised_name(name))
