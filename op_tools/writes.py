"""Which arguments a call writes: known from the op's schema, ``out=``, ``inplace=True``, and a small table of ops
that write without saying so.

Tools that keep host copies of device tensors (OpAutoCompare's copy cache, OpCapture's dedup) must know what a
call changed: a write the version counter does not show (GradScaler's unscale, BatchNorm's running statistics,
CUDA's ``_foreach_lerp_``, a write through ``.data``) would otherwise leave a stale copy in use. Names are
resolved once to a ``WriteSpec``; ``WriteSpec.written(args, kwargs)`` is the per-call part.

>>> call_writes("torch.Tensor.add_").written((x, y), {}) == [x]
True
>>> call_writes("torch.nn.functional.relu").written((x,), {"inplace": True}) == [x]
True
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from .naming import OPERATOR_ATEN_OPS, WRITING_OPERATORS, is_inplace_op

_TENSOR_TYPES = ("Tensor", "Optional[Tensor]", "List[Tensor]", "List[Optional[Tensor]]")


@dataclasses.dataclass(frozen=True)
class WriteSpec:
    """Where a function may write: positions and keyword names (``list_positions`` hold lists of tensors)."""

    positions: tuple[int, ...] = ()
    list_positions: tuple[int, ...] = ()
    keywords: tuple[str, ...] = ()
    inplace_keyword: bool = False       # ``inplace=True`` writes the first argument (torch.nn.functional)
    hidden: tuple[tuple[int, str], ...] = ()  # (position, keyword) written when ``hidden_when`` holds
    hidden_when: tuple[int, str, bool] | None = None  # (position, keyword, default) of the flag enabling them
    unknown: bool = False                # not a torch operator: every tensor argument may be written

    @property
    def never(self) -> bool:
        """True when no call of this function can write any argument: its calls need no write tracking."""
        return not (self.positions or self.list_positions or self.keywords or self.inplace_keyword or self.hidden
                    or self.unknown)

    def written(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """The tensors this call writes (each once), or every tensor argument for an unknown function."""
        if self.never:
            return []
        if self.unknown:
            return _unique(_all_tensors(args, kwargs))
        out: list = []
        for position in self.positions:
            if position < len(args) and isinstance(args[position], torch.Tensor):
                out.append(args[position])
        for position in self.list_positions:
            if position < len(args) and isinstance(args[position], (list, tuple)):
                out.extend(t for t in args[position] if isinstance(t, torch.Tensor))
        for keyword in self.keywords:
            value = kwargs.get(keyword)
            if isinstance(value, torch.Tensor):
                out.append(value)
            elif isinstance(value, (list, tuple)):
                out.extend(t for t in value if isinstance(t, torch.Tensor))
        if self.inplace_keyword and kwargs.get("inplace") is True and args and isinstance(args[0], torch.Tensor):
            out.append(args[0])
        if self.hidden and _flag(args, kwargs, self.hidden_when):
            for position, keyword in self.hidden:
                value = args[position] if position < len(args) else kwargs.get(keyword)
                if isinstance(value, torch.Tensor):
                    out.append(value)
        return _unique(out)


def _flag(args: tuple, kwargs: dict, where) -> bool:
    if where is None:
        return True
    position, keyword, default = where
    value = args[position] if position < len(args) else kwargs.get(keyword, default)
    return bool(value)


def _unique(tensors: list) -> list:
    seen, out = set(), []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _all_tensors(args: tuple, kwargs: dict) -> list:
    from .arguments import iter_tensors

    return [*iter_tensors(args), *iter_tensors(kwargs)]


# Kernels that write arguments their schema does not mark as written (PyTorch's batch norm writes its running
# statistics in place): (position, keyword) written, and the training flag that makes them written.
_HIDDEN_WRITES = {
    "torch.nn.functional.batch_norm": (((1, "running_mean"), (2, "running_var")), (5, "training", False)),
    "torch.batch_norm": (((3, "running_mean"), (4, "running_var")), (5, "training", False)),
    "torch.native_batch_norm": (((3, "running_mean"), (4, "running_var")), (5, "training", False)),
    "torch.nn.functional.instance_norm": (((1, "running_mean"), (2, "running_var")), (5, "use_input_stats", True)),
    "torch.instance_norm": (((3, "running_mean"), (4, "running_var")), (5, "use_input_stats", True)),
    # max_norm renormalises the embedding rows in place (a real in-place op inside: said here so it is compared)
    "torch.nn.functional.embedding": (((1, "weight"),), (3, "max_norm", None)),
}
_FUNCTIONAL = "torch.nn.functional."


@functools.lru_cache(maxsize=4096)
def call_writes(name: str) -> WriteSpec:
    """The ``WriteSpec`` of the function named ``name`` (as ``naming.resolve_op_name`` names it)."""
    short = name.rpartition(".")[2]
    hidden = _HIDDEN_WRITES.get(name)
    hidden_fields: dict = {"hidden": hidden[0], "hidden_when": hidden[1]} if hidden else {}
    if not name.startswith("torch.") or name.startswith("torch.distributed."):
        # A user's function (apply_feature), or a collective writing its buffers from C++: anything may change.
        return WriteSpec(unknown=True)
    if short in WRITING_OPERATORS:
        return WriteSpec(positions=(0,))
    positions, lists, keywords = _schema_writes(short)
    if not positions and not lists and is_inplace_op(name) and short != "requires_grad_":
        positions = (0,)  # a torch function named as in-place with no aten schema of that name
    inplace = name.startswith(_FUNCTIONAL) and _takes_inplace(name)
    return WriteSpec(positions, lists, keywords, inplace, **hidden_fields)


def _schema_writes(short: str) -> tuple[tuple, tuple, tuple]:
    """Positions, list positions and keyword names that any overload of ``aten::<short>`` writes."""
    try:
        packet = getattr(torch.ops.aten, OPERATOR_ATEN_OPS.get(short, short))
    except (AttributeError, RuntimeError):
        return (), (), ()
    if not isinstance(packet, torch._ops.OpOverloadPacket):  # the namespace's own attributes (__repr__, __dir__)
        return (), (), ()
    positions, lists, keywords = set(), set(), set()
    for overload in packet.overloads():
        for position, argument in enumerate(getattr(packet, overload)._schema.arguments):
            info = argument.alias_info
            kind = str(argument.type)
            if info is None or not info.is_write or kind not in _TENSOR_TYPES:
                continue  # TorchScript's list builtins (aten::sort.int on int[]) write lists, not tensors
            if argument.kwarg_only:
                keywords.add(argument.name)
            elif kind.startswith("List"):
                lists.add(position)
            else:
                positions.add(position)
    return tuple(sorted(positions)), tuple(sorted(lists)), tuple(sorted(keywords))


def _takes_inplace(name: str) -> bool:
    import inspect

    func = getattr(torch.nn.functional, name[len(_FUNCTIONAL):], None)
    try:
        return func is not None and "inplace" in inspect.signature(func).parameters
    except (TypeError, ValueError):
        return False
