"""PyTorch's operator database (``op_db``), what each OpInfo claims, and choosing OpInfos and dtypes by name.

``torch.testing._internal.common_methods_invocations.op_db`` lists every operator PyTorch tests, with
sample inputs per dtype, the dtypes it claims per device type and whether it supports autograd. It is
imported only in the worker processes (it takes seconds and imports PyTorch's test utilities), and
importing it needs the small ``expecttest`` package: ``pip install 'ditorch[conformance]'``.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import functools

import torch

# OpInfos whose outputs are random draws or uninitialised memory: there is nothing to compare. Other random
# ops are caught by running the first sample twice on the CPU with different seeds.
RANDOM_OPS = frozenset({
    "bernoulli", "cauchy", "exponential", "geometric", "log_normal", "multinomial", "normal", "normal.in_place",
    "normal.number_mean", "uniform", "rand_like", "randint", "randint_like", "randn", "randn_like",
    "nn.functional.alpha_dropout", "nn.functional.dropout", "nn.functional.dropout2d", "nn.functional.dropout3d",
    "nn.functional.feature_alpha_dropout.with_train", "nn.functional.rrelu",
})
UNINITIALISED_OPS = frozenset({"empty", "empty_like", "empty_permuted", "empty_strided", "new_empty",
                               "new_empty_strided"})
DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64", "complex64", "complex128", "complex32", "int8", "int16",
               "int32", "int64", "uint8", "bool")
DEFAULT_DTYPES = ("float32", "float16", "bfloat16")
EXTRA_NAME = "conformance"


class MissingDependencyError(RuntimeError):
    """PyTorch's operator database cannot be imported; the message says what to install."""


def import_op_db() -> list:
    """PyTorch's ``op_db`` list (importing it takes seconds); MissingDependencyError says what to install."""
    try:
        from torch.testing._internal.common_methods_invocations import op_db
    except ModuleNotFoundError as e:
        if e.name == "expecttest":
            raise MissingDependencyError(
                "the conformance sweep needs PyTorch's operator database, whose import needs the 'expecttest' "
                f"package: pip install expecttest (or pip install 'ditorch[{EXTRA_NAME}]')") from None
        raise MissingDependencyError(f"cannot import PyTorch's operator database ({e}); torch {torch.__version__}") \
            from None
    except ImportError as e:
        raise MissingDependencyError(f"cannot import PyTorch's operator database ({e}); torch {torch.__version__}") \
            from None
    return op_db


@functools.cache
def load_op_db() -> dict:
    """``{full name: OpInfo}`` of every OpInfo in PyTorch's ``op_db``, as it is when first asked for."""
    return {full_name(op): op for op in import_op_db()}


def full_name(opinfo) -> str:
    """``"normal.in_place"``: the name and variant that tell an OpInfo from the others (its own ``full_name`` from
    torch 2.5 on)."""
    variant = getattr(opinfo, "variant_test_name", "")
    return f"{opinfo.name}.{variant}" if variant else opinfo.name


@dataclasses.dataclass(frozen=True)
class OpEntry:
    """What the sweep needs to know about an OpInfo before running it (sent from a worker to the sweep)."""

    name: str                 # the full name: "max.reduction_with_dim"
    base: str                 # the name without its variant: "max"
    dtypes: tuple[str, ...]   # the dtypes it claims on the device's type
    gradients: tuple[str, ...] = ()  # the dtypes it claims gradients in there

    @classmethod
    def from_dict(cls, data: dict) -> OpEntry:
        return cls(data["name"], data["base"], tuple(data["dtypes"]), tuple(data.get("gradients", ())))


def catalogue(device_type: str) -> list[OpEntry]:
    """Every OpInfo with the dtypes it claims on ``device_type``, forward and backward."""
    def names(dtypes) -> tuple[str, ...]:
        return tuple(sorted(dtype_name(d) for d in dtypes))

    return [OpEntry(name, op.name, names(op.supported_dtypes(device_type)),
                    names(op.supported_backward_dtypes(device_type)))
            for name, op in load_op_db().items()]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtypes(text: str) -> tuple[str, ...] | None:
    """``--dtypes``: comma-separated dtype names; ``all``: every dtype an OpInfo claims (``None``)."""
    names = [n.strip().removeprefix("torch.") for n in text.split(",") if n.strip()]
    if names == ["all"]:
        return None
    if not names:
        raise ValueError("no dtype given")
    for name in names:
        if not isinstance(getattr(torch, name, None), torch.dtype):
            raise ValueError(f"unknown dtype {name!r} (e.g. {', '.join(DTYPE_NAMES[:6])}, or all)")
    return tuple(dict.fromkeys(names))


def select(entries: list[OpEntry], patterns: list[str] | None) -> list[OpEntry]:
    """The entries named by ``patterns`` (all when None), in op_db's order.

    A pattern is a full name (``max.reduction_with_dim``, ``softmax``: that OpInfo alone), a name that is only
    the stem of variants (``max``: all of them) or a shell-style pattern (``nn.functional.*``, ``softmax*``).
    A pattern that selects nothing is a ValueError naming it and the closest names.
    """
    if not patterns:
        return list(entries)
    names = [e.name for e in entries]
    chosen: set[str] = set()
    for pattern in patterns:
        if pattern in names:  # a full name is that OpInfo alone (``softmax``, not ``softmax.with_dtype``)
            chosen.add(pattern)
            continue
        found = {e.name for e in entries if e.base == pattern or fnmatch.fnmatchcase(e.name, pattern)}
        if not found:
            close = difflib.get_close_matches(pattern, names, n=4)
            hint = f"; closest: {', '.join(close)}" if close else ""
            raise ValueError(f"--ops {pattern!r} names no OpInfo of torch {torch.__version__}{hint}")
        chosen |= found
    return [e for e in entries if e.name in chosen]


# --- what an OpInfo claims ---

def skip_reason(opinfo, dtype: torch.dtype, device_type: str) -> str | None:
    """Why ``opinfo`` in ``dtype`` is not run at all on ``device_type``, or None."""
    if full_name(opinfo) in UNINITIALISED_OPS:
        return "uninitialised memory: nothing to compare"
    if full_name(opinfo) in RANDOM_OPS:
        return "random: its outputs are draws"
    if dtype not in opinfo.supported_dtypes(device_type):
        return f"dtype not claimed: the OpInfo lists no {dtype_name(dtype)} on {device_type}"
    return None


def supports_backward(opinfo, dtype: torch.dtype, device_type: str) -> str | None:
    """None when the OpInfo claims gradients in ``dtype`` on ``device_type``, else why not."""
    if not opinfo.supports_autograd:
        return "no autograd: the OpInfo does not support it"
    if dtype not in opinfo.supported_backward_dtypes(device_type):
        return f"backward not claimed: the OpInfo lists no {dtype_name(dtype)} gradients on {device_type}"
    return None


@functools.cache
def _replayable(name: str) -> bool:
    from ..replay import ReplayError, resolve_op

    try:
        resolve_op(name)
    except ReplayError:
        return False
    return True


def replay_name(opinfo) -> str:
    """The name under which ``run_op_from_data`` finds the OpInfo's function (``torch.add``,
    ``torch.ops.aten._softmax_backward_data``), or "" when it calls a Python wrapper of its own."""
    from torch.overrides import resolve_name

    from ...ops.naming import has_twin

    func = opinfo.op
    try:
        if isinstance(func, torch._ops.OpOverloadPacket):
            name = "torch.ops." + func._qualified_op_name.replace("::", ".")
        elif isinstance(func, torch._ops.OpOverload):
            name = f"torch.ops.{func._schema.name.replace('::', '.')}.{func._overloadname}"
        elif has_twin(func):  # torch.mm == torch.spmm: torch's table names both torch.spmm
            name = f"torch.{func.__name__}"
        else:
            name = resolve_name(func) or ""
    except Exception:  # noqa: BLE001 - an object torch cannot name: not replayable
        return ""
    return name if name and _replayable(name) else ""
