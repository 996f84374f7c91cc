"""Fault injection for the sim device: make chosen aten ops fail, drift, poison their outputs, or
write without bumping version counters.

A fault spec is ``pattern[@dtype]:kind`` with ``kind`` one of ``unsupported``, ``nan``, ``inf``,
``noise=<relative error>``, ``bitflip=<N>``, ``slow=<milliseconds>``, ``scratch=<relative change>`` or
``unversioned``; several specs are joined by ``;``. ``bitflip=<N>`` flips one bit of one element of the output in
every N-th call of the matched ops (the mantissa's top bit, an element drawn from the faults' private generator): a
chip's silent corruption, now and then. After the kind, ``,p=<fraction>`` makes a ``noise``, ``nan``, ``inf`` or
``bitflip`` fault intermittent (active in that fraction of the calls it matches, drawn from the private generator),
and ``,rank=<r>`` keeps a fault to one rank of a distributed run (``torch.distributed``'s rank, else ``RANK``).
``pattern`` is a regular expression matched against the whole op name, with or without its overload (``mm``,
``add.Tensor``, ``aten::rsqrt``, ``.*``). ``unversioned`` makes matched in-place and ``out=`` ops leave the version
counter of the sim tensors they write unchanged, as some kernels do on real hardware (see ``version_counter.py``).
``scratch=<rel>`` makes the kernel use its first floating input that it does not declare written as scratch: that
input is scaled by ``1 + rel`` in place before the kernel computes from it, with no version bump (a vendor kernel
writing an input it was only to read).

An ``@`` part that is not a dtype name is a module path (``silu@model.layers.1:nan``, with a dtype too:
``silu@model.layers.1@float16:nan``): the fault then hits only calls made in the forward of that module or of
a module under it, paths named as op_tools names them (``module_scope.py``).

    DITORCH_SIM_FAULTS="mm:noise=1e-3;.*@float64:unsupported;add_:unversioned;silu@model.layers.1:nan"
    DITORCH_SIM_FAULTS="mm:bitflip=50,rank=1;addmm:noise=1e-2,p=0.1"

    with ditorch.sim.faults("gelu:nan"):
        ...
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import logging
import os
import re
import threading
import time

import torch
from torch._subclasses.fake_tensor import is_fake

from . import module_scope
from .version_counter import WRITES

ENV_VAR = "DITORCH_SIM_FAULTS"
FORM = ("'pattern[@dtype]:kind[,p=<fraction>][,rank=<r>]' joined by ';', kind one of unsupported, nan, inf, "
        "noise=<rel>, bitflip=<N>, slow=<ms>, scratch=<rel>, unversioned; an '@module.path' part (with or without "
        "'@dtype') keeps a fault to that module's forward")
KINDS_WITH_VALUE = {"noise", "slow", "bitflip", "scratch"}
KINDS = {"unsupported", "nan", "inf", "unversioned"} | KINDS_WITH_VALUE
# sim's collectives (its process group's methods, distributed.py): an output fault on one changes what it received;
# ``slow`` makes one complete that much later (async_op=True returns at once, its Work waits the while)
COLLECTIVES = ("allreduce", "allreduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_single",
               "reduce_scatter_tensor_coalesced", "broadcast", "allgather", "all_gather_single",
               "allgather_into_tensor_coalesced", "gather", "scatter", "alltoall", "all_to_all_single", "send", "recv",
               "recv_anysource")
OUTPUT_KINDS = {"noise", "nan", "inf", "bitflip"}  # applied to a call's outputs; these may be intermittent
# The bit a bitflip flips, per float dtype: the mantissa's top one (the value moves by a quarter to a half).
TOP_MANTISSA_BIT = {torch.float64: (51, torch.int64), torch.float32: (22, torch.int32),
                    torch.float16: (9, torch.int16), torch.bfloat16: (6, torch.int16)}
# Kinds applied by ADInplaceOrView kernels (version_counter.py), not by run_op.
VERSION_KINDS = {"unversioned"}


class SimUnsupportedError(RuntimeError):
    """Raised by an op the sim device was told not to support, as a vendor's missing kernel does."""


@dataclasses.dataclass(frozen=True)
class Fault:
    pattern: re.Pattern
    kind: str
    value: float = 0.0
    dtype: torch.dtype | None = None
    module: str | None = None  # a module path: only calls in that module's forward (or under it)
    probability: float = 1.0  # the fraction of matching calls it is active in (intermittent below 1)
    rank: int | None = None  # the one rank it applies on

    def matches_name(self, packet: str, full: str) -> bool:
        return bool(self.pattern.fullmatch(packet) or self.pattern.fullmatch(full))

    def applies(self, dtypes) -> bool:
        """Whether this call (its tensors' ``dtypes``, the module running now, this rank) is one the fault is kept
        to."""
        if self.dtype is not None and self.dtype not in dtypes:
            return False
        if self.rank is not None and self.rank != _rank():
            return False
        return self.module is None or module_scope.in_scope(module_scope.current(), self.module)

    def __str__(self) -> str:
        module = f"@{self.module}" if self.module else ""
        dtype = f"@{str(self.dtype).removeprefix('torch.')}" if self.dtype else ""
        value = f"={self.value:g}" if self.kind in KINDS_WITH_VALUE else ""
        options = (f",p={self.probability:g}" if self.probability < 1 else "") + \
            (f",rank={self.rank}" if self.rank is not None else "")
        return f"{self.pattern.pattern}{module}{dtype}:{self.kind}{value}{options}"


def _rank() -> int:
    """This process's rank: torch.distributed's once initialised, else torchrun's ``RANK`` (0 without either)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _bad(source: str, text: str, why: str) -> ValueError:
    return ValueError(f"{source}={text!r}: {why}; expected {FORM}")


@functools.cache
def _dtype_names() -> tuple[str, ...]:
    return tuple(name for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype))


# Shorthands people write for dtypes (fp16, bf16, int8x): never taken for a module path.
_DTYPE_LIKE = re.compile(r"(fp|bf|u?int|float|bfloat|complex|qu?int)\d+\w*")


def _parse_scope(part: str, source: str, text: str) -> torch.dtype | str:
    """An ``@`` part: a dtype when it names one, else a module path (one that looks like a dtype is an error)."""
    name = part.strip()
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if isinstance(dtype, torch.dtype):
        return dtype
    close = difflib.get_close_matches(name, _dtype_names(), n=1, cutoff=0.75)
    if name.startswith("torch.") or (("." not in name) and (close or _DTYPE_LIKE.fullmatch(name))):
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise _bad(source, text, f"unknown dtype {name!r}{hint} (a module path is written as named_modules() "
                                 "names it: model.layers.1)")
    if not name or any(not c for c in name.split(".")) or any(ch.isspace() for ch in name):
        raise _bad(source, text, f"{name!r} is neither a dtype nor a module path (model.layers.1)")
    return name


def parse_faults(text: str, source: str = ENV_VAR) -> list[Fault]:
    """Parse a fault spec; a malformed one is a ValueError naming ``source`` and the expected form."""
    faults = []
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        target, sep, kind_text = entry.rpartition(":")
        if not sep or not target:
            raise _bad(source, text, f"entry {entry!r} has no ':kind'")
        kind_part, *option_texts = kind_text.split(",")
        kind, _, value_text = kind_part.strip().partition("=")
        if kind not in KINDS:
            raise _bad(source, text, f"unknown fault kind {kind!r}")
        value = 0.0
        if kind in KINDS_WITH_VALUE:
            try:
                value = float(value_text)
            except ValueError:
                raise _bad(source, text, f"{kind} needs a number, got {value_text!r}") from None
            if kind == "bitflip" and (value < 1 or value != int(value)):
                raise _bad(source, text, f"bitflip needs a whole number of calls >= 1, got {value_text!r}")
        elif value_text:
            raise _bad(source, text, f"{kind} takes no value")
        probability, rank = _options(option_texts, kind, entry, source, text)
        pattern_text, *scope_texts = target.split("@")
        dtype, module = None, None
        for scope_text in scope_texts:
            scope = _parse_scope(scope_text, source, text)
            if isinstance(scope, torch.dtype):
                if dtype is not None:
                    raise _bad(source, text, f"entry {entry!r} names two dtypes")
                dtype = scope
            elif module is not None:
                raise _bad(source, text, f"entry {entry!r} names two module paths")
            else:
                module = scope
        if module is not None and kind in VERSION_KINDS:
            raise _bad(source, text, f"{kind} applies to every call of its ops (PyTorch's ADInplaceOrView kernel), "
                                     "not to one module's")
        pattern_text = pattern_text.strip().removeprefix("aten::")
        try:
            pattern = re.compile(pattern_text)
        except re.error as e:
            raise _bad(source, text, f"invalid regular expression {pattern_text!r} ({e})") from None
        faults.append(Fault(pattern, kind, value, dtype, module, probability, rank))
    return faults


def _options(texts: list[str], kind: str, entry: str, source: str, text: str) -> tuple[float, int | None]:
    """``p=<fraction>`` and ``rank=<r>`` after a kind."""
    probability, rank = 1.0, None
    for option in texts:
        name, _, value = option.strip().partition("=")
        if name not in ("p", "rank"):
            raise _bad(source, text, f"entry {entry!r}: unknown option {name!r} (p=<fraction>, rank=<r>)")
        try:
            if name == "p":
                probability = float(value)
                if not 0 < probability <= 1:
                    raise ValueError
            else:
                rank = int(value)
                if rank < 0:
                    raise ValueError
        except ValueError:
            raise _bad(source, text, f"entry {entry!r}: {name}={value!r} is not "
                                     + ("a fraction in (0, 1]" if name == "p" else "a rank >= 0")) from None
    if probability < 1 and kind not in OUTPUT_KINDS:
        raise _bad(source, text, f"entry {entry!r}: p= applies to {', '.join(sorted(OUTPUT_KINDS))}, not {kind}")
    return probability, rank


@functools.cache
def aten_op_names() -> tuple[tuple[str, str, str], ...]:
    """``(qualified, packet, packet.overload)`` of every registered op: its dispatcher name (``aten::gelu``) and the
    two names faults match (``gelu``, ``gelu.default``)."""
    names = []
    for qualified in torch._C._dispatch_get_all_op_names():
        packet, _, overload = qualified.removeprefix("aten::").partition(".")
        names.append((qualified, packet, f"{packet}.{overload or 'default'}"))
    return tuple(names)


_checked_patterns: set = set()  # pattern texts already checked (a context manager in a loop checks once)


def _schema(qualified: str) -> torch._C.FunctionSchema | None:
    """The schema of an overload a call can name (``aten::linear.out``); ``None`` for a name registered with no
    schema, or with a vararg one (``aten::einsum.sublist``: the JIT's, which Python rewrites before it dispatches)."""
    name, _, overload = qualified.partition(".")
    try:
        schema = torch._C._get_schema(name, overload)
    except RuntimeError:
        return None
    return None if "..." in str(schema) else schema


def _composite_warning(fault: Fault, source: str, matched: list[str]) -> str | None:
    """Why ``fault`` never fires on the calls meant: every overload it matches has a ``CompositeImplicitAutograd``
    kernel, which PyTorch runs above any device's (``linear`` as ``addmm``, ``layer_norm``, ``softmax``), so sim sees
    it only under ``torch.inference_mode()`` (no autograd key to run the composite), or reaches sim only in its
    ``out=`` form; else ``None``."""
    schemas = {name: schema for name in matched if (schema := _schema(name)) is not None}
    reaching = []
    for name, schema in schemas.items():
        if not torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd"):
            if not any(argument.is_out for argument in schema.arguments):
                return None  # a call without out= reaches sim: the fault can fire
            reaching.append(name)
    composite = ", ".join(name for name in schemas if name not in reaching)
    out_only = f"; {', '.join(reaching)} only in calls with out=" if reaching else ""
    return (f"{source}: {fault.pattern.pattern!r} matches only ops that PyTorch runs as other aten ops before a "
            f"device sees them ({composite}){out_only}: the fault fires on them only under torch.inference_mode(); "
            "name the ops they run as (torch.profiler lists the aten ops a line runs)")


def unmatched_pattern_warning(fault: Fault, source: str) -> str | None:
    """Why ``fault`` can never apply (its pattern matches no aten op, or only ops decomposed before a device runs
    them), with the aten name meant; else ``None``."""
    if any(fault.matches_name(name, name) for name in COLLECTIVES):
        return None
    matched = [qualified for qualified, packet, full in aten_op_names() if fault.matches_name(packet, full)]
    if matched:
        return _composite_warning(fault, source, matched)
    text = fault.pattern.pattern
    packets = sorted({packet for _, packet, _ in aten_op_names()})
    last = text.rpartition(".")[2]
    if "." in text and last in packets:  # a torch name (torch.nn.functional.gelu, torch.Tensor.add_)
        return (f"{source}: {text!r} matches no aten op: faults name aten ops, not torch functions; "
                f"did you mean {last!r} (aten::{last})?")
    close = difflib.get_close_matches(text, packets, n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
    return f"{source}: {text!r} matches no aten op{hint}"


def warn_unmatched(faults: list[Fault], source: str) -> list[Fault]:
    """Log (logger ``ditorch``, once per pattern) each fault whose pattern matches no op; return ``faults``."""
    for fault in faults:
        if fault.pattern.pattern not in _checked_patterns:
            _checked_patterns.add(fault.pattern.pattern)
            message = unmatched_pattern_warning(fault, source)
            if message is not None:
                logging.getLogger("ditorch").warning("%s", message)
    return faults


class FaultTable:
    """The active faults, with a per-op cache so that ops without faults cost one dict lookup."""

    def __init__(self) -> None:
        self._faults: list[Fault] = []
        self._by_op: dict = {}
        self._lock = threading.Lock()
        self.active = False
        # A private generator: injected noise must not consume the user's random stream.
        self._noise_gen = torch.Generator().manual_seed(0)
        self._calls: dict[Fault, int] = {}  # a bitflip fault -> the calls it matched (it fires on every N-th)

    def set(self, faults: list[Fault]) -> None:
        with self._lock:
            touches_versions = any(f.kind in VERSION_KINDS for f in (*self._faults, *faults))
            self._faults = list(faults)
            self._by_op = {}
            self._calls = {}  # a bitflip's every N-th call counts from when it was set
            # and its draws (noise signs, bitflip places, intermittent firing) start over: the same faults on the
            # same program corrupt the same elements, whatever ran before (a test's verdict, not its order's)
            self._noise_gen.manual_seed(0)
            self.active = any(f.kind not in VERSION_KINDS for f in self._faults)
            module_scope.track(any(f.module is not None for f in self._faults))  # hooks only while they serve
            if touches_versions:
                WRITES.apply(self._faults)

    def current(self) -> list[Fault]:
        return list(self._faults)

    def for_op(self, func) -> tuple[Fault, ...]:
        found = self._by_op.get(func)
        if found is None:
            packet = func._schema.name.removeprefix("aten::")
            full = f"{packet}.{func._overloadname}"  # mm.default, add.Tensor
            found = tuple(f for f in self._faults if f.kind not in VERSION_KINDS and f.matches_name(packet, full))
            self._by_op[func] = found
        return found

    def for_collective(self, name: str) -> tuple[Fault, ...]:
        """The output and ``slow`` faults of sim's collective ``name`` (``allreduce``, ``reduce_scatter_tensor``,
        ...: its process group's method)."""
        found = self._by_op.get(name)
        if found is None:
            found = tuple(f for f in self._faults if f.kind in OUTPUT_KINDS | {"slow"} and f.matches_name(name, name))
            self._by_op[name] = found
        return found

    def before(self, func, faults, dtypes, inputs: list) -> None:
        """``inputs``: the kernel's CPU arguments, in order (a ``scratch`` fault writes one)."""
        for fault in faults:
            if not fault.applies(dtypes):
                continue
            if fault.kind == "unsupported":
                dtype = f" for {fault.dtype}" if fault.dtype else ""
                raise SimUnsupportedError(
                    f"sim: {func._schema.name}.{func._overloadname} is not supported{dtype} on this device "
                    f"(injected fault '{fault}')"
                )
            if fault.kind == "slow":
                time.sleep(fault.value / 1000.0)
            if fault.kind == "scratch":
                read = _read_only_input(func, inputs)
                if read is not None:
                    read.mul_(1 + fault.value)

    def after(self, faults, dtypes, outputs) -> None:
        # a sparse output is wrong in its values (its implicit zeros stay zeros)
        outputs = [o._values() if o.layout is torch.sparse_coo else o for o in outputs]
        for fault in faults:
            if fault.kind not in OUTPUT_KINDS or not fault.applies(dtypes) or not self._fires(fault):
                continue
            if fault.kind == "bitflip":
                self._flip(next((o for o in outputs if o.dtype in TOP_MANTISSA_BIT and o.numel()), None))
                continue
            for out in outputs:
                if out.is_floating_point() or out.is_complex():
                    self._poison(fault, out)

    def _fires(self, fault: Fault) -> bool:
        """Whether the fault is active in this call: every N-th call for a bitflip, a drawn fraction if
        intermittent."""
        if fault.kind == "bitflip":
            with self._lock:
                count = self._calls[fault] = self._calls.get(fault, 0) + 1
            if count % int(fault.value):
                return False
        return fault.probability >= 1 or float(torch.rand((), generator=self._noise_gen)) < fault.probability

    def _flip(self, out: torch.Tensor | None) -> None:
        if out is None:
            return
        bit, as_int = TOP_MANTISSA_BIT[out.dtype]
        where = tuple(int(torch.randint(0, size, (), generator=self._noise_gen)) for size in out.shape)
        bits = out.view(as_int)
        bits[where] ^= 1 << bit

    def _poison(self, fault: Fault, out: torch.Tensor) -> None:
        if fault.kind == "nan":
            out.fill_(float("nan"))
        elif fault.kind == "inf":
            out.fill_(float("inf"))
        elif out.numel():
            # Every element off by exactly the relative error, with a random sign. On ``out``'s device: a collective's
            # output is the sim tensor itself (an op's, the CPU tensor behind it).
            out.mul_(self._signs(out).to(out.device, out.dtype).mul_(fault.value).add_(1))

    def _signs(self, out: torch.Tensor) -> torch.Tensor:
        """+1 or -1 per element of ``out``: drawn from the faults' own generator; while torch.compile traces (the
        fault is recorded into the graph it spoils), a fixed pseudo-random pattern computed in the graph, as torch
        2.11 cannot record a draw from a generator."""
        if not is_fake(out):
            return torch.randint(0, 2, out.shape, generator=self._noise_gen).mul_(2).sub_(1)
        hashed = torch.arange(out.numel(), device=out.device).mul_(2654435761).remainder_(2**32)  # Knuth's hash
        return hashed.bitwise_right_shift_(16).bitwise_and_(1).mul_(2).sub_(1).reshape(out.shape)


def _read_only_input(func, inputs: list) -> torch.Tensor | None:
    """The first floating tensor among ``inputs`` that ``func``'s schema does not declare written."""
    for argument, value in zip(func._schema.arguments, inputs):
        written = argument.alias_info is not None and argument.alias_info.is_write
        if not written and isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() and \
                all(stride or size == 1 for stride, size in zip(value.stride(), value.shape)):  # not an expanded one
            return value
    return None


TABLE = FaultTable()


def load_from_env() -> None:
    """Install the faults named by ``DITORCH_SIM_FAULTS`` (replacing any set before)."""
    TABLE.set(warn_unmatched(parse_faults(os.environ.get(ENV_VAR, "")), ENV_VAR))


def set_faults(spec: str | list[Fault]) -> None:
    """Replace the active faults with ``spec`` (a spec string or parsed faults)."""
    TABLE.set(warn_unmatched(parse_faults(spec, "spec"), "spec") if isinstance(spec, str) else spec)


def clear_faults() -> None:
    TABLE.set([])


@contextlib.contextmanager
def faults(spec: str):
    """Add the faults of ``spec`` for the duration of the block, then restore the previous ones.

    >>> with ditorch.sim.faults("mm:noise=1e-3"):
    ...     y = x @ w   # every element of y is off by 1e-3, relatively
    """
    previous = TABLE.current()
    TABLE.set(previous + warn_unmatched(parse_faults(spec, "spec"), "spec"))
    try:
        yield
    finally:
        TABLE.set(previous)


def inject_fault(op: str, kind: str, value: float | None = None, *, dtype: torch.dtype | None = None,
                 module: str | None = None, p: float | None = None, rank: int | None = None) -> None:
    """Add one fault: ``inject_fault("mm", "noise", 1e-3)``, ``inject_fault(".*", "unsupported", dtype=torch.half)``,
    ``inject_fault("silu", "nan", module="model.layers.1")``, ``inject_fault("mm", "bitflip", 50, rank=1)``,
    ``inject_fault("addmm", "noise", 1e-2, p=0.1)``."""
    dtype_text = f"@{str(dtype).removeprefix('torch.')}" if dtype is not None else ""
    module_text = f"@{module}" if module is not None else ""
    value_text = f"={value}" if value is not None else ""
    options = (f",p={p}" if p is not None else "") + (f",rank={rank}" if rank is not None else "")
    spec = f"{op}{module_text}{dtype_text}:{kind}{value_text}{options}"
    TABLE.set(TABLE.current() + warn_unmatched(parse_faults(spec, "inject_fault"), "inject_fault"))
