"""OpAutoCompare: run every handled op on the CPU as well and say which one computes wrong, forward and backward.

Per handled call (``OP_AUTOCOMPARE_LIST`` / ``OP_AUTOCOMPARE_DISABLE_LIST``):

1. before the op runs, its inputs are copied to the host (``host_copies``: a copy is reused across calls only
   while proven current; an argument the op writes is always copied fresh);
2. the op runs on the device exactly as without the tool: the user's tensors, graph and random streams;
3. the CPU reference (``reference``) runs on the host copies upcast to float64 (``<OPNAME>_OP_DTYPE_CAST_DICT``
   overrides; float32, then the device's dtype, where the CPU has no float64 kernel) and, when the verdict needs
   it, once more in the device's own dtype computing as the device declared (its autocast, TF32/HF32:
   ``device_math``); ``comparison.compare_outputs`` gives the verdict for the outputs and for every argument the
   op writes (in-place ops, ``out=``, BatchNorm's running statistics, a foreach op's list).
   With ``reference="device"`` (``numerics/device_reference.py``) the copies are float64 copies on the device and
   the reference runs there; a call whose verdict is not a clean pass, each op's first call and a sample of the
   others are judged, or cross-checked, on the CPU as above;
4. once the op's whole backward ran on the user's graph (``call_backward``: hooks on the autograd nodes it
   created, so in-place ops, ``torch.utils.checkpoint`` and double backward work as without the tool), the CPU
   reference backward runs with the same upstream gradients and the input gradients are compared the same way.

Calls that draw random numbers (by name, by a probability argument, or because the device's generator moved)
are never rerun: a rerun would draw other numbers, and would consume the user's stream; one written in Python out of
torch calls (attention with dropout: ``composite`` in ``op_facts``) runs with those calls handled, so the ones that
draw nothing are compared; attention with dropout as one op (``replays_dropout``) is compared with its mask,
replayed from the device's generator (``numerics/attention.py``). A call that fails is checked once more with its
cached input copies re-read from the device, so a copy made stale by a write no call showed never raises a false
alarm.

Failing calls are printed (every call with ``OP_TOOLS_VERBOSE=1``) and saved (``failing_calls``) in OpCapture's format
under ``op_capture_results/<op>/<pid>/autocompare/<forward_id>/<time>/{device,cpu}/``. At ``stop()``: a summary,
the failing ops in execution order, and a CSV in ``op_autocompare_result/``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Sequence

import torch

from ..config.settings import Family
from ..config.variables import (
    AUTOCOMPARE_BACKWARD,
    AUTOCOMPARE_CAST,
    AUTOCOMPARE_COLLECTIVES,
    AUTOCOMPARE_COMPILED,
    AUTOCOMPARE_CROSS_CHECK_EVERY,
    AUTOCOMPARE_DEVICE_REFERENCE_MAX_BYTES,
    AUTOCOMPARE_MAX_SAVE_BYTES,
    AUTOCOMPARE_MAX_SAVED,
    AUTOCOMPARE_REFERENCE,
    AUTOCOMPARE_TOLERANCES,
    AUTOCOMPARE_VERDICT_BATCH,
    MAX_CACHE_SIZE,
    REFERENCE_CAST_VAR,
    Sources,
    convert_dtype_map,
    parse_dtype_map,
)
from ..core import module_path
from ..core.engine import OpCall, OpTool, RegionRun, feature, tool_work
from ..numerics import collective_reference, device_rerun, fused_kernels, graph_reference
from ..numerics.ambiguous_results import adopt_choices, adopted
from ..numerics.attention import replayed_dropout_mask, with_dropout_mask
from ..numerics.comparison import (
    COLUMNS,
    UNREAD,
    WEAK_PASS,
    Comparison,
    PendingStats,
    SameDtypeHistory,
    ToleranceSpec,
    compare_outputs,
    compare_tensors,
    launch_stats,
    op_key,
    output_pairs,
)
from ..numerics.device_math import DeviceMath
from ..numerics.device_reference import (
    DeviceCopies,
    MemoryBound,
    NeedsHostError,
    NotCopiedError,
    Trust,
    needs_host,
    references_differ,
    tested_dtype,
)
from ..numerics.error_statistics import DEVICE_STATISTICS_MIN
from ..numerics.host_copies import HostCopies, has_events, snapshot, wait_for_copies
from ..numerics.reference import (
    DEFAULT_CAST,
    Reference,
    accumulated_terms,
    attempts_for,
    broadcast_terms,
    index_sum_terms,
    magnitudes_forward,
    map_arguments,
    meta_dtypes,
    reference_backward,
    run_reference,
    run_same_dtype,
)
from ..numerics.rounding_bounds import AnyOrderSum, attention_rounding, rounded_terms
from ..ops.arguments import UnsupportedInputError, is_dtensor, iter_items, iter_tensors, map_tensors, strided
from ..ops.collectives import collective_call, functional_call, functional_kind, signature_of
from ..ops.custom_functions import custom_node, unfollowed_function
from ..ops.op_facts import cached_on_facts, op_facts
from ..ops.random_calls import GeneratorProbe, cpu_generator_token, device_rng, random_reason, skip_text
from ..ops.torch_versions import OutOfMemoryError, is_compiling
from ..ops.writes import call_writes, flag_holds
from ..output import reporting, result_files
from .compare_state import CompareState, Launched
from .failing_calls import FailingCalls
from .verdict_queue import VerdictQueue

DEFAULT_REFERENCE_CAST = DEFAULT_CAST
# Why a compiled graph that writes tensors it holds goes unchecked: a compiled optimizer step writes the parameters and
# their state, which dynamo makes attributes of the graph, read by the reference only after the step wrote them.
_HELD_WRITES = ("a compiled graph writing tensors it holds, not its inputs (a compiled optimizer step's parameters "
                "and state): its writes are not compared")
# why a call's reference ran on the CPU with the device's asked for (the summary's counts)
_UNTRUSTED = "its float64 kernels on the device disagreed with the CPU's"
_NEEDED_CPU = "its verdict needed the CPU"

CSV_COLUMNS = ("op", "forward_id", "phase", "module", *COLUMNS, "location", *result_files.RECORD_COLUMNS)
# the console shows these columns of a comparison (fitting 120 characters); the CSV has them all
CONSOLE_COLUMNS = ("name", "allclose", "max_abs_diff", "max_relative_diff", "verdict", "error_info")
FAILURES_SHOWN = 20  # rows of the failing-ops table on the console; the CSV holds them all
VERSUS_EAGER_WORSE = 2.0  # a compiled graph erring more than this many times its eager run is counted as worse
_RERUN_DRAWS = "random (the CPU reference drew numbers)"
# Input elements from which an op's first call learns its output dtypes on meta tensors rather than by a same-dtype
# run (a meta run costs about a millisecond of Python whatever the size; a run on small tensors costs less).
META_DTYPES_MIN = 1 << 16


class _Learnt:
    """What compared calls taught about the CPU reference and the device's kernels, kept for the process: facts of
    an op's signature, not of one run, so a tool started per step does not pay an op's first-call costs again."""

    def __init__(self) -> None:
        # Output dtypes a correct run gives, per (op, input dtypes, device math): the same-dtype CPU run is lazy,
        # so without this a device returning a narrower dtype with small errors would pass.
        self.expected_dtypes: dict[tuple, tuple] = {}
        self.history = SameDtypeHistory()  # same-dtype errors per signature: reruns only where they decide
        self.rng_checked: set[str] = set()  # op names whose reruns were seen to leave the CPU generator alone
        self.drawing_reruns: set[str] = set()  # op names whose reruns drew numbers: never rerun again
        self.float64: dict[str, bool] = {}  # device type -> whether its kernels take float64
        self.trust = Trust()  # the device references' cross-checks (numerics/device_reference.py)


LEARNT = _Learnt()


_NO_CHECK = "collective (op_tools has no check for this one)"


@cached_on_facts  # asked on every handled call, and a name's answer changes only with its declared facts
def skip_reason(name: str) -> str | None:
    """Why ``name`` is never compared whatever its arguments: ``'uninitialised'``, ``'collective'`` or ``None``."""
    if op_facts(name).uninitialised:
        return "uninitialised"
    if op_facts(name).collective and signature_of(name) is None and functional_kind(name) is None:
        return _NO_CHECK  # its result is other ranks' data
    return None


@dataclasses.dataclass(frozen=True)
class AutoCompareConfig:
    backward: bool
    tolerance: ToleranceSpec
    casts: dict[str, dict[torch.dtype, torch.dtype]]  # OPNAME -> reference cast
    max_saved: int = 3
    collectives: bool = True  # torch.distributed collectives checked against every rank's inputs
    max_save_bytes: int = 64 << 20  # what the saved failing calls may take in all
    compiled: str = "eager"  # "check": compiled graphs stay compiled, each run compared as one call
    reference: str = "cpu"  # where the float64 reference runs: "cpu", "device" or "auto" (device_reference)
    cross_check_every: int = 64  # with a device reference: every N-th call of an op runs the CPU's too
    device_reference_max_bytes: int | None = 8 << 30  # the device memory the float64 copies may hold at once
    verdict_batch: int = 64  # calls judged after one wait for their copies (verdict_queue.py)
    max_cache_size: int | None = None  # rows held before they are appended to the CSV; None: written at stop()

    @classmethod
    def from_env(cls, sources: Sources | None = None) -> AutoCompareConfig:
        sources = sources or Sources()
        casts = dict(sources.file.get(REFERENCE_CASTS.name, {}))
        for name in os.environ:
            match = REFERENCE_CAST_VAR.match(name)
            if match:
                var = dataclasses.replace(AUTOCOMPARE_CAST, name=name, default=None, parse=parse_dtype_map)
                casts[match.group(1)] = var.read()
        casts.update(sources.arguments.get(REFERENCE_CASTS.name, {}))
        tolerance = ToleranceSpec.from_env().over(sources.file.get(TOLERANCE.name))
        given = sources.arguments.get(TOLERANCE.name)
        return cls(AUTOCOMPARE_BACKWARD.read(sources), given.over(tolerance) if given else tolerance, casts,
                   AUTOCOMPARE_MAX_SAVED.read(sources), AUTOCOMPARE_COLLECTIVES.read(sources),
                   AUTOCOMPARE_MAX_SAVE_BYTES.read(sources), AUTOCOMPARE_COMPILED.read(sources),
                   AUTOCOMPARE_REFERENCE.read(sources), AUTOCOMPARE_CROSS_CHECK_EVERY.read(sources),
                   AUTOCOMPARE_DEVICE_REFERENCE_MAX_BYTES.read(sources), AUTOCOMPARE_VERDICT_BATCH.read(sources),
                   MAX_CACHE_SIZE.read(sources))


def _reference_casts(value) -> dict[str, dict[torch.dtype, torch.dtype]]:
    if not isinstance(value, dict):
        raise TypeError("not a dict")
    from ..ops.naming import resolve_op_name

    return {op_key(resolve_op_name(op) if callable(op) else str(op)): convert_dtype_map(cast)
            for op, cast in value.items()}


# Keywords standing for families of variables (one per op and dtype).
TOLERANCE = Family(AUTOCOMPARE_TOLERANCES[2].name, ToleranceSpec.from_value,
                   "(atol, rtol), or a dict {torch.bfloat16: (atol, rtol), 'default': (atol, rtol), "
                   "'torch.nn.functional.linear': {torch.float16: (atol, rtol)}}",
                   "'atol,rtol' for every op and dtype (per dtype or op: the variables or the config file)")
REFERENCE_CASTS = Family(AUTOCOMPARE_CAST.name, _reference_casts,
                         "a dict {op name or function: {torch.float16: torch.float32}}")



def _in_frame_of(found, call_module: str):
    """``found`` (a ``DivergingNode`` or ``fused_kernels.DivergingKernel``) with its module path under
    ``call_module``, the module running the compiled graph's call, where it is the frame's own module's (``self``);
    a root module's children are named without it, as the engine names them (``model.layers.0``)."""
    path = found.module
    if path != "self" and not path.startswith("self."):
        return found
    inner = path[len("self."):] if path != "self" else ""
    outer = call_module if module_path.enclosing(call_module) else ""  # a root's path is its class: left out
    joined = ".".join(filter(None, (outer, inner))) or call_module
    if outer and not module_path.is_known(joined):  # the frame's module is not the one running the call (a layer
        # compiled in place, layer.compile(), runs no module hooks): the path inside it alone
        joined = inner or call_module
    return dataclasses.replace(found, module=joined)

@feature("autocompare")
class OpAutoCompare(OpTool):
    """Compare every handled op, forward and backward, with a float64 CPU reference.

    Keyword arguments (each overrides its variables): ``ops``, ``disable`` (``OP_AUTOCOMPARE_LIST``/
    ``_DISABLE_LIST``: lists of op names, patterns or functions), ``backward`` (``OP_AUTOCOMPARE_BACKWARD``),
    ``max_saved`` (``OP_AUTOCOMPARE_MAX_SAVED``), ``max_save_bytes`` (``OP_AUTOCOMPARE_MAX_SAVE_BYTES``),
    ``tolerance`` (the variables
    ``[<OPNAME>_]AUTOCOMPARE_ERROR_TOLERANCE[_<DTYPE>]``: ``(atol, rtol)``, or a dict
    ``{torch.bfloat16: (atol, rtol), "torch.nn.functional.linear": {torch.float16: (atol, rtol)}}``),
    ``reference_casts`` (``<OPNAME>_OP_DTYPE_CAST_DICT``: ``{"linear": {torch.float16: torch.float32}}``),
    ``collectives`` (``OP_AUTOCOMPARE_COLLECTIVES``: check torch.distributed collectives against every rank's
    inputs), ``compiled`` (``OP_AUTOCOMPARE_COMPILED``: ``"check"`` keeps torch.compile'd code compiled and compares
    each compiled graph's run as one call; ``"versus_eager"`` also runs each graph's forward eagerly on the device
    and says whether compiled errs more), ``reference`` (``OP_AUTOCOMPARE_REFERENCE``: ``"device"`` runs the float64
    reference on the device where it computes float64, judging on the CPU every call that does not pass cleanly;
    ``"auto"``: the device where it can), ``cross_check_every`` (``OP_AUTOCOMPARE_CROSS_CHECK_EVERY``),
    ``device_reference_max_bytes`` (``OP_AUTOCOMPARE_DEVICE_REFERENCE_MAX_BYTES``), ``verdict_batch``
    (``OP_AUTOCOMPARE_VERDICT_BATCH``: calls judged after one wait for their copies; 1: each when it returns),
    ``max_cache_size`` (``OP_TOOLS_MAX_CACHE_SIZE``: the comparisons appended to the CSV whenever more are held;
    unset: written at stop()), and ``results_dir``,
    ``verbose``, ``print_stack``, ``strict``, ``print_ranks`` as every tool.

    >>> with op_tools.OpAutoCompare(tolerance={torch.bfloat16: (1e-2, 1e-2)}, backward=False) as compare:
    ...     loss = model(x).sum()
    >>> with op_tools.OpAutoCompare() as compare:       # failures and the summary; OP_TOOLS_VERBOSE=1: every call
    ...     loss = model(x).sum(); loss.backward()
    >>> compare.failures[:1]   # the first op, in execution order, that computes wrong (forward or backward)
    """

    hook_name = "OpAutoCompareHook"
    env_prefix = "OP_AUTOCOMPARE"
    reports_unchecked = True  # the run report reads its findings
    results_folder = "op_autocompare_result"
    tracks_writes = True
    keywords = {"backward": AUTOCOMPARE_BACKWARD, "max_saved": AUTOCOMPARE_MAX_SAVED,
                "max_save_bytes": AUTOCOMPARE_MAX_SAVE_BYTES, "tolerance": TOLERANCE,
                "reference_casts": REFERENCE_CASTS, "collectives": AUTOCOMPARE_COLLECTIVES,
                "compiled": AUTOCOMPARE_COMPILED, "reference": AUTOCOMPARE_REFERENCE,
                "cross_check_every": AUTOCOMPARE_CROSS_CHECK_EVERY,
                "device_reference_max_bytes": AUTOCOMPARE_DEVICE_REFERENCE_MAX_BYTES,
                "verdict_batch": AUTOCOMPARE_VERDICT_BATCH, "max_cache_size": MAX_CACHE_SIZE}
    tracks_modules = True

    def configure(self) -> None:
        self.settings = AutoCompareConfig.from_env(self.sources)
        self.checks_regions = self.settings.compiled in ("check", "versus_eager")
        self._tolerance = self.settings.tolerance or None  # None: no variable set, nothing to look up per call
        self.saving = FailingCalls(self.common, self.settings.max_saved, self.pid_folder, self.tally, self._logger,
                                   self.settings.max_save_bytes)
        self.counts: collections.Counter = collections.Counter()
        self._taken = 0  # forward calls compared or queued to be (a random composite counts those inside it)
        self.skipped: collections.Counter = collections.Counter()
        self.backward_not_compared: collections.Counter = collections.Counter()
        # calls per op name whose backward ran again over a retained graph: those runs are not compared
        self.backward_runs_again: collections.Counter = collections.Counter()
        # custom autograd.Function name -> calls that read its results (ops/custom_functions.py)
        self.unfollowed_functions: collections.Counter = collections.Counter()
        # the custom Functions' nodes this tool's calls made (a compiled graph's run): their backward is followed
        self._followed_nodes: weakref.WeakSet = weakref.WeakSet()
        self.device_math: collections.Counter = collections.Counter()  # what same-dtype runs applied -> calls
        self.stale_copies = 0  # cached host copies found out of date when a failing call re-read them
        # failing calls that changed an input they do not declare written, by op (_wrote_its_inputs, device_rerun)
        self.inputs_written: collections.Counter[str] = collections.Counter()
        # (op, phase, result) -> calls passed with that result within a correct run's own error of WEAK_PASS or more:
        # a fault that size there passes
        self.weak_passes: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self.failures: list[dict] = []
        self._failures_shown: set = set()  # (op, phase) whose first failing call's table was shown at WARNING
        self.rows: list[tuple] = []  # comparisons not yet in the CSV
        self._csv_written = [0, 0]  # rows and bytes appended to the CSV before stop() (OP_TOOLS_MAX_CACHE_SIZE)
        self._csv_failed = False  # an append failed: the rest is written at stop()
        self._pending: weakref.WeakValueDictionary[int, OpCall] = weakref.WeakValueDictionary()
        self._order_lock = threading.Lock()
        self._copies = HostCopies()
        # Verdicts judged in batches (verdict_queue.py), on devices with events; strict mode judges each call at once
        # (its error is raised at the call that made it).
        self._queue = VerdictQueue(self._copies, self._guarded,
                                   batch=1 if self.common.strict else self.settings.verdict_batch)
        self._deferring: dict[str, bool] = {}  # device type -> whether its calls' verdicts wait in the queue
        # A training step's verdicts are all in when its optimizer step returns (failures read then are complete,
        # and a step's cost includes its judging).
        from torch.optim.optimizer import register_optimizer_step_post_hook

        previous = vars(self).get("_step_hook")
        if previous is not None:  # started again before its stop
            previous.remove()
        # outside dynamo: under a torch.compile'd optimizer step, dynamo would compile the judging's own frames
        self._step_hook: torch.utils.hooks.RemovableHandle = register_optimizer_step_post_hook(
            torch._disable_dynamo(functools.partial(self._judge_step)))
        self._probes: dict[torch.device, GeneratorProbe] = {}
        self._attempts: dict[str, list] = {}  # op name -> the reference casts to try, in order
        # compiled graph's name -> the largest ratio of its compiled error to its eager one (versus_eager)
        self.versus_eager: dict[str, float] = {}
        # compiled graph's name -> the first node found diverging in it (None: none does), once per graph
        self._narrowed: dict[str, graph_reference.DivergingNode | fused_kernels.DivergingKernel | None] = {}
        self._region_writes: dict[str, tuple] = {}  # region name -> graph_reference.written_sources of its graph
        # the float64 reference on the device (numerics/device_reference.py)
        self._device_reference = self.settings.reference != "cpu"
        self._memory = MemoryBound(self.settings.device_reference_max_bytes)
        self._said_no_float64: set[str] = set()
        # where each compared call's verdict came from: "device", or "CPU: <why>" -> forward calls
        self.reference_place: collections.Counter = collections.Counter()
        self.untrusted_here: dict[str, str] = {}  # ops found untrusted by this tool's cross-checks

    def _judge_step(self, *_) -> None:
        # not while dynamo traces a compiled optimizer step: the queue waits for the next point
        if len(self._queue) and not is_compiling():
            self.judge_queued()

    def judge_queued(self) -> None:
        """Judge the calls still waiting for their copies now (one wait for the device): ``failures`` and the counts
        are then complete. Optimizer steps and ``stop()`` do it; a loop without an optimizer may call it."""
        # The program's calls go through the tools' modes: the judging's own calls (thousands a step) skip them.
        with tool_work(), torch._C.DisableTorchFunction():
            self._queue.flush()

    def note_writes(self, tensors: list) -> None:
        self._copies.forget(tensors)
        self._queue.before_write(tensors)

    def _defers(self, device: torch.device) -> bool:
        """Whether calls on ``device`` are judged in batches: copies without waiting, then one wait for a batch."""
        known = self._deferring.get(device.type)
        if known is None:
            known = self._deferring[device.type] = \
                self._queue.batch > 1 and device.type != "cpu" and has_events(device)
        return known

    # --- forward ---

    def before(self, call: OpCall) -> None:
        state = call.state = CompareState()
        spec = call_writes(call.name)
        written = spec.written(call.args, call.kwargs)
        state.written = written
        if written:  # a queued call may re-read what this call writes: judged first
            self._queue.before_write(written)
        region = call.func.region if type(call.func) is RegionRun else None
        if region is not None:  # a compiled graph: its reference is the graph dynamo traced, rerun on the host
            reason = graph_reference.random_reason(region.gm)
            state.func = graph_reference.reference_of(region)
            state.region_args = call.args
            writes = self._region_writes.get(region.name)
            if writes is None:
                writes = self._region_writes[region.name] = graph_reference.written_sources(region.gm)
            if writes[1] and reason is None:  # no output shows what it did: passing it unjudged would be a silent pass
                raise UnsupportedInputError(_HELD_WRITES)
        else:
            reason = skip_reason(call.name) or random_reason(call.name, call.args, call.kwargs)
            if reason == _NO_CHECK and call.name.startswith("torch.distributed.") and self.settings.collectives:
                # tensors moved between ranks (a gather, a send) and left unchecked: never a clean verdict
                raise UnsupportedInputError("a torch.distributed collective op_tools has no check for")
        reason = reason or (_RERUN_DRAWS if call.name in LEARNT.drawing_reruns else None)
        facts = op_facts(call.name)
        if reason == "random" and facts.composite or reason is None and facts.compared_inside:
            state.inside = True  # run() descends into it; one that draws nothing is compared whole as well
        elif reason == "random" and op_facts(call.name).replays_dropout and \
                (rng := device_rng(call.device)) is not None:
            state.replay, reason = (rng, rng[0]()), None  # after() replays its mask
        elif reason == "random":
            reason = skip_text(call.name)
        if reason is None and (signature_of(call.name) is not None or functional_kind(call.name) is not None):
            reason = self._before_collective(call, state)
        if reason is not None:
            state.skip = reason
            return
        # A DTensor is compared whole: its copies are its full tensor (host_copies.snapshot), the reference runs on
        # the global tensors, and the result is gathered the same way.
        # Copies are reused across calls only when every call is seen (a mode): targeted wrappers and apply_feature
        # see only their functions, and the writes of the others (an optimizer's) would leave copies stale.
        host_copy = (self._copies.get_without_waiting if self._defers(call.device) else self._copies.get) \
            if self.sees_every_call else _fresh_copy
        copies = self._device_copies(call, state) if self._device_reference else None
        if copies is not None:  # the reference runs on the device, on these float64 copies (device_reference)
            try:
                self._copy_arguments(call, state, copies.fresh, keep_devices=True)
            except NotCopiedError as why:
                copies, state.cpu_reason = None, why.args[0]
            except OutOfMemoryError:  # a call that does not fit beside the run: compared on the CPU
                copies, state.cpu_reason = None, "out of device memory for its float64 copies"
            else:
                if self._memory.admits(copies.nbytes):
                    state.device_copies = copies
                    self._memory.hold(copies)
                    state.cross_check = LEARNT.trust.cross_check(call.name, self.settings.cross_check_every)
                else:  # let go at once: rare, and cheaper than sizing every call's arguments beforehand
                    copies, state.cpu_reason = None, \
                        "its float64 copies would pass OP_AUTOCOMPARE_DEVICE_REFERENCE_MAX_BYTES"
        if copies is None:
            self._copy_arguments(call, state, host_copy)
        if region is not None:  # the inputs its graph writes (every input may be, for the copies: spec.unknown)
            positions = self._region_writes[region.name][0]
            state.compared_writes = [t for i in positions if isinstance(t := call.args[i], torch.Tensor)]
        else:
            state.compared_writes = () if spec.unknown else written
        state.math = DeviceMath.of(call.device, call.name)
        state.rng = self._probe(call.device).token()
        reason = self._backward_reason(call)
        if reason is None:
            inputs: list[torch.Tensor] = []
            labels: list[str] = []
            for label, t in labelled_tensors(call.args, call.kwargs):
                if t.requires_grad and all(t is not u for u in inputs):
                    inputs.append(t)
                    labels.append(label)
                    function = unfollowed_function(t, self._followed_nodes)
                    if function is not None:  # its backward, before this call's, is compared by nothing
                        with self._lock:
                            self.unfollowed_functions[function] += 1
            call.grad_inputs, state.grad_labels = inputs, labels
        elif reason:
            self.backward_not_compared[reason] += 1

    @staticmethod
    def _copy_arguments(call: OpCall, state: CompareState, get, keep_devices: bool = False) -> None:
        """``state.cpu_args``/``cpu_kwargs``: the call's arguments with each tensor through ``get`` (``(copy,
        reused)``) once, and ``state.tensors``: (tensor, copy, reused) in argument order, walked once."""
        tensors: list = []
        # A tensor passed twice (x * x, attention's query, key and value) is one copy: one leaf in the reference, so
        # that its gradient sums both uses as the device's does. The cache gave that only to the tensors it keeps.
        taken: dict[int, tuple] = {}

        def copy(t: torch.Tensor) -> torch.Tensor:
            host, reused = taken.get(id(t)) or taken.setdefault(id(t), get(strided(t, _NOT_COMPARED)))
            tensors.append((t, host, reused))
            return host

        state.tensors = tensors  # after() drops the list (it holds device memory)
        state.cpu_args = map_arguments(call.args, copy, keep_devices=keep_devices)
        state.cpu_kwargs = map_arguments(call.kwargs, copy, keep_devices=keep_devices)

    def _device_copies(self, call: OpCall, state: CompareState) -> DeviceCopies | None:
        """A holder for the call's float64 copies on its device when its reference runs there; else None, with why
        in ``state.cpu_reason`` (counted once the call is compared)."""
        reason = _device_reason(call, state, self.settings)
        if reason is None and not self._float64_on(call.device):
            reason = "the device has no float64 kernels"
            self._say_no_float64(call.device)
        if reason is not None:
            state.cpu_reason = reason
            return None
        return DeviceCopies()

    def _say_no_float64(self, device: torch.device) -> None:
        if device.type not in self._said_no_float64:
            self._said_no_float64.add(device.type)
            self._logger.log(logging.WARNING if self.settings.reference == "device" else logging.INFO,
                             "OpAutoCompare: reference=%s: the float64 reference runs on the CPU, as %s has no float64 "
                             "kernels", self.settings.reference, device.type)

    def _before_collective(self, call: OpCall, state: CompareState) -> str | None:
        """A collective to check against every rank's inputs (its sent tensors copied now); else why it is not."""
        if not self.settings.collectives:
            return "collective (OP_AUTOCOMPARE_COLLECTIVES=0)"
        bound = collective_call(call.name, call.func, call.args, call.kwargs) or \
            functional_call(call.name, call.args, call.kwargs)
        if bound is None:
            raise UnsupportedInputError("collective (its arguments did not bind)")
        reason = collective_reference.unverifiable(bound)
        if reason == collective_reference.NO_TENSORS:
            return reason
        if reason is not None:  # tensors moved between ranks, unchecked: never a clean verdict
            raise UnsupportedInputError(reason)
        state.collective = (bound, collective_reference.sent_copies(bound))
        return "collective"  # not compared as an op: after() checks it against the other ranks' inputs

    def _after_waited_collective(self, call: OpCall) -> None:
        try:
            self._after_collective(call)
        except Exception:
            self.counts["forward not checked"] += 1  # as after() counts a check that failed
            raise

    def _after_collective(self, call: OpCall) -> None:
        state: CompareState = call.state
        assert state.collective is not None
        self._queue.flush()  # the calls before it are judged first
        bound, copies = state.collective
        state.collective = None
        comparisons = collective_reference.verify(bound, copies)  # an error: after() counts the call not checked
        passed = all(c.passed for c in comparisons)
        self._taken += 1
        self.counts["forward compared"] += 1
        self.counts["forward passed" if passed else "forward failed"] += 1
        level = self._table_level(call.name, "forward", passed)
        location = call.location if not passed or self._logger.isEnabledFor(level) else ""
        self._record(call.name, call.forward_id, "forward", location, comparisons, call.module_path, call.step,
                     call.time)
        if self._logger.isEnabledFor(level):
            self._logger.log(level, reporting.header(call.name, call.forward_id, location)
                             + ("" if passed else "    FAIL") + "\n"
                             + reporting.call_table(call.name, [_named_row(call.name, c) for c in comparisons],
                                                    CONSOLE_COLUMNS))

    def run(self, call: OpCall):
        if not call.state.inside:
            return call.runs(*call.args, **call.kwargs)
        # Its calls are handled one by one. A random composite is skipped, and after() counts it with how many of
        # them were compared; one that draws nothing is compared whole too (``compared_inside``: under a list naming
        # it alone, or another mode on the stack, the calls inside are not handled, and the whole is what is judged).
        taken = self._taken
        result = self.run_inside(call)
        inside = self._taken - taken
        if inside and call.state.skip:
            call.state.skip = f"random (compared inside: {inside} call{'s' if inside != 1 else ''})"
        return result

    def _probe(self, device: torch.device) -> GeneratorProbe:
        probe = self._probes.get(device)
        if probe is None:
            probe = self._probes[device] = GeneratorProbe(device)
        return probe

    def _backward_reason(self, call: OpCall) -> str | None:
        """None when this call's backward is compared; '' when it has none; else why it is not compared."""
        if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            return ""
        if not any(t.requires_grad for t, _, _ in call.state.tensors):
            return ""
        if not self.settings.backward:
            return "OP_AUTOCOMPARE_BACKWARD=0"
        name = call.name
        facts = op_facts(name)
        # a view's gradient passes through, save an expansion's (a sum over the broadcast elements: broadcast_sums) and
        # that of a view whose backward is a kernel (backward_kernel: a slice's, a split's, a gather's)
        if facts.view and not (facts.broadcast_sums or facts.backward_kernel) or facts.conversion:
            return "view or conversion (gradient passed through)"
        return None

    def after(self, call: OpCall) -> None:
        try:
            if call.grad_inputs:  # its backward is followed, through a custom Function's node too (a compiled graph)
                for t in iter_tensors(call.result):
                    node = custom_node(t)
                    if node is not None:
                        self._followed_nodes.add(node)
            self._after(call)
        except Exception:
            self.counts["forward not checked"] += 1  # the engine reports the error and counts the call
            raise
        finally:
            # what the comparison used lives only while after() runs, or until the queue judges the call
            if call.state.host_of is not None and not call.state.queued:
                call.state.drop_forward()

    def _judge_queued(self, call: OpCall) -> None:
        """A forward verdict that waited in the queue (its copies, or its statistics on the device, have landed)."""
        state: CompareState = call.state
        state.queued = False
        try:
            outcome = self._judge_launched(call, state) if state.launched is not None else \
                self._judge_forward(call, state)
            if outcome is not None:
                self._conclude_forward(call, state, outcome)
        except Exception:
            self.counts["forward not checked"] += 1  # the engine's runner reports the error and counts the call
            raise
        finally:
            if state.host_of is not None:
                state.drop_forward()

    def _after(self, call: OpCall) -> None:
        state: CompareState = call.state
        written = state.written
        reason = state.skip
        if state.collective is not None:
            self._copies.forget(written)
            bound = state.collective[0]
            if bound.asynchronous:  # what it receives is there once the program waits for it
                self.check_when_waited(call, self._after_waited_collective, bound.received, bound)
                return
            if bound.functional:  # its result, filled by the collective: waited for now (the program's wait is a no-op)
                if not isinstance(call.result, torch.Tensor):
                    raise UnsupportedInputError("a functional collective that returned no tensor")
                bound.received.append(call.result)
                with torch.no_grad():
                    torch.ops._c10d_functional.wait_tensor(call.result)
            self._after_collective(call)
            return
        if reason is not None:
            self.skipped[reason] += 1
            self._copies.forget(written)
            return
        if state.cpu_args is None:  # before() failed: reported and counted by the engine
            self.counts["forward not checked"] += 1
            self._copies.forget(written)
            return
        tensors, state.tensors = state.tensors, ()
        if state.replay is not None:
            keep = replayed_dropout_mask(call.args, call.kwargs, call.result, *state.replay)
            if keep is None:
                return self._skip_random(call, skip_text(call.name))
            state.func = with_dropout_mask(keep)
        elif state.rng != self._probe(call.device).token():  # drew random numbers its name and arguments hid
            return self._skip_random(call, "random (the device's generator moved)")
        written_ids = {id(t) for t in written}
        in_result = {id(t) for t in iter_tensors(call.result)}
        extra = [t for t in state.compared_writes if id(t) not in in_result]  # written, not returned
        for t in written:
            if id(t) not in in_result and all(t is not e for e in extra):
                self._copies.forget([t])  # may have been written (an unknown function's argument)
        signature = (call.name, tuple(t.dtype for t, _, _ in tensors), state.math)
        # what _compare_forward compares (dropped when after() returns)
        state.extra, state.extra_labels, state.signature = \
            [id(t) for t in extra], _labels_of(call.args, call.kwargs, extra), signature
        state.precedent = (*signature, tuple(tuple(t.shape) for t, _, _ in tensors),
                           _settings_of(call.args, call.kwargs))
        state.grad_ids, state.wants_backward = [id(t) for t in call.grad_inputs], bool(call.grad_inputs)
        # Judged now: a compiled graph (narrowed at once), and with the reference on the device an op's first call
        # (its next calls run their reference there once it has shown its reruns draw no random numbers).
        defer = type(call.func) is not RegionRun and self._defers(call.device) and \
            not (self._device_reference and call.name not in LEARNT.rng_checked)
        on_device = state.device_copies is not None
        if on_device and defer:
            launched = self._launch_forward(call, state, tensors, extra)
            if launched:
                return
            on_device = launched is None  # False: the CPU judges it (state.cpu_reason says why)
        defer = defer and state.device_copies is None
        if not defer:  # judged now: the calls queued before it first, so failures are found in the order they ran
            self._queue.flush()
        outcome = self._forward_on_device(call, state, tensors, extra) if on_device else None
        if outcome is None:
            if state.device_copies is not None:
                tensors = self._to_host(state, tensors)
            host_of = state.host_of = {id(t): host for t, host, _ in tensors}
            state.host_inputs = tuple(id(host) for t, host, _ in tensors if t.is_cpu)  # a rerun keeps them there
            # A result that is the op's input (``to``, ``contiguous`` returning the tensor itself) of an op that writes
            # nothing is compared as that input's copy: one copy, re-read with it if the call fails.
            inputs = host_of if call_writes(call.name).never else {}
            state.device_cpu = map_tensors(call.result, lambda t: inputs[id(t)] if id(t) in inputs else
                                           self._compared_value(t, id(t) in written_ids, defer))
            state.extra_cpu = [self._compared_value(t, True, defer) for t in extra]
            # the host copies the reruns may write into (the written arguments'), kept for the backward's rerun too
            state.owned = {id(host_of[id(t)]) for t in written if id(t) in host_of}
            # inputs the cache supplied, re-read if the call fails (not those the op wrote: their old values are gone)
            state.rereads = {id(t): t for t, _, reused in tensors if reused and id(t) not in written_ids}
            if defer:
                # Judged once its copies have landed, with the call's source line taken while its frames are on the
                # stack (what a failure re-reads is held as it is: torch.utils.swap_tensors, which Module.to uses,
                # refuses weak references, not references).
                state.written = state.compared_writes = ()
                state.queued = True
                call.keep_location()
                self._taken += 1
                # A call with a backward to follow loses its arguments and result when it is hooked (the engine's
                # _attach_call_backward, or call_backward_skipped); any other is queued without them.
                self._queue.put(call if state.wants_backward else call.without_values(), self._judge_queued,
                                state.rereads.values())
                return
            outcome = self._judge_forward(call, state)
        if outcome is None:
            return
        self._taken += 1
        self._conclude_forward(call, state, outcome)

    def _judge_forward(self, call: OpCall, state: CompareState, device_values=None) -> tuple | None:
        """The forward compared on the host, from the copies in ``state``; compared again with fresh copies of the
        inputs the cache supplied where one was out of date. ``device_values``: the device reference's results on
        the host (else read from it) for the cross-check."""
        outcome = self._compare_forward(call, state)
        if outcome is not None and not all(c.passed for c in outcome[0]) and state.rereads:
            if self._recheck(call, state):  # a cached copy was stale: compare again
                outcome = self._compare_forward(call, state)
        if outcome is not None and state.device_reference is not None:
            self._cross_check(call, state, state.device_reference.result if device_values is None else device_values,
                              outcome[1], "forward", outcome[0])
        return outcome

    def _conclude_forward(self, call: OpCall, state: CompareState, outcome: tuple) -> None:
        """Count, record, show and save a forward verdict; keep what its backward needs."""
        extra = state.extra
        if self._device_reference:
            self.reference_place["forward", "device" if state.device_copies is not None else state.cpu_reason] += 1
        device_cpu, extra_cpu, host_of = state.device_cpu, state.extra_cpu, state.host_of or {}
        comparisons, reference = outcome
        passed = all(c.passed for c in comparisons)
        self.counts["forward compared"] += 1
        self.counts["forward passed" if passed else "forward failed"] += 1
        if passed:
            for result in _weak(comparisons):
                self.weak_passes[call.name, "forward", result] += 1
        if state.math_used:
            self.device_math[state.math_used.describe()] += 1
        wants_backward = state.wants_backward
        # Finding the user's source line costs a stack walk: only for what is printed or may fail later.
        level = self._table_level(call.name, "forward", passed)
        location = call.location if not passed or self._logger.isEnabledFor(level) or wants_backward else ""
        module = call.module_path
        if self.settings.compiled == "versus_eager" and type(call.func) is RegionRun:
            self._versus_eager(call, comparisons, reference)
        if not passed and type(call.func) is RegionRun:
            module, location = self._narrow(call, comparisons, module, location)
        self._record(call.name, call.forward_id, "forward", location, comparisons, module, call.step, call.time)
        device_out = (device_cpu, *extra_cpu)
        ref_out = (reference.result, *[reference.mapped[id(host_of[i])] for i in extra])
        if self._logger.isEnabledFor(level):
            self._print_forward(call, reference, comparisons, location, passed, level)
        if not passed:
            self._save(call.name, call.forward_id, state, device_out, ref_out,
                       record=result_files.record_fields(self.common.rank, call.step, call.time))
            state.saved_forward = True
        if not wants_backward:
            state.release()
            return
        # Kept for the backward: the CPU reference graph and what a failure report would save.
        state.reference, state.device_out, state.ref_out = reference, device_out, ref_out
        self._pending[call.forward_id] = call

    def _skip_random(self, call: OpCall, reason: str) -> None:
        self.skipped[reason] += 1
        self._copies.forget(call.state.written)
        call.state.release()
        call.grad_inputs = []

    def _forward_on_device(self, call: OpCall, state: CompareState, tensors: Sequence, extra: list) -> tuple | None:
        """The forward judged against the float64 reference on the device; None when its verdict is not a clean
        pass, or the call is cross-checked (``state.cpu_reason`` says which): the CPU then judges it."""
        state.device_cpu = map_tensors(call.result, torch.Tensor.detach)
        state.extra_cpu = [t.detach() for t in extra]
        state.host_of = {id(t): copy for t, copy, _ in tensors}
        state.owned = {id(state.host_of[id(t)]) for t in state.written if id(t) in state.host_of}
        self._copies.forget(state.written)  # the host copies are not kept current by this path
        results = list(iter_tensors((state.device_cpu, state.extra_cpu)))
        if any(t.dtype in (torch.float64, torch.complex128) for t in results):
            state.cpu_reason = "a float64 result (the device's reference would be itself)"
            return None
        if any(is_dtensor(t) for t in results):  # from plain arguments (distribute_tensor): compared whole
            state.cpu_reason = "a DTensor"
            return None
        try:
            outcome = self._compare_forward(call, state, on_device=True)
        except NeedsHostError:
            state.cpu_reason = _NEEDED_CPU
            return None
        except OutOfMemoryError:
            state.cpu_reason = "out of device memory for its comparison"
            return None
        if outcome is None:  # state.cpu_reason says why
            return None
        if not all(c.passed for c in outcome[0]):
            state.cpu_reason = _NEEDED_CPU
            return None
        if state.cross_check:
            state.cpu_reason = "a cross-check"
            return None
        state.device_reference = None  # it is the call's reference (state.reference, for the backward)
        return outcome

    def _launch_forward(self, call: OpCall, state: CompareState, tensors: Sequence, extra: list) -> bool | None:
        """The float64 reference run on the device now and the comparison's statistics computed there (read with the
        batch's, in one transfer), and the verdict queued (``_judge_launched``): True. None: the call is judged now
        (``_forward_on_device`` says why); False: the CPU judges it now (``state.cpu_reason`` says why)."""
        results = list(iter_tensors(call.result))
        if any(t.dtype in (torch.float64, torch.complex128) or is_dtensor(t) for t in itertools.chain(results, extra)) \
                or LEARNT.expected_dtypes.get(state.signature) != _leaf_dtypes(call.result):
            return None  # the output dtypes a correct run gives are learnt on the CPU
        host_of = {id(t): copy for t, copy, _ in tensors}
        owned = {id(host_of[id(t)]) for t in state.written if id(t) in host_of}
        try:
            reference, _ = run_reference(state.func or call.func, state.cpu_args, state.cpu_kwargs,
                                         self._attempts_of(call.name)[:1], owned,
                                         [host_of[i] for i in state.grad_ids], keep_devices=True)
            if reference is None:
                state.cpu_reason = "the float64 reference cannot run on the device"
                return False
            # Kept as they are now: a later op may write the results in place before the verdict reads them.
            with torch.no_grad():
                state.device_cpu = map_tensors(call.result, _kept)
                state.extra_cpu = [_kept(t) for t in extra]
            pairs = output_pairs(state.device_cpu, reference.result)
            outputs = len(pairs)
            pairs += [(kept, reference.mapped[id(host_of[id(t)])]) for t, kept in zip(extra, state.extra_cpu)]
            # a cross-checked call is judged on the CPU: no statistics here
            pending = None if state.cross_check else launch_stats(pairs, self._tolerance, call.name, False)
        except OutOfMemoryError:
            state.cpu_reason = "out of device memory for its comparison"
            return False
        state.host_of, state.owned, state.rereads = host_of, owned, {}
        state.launched = Launched(reference, pending, outputs,
                                  _dtypes_only(call.args) if op_facts(call.name).rounded_terms else ())
        self._copies.forget(state.written)  # the host copies are not kept current by this path
        state.written = state.compared_writes = ()
        state.queued = True
        call.keep_location()
        self._taken += 1
        # held until judged: the float64 copies (a call with a backward holds them until then anyway, within the
        # memory bound), the reference's results and the kept ones
        held = sum(t.nbytes for t in itertools.chain(iter_tensors(reference.result), iter_tensors(state.device_cpu),
                                                        state.extra_cpu))
        copies = state.device_copies
        if pending is not None:
            self._queue.read_with(pending)  # its statistics come back with the batch's, in one transfer
        self._queue.put(call if state.wants_backward else call.without_values(), self._judge_queued,
                        held=held + (0 if state.wants_backward or copies is None else copies.nbytes))
        return True

    def _judge_launched(self, call: OpCall, state: CompareState) -> tuple | None:
        """A forward launched on the device, judged once its statistics have landed: on the device when it passes
        there cleanly; else on the CPU, from host copies of what the device judged, cross-checked against it."""
        launched = state.launched
        assert launched is not None  # set by _launch_forward
        outcome = None
        untrusted = call.name in LEARNT.trust.untrusted  # found so by a cross-check since the call was launched
        if untrusted:
            state.cpu_reason = _UNTRUSTED
        elif state.cross_check:
            state.cpu_reason = "a cross-check"
        else:
            try:
                outcome = self._compare_forward(call, state, on_device=True, launched=launched)
            except NeedsHostError:
                pass
            except OutOfMemoryError:
                state.cpu_reason = "out of device memory for its comparison"
        if outcome is not None and all(c.passed for c in outcome[0]):
            state.device_reference = None  # it is the call's reference (state.reference, for the backward)
            return outcome
        state.cpu_reason = state.cpu_reason or _NEEDED_CPU
        values = self._launched_to_host(call, state, launched.reference)
        state.device_reference = None if untrusted else launched.reference  # nothing more to learn from it
        return self._judge_forward(call, state, values)

    def _launched_to_host(self, call: OpCall, state: CompareState, reference: Reference):
        """A launched call's device copies and kept results brought to the host (exactly), for the CPU to judge it,
        and the host copies of the device reference's results returned (to cross-check the CPU's): one wait."""
        host_of, owned = state.host_of, state.owned
        assert host_of is not None and owned is not None  # set by _launch_forward
        copies = _copies_to_host(state, True)
        state.host_of = {i: copies.host_tensor(c, True) for i, c in host_of.items()}
        state.owned = {id(h) for i, h in copies.on_host.items() if i in owned}
        state.device_cpu = map_tensors(state.device_cpu, self._judged_copy)
        state.extra_cpu = [self._judged_copy(t) for t in state.extra_cpu]
        values = map_tensors(reference.result, _on_its_way)
        wait_for_copies(call.device)
        return values

    def _judged_copy(self, t: torch.Tensor) -> torch.Tensor:
        """A kept device value as the CPU's verdict compares it: itself where the device measures it
        (``_compared_value``), else a host copy on its way (not cached: it is the tool's own)."""
        return t if self._measured_on_device(t) else _on_its_way(t)

    def _to_host(self, state: CompareState, tensors: Sequence) -> list:
        """The call's device copies brought to the host in its dtypes (exactly): it is judged on the CPU."""
        copies = _copies_to_host(state)
        return [(t, copies.host_tensor(c), False) for t, c, _ in tensors]

    def _cross_check(self, call: OpCall, state: CompareState, device_values, cpu_reference, phase: str,
                     comparisons: Sequence[Comparison]) -> None:
        """The two references of one call, compared: one that differs beyond float64 rounding, and beyond what could
        change the CPU's verdict (``comparisons``), means the device's float64 kernels for this op are wrong, and
        the op's reference runs on the CPU from now on."""
        if isinstance(cpu_reference, Reference):
            if cpu_reference.note:  # the CPU ran it narrower than float64: nothing to hold the device's to
                return
            # another right answer (an eigenvector's other sign) is no disagreement: with the CPU's choices
            device_values = adopted(call.name, cpu_reference, device_values)
            cpu_reference = cpu_reference.result
        tested = tested_dtype(state.signature[1]) if state.signature else None
        errors = [c.device_error for c in comparisons if math.isfinite(c.device_error)]
        differ = references_differ(device_values, cpu_reference, tested or torch.float32, min(errors, default=0.0))
        self.reference_place[phase, "cross-checked"] += 1
        if differ is None:
            return
        text = f"{phase}: {differ}"
        with self._lock:
            LEARNT.trust.untrusted.setdefault(call.name, text)
            self.untrusted_here.setdefault(call.name, text)
        self._logger.warning("OpAutoCompare: %s: the float64 reference on %s disagrees with the CPU's (%s); %s's "
                             "float64 kernels there are not trusted, and its reference runs on the CPU from now on",
                             call.name, call.device.type, text, call.name)

    def _compared_value(self, t: torch.Tensor, written: bool, deferred: bool = False) -> torch.Tensor:
        """What ``t`` is compared as: itself on its device when large, held in the device's own memory, and the device
        computes in float64 (only the statistics come back), unless the call is judged later (``deferred``: its copy
        is on its way); else a host copy, remembered for the next call."""
        strided(t, _NOT_COMPARED)
        if not deferred and not is_dtensor(t) and self._measured_on_device(t):
            if written:
                self._copies.forget([t])
            return t
        return self._copies.fresh(t, written=written, non_blocking=deferred)

    def _measured_on_device(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s statistics are computed where it is, against its reference uploaded: large, held in the
        device's own memory, and the device computes in float64."""
        return t.numel() >= DEVICE_STATISTICS_MIN and _in_device_memory(t) and self._float64_on(t.device)

    def _float64_on(self, device: torch.device) -> bool:
        known = LEARNT.float64.get(device.type)
        if known is None:
            try:
                known = bool((torch.ones(2, dtype=torch.float64, device=device) * 2).sum().item() == 4)
            except (RuntimeError, TypeError, NotImplementedError):  # MPS and some vendors: no float64 kernels
                known = False
            LEARNT.float64[device.type] = known
        return known

    def _attempts_of(self, name: str) -> list:
        attempts = self._attempts.get(name)
        if attempts is None:
            attempts = self._attempts[name] = attempts_for(self.settings.casts.get(op_key(name),
                                                                                   DEFAULT_REFERENCE_CAST))
        return attempts

    def _compare_forward(self, call: OpCall, state: CompareState, on_device: bool = False,
                         launched: Launched | None = None) -> tuple | None:
        """``(comparisons, reference)`` for the outputs and the written arguments, or None (reported). ``on_device``:
        the copies and the reference are on the device, and what only the CPU gives raises ``NeedsHostError``; None
        there when the device's float64 reference cannot run. ``launched``: ``state.launched``, the device's
        reference already run and its statistics read."""
        device_cpu, host_of, math = state.device_cpu, state.host_of, state.math
        assert math is not None and host_of is not None  # set by before() and after() for every call copied
        owned = state.owned
        assert owned is not None  # set with host_of
        attempts = self._attempts_of(call.name)
        if on_device:
            attempts = attempts[:1]  # the device's float64 or the CPU, never a narrower reference
        grad_snaps = state.grad_snaps = [host_of[i] for i in state.grad_ids]
        func = state.func or call.func
        reference: Reference | None
        if launched is not None:  # its reference ran when the call returned (_launch_forward)
            reference, error, rng = launched.reference, "", None
        else:
            # The reruns must leave the CPU generator as they found it: checked on an op's first call (a rerun of an
            # op whose device run drew nothing draws nothing; the device run of every call is checked in after()).
            rng = cpu_generator_token() if call.name not in LEARNT.rng_checked else None
            reference, error = run_reference(func, state.cpu_args, state.cpu_kwargs, attempts, owned, grad_snaps,
                                             keep_devices=on_device)
        if reference is None and on_device:
            state.cpu_reason = "the float64 reference cannot run on the device"
            return None
        if reference is None:
            self._copies.forget(state.written)
            state.release()
            call.grad_inputs = []
            # The call goes unchecked: the tool's failure, not the op's, reported once per op name and counted in
            # the verdict (an error under OP_TOOLS_STRICT=1).
            raise RuntimeError(f"the CPU reference cannot run: {error}")
        if on_device:
            state.device_reference = reference  # a cross-check if the CPU judges the call
        # a tie's index, an eigenvector's sign: the reference takes the device's choice where it is a right answer
        choices = adopt_choices(call.name, device_cpu, reference)
        same_cache: list = []

        def same():
            if on_device:
                raise NeedsHostError
            if not same_cache:
                run = run_same_dtype(func, state.cpu_args, state.cpu_kwargs, owned, math)
                adopt_choices(call.name, reference.result, run)
                same_cache.append(run)
            return same_cache[0]

        def same_out():
            run = same()
            return None if run is None else run.result

        signature = state.signature
        expected = LEARNT.expected_dtypes.get(signature)
        if on_device and expected != _leaf_dtypes(device_cpu):
            raise NeedsHostError  # the output dtypes a correct run gives: learnt on the CPU
        if expected is None and call.name.startswith("torch.") and \
                sum(t.numel() for t in host_of.values()) >= META_DTYPES_MIN:
            # found on meta tensors (no computation), where a same-dtype run would cost; not for a user's function,
            # which may branch on the device it is given
            expected = meta_dtypes(func, state.cpu_args, state.cpu_kwargs, math)
            if expected is not None:
                LEARNT.expected_dtypes[signature] = expected
        same_value = same_out  # run only when an error is above the floor
        if expected is None or expected != _leaf_dtypes(device_cpu):
            same_value = same_out()  # eager: compare_outputs then checks every output's dtype
            if expected is None:
                LEARNT.expected_dtypes[signature] = _leaf_dtypes(device_cpu if same_value is None else same_value)
        read = launched.stats.read() if launched is not None and launched.stats is not None else {}
        outputs = launched.outputs if launched is not None else 0
        # the call's own arguments: the bounds read their dtypes (a device path's copies are float64)
        device_args = launched.device_args if launched is not None else call.args if on_device else \
            state.cpu_args or ()
        comparisons = compare_outputs(device_cpu, reference.result, same_value, self._tolerance, op_name=call.name,
                                      prefix="output", history=LEARNT.history, key=state.precedent,
                                      site=call.module_path,
                                      bounds=_forward_bounds(call.name, func, reference, device_args,
                                                             state.math is not None and state.math.float32_sums),
                                      read={i: v for i, v in read.items() if i < outputs and i not in choices}
                                      if launched else None)
        for i, note in choices.items():
            if i < len(comparisons):
                comparisons[i].error_info = "; ".join(filter(None, (comparisons[i].error_info, note)))
        for k, (label, i, host) in enumerate(zip(state.extra_labels, state.extra, state.extra_cpu)):
            before_op = host_of[i]
            comparisons.append(compare_tensors(label, host, reference.mapped[id(before_op)],
                                               functools.partial(_written_result, same, before_op),
                                               self._tolerance, call.name, True,
                                               (LEARNT.history, (*state.precedent, label), call.module_path),
                                               stats=read.get(outputs + k, UNREAD)))
        if rng is not None:
            LEARNT.rng_checked.add(call.name)
        if rng is not None and cpu_generator_token() != rng:  # a rerun drew numbers: give them back, compare nothing
            torch.default_generator.set_state(_state_tensor(rng))
            LEARNT.drawing_reruns.add(call.name)
            self.skipped[_RERUN_DRAWS] += 1
            state.release()
            call.grad_inputs = []
            return None
        used = same_cache[0].math_used if same_cache and same_cache[0] is not None else None
        state.math_used = used
        notes = "; ".join(filter(None, (reference.note, _math_note(used))))
        if notes:
            for c in comparisons:
                c.error_info = "; ".join(filter(None, (c.error_info, notes)))
        return comparisons, reference

    def _narrow(self, call: OpCall, comparisons: list[Comparison], module: str, location: str) -> tuple[str, str]:
        """A compiled graph that failed: the first of its nodes that diverges (found once per graph), named in the
        comparisons; the module path and source line to record, the node's where one was found."""
        region = call.func.region
        if region.name not in self._narrowed:
            found: graph_reference.DivergingNode | fused_kernels.DivergingKernel | None = \
                self._narrowing(graph_reference.first_diverging_node, region.gm, call.args, self._tolerance)
            if found is None and fused_kernels.is_inductor(region.backend):
                found = self._narrowing(fused_kernels.first_diverging_kernel, region.backend, region.gm, call.args,
                                        self._tolerance)
            self._narrowed[region.name] = found
            self._logger.warning("OpAutoCompare: %s failed; %s", region.name,
                                 _in_frame_of(found, call.module_path).describe() if found else
                                 "no node's output diverges when its nodes run one by one on the device: the "
                                 "fault is in how the graph was compiled (a fused kernel), not in one op")
        found = self._narrowed[region.name]
        if found is None:
            return module, location
        found = _in_frame_of(found, call.module_path)
        for c in comparisons:
            c.error_info = "; ".join(filter(None, (found.describe(), c.error_info)))
        return found.module or module, found.location or location

    def _narrowing(self, narrow, *args):
        """``narrow(*args)``, or None with a WARNING when it fails: the graph's failure is recorded all the same."""
        try:
            return narrow(*args)
        except Exception as e:  # noqa: BLE001 - narrowing is a hint; its failure must not lose the verdict
            self._logger.warning("OpAutoCompare: narrowing a failing compiled graph down failed (%s: %s); the failure "
                                 "is reported on the graph", type(e).__name__, str(e).splitlines()[0][:200])
            return None

    def _narrow_backward(self, call: OpCall, upstream: tuple):
        """A compiled graph whose backward failed and whose forward named nothing: its first node, in the backward's
        order, whose own gradients diverge (found once per graph)."""
        region = call.func.region
        key = f"{region.name} backward"
        if key not in self._narrowed:
            found = self._narrowing(graph_reference.first_diverging_gradient, region.gm, call.state.region_args,
                                    upstream, self._tolerance)
            self._narrowed[key] = found
            self._logger.warning("OpAutoCompare: %s failed in backward; %s", region.name, found.describe() + " in "
                                 "backward" if found else "no node's gradients diverge when its nodes run one by one "
                                 "on the device: the fault is in how the backward was compiled, not in one op")
        return self._narrowed[key]

    def _versus_eager(self, call: OpCall, comparisons: list[Comparison], reference) -> None:
        """A compiled graph's forward also run eagerly on the device (``versus_eager``): each output's comparison says
        its compiled error against the eager run's, both against the float64 reference."""
        region = call.func.region
        eager = graph_reference.eager_run(region.gm, call.args)
        eager_cpu = map_tensors(eager, lambda t: t.detach().to("cpu"))
        eager_comparisons = compare_outputs(eager_cpu, reference.result, None, self._tolerance, op_name=call.name,
                                            prefix="output")
        pairs = list(zip(comparisons, eager_comparisons))
        for compiled, eager_run in pairs:
            compiled.error_info = "; ".join(filter(None, (
                f"compiled error {compiled.device_error:.3g}, eager {eager_run.device_error:.3g} "
                f"({_ratio(compiled.device_error, eager_run.device_error):.3g}x)", compiled.error_info)))
        # the graph's: its largest error compiled against its largest eager (one output's ratio is noisy: a scalar's
        # errors may cancel in one run and not in the other)
        ratio = _ratio(max((c.device_error for c, _ in pairs), default=0.0),
                       max((e.device_error for _, e in pairs), default=0.0))
        with self._lock:
            self.versus_eager[region.name] = max(ratio, self.versus_eager.get(region.name, 0.0))

    def _recheck(self, call: OpCall, state: CompareState) -> bool:
        """Re-read the inputs the cache supplied (``state.rereads``); True, with the copies replaced, when any was
        out of date (``VerdictQueue.before_write``: no call seen since wrote them). An input the call itself changed
        (a kernel using an input it does not declare written as scratch) keeps its copy: the failure stands."""
        replaced = {}
        host_of, rereads = state.host_of, state.rereads
        assert host_of is not None and rereads is not None  # set together by after()
        for i, t in rereads.items():
            host = host_of[i]
            if id(host) not in replaced:
                now = self._copies.fresh(t)
                if not _same_values(now, host):
                    replaced[id(host)] = now
        if not replaced:
            return False
        if self._wrote_its_inputs(call, state, replaced):
            return False
        for i, host in list(host_of.items()):
            if id(host) in replaced:
                host_of[i] = replaced[id(host)]
        self.stale_copies += len(replaced)
        swap = lambda h: replaced.get(id(h), h)  # noqa: E731
        state.cpu_args = map_tensors(state.cpu_args, swap)
        state.cpu_kwargs = map_tensors(state.cpu_kwargs, swap)
        state.device_cpu = map_tensors(state.device_cpu, swap)  # a result that is its input shares its copy
        return True

    def _wrote_its_inputs(self, call: OpCall, state: CompareState, replaced: dict[int, torch.Tensor]) -> bool:
        """Whether the cached inputs a failing call found changed (``replaced``: id of the cached copy -> the input
        as re-read) were changed by the call itself (``device_rerun``); counted and said once per op if so. Not
        asked where a rerun would not be the call's: a compiled graph, a replayed dropout mask, a host op."""
        if type(call.func) is RegionRun or state.func is not None or call.device.type == "cpu":
            return False
        if not device_rerun.forward_given_cached(call.func, call.device, state.cpu_args, state.cpu_kwargs,
                                                 state.host_inputs, state.device_cpu, replaced):
            return False
        self._say_written(call.name)
        return True

    def _wrote_its_upstream(self, call: OpCall, state: CompareState, cached: list, reread: list,
                            given: tuple) -> bool:
        """``_wrote_its_inputs`` for a failing backward whose cached upstream gradients were found changed:
        ``given``, the device's input gradients (one passed on unchanged as the upstream's re-read copy)."""
        if type(call.func) is RegionRun or state.func is not None or call.device.type == "cpu":
            return False
        if not device_rerun.backward_given_cached(call.func, call.device, state.cpu_args, state.cpu_kwargs,
                                                  state.host_inputs, state.owned or set(), state.grad_snaps,
                                                  _unique_tensors, cached, reread, given):
            return False
        self._say_written(call.name)
        return True

    def _say_written(self, name: str) -> None:
        with self._lock:
            self.inputs_written[name] += 1
            first = self.inputs_written[name] == 1
        if first:
            self._logger.warning("OpAutoCompare: %s changed an input it does not declare written (found when it "
                                 "failed): judged on the input as it was given", name)

    # --- backward ---

    def call_backward_skipped(self, call: OpCall, why: str) -> None:
        if why:
            self.backward_not_compared[why] += 1
        self._pending.pop(call.forward_id, None)
        if call.state.queued:  # its forward is still to be judged: that releases what it holds
            call.state.wants_backward = False
            call.release()  # the queue holds the call: not its arguments and result
            return
        call.state.release_backward()
        if not call.state.saved_forward:
            call.state.release()

    def backward_again(self, name: str) -> None:
        with self._lock:
            self.backward_runs_again[name] += 1

    def upstream_arrived(self, call: OpCall, index: int, gradient: torch.Tensor) -> None:
        """A host copy of an upstream gradient as it arrives, before the call's backward kernels read it: a kernel
        that writes it (using it as scratch) would otherwise be compared against what it wrote. A call whose
        reference ran on the device keeps a device copy instead (its gradients are compared there). Not a DTensor."""
        state: CompareState = call.state
        if is_dtensor(gradient):  # its copy is a gather, which every rank makes at the call's end as before: a
            return  # collective made in a pre-hook comes in another order on each rank (FSDP2's reduce-scatters)
        if state.device_copies is not None or state.device_reference is not None:
            if state.upstream_kept is None:
                state.upstream_kept = {}
            with torch.no_grad():
                state.upstream_kept[index] = _kept(gradient)
            return
        if state.reference is None and not state.queued:
            return
        get = self._copies.get_without_waiting if self._defers(call.device) else self._copies.get
        if state.upstream_early is None:
            state.upstream_early = {}
        state.upstream_early[index] = get(gradient)

    def after_call_backward(self, call: OpCall, upstream: tuple, input_grads: tuple, complete: bool) -> None:
        try:
            self._after_call_backward(call, upstream, input_grads, complete)
        except Exception:
            with self._lock:
                self.counts["backward not checked"] += 1  # the engine reports the error and counts the call
            raise

    def _after_call_backward(self, call: OpCall, upstream: tuple, input_grads: tuple, complete: bool) -> None:
        state: CompareState = call.state
        if not state.queued and state.reference is None:  # not compared in forward (random, released at stop())
            self._pending.pop(call.forward_id, None)
            return
        if complete and state.device_copies is None and state.device_reference is None and \
                type(call.func) is not RegionRun and self._defers(call.device):
            self._queue_backward(call, upstream, input_grads)
            return
        if complete and (state.device_copies is not None or state.device_reference is not None) and \
                type(call.func) is not RegionRun and self._defers(call.device) and \
                self._launch_backward(call, upstream, input_grads):
            return
        self._queue.flush()  # judged now: its forward and the calls queued before it first
        self._pending.pop(call.forward_id, None)
        if state.reference is None:
            return
        if not complete and all(g is None for g in input_grads):  # its nodes that ran gave no input a gradient
            self.backward_not_compared["the backward pass ran only part of the op's graph, and no input's part"] += 1
            state.release()
            return
        # Part of the graph (``autograd.grad(loss, [x])``, ``backward(inputs=[x])``: a gradient penalty's): the
        # gradients it computed are compared; those it did not ask for are None, as a complete pass leaves them.
        kept = state.upstream_kept  # the device-reference calls' upstream gradients, as they arrived
        arrived = upstream if kept is None else tuple(kept.get(i, g) for i, g in enumerate(upstream))
        verdict, device_values = self._backward_on_device(call, state, arrived, input_grads) \
            if state.device_copies is not None else (None, None)
        if verdict is not None:
            comparisons, reference_grads = verdict
            device_grads_cpu: tuple = ()
            upstream_cpu: list[torch.Tensor | None] = []
        else:
            if state.device_copies is not None:
                self._backward_to_host(call, state)
            elif self._device_reference:
                with self._lock:
                    self.reference_place["backward", state.cpu_reason] += 1
            early = state.upstream_early if kept is None else {i: (snapshot(g), False) for i, g in kept.items()}
            upstream_cpu, rereads = self._upstream_copies(upstream, self._copies.get, early)
            device_grads_cpu = self._given_copies(upstream, upstream_cpu, input_grads, False, early is not None)
            comparisons, reference_grads, upstream_cpu, device_grads_cpu = self._backward_on_host(
                call, state, upstream_cpu, rereads, device_grads_cpu)
            if device_values is not None:  # the device reference's gradients, computed before it needed the CPU
                self._cross_check(call, state, device_values, reference_grads, "backward", comparisons)
            elif state.device_reference is not None:
                self._cross_check_backward(call, state, arrived, reference_grads, comparisons)
        self._conclude_backward(call, state, comparisons, reference_grads, upstream_cpu, device_grads_cpu, upstream)

    def _queue_backward(self, call: OpCall, upstream: tuple, input_grads: tuple) -> None:
        """The backward's tensors on their way to the host, and its verdict queued behind its forward's."""
        upstream_cpu, rereads = self._upstream_copies(upstream, self._copies.get_without_waiting,
                                                      call.state.upstream_early)
        device_grads_cpu = self._given_copies(upstream, upstream_cpu, input_grads, True,
                                              call.state.upstream_early is not None)
        started = time.time()

        def judge(call: OpCall) -> None:
            state: CompareState = call.state
            self._pending.pop(call.forward_id, None)
            if state.reference is None:  # the forward was not compared after all (random, no reference)
                return
            try:
                if self._device_reference:
                    with self._lock:
                        self.reference_place["backward", state.cpu_reason] += 1
                comparisons, reference_grads, upstream_now, given_now = self._backward_on_host(
                    call, state, upstream_cpu, rereads, device_grads_cpu)
                self._conclude_backward(call, state, comparisons, reference_grads, upstream_now, given_now,
                                        started=started)
            except Exception:
                with self._lock:
                    self.counts["backward not checked"] += 1  # the engine's runner reports the error
                raise

        self._queue.put(call, judge, rereads.values())

    def _launch_backward(self, call: OpCall, upstream: tuple, input_grads: tuple) -> bool:
        """The backward of a call whose forward ran the device's reference: that reference's gradients and the
        comparison's statistics computed on the device now, and the verdict queued behind its forward's (True);
        False when its gradients do not match its outputs (judged now). A forward the CPU judged has its backward
        judged there too, cross-checked against these gradients."""
        state: CompareState = call.state
        # the device's reference graph: its forward's, still to be judged, judged on the device, or cross-checked
        reference = state.launched.reference if state.queued and state.launched is not None else \
            state.reference if state.device_copies is not None else state.device_reference
        if reference is None:
            return False
        ref_flat = _unique_tensors(reference.result)
        if len(ref_flat) != len(upstream):
            return False
        kept = state.upstream_kept or {}  # the upstream gradients as they arrived, before the backward's kernels ran
        with torch.no_grad():  # kept as they are now: the engine may add into them before the verdict reads them
            upstream = tuple(None if g is None else kept[i] if i in kept else _kept(g) for i, g in enumerate(upstream))
            input_grads = tuple(None if g is None else _kept(g) for g in input_grads)
        reference_grads = reference_backward(ref_flat, reference.leaves, upstream)
        pending = launch_stats(output_pairs(input_grads, reference_grads), self._tolerance, call.name, True)
        started = time.time()

        def judge(call: OpCall) -> None:
            self._judge_launched_backward(call, upstream, input_grads, reference_grads, pending, started)

        if pending is not None:
            self._queue.read_with(pending)
        self._queue.put(call, judge, held=sum(t.nbytes for t in iter_tensors((upstream, input_grads,
                                                                                  reference_grads))))
        return True

    def _judge_launched_backward(self, call: OpCall, upstream: tuple, input_grads: tuple, reference_grads: tuple,
                                 pending: PendingStats | None, started: float) -> None:
        """A backward launched on the device, judged there when its forward was and it passes cleanly; else on the
        CPU, from host copies of what the device judged, cross-checked against the device's gradients."""
        state: CompareState = call.state
        self._pending.pop(call.forward_id, None)
        if state.reference is None:  # the forward was not compared after all
            return
        untrusted = call.name in LEARNT.trust.untrusted  # found so since the call was launched
        try:
            if state.device_copies is not None and not untrusted:  # its forward passed on the device
                try:
                    comparisons, _ = self._compare_backward(call, state, upstream, input_grads, on_device=True,
                                                            reference_grads=reference_grads,
                                                            read=pending.read() if pending is not None else {})
                    passed = all(c.passed for c in comparisons)
                except NeedsHostError:
                    passed = False
                if passed:
                    with self._lock:
                        self.reference_place["backward", "device"] += 1
                    self._conclude_backward(call, state, comparisons, reference_grads, [], (), started=started)
                    return
            if state.device_copies is None:
                with self._lock:
                    self.reference_place["backward", state.cpu_reason] += 1
            # what the CPU judges from, on the host, the forward's own copies too where it passed on the device: one
            # wait for them all
            upstream_cpu = [None if g is None else _on_its_way(g) for g in upstream]
            grads_cpu = tuple(None if g is None else self._judged_copy(g) for g in input_grads)
            device_grads = map_tensors(reference_grads, _on_its_way)
            if state.device_copies is not None:
                self._backward_to_host(call, state, True, _UNTRUSTED if untrusted else _NEEDED_CPU)
            else:
                wait_for_copies(call.device)
            comparisons, cpu_grads, upstream_cpu, grads_cpu = self._backward_on_host(call, state, upstream_cpu, {},
                                                                                     grads_cpu)
            if not untrusted:
                self._cross_check(call, state, device_grads, cpu_grads, "backward", comparisons)
            self._conclude_backward(call, state, comparisons, cpu_grads, upstream_cpu, grads_cpu, started=started)
        except Exception:
            with self._lock:
                self.counts["backward not checked"] += 1  # the engine's runner reports the error
            raise

    @staticmethod
    def _upstream_copies(upstream: tuple, get, early: dict | None) -> tuple[list, dict[int, torch.Tensor]]:
        """Host copies of the upstream gradients, and those the cache supplied (by position): taken as each arrived,
        before the backward read it (``early``: ``upstream_arrived``), else through ``get`` now."""
        copies: list[torch.Tensor | None] = []
        reused: dict[int, torch.Tensor] = {}
        for i, g in enumerate(upstream):
            if g is None:
                copies.append(None)
                continue
            host, was_cached = early[i] if early is not None and i in early else get(g)
            copies.append(host)
            if was_cached:
                reused[i] = g
        return copies, reused

    def _given_copies(self, upstream: tuple, upstream_cpu: list, input_grads: tuple, deferred: bool,
                      early: bool = False) -> tuple:
        """What the gradients a backward gave are compared as (``_compared_value``): a gradient given twice (``add``
        passes its upstream gradient to both inputs), or one it received, is that one copy: the upstream's, made
        before the backward read it or taken from the cache (re-read with it if the call fails,
        ``_backward_on_host``). With the upstream copied before the backward read it (``early``), a backward that
        computed another gradient as well may have written the upstream it passed on (``index_add``'s backward with
        ``alpha=0``): what it passed on is then copied as it is now."""
        made = {id(g): host for g, host in zip(upstream, upstream_cpu) if g is not None}
        if early and any(g is not None and id(g) not in made for g in input_grads):
            made = {}
        copies: list[torch.Tensor | None] = []
        for g in input_grads:
            if g is None:
                copies.append(None)
                continue
            host = made.get(id(g))
            if host is None:
                host = made[id(g)] = self._compared_value(g, False, deferred)
            copies.append(host)
        return tuple(copies)

    def _conclude_backward(self, call: OpCall, state: CompareState, comparisons: list[Comparison], reference_grads,
                           upstream_cpu, device_grads_cpu, upstream: tuple = (), started: float | None = None) -> None:
        """Count, record, show and save a backward verdict; ``upstream``: the device's (a compiled graph's narrowing
        reruns its backward); ``started``: when the check started (now unless it was queued)."""
        passed = all(c.passed for c in comparisons)
        with self._lock:
            self.counts["backward compared"] += 1
            self.counts["backward passed" if passed else "backward failed"] += 1
            if passed:
                for result in _weak(comparisons):
                    self.weak_passes[call.name, "backward", result] += 1
        location, module = call.location, call.module_path
        found = self._narrowed.get(call.name) if not passed and type(call.func) is RegionRun else None
        if found is None and not passed and type(call.func) is RegionRun:
            found = self._narrow_backward(call, upstream)
        if found is not None:  # the graph's forward was narrowed to a node: the likeliest origin of its gradients'
            found = _in_frame_of(found, module)
            for c in comparisons:
                c.error_info = "; ".join(filter(None, (found.describe(), c.error_info)))
            module, location = found.module or module, found.location or location
        self._record(call.name, call.forward_id, "backward", location, comparisons, module, call.step,
                     time.time() if started is None else started)
        level = self._table_level(call.name, "backward", passed)
        if self._logger.isEnabledFor(level):
            rows = [_named_row(call.name, c) for c in comparisons]
            self._logger.log(level, reporting.header(call.name, call.forward_id, location, "backward")
                         + "\n" + reporting.call_table(call.name, rows, CONSOLE_COLUMNS))
        if not passed or state.saved_forward:  # a call saved for its forward gets its gradients too
            self._save(call.name, call.forward_id, state, state.device_out, state.ref_out,
                       grads=(device_grads_cpu, tuple(upstream_cpu), reference_grads))
        state.release()

    def _cross_check_backward(self, call: OpCall, state: CompareState, upstream: tuple, reference_grads,
                              comparisons: Sequence[Comparison]) -> None:
        reference = state.device_reference
        assert reference is not None  # only called for a call with both references
        try:
            device_values = reference_backward(_unique_tensors(reference.result), reference.leaves,
                                               tuple(None if g is None else g.detach() for g in upstream))
        except (RuntimeError, NotImplementedError, TypeError) as e:  # the verdict stands: it is the CPU's
            self._logger.info("OpAutoCompare: %s: the device's float64 backward could not run for the cross-check "
                              "(%s)", call.name, str(e).splitlines()[0][:120] if str(e) else type(e).__name__)
            return
        self._cross_check(call, state, device_values, reference_grads, "backward", comparisons)

    def _backward_on_host(self, call: OpCall, state: CompareState, upstream_cpu: list, rereads: dict,
                          device_grads_cpu: tuple) -> tuple:
        """``(comparisons, reference gradients, upstream copies, given gradients' copies)`` against the CPU reference;
        the comparison is made again with fresh copies where a cached upstream copy (``rereads``: position -> the
        gradient) was stale, a gradient the backward passed on unchanged (``_given_copies``) re-read with it."""
        comparisons, reference_grads = self._compare_backward(call, state, tuple(upstream_cpu), device_grads_cpu,
                                                              retain=bool(rereads))
        if not all(c.passed for c in comparisons) and rereads:
            now = list(upstream_cpu)
            for i, g in rereads.items():
                now[i] = self._copies.fresh(g)
            stale = sum(1 for a, b in zip(now, upstream_cpu)
                        if a is not None and b is not None and not _same_values(a, b))
            swapped = {id(old): new for old, new in zip(upstream_cpu, now) if old is not new}
            given_now = tuple(None if c is None else swapped.get(id(c), c) for c in device_grads_cpu)
            if stale and not self._wrote_its_upstream(call, state, upstream_cpu, now, given_now):
                self.stale_copies += stale
                device_grads_cpu = given_now
                upstream_cpu = now
                comparisons, reference_grads = self._compare_backward(call, state, tuple(now), device_grads_cpu)
        return comparisons, reference_grads, upstream_cpu, device_grads_cpu

    def _backward_on_device(self, call: OpCall, state: CompareState, upstream: tuple, input_grads: tuple):
        """``((comparisons, reference gradients), None)`` against the device's float64 reference graph when they
        all pass without what only the CPU gives; else ``(None, the device reference's gradients or None)``, those
        to cross-check the CPU's with (the graph is spent)."""
        upstream = tuple(None if g is None else g.detach() for g in upstream)
        reference = state.reference
        assert reference is not None  # only called for a call compared in forward
        ref_flat = _unique_tensors(reference.result)
        if len(ref_flat) != len(upstream):
            return None, None
        reference_grads = reference_backward(ref_flat, reference.leaves, upstream)
        try:
            comparisons, _ = self._compare_backward(call, state, upstream,
                                                    tuple(None if g is None else g.detach() for g in input_grads),
                                                    on_device=True, reference_grads=reference_grads)
        except NeedsHostError:
            return None, reference_grads
        if not all(c.passed for c in comparisons):
            return None, reference_grads
        with self._lock:
            self.reference_place["backward", "device"] += 1
        return (comparisons, reference_grads), None

    def _backward_to_host(self, call: OpCall, state: CompareState, together: bool = False,
                          reason: str = _NEEDED_CPU) -> None:
        """A call judged on the device in forward whose backward needs the CPU: its device copies brought to the host
        (exactly) and the CPU reference run on them; the device's kept to cross-check the gradients. ``together``:
        the copies are waited for once, with every other copy on its way."""
        device_reference = state.reference
        assert device_reference is not None and state.owned is not None
        copies = _copies_to_host(state, together)
        state.grad_snaps = [copies.host_tensor(c, together) for c in state.grad_snaps]
        state.owned = {id(h) for i, h in copies.on_host.items() if i in state.owned}
        on_host = functools.partial(map_tensors, fn=_on_its_way if together else snapshot)
        state.device_out, state.ref_out = on_host(state.device_out), on_host(state.ref_out)
        if together:
            wait_for_copies(call.device)
        reference, error = run_reference(state.func or call.func, state.cpu_args, state.cpu_kwargs,
                                         self._attempts_of(call.name), state.owned, state.grad_snaps)
        if reference is None:
            raise RuntimeError(f"the CPU reference cannot run: {error}")
        adopt_choices(call.name, device_reference.result, reference)  # the choices the forward's reference took
        state.reference, state.device_reference = reference, device_reference
        with self._lock:
            self.reference_place["backward", reason] += 1

    def _compare_backward(self, call: OpCall, state: CompareState, upstream_cpu: tuple, device_grads_cpu: tuple,
                          on_device: bool = False, reference_grads: tuple | None = None, read: dict | None = None,
                          retain: bool = False):
        """``retain``: the reference's graph is kept for a second backward (a cached upstream copy may be re-read)."""
        reference = state.reference
        assert reference is not None  # _after_call_backward returned for a call without one
        ref_flat = _unique_tensors(reference.result)
        if len(ref_flat) != len(upstream_cpu):
            return [Comparison("grad", False, False, error_info="reference outputs differ in number")], ()
        if reference_grads is None:
            reference_grads = reference_backward(ref_flat, reference.leaves, upstream_cpu, retain=retain)
        same_cache: list = []

        def same():
            if not same_cache:
                same_cache.append(self._same_dtype_backward(call, state, upstream_cpu))
            return same_cache[0]

        comparisons = compare_outputs(device_grads_cpu, reference_grads, needs_host if on_device else same,
                                      self._tolerance, op_name=call.name, prefix="grad", history=LEARNT.history,
                                      site=call.module_path,
                                      key=("backward", *state.precedent),
                                      bounds=_gradient_bounds(call.name, state, call.func, reference, ref_flat,
                                                              upstream_cpu), read=read)
        for c, label in zip(comparisons, state.grad_labels):
            c.name = f"{label}.grad"
        return comparisons, reference_grads

    def _same_dtype_backward(self, call: OpCall, state: CompareState, upstream_cpu: tuple):
        """The input gradients of a CPU run in the device's dtypes and declared math, for the same upstream."""
        math, owned = state.math, state.owned
        assert math is not None and owned is not None  # set for every call compared in forward
        run = run_same_dtype(state.func or call.func, state.cpu_args, state.cpu_kwargs, owned, math, state.grad_snaps)
        if run is None:
            return None
        if state.reference is not None:  # the choices the reference took (a tie's index, an eigenvector's sign)
            adopt_choices(call.name, state.reference.result, run)
        try:
            return reference_backward(_unique_tensors(run.result), run.leaves, upstream_cpu, math)
        except (RuntimeError, NotImplementedError, TypeError):
            return None

    # --- reporting ---

    def _record(self, name: str, forward_id: int, phase: str, location: str, comparisons: list[Comparison],
                module: str = "", step: int = 0, started: float = 0.0) -> None:
        """Keep a call's comparisons for the CSV; ``step`` is its forward's, ``started`` when it (its backward
        check, for backward) started."""
        first_line = location.splitlines()[0] if location else ""
        rows = [(name, forward_id, phase, c, first_line, module, step, started) for c in comparisons]  # at stop()
        failed = [c for c in comparisons if not c.passed]
        with self._order_lock:
            self.rows.extend(rows)
            limit = self.settings.max_cache_size
            if limit is not None and len(self.rows) > limit and not self._csv_failed:  # in order: under this lock
                try:
                    self._append_rows()
                except OSError as error:  # the rows stay held, for stop() to write (and report) as without it
                    self._csv_failed = True
                    self._logger.warning("OpAutoCompare: could not append to %s (%s: %s); its rows are written at "
                                         "stop()", self._csv_path(), type(error).__name__, error)
            if failed:
                self.failures.append({
                    "order": len(self.failures) + 1, "op": name, "phase": phase, "forward_id": forward_id,
                    "module": module, "step": step, "time": started,
                    "failing": ", ".join(c.name for c in failed),
                    "error_info": "; ".join(filter(None, (c.error_info for c in failed)))[:200],
                    "location": first_line,
                })

    def _csv_path(self) -> str:
        return result_files.results_path(self.common, self.results_folder, f"op_autocompare_info_{self.stem}.csv")

    def _csv_rows(self) -> list[dict]:
        rank = self.common.rank
        rows = [{"op": op, "forward_id": forward_id, "phase": phase, "module": module, **c.row(),
                 "location": location, **result_files.record_fields(rank, step, started)}
                for op, forward_id, phase, c, location, module, step, started in self.rows]
        return [{c: row.get(c, "") for c in CSV_COLUMNS} for row in rows]

    def _append_rows(self) -> None:
        """Append the rows held to the CSV (under ``_order_lock``); where it fails, the rows stay held."""
        if not self.rows:
            return
        size = result_files.append_csv(self._csv_path(), self._csv_rows(), CSV_COLUMNS)
        self._csv_written[0] += len(self.rows)
        self._csv_written[1] += size
        self.rows = []

    def _table_level(self, name: str, phase: str, passed: bool) -> int:
        """A call's table is DEBUG, but for the first failing call of each op and phase: WARNING (the later ones are
        in the summary and the CSV)."""
        if passed:
            return logging.DEBUG
        with self._lock:
            first = (name, phase) not in self._failures_shown
            self._failures_shown.add((name, phase))
        return logging.WARNING if first else logging.DEBUG

    def _print_forward(self, call: OpCall, reference, comparisons, location: str, passed: bool, level: int) -> None:
        arg_rows = reporting.value_rows(f"{call.name} inputs", call.args, call.kwargs)
        arg_rows += reporting.value_rows(f"{call.name} cpu_inputs", reference.args, reference.kwargs)
        rows = [_named_row(call.name, c) for c in comparisons]
        self._logger.log(level, reporting.header(call.name, call.forward_id, location)
                     + ("" if passed else "    FAIL") + "\n"
                     + reporting.call_table(call.name, arg_rows) + "\n"
                     + reporting.call_table(call.name, rows, CONSOLE_COLUMNS))

    def _save(self, name: str, forward_id: int, state: CompareState, device_out, ref_out, grads=None,
              record: dict | None = None) -> None:
        cast = self.settings.casts.get(op_key(name), DEFAULT_REFERENCE_CAST)
        self.saving.save(name, forward_id, state, cast, device_out, ref_out, grads, record)

    def finish(self) -> None:
        self._step_hook.remove()
        self._queue.flush()
        for call in list(self._pending.values()):  # calls whose backward never ran
            call.state.release()
            self.backward_not_compared["its backward had not run at stop()"] += 1
        self.saving.drain()
        self._pending = weakref.WeakValueDictionary()
        self._copies = HostCopies()
        self._queue = VerdictQueue(self._copies, self._guarded, self._queue.batch)
        text = self.summary()
        if self.saving.saved:  # the summary may shorten their folder: the listing names it whole
            self.tally.name(self.saving.folder(), "failing calls, for run_op_from_data")
        if self._csv_written[0]:  # the rest after the rows appended as the run went
            with self._order_lock:
                self._append_rows()
            rows, size = self._csv_written
            self.tally.add(self._csv_path(), size, f"{rows} comparisons")
        elif self.rows:
            path = self._csv_path()
            self.tally.add(path, result_files.write_csv(path, self._csv_rows()), f"{len(self.rows)} comparisons")
        if self.untrusted_here:  # for the run report: the device's float64 kernels this run found wrong
            path = result_files.results_path(self.common, self.results_folder, f"reference_{self.stem}.json")
            record = {"format": "op_tools reference trust", "version": 1, "rank": self.common.rank,
                      "device": next(iter(self._probes), torch.device("cpu")).type, "untrusted": self.untrusted_here}
            self.tally.add(path, result_files.write_json(path, record), "untrusted float64 kernels")
        self._logger.log(logging.WARNING if self.failures or self.not_checked() else logging.INFO, text)

    def _reference_lines(self) -> list[str]:
        """Where the float64 references ran (reference="device"/"auto"), and the ops whose device float64 kernels
        the cross-checks caught disagreeing with the CPU's."""
        lines = []
        for phase in ("forward", "backward"):
            places = collections.Counter({why: n for (p, why), n in self.reference_place.items()
                                          if p == phase and why != "cross-checked"})
            on_device = places.pop("device", 0)
            on_cpu = sum(places.values())
            why = ", ".join(f"{reason or 'on the CPU anyway'}: {n}" for reason, n in places.most_common())
            lines.append(f"float64 reference, {phase}: {on_device} calls on the device, {on_cpu} on the CPU"
                         + (f" ({why})" if why else "") + f"; {self.reference_place[phase, 'cross-checked']} "
                         "cross-checked against the CPU's")
        for name, what in LEARNT.trust.untrusted.items():
            lines.append(f"{name}: the device's float64 reference disagreed with the CPU's ({what}); its reference "
                         "runs on the CPU")
        return lines

    def closing_line(self) -> str:
        line = super().closing_line()
        if not self._device_reference:
            return line
        on_device = sum(n for (_, why), n in self.reference_place.items() if why == "device")
        total = sum(n for (_, why), n in self.reference_place.items() if why != "cross-checked")
        untrusted = LEARNT.trust.untrusted
        return (f"{line}; float64 reference on the device for {on_device} of {total} comparisons"
                + (f", its float64 kernels untrusted for {len(untrusted)} op{'s' if len(untrusted) != 1 else ''} "
                   f"({', '.join(untrusted)}: on the CPU)" if untrusted else ""))

    def found(self) -> str:
        ops = len({f["op"] for f in self.failures})
        return f"{ops} op{'s' if ops != 1 else ''} failed" if ops else ""

    def unchecked_parts(self) -> list[str]:
        parts = []
        if self.unfollowed_functions:
            names = ", ".join(self.unfollowed_functions)
            hint = "; torch.utils.checkpoint(..., use_reentrant=False) is compared" \
                if "CheckpointFunction" in self.unfollowed_functions else ""
            parts.append(f"the backward of custom autograd.Functions not compared ({names}: its ops run where no tool "
                         f"sees them; {sum(self.unfollowed_functions.values())} calls read their results{hint})")
        again = sum(self.backward_runs_again.values())
        if again:
            parts.append(f"{again} backward run{'s' if again != 1 else ''} of calls again over a retained graph "
                         f"(retain_graph=True) not compared, the first {next(iter(self.backward_runs_again))}")
        unaccounted = self._forward_unaccounted()
        if unaccounted:
            parts.append(f"{unaccounted} calls ended with no verdict (an OpAutoCompare bug: please report it)")
        lost = self.saving.lost()
        if lost:
            parts.append(lost)
        return parts

    def _forward_unaccounted(self) -> int:
        """Handled calls that ended as none of compared, skipped, not checked, raised or cut short by SIGTERM: 0 unless
        a path forgot one."""
        c = self.counts
        return max(0, sum(self.handled.values()) - c["forward compared"] - sum(self.skipped.values())
                   - c["forward not checked"] - self.waits_not_checked() - sum(self.raised.values())
                   - sum(self.interrupted.values()))

    def summary(self) -> str:
        """The end-of-run account: every handled call compared (passed or failed), skipped (why), not checked (the
        tool failed) or raised by the op itself; the device's declared math; the failing ops in order. Its last line
        says "no op failed" only when every handled call was compared or skipped with a reason."""
        c = self.counts
        raised = sum(self.raised.values())
        unwaited = self.waits_not_checked()  # asynchronous collectives whose wait never came: counted not checked
        fit = reporting.fit_line  # its lines wrapped at the console's width; the table fits it by itself
        lines = ["", fit(f"OpAutoCompare summary: forward {c['forward compared']} compared, {c['forward passed']} "
                         f"passed, {c['forward failed']} failed, {c['forward not checked'] + unwaited} not checked; "
                         "backward "
                         f"{c['backward compared']} compared, {c['backward passed']} passed, {c['backward failed']} "
                         f"failed, {c['backward not checked']} not checked; {sum(self.skipped.values())} skipped"
                         + (f"; {raised} raised by the op itself" if raised else ""))]
        if self.skipped:
            lines.append(fit("skipped: " + ", ".join(f"{reason}: {n}" for reason, n in self.skipped.most_common())))
        if self.backward_not_compared:
            lines.append(fit("backward not compared: " + ", ".join(
                f"{reason}: {n}" for reason, n in self.backward_not_compared.most_common())))
        if self.device_math:
            lines.append(fit("device math replayed by the same-dtype reference where the op used it: " + ", ".join(
                f"{described} ({n} call{'s' if n != 1 else ''})" for described, n in self.device_math.most_common())))
        if self._device_reference:
            lines.extend(fit(line) for line in self._reference_lines())
        if self.versus_eager:
            worse = {name: r for name, r in self.versus_eager.items() if r > VERSUS_EAGER_WORSE}
            name, ratio = max(self.versus_eager.items(), key=lambda item: item[1])
            lines.append(fit(f"compiled against eager in the device's dtype: {len(self.versus_eager)} graphs, "
                             f"compiled errs more than {VERSUS_EAGER_WORSE:g}x eager in {len(worse)}"
                             + (f" (the most: {name}, {ratio:.3g}x)" if worse else "")))
        if self.saving.saved:
            lines.append(self.saving.summary_line())
        if self.stale_copies:
            lines.append(fit(f"{self.stale_copies} cached input copies were out of date (written by something no "
                             "call showed) and were re-read before the verdict"))
        if self.inputs_written:
            lines.append(fit(f"{sum(self.inputs_written.values())} failing calls changed an input they do not declare "
                             "written (" + ", ".join(f"{op}: {n}" for op, n in self.inputs_written.most_common())
                             + "): judged on the inputs they were given"))
        if self.weak_passes:
            lines.append(fit(f"{sum(self.weak_passes.values())} results passed within a correct run's own error of "
                             f"{WEAK_PASS:g} or more of their scale, where a fault that size passes too: " + ", ".join(
                                 f"{op} ({phase}) {result}: {n}"
                                 for (op, phase, result), n in self.weak_passes.most_common(5))))
        if self.failures:
            lines.append("failing ops in execution order (the first is where to look):")
            shown = [{**f, "location": reporting.short_location(f["location"])} for f in self.failures[:FAILURES_SHOWN]]
            lines.append(reporting.table_text(shown, ("order", "op", "phase", "module", "forward_id",
                                                                               "failing", "error_info", "location"),
                                              keep="op"))
            if len(self.failures) > FAILURES_SHOWN:
                lines.append(f"{len(self.failures) - FAILURES_SHOWN} more failures in the CSV")
        problem = self.not_checked()
        if problem:
            lines.append(fit(f"NOT CHECKED: {problem}"))
        if not self.failures:
            if not c["forward compared"] and not c["backward compared"]:
                lines.append("no call was compared")
            elif problem:
                lines.append("no failure among the calls compared; not every call was checked (above)")
            else:
                lines.append("no op failed")
        return "\n".join(lines)


def _weak(comparisons: list[Comparison]) -> list[str]:
    """The results of a passing call that passed within a correct run's error of ``WEAK_PASS`` or more."""
    return [c.name for c in comparisons if c.weak]


def _device_reason(call: OpCall, state: CompareState, settings: AutoCompareConfig) -> str | None:
    """Why this call's reference runs on the CPU although the device's was asked for ('' when it ran on the CPU
    anyway), or None: on the device."""
    if call.device.type == "cpu":
        return ""
    if type(call.func) is RegionRun:
        return "a compiled graph"
    if state.replay is not None:
        return "attention with its dropout mask replayed"
    name = call.name
    if name in LEARNT.trust.untrusted:
        return _UNTRUSTED
    if name not in LEARNT.rng_checked:
        return "its first call"  # where the reruns are seen to leave the random streams alone
    if op_key(name) in settings.casts:
        return "a reference cast is set for it"
    return None  # a DTensor argument is found as the arguments are copied (device_reference.NotCopiedError)


def _written_result(same, before_op: torch.Tensor):
    """What the same-dtype run wrote into its copy of an argument (None without a same-dtype run)."""
    run = same()
    return None if run is None else run.mapped.get(id(before_op))


def _math_note(used: DeviceMath | None) -> str:
    """Said when the same-dtype reference the verdict used computed some of the device's reduced precision."""
    return f"reference replays the device's {used.describe()}" if used is not None and used.reduced else ""


def _state_tensor(token: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(token), dtype=torch.uint8)


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return False


_NOT_COMPARED = "are not compared"  # a sparse tensor's call (its comparison would need its values matched by index)


def _fresh_copy(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    return snapshot(t), False


def _in_device_memory(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage is device memory (a GPU's), not host memory seen through a device (sim's)."""
    try:
        return t.untyped_storage().device.type != "cpu"
    except (RuntimeError, NotImplementedError, TypeError):
        return True


def _ratio(compiled: float, eager: float) -> float:
    if math.isnan(compiled) or math.isnan(eager):
        return math.nan
    return compiled / eager if eager > 0 else (math.inf if compiled > 0 else 1.0)


def _leaf_dtypes(result) -> tuple:
    if isinstance(result, torch.Tensor):  # most ops: no walk
        return (result.dtype,)
    return tuple(t.dtype for t in iter_tensors(result))


def _named_row(op: str, comparison: Comparison) -> dict:
    row = comparison.row()
    row["name"] = f"{op} {row['name']}"
    return row


# The most roundings in one term of a ``broadcast_sums`` op's broadcast gradient: addcdiv's divisor's,
# ``-g value t1 / (t2 t2)`` (a selection's, ``where``'s or ``maximum``'s, has none; a product's, one).
_TERM_ROUNDINGS = 4


def _masked_fill_terms(input, mask, value):  # noqa: A002 - masked_fill's own argument names
    return torch.where(mask, value, input)


# Ops that refuse their broadcast input expanded (masked_fill's value must be 0-d): the function computing the same
# terms that ``broadcast_terms`` reruns instead (its arguments named as the op's).
_TERMS_AS = {name: _masked_fill_terms for name in ("torch.Tensor.masked_fill", "torch.Tensor.masked_fill_",
                                                     "torch.masked_fill")}


def _broadcast_sums(name: str, func, reference: Reference, outputs: list[torch.Tensor], upstream: tuple):
    """For an op whose gradient for a broadcast input is a sum over the broadcast elements (``broadcast_sums``):
    ``bounds(i)``, the ``AnyOrderSum`` of leaf ``i`` when it was broadcast (fewer elements than the outputs, all of
    one shape), else None; the terms' magnitudes from one more float64 run, made only for a leaf about to fail. None
    for other ops."""
    if not op_facts(name).broadcast_sums or not outputs or any(o.shape != outputs[0].shape for o in outputs):
        return None
    shape = outputs[0].shape
    terms = _once(lambda: broadcast_terms(_TERMS_AS.get(name, func), reference, upstream, shape))

    def bounds(i: int):
        leaf = reference.leaves[i] if i < len(reference.leaves) else None
        if leaf is None or not 0 < leaf.numel() < shape.numel():
            return None
        summed = terms()
        if summed is None or summed[i] is None:
            return None
        magnitudes, n = summed[i]
        return AnyOrderSum(magnitudes, n, _TERM_ROUNDINGS, terms_rounded=True)

    return bounds


_SETTINGS = frozenset({int, bool, str, type(None), torch.dtype})  # arguments that say what an op computes


def _setting(value):
    """A plain argument as its signature keeps it: itself, a tuple for a list of ints (dimensions), else None."""
    if type(value) in _SETTINGS:
        return value
    if type(value) in (list, tuple) and all(type(v) is int for v in value):
        return tuple(value)
    return None


def _settings_of(args: tuple, kwargs: dict) -> tuple:
    """What a call's plain arguments say it computes (a dimension, a flag, a mode), for its signature's precedent: a
    product over one dimension and over all elements of the same shape are different computations, and the first's
    error once excused a fault of 10% in the second. Floats are left out: a scale changes values, not the
    computation, and an optimizer's learning rate would make every step's calls a new signature."""
    settings = tuple(map(_setting, args))
    return (settings, tuple((k, _setting(v)) for k, v in kwargs.items())) if kwargs else settings


def _gradient_bounds(name: str, state: CompareState, func, reference: Reference, outputs: list[torch.Tensor],
                     upstream: tuple):
    """``bounds(i)`` of a call's gradients: ``_broadcast_sums``' for a ``broadcast_sums`` op; for an ``index_sums``
    op on a device whose kernel sums in float32 (``DeviceMath.float32_sums``), its floating leaf's ``AnyOrderSum``
    (one rounding a term: a division by its index's count at most), from one more float64 run made only when the
    verdict asks; None for other ops."""
    func = state.func or func
    if not (state.math is not None and state.math.float32_sums and op_facts(name).index_sums):
        return _broadcast_sums(name, func, reference, outputs, upstream)
    terms = _once(lambda: index_sum_terms(func, reference, upstream))

    def bounds(i: int):
        summed = terms()
        if summed is None or i >= len(summed) or summed[i] is None:
            return None
        magnitudes, n = summed[i]
        return AnyOrderSum(magnitudes, n, term_roundings=1)

    return bounds


def _forward_bounds(name: str, func, reference: Reference, device_args: tuple, float32_sums: bool = False):
    """``bounds(0)``, the rounding bound of the one result of an op whose algorithm bounds it (``op_facts``'
    ``sums_elements``: an ``AnyOrderSum``; ``attention_rounding``: an ``AttentionRounding``; ``rounded_terms``: a
    ``RoundedTerms``; ``accumulates_when``, set, on a device that sums in float32 (``float32_sums``): an
    ``AnyOrderSum``), from one more float64 run made only when the verdict asks; None for other ops.
    ``device_args``: the call's arguments in the device's dtypes."""
    facts = op_facts(name)
    if facts.accumulates_when is not None:
        if not float32_sums or not flag_holds(reference.args, reference.kwargs, facts.accumulates_when):
            return None
        accumulated = _once(lambda: accumulated_terms(func, reference))

        def accumulation(i: int):
            terms = accumulated() if i == 0 else None
            return None if terms is None else AnyOrderSum(terms[0], terms[1], term_roundings=0)

        return accumulation
    if facts.attention_rounding:
        rerun = _once(lambda: attention_rounding(func, reference.args, reference.kwargs))
        return lambda i: rerun() if i == 0 else None
    if facts.rounded_terms:
        terms = _once(lambda: rounded_terms(device_args, reference.args, reference.kwargs))
        return lambda i: terms() if i == 0 else None
    if not facts.sums_elements:
        return None
    source = next(iter_tensors(reference.args), None)
    magnitudes_of = _once(lambda: magnitudes_forward(func, reference))

    def bounds(i: int):
        if i != 0 or source is None:
            return None
        magnitudes = magnitudes_of()
        if not isinstance(magnitudes, torch.Tensor) or not magnitudes.numel() or source.numel() < magnitudes.numel():
            return None
        return AnyOrderSum(magnitudes.abs(), max(1, source.numel() // magnitudes.numel()))

    return bounds


def _copies_to_host(state: CompareState, non_blocking: bool = False) -> DeviceCopies:
    """The call's arguments on the host from its device copies (exactly, in its dtypes): the CPU judges it from now
    on; the copies returned (their host copies are theirs, ``on_host``). ``non_blocking``: read after a wait."""
    copies = state.device_copies
    assert copies is not None  # only for a call copied on the device
    state.device_copies = None
    state.cpu_args = copies.host(state.cpu_args, non_blocking)
    state.cpu_kwargs = copies.host(state.cpu_kwargs, non_blocking)
    return copies


def _kept(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


def _on_its_way(t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t`` not waited for: read after ``wait_for_copies``."""
    return snapshot(t, non_blocking=True)


def _dtypes_only(args: tuple) -> tuple:
    """``args`` with each tensor an empty one of its dtype on the meta device: what a bound reads of the call's own
    arguments, without holding them."""
    return map_tensors(args, lambda t: torch.empty(0, dtype=t.dtype, device="meta"))


def _once(rerun):
    """``rerun()`` on the first call, kept; None when it raised (no such rerun: the usual verdict stands)."""
    kept: list = []

    def get():
        if not kept:
            try:
                kept.append(rerun())
            except (RuntimeError, NotImplementedError, TypeError):
                kept.append(None)
        return kept[0]

    return get


def _unique_tensors(result) -> list[torch.Tensor]:
    """The tensors of ``result``, each once, in order."""
    if isinstance(result, torch.Tensor):  # most ops: no walk
        return [result]
    seen, out = set(), []
    for t in iter_tensors(result):
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def labelled_tensors(args, kwargs):
    """``("input[0]", tensor)``, ``("input[1][0]", ...)``, ``("input[weight]", ...)``: every tensor argument."""
    for key, value in itertools.chain(enumerate(args), kwargs.items()):
        if isinstance(value, torch.Tensor):  # most arguments: no walk
            yield f"input[{key}]", value
        else:
            for path, v in iter_items(value, f"[{key}]"):
                if isinstance(v, torch.Tensor):
                    yield f"input{path}", v


def _labels_of(args, kwargs, tensors: list) -> list[str]:
    if not tensors:
        return []
    wanted = {id(t) for t in tensors}
    found: dict[int, str] = {}
    for label, t in labelled_tensors(args, kwargs):
        if id(t) in wanted:
            found.setdefault(id(t), f"written {label}")
    return [found.get(id(t), "written input") for t in tensors]
