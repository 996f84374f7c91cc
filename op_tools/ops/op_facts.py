"""What op_tools knows about each op beyond its name, in one registry: views, hidden writes, random draws, the
device's reduced-precision math, how exactly an op rounds. Adding an op's knowledge is one ``register_op_facts``.

A key is a full name as op_tools reports it (``torch.nn.functional.batch_norm``, ``mylib.fused_dropout``), a
namespace (``torch.nn.init.*``: every function under it) or a short name (``dropout``: the op of that name in any
namespace, and its in-place variant ``dropout_`` where that has no facts of its own). Fact by fact, a full name's
declaration wins over its namespaces', which win over its short name's.

A user's own op (a Python function that takes part in ``__torch_function__``) is declared by the function or its
name; declare it before the tool first sees it (the answers are cached per name)::

    >>> register_op_facts(mylib.fused_dropout, draws_when=((1, "p", 0.5), (2, "training", True)))
    >>> register_op_facts(mylib.scale_, writes=(0,))          # writes its first argument in place
    >>> op_facts("mylib.scale_").writes
    ((0, ''),)
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import numbers
from collections.abc import Iterator
from typing import Any, Callable

from .naming import CONVERSIONS, UNANNOTATED_VIEWS, VIEW_OPS, resolve_op_name, schema_view

Where = tuple[int, str]  # (position, keyword) of an argument
Flag = tuple[int, str, Any]  # (position, keyword, default when absent) of an argument


@dataclasses.dataclass(frozen=True, slots=True)
class OpFacts:
    """The facts of one op; the defaults are those of an op nobody declared anything about."""

    view: bool = False  # its outputs alias its input: never run elsewhere nor cast; its gradient passes through
    # A view whose backward is a kernel that makes a new tensor of its input's shape: the upstream's elements written
    # into zeros (select, slice, diagonal), the pieces' gradients joined (split, unbind), the windows' added (unfold):
    # a device's kernel may get it wrong, so it is compared as any op's
    backward_kernel: bool = False
    # A view that computes nothing either way: its outputs are its input's elements as they lie in memory, and its
    # backward passes the upstream gradient on rearranged (a view, or a copy where it must be contiguous). No value
    # is made in it, so no inf or nan is born there (``Tensor.view(dtype)`` reads the same bits as another dtype).
    alias_only: bool = False
    conversion: bool = False  # moves data between devices or converts dtypes on purpose
    # Arguments it writes that its schema does not mark as written (BatchNorm's running statistics), and the flag
    # that makes them written (None: always). For an op outside ``torch.``, None means "may write anything".
    writes: tuple[Where, ...] | None = None
    writes_when: Flag | None = None
    random: bool = False  # draws random numbers whatever its arguments
    # Draws only for some arguments: (probability, training flag or None), each a ``Flag``; a position of None
    # means "no probability argument". A call draws when the probability is above 0 and it trains.
    draws_when: tuple[Flag, Flag | None] | None = None
    composite: bool = False  # a random op written in Python out of torch calls: compared inside, call by call
    # Compared inside, call by call, even when it draws nothing (and then whole as well): its parts are judged by
    # bounds of their own (attention's rounding, softmax's), tighter than one ratio for the whole call
    compared_inside: bool = False
    random_note: str | None = None  # the skip reason of a random call of it, where "random" says too little
    # The float32 reduced-precision family a device may apply to this aten op ("matmul": TF32/HF32 GEMMs, "conv")
    # and the operands it rounds; read when op_tools is imported, as the replay's kernels are built from it.
    lower_precision: str | None = None
    rounded_operands: tuple[Where, ...] = ()
    # A recurrent network in one call: on CUDA one cuDNN call whose matrix products follow cuDNN's TF32 switch, not
    # cuBLAS's; on the CPU (oneDNN's kernel, or linears) and on other devices, ordinary matrix products.
    recurrent: bool = False
    algorithm_ratio: float | None = None  # the device kernel's algorithm legitimately errs more than the CPU's
    uninitialised: bool = False  # its results are memory never written: nothing to compare
    from_data: bool = False  # its result holds the values the program gave it (a list, an array): none computed
    rounded_once: bool = False  # each forward result element is computed wide and rounded once (comparison.py)
    collective: bool = False  # exchanges data with other ranks: this host holds only its own part of the inputs
    # Takes CPU tensors of any size beside device ones (indices, the values a ``__setitem__`` copies): CUDA accepts
    # them, where other ops refuse a call that mixes devices.
    mixes_devices: bool = False
    overwrites: bool = False  # writes its first argument without reading it: what was there is no input of it
    # Other arguments it writes without reading them (lists of tensors included), when the flag holds (None: always):
    # fused SGD's first step fills its momentum buffers, made by empty_like, without reading them.
    overwritten: tuple[Where, ...] = ()
    overwritten_when: Flag | None = None
    async_result: bool = False  # its result is filled later, by another thread, until waited for (wait_tensor)
    completes: bool = False  # waits for an async result: what it returns is that result, not something it read
    # Its gradient for an input broadcast over the output is a sum, over the broadcast elements, of terms of a few
    # roundings each (add, mul, where, lerp; an expansion's is the sum alone): a device may sum them in any order, and
    # the op's float64 gradient for that input expanded gives the terms' magnitudes (rounding_bounds.AnyOrderSum).
    broadcast_sums: bool = False
    # Each result element is a sum (or a mean) of elements of its first argument (sum, mean): in any order on a
    # device, and the op on that argument's absolute values gives the magnitudes summed.
    sums_elements: bool = False
    # Its result is softmax(q k^T scale + mask) v, as scaled_dot_product_attention takes them: in a narrow dtype its
    # forward result is judged by what a fused kernel's roundings allow (rounding_bounds.AttentionRounding).
    attention_rounding: bool = False
    # Its result sums terms of one sign that it computes from its first argument and rounds to that argument's dtype
    # first: cross_entropy's log_softmax runs in the logits' dtype (also under autocast, whose nll_loss is float32),
    # so a device that rounds a term the other way errs by up to half an ulp of that dtype per term, whatever the
    # CPU's own error shows (rounding_bounds.RoundedTerms).
    rounded_terms: bool = False
    # Its gradient for its floating input (an embedding's weight, what ``x[ids]`` gathers from) sums, row by row,
    # the upstream gradient's rows at the positions whose index names that row. In a narrow dtype a GPU's kernel
    # adds them in float32 and rounds once, where the CPU's adds them in the narrow dtype itself (9.5% off over 250
    # rows of one index in bfloat16): the CPU's same-dtype error is no measure, so on a device that declares float32
    # sums (``DeviceMath.float32_sums``) that gradient is judged by the sum's rounding (rounding_bounds.AnyOrderSum).
    index_sums: bool = False
    # The flag (position, keyword, default) that makes it add its values into its result where an index repeats
    # (``index_put``'s ``accumulate``): in a narrow dtype CUDA's kernel adds them in float32 and rounds once, the
    # CPU's in the narrow dtype (12% off over 4,000 values of one position in bfloat16). Judged as ``index_sums``'
    # gradients are, by the sum's rounding on a device that sums in float32.
    accumulates_when: Flag | None = None
    # The CPU's kernel adds (or multiplies) its terms in a narrow dtype itself where CUDA's does in float32 (over
    # 4,096 terms in bfloat16, the CPU's result off by 208 ulps for prod, 6.4 for fold; rounded once from float32,
    # 0.6): on a device that sums in float32 (``DeviceMath.float32_sums``) its same-dtype run is made in float32 and
    # rounded once (reference.py).
    cpu_sums_narrow: bool = False
    # A random call whose draws PyTorch's math path, rerun on the device from the generator state the call started
    # from, gives back when the device took that path: compared with them (numerics/attention.py).
    replays_dropout: bool = False
    # The argument that is a norm's order (``norm``'s ``p``, ``vector_norm``'s ``ord``): a float there is no value the
    # op puts in its result, so its inf (the max norm) excuses no inf in it, as a fill value's would (OpOverflowCheck)
    order: Where | None = None
    # Its result is one of several right answers, which a device's kernel may choose otherwise than the CPU's: tied
    # elements' indices ("sort", "argsort", "topk", "index of value", "kth value"), vectors free up to a sign or a
    # rotation ("eigenvectors", "singular vectors", "singular vectors (V)", "qr"). OpAutoCompare's reference takes
    # the device's choice where it is valid (numerics/ambiguous_results.py).
    ambiguous: str | None = None
    # Its float arguments land in its results as they are (a mask's fill value, a bound, a padding value): an inf there
    # explains infs of its own sign only, where an arithmetic op's (``x * -inf``, ``x - inf``) may come out as either
    # (OpOverflowCheck's ``scalar_values``).
    places_scalars: bool = False
    # It reads its input's memory as it lies in storage (``as_strided``): the position of its ``size`` argument,
    # ``stride`` and ``storage_offset`` after it (the offline replay rebuilds the storage the capture kept).
    layout_read: int | None = None


_FIELDS = {f.name: f for f in dataclasses.fields(OpFacts)}
_DECLARED: dict[str, dict[str, Any]] = {}  # key -> the facts declared for it
_CACHES: list[Callable[[], None]] = []  # cache_clear of every per-name answer derived from the facts


def register_op_facts(op: str | Callable, **facts: Any) -> None:
    """Declare ``facts`` (``OpFacts`` field names) of ``op``: a function, its full name, ``namespace.*`` or a short
    name. Declaring a fact again replaces it. Raises TypeError or ValueError naming the argument at fault.

    >>> register_op_facts("mylib.draw", random=True)
    """
    key = _key(op)
    for name, value in facts.items():
        if name not in _FIELDS:
            raise TypeError(f"register_op_facts() got an unexpected keyword argument {name!r}: expected one of "
                            f"{', '.join(_FIELDS)}")
        facts[name] = _checked(name, value)
    _DECLARED.setdefault(key, {}).update(facts)
    for clear in _CACHES:
        clear()


@functools.lru_cache(maxsize=4096)  # asked on every handled call; cleared when a fact is declared
def op_facts(name: str) -> OpFacts:
    """The facts of the op named ``name`` (as ``naming.resolve_op_name`` names it); defaults for an unknown op."""
    short = name.rpartition(".")[2]
    # later keys win: the short name (after its out-of-place name, for an in-place variant), the namespaces from
    # the outermost in, the full name
    keys = [short[:-1], short] if short.endswith("_") else [short]
    parts = name.split(".")
    keys += [".".join(parts[:end]) + ".*" for end in range(1, len(parts))]
    keys.append(name)
    merged: dict[str, Any] = {}
    for key in keys:
        merged.update(_DECLARED.get(key, ()))
    if "view" not in merged and not merged.get("conversion") and schema_view(name):
        # torch's view ops as their schemas say (a conversion's alias is itself, unchanged); a backward nobody said
        # passes the gradient through is compared as any op's (resolve_conj's materialises, real's is a kernel)
        merged["view"] = True
        merged.setdefault("backward_kernel", True)
    return OpFacts(**merged) if merged else _DEFAULT


class OpsWith(collections.abc.Set):
    """The ops with a fact, live: ``name in OpsWith("composite")`` asks ``op_facts(name)``; iterating gives the keys
    that declare the fact (short names and namespaces included), in the order they were first declared."""

    def __init__(self, fact: str) -> None:
        if fact not in _FIELDS:
            raise ValueError(f"OpsWith(fact={fact!r}): expected one of {', '.join(_FIELDS)}")
        self.fact = fact

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and bool(getattr(op_facts(name), self.fact))

    def __iter__(self) -> Iterator[str]:
        return (key for key, facts in list(_DECLARED.items()) if facts.get(self.fact))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"OpsWith({self.fact!r})"


def cached_on_facts(function: Callable) -> Callable:
    """``functools.lru_cache`` for a per-name answer derived from the facts: cleared when a fact is declared."""
    cached = functools.lru_cache(maxsize=4096)(function)
    _CACHES.append(cached.cache_clear)
    return cached


_DEFAULT = OpFacts()
_CACHES.append(op_facts.cache_clear)


def _key(op: str | Callable) -> str:
    if isinstance(op, str):
        if not op or op.startswith(".") or op.endswith(".") or ".." in op:
            raise ValueError(f"register_op_facts(op={op!r}): expected a function, a dotted name such as "
                             "'mylib.fused_dropout', a namespace such as 'mylib.*' or a short name such as 'dropout'")
        return op
    if callable(op):
        return resolve_op_name(op)
    raise TypeError(f"register_op_facts(op={op!r}): expected a function or its name, got {type(op).__name__}")


def _where(name: str, value: Any, flag: bool = False) -> tuple:
    """A (position, keyword) pair, or with ``flag`` a (position, keyword, default) triple; an int is a position."""
    if isinstance(value, int) and not isinstance(value, bool) and not flag:
        value = (value, "")
    size = 3 if flag else 2
    if not (isinstance(value, tuple) and len(value) == size and (value[0] is None or (
            isinstance(value[0], int) and not isinstance(value[0], bool) and value[0] >= 0))
            and isinstance(value[1], (str, type(None)))):
        form = "(position, keyword, default)" if flag else "a position or (position, keyword)"
        raise ValueError(f"register_op_facts({name}=...): {value!r} is not {form}")
    return value


def _checked(name: str, value: Any) -> Any:
    """``value`` in the form the field ``name`` holds, or ValueError naming the argument."""
    if name in ("writes", "rounded_operands", "overwritten"):
        if value is None and name == "writes":
            return None
        if not isinstance(value, (tuple, list)):
            raise ValueError(f"register_op_facts({name}={value!r}): expected a tuple of positions or "
                             "(position, keyword) pairs")
        return tuple(_where(name, item) for item in value)
    if name == "order":
        return None if value is None else _where(name, tuple(value) if isinstance(value, list) else value)
    if name in ("writes_when", "overwritten_when", "accumulates_when"):
        return None if value is None else _where(name, tuple(value) if isinstance(value, list) else value, flag=True)
    if name == "draws_when":
        if value is None:
            return None
        if not (isinstance(value, tuple) and len(value) == 2):
            raise ValueError(f"register_op_facts(draws_when={value!r}): expected (probability, training) where each "
                             "is (position, keyword, default) and training may be None")
        return (_where(name, value[0], flag=True), None if value[1] is None else _where(name, value[1], flag=True))
    if name in ("random_note", "lower_precision", "ambiguous"):
        if value is not None and not isinstance(value, str):
            raise ValueError(f"register_op_facts({name}={value!r}): expected a string or None")
        return value
    if name == "layout_read":
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"register_op_facts(layout_read={value!r}): expected a position (an int >= 0) or None")
        return value
    if name == "algorithm_ratio":
        if value is not None and (not isinstance(value, numbers.Real) or isinstance(value, bool) or value < 1):
            raise ValueError(f"register_op_facts(algorithm_ratio={value!r}): expected a number >= 1 or None")
        return None if value is None else float(value)
    if not isinstance(value, bool):
        raise ValueError(f"register_op_facts({name}={value!r}): expected True or False")
    return value


# --- what op_tools knows of torch's ops ---

for _name in (*VIEW_OPS, *UNANNOTATED_VIEWS):  # besides those aten's schemas say (schema_view)
    register_op_facts(_name, view=True)
for _name in CONVERSIONS:
    register_op_facts(_name, conversion=True)
# Views that keep only some elements, or repeat some, or are pieces of their input: their backward writes a new
# tensor. Counted as "gradient passed through", a 10% fault in slice_backward, select_backward, diagonal_backward,
# unbind's or split's left the verdict clean. A reshape, a permutation or a squeeze keeps a view's gradient. By short
# name: torch.split is torch.functional.split, torch.linalg.diagonal is a diagonal. An expansion of several inputs
# (meshgrid, broadcast_tensors) sums its gradient: a kernel too.
for _name in ("as_strided", "diagonal", "narrow", "select", "unfold", "unbind", "split", "split_with_sizes",
              "hsplit", "vsplit", "dsplit", "tensor_split", "chunk", "unsafe_split", "unsafe_split_with_sizes",
              "unsafe_chunk", "meshgrid", "broadcast_tensors", "__getitem__",
              # a complex tensor's parts: written into a complex zero
              "real", "imag", "torch.Tensor.real.__get__", "torch.Tensor.imag.__get__"):
    register_op_facts(_name, backward_kernel=True)

# Views that compute nothing forward or backward: not an expansion's (its gradient is a sum), not those above
# (their backward writes zeros), not a reshape's or a flatten's (which copy what no view can give), not complex ones'
# (their gradient is made complex) nor in-place ones (they change a tensor's layout).
for _name in ("view", "view_as", "transpose", "permute", "unsqueeze", "squeeze", "t", "T.__get__", "mT.__get__",
              "movedim", "moveaxis", "swapaxes", "swapdims", "unflatten", "detach"):
    register_op_facts(f"torch.Tensor.{_name}", alias_only=True)
for _name in ("transpose", "permute", "unsqueeze", "squeeze", "t", "movedim", "detach"):
    register_op_facts(f"torch.{_name}", alias_only=True)

# Kernels that write arguments their schema does not mark as written (PyTorch's batch norm writes its running
# statistics in place), when their training flag says so.
for _name, _written, _when in (
    ("torch.nn.functional.batch_norm", ((1, "running_mean"), (2, "running_var")), (5, "training", False)),
    ("torch.batch_norm", ((3, "running_mean"), (4, "running_var")), (5, "training", False)),
    ("torch.native_batch_norm", ((3, "running_mean"), (4, "running_var")), (5, "training", False)),
    ("torch.nn.functional.instance_norm", ((1, "running_mean"), (2, "running_var")), (5, "use_input_stats", True)),
    ("torch.instance_norm", ((3, "running_mean"), (4, "running_var")), (5, "use_input_stats", True)),
    # SyncBatchNorm's statistics kernels (CUDA's, a vendor's, sim's) update the running statistics
    ("torch.batch_norm_gather_stats_with_counts", ((3, "running_mean"), (4, "running_var")), None),
    ("torch.batch_norm_gather_stats", ((3, "running_mean"), (4, "running_var")), None),
    ("torch.batch_norm_update_stats", ((1, "running_mean"), (2, "running_var")), None),
    # max_norm renormalises the embedding rows in place (a real in-place op inside: said here so it is compared)
    ("torch.nn.functional.embedding", ((1, "weight"),), (3, "max_norm", None)),
    # a Python function, so no aten schema shows that out= is written (spectral_norm's power iteration writes its
    # u and v buffers so)
    ("torch.nn.functional.normalize", ((4, "out"),), None),
):
    register_op_facts(_name, writes=_written, writes_when=_when)

# Ops CUDA lets take CPU tensors beside device ones (their indices; the values ``__setitem__`` copies in).
for _name in ("__setitem__", "index_put", "_index_put_impl_"):
    register_op_facts(_name, mixes_devices=True)

# Ops whose results are random draws whatever their arguments.
for _name in ("rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm", "bernoulli",
              "bernoulli_", "normal", "normal_", "uniform", "uniform_", "random", "random_", "exponential_",
              "geometric_", "cauchy_", "log_normal_", "multinomial", "poisson", "gumbel_softmax", "_sample_dirichlet",
              "_standard_gamma", "binomial", "torch.nn.init.*"):
    register_op_facts(_name, random=True)
# Ops that draw only for some arguments: the probability, and the training flag (None: always training).
for _names, _probability, _training in (
    (("dropout", "dropout1d", "dropout2d", "dropout3d"), (1, "p", 0.5), (2, "training", True)),
    (("alpha_dropout", "feature_alpha_dropout"), (1, "p", 0.5), (2, "training", False)),
    (("native_dropout", "feature_dropout"), (1, "p", None), (2, "train", True)),
    (("scaled_dot_product_attention", "_scaled_dot_product_attention_math"), (4, "dropout_p", 0.0), None),
    (("multi_head_attention_forward",), (10, "dropout_p", None), (13, "training", True)),
    (("rrelu", "rrelu_"), (None, None, 1.0), (3, "training", False)),
    # torch.dropout & co take (input, p, train): train is positional and required
    (("torch.dropout", "torch.dropout_", "torch.feature_dropout", "torch.feature_dropout_", "torch.alpha_dropout",
      "torch.alpha_dropout_", "torch.feature_alpha_dropout", "torch.feature_alpha_dropout_"), (1, "p", 0.0),
     (2, "train", True)),
):
    for _name in _names:
        register_op_facts(_name, draws_when=(_probability, _training))
# Random calls written in Python out of torch calls: OpAutoCompare runs them with the calls they make handled one by
# one, so those that draw nothing (the softmax beside attention's dropout) are compared.
for _name in ("torch.nn.functional.multi_head_attention_forward", "torch.nn.functional.gumbel_softmax"):
    register_op_facts(_name, composite=True)
# Attention as one Python function: compared whole, a fault of 1e-2 in its softmax hid in bfloat16 under the 16x ratio
# its fused kernels need (below); inside, its attention is one scaled_dot_product_attention (judged by the fused
# kernels' rounding) or a softmax between two batched products (each judged by its own bound).
register_op_facts("torch.nn.functional.multi_head_attention_forward", compared_inside=True)
# Random calls that are one op with more than the draw inside (no Python calls to descend into).
register_op_facts("scaled_dot_product_attention", replays_dropout=True,
                  random_note="random (attention with dropout in a fused kernel: its mask cannot be replayed)")
register_op_facts("_scaled_dot_product_attention_math",
                  random_note="random (attention with dropout, one op: nothing inside compared)")

# aten ops whose float32 operands a device's reduced-precision mode rounds: the matrix products (cuBLAS GEMMs) and
# the convolutions (cuDNN), forward and backward.
for _family, _operands in (
    ("matmul", {"mm": ((0, "self"), (1, "mat2")), "bmm": ((0, "self"), (1, "mat2")),
                "addmm": ((1, "mat1"), (2, "mat2")), "baddbmm": ((1, "batch1"), (2, "batch2")),
                "addbmm": ((1, "batch1"), (2, "batch2"))}),
    ("conv", {"convolution": ((0, "input"), (1, "weight")), "_convolution": ((0, "input"), (1, "weight")),
              "convolution_backward": ((0, "grad_output"), (1, "input"), (2, "weight"))}),
):
    for _name, _where_rounded in _operands.items():
        register_op_facts(_name, lower_precision=_family, rounded_operands=_where_rounded)

for _name in ("lstm", "gru", "rnn_tanh", "rnn_relu"):
    register_op_facts(_name, recurrent=True)

# Ops whose device kernels legitimately use another algorithm than the CPU's (fused attention: online softmax,
# recomputation in backward), measured a little above 4x the CPU's error on an H100: a wider ratio. A 1e-3 fault
# is still thousands of times the bound's width in float32.
for _name in ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
              "multi_head_attention_forward"):
    register_op_facts(_name, algorithm_ratio=16.0)

# Ops whose results are memory never written.
for _name in ("empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided", "resize_",
              "resize_as_", "set_",
              # FSDP2's staging of an all-gather: its argument and result is the all-gather's buffer (an empty's), this
              # rank's part copied in, the other ranks' memory never written until the all-gather fills it
              "fsdp.all_gather_copy_in"):
    register_op_facts(_name, uninitialised=True)

# Ops whose result is the program's own data (torch.tensor([1.0, float("-inf")])): an inf there was given, not made.
for _name in ("tensor", "as_tensor", "asarray", "new_tensor", "from_numpy", "frombuffer"):
    register_op_facts(_name, from_data=True)

# Ops that fill their first argument whatever it held (initialisers, fill_, copy_'s destination): memory never
# written before (an `empty` about to be initialised) is not something they read.
for _name in ("torch.nn.init.*", "normal_", "uniform_", "fill_", "zero_", "random_", "exponential_", "geometric_",
              "log_normal_", "cauchy_", "bernoulli_", "copy_"):
    register_op_facts(_name, overwrites=True)
# torch.optim's fused SGD with momentum: at its first step the momentum buffers are torch.empty_like's memory, which
# the kernel fills without reading (is_first_step is keyword-only: its position is the schema's)
register_op_facts("_fused_sgd_", overwritten=((2, "momentum_buffer_list"),),
                  overwritten_when=(8, "is_first_step", False))

# Collectives: torch.distributed's calls, and the functional collectives (DTensor's redistributions, FSDP2) whose
# result is another rank's data, or becomes it when waited for.
for _name in ("torch.distributed.*", "_c10d_functional.*", "c10d_functional.*", "_c10d_functional_autograd.*",
              "c10d.*", "_dtensor.*"):
    register_op_facts(_name, collective=True)
for _namespace in ("_c10d_functional", "c10d_functional"):
    register_op_facts(f"{_namespace}.*", async_result=True)
    register_op_facts(f"{_namespace}.wait_tensor.*", async_result=False, completes=True)  # every overload

# Elementwise ops whose gradient for a broadcast input sums, over the broadcast elements, terms of a few roundings
# (products and quotients of the upstream gradient and the inputs, or selections of it), and expansions, whose
# gradient is that sum alone. Not pow, atan2, hypot and the like: their terms hold functions of the inputs rounded
# as a device's library rounds them.
for _name in ("add", "sub", "subtract", "rsub", "mul", "multiply", "div", "divide", "true_divide",
              *(f"__{side}{op}__" for op in ("add", "sub", "mul", "truediv", "div") for side in ("", "r", "i")),
              "addcmul", "addcdiv", "lerp", "where", "maximum", "minimum", "fmax", "fmin", "clamp", "clip",
              "clamp_min", "clamp_max", "expand", "expand_as", "broadcast_to", "masked_fill", "masked_fill_"):
    register_op_facts(_name, broadcast_sums=True)

for _name in ("sum", "mean", "nansum", "nanmean", "sum_to_size"):
    register_op_facts(_name, sums_elements=True)

register_op_facts("scaled_dot_product_attention", attention_rounding=True)
register_op_facts("cross_entropy", rounded_terms=True)
register_op_facts("embedding", index_sums=True)
register_op_facts("torch.Tensor.__getitem__", index_sums=True)  # a gather's (x[ids]); a view's has no index to sum
for _name in ("index_put", "index_put_"):
    register_op_facts(_name, accumulates_when=(3, "accumulate", False))
# norms whose order may be inf (the largest magnitude), and the ops built on one
for _name, _order in (("norm", (1, "p")), ("torch.linalg.norm", (1, "ord")), ("vector_norm", (1, "ord")),
                      ("matrix_norm", (1, "ord")), ("_foreach_norm", (1, "ord")), ("dist", (2, "p")),
                      ("cdist", (2, "p")), ("pdist", (1, "p")), ("normalize", (1, "p")), ("renorm", (1, "p"))):
    register_op_facts(_name, order=_order)
# grid_sample's forward too: the CPU weighs the four corners in the narrow dtype (6 ulps off in bfloat16), CUDA's
# kernel in float32 (opmath). Not index_reduce's mean (9 ulps) nor grid_sample's backward (20): CUDA's atomics add
# in the narrow dtype too
for _name in ("prod", "fold", "grid_sample", "grid_sampler", "grid_sampler_2d", "grid_sampler_3d"):
    register_op_facts(_name, cpu_sums_narrow=True)

# Ops that compute every output element on its own, from a few inputs, in a type wider than a narrow output, and
# round it once (rounded_ops.py says why that matters).
for _name in (
    # activations
    "silu", "gelu", "relu", "relu6", "leaky_relu", "elu", "selu", "celu", "mish", "hardswish", "hardsigmoid",
    "hardtanh", "sigmoid", "tanh", "softplus", "softsign", "logsigmoid", "tanhshrink", "threshold",
    # a row's float32 sum inside, of positive terms: its error is far below the rounding (rounded_ops.py)
    "softmax", "_softmax", "_safe_softmax",
    # elementwise
    "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt", "reciprocal", "neg", "negative", "abs",
    "sin", "cos", "erf", "square", "clamp", "clip", "clamp_min", "clamp_max", "add", "sub", "subtract", "rsub", "mul",
    "multiply", "div", "divide", "true_divide", "addcmul", "addcdiv", "lerp", "pow", "maximum", "minimum", "where",
    "masked_fill",
    # casts to a dtype given as an argument: the reference keeps the wide value
    "to", "type", "type_as", "copy",
    *(f"__{side}{op}__" for op in ("add", "sub", "mul", "truediv", "div", "pow", "neg", "abs")
      for side in ("", "r", "i")),
):
    register_op_facts(_name, rounded_once=True)

# Results with more than one right answer (numerics/ambiguous_results.py): CUDA's sort and top-k order equal elements
# otherwise than the CPU's, cuSOLVER's eigenvectors and singular vectors may have the other sign. A stable sort has one
# answer (its ``stable`` flag says so); max, min, argmax and argmin promise the first of equal elements: exact.
_AMBIGUOUS: dict[str, tuple[str, ...]] = {
    "sort": ("sort",),
    "argsort": ("argsort",),
    "topk": ("topk",),
    "index of value": ("mode", "median", "nanmedian"),
    "kth value": ("kthvalue",),
    "eigenvectors": ("eigh", "linalg_eigh", "_linalg_eigh"),
    "singular vectors (V)": ("svd",),  # torch.svd: (U, S, V)
    "singular vectors": ("torch.linalg.svd", "linalg_svd", "_linalg_svd"),  # (U, S, Vh)
    "qr": ("qr", "linalg_qr"),
    "eigenpairs": ("torch.linalg.eig", "linalg_eig", "torch.linalg.eigvals", "linalg_eigvals"),
}
for _kind, _ambiguous_ops in _AMBIGUOUS.items():
    for _name in _ambiguous_ops:
        register_op_facts(_name, ambiguous=_kind)

# Float arguments put in the result as they are (in-place variants go by their out-of-place name)
for _name in ("masked_fill", "index_fill", "fill", "full", "full_like", "new_full", "fill_diagonal", "where", "clamp",
              "clip", "clamp_min", "clamp_max", "nan_to_num", "threshold", "hardtanh", "pad", "constant_pad_nd",
              "scatter"):
    register_op_facts(_name, places_scalars=True)
# Readers of their input's storage, by the place of their size argument
for _name, _size_at in (("as_strided", 1), ("as_strided_copy", 1), ("as_strided_scatter", 2)):
    register_op_facts(_name, layout_read=_size_at)
