"""OpDtypeCast: run handled ops in a wider dtype (OP_DTYPE_CAST_DICT) and cast the results back."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch

from ..config.settings import origin
from ..config.variables import DTYPE_CAST_DICT, narrows
from ..core.engine import OpCall, OpTool, OpToolsAbortError, feature, tool_work
from ..numerics import comparison
from ..numerics.device_math import DeviceMath, autocast_off, emulated
from ..ops.arguments import UnsupportedInputError, iter_items, iter_tensors, map_tensors, promoted_dtype
from ..ops.moves import moved
from ..ops.op_facts import op_facts
from ..ops.stand_in_saves import SavedStandIns, result_pairs
from ..ops.writes import call_writes, carry_version, carry_writes, stand_in_made, writes_overlap
from ..output import reporting


@feature("cast_dtype")
class OpDtypeCast(OpTool):
    """Cast inputs whose dtype is in ``OP_DTYPE_CAST_DICT``, run, hand outputs back in the dtype the op returns without
    the tool (``x16 + x32`` stays float32; found by running the op on meta tensors, see ``_expected_dtypes``).

    Under the user's autocast the widened op runs with autocast off (autocast would cast it back down). Where the
    table widens autocast's own dtype (``float16`` under ``torch.autocast(dtype=torch.float16)``), an op autocast
    would run in that dtype runs in the wider one instead, its outputs in the dtype its inputs give without
    autocast; the log's ``autocast`` row names the dtype that ran. Where the table keeps autocast's dtype, those ops
    are autocast's, run as without the tool. Every other output keeps the dtype the op returns under that autocast
    (found by running the op on meta tensors with the device's policy, ``device_math``). A call whose widened run
    fails (a device without float64) runs as written, counted as not checked. Without autocast, a call whose tensors
    are in dtypes the table makes one (linear of float16 by float32) runs as written too: PyTorch computes it in the
    wider dtype itself or refuses it, the user's error, which widening would turn into a result.

    Keyword arguments (each overrides its variable): ``ops``, ``disable`` (``OP_DTYPE_CAST_LIST``/``_DISABLE_LIST``:
    lists of op names, patterns or functions), ``casts`` (``OP_DTYPE_CAST_DICT``: ``{torch.float16: torch.float32}``),
    and ``results_dir``, ``verbose``, ``print_stack``, ``strict``, ``print_ranks`` as every tool.

    >>> with op_tools.OpDtypeCast():   # default torch.float16->torch.float32,torch.bfloat16->torch.float32
    ...     y = torch.nn.functional.silu(x_fp16)      # computed in float32, returned as float16
    >>> with op_tools.OpDtypeCast(casts={torch.bfloat16: torch.float64}):
    ...     y = torch.nn.functional.silu(x_bf16)      # computed in float64, returned as bfloat16
    """

    hook_name = "OpDtypeCastHook"
    env_prefix = "OP_DTYPE_CAST"
    handles_transformed = True  # casts are ops on functorch's tensors as on any
    changes_saved_tensors = True  # the widened tensors: a checkpoint recomputing without the tool saves others
    replaces_runs = True
    keywords = {"casts": DTYPE_CAST_DICT}

    def configure(self) -> None:
        self.cast = DTYPE_CAST_DICT.read(self.sources)
        narrowing = [f"{a}->{b}" for a, b in self.cast.items() if narrows(a, b)]
        if narrowing:  # the user's to ask (the original's own examples narrow); said, for the run's numbers change
            self._logger.warning("OpDtypeCast: %s narrow%s: those ops run in the narrower dtype, and their results, "
                                 "cast back, hold its values (the run's numbers change)", ", ".join(narrowing),
                                 "s" if len(narrowing) == 1 else "")
        self.config_text = ",".join(f"{a}->{b}" for a, b in self.cast.items())
        self._expected: dict[tuple, tuple | None] = {}  # _expected_dtypes's answers by _dtype_key
        self.cast_calls = 0  # handled calls run in a dtype the table gave: what the closing line says beside handled
        self.mixed_calls = 0  # handled calls run as written, their dtypes being ones the table makes one (_joins)
        comparison.WIDENED[0] = True  # OpAutoCompare takes a result wider than autocast's for the user's choice

    def accepts(self, name: str) -> bool:
        # Views must alias their base; explicit conversions mean what they say; a collective's dtype is agreed with
        # every other rank (one rank widening alone would send other bytes than the others expect).
        facts = op_facts(name)
        return not facts.view and not facts.conversion and not facts.collective and \
            not name.startswith("torch.Tensor.__get")

    def run(self, call: OpCall):
        math = DeviceMath.of(call.device).autocast_only()
        under = math.autocast_dtype
        lowered_to = under if under in self.cast and self.cast[under] != under else None
        casts_some = lowered_to is not None or any(self.cast.get(t.dtype, t.dtype) != t.dtype
                                                   for t in iter_tensors((call.args, call.kwargs)))
        if casts_some and writes_overlap(call_writes(call.name), call.args, call.kwargs):
            # Its wide copies share no memory: the call would run on them, computing what the device refuses (or
            # computes otherwise, reading what it wrote). It runs as written, as without the tool.
            return self._run_as_written(call, UnsupportedInputError(
                "a tensor the call writes shares memory with another of its tensors"))
        if under is None and call.name.rpartition(".")[2] in _ONE_DTYPE and _joins(self.cast, call):
            # A product or convolution whose tensors differ in dtype where widened they would not: PyTorch's kernels
            # refuse it (linear of float16 by float32, which meta kernels let through), an error widening would turn
            # into a result. It runs as written, as without the tool. Other ops take mixed dtypes (layer_norm of a
            # float16 input by float32 weights, x16 + x32): widened, as any call.
            result = call.runs(*call.args, **call.kwargs)
            self.mixed_calls += 1
            return result
        # The dtypes the op returns without the tool, from a meta run: only for a call the tool changes.
        expected = self._expected_dtypes(call, math) if casts_some else None
        autocast_dtype_out = under is not None and expected is not None and under in expected
        if autocast_dtype_out and lowered_to is None:
            # Autocast runs the op in its own dtype, which the table keeps: autocast would cast the widened inputs
            # down again, or, with autocast off, a float16 input would meet a float64 one (addmm raised). The call
            # is autocast's, as without the tool.
            return call.runs(*call.args, **call.kwargs)
        # The tool widens what autocast would lower: where autocast runs this op in a dtype the table widens, the
        # op runs in the wider dtype with autocast off (autocast's key would cast the widened inputs back down).
        lowered = lowered_to is not None and autocast_dtype_out
        # With autocast off, the inputs autocast would have given one dtype get one: the widest the table widens the
        # call's tensors to (a float16 input beside float64 ones raised). At an op autocast lowers, every input it
        # lowers; at any other, those in autocast's dtype, which autocast casts up to the others' (softmax,
        # layer_norm: float32) or type promotion does.
        joined = None if under is None else _widest(self.cast, call, self.cast[lowered_to] if lowered else None)
        sparse = _sparse_gradients(call)
        failed: Exception | None = None
        try:
            with tool_work():
                pairs: list[tuple] = []  # (original, cast copy, *stand_in_made(cast copy))
                made: dict[int, torch.Tensor] = {}  # a tensor passed twice (x.mul_(x), out=x) is one wide tensor too

                def widen(t: torch.Tensor) -> torch.Tensor:
                    wide = made.get(id(t))
                    if wide is not None:
                        return wide
                    if joined is not None and (_lowered_by_autocast(t, call.device) if lowered else
                                               t.dtype == under and t.device.type == call.device.type):
                        target = joined
                    else:
                        target = self.cast.get(t.dtype)
                    if target is None or target == t.dtype:
                        return t
                    # differentiable: gradients reach the original (in their own layout where they are sparse)
                    wide = made[id(t)] = moved(t, t.device, target) if sparse else t.to(target)
                    pairs.append((t, wide, *stand_in_made(wide)))
                    return wide

                args, kwargs = map_tensors(call.args, widen), map_tensors(call.kwargs, widen)
                as_written = not pairs and not lowered or _computes_narrower(call.name, expected, args, kwargs)
            saves = None
            if not as_written:
                saves = SavedStandIns.watching([wide for _, wide, *_ in pairs])
                with autocast_off(call.device.type) if math else contextlib.nullcontext(), \
                        saves or contextlib.nullcontext():
                    result = call.runs(*args, **kwargs)
        except OpToolsAbortError:
            raise
        except (RuntimeError, NotImplementedError) as error:  # a kernel's (a device without the wider dtype's), or
            # the user's: the call as written tells which, run outside this block (the user's error, if it raises,
            # carries no trace of the tool's)
            failed = error
        if failed is not None:
            return self._run_as_written(call, failed)
        if as_written:  # outside the try: the user's error raised once
            return call.runs(*call.args, **call.kwargs)
        with tool_work():
            originals = {id(wide): original for original, wide, *_ in pairs}
            rows = [{"name": call.name, "target": f"input{path}", "action": f"{o.dtype} -> {w.dtype}",
                     "config": self.config_text}
                    for (path, o), (_, w) in zip(_tensor_items(call.args, call.kwargs), _tensor_items(args, kwargs))
                    if o is not w]
            writes = call_writes(call.name)
            carry_writes(pairs, writes, call.args, call.kwargs)  # the caller's tensors written

            raw_tensors = list(iter_tensors(result))
            wanted = expected if expected is not None and len(expected) == len(raw_tensors) else \
                _unknown_op_dtypes(raw_tensors, (args, kwargs), (call.args, call.kwargs))
            if lowered and wanted is expected:
                # An output autocast would have lowered gets the dtype the op gives its own inputs without autocast.
                unlowered = promoted_dtype(call.args, call.kwargs)
                wanted = [unlowered if dtype == lowered_to and unlowered is not None else dtype for dtype in expected]
                ran = {raw.dtype for raw, dtype in zip(raw_tensors, expected) if dtype == lowered_to}
                if ran:
                    rows.insert(0, {"name": call.name, "target": "autocast",
                                    "action": f"{lowered_to} -> {', '.join(sorted(map(str, ran)))}",
                                    "config": self.config_text})
            dtypes = iter(wanted)
            out = map_tensors(result, lambda t: _returned(originals, t, next(dtypes)))
            for raw, final in zip(raw_tensors, iter_tensors(out)):
                if final is not raw and id(raw) not in originals:
                    carry_version(final, raw, writes)  # the version counter the op left on its result
            if saves is not None and saves.saved():  # the node's saved wide copies, tied to the caller's tensors
                saves.tie([(wide, original, "an input") for original, wide, *_ in pairs]
                          + result_pairs(result, out), call.name)
            for (path, raw), (_, final) in zip(iter_items(reporting.as_tuple(result)),
                                                iter_items(reporting.as_tuple(out))):
                if isinstance(raw, torch.Tensor) and raw.dtype != final.dtype:
                    rows.append({"name": call.name, "target": f"output{path}",
                                 "action": f"{raw.dtype} -> {final.dtype}", "config": self.config_text})
            call.state["rows"] = rows
            self.cast_calls += 1
            return out

    def handled_note(self) -> str:
        mixed = f", {self.mixed_calls} mixing dtypes run as written" if self.mixed_calls else ""
        return f" ({self.cast_calls} cast{mixed})"

    def unchecked_parts(self) -> list[str]:
        """Calls handled, none cast and none failed: each raised the user's own error, mixed dtypes the table makes
        one (run as written), or had no dtype the table names (a float32 model under the default table, an empty
        one). Said, as the run's numbers are what they were without the tool: the user asked for another dtype and
        got none."""
        if self.cast_calls or not self.handled or self.unchecked:  # unchecked: calls whose widened run failed
            return []
        where = origin(self, "casts")
        changed = sorted(str(dtype) for dtype, to in self.cast.items() if to != dtype)
        if not changed:
            return [f"{where} casts no dtype to another: no call was cast"]
        raised, mixed = sum(self.raised.values()), self.mixed_calls
        rest = sum(self.handled.values()) - raised - mixed
        why = [f"{_calls(raised)} raised {'its' if raised == 1 else 'their'} own error"] if raised else []
        if mixed:
            why.append(f"{_calls(mixed)} mixing dtypes {where} makes one ran as written")
        if rest:
            had = "none had an" if rest == sum(self.handled.values()) else f"{_calls(rest, 'other ')} had no"
            why.append(f"{had} input in a dtype {where} casts ({', '.join(changed)})")
        return [f"no call was cast: {'; '.join(why)}"]

    def _run_as_written(self, call: OpCall, error: Exception):
        """The call run as without the tool, for ``error`` (its widened run failed: a device without float64
        kernels): an exception raised here is the user's, and propagates; else the call is counted as not cast."""
        result = call.runs(*call.args, **call.kwargs)
        if self.common.strict:
            raise error
        with tool_work():
            failure = NotCastError(f"run as written, not cast ({type(error).__name__}: {error})")
            failure.__cause__ = error
            self.tool_failed(call, failure)
        return result

    def _expected_dtypes(self, call: OpCall, math: DeviceMath) -> tuple | None:
        """The dtypes of the op's tensor outputs without the tool (under the user's autocast, if any), from a run on
        meta tensors of the caller's own dtypes; None when the op cannot run on meta. Remembered per ``_dtype_key``:
        a meta run costs as much as a small op (sin's meta kernel is Python)."""
        key = _dtype_key(call, math)
        with contextlib.suppress(KeyError):  # one lookup: another thread may clear the table meanwhile
            return self._expected[key]
        try:
            # no_grad: the copies need no autograd nodes, and the meta run's outputs are thrown away
            with tool_work(), emulated(math), torch.no_grad():
                meta_args = map_tensors(call.args, lambda t: t.to("meta"))
                meta_kwargs = map_tensors(call.kwargs, lambda t: t.to("meta"))
                dtypes: tuple | None = tuple(t.dtype for t in iter_tensors(call.func(*meta_args, **meta_kwargs)))
        except Exception:  # noqa: BLE001 - no meta kernel (data-dependent shapes, custom ops): the op's rule, if
            # any, else _unknown_op_dtypes
            rule, dtypes = _RETURNED_WITHOUT_META.get(call.name), None
            if rule is not None:
                with contextlib.suppress(Exception):  # arguments the op refuses: its own error will say why
                    dtypes = rule(*call.args, **call.kwargs)
        if len(self._expected) >= _REMEMBERED:
            self._expected.clear()
        self._expected[key] = dtypes
        return dtypes

    def after(self, call: OpCall) -> None:
        rows = call.state.pop("rows", None)
        if rows and self._logger.isEnabledFor(logging.DEBUG):
            self._logger.debug(reporting.table_text(rows, ("name", "target", "action", "config")))


class NotCastError(RuntimeError):
    """A call the tool ran as written, its widened run having failed (the message says how)."""


def _calls(n: int, kind: str = "") -> str:
    return f"{n} {kind}call{'s' if n != 1 else ''}"


# The ops whose kernels refuse tensors of two floating dtypes ("expected m1 and m2 to have the same dtype"), by their
# names' last part (torch.nn.functional.linear, torch.Tensor.matmul, torch.mm, ...).
_ONE_DTYPE = frozenset({"linear", "bilinear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "mv", "dot", "inner",
                        "addmm", "addbmm", "baddbmm", "addmv", "einsum", "conv1d", "conv2d", "conv3d",
                        "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"})


def _joins(cast: dict, call: OpCall) -> bool:
    """Whether the table's widening gives two of the call's tensors (of dim > 0: a 0-dim one takes part in type
    promotion only as a number would) one dtype where they had two: float16 and float32 under float16->float32."""
    # ndim, a property, not dim(): a program's own torch-function mode sees a metadata read, not a call
    given = {t.dtype for t in iter_tensors((call.args, call.kwargs)) if t.ndim}
    return len({cast.get(dtype, dtype) for dtype in given}) < len(given)


# The ops whose weight's gradient may be sparse: the position of their ``sparse`` argument (``nn.Embedding`` passes
# it positionally). Only their tensors are widened through ``moved``, which costs 11-28 us a tensor against
# ``Tensor.to``'s 5 us.
_SPARSE_ARGUMENT = {"torch.nn.functional.embedding": 6, "torch.nn.functional.embedding_bag": 7}


def _sparse_gradients(call: OpCall) -> bool:
    """Whether ``call`` asks for sparse gradients (``sparse=True``)."""
    position = _SPARSE_ARGUMENT.get(call.name)
    if position is None:
        return False
    sparse = call.args[position] if len(call.args) > position else call.kwargs.get("sparse", False)
    return sparse is True


def _widest(cast: dict, call: OpCall, also: torch.dtype | None = None) -> torch.dtype | None:
    """The widest floating dtype of ``also`` and those the table widens the call's tensors to; None for none."""
    widest = also
    for t in iter_tensors((call.args, call.kwargs)):
        target = cast.get(t.dtype)
        if target is not None and target != t.dtype and target.is_floating_point:
            widest = target if widest is None else torch.promote_types(widest, target)
    return widest


# Ops with no meta kernel whose outputs' dtypes are no promotion of their inputs' (``_unknown_op_dtypes`` would
# guess wrong): the dtypes they return for the call's arguments, by op name, as ATen's kernels decide them.
_RETURNED_WITHOUT_META: dict[str, Callable[..., tuple]] = {}


def _returns_without_meta(*names: str):
    def register(rule: Callable[..., tuple]) -> Callable[..., tuple]:
        for name in names:
            _RETURNED_WITHOUT_META[name] = rule
        return rule
    return register


@_returns_without_meta("torch.bincount", "torch.Tensor.bincount")
def _bincount_dtypes(input: torch.Tensor, weights: torch.Tensor | None = None, minlength: int = 0) -> tuple:
    # _bincount_cpu and _bincount_cuda count in int64, sum float32 weights in float32 and any other in float64
    # (float16 weights return float64: promotion would say float16)
    if weights is None:
        return (torch.int64,)
    return (torch.float32 if weights.dtype == torch.float32 else torch.float64,)


def _computes_narrower(name: str, expected: tuple | None, args: tuple, kwargs: dict) -> bool:
    """Whether the widened call of an op with a rule (``_RETURNED_WITHOUT_META``) returns an output narrower than the
    op without the tool: its kernel computes the caller's dtype in a wider one already (bincount sums float16 weights
    in float64), which widening to float32 would narrow."""
    rule = _RETURNED_WITHOUT_META.get(name)
    if rule is None or expected is None:
        return False
    widened = rule(*args, **kwargs)
    return len(widened) != len(expected) or \
        any(torch.promote_types(w, e) != w for w, e in zip(widened, expected))


def _returned(originals: dict, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What the op hands back for ``t``: the caller's tensor it wrote (in-place, out=), or ``t`` in ``dtype``."""
    original = originals.get(id(t))
    if original is not None:
        return original
    return t if t.dtype == dtype else t.to(dtype)


_REMEMBERED = 4096  # _expected_dtypes's answers kept: a bound for keys that name objects (functions, strings)


def _dtype_key(call: OpCall, math: DeviceMath) -> tuple:
    """What decides the dtypes a call returns: the op, autocast, and each argument's kind where type promotion reads
    it (a tensor's dtype, device type and whether it is 0-dim; a number's type), other arguments as they are
    (dtypes, flags, functions); not shapes or values, so that a model's calls share a few keys."""
    parts: list = [call.func, math]
    for path, value in iter_items((call.args, call.kwargs)):
        if isinstance(value, torch.Tensor):
            value = (value.dtype, value.device.type, value.dim() == 0)
        elif isinstance(value, (int, float, complex)) and not isinstance(value, bool) or not _hashable(value):
            value = type(value)
        parts.append((path, value))
    return tuple(parts)


def _hashable(value) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _unknown_op_dtypes(outputs: list, widened: tuple, given: tuple) -> list:
    """The dtypes to return ``outputs`` in when the meta run could not say: an output in the dtype the widened
    inputs promote to gets the one the caller's inputs promote to (what an elementwise op or a reduction returns);
    every other one keeps its dtype, and so do all when the call names a dtype (``sum(x, dtype=torch.float32)``:
    the op returns that one whatever its inputs)."""
    wide, plain = promoted_dtype(*widened), promoted_dtype(*given)
    if plain is None or any(isinstance(v, torch.dtype) for _, v in iter_items(given)):
        return [t.dtype for t in outputs]
    return [plain if t.dtype == wide else t.dtype for t in outputs]


def _lowered_by_autocast(t: torch.Tensor, device: torch.device) -> bool:
    """Whether autocast would cast ``t`` down at an op it lowers: a floating tensor on its device, float64 aside."""
    return t.is_floating_point() and t.dtype != torch.float64 and t.device.type == device.type


def _tensor_items(args, kwargs):
    items = [(p, v) for p, v in iter_items(tuple(args)) if isinstance(v, torch.Tensor)]
    items += [(p, v) for p, v in iter_items(kwargs) if isinstance(v, torch.Tensor)]
    return items
