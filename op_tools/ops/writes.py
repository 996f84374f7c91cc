"""Which arguments a call writes: known from the op's schema, ``out=``, ``inplace=True``, and what ``op_facts`` declares
(ops that write without saying so, a user's ops).

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
from typing import Any

import torch

from .naming import TENSOR_TYPES, WRITING_OPERATORS, aten_packet, is_inplace_op
from .op_facts import cached_on_facts, op_facts


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
    # Its device kernels write without moving version counters (no ADInplaceOrView kernel, not a composite: the
    # foreach family, fused optimizers); what the CPU's own kernel moves (its slow path's per-tensor ``add_``) says
    # nothing of the device's: ``version_moves``.
    unversioned: bool = False

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
        if self.hidden and flag_holds(args, kwargs, self.hidden_when):
            for position, keyword in self.hidden:
                value = args[position] if position < len(args) else kwargs.get(keyword)
                if isinstance(value, torch.Tensor):
                    out.append(value)
        return _unique(out)


def overwritten(name: str, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors a call of ``name`` writes without reading what they held, beyond its first argument (``op_facts``'
    ``overwritten``): no input of the call."""
    facts = op_facts(name)
    if not facts.overwritten or not flag_holds(args, kwargs, facts.overwritten_when):
        return []
    out: list = []
    for position, keyword in facts.overwritten:
        value = args[position] if position < len(args) else kwargs.get(keyword)
        out.extend(t for t in (value if isinstance(value, (list, tuple)) else (value,)) if isinstance(t, torch.Tensor))
    return out


def flag_holds(args: tuple, kwargs: dict, where) -> bool:
    """Whether a call's flag argument at ``where`` (``op_facts``' ``Flag``: position, keyword, default) is set; True
    for None (no flag: always)."""
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


_FUNCTIONAL = "torch.nn.functional."


@cached_on_facts
def call_writes(name: str) -> WriteSpec:
    """The ``WriteSpec`` of the function named ``name`` (as ``naming.resolve_op_name`` names it)."""
    short = name.rpartition(".")[2]
    facts = op_facts(name)  # writes its schema does not show (BatchNorm's running statistics), or a user's op's
    hidden_fields: dict = {"hidden": facts.writes, "hidden_when": facts.writes_when} if facts.writes else {}
    if not name.startswith("torch.") or name.startswith("torch.distributed."):
        # A user's function (apply_feature), or a collective writing its buffers from C++: anything may change,
        # unless its writes were declared.
        return WriteSpec(unknown=True) if facts.writes is None else WriteSpec(**hidden_fields)
    if short in WRITING_OPERATORS:
        return WriteSpec(positions=(0,))
    positions, lists, keywords = _schema_writes(short)
    if not positions and not lists and is_inplace_op(name) and short != "requires_grad_":
        positions = (0,)  # a torch function named as in-place with no aten schema of that name
    inplace = name.startswith(_FUNCTIONAL) and _takes_inplace(name)
    return WriteSpec(positions, lists, keywords, inplace, **hidden_fields, unversioned=_unversioned(short))


def _unversioned(short: str) -> bool:
    """Whether no overload of ``aten::<short>`` that the dispatcher knows has an ADInplaceOrView kernel (the one that
    moves the version counters of what an op writes) or a CompositeImplicitAutograd one (a decomposition that runs the
    same ops on every device): its device kernels' writes move no counter (CUDA's fused foreach kernels, sim's)."""
    packet = aten_packet(short)
    if packet is None:
        return False
    known = False
    for overload in packet.overloads():
        qualified = packet._qualified_op_name + ("" if overload == "default" else f".{overload}")
        try:
            if any(torch._C._dispatch_has_kernel_for_dispatch_key(qualified, key)
                   for key in ("ADInplaceOrView", "CompositeImplicitAutograd")):
                return False
        except RuntimeError:  # a TorchScript builtin (aten::add_.t on lists), not in the dispatcher
            continue
        known = True
    return known


def _schema_writes(short: str) -> tuple[tuple, tuple, tuple]:
    """Positions, list positions and keyword names that any overload of ``aten::<short>`` writes."""
    packet = aten_packet(short)
    if packet is None:
        return (), (), ()
    positions, lists, keywords = set(), set(), set()
    for overload in packet.overloads():
        for position, argument in enumerate(getattr(packet, overload)._schema.arguments):
            info = argument.alias_info
            kind = str(argument.type)
            if info is None or not info.is_write or kind not in TENSOR_TYPES:
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


def _byte_range(t: torch.Tensor) -> tuple[int, int] | None:
    """The bytes of its storage ``t`` spans, [start, end); None for a tensor with no memory of its own to compare."""
    if t.layout != torch.strided or t.is_meta or t.numel() == 0:
        return None
    start = int(t.storage_offset()) * t.element_size()
    span = sum((int(n) - 1) * int(s) for n, s in zip(t.shape, t.stride())) + 1
    return start, start + span * t.element_size()


def writes_overlap(writes: WriteSpec, args: tuple, kwargs: dict) -> bool:
    """Whether a tensor the call writes shares memory with another of its tensors without being the
    same view of it: ``x.add_(x[0])``, ``add(x[:-1], 1, out=x[1:])``, which a device refuses ("some elements of the
    input tensor and the written-to tensor refer to a single memory location") and copies of each, sharing no memory,
    would compute. Not for a function of unknown writes (every argument may be written)."""
    if writes.unknown or writes.never:
        return False
    written = writes.written(args, kwargs)
    if not written:
        return False
    from .arguments import local_part  # a DTensor's memory is its local tensor's (its own storage has none)

    by_storage: dict[tuple, list[tuple[torch.Tensor, tuple[int, int]]]] = {}  # (device, storage) -> its tensors
    for t in _all_tensors(args, kwargs):
        t = local_part(t)
        span = _byte_range(t)
        if span is not None:
            by_storage.setdefault((t.device, t.untyped_storage().data_ptr()), []).append((t, span))
    for w in written:
        w = local_part(w)
        mine = _byte_range(w)
        if mine is None:
            continue
        for other, theirs in by_storage.get((w.device, w.untyped_storage().data_ptr()), ()):
            if other is w:
                continue
            same_view = theirs == mine and other.shape == w.shape and other.stride() == w.stride()
            if not same_view and theirs[0] < mine[1] and mine[0] < theirs[1]:
                return True
    return False


def stand_in_made(t: torch.Tensor) -> tuple[int | None, Any]:
    """What ``carry_writes`` compares a stand-in with, taken as it is made: its version counter (None for an inference
    tensor, which keeps none: reading it raises) and its autograd node."""
    return (None if t.is_inference() else t._version), t.grad_fn


def carry_writes(pairs: list, writes: WriteSpec, args: tuple, kwargs: dict) -> None:
    """Give each original what a call wrote into its stand-in, the copy the call ran on instead (on the CPU, in a
    wider dtype): ``pairs`` of ``(original, stand-in, *stand_in_made(stand-in))``. Written: what ``writes`` declares
    for the call's original ``args``/``kwargs`` (in-place ops, ``out=``, BatchNorm's running statistics, which its
    kernel writes without moving the version counter), and any stand-in whose version counter moved; an inference
    stand-in, with no counter, where declared, or wherever the call's writes are unknown. Each original's version
    counter ends where the op itself leaves it (``version_moves``), not where the tool's ``copy_`` puts it."""
    declared = set() if writes.unknown else {id(t) for t in writes.written(args, kwargs)}
    for original, stand_in, version, made_by in pairs:
        moved = writes.unknown if version is None else stand_in._version != version
        if (moved or id(original) in declared) and original is not stand_in:
            carry_write(original, stand_in, made_by, version_moves(writes, stand_in, version))


def version_moves(writes: WriteSpec, stand_in: torch.Tensor, version: int | None) -> int | None:
    """How far the call moves the version counter of the device tensor ``stand_in`` stood in for: as far as it moved
    ``stand_in``'s (``version``: as made), since the CPU's dispatch moves it as the device's does (ADInplaceOrView,
    or a composite's own in-place ops); 0 for an op whose device kernels write unversioned (``WriteSpec.unversioned``);
    None where unknown (an inference stand-in keeps no counter)."""
    if writes.unversioned:
        return 0
    return None if version is None else stand_in._version - version


def carry_write(original: torch.Tensor, stand_in: torch.Tensor, made_by, moves: int | None = None) -> None:
    """Give ``original`` what a call wrote into ``stand_in``, made by autograd node ``made_by`` (``stand_in.grad_fn``
    then), and its shape where the call resized it (``out=``). Recorded by autograd only where the call's own write
    was (``stand_in``'s node moved on): written outside autograd (``torch.nn.init``'s functions, under ``no_grad``
    inside), a parameter takes the values as it would have on the device, where autograd refuses an in-place op on a
    leaf that requires grad. ``original``'s version counter then stands ``moves`` past where it was (the op's own
    moves: ``copy_`` moved it once, BatchNorm's running statistics and ``_foreach_add_`` move it not at all), or
    where ``copy_`` leaves it for None."""
    after = None if moves is None or original.is_inference() else original._version + moves
    if original.shape != stand_in.shape:
        # an ``out=`` tensor the op resized: resized inside the op's kernel on the device, which moves its version
        # counter once, for the write (copy_ below); resize_ above ADInplaceOrView would move it again
        with torch._C._AutoDispatchBelowADInplaceOrView():
            original.resize_(stand_in.shape)
    with torch.set_grad_enabled(torch.is_grad_enabled() and stand_in.grad_fn is not made_by):
        original.copy_(stand_in)
    if after is not None:
        set_version(original, after)


def carry_version(result: torch.Tensor, made_from: torch.Tensor, writes: WriteSpec) -> None:
    """Give ``result``, the tool's copy of a call's output ``made_from`` (on the device, in the caller's dtype), the
    version counter the op left on ``made_from`` (``stft``'s result: 2, from its own in-place steps): a fresh copy's
    is 0. Not for an op whose device kernels write unversioned: the CPU's kernel is not theirs."""
    if writes.unversioned or made_from.is_inference() or result.is_inference():
        return
    if made_from._version != result._version:
        set_version(result, made_from._version)


def set_version(t: torch.Tensor, version: int) -> None:
    """Set ``t``'s version counter (shared with its views and base) to ``version``."""
    torch._C._autograd._unsafe_set_version_counter((t,), (version,))
