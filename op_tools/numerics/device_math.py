"""The math a device declares, read at each call, and replayed on the CPU for the same-dtype reference run.

A correct device computes other numbers than the CPU in the same dtype for two declared reasons:

- **autocast**: inside ``torch.autocast(device)`` each aten op casts its inputs by a policy (matmuls in the
  low-precision dtype, ``softmax``/losses in float32, ``cat``-like ops to the widest input), op by op, also inside
  composite functions (``cross_entropy`` runs its ``log_softmax`` in the logits' dtype and its ``nll_loss`` in
  float32). The policy is the device module's ``autocast_policy()`` when it has one, else CUDA's (below);
- **reduced-precision float32**: TF32 on CUDA (``torch.backends.cuda.matmul.allow_tf32``, which
  ``torch.set_float32_matmul_precision("high")`` sets, and ``torch.backends.cudnn.allow_tf32``, on by default for
  convolutions), HF32 on Ascend: matrix products and convolutions round their float32 operands to a shorter
  mantissa. A device module declares its own through ``float32_reduced_precision()``, e.g.
  ``{"matmul": "tf32", "conv": "tf32"}`` (ditorch's sim and NPU adapter do).

``DeviceMath.of(device)`` reads both for one call; ``emulated(math)`` is a context in which CPU ops compute the
way the device declared: kernels on a spare autocast dispatch key apply the policy (differentiably, above
autograd, as autocast does) and round the operands of matmuls and convolutions.

>>> math = DeviceMath.of(torch.device("cuda"))      # e.g. DeviceMath(autocast_dtype=torch.float16, reduced=())
>>> with emulated(math):
...     same_dtype = torch.nn.functional.cross_entropy(logits.cpu(), target.cpu())   # float32, as on the device
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
import warnings

import torch
from torch._C import DispatchKey

from ..ops.op_facts import OpsWith, op_facts
from ..ops.torch_versions import autocast_dtype
from .attention import attention_math

logger = logging.getLogger("op_tools")

# CUDA's autocast policy (aten/src/ATen/autocast_mode.h and .cpp): op names, "packet" or "packet.overload".
CUDA_LOWER_PRECISION = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr", "matmul",
    "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention", "cudnn_convolution",
    "cudnn_convolution_transpose",
)
CUDA_FLOAT32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "sinh",
    "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm", "native_layer_norm",
    "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity", "poisson_nll_loss",
    "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss",
    "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist",
    "renorm", "logsumexp",
)
# float32 by setting the op's optional dtype argument, and only when the caller left it unset: an explicit dtype
# (cross_entropy passes the logits' own to log_softmax) is kept.
CUDA_FLOAT32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "prod.dim_Dimname", "softmax.int", "softmax.Dimname", "log_softmax.int",
    "log_softmax.Dimname", "cumprod", "cumprod.dimname", "cumsum", "cumsum.dimname", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList", "sum.dim_DimnameList",
)
CUDA_FLOAT32_APPEND_DTYPE = ("norm.Scalar", "norm.ScalarOpt_dim", "norm.names_ScalarOpt_dim")
CUDA_PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sampler", "index_put", "tensordot",
                "scatter_add")

# aten ops whose float32 operands a device's reduced-precision mode rounds, per family ("matmul", "conv"): the
# positions and keywords of the operands rounded (``op_facts``' ``lower_precision`` and ``rounded_operands``, as
# declared when op_tools was imported: the replay's kernels are built from it).
REDUCED_PRECISION_OPERANDS: dict[str, dict[str, tuple[tuple[int, str], ...]]] = {}
for _name in OpsWith("lower_precision"):
    _facts = op_facts(_name)
    REDUCED_PRECISION_OPERANDS.setdefault(str(_facts.lower_precision), {})[_name] = _facts.rounded_operands
# Ops whose CPU kernel does its products inside (the CPU's fused attention), run unfused while a reduced matmul
# precision is replayed, so that their matrix products are rounded as the device's are.
UNFUSED = {"scaled_dot_product_attention": attention_math}
# Recurrent ops, whose CPU kernel in float32 is oneDNN's (its products inside, never rounded): run on linears while
# a reduced matmul precision is replayed.
RECURRENT = tuple(name for name in ("lstm", "gru", "rnn_tanh", "rnn_relu") if op_facts(name).recurrent)
# Mantissa bits kept by each reduced float32 format (float32 has 23).
MANTISSA_BITS = {"tf32": 10, "hf32": 11, "bf16": 7}


@dataclasses.dataclass(frozen=True)
class AutocastPolicy:
    """Op names per cast policy (``packet`` for every overload, ``packet.overload`` for one)."""

    lower_precision: tuple[str, ...] = CUDA_LOWER_PRECISION
    float32: tuple[str, ...] = CUDA_FLOAT32
    float32_set_opt_dtype: tuple[str, ...] = CUDA_FLOAT32_SET_OPT_DTYPE
    float32_append_dtype: tuple[str, ...] = CUDA_FLOAT32_APPEND_DTYPE
    promote: tuple[str, ...] = CUDA_PROMOTE

    def by_name(self) -> dict[str, str]:
        table = {}
        for policy in ("lower_precision", "float32", "float32_set_opt_dtype", "float32_append_dtype", "promote"):
            for name in getattr(self, policy):
                table[name] = policy
        return table


CUDA_POLICY = AutocastPolicy()


@dataclasses.dataclass(frozen=True)
class DeviceMath:
    """What a device computes differently from the CPU at one call: its autocast and reduced-precision float32."""

    autocast_dtype: torch.dtype | None = None
    reduced: tuple[tuple[str, str], ...] = ()  # (("matmul", "tf32"), ("conv", "tf32"))
    policy: AutocastPolicy = CUDA_POLICY
    # The call's kernel adds a narrow dtype's terms in float32 (an ``index_sums`` op's gradient: an embedding's
    # weight; ``accumulates_when``, ``cpu_sums_narrow``), as a GPU's does, where the CPU's adds them in the narrow
    # dtype: judged by that sum's rounding bound, or against a same-dtype run made in float32 and rounded once.
    float32_sums: bool = False

    @classmethod
    def of(cls, device: torch.device | None, op: str | None = None) -> DeviceMath:
        """The math of a call of ``op`` (its name, as the tools name it) on ``device``: what ``op`` is can change it
        (a recurrent op's products on CUDA follow cuDNN's switch, an embedding's gradient sums in float32)."""
        if device is None or device.type == "cpu":
            return _PLAIN
        kind = _math_kind(device.type)
        dtype = autocast_dtype(kind)
        facts = None if op is None else op_facts(op)
        reduced = _reduced_precision(kind, recurrent=facts is not None and facts.recurrent)
        float32_sums = facts is not None and (facts.index_sums or facts.accumulates_when is not None or
                                              facts.cpu_sums_narrow) and _float32_sums(kind)
        if dtype is None and not reduced and not float32_sums:
            return _PLAIN
        return cls(dtype, reduced, _policy(kind), float32_sums)

    def __bool__(self) -> bool:
        return self.autocast_dtype is not None or bool(self.reduced)

    def autocast_only(self) -> DeviceMath:
        """The autocast part alone: what decides the dtypes an op returns."""
        return self if not self.reduced else DeviceMath(self.autocast_dtype, (), self.policy)

    def only(self, used: set) -> DeviceMath:
        """The part of this math in ``used`` (what ``emulated`` saw a block's ops apply)."""
        return DeviceMath(self.autocast_dtype if "autocast" in used else None,
                          tuple(r for r in self.reduced if r[0] in used), self.policy)

    def describe(self) -> str:
        """``'autocast float16 and TF32 for matmul/conv'`` for reports (within a list of several, one item)."""
        parts = []
        if self.autocast_dtype is not None:
            parts.append(f"autocast {str(self.autocast_dtype).removeprefix('torch.')}")
        formats: dict[str, list[str]] = {}
        for family, form in self.reduced:
            formats.setdefault(form, []).append(family)
        parts += [f"{form.upper()} for {'/'.join(families)}" for form, families in formats.items()]
        return " and ".join(parts)


_PLAIN = DeviceMath()


def _math_kind(kind: str) -> str:
    """The device type whose math a call's device follows. A device layer may show a vendor's device as ``cuda``
    (ditorch does by default, ``DITORCH_SHOW_DEVICE_AS_CUDA``): then a ``cuda`` tensor is the PrivateUse1 backend's,
    whose module declares its math (read as CUDA's, a sim or NPU convolution was judged by cuDNN's TF32 switch, on by
    default: a fault of 1e-3 passed). So on a torch built with CUDA too: ditorch shows a device as cuda only where
    CUDA's own is not used (native CUDA patches nothing; sim refuses to register beside CUDA in use)."""
    if kind == "cuda" and "device" in vars(torch.Tensor):  # Tensor.device replaced (the C getter is TensorBase's): a
        # device layer shows a device as another
        backend = torch._C._get_privateuse1_backend_name()
        if backend != "privateuseone":
            return backend
    return kind


def _reduced_precision(kind: str, recurrent: bool = False) -> tuple[tuple[str, str], ...]:
    if kind == "cuda" and recurrent:
        # cuDNN runs the whole network and reads its operands as TF32 by its own switch (RNN.cpp's math type),
        # where the CPU's rerun (without oneDNN, see _kernel) computes linears: their products are rounded
        return (("matmul", "tf32"),) if torch.backends.cudnn.allow_tf32 and torch.backends.cudnn.enabled else ()
    if kind == "cuda":
        found = []
        if torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest":
            found.append(("matmul", "tf32"))
        if torch.backends.cudnn.allow_tf32:
            found.append(("conv", "tf32"))
        return tuple(found)
    declare = _module_function(kind, "float32_reduced_precision")
    if declare is None:
        return ()
    try:
        return tuple(sorted(dict(declare()).items()))
    except Exception as e:  # noqa: BLE001 - a device module's declaration failing must not stop the tool
        logger.warning("torch.%s.float32_reduced_precision() failed (%s): its float32 math is taken as full", kind, e)
        return ()


def _float32_sums(kind: str) -> bool:
    """Whether ``kind``'s kernels add a narrow dtype's terms in float32: CUDA's do; another device says so with
    ``torch.<kind>.narrow_accumulation()`` (``"float32"``, or ``"narrow"`` for kernels that add in the narrow dtype
    itself, as the CPU's embedding backward does: sim running the CPU's kernels); one that does not is taken as a
    GPU's, and a kernel of it that adds in the narrow dtype is then reported, as it errs where CUDA's does not."""
    declare = None if kind == "cuda" else _module_function(kind, "narrow_accumulation")
    if declare is None:
        return True
    try:
        return declare() == "float32"
    except Exception as e:  # noqa: BLE001 - a device module's declaration failing must not stop the tool
        logger.warning("torch.%s.narrow_accumulation() failed (%s): its narrow sums are judged as the CPU's", kind, e)
        return False


def _policy(kind: str) -> AutocastPolicy:
    declare = _module_function(kind, "autocast_policy")
    if declare is None:
        return CUDA_POLICY
    return _declared_policy(kind, declare)


@functools.cache
def _declared_policy(kind: str, declare) -> AutocastPolicy:
    table = dict(declare())
    return AutocastPolicy(**{k: tuple(table.get(k, ())) for k in (f.name for f in dataclasses.fields(AutocastPolicy))})


@functools.cache
def _module_function(kind: str, name: str):
    function = getattr(getattr(torch, kind, None), name, None)
    return function if callable(function) else None


# --- replaying it on the CPU ---

_SPARE_KEYS = ("AutocastHPU", "AutocastIPU", "AutocastXLA")  # autocast keys of backends absent from this process
_state = threading.local()
_install_lock = threading.Lock()
_installed: dict = {}  # "key" -> DispatchKey, "libraries" -> [...], "policies" -> set of installed policies


def round_mantissa(t: torch.Tensor, bits: int) -> torch.Tensor:
    """``t`` (float32) rounded to ``bits`` mantissa bits, to nearest even; inf and nan unchanged."""
    drop = 23 - bits
    raw = t.contiguous().view(torch.int32)
    half, low = 1 << (drop - 1), (1 << drop) - 1
    rounded = (raw + (half - 1) + ((raw >> drop) & 1)) & ~low
    special = (raw & 0x7F800000) == 0x7F800000
    return torch.where(special, raw, rounded).view(torch.float32).view(t.shape)


_NOTHING = contextlib.nullcontext()  # reusable: entering it holds no state


def emulated(math: DeviceMath, used: set | None = None):
    """CPU ops in this block compute as the device declared (``math``); nothing when it declares nothing. ``used``
    collects what the block's ops applied: ``"autocast"`` and the reduced-precision families (``"matmul"``, ...)."""
    if not math:
        return _NOTHING  # the common case: no generator-based context built per rerun
    key = _install(math.policy)
    return _NOTHING if key is None else _emulating(math, key, used)


def autocast_off(device_type: str):
    """Autocast off for ``device_type``: for the device's own calls, and for their emulation on the CPU where a block
    of ``emulated`` encloses this one (OpFallback runs a call on the CPU as the device's autocast would; an
    OpDtypeCast under it widens the call with autocast off, which the emulation, left on, lowered again: a float32
    result holding float16 values)."""
    math = getattr(_state, "math", None)
    if math is None or math.autocast_dtype is None:  # the common case: no generator-based context per call
        return torch.autocast(device_type, enabled=False)
    return _autocast_off_emulated(device_type, math)


@contextlib.contextmanager
def _autocast_off_emulated(device_type: str, math: DeviceMath):
    _state.math = dataclasses.replace(math, autocast_dtype=None)
    try:
        with torch.autocast(device_type, enabled=False):
            yield
    finally:
        _state.math = math


@contextlib.contextmanager
def _emulating(math: DeviceMath, key, used: set | None):
    previous, previous_used = getattr(_state, "math", None), getattr(_state, "used", None)
    _state.used = used
    was_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded(key)
    was_included = torch._C._dispatch_tls_is_dispatch_key_included(key)
    _state.math, _state.inside_policy = math, False
    torch._C._dispatch_tls_set_dispatch_key_excluded(key, False)
    torch._C._dispatch_tls_set_dispatch_key_included(key, True)
    try:
        yield
    finally:
        torch._C._dispatch_tls_set_dispatch_key_included(key, was_included)
        torch._C._dispatch_tls_set_dispatch_key_excluded(key, was_excluded)
        _state.math, _state.used = previous, previous_used


def _install(policy: AutocastPolicy):
    """Register the emulation kernels on a spare autocast key (once per policy); the key, or None if none is free."""
    with _install_lock:
        if "key" not in _installed:
            _installed["key"] = _spare_key()
            _installed["libraries"], _installed["ops"] = [], {}
            if _installed["key"] is not None:
                fallthrough = torch.library.Library("_", "IMPL")
                fallthrough.fallback(torch.library.fallthrough_kernel, _installed["key"].name)
                _installed["libraries"].append(fallthrough)
            else:
                logger.warning("op_tools: no spare autocast dispatch key in this process (%s are all in use): the "
                               "same-dtype reference cannot replay the device's autocast and TF32 math",
                               ", ".join(_SPARE_KEYS))
        key = _installed["key"]
        if key is None:
            return None
        wanted = {**{name: None for name in (*_reduced_ops(), *RECURRENT)}, **policy.by_name()}
        missing = [name for name in wanted if name not in _installed["ops"]]
        if missing:
            library = torch.library.Library("aten", "IMPL")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "overriding a previously registered kernel" cannot happen here
                for name in missing:
                    for qualified, op in _overloads(name):
                        if qualified not in _installed["ops"]:
                            library.impl(qualified, _kernel(op, key), key.name, with_keyset=True)
                            _installed["ops"][qualified] = op
                    _installed["ops"][name] = None
            _installed["libraries"].append(library)
        return key


def _spare_key():
    for name in _SPARE_KEYS:
        key = getattr(DispatchKey, name, None)
        if key is not None and not torch._C._dispatch_has_kernel_for_dispatch_key("aten::mm", name) and \
                not torch._C._dispatch_has_kernel_for_any_dispatch_key("aten::mm", _keyset(key)):
            return key
    return None


def _keyset(key):
    return torch._C.DispatchKeySet(key)


def _reduced_ops() -> list[str]:
    return [name for table in REDUCED_PRECISION_OPERANDS.values() for name in table]


def _overloads(name: str):
    """``(qualified name, OpOverload)`` of ``name`` (``packet`` for all overloads, ``packet.overload`` for one)."""
    packet_name, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, packet_name, None)
    if packet is None:
        return []
    names = [overload or "default"] if overload else packet.overloads()
    out = []
    for overload_name in names:
        op = getattr(packet, overload_name, None)
        if op is None or any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments):
            continue  # in-place and out= variants keep the dtypes they are given, as under autocast
        out.append((packet_name if overload_name == "default" else f"{packet_name}.{overload_name}", op))
    return out


def _kernel(op, key):
    packet = op._schema.name.removeprefix("aten::")
    qualified = packet if op._overloadname == "default" else f"{packet}.{op._overloadname}"
    rounded_operands = {family: table[packet] for family, table in REDUCED_PRECISION_OPERANDS.items()
                        if packet in table}

    unfused = UNFUSED.get(qualified)
    recurrent = packet in RECURRENT

    def kernel(keyset, *args, **kwargs):
        keyset = keyset.remove(key)
        math = getattr(_state, "math", None)
        if math is None:
            return op.redispatch(keyset, *args, **kwargs)
        policy = None
        if math.autocast_dtype is not None and not _state.inside_policy:
            table = _policy_table(math.policy)
            policy = table.get(qualified) or table.get(packet)
            if policy is None and recurrent:  # a device's whole network is one autocast op (CUDA's _cudnn_rnn,
                # sim's fused cells): its input, states and weights all in autocast's dtype, where the CPU's
                # linears alone would leave the float32 states' sums in float32
                policy = "lower_precision"
        used = getattr(_state, "used", None)
        if policy is not None:
            args, kwargs = _apply_policy(policy, math.autocast_dtype, op, args, kwargs)
            if used is not None:
                used.add("autocast")
        if rounded_operands and math.reduced:
            args, kwargs = _round_operands(math, rounded_operands, args, kwargs, used)
        products_rounded = bool(dict(math.reduced).get("matmul"))
        if unfused is not None and products_rounded:
            run = unfused
        elif recurrent and (products_rounded or math.autocast_dtype is not None):
            # the CPU's float32 network is oneDNN's, its products inside, where neither the rounding nor autocast
            # reaches them: without it the CPU computes it on linears, which both reach (a clean bfloat16 LSTM's
            # gradients were judged against float32 math, and failed)
            run = functools.partial(_without_onednn, op, keyset)
        else:
            run = functools.partial(op.redispatch, keyset)
        if policy is None:
            return run(*args, **kwargs)
        _state.inside_policy = True  # as autocast: ops inside a policy op are not cast again
        try:
            return run(*args, **kwargs)
        finally:
            _state.inside_policy = False

    return kernel


def _without_onednn(op, keyset, *args, **kwargs):
    # a process-wide switch, but the rerun and the user's calls share one thread: no user op runs in between
    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)  # only this switch: mkldnn.flags() would set its others to their defaults
    try:
        return op.redispatch(keyset, *args, **kwargs)
    finally:
        torch._C._set_mkldnn_enabled(enabled)


@functools.cache
def _policy_table(policy: AutocastPolicy) -> dict[str, str]:
    return policy.by_name()


def _eligible(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64


def _cast_all(value, dtype):
    if _eligible(value):
        return value if value.dtype == dtype else value.to(dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_all(v, dtype) for v in value)
    return value


def _apply_policy(policy: str, autocast_dtype, op, args, kwargs):
    if policy == "lower_precision":
        return _cast_all(args, autocast_dtype), {k: _cast_all(v, autocast_dtype) for k, v in kwargs.items()}
    if policy == "float32":
        return _cast_all(args, torch.float32), {k: _cast_all(v, torch.float32) for k, v in kwargs.items()}
    if policy in ("float32_set_opt_dtype", "float32_append_dtype"):
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if _eligible(first) and kwargs.get("dtype") is None and not _dtype_given(op, args):
            kwargs = {**kwargs, "dtype": torch.float32}
        return args, kwargs
    widest = None  # promote
    for value in (*args, *kwargs.values()):
        for t in (value if isinstance(value, (list, tuple)) else (value,)):
            if _eligible(t):
                widest = t.dtype if widest is None else torch.promote_types(widest, t.dtype)
    if widest is None:
        return args, kwargs
    return _cast_all(args, widest), {k: _cast_all(v, widest) for k, v in kwargs.items()}


def _dtype_given(op, args) -> bool:
    for position, argument in enumerate(op._schema.arguments):
        if argument.name == "dtype":
            return position < len(args) and args[position] is not None
    return False


def _round_operands(math: DeviceMath, operands: dict, args: tuple, kwargs: dict, used: set | None):
    reduced = dict(math.reduced)
    for family, places in operands.items():
        form = reduced.get(family)
        if form is None:
            continue
        bits = MANTISSA_BITS.get(form, MANTISSA_BITS["tf32"])
        positional = list(args)
        for position, keyword in places:
            value = positional[position] if position < len(positional) else kwargs.get(keyword)
            rounded = _rounded(value, bits)
            if rounded is value:
                continue
            if used is not None:
                used.add(family)
            if position < len(positional):
                positional[position] = rounded
            else:
                kwargs = {**kwargs, keyword: rounded}
        args = tuple(positional)
    return args, kwargs


def _rounded(value, bits: int):
    if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
        with torch.no_grad():  # rounding is not part of the math to differentiate: a straight-through copy
            rounded = round_mantissa(value.detach(), bits)
        if value.requires_grad:
            return value + (rounded - value.detach())  # the rounded values, gradients passed through unchanged
        return rounded
    return value
