"""``python -m op_tools TOOL [options] script.py [args]``: run a script under a tool, with no edit to it.

    python -m op_tools autocompare --ops torch.nn.functional.linear,torch.softmax train.py --steps 4
    python -m op_tools capture --mode summary -m mypackage.train --steps 4
    python -m op_tools --help            # the tools
    python -m op_tools capture --help    # its options: one per keyword argument of the tool
    python -m op_tools monitor --every 10 train.py   # TrainingMonitor: no op tool, but started and stopped alike

Installed as the ``op-tools`` command too. The tool starts before the script runs and stops after it, also when
the script raises or calls ``sys.exit`` (its exit status is kept). Each option takes the text its environment
variable takes (``--ops`` as ``OP_CAPTURE_LIST``, ``--verbose 0``); a flag given alone means 1 (``--sync``).
Options win over the variables, which win over the config file (``--config``, or ``OP_TOOLS_CONFIG``).

Exit status (``op_tools.output.exit_status``): the script's own when it is not 0; else the tool's verdict: 0 clean
(every handled call checked, nothing found), 3 found something (an op failed, an inf/nan, the monitor's anomaly), 4
could not check (some calls went unchecked because the tool failed on them, a file could not be written, or the op
list matched no call). Under torchrun each rank says so in one line before a verdict's 3 or 4, so that torchrun's
``ChildFailedError`` after it is not read as a crash.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from collections.abc import Callable
from typing import Any, NoReturn, cast

from .config.settings import Family, keywords_of
from .config.tool_registry import (  # filled by the tools: the package imported them first
    FEATURES,
    NON_OP_TOOLS,
    ToolClass,
    find_tool,
    normalised_name,
    short_name,
    tool_name,
)
from .config.training_monitor import TrainingMonitorConfig
from .config.variables import CONFIG_FILE, EnvVar, parse_flag
from .core.engine import OpTool
from .output import exit_status
from .tools.training_monitor import TrainingMonitor

# The tools that handle no op: their config class (tool_registry.NON_OP_TOOLS, whose keywords are the command's
# options) -> the class run, which has start() and stop(). An op tool is both.
RUNS: dict[type, type] = {TrainingMonitorConfig: TrainingMonitor}


def _tool_names(cls: type[ToolClass]) -> list[str]:
    if cls in NON_OP_TOOLS.values():
        return [short_name(cls), tool_name(cls)]
    names = [short_name(cls), cast("type[OpTool]", cls).feature, cls.__name__, "op_" + short_name(cls)]
    return list(dict.fromkeys(names))


def _find_tool(name: str) -> type[ToolClass] | None:
    """The op tool ``name`` stands for (``find_tool``), or the config class of the tool that handles no op."""
    others = {normalised_name(n): cls for cls in NON_OP_TOOLS.values() for n in _tool_names(cls)}
    return find_tool(name) or others.get(normalised_name(name))


def _add_options(parser: argparse.ArgumentParser, cls: type[ToolClass]) -> None:
    for keyword, setting in keywords_of(cls).items():
        if isinstance(setting, Family):
            if not setting.cli_form:
                continue  # no text form (a dict): its variables or the config file set it
            help_text, flag = f"{setting.cli_form}", False
        else:
            help_text = f"as {setting.name}: {setting.form}"
            flag = setting.parse is parse_flag
        options = dict.fromkeys([f"--{keyword}", f"--{keyword.replace('_', '-')}"])
        bare_flag: dict[str, Any] = {"nargs": "?", "const": "1"} if flag else {}
        parser.add_argument(*options, dest=keyword, metavar="0|1" if flag else "TEXT", help=help_text, **bare_flag)


_FLAG_WORDS = {"0", "1", "true", "false", "yes", "no", "on", "off"}


def build_parser() -> tuple[argparse.ArgumentParser, dict[type[ToolClass], argparse.ArgumentParser]]:
    """The top parser (its help lists the tools) and one parser per tool for the options before the script."""
    parser = argparse.ArgumentParser(
        prog="python -m op_tools", description="Run a Python script under an op_tools tool, with no edit to it.",
        usage="python -m op_tools TOOL [options] (script.py | -m module) [args ...]",
        epilog="Tool names: the short names above, the class names (OpCapture) and the original ditorch's feature "
               "names (op_capture, dump_op_args, measure_op_time, cast_dtype) alike. "
               "'python -m op_tools TOOL --help' lists a tool's options.")
    tools = parser.add_subparsers(dest="tool", metavar="TOOL", required=True)
    by_class = {}
    for cls in [*FEATURES.values(), *NON_OP_TOOLS.values()]:
        names = _tool_names(cls)
        doc = " ".join((RUNS.get(cls, cls).__doc__ or "").strip().split("\n\n")[0].split())  # its first paragraph
        sub = by_class[cls] = tools.add_parser(
            names[0], aliases=names[1:], help=doc, description=doc, prog=f"python -m op_tools {names[0]}",
            usage=f"python -m op_tools {names[0]} [options] (script.py | -m module) [args ...]",
            epilog="The first argument that is not an option is the script; what follows it is the script's own "
                   "(or: -m module args ..., as python -m does).")
        _add_options(sub, cls)
        sub.add_argument("--config", metavar="FILE.toml", help=f"a config file (as {CONFIG_FILE.name})")
    return parser, by_class


def split_command(cls: type[ToolClass], argv: list[str]) -> tuple[list[str], str | None, str | None, list[str]]:
    """``argv`` after the tool name -> (the tool's options, script, module, the script's arguments): the first
    argument that is neither an option nor an option's value is the script (``-m name``: a module)."""
    flags, valued = {"-h", "--help"}, {"--config"}
    for keyword, setting in keywords_of(cls).items():
        names = {f"--{keyword}", f"--{keyword.replace('_', '-')}"}
        (flags if getattr(setting, "parse", None) is parse_flag else valued).update(names)
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "-m":
            return argv[:i], None, (argv[i + 1] if i + 1 < len(argv) else None), argv[i + 2:]
        if arg == "--" or not arg.startswith("-"):
            rest = argv[i + 1:] if arg == "--" else argv[i:]
            return argv[:i], (rest[0] if rest else None), None, rest[1:]
        if "=" not in arg and (arg in valued or (arg in flags and argv[i + 1:i + 2]
                                                   and argv[i + 1].lower() in _FLAG_WORDS)):
            i += 1  # its value
        i += 1
    return argv, None, None, []


def run_under(tool, script: str | None, argv: list[str], module: str | None = None,
              usage_error: Callable[[str], NoReturn] | None = None) -> int | str | None:
    """Run ``script`` (or ``module``) as ``__main__`` with ``sys.argv`` set, between ``tool.start()`` and
    ``tool.stop()``; its exit status (``SystemExit``'s code; 0 when it returns), or when that is 0 the tool's
    verdict (``exit_status.status_of``), said in a line on each rank under torchrun. Its exceptions propagate.
    ``usage_error`` gets what ``start()`` refused (a malformed variable or config file, a results folder it cannot
    write), before the script runs: a bad environment, not a crash."""
    try:
        tool.start()
    except (ValueError, OSError) as error:
        if usage_error is None:
            raise
        usage_error(str(error))
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    if module is None:
        assert script is not None  # main() gives a script or a module
        sys.argv = [script, *argv]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script.py` does
    else:
        sys.argv = [module, *argv]  # run_module replaces argv[0] with the module's file
        sys.path.insert(0, os.getcwd())  # as `python -m module` does
    status: int | str | None = 0
    try:
        if module is None:
            assert script is not None  # main() gives a script or a module
            runpy.run_path(script, run_name="__main__")
        else:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as done:
        status = done.code
    finally:
        try:
            tool.stop()
        finally:
            sys.argv, sys.path[:] = saved_argv, saved_path
    if status in (0, None):
        verdict = exit_status.status_of(tool.verdict())  # an op tool's, or the monitor's: each has verdict()
        exit_status.explain_under_torchrun(verdict)
        return verdict
    return status


def main(argv: list[str] | None = None) -> int | str | None:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser, by_class = build_parser()
    cls = _find_tool(argv[0]) if argv and not argv[0].startswith("-") else None
    if cls is None:
        parser.parse_args(argv[:1] or argv)  # help, or argparse's error naming the valid tools
        parser.error(f"unknown tool {argv[0]!r}")
    tool_options, script, module, args = split_command(cls, argv[1:])
    sub = by_class[cls]
    options = sub.parse_args(tool_options)
    if script is None and module is None:
        sub.error("no script to run: give script.py (or -m module) after the options")
    if script is not None and not os.path.isfile(script):
        sub.error(f"no such script: {script}")
    if options.config:
        if not os.path.isfile(options.config):  # else named as the variable it is handed on in, which was not set
            sub.error(f"--config {options.config}: no such file")
        os.environ[CONFIG_FILE.name] = options.config
    settings = {k: getattr(options, k) for k in keywords_of(cls) if getattr(options, k, None) is not None}
    for keyword, text in settings.items():  # the options are the variables' text: said in their form, not Python's
        setting = keywords_of(cls)[keyword]
        if isinstance(text, str) and isinstance(setting, EnvVar):  # a Family checks its members itself
            try:
                setting.parse(text)
            except ValueError as e:
                sub.error(f"--{keyword.replace('_', '-')} {text!r}: {e}; expected {setting.form}")
    try:
        tool = RUNS.get(cls, cls)(**settings)
    except (TypeError, ValueError) as e:
        sub.error(str(e))  # "OpCapture(mode='everything'): unknown choice ...; expected full or summary"
    return run_under(tool, script, args, module, sub.error)


if __name__ == "__main__":
    sys.exit(main())
