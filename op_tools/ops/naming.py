"""Names of the functions the engine sees, and what kind of call each name is."""

from __future__ import annotations

import difflib
import functools
import importlib
from typing import Any

from torch.overrides import resolve_name

_names: dict[Any, str] = {}

# Calls that only read metadata or host values, or manage autograd: never handled by any tool.
METADATA_QUERIES = frozenset(
    "torch.Tensor." + n for n in (
        "size", "dim", "ndimension", "numel", "nelement", "stride", "storage_offset", "data_ptr", "element_size",
        "is_contiguous", "is_floating_point", "is_complex", "is_signed", "is_neg", "is_conj", "is_inference",
        "is_set_to", "is_shared", "is_pinned", "_is_view", "_is_zerotensor", "has_names", "get_device", "type",
        "untyped_storage", "storage", "_typed_storage", "dim_order", "__repr__", "__format__", "__str__",
        "__hash__", "__len__", "__bool__", "__int__", "__float__", "__index__", "__dir__", "__reduce_ex__",
        "__setstate__", "__deepcopy__", "__array__", "item", "tolist", "backward", "register_hook",
        "register_post_accumulate_grad_hook", "retain_grad", "requires_grad_", "_version", "__contains__",
        "is_same_size", "__dlpack_device__",
    )
) | frozenset({"torch._has_compatible_shallow_copy_type", "torch.is_tensor", "torch.numel", "torch.is_floating_point",
               "torch.is_complex", "torch.is_nonzero", "torch.result_type", "torch.can_cast", "torch.promote_types",
               "torch.is_same_size", "torch.get_device",
               # grad mode's switch (torch 2.11 dispatches it to the modes): the state calls run under, not a call
               "torch._C._set_grad_enabled",
               # torch.profiler.record_function's marks (an optimizer step's): a profiler handle, no values
               "profiler._record_function_enter_new", "profiler._record_function_exit._RecordFunction",
               # devices and parsed .to() arguments: a CPU rerun would answer cpu, which is no reference for them
               "torch.device", "torch._C._nn._parse_to"})

# Ops whose outputs alias their input: falling back or casting them would break the aliasing.
VIEW_OPS = frozenset(
    "torch.Tensor." + n for n in (
        "view", "view_as", "reshape", "reshape_as", "as_strided", "detach", "diagonal", "expand", "expand_as",
        "movedim", "moveaxis", "narrow", "permute", "select", "squeeze", "unsqueeze", "transpose", "t", "T", "H",
        "mT", "mH", "real", "imag", "unflatten", "flatten", "unfold", "unbind", "split", "split_with_sizes", "hsplit",
        "vsplit", "tensor_split", "swapaxes", "swapdims", "chunk", "indices", "values", "__getitem__", "adjoint",
        "T.__get__", "H.__get__", "mT.__get__", "mH.__get__", "real.__get__", "imag.__get__", "contiguous",
        # in place: they change the tensor's shape, strides or storage, not its values (aten's ``inplace_view`` tag)
        "unsqueeze_", "squeeze_", "t_", "transpose_", "swapdims_", "swapaxes_", "as_strided_", "resize_",
        "resize_as_", "set_", "detach_",
    )
) | frozenset(
    "torch." + n for n in (
        "reshape", "flatten", "squeeze", "unsqueeze", "transpose", "t", "permute", "narrow", "select", "split",
        "chunk", "unbind", "movedim", "view_as_real", "view_as_complex", "as_strided", "diagonal", "detach",
        "as_strided_", "resize_as_", "detach_",
    )
)

# Composite ops whose results are views of their input though their schemas promise no alias (aten's ``schema_view``
# cannot tell): they return what view ops made (unsafe_split: split's pieces, autograd told nothing).
UNANNOTATED_VIEWS = ("atleast_1d", "atleast_2d", "atleast_3d", "broadcast_tensors", "meshgrid", "unsafe_split",
                     "unsafe_split_with_sizes", "unsafe_chunk")

# Ops that move data between devices or convert dtypes on purpose.
CONVERSIONS = frozenset(
    "torch.Tensor." + n for n in (
        "to", "cpu", "cuda", "type", "copy_", "half", "float", "double", "bfloat16", "int", "long", "short", "bool",
        "char", "byte", "pin_memory", "type_as", "new_tensor", "clone", "__deepcopy__", "contiguous",
    )
) | frozenset({"torch.tensor", "torch.as_tensor", "torch.from_numpy", "torch.asarray"})


# Tensor operators that PyTorch's C++ dispatch hands to a function mode as the named method (``x + y`` is seen
# as ``torch.Tensor.add``): targeted dispatch wraps them under that name. Checked against a mode by the tests.
OPERATOR_METHODS = {
    "__add__": "add", "__radd__": "add", "__iadd__": "add_", "__sub__": "sub", "__isub__": "sub_",
    "__mul__": "mul", "__rmul__": "mul", "__imul__": "mul_", "__truediv__": "div", "__div__": "div",
    "__itruediv__": "div_", "__idiv__": "div_", "__ifloordiv__": "floor_divide_", "__mod__": "remainder",
    "__imod__": "remainder_", "__matmul__": "matmul", "__lt__": "lt", "__le__": "le", "__gt__": "gt", "__ge__": "ge",
    "__ne__": "ne", "__rand__": "bitwise_and", "__ror__": "bitwise_or", "__rxor__": "bitwise_xor",
}

# The aten op behind each Tensor operator, for lookups in ``torch.ops.aten`` (whose own ``__eq__`` is Python's): a
# mode sees ``a == b`` as ``torch.Tensor.__eq__``. Operators aten has under their own name (``__and__``) map to it.
OPERATOR_ATEN_OPS = {
    **OPERATOR_METHODS, "__eq__": "eq", "__invert__": "bitwise_not", "__neg__": "neg", "__pos__": "positive",
    "__abs__": "abs", "__pow__": "pow", "__rpow__": "pow", "__rsub__": "rsub", "__rtruediv__": "div",
    "__floordiv__": "floor_divide", "__rfloordiv__": "floor_divide", "__rmod__": "remainder",
    "__rlshift__": "__lshift__", "__rrshift__": "__rshift__", "__rmatmul__": "matmul", "__reversed__": "flip",
}

# Operators that write their first argument (``a += b``); ``__invert__``, ``__index__`` and ``__iter__`` do not.
WRITING_OPERATORS = frozenset({"__setitem__"}) | frozenset(
    f"__i{op}__" for op in ("add", "sub", "mul", "div", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or",
                            "xor", "lshift", "rshift")
)


# Where torch's functions are aten ops, and the prefix aten's name has there (``torch.linalg.diagonal`` is
# ``aten::linalg_diagonal``, ``torch.functional.split`` is ``aten::split``). Not torch.nn.functional: its Python
# functions share names with aten ops they are not (``F.unfold`` is im2col, ``aten::unfold`` a view).
_ATEN_PREFIXES = {"torch": "", "torch.Tensor": "", "torch.functional": "", "torch._C._nn": "",
                  "torch.linalg": "linalg_", "torch.special": "special_", "torch.fft": "fft_"}
TENSOR_TYPES = ("Tensor", "Optional[Tensor]", "List[Tensor]", "List[Optional[Tensor]]")


def aten_packet(short: str):
    """``torch.ops.aten.<short>`` (as ``OPERATOR_ATEN_OPS`` maps operators), or None where aten has no op of that
    name."""
    import torch

    try:
        packet = getattr(torch.ops.aten, OPERATOR_ATEN_OPS.get(short, short))
    except (AttributeError, RuntimeError):
        return None
    # not the namespace's own attributes (__repr__, __dir__)
    return packet if isinstance(packet, torch._ops.OpOverloadPacket) else None


@functools.cache
def schema_view(name: str) -> bool:
    """Whether the aten op behind the function named ``name`` returns a view of its input, as its schema says: an
    overload whose result aliases a tensor argument it does not write (``split.Tensor(Tensor(a -> *) self, ...) ->
    Tensor(a)[]``), or one aten tags an in-place view (``unsqueeze_``). PyTorch's own account, so a view op a later
    torch adds is known without a list to keep.

    >>> schema_view("torch.functional.split"), schema_view("aten.alias.default"), schema_view("torch.add")
    (True, True, False)
    """
    import torch

    parts = name.split(".")
    if parts[0] == "aten" and len(parts) in (2, 3):
        packet, overloads = aten_packet(parts[1]), parts[2:]
    else:
        prefix = _ATEN_PREFIXES.get(".".join(parts[:-1]))
        packet = None if prefix is None else aten_packet(prefix + parts[-1] if prefix else parts[-1])
        overloads = []
    if packet is None:
        return False
    for overload in overloads or packet.overloads():
        op = getattr(packet, overload, None)
        if not isinstance(op, torch._ops.OpOverload):
            continue
        if torch.Tag.inplace_view in op.tags or any(
                a.alias_info is not None and not a.alias_info.is_write and str(a.type) in TENSOR_TYPES
                for a in op._schema.arguments):  # not TorchScript's list builtins (aten::__getitem__.t on t[])
            return True
    return False


def resolve_op_name(func) -> str:
    """The public name of ``func`` (``torch.add``, ``torch.Tensor.add``, ``torch.nn.functional.linear``), cached.

    >>> resolve_op_name(torch.Tensor.add)
    'torch.Tensor.add'
    """
    try:
        name = _names.get(func)
    except TypeError:  # unhashable callables are rare; name them each time
        return _name_of(func)
    if name is None:
        name = _name_of(func)
        if not has_twin(func):  # a twin's entry would name the other twin (they are equal keys)
            _names[func] = name
    return name


@functools.cache
def _twins() -> frozenset:
    """torch's builtins equal to another of a different name: one C function bound under several names
    (``torch.mm == torch.spmm == torch.dsmm``, ``hsmm``/``hspmm``, ``saddmm``/``sspaddmm``). Equal, they hash alike:
    torch's own name table (``resolve_name``) and any dict keyed by function take one for the other."""
    seen: dict[Any, str] = {}
    twins = []
    functions = _variable_functions()
    for name in dir(functions):
        func = getattr(functions, name, None)
        if not callable(func) or name.startswith("__"):
            continue
        try:
            other = seen.setdefault(func, name)
        except TypeError:
            continue
        if other != name:
            twins.append(func)
    return frozenset(twins)


def _variable_functions():
    import torch

    return torch._C._VariableFunctions


def has_twin(func) -> bool:
    """Whether ``func`` is one of torch's builtins bound under several names (``_twins``): named by its own
    ``__name__``, never cached or skipped by function."""
    try:
        return func in _twins()
    except TypeError:
        return False


_NAMESPACES = (("torch", "torch"), ("torch.Tensor", "torch.Tensor"), ("torch.nn.functional", "torch.nn.functional"),
               ("torch._C._nn", "torch._C._nn"), ("torch.linalg", "torch.linalg"), ("torch.special", "torch.special"),
               ("torch.fft", "torch.fft"), ("torch.distributed", "torch.distributed"))


def _name_of(func) -> str:
    short = getattr(func, "__name__", None)
    if short and has_twin(func):  # torch's table names the twins alike (torch.mm as torch.spmm)
        return f"torch.{short}"
    name = resolve_name(func)
    if name:
        return name
    if short:  # private functions resolve_name does not list (torch._foreach_add_, …), torch.distributed.*
        for prefix, path in _NAMESPACES:
            namespace = import_path(path)
            found = getattr(namespace, short, None) if namespace is not None else None
            # the function itself, or a wrapper of it there (op_tools' own around torch.distributed's collectives)
            if found is not None and (found is func or getattr(found, "__wrapped__", None) is func):
                return f"{prefix}.{short}"
    qualname = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or type(func).__name__
    module = getattr(func, "__module__", None)
    if qualname.startswith("_VariableFunctionsClass."):
        # A torch.* builtin whose name was replaced in the torch namespace (a device layer wrapping factories).
        return f"torch.{short}"
    if "<locals>" in qualname:  # generated methods such as Tensor.<device>()
        qualname = getattr(func, "__name__", qualname)
    return f"{module}.{qualname}" if module else qualname


@functools.cache
def alias_namespaces() -> tuple:
    """Where torch's public functions live under a name, including the C modules behind torch.linalg & co."""
    paths = [path for _, path in _NAMESPACES] + ["torch._C._linalg", "torch._C._special", "torch._C._fft"]
    return tuple(ns for ns in map(import_path, paths) if ns is not None)


def name_as(func, name: str | None) -> None:
    """Name ``func`` (a wrapper installed in place of a function) as the function it stands for; ``None`` forgets."""
    if name is None:
        _names.pop(func, None)
    else:
        _names[func] = name


def import_path(path: str):
    """The module (or ``torch.Tensor``) a dotted name stands for: ``"torch.linalg"``; ``None`` if not importable."""
    module, _, attr = path.partition(".Tensor")
    try:
        namespace = importlib.import_module(module)
    except ImportError:
        return None
    return namespace.Tensor if attr == "" and path.endswith(".Tensor") else namespace


@functools.cache
def is_metadata_query(name: str) -> bool:
    """Attribute getters/setters and pure metadata queries: tools never handle them. A complex tensor's parts are
    ops: their backward is a kernel (the upstream written into a complex zero), compared as torch.real's."""
    return name in METADATA_QUERIES or name.endswith(("__get__", "__set__", "__delete__", ".__repr__", ".__format__",
                                                      ".__str__")) and name not in _COMPUTING_GETTERS


_COMPUTING_GETTERS = frozenset({"torch.Tensor.real.__get__", "torch.Tensor.imag.__get__"})


@functools.cache
def is_inplace_op(name: str) -> bool:
    """``torch.Tensor.add_``, ``torch._foreach_mul_``, ``__iadd__``, ``__setitem__``: the first argument is written."""
    short = name.rpartition(".")[2]
    if short.endswith("__"):
        return short in WRITING_OPERATORS
    return short.endswith("_")


def function_from_name(name: str, suggest: bool = False):
    """``(owner, attribute, function)`` for a dotted name such as ``torch.Tensor.sort`` or ``package.module.func``.

    Raises ValueError when the name does not resolve; with ``suggest``, naming the closest names the owner has (a
    search: for a name the user gave once, as ``apply_feature``'s, not for a LIST read at each start).
    """
    parts = name.split(".")
    hint = ""
    for split in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        at = split
        try:
            for at in range(split, len(parts) - 1):
                owner = getattr(owner, parts[at])
            at = len(parts) - 1
            return owner, parts[-1], getattr(owner, parts[-1])
        except AttributeError:  # parts[at] is what owner lacks (a typo: torch.nn.functional.gleu): the closest names
            if not suggest:
                break
            close = difflib.get_close_matches(parts[at], [a for a in dir(owner) if not a.startswith("__")], n=2,
                                              cutoff=0.7)
            if close:
                meant = (".".join([*parts[:at], c, *parts[at + 1:]]) for c in close)
                hint = f"; did you mean {' or '.join(map(repr, meant))}?"
            break
    raise ValueError(f"cannot resolve {name!r} to a function: expected a dotted name such as 'torch.add', "
                     f"'torch.Tensor.sort', 'torch.nn.functional.linear' or 'package.module.func'{hint}")
