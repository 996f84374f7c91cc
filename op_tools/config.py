"""Environment variables of op_tools: one table, typed parsers, read once when a tool starts.

Every variable is declared here with its form, default and meaning (``VARIABLES``), so that the
docs can be generated from this table. A malformed value is a ``ValueError`` that names the
variable, the value and the expected form.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Callable

import torch


@dataclasses.dataclass(frozen=True)
class EnvVar:
    """One environment variable: ``parse(text)`` turns its text (``None`` when unset and no default) into a value."""

    name: str
    form: str
    default: str | None
    meaning: str
    parse: Callable[[str | None], Any]

    def read(self) -> Any:
        text = os.environ.get(self.name, self.default)
        try:
            return self.parse(text)
        except ValueError as e:
            raise ValueError(f"{self.name}={text!r}: {e}; expected {self.form}") from None


VARIABLES: dict[str, EnvVar] = {}


def declare(name: str, form: str, default: str | None, meaning: str, parse: Callable[[str | None], Any]) -> EnvVar:
    var = EnvVar(name, form, default, meaning, parse)
    VARIABLES[name] = var
    return var


# --- parsers: each raises ValueError saying what is wrong; EnvVar.read adds the name and the form ---

def parse_flag(text: str | None) -> bool:
    value = (text or "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise ValueError("not a flag")


def parse_text(text: str | None) -> str:
    return (text or "").strip()


def parse_directory(text: str | None) -> str:
    path = (text or "").strip()
    if path and os.path.exists(path) and not os.path.isdir(path):
        raise ValueError("exists and is not a directory")
    return path


def parse_choice(*choices: str) -> Callable[[str | None], str]:
    def parse(text: str | None) -> str:
        value = (text or "").strip().lower()
        if value not in choices:
            raise ValueError(f"unknown choice {value!r}")
        return value

    return parse


def parse_name_patterns(text: str | None) -> tuple[re.Pattern, ...] | None:
    """``None`` when unset (every name), else the compiled patterns (empty text: no name)."""
    if text is None:
        return None
    patterns = []
    for entry in filter(None, (e.strip() for e in text.split(","))):
        try:
            patterns.append(re.compile(entry))
        except re.error as e:
            raise ValueError(f"invalid regular expression {entry!r} ({e})") from None
    return tuple(patterns)


def parse_dtype(text: str) -> torch.dtype:
    dtype = getattr(torch, text.strip().removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {text.strip()!r}")
    return dtype


def parse_dtype_map(text: str | None) -> dict[torch.dtype, torch.dtype]:
    mapping = {}
    for entry in filter(None, (e.strip() for e in (text or "").split(","))):
        source, arrow, target = entry.partition("->")
        if not arrow:
            raise ValueError(f"entry {entry!r} has no '->'")
        mapping[parse_dtype(source)] = parse_dtype(target)
    return mapping


# --- shared variables ---

RESULTS_DIR = declare(
    "OP_TOOLS_RESULTS_DIR", "a directory path", "op_tools_results",
    "Where every tool writes its files (a subfolder per tool; `rank<N>` inside it under torchrun).", parse_directory,
)
VERBOSE = declare(
    "OP_TOOLS_VERBOSE", "0 or 1", "1",
    "0 silences the per-call tables; files are still written.", parse_flag,
)
PRINT_STACK = declare(
    "OP_TOOLS_PRINT_STACK", "0 or 1", "0",
    "1 prints the full user stack of each handled call instead of one source line.", parse_flag,
)
STRICT = declare(
    "OP_TOOLS_STRICT", "0 or 1", "0",
    "1 makes a failure inside a tool raise instead of being reported once per op and ignored.", parse_flag,
)

# Tool prefixes in the original's naming; each gets OP_<PREFIX>_LIST and OP_<PREFIX>_DISABLE_LIST.
TOOL_PREFIXES = ("OP_CAPTURE", "OP_OBSERVE", "OP_OVERFLOW_CHECK", "OP_FALLBACK", "OP_DTYPE_CAST", "OP_TIME_MEASURE",
                 "OP_AUTOCOMPARE")
_LIST_FORM = "comma-separated op names or regular expressions matching the whole name, e.g. 'torch.add,.*linear.*'"


def declare_op_lists(prefix: str) -> tuple[EnvVar, EnvVar]:
    """Declare ``<prefix>_LIST`` and ``<prefix>_DISABLE_LIST`` (later tools call this for theirs)."""
    return (
        declare(f"{prefix}_LIST", _LIST_FORM, None,
                "Ops the tool handles. Unset: all; empty: none. Plain names only: the tool wraps those functions "
                "and costs nothing on other calls; any pattern: every call's name is checked.", parse_name_patterns),
        declare(f"{prefix}_DISABLE_LIST", _LIST_FORM, None,
                "Ops the tool never handles; wins over the LIST.", parse_name_patterns),
    )


OP_LISTS = {prefix: declare_op_lists(prefix) for prefix in TOOL_PREFIXES}

CAPTURE_MODE = declare(
    "OP_CAPTURE_MODE", "full or summary", "full",
    "summary records only op names, argument metadata and counts, and writes one aggregated table per run.",
    parse_choice("full", "summary"),
)
CAPTURE_DEDUP = declare(
    "OP_CAPTURE_DEDUP", "0 or 1", "1",
    "1 stores a tensor whose values were already written (same dtype, sizes, strides and bytes) once and "
    "references it; 0 writes every argument in full.", parse_flag,
)
OVERFLOW_CHECK_RAISE = declare(
    "OP_OVERFLOW_CHECK_RAISE", "0 or 1", "0",
    "1 raises OverflowDetectedError at the first op producing inf/nan from finite inputs.", parse_flag,
)
TIME_MEASURE_SYNC = declare(
    "OP_TIME_MEASURE_SYNC", "0 or 1", "0",
    "1 times each call between two synchronisations of its device (host clock) instead of with timing events "
    "on its stream: the time of all work queued meanwhile, at the cost of a host synchronisation per call.",
    parse_flag,
)
DTYPE_CAST_DICT = declare(
    "OP_DTYPE_CAST_DICT", "comma-separated 'torch.<dtype>->torch.<dtype>' pairs",
    "torch.float16->torch.float32,torch.bfloat16->torch.float32",
    "Which input dtypes OpDtypeCast widens, and to what.", parse_dtype_map,
)

# OpAutoCompare. The tolerance variables keep the original's names and priority:
# <OPNAME>_AUTOCOMPARE_ERROR_TOLERANCE_<DTYPE> > AUTOCOMPARE_ERROR_TOLERANCE_<DTYPE> > AUTOCOMPARE_ERROR_TOLERANCE,
# OPNAME being the last component of the op name, upper-cased (torch.nn.functional.linear -> LINEAR).
AUTOCOMPARE_BACKWARD = declare(
    "OP_AUTOCOMPARE_BACKWARD", "0 or 1", "1",
    "1 also compares the gradients of each compared op's inputs; 0 compares forward results only.", parse_flag,
)


def parse_count(text: str | None) -> int:
    try:
        value = int((text or "").strip())
    except ValueError:
        raise ValueError("not an integer") from None
    if value < 0:
        raise ValueError("must be >= 0")
    return value


AUTOCOMPARE_MAX_SAVED = declare(
    "OP_AUTOCOMPARE_MAX_SAVED", "an integer >= 0", "3",
    "How many failing calls of each op are saved for the offline replay (written in the background); the rest "
    "are counted in the summary. 0 saves none.", parse_count,
)
_TOLERANCE_FORM = "'atol,rtol', e.g. '1e-3,1e-3'"
_TOLERANCE_MEANING = ("When any tolerance variable applies to an output, allclose under it decides instead of the "
                      "comparison with a same-dtype CPU run. Priority: per op and dtype > per dtype > global.")
AUTOCOMPARE_TOLERANCES = tuple(
    declare(name, _TOLERANCE_FORM, None, _TOLERANCE_MEANING, parse_text)
    for name in ("AUTOCOMPARE_ERROR_TOLERANCE", "AUTOCOMPARE_ERROR_TOLERANCE_<DTYPE>",
                 "<OPNAME>_AUTOCOMPARE_ERROR_TOLERANCE_<DTYPE>")
)
AUTOCOMPARE_CAST = declare(
    "<OPNAME>_OP_DTYPE_CAST_DICT", "comma-separated 'torch.<dtype>->torch.<dtype>' pairs",
    "torch.float16->torch.float64,torch.bfloat16->torch.float64,torch.float32->torch.float64",
    "The dtypes OpAutoCompare's CPU reference computes <OPNAME> in (OPNAME as for the tolerances).",
    parse_dtype_map,
)


class OpFilter:
    """Which op names a tool handles, from its LIST and DISABLE_LIST; decisions cached per name."""

    def __init__(self, allow: tuple[re.Pattern, ...] | None, deny: tuple[re.Pattern, ...] | None) -> None:
        self.allow = allow
        self.deny = deny or ()
        self._decisions: dict[str, bool] = {}

    @classmethod
    def from_env(cls, prefix: str) -> OpFilter:
        allow_var, deny_var = OP_LISTS.get(prefix) or declare_op_lists(prefix)
        return cls(allow_var.read(), deny_var.read())

    def exact_names(self) -> tuple[str, ...] | None:
        """The LIST's names when each entry is a plain dotted name (no regular-expression syntax), else ``None``."""
        if not self.allow or not all(_PLAIN_NAME.fullmatch(p.pattern) for p in self.allow):
            return None
        return tuple(dict.fromkeys(p.pattern for p in self.allow))

    def allows(self, name: str) -> bool:
        decision = self._decisions.get(name)
        if decision is None:
            decision = not _matches(self.deny, name) and (self.allow is None or _matches(self.allow, name))
            self._decisions[name] = decision
        return decision


# A '.' in such an entry could match any character as a regular expression; no two op names differ only there.
_PLAIN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def _matches(patterns, name: str) -> bool:
    return any(p.pattern == name or p.fullmatch(name) for p in patterns)


@dataclasses.dataclass(frozen=True)
class CommonConfig:
    """The variables every tool shares, read once at ``start()``."""

    results_dir: str
    verbose: bool
    print_stack: bool
    strict: bool
    rank: int | None

    @classmethod
    def from_env(cls) -> CommonConfig:
        return cls(RESULTS_DIR.read() or "op_tools_results", VERBOSE.read(), PRINT_STACK.read(), STRICT.read(),
                   _torchrun_rank())


def _torchrun_rank() -> int | None:
    # torchrun (and torch.distributed.launch) export RANK and WORLD_SIZE to every worker.
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        try:
            return int(os.environ["RANK"])
        except ValueError:
            return None
    return None
