"""What a ``torch.distributed`` collective sends and receives: one table, read by every tool that looks at one.

A collective writes its received tensor from C++ (or another stream), so a tool reads what was sent before the call
(``sent``) and what arrived after it (``received``). An asynchronous call (``async_op=True``) has received nothing
when it returns: its result is ready when its ``Work`` is waited for, where the tools check it
(``core/collective_waits.py``).

>>> c = collective_call("torch.distributed.all_reduce", dist.all_reduce, (t,), {"op": dist.ReduceOp.AVG})
>>> c.kind, c.sent, c.received, c.reduce_op
('all_reduce', [t], [t], 'avg')
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import torch


@dataclasses.dataclass(frozen=True)
class CollectiveSignature:
    """Parameter names: what the call sends, what it receives (a list parameter holds one tensor per rank)."""

    kind: str
    sent: str
    received: str
    reduces: bool = False  # takes ``op`` (a ReduceOp, SUM by default)


_SIGNATURES = {
    "all_reduce": CollectiveSignature("all_reduce", "tensor", "tensor", reduces=True),
    "broadcast": CollectiveSignature("broadcast", "tensor", "tensor"),
    "all_gather_into_tensor": CollectiveSignature("all_gather", "input_tensor", "output_tensor"),
    "all_gather_single": CollectiveSignature("all_gather", "input_tensor", "output_tensor"),
    "all_gather": CollectiveSignature("all_gather", "tensor", "tensor_list"),
    "reduce_scatter_tensor": CollectiveSignature("reduce_scatter", "input", "output", reduces=True),
    "reduce_scatter_single": CollectiveSignature("reduce_scatter", "input", "output", reduces=True),
    "reduce_scatter": CollectiveSignature("reduce_scatter", "input_list", "output", reduces=True),
    "all_to_all_single": CollectiveSignature("all_to_all", "input", "output"),
    "reduce": CollectiveSignature("reduce", "tensor", "tensor", reduces=True),
}
_PREFIX = "torch.distributed."
COLLECTIVE_NAMES = tuple(_SIGNATURES)  # their names in the torch.distributed namespace


@dataclasses.dataclass
class CollectiveCall:
    """One call of a collective, its arguments bound to their names."""

    name: str
    kind: str
    sent: list[torch.Tensor]
    received: list[torch.Tensor]
    reduce_op: str  # "sum", "avg", "max", "min", "product", "" when the collective does not reduce; else the op's name
    group: object  # the ProcessGroup (None: the default group)
    asynchronous: bool
    arguments: dict
    functional: bool = False  # a functional collective: what it receives is its result, known once it returns
    coalesced: bool = False  # called inside a ``_coalescing_manager``: issued later, with the others, at its exit


def signature_of(name: str) -> CollectiveSignature | None:
    """The signature of the ``torch.distributed`` collective ``name``, None for any other function."""
    return _SIGNATURES.get(name[len(_PREFIX):]) if name.startswith(_PREFIX) else None


@functools.cache
def _parameters(func) -> inspect.Signature:
    return inspect.signature(inspect.unwrap(func))


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for t in value if isinstance(t, torch.Tensor)]
    return []


_REDUCE_OPS = frozenset({"sum", "avg", "max", "min", "product", "band", "bor", "bxor", "premul_sum"})


def _op_name(op) -> str:
    """``"sum"`` for ``ReduceOp.SUM`` (printed ``RedOpType.SUM``), ``"premul_sum"`` for the op
    ``_make_nccl_premul_sum(factor)`` builds (a ``ReduceOp`` holding its ``RedOpType`` and factor); ``"other"`` for
    any other op built at run time."""
    if op is None:
        return "sum"
    text = str(getattr(op, "op", op)).rpartition(".")[2].lower()
    return text if text in _REDUCE_OPS else "other"


def premul_factor(call: CollectiveCall):
    """The factor a ``premul_sum`` collective multiplies each rank's tensor by before summing (a number, or a 0-d
    tensor as given), from its ``ReduceOp``: its ``factor`` (torch 2.13), else its state's second item (2.11)."""
    op = call.arguments.get("op")
    factor = getattr(op, "factor", None)
    if factor is None and op is not None and hasattr(op, "__getstate__"):
        state = op.__getstate__()
        factor = state[1] if isinstance(state, tuple) and len(state) > 1 else None
    return factor


def collective_call(name: str, func, args: tuple, kwargs: dict) -> CollectiveCall | None:
    """The call bound to its signature's names, or None for a function that is not one of the table's collectives
    (or whose arguments do not bind)."""
    signature = signature_of(name)
    if signature is None:
        return None
    try:
        bound = _parameters(func).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    return CollectiveCall(name, signature.kind, _tensors(arguments.get(signature.sent)),
                          _tensors(arguments.get(signature.received)),
                          _op_name(arguments.get("op")) if signature.reduces else "", arguments.get("group"),
                          bool(arguments.get("async_op", False)), arguments,
                          coalesced=_coalescing(arguments.get("group")))


def root_rank(call: CollectiveCall) -> int:
    """A broadcast's source or a reduce's destination, as a rank of the call's group: ``group_src``/``group_dst``, else
    the global ``src``/``dst`` (0 when none is given) translated."""
    side = "src" if call.kind == "broadcast" else "dst"
    local = call.arguments.get(f"group_{side}")
    if local is not None:
        return local
    global_rank = call.arguments.get(side) or 0
    if call.group is None:
        return global_rank
    from torch.distributed import distributed_c10d

    return distributed_c10d.get_group_rank(call.group, global_rank)  # type: ignore[arg-type]  # a ProcessGroup


def split_sizes(call: CollectiveCall, side: str, size: int) -> list[int]:
    """An all-to-all's rows per rank of its ``side`` ("input": what it sends, "output": what it receives): its split
    sizes, or ``size`` equal parts."""
    given = call.arguments.get(f"{side}_split_sizes")
    tensor = call.sent[0] if side == "input" else call.received[0]
    return list(given) if given else [tensor.shape[0] // size] * size


def _coalescing(group) -> bool:
    """Whether ``group`` (None: the default group) is inside a ``_coalescing_manager`` now: its collectives are queued,
    not run, until the manager's exit runs them as one batch (what they receive is not there after the call)."""
    from torch.distributed import distributed_c10d

    state = distributed_c10d._world.pg_coalesce_state
    return bool(state) and (group if group is not None else distributed_c10d._get_default_group()) in state


# The functional collectives (``torch.ops._c10d_functional``: DTensor's redistributions, FSDP2 compiled, the
# autograd ones of expert parallelism) that move tensors: their kind and their parameters, in the schema's order. Each
# returns what it received, filled when it is waited for (``wait_tensor``); a broadcast's source is a rank of the
# group (``group_src``).
_FUNCTIONAL: dict[str, tuple[str, tuple[str, ...]]] = {
    "all_reduce": ("all_reduce", ("input", "reduce_op", "group_name")),
    "all_reduce_": ("all_reduce", ("input", "reduce_op", "group_name")),
    "all_gather_into_tensor": ("all_gather", ("input", "group_size", "group_name")),
    "reduce_scatter_tensor": ("reduce_scatter", ("input", "reduce_op", "group_size", "group_name")),
    "all_to_all_single": ("all_to_all", ("input", "output_split_sizes", "input_split_sizes", "group_name")),
    "broadcast": ("broadcast", ("input", "group_src", "group_name")),
    "broadcast_": ("broadcast", ("input", "group_src", "group_name")),
}
_FUNCTIONAL_NAMESPACES = ("_c10d_functional.", "_c10d_functional_autograd.", "c10d_functional.")


def functional_kind(name: str) -> str | None:
    """The kind of the functional collective ``name`` (as the tools name calls: ``_c10d_functional.all_reduce``, with or
    without its overload), None for any other name."""
    namespace, _, rest = name.partition(".")
    if namespace + "." not in _FUNCTIONAL_NAMESPACES:
        return None
    entry = _FUNCTIONAL.get(rest.partition(".")[0])
    return entry[0] if entry else None


def functional_call(name: str, args: tuple, kwargs: dict) -> CollectiveCall | None:
    """A functional collective's call bound to its parameters (``received`` empty: its result, once it returns), or
    None for another function or arguments that do not bind."""
    if functional_kind(name) is None:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    kind, parameters = _FUNCTIONAL[name.partition(".")[2].partition(".")[0]]
    if len(args) > len(parameters) or set(kwargs) - set(parameters):
        return None
    arguments = {**dict(zip(parameters, args)), **kwargs}
    if "input" not in arguments or "group_name" not in arguments:
        return None
    group = _resolve_process_group(arguments["group_name"])
    return CollectiveCall(name, kind, _tensors(arguments["input"]), [], str(arguments.get("reduce_op", "")).lower(),
                          group, False, arguments, functional=True)


# The collectives that move tensors between ranks. A tool's mode sees one only where torch dispatches it to
# __torch_function__ (``has_torch_function`` in its body, or in the collective it calls: torch 2.13's
# all_gather_into_tensor calls all_gather_single). Torch 2.11 does so for five of them only.
_DATA_COLLECTIVES = ("broadcast", "all_reduce", "all_reduce_coalesced", "reduce", "all_gather",
                     "all_gather_into_tensor", "gather", "scatter", "reduce_scatter", "reduce_scatter_tensor",
                     "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv")


@functools.lru_cache(maxsize=1)
def unseen_collectives() -> tuple[str, ...]:
    """The ``torch.distributed`` collectives of this torch that no tool's mode sees (they dispatch no
    ``__torch_function__``): on torch 2.11 ``broadcast``, ``reduce``, ``gather``, ``scatter``, ``reduce_scatter``,
    ``all_to_all``, ``send``/``recv``...; none on torch 2.13."""
    import torch.distributed as dist

    if not dist.is_available():
        return ()

    def dispatches(name: str, depth: int = 1) -> bool:
        code = getattr(inspect.unwrap(getattr(dist, name)), "__code__", None)
        if code is None:  # not a Python function: nothing to tell
            return True
        return "has_torch_function" in code.co_names or depth > 0 and any(
            other != name and hasattr(dist, other) and dispatches(other, depth - 1) for other in code.co_names
            if other in _DATA_COLLECTIVES or other.endswith("_single"))

    return tuple(_PREFIX + name for name in _DATA_COLLECTIVES if hasattr(dist, name) and not dispatches(name))
