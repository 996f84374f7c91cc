"""The registry of tools: ``FEATURES`` (filled by the ``@feature`` class decorator) and the names each tool goes by.

The engine, the settings, ``apply_feature`` and ``python -m op_tools`` all read it; it imports none of them, so
each can import it from the top (the engine's import of the settings no longer closes a circle through it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: at run time the registry holds whatever classes @feature is given
    from ..core.engine import OpTool

FEATURES: dict[str, type[OpTool]] = {}


def feature(name: str):
    """Class decorator: make a tool available to ``apply_feature`` under ``name``."""

    def register(cls):
        cls.feature = name
        FEATURES[name] = cls
        return cls

    return register


def short_name(cls: type[OpTool]) -> str:
    """The tool's name on the command line and in the config file: ``OP_TIME_MEASURE`` -> ``time_measure``."""
    return cls.env_prefix.removeprefix("OP_").lower()


def tool_sections() -> dict[str, type[OpTool]]:
    """Section name -> tool class, for every registered tool."""
    return {short_name(cls): cls for cls in FEATURES.values() if cls.env_prefix}


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
