"""A tool's settings given as keyword arguments or in a config file, parsed into what the variables give.

Each keyword stands for one variable (``ops`` for ``OP_<TOOL>_LIST``, ``mode`` for ``OP_CAPTURE_MODE``, …) and
its value goes through that variable's own parser (``EnvVar.value_of``): text in the variable's form, or a
Python value of the parsed type's kind (a list of names, a bool, a dict of dtypes). A keyword that stands for
a family of variables (OpAutoCompare's ``tolerance``) is a ``Family`` with its own converter.

Precedence: arguments > environment variables > config file > defaults (``config.Sources``).

The config file (``OP_TOOLS_CONFIG=path.toml``) uses the same keywords, in a section per tool (its short name,
as ``python -m op_tools`` takes it) and ``[op_tools]`` for the settings every tool shares::

    [op_tools]
    results_dir = "debug_results"

    [autocompare]
    ops = ["torch.nn.functional.linear", ".*softmax.*"]
    tolerance.bfloat16 = [1e-2, 1e-2]

    [capture]
    mode = "summary"
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
import sys
from collections.abc import Mapping
from typing import Any, Callable

from .tool_registry import ToolClass, find_tool, short_name, tool_name, tool_sections
from .variables import (
    CONFIG_FILE,
    PRINT_RANKS,
    PRINT_STACK,
    RESULTS_DIR,
    STRICT,
    VERBOSE,
    EnvVar,
    Sources,
    declare_op_lists,
)

SHARED_SECTION = "op_tools"
SHARED = {"results_dir": RESULTS_DIR, "verbose": VERBOSE, "print_stack": PRINT_STACK, "strict": STRICT,
          "print_ranks": PRINT_RANKS}


@dataclasses.dataclass(frozen=True)
class Family:
    """A keyword standing for a family of variables (``<OPNAME>_AUTOCOMPARE_ERROR_TOLERANCE_<DTYPE>``): ``name`` is
    its key in ``Sources``, ``convert`` turns a Python value into what the tool reads."""

    name: str
    convert: Callable[[Any], Any]
    argument_form: str
    cli_form: str = ""  # how to write it as text on the command line; empty: no text form

    def value_of(self, value: Any) -> Any:
        return self.convert(value)


def keywords_of(cls: type[ToolClass]) -> dict[str, EnvVar | Family]:
    """Every keyword ``cls`` takes, with the variable (or family) it stands for: ``ops``/``disable`` (its LIST and
    DISABLE_LIST), its own (``cls.keywords``), then those every tool shares."""
    table: dict[str, EnvVar | Family] = {}
    if cls.env_prefix:
        table["ops"], table["disable"] = declare_op_lists(cls.env_prefix)
    table.update(cls.keywords)
    table.update(SHARED)
    return table


def signature_of(cls: type[ToolClass]) -> inspect.Signature:
    """``Tool(*, ops=None, disable=None, …)``: what ``help()`` and editors show for the keyword table."""
    return inspect.Signature([inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=None)
                              for k in keywords_of(cls)])


def did_you_mean(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def _value(setting: EnvVar | Family, value: Any, where: str) -> Any:
    try:
        return setting.value_of(value)
    except (ValueError, TypeError) as e:
        raise type(e)(f"{where}: {e}; expected {setting.argument_form}") from None


def validate_arguments(cls: type[ToolClass], given: dict[str, Any]) -> dict[str, Any]:
    """The parsed values of a tool's keyword arguments, by variable name (``None``: not given, the variable or the
    file decides). An unknown keyword is a TypeError, a malformed value a ValueError or TypeError, each naming it."""
    table = keywords_of(cls)
    parsed = {}
    for key, value in given.items():
        setting = table.get(key)
        if setting is None:
            raise TypeError(f"{tool_name(cls)}() got an unexpected keyword argument {key!r}"
                            f"{did_you_mean(key, table)} (it takes {', '.join(table)})")
        if value is not None:
            parsed[setting.name] = _value(setting, value, f"{tool_name(cls)}({key}={value!r})")
    return parsed


def sources_for(tool) -> Sources:
    """What ``EnvVar.read`` needs for ``tool``: its arguments and the config file's values for it."""
    return Sources(tool.arguments, file_values(type(tool)))


def origin(tool, keyword: str) -> str:
    """Where ``tool``'s value of ``keyword`` came from: ``OpCapture(ops=...)``, the variable, or the file's key."""
    setting = keywords_of(type(tool))[keyword]
    if setting.name in tool.arguments:
        return f"{type(tool).__name__}({keyword}=...)"
    if setting.name in os.environ or setting.name not in (tool.sources.file if tool.sources else {}):
        return setting.name
    return f"{CONFIG_FILE.read()}: [{short_name(type(tool))}] {keyword}"


# --- the config file ---

def file_values(cls: type[ToolClass]) -> dict[str, Any]:
    """The config file's values for ``cls`` by variable name: ``[op_tools]``, then its own section over it."""
    path = CONFIG_FILE.read()
    if not path:
        return {}
    try:
        stamp = os.stat(path).st_mtime_ns
    except OSError as e:
        raise ValueError(f"{CONFIG_FILE.name}={path!r}: cannot read it ({e.strerror}); "
                         f"expected {CONFIG_FILE.form}") from None
    sections = _load(path, stamp)
    return {**sections.get(SHARED_SECTION, {}), **sections.get(short_name(cls), {})}


_loaded: dict[tuple[str, int], dict] = {}


def _load(path: str, stamp: int) -> dict[str, dict[str, Any]]:
    """Every section of the file, parsed and validated (once per version of the file)."""
    key = (os.path.abspath(path), stamp)
    if key not in _loaded:
        _loaded.clear()
        _loaded[key] = _parse_file(path, _read_toml(path))
    return _loaded[key]


def _read_toml(path: str) -> dict:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python < 3.11
        try:
            import tomli as tomllib
        except ImportError:
            raise ImportError(f"{CONFIG_FILE.name}={path!r}: reading a TOML file needs Python >= 3.11 or the "
                              "'tomli' package (pip install tomli)") from None
    with open(path, "rb") as f:
        try:
            return tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{CONFIG_FILE.name}={path!r}: not valid TOML ({e})") from None


def _parse_file(path: str, document: dict) -> dict[str, dict[str, Any]]:
    tools = tool_sections()
    parsed: dict[str, dict[str, Any]] = {}
    for section, values in document.items():
        if not isinstance(values, dict):
            raise ValueError(f"{path}: {section} = {values!r} is outside any section; settings go under "
                             f"[{SHARED_SECTION}] (every tool) or a tool's section ([capture], [autocompare], …)")
        table: Mapping[str, EnvVar | Family]
        if section == SHARED_SECTION:
            table = SHARED
        elif section in tools:
            table = keywords_of(tools[section])
        else:
            alias = find_tool(section)
            close = [short_name(alias)] if alias is not None else difflib.get_close_matches(
                section, [SHARED_SECTION, *tools], n=1, cutoff=0.6)
            hint = f"; did you mean [{close[0]}]?" if close else ""
            raise ValueError(f"{path}: unknown section [{section}]{hint} (sections: [{SHARED_SECTION}], "
                             + ", ".join(f"[{name}]" for name in tools) + ")")
        parsed[section] = {}
        for key, value in values.items():
            setting = table.get(key)
            if setting is None:
                by_variable = [k for k, s in table.items() if s.name == key]
                hint = f"; did you mean {by_variable[0]}?" if by_variable else did_you_mean(key, table)
                raise ValueError(f"{path}: [{section}] {key}: unknown setting{hint} "
                                 f"([{section}] takes {', '.join(table)})")
            parsed[section][setting.name] = _value(setting, value, f"{path}: [{section}] {key} = {value!r}")
    return parsed
