"""Environment variables of op_tools: one table, typed parsers, read once when a tool starts.

Every variable is declared here with its form, default and meaning (``VARIABLES``), so that the
docs can be generated from this table. A malformed value is a ``ValueError`` that names the
variable, the value and the expected form.

A setting can also be given as a tool's keyword argument or in the config file (``settings.py``): the
value is turned into the variable's parsed type by the variable's own ``parse`` (text) or ``convert``
(any other Python value), and handed to ``EnvVar.read`` through ``Sources``. Precedence: arguments >
environment variables > config file > default.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import threading
from collections.abc import Iterator, Mapping
from typing import Any, Callable

import torch

from .step_selection import convert_steps, parse_steps


@dataclasses.dataclass(frozen=True)
class Sources:
    """Parsed values given other than by the environment, by variable name: a tool's arguments (they win over the
    variables) and the config file's (the variables win over them)."""

    arguments: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    file: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class EnvVar:
    """One environment variable: ``parse(text)`` turns its text (``None`` when unset and no default) into a value;
    ``convert(value)`` does the same for a Python value given as an argument or in the config file (``value_form``
    says how to write one)."""

    name: str
    form: str
    default: str | None
    meaning: str
    parse: Callable[[str | None], Any]
    convert: Callable[[Any], Any] | None = None
    value_form: str = ""

    def read(self, sources: Sources | None = None) -> Any:
        if sources is not None and self.name in sources.arguments:
            return sources.arguments[self.name]
        text = os.environ.get(self.name)
        if getattr(_recording, "reads", None) is not None:
            _recording.reads[self.name] = text
        if text is None and sources is not None and self.name in sources.file:
            return sources.file[self.name]
        text = self.default if text is None else text
        try:
            return self.parse(text)
        except ValueError as e:
            raise ValueError(f"{self.name}={text!r}: {e}; expected {self.form}") from None

    def value_of(self, value: Any) -> Any:
        """``value`` (text in the variable's form, or a Python value) as ``read`` returns it; ValueError or
        TypeError saying why not (the caller names the argument or the file's key)."""
        if isinstance(value, str):
            return self.parse(value)
        if self.convert is None:
            raise TypeError(f"not text but {type(value).__name__}")
        return self.convert(value)

    @property
    def argument_form(self) -> str:
        return self.value_form or self.form


_recording = threading.local()  # .reads: {name: text or None} of the variables read, while recorded_reads() runs


@contextlib.contextmanager
def recorded_reads() -> Iterator[dict[str, str | None]]:
    """The variables ``EnvVar.read`` takes from the environment on this thread meanwhile, with their texts (None:
    unset): what a tool's configuration was read from, to tell whether one changed while it ran."""
    outer, _recording.reads = getattr(_recording, "reads", None), {}
    try:
        yield _recording.reads
    finally:
        _recording.reads = outer


def changed_since(reads: Mapping[str, str | None]) -> list[str]:
    """The variables of ``reads`` whose text in the environment is not the one read."""
    return [name for name, text in reads.items() if os.environ.get(name) != text]


VARIABLES: dict[str, EnvVar] = {}


def declare(name: str, form: str, default: str | None, meaning: str, parse: Callable[[str | None], Any],
            convert: Callable[[Any], Any] | None = None, value_form: str = "") -> EnvVar:
    var = EnvVar(name, form, default, meaning, parse, convert, value_form)
    VARIABLES[name] = var
    return var


# --- parsers: each raises ValueError saying what is wrong; EnvVar.read adds the name and the form ---

def parse_flag(text: str | None) -> bool:
    value = (text or "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    if value.isdigit():  # the original ditorch read its flags as int(value) > 0: OP_TOOLS_PRINT_STACK=2 is on
        return int(value) > 0
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
    return _compile_patterns(text.split(","))


def _compile_patterns(entries) -> tuple[re.Pattern, ...]:
    patterns = []
    for entry in filter(None, (e.strip() for e in entries)):
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


def parse_dtype_map(text: str | None, pair=None) -> dict[torch.dtype, torch.dtype]:
    """``'torch.float16->torch.float32,...'`` -> ``{source: target}``, each pair checked by ``pair`` (by default
    ``widening``)."""
    check = pair or widening
    mapping: dict[torch.dtype, torch.dtype] = {}
    for entry in filter(None, (e.strip() for e in (text or "").split(","))):
        source, arrow, target = entry.partition("->")
        if not arrow:
            raise ValueError(f"entry {entry!r} has no '->'")
        dtype, wanted = parse_dtype(source), check(parse_dtype(source), parse_dtype(target))
        if mapping.get(dtype, wanted) != wanted:  # two entries for one dtype: the last one silently won
            raise ValueError(f"{dtype} is mapped twice, to {mapping[dtype]} and to {wanted}")
        mapping[dtype] = wanted
    return mapping


def floating_cast(source: torch.dtype, target: torch.dtype) -> torch.dtype:
    """``target``, both being real floating or both complex dtypes (a cast the user may ask of OpDtypeCast either
    way: the original ditorch's own examples narrow, ``torch.float32->torch.float16``). Else ValueError naming the
    pair (``float16->int8`` truncates, ``float32->complex64`` changes the kind)."""
    kinds = (source.is_floating_point, source.is_complex), (target.is_floating_point, target.is_complex)
    if not any(kinds[0]) or kinds[0] != kinds[1]:
        raise ValueError(f"'{source}->{target}' does not map a floating dtype to a floating one (or a complex to a "
                         "complex)")
    return target


def narrows(source: torch.dtype, target: torch.dtype) -> bool:
    """True where ``target`` does not hold every value of ``source`` (range, precision, smallest normal number)."""
    wide, narrow = torch.finfo(target), torch.finfo(source)
    return wide.max < narrow.max or wide.eps > narrow.eps or wide.tiny > narrow.tiny


def widening(source: torch.dtype, target: torch.dtype) -> torch.dtype:
    """``floating_cast``'s ``target``, when it holds every value of ``source``: a cast to it and back gives the
    caller's values (what a reference dtype must do). Else ValueError naming the pair (``float16->bfloat16``
    rounds)."""
    floating_cast(source, target)
    if narrows(source, target):
        raise ValueError(f"'{source}->{target}' narrows: {target} does not hold every {source} value")
    return target


def parse_cast_map(text: str | None) -> dict[torch.dtype, torch.dtype]:
    return parse_dtype_map(text, floating_cast)


def parse_size(text: str | None) -> int | None:
    """``'500M'``, ``'2G'``, ``'1048576'`` (powers of 1024; ``K``/``KB``/``KiB`` alike) -> bytes; unset: ``None``."""
    value = (text or "").strip().upper().removesuffix("B").removesuffix("I")
    if not value:
        return None
    scale = 1024 ** (" KMGT".index(value[-1])) if value[-1] in "KMGT" else 1
    try:
        number = float(value[:-1] if scale > 1 else value)
    except ValueError:
        raise ValueError("not a size") from None
    if not number >= 0 or number == float("inf"):
        raise ValueError("must be >= 0")
    return int(number * scale)


# --- converters of Python values (arguments, the config file): each raises ValueError/TypeError saying why ---

def convert_flag(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise TypeError("not a bool")


def convert_path(value: Any) -> str:
    if isinstance(value, os.PathLike):
        return parse_directory(os.fspath(value))
    raise TypeError("not a path")


def convert_name_patterns(value: Any) -> tuple[re.Pattern, ...] | None:
    """A list of op names, regular expressions or functions (named as the tools name them)."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple, set, frozenset)):
        raise TypeError("not a list")
    entries = []
    for entry in value:
        if callable(entry):
            from ..ops.naming import resolve_op_name

            entry = resolve_op_name(entry)  # a plain dotted name: matched as it is (see _matches)
        if not isinstance(entry, str):
            raise TypeError(f"entry {entry!r} is neither a name nor a function")
        entries.append(entry)
    return _compile_patterns(entries)


def convert_dtype(value: Any) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        return parse_dtype(value)
    raise TypeError(f"{value!r} is not a dtype")


def convert_dtype_map(value: Any, pair=None) -> dict[torch.dtype, torch.dtype]:
    if not isinstance(value, Mapping):
        raise TypeError("not a dict")
    check = pair or widening
    return {convert_dtype(k): check(convert_dtype(k), convert_dtype(v)) for k, v in value.items()}


def convert_cast_map(value: Any) -> dict[torch.dtype, torch.dtype]:
    return convert_dtype_map(value, floating_cast)


def convert_count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError("not an integer")
    return parse_count(str(value))


def convert_size(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError("not a number of bytes")
    return parse_size(str(value))


_LIST_VALUE_FORM = ("a list of op names, regular expressions matching the whole name, or functions, e.g. "
                    "['torch.add', '.*linear.*', torch.nn.functional.gelu] (or the variable's comma-separated text)")
_DTYPE_MAP_FORM = ("comma-separated 'torch.<dtype>->torch.<dtype>' pairs, each floating dtype to one at least as "
                   "wide (complex to complex)")
_DTYPE_MAP_VALUE_FORM = ("a dict {torch.float16: torch.float32} (dtypes or their names; each floating dtype to one "
                         "at least as wide, complex to complex)")


def _flag(name: str, default: str, meaning: str) -> EnvVar:
    return declare(name, "0 or 1", default, meaning, parse_flag, convert_flag, "True or False")


# --- shared variables ---

RESULTS_DIR = declare(
    "OP_TOOLS_RESULTS_DIR", "a directory path", "op_tools_results",
    "Where every tool writes its files (a subfolder per tool; `rank<N>` inside it under torchrun).", parse_directory,
    convert_path, "a directory path (str or os.PathLike)",
)
VERBOSE = declare(
    "OP_TOOLS_VERBOSE", "0 or 1", None,
    "1 shows every handled call's table (the `op_tools` logger at DEBUG); 0 only failures, summaries and each "
    "tool's closing line (INFO). Unset: INFO, unless the application set the `op_tools` logger's level. Files are "
    "written either way.", lambda text: None if text is None else parse_flag(text), convert_flag, "True or False",
)
PROGRESS = _flag("OP_TOOLS_PROGRESS", "1",
                 "0 hides the progress bars (OpCapture, the replay of a folder); they show only on a terminal, never "
                 "under CI.")
PRINT_STACK = _flag("OP_TOOLS_PRINT_STACK", "0",
                    "1 prints the full user stack of each handled call instead of one source line.")
STRICT = _flag("OP_TOOLS_STRICT", "0",
               "1 makes a failure inside a tool (or in an apply_feature condition_func) raise instead of being "
               "reported once per op and ignored.")


def parse_ranks(text: str | None) -> frozenset[int] | None:
    """``'all'`` (or unset) -> ``None`` (every rank); ``'0'``, ``'0,3'`` -> those ranks."""
    value = (text or "").strip().lower()
    if value in ("", "all"):
        return None
    ranks = set()
    for entry in (e.strip() for e in value.split(",")):
        if not entry.isdigit():
            raise ValueError(f"entry {entry!r} is not a rank (an integer >= 0)")
        ranks.add(int(entry))
    return frozenset(ranks)


def convert_ranks(value: Any) -> frozenset[int] | None:
    """``'all'``/``None``, one rank (an int) or a list of ranks."""
    if value is None or isinstance(value, str):
        return parse_ranks(value)
    values = [value] if isinstance(value, int) else value
    if not isinstance(values, (list, tuple, set, frozenset)) or \
            not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise TypeError("neither 'all', a rank nor a list of ranks (integers >= 0)")
    return frozenset(values)


PRINT_RANKS = declare(
    "OP_TOOLS_PRINT_RANKS", "all, or comma-separated ranks, e.g. 0 or 0,3", "all",
    "Under torchrun, the ranks whose op_tools console lines (INFO and DEBUG) are shown; the other ranks show "
    "WARNING and above only (a failure on any rank is never silent) and write their files as usual. Every console "
    "line under torchrun starts with `[rank<N>] `. Outside torchrun: no effect.", parse_ranks, convert_ranks,
    "'all', an int or a list of ints",
)

TERMINAL_WIDTH = 0  # OP_TOOLS_TABLE_WIDTH unset: the terminal's width, read when the tool starts
MIN_TABLE_WIDTH = 40  # narrower, a table of a call's values has no room left for its cells


def parse_table_width(text: str | None) -> int | None:
    """Unset or empty: ``TERMINAL_WIDTH``; ``'full'``: ``None`` (no cell shortened); else the width (>= 40)."""
    value = (text or "").strip().lower()
    if not value:
        return TERMINAL_WIDTH
    if value == "full":
        return None
    try:
        width = int(value)
    except ValueError:
        raise ValueError("neither an integer nor 'full'") from None
    if width < MIN_TABLE_WIDTH:
        raise ValueError(f"must be >= {MIN_TABLE_WIDTH}")
    return width


TABLE_WIDTH = declare(
    "OP_TOOLS_TABLE_WIDTH", f"an integer >= {MIN_TABLE_WIDTH}, or full", None,
    "The width in characters that console tables and the tools' closing lines fit (under torchrun, with their "
    "`[rank<N>] ` label); long cells are shortened with `…` (module paths keep their indices and last name), and "
    "a module path or op name shortened is written whole on a line of its own under the table; a closing line "
    "too long names its results folder by its last folders, whole on the line above it, and a closing or summary "
    "line still too long wraps at its clauses onto lines indented two spaces. `full` shortens and wraps nothing "
    "(cells and lines whole, however wide). Unset: the terminal's width when stdout or stderr is a terminal (`COLUMNS` "
    "wins, as for `shutil.get_terminal_size`), else 100. Files always keep every cell whole.", parse_table_width,
)
REPLICA_FINGERPRINTS = _flag(
    "OP_TOOLS_REPLICA_FINGERPRINTS", "1",
    "Under torchrun with more than one rank, while a tool runs: before each optimizer step, a checksum of every "
    "replicated parameter and its gradient (the sum of its bits, on the device, one transfer per step), and which "
    "parameters hold inf/nan, written to `op_replica_fingerprints/rank<N>/`, for `python -m op_tools.report` to "
    "tell whether the replicas still agree. "
    "0 writes none.",
)
CONFIG_FILE = declare(
    "OP_TOOLS_CONFIG", "a TOML file path", None,
    "A config file holding the tools' settings (docs/tools/README.md#config-file): `[op_tools]` for every tool, "
    "`[capture]`, `[autocompare]`, … for one; keys are the tools' keyword arguments. Variables win over it.",
    parse_text,
)

# Tool prefixes in the original's naming; each gets OP_<PREFIX>_LIST and OP_<PREFIX>_DISABLE_LIST.
TOOL_PREFIXES = ("OP_CAPTURE", "OP_OBSERVE", "OP_OVERFLOW_CHECK", "OP_FALLBACK", "OP_DTYPE_CAST", "OP_TIME_MEASURE",
                 "OP_AUTOCOMPARE", "OP_SELF_CHECK")
_LIST_FORM = "comma-separated op names or regular expressions matching the whole name, e.g. 'torch.add,.*linear.*'"


def declare_op_lists(prefix: str) -> tuple[EnvVar, EnvVar]:
    """Declare ``<prefix>_LIST`` and ``<prefix>_DISABLE_LIST`` (later tools call this for theirs)."""
    return (
        declare(f"{prefix}_LIST", _LIST_FORM, None,
                "Ops the tool handles. Unset: all; empty: none. Plain names only: the tool wraps those functions "
                "and costs nothing on other calls; any pattern: every call's name is checked.", parse_name_patterns,
                convert_name_patterns, _LIST_VALUE_FORM),
        declare(f"{prefix}_DISABLE_LIST", _LIST_FORM, None,
                "Ops the tool never handles; wins over the LIST.", parse_name_patterns, convert_name_patterns,
                _LIST_VALUE_FORM),
    )


OP_LISTS = {prefix: declare_op_lists(prefix) for prefix in TOOL_PREFIXES}

CAPTURE_MODE = declare(
    "OP_CAPTURE_MODE", "full, summary or stats", "full",
    "summary records only op names, argument metadata and counts, and writes one aggregated table per run; stats "
    "records every call (CPU calls too), forward and backward, with its module path and statistics of its tensors, "
    "for python -m op_tools.compare_runs (docs/tools/compare_runs.md).",
    parse_choice("full", "summary", "stats"),
)
CAPTURE_DEDUP = _flag(
    "OP_CAPTURE_DEDUP", "1",
    "1 stores a tensor whose values were already written (same dtype, sizes, strides and bytes) once and "
    "references it; 0 writes every argument in full.",
)
CAPTURE_MAX_BYTES = declare(
    "OP_CAPTURE_MAX_BYTES", "a size in bytes, e.g. 1048576, 500M, 2G (powers of 1024)", None,
    "Full capture stops saving calls once it wrote this much (checked before each call, which is saved whole), "
    "with one warning saying how much it saved. Unset: no limit.", parse_size, convert_size,
    "an int (bytes) or a size text such as '500M'",
)
CAPTURE_STEPS = declare(
    "OP_CAPTURE_STEPS", "all, or comma-separated steps and ranges, e.g. 0,2-3 or 5- (5 and later)", None,
    "Full and summary capture save only the calls of these steps, counted as every tool counts them "
    "(optimizer.step() calls finished since the tool started: the first step is 0); the others are counted in the "
    "closing line. Unset: every step.", parse_steps, convert_steps,
    "an int, a list of ints, a range, or a text such as '0,2-3'",
)


def _optional_positive_count(text: str | None) -> int | None:
    return None if not (text or "").strip() else parse_positive_count(text)


def _convert_optional_positive_count(value: Any) -> int | None:
    return None if value is None else parse_positive_count(str(convert_count(value)))


CAPTURE_MAX_CALLS_PER_OP = declare(
    "OP_CAPTURE_MAX_CALLS_PER_OP", "an integer >= 1", None,
    "Full capture saves at most this many calls of each op (the first ones, in the steps chosen); the others are "
    "counted in the closing line. Unset: no limit.", _optional_positive_count, _convert_optional_positive_count,
    "an int >= 1",
)
OVERFLOW_CHECK_RAISE = _flag(
    "OP_OVERFLOW_CHECK_RAISE", "0",
    "1 raises OverflowDetectedError at the first op producing inf/nan from finite inputs.",
)
TIME_MEASURE_SYNC = _flag(
    "OP_TIME_MEASURE_SYNC", "0",
    "1 times each call between two synchronisations of its device (host clock) instead of with timing events "
    "on its stream: the time of all work queued meanwhile, at the cost of a host synchronisation per call.",
)
DTYPE_CAST_DICT = declare(
    "OP_DTYPE_CAST_DICT", _DTYPE_MAP_FORM,
    "torch.float16->torch.float32,torch.bfloat16->torch.float32",
    "Which input dtypes OpDtypeCast casts, and to what: a floating (or complex) dtype to another; a pair that "
    "narrows (torch.float32->torch.float16, the original's example) is taken, and said at start: the run's values "
    "change.", parse_cast_map, convert_cast_map, _DTYPE_MAP_VALUE_FORM,
)

# OpAutoCompare. The tolerance variables keep the original's names and priority:
# <OPNAME>_AUTOCOMPARE_ERROR_TOLERANCE_<DTYPE> > AUTOCOMPARE_ERROR_TOLERANCE_<DTYPE> > AUTOCOMPARE_ERROR_TOLERANCE,
# OPNAME being the last component of the op name, upper-cased (torch.nn.functional.linear -> LINEAR).
AUTOCOMPARE_BACKWARD = _flag(
    "OP_AUTOCOMPARE_BACKWARD", "1",
    "1 also compares the gradients of each compared op's inputs; 0 compares forward results only.",
)
AUTOCOMPARE_COLLECTIVES = _flag(
    "OP_AUTOCOMPARE_COLLECTIVES", "1",
    "1 checks each synchronous torch.distributed collective (DDP's gradient buckets, FSDP's all-gathers and "
    "reduce-scatters) against a reference computed on the host from every rank's inputs, gathered through a gloo "
    "group (a host synchronisation and world-size times the sent bytes per collective); 0 counts them as skipped.",
)


def parse_count(text: str | None, least: int = 0) -> int:
    try:
        value = int((text or "").strip())
    except ValueError:
        raise ValueError("not an integer") from None
    if value < least:
        raise ValueError(f"must be >= {least}")
    return value


_COMPILED_CHOICE = parse_choice("eager", "check", "versus_eager")
AUTOCOMPARE_COMPILED = declare(
    "OP_AUTOCOMPARE_COMPILED", "eager, check or versus_eager", "eager",
    "How torch.compile'd code is checked. eager: it runs eagerly while the tool is active and each op is compared "
    "(what the eager model computes); check: it stays compiled, and each compiled graph's run is compared as one "
    "call, forward and backward, with the graph dynamo traced rerun in float64 on the CPU (what the compiled model "
    "computes; docs/tools/op_autocompare.md#compiled-code); versus_eager: as check, and each graph's forward also "
    "run eagerly on the device in its dtype, so that each row says whether compiled errs more than eager, and by "
    "how much.",
    _COMPILED_CHOICE, lambda value: _COMPILED_CHOICE(str(value)), "'eager', 'check' or 'versus_eager'",
)
AUTOCOMPARE_MAX_SAVED = declare(
    "OP_AUTOCOMPARE_MAX_SAVED", "an integer >= 0", "3",
    "How many failing calls of each op are saved for the offline replay (written in the background); the rest "
    "are counted in the summary. 0 saves none.", parse_count, convert_count, "an int >= 0",
)
AUTOCOMPARE_MAX_SAVE_BYTES = declare(
    "OP_AUTOCOMPARE_MAX_SAVE_BYTES", "a size in bytes, e.g. 67108864, 64M, 1G (powers of 1024)", "64M",
    "How much the failing calls saved for the offline replay may take in a run, inputs, outputs and gradients on "
    "both sides (a call with a real vocabulary's logits is gigabytes): a call that would go past it is not saved, "
    "and the summary counts it.", parse_size, convert_size, "an int (bytes) or a size text such as '64M'",
)
_TOLERANCE_FORM = "'atol,rtol', e.g. '1e-3,1e-3'"
_TOLERANCE_MEANING = ("When any tolerance variable applies to an output, allclose under it decides instead of the "
                      "comparison with a same-dtype CPU run. Priority: per op and dtype > per dtype > global.")
AUTOCOMPARE_TOLERANCES = tuple(
    declare(name, _TOLERANCE_FORM, None, _TOLERANCE_MEANING, parse_text)
    for name in ("AUTOCOMPARE_ERROR_TOLERANCE", "AUTOCOMPARE_ERROR_TOLERANCE_<DTYPE>",
                 "<OPNAME>_AUTOCOMPARE_ERROR_TOLERANCE_<DTYPE>")
)
REFERENCE_CAST_VAR = re.compile(r"^(\w+)_OP_DTYPE_CAST_DICT$")  # the concrete names of AUTOCOMPARE_CAST
AUTOCOMPARE_CAST = declare(
    "<OPNAME>_OP_DTYPE_CAST_DICT", _DTYPE_MAP_FORM,
    "torch.float16->torch.float64,torch.bfloat16->torch.float64,torch.float32->torch.float64",
    "The dtypes OpAutoCompare's CPU reference computes <OPNAME> in (OPNAME as for the tolerances).",
    parse_dtype_map,
)


# --- run recordings (OP_CAPTURE_MODE=stats) and python -m op_tools.compare_runs ---

def parse_positive_count(text: str | None) -> int:
    return parse_count(text, least=1)  # -1 is said to need >= 1, not >= 0


def convert_positive_count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError("not an integer")
    return parse_positive_count(str(value))


CAPTURE_STATS_MAX_TENSORS = declare(
    "OP_CAPTURE_STATS_MAX_TENSORS", "an integer >= 1", "4096",
    "In stats mode, how many tensors of each side of a call (inputs, outputs, gradients) are recorded; the others "
    "are counted, and compare_runs says their values were not compared. Bounds the bytes a call adds to the "
    "recording (about 150 per tensor); the default holds a foreach optimizer's lists whole (its step over every "
    "parameter, three lists on its inputs' side) up to about 1,300 parameter tensors.", parse_positive_count,
    convert_positive_count, "an int >= 1",  # OpCapture(stats_max_tensors=64), as the other counts take
)



def parse_dtype_tolerances(text: str | None) -> dict[str, float]:
    """``float32=1e-4,bfloat16=8e-3`` -> ``{"float32": 1e-4, "bfloat16": 8e-3}``."""
    out = {}
    for entry in filter(None, (e.strip() for e in (text or "").split(","))):
        name, equals, value = entry.partition("=")
        name = name.strip().removeprefix("torch.")
        if not equals or name not in ("float64", "float32", "float16", "bfloat16", "float8"):
            raise ValueError(f"entry {entry!r} is not <float64|float32|float16|bfloat16|float8>=<number>")
        try:
            out[name] = float(value)
        except ValueError:
            raise ValueError(f"entry {entry!r}: {value.strip()!r} is not a number") from None
        if not out[name] >= 0:
            raise ValueError(f"entry {entry!r}: must be >= 0")
    return out


COMPARE_RUNS_TOLERANCES = declare(
    "OP_COMPARE_RUNS_TOLERANCES", "comma-separated '<dtype>=<relative difference>', dtype one of float64, float32, "
    "float16, bfloat16, float8", "float64=1e-7,float32=1e-4,float16=1e-3,bfloat16=5e-3,float8=5e-2",
    "compare_runs: the largest relative difference a call may add to what its inputs carried without being a "
    "divergence, by the lowest precision the pair or any call before it used; entries given replace those "
    "defaults, the others stay.",
    parse_dtype_tolerances,
)
COMPARE_RUNS_DEPTH_SCALE = declare(
    "OP_COMPARE_RUNS_DEPTH_SCALE", "an integer >= 0", "1000",
    "compare_runs: tolerances grow with depth as sqrt(1 + calls before it in its step / this number), as rounding "
    "errors accumulate; 0 keeps them flat.", parse_count,
)


def parse_non_negative_number(text: str | None) -> float:
    try:
        value = float((text or "").strip())
    except ValueError:
        raise ValueError("not a number") from None
    if not value >= 0:
        raise ValueError("must be >= 0")
    return value


COMPARE_RUNS_CARRIED_GROWTH = declare(
    "OP_COMPARE_RUNS_CARRIED_GROWTH", "a number >= 0", "2",
    "compare_runs: how much a call may grow the difference its inputs carried in (its outputs may differ by the "
    "tolerance plus this times the inputs' difference) before it counts as a divergence.",
    parse_non_negative_number,
)

class OpFilter:
    """Which op names a tool handles, from its LIST and DISABLE_LIST; decisions cached per name."""

    def __init__(self, allow: tuple[re.Pattern, ...] | None, deny: tuple[re.Pattern, ...] | None) -> None:
        self.allow = allow
        self.deny = deny or ()
        self._decisions: dict[str, bool] = {}

    @classmethod
    def from_env(cls, prefix: str, sources: Sources | None = None) -> OpFilter:
        allow_var, deny_var = OP_LISTS.get(prefix) or declare_op_lists(prefix)
        return cls(allow_var.read(sources), deny_var.read(sources))

    def exact_names(self) -> tuple[str, ...] | None:
        """The LIST's names when each entry is a plain dotted name (no regular-expression syntax), else ``None``."""
        if not self.allow or not all(PLAIN_NAME.fullmatch(p.pattern) for p in self.allow):
            return None
        return tuple(dict.fromkeys(p.pattern for p in self.allow))

    def denies(self, name: str) -> bool:
        """Whether the DISABLE_LIST names ``name``."""
        return _matches(self.deny, name)

    def allows(self, name: str) -> bool:
        decision = self._decisions.get(name)
        if decision is None:
            decision = not _matches(self.deny, name) and (self.allow is None or _matches(self.allow, name))
            self._decisions[name] = decision
        return decision


# A '.' in such an entry could match any character as a regular expression; no two op names differ only there.
PLAIN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def _matches(patterns, name: str) -> bool:
    return any(p.pattern == name or p.fullmatch(name) for p in patterns)


@dataclasses.dataclass(frozen=True)
class CommonConfig:
    """The variables every tool shares, read once at ``start()``."""

    results_dir: str
    verbose: bool | None  # None: unset, the op_tools logger's level decides
    print_stack: bool
    strict: bool
    rank: int | None  # torchrun's RANK; None outside torchrun
    print_ranks: frozenset[int] | None = None  # OP_TOOLS_PRINT_RANKS; None: every rank
    replica_fingerprints: bool = True  # OP_TOOLS_REPLICA_FINGERPRINTS
    table_width: int | None = TERMINAL_WIDTH  # OP_TOOLS_TABLE_WIDTH; None: full, cells never shortened

    @classmethod
    def from_env(cls, sources: Sources | None = None) -> CommonConfig:
        return cls(RESULTS_DIR.read(sources) or "op_tools_results", VERBOSE.read(sources), PRINT_STACK.read(sources),
                   STRICT.read(sources), torchrun_rank(), PRINT_RANKS.read(sources),
                   REPLICA_FINGERPRINTS.read(sources), TABLE_WIDTH.read(sources))


def torchrun_rank() -> int | None:
    """This process's rank under torchrun, ``None`` outside it: torchrun (and torch.distributed.launch) export
    RANK and WORLD_SIZE to every worker."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        try:
            return int(os.environ["RANK"])
        except ValueError:
            return None
    return None


# --- TrainingMonitor (config/training_monitor.py gathers them into TrainingMonitorConfig) ---

BLOCKS = "blocks"  # OP_TRAINING_MONITOR_ACTIVATIONS: the items of every nn.ModuleList (a transformer's layers)


_REFERENCE_CHOICE = parse_choice("cpu", "device", "auto")
AUTOCOMPARE_REFERENCE = declare(
    "OP_AUTOCOMPARE_REFERENCE", "cpu, device or auto", "cpu",
    "Where the float64 reference runs. cpu: on the host, for every call; device: in float64 on the device, where "
    "the device computes it, with every call whose verdict is not a clean pass, each op's first call and every "
    "OP_AUTOCOMPARE_CROSS_CHECK_EVERY-th call rerun on the CPU as well (an op whose two references disagree moves "
    "to the CPU for the rest of the run); auto: device where the device computes float64, else cpu, with one line "
    "saying why. The verdicts are the CPU's: a failure is never reported from the device reference alone.",
    _REFERENCE_CHOICE, lambda value: _REFERENCE_CHOICE(str(value)), "'cpu', 'device' or 'auto'",
)
AUTOCOMPARE_CROSS_CHECK_EVERY = declare(
    "OP_AUTOCOMPARE_CROSS_CHECK_EVERY", "an integer >= 1", "64",
    "With the reference on the device: besides each op's first call, every N-th call of each op also runs the CPU "
    "reference, and the two references are compared (forward and backward). 1 cross-checks every call.",
    parse_positive_count, convert_positive_count, "an int >= 1",
)
AUTOCOMPARE_VERDICT_BATCH = declare(
    "OP_AUTOCOMPARE_VERDICT_BATCH", "an integer >= 1", "64",
    "On a device with events (CUDA, NPU, sim): each call's tensors go to the host without waiting, and the calls "
    "are judged N at a time after one wait for all their copies, in the order they ran (the verdicts are the same). "
    "1 judges each call when it returns, with a wait per copy (a failure's table printed at the call), and so does "
    "OP_TOOLS_STRICT=1.",
    parse_positive_count, convert_positive_count, "an int >= 1",
)
MAX_CACHE_SIZE = declare(
    "OP_TOOLS_MAX_CACHE_SIZE", "an integer >= 0", None,
    "The original's: OpAutoCompare appends its comparisons to its CSV, and OpTimeMeasure its calls' times to "
    "op_elasped_info_*.csv, whenever more than this many rows are held, so that a run that dies (a kernel's crash, "
    "a kill) leaves the rows of the calls checked or timed so far. A call's time waits for its backward, or for a "
    "later step; 0, as in the original: each row as it comes. Unset: each CSV is written once, at stop() (or at "
    "exit). The other tools write their files at stop().",
    lambda text: None if not (text or "").strip() else parse_count(text),
    lambda value: None if value is None else convert_count(value), "an int >= 0",
)
AUTOCOMPARE_DEVICE_REFERENCE_MAX_BYTES = declare(
    "OP_AUTOCOMPARE_DEVICE_REFERENCE_MAX_BYTES", "a size in bytes, e.g. 8G, 512M (powers of 1024)", "8G",
    "With the reference on the device: how much device memory the float64 copies of the calls' inputs may hold at "
    "once (those of calls waiting for their backward included). A call whose copies would go past it is compared on "
    "the CPU, and the summary counts it.", parse_size, convert_size, "an int (bytes) or a size text such as '8G'",
)


def _number(text: str | None, accepts: Callable[[float], bool], expected: str) -> float:
    try:
        value = float((text or "").strip())
    except ValueError:
        raise ValueError("not a number") from None
    if not accepts(value):  # nan fails every test
        raise ValueError(expected)
    return value


def parse_fraction(text: str | None) -> float:
    return _number(text, lambda v: 0 < v <= 1, "must be > 0 and <= 1")


def convert_fraction(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError("not a number")
    return parse_fraction(repr(float(value)))


SELF_CHECK_BUDGET = declare(
    "OP_SELF_CHECK_BUDGET", "a fraction > 0 and <= 1", "0.02",
    "The share of the run's wall time OpSelfCheck's checks may take: a call is checked while the tool's own time "
    "stays within it (the first call of each call site always is, a one-time sweep outside it); while it is spent "
    "the tool pauses (calls run untouched, the engine's dispatch too) and the rest are counted as not checked "
    "(budget).",
    parse_fraction, convert_fraction, "a float > 0 and <= 1",
)


def parse_factor(text: str | None) -> float:
    return _number(text, lambda v: 1 < v < float("inf"), "must be > 1")


def convert_factor(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError("not a number")
    return parse_factor(repr(float(value)))


def parse_auto_flag(text: str | None) -> bool | None:
    """``auto`` (or empty) -> ``None``: the tool decides; else a flag."""
    return None if (text or "").strip().lower() in ("", "auto") else parse_flag(text)


def convert_patterns(value: Any) -> tuple[re.Pattern, ...]:
    """A list of regular expressions (a text is the variable's comma-separated form: ``EnvVar.value_of``)."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(entry, str) for entry in value):
        raise TypeError("not a list of regular expressions (str)")
    return _compile_patterns(value)


def parse_activations(text: str | None) -> str | tuple[re.Pattern, ...]:
    """``blocks`` -> ``BLOCKS``; ``none`` or empty -> ``()``; else the compiled patterns."""
    value = (text or "").strip()
    if value.lower() in (BLOCKS, "none"):
        return BLOCKS if value.lower() == BLOCKS else ()
    return _no_keyword_among(_compile_patterns(value.split(",")))


def convert_activations(value: Any) -> tuple[re.Pattern, ...]:
    return _no_keyword_among(convert_patterns(value))


def _no_keyword_among(patterns: tuple[re.Pattern, ...]) -> tuple[re.Pattern, ...]:
    if any(p.pattern.lower() in (BLOCKS, "none") for p in patterns):
        raise ValueError(f"{BLOCKS} and none stand alone, not in a list")
    return patterns


_MONITOR = "OP_TRAINING_MONITOR"
TRAINING_MONITOR_EVERY = declare(
    f"{_MONITOR}_EVERY", "an integer >= 1", "1",
    "TrainingMonitor records every N-th optimizer step, from step 0; the steps between cost nothing.",
    parse_positive_count, convert_positive_count, "an int >= 1",
)
TRAINING_MONITOR_STATE_EVERY = declare(
    f"{_MONITOR}_STATE_EVERY", "an integer >= 1", "20",
    "TrainingMonitor records the weight norms, update ratios and Adam moment norms (each a pass over every weight) "
    "at every N-th monitored step, from step 0; gradients, the loss and module outputs at every monitored step.",
    parse_positive_count, convert_positive_count, "an int >= 1",
)
TRAINING_MONITOR_PARAMETERS = declare(
    f"{_MONITOR}_PARAMETERS", r"comma-separated regular expressions matched at the start of parameter names, e.g. "
    r"'model\.layers\.0\.,lm_head'", None,
    "The parameters whose figures TrainingMonitor records (grad_norm, weight_norm, update_ratio, moments): those "
    "whose name one of them matches from its start. Unset: every parameter; empty: none.",
    parse_name_patterns, convert_patterns, r"a list of regular expressions, e.g. [r'model\.layers\.0\.', 'lm_head'] "
    "(or the variable's comma-separated text)",
)
TRAINING_MONITOR_ACTIVATIONS = declare(
    f"{_MONITOR}_ACTIVATIONS", "blocks, none, or comma-separated regular expressions matching whole module names, "
    r"e.g. 'model\.layers\.\d+\.mlp'", BLOCKS,
    "The modules whose output statistics (forward) and output-gradient statistics (backward) TrainingMonitor "
    "records, named as `model.named_modules()` names them: `blocks` the items of every nn.ModuleList "
    "(`model.layers.0`, …), `none` no module.",
    parse_activations, convert_activations, "'blocks', 'none' or a list of regular expressions",
)
TRAINING_MONITOR_SPIKE_FACTOR = declare(
    f"{_MONITOR}_SPIKE_FACTOR", "a number > 1", "10",
    "TrainingMonitor's grad_norm_spike rule fires when a parameter's gradient norm exceeds this times its moving "
    "average.", parse_factor, convert_factor, "a number > 1",
)
TRAINING_MONITOR_WARMUP = declare(
    f"{_MONITOR}_WARMUP", "an integer >= 1", "3",
    "The monitored steps a parameter's gradient norm is seen before TrainingMonitor's spike rule judges it.",
    parse_positive_count, convert_positive_count, "an int >= 1",
)
TRAINING_MONITOR_TENSORBOARD = declare(
    f"{_MONITOR}_TENSORBOARD", "auto, 0 or 1", "auto",
    "auto: TrainingMonitor writes TensorBoard event files when the tensorboard package is installed; 1 requires "
    "it (an ImportError when it is missing); 0 writes none.", parse_auto_flag, convert_flag, "None, True or False",
)
TRAINING_MONITOR_UPDATE_RATIO = _flag(
    f"{_MONITOR}_UPDATE_RATIO", "1",
    "1: TrainingMonitor also records each selected parameter's update ratio ‖new − old‖ / ‖old‖ over each "
    "monitored step (it keeps a copy of the selected weights over the step).",
)
TRAINING_MONITOR_MOMENTS = _flag(
    f"{_MONITOR}_MOMENTS", "1",
    "1: TrainingMonitor also records the norms of Adam's moments (exp_avg, exp_avg_sq) of each selected parameter.",
)
TRAINING_MONITOR_SCALE_DROPS = declare(
    f"{_MONITOR}_SCALE_DROPS", "an integer >= 1", "3",
    "TrainingMonitor's loss_scale_dropping rule fires once a GradScaler's scale fell this many times in a row.",
    parse_positive_count, convert_positive_count, "an int >= 1",
)
TRAINING_MONITOR_REPLICAS = _flag(
    f"{_MONITOR}_REPLICAS", "1",
    "Under data parallel (more than one rank): 1 makes TrainingMonitor compare the gradients of each replicated "
    "parameter across ranks each monitored step (the replica_mismatch rule).",
)
TRAINING_MONITOR_HTML = _flag(
    f"{_MONITOR}_HTML", "1", "1: TrainingMonitor writes the run's single-file HTML page at stop().",
)
