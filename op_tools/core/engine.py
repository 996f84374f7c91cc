"""The one engine behind every tool: a TorchFunctionMode that names each call and hands it to a tool.

A tool is a small subclass of ``OpTool`` that says only what is different about it::

    class OpCountAdds(OpTool):
        hook_name = "OpCountAddsHook"
        env_prefix = "OP_COUNT_ADDS"          # reads OP_COUNT_ADDS_LIST / OP_COUNT_ADDS_DISABLE_LIST
        results_folder = "op_count_adds_results"

        def after(self, call):                # also: before, run, before_backward, after_backward
            ...

Per call the engine does, for a tool that handles it::

    before(call)                  # in tool work: may replace call.args / call.kwargs, fill call.state, and list
                                  # in call.grad_inputs the inputs whose gradients after_call_backward wants
    call.result = run(call)       # the op itself (default: call.func(*call.args, **call.kwargs)); run() may call
                                  # run_inside(call) to have the torch calls a Python composite makes handled too
    after(call)                   # in tool work: may replace call.result
    # if the tool defines before_backward / after_backward: autograd hooks on the outputs' grad_fn nodes
    before_backward(call, grad_outputs)               # upstream gradients, before the node runs
    after_backward(call, grad_inputs, grad_outputs)   # gradients of the node's inputs, after it ran
    upstream_arrived(call, index, gradient)           # if defined: each upstream gradient, before its node runs
    # if it defines after_call_backward: once every node the call created ran (call_backward.py)
    after_call_backward(call, upstream, input_grads, complete)

"Tool work" is per thread: torch calls made by a tool itself are never handled by any tool. A
failure inside a tool is logged once per (tool, op) and the op goes on unchanged, unless
``OP_TOOLS_STRICT=1``; an exception raised by the op itself propagates as it is.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import functools
import itertools
import json
import logging
import os
import signal
import sys
import threading
import time
import types
from typing import Any, Callable, ClassVar

import torch
from torch._C import _are_functorch_transforms_active as _transforms_active
from torch._C._autograd import _get_sequence_nr as _sequence_nr
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils._device import DeviceContext

from ..config import typo_check
from ..config.settings import origin, signature_of, sources_for, validate_arguments
from ..config.tool_registry import FEATURES, feature  # noqa: F401  # op_tools.core.engine.FEATURES / feature, as before
from ..config.variables import CommonConfig, OpFilter, Sources, changed_since, recorded_reads
from ..ops import torch_versions
from ..ops.arguments import UnsupportedInputError, call_device, in_transform, iter_tensors
from ..ops.collectives import collective_call, unseen_collectives
from ..ops.naming import has_twin, is_metadata_query, resolve_op_name
from ..ops.writes import call_writes
from ..output import reporting, result_files
from . import collective_waits, compiled_regions, fast_paths, gradient_communication, module_path, one_hop, targeting
from .call_backward import CallBackward
from .replicas import REPLICAS
from .steps import STEPS


class _ThreadState(threading.local):
    depth = 0  # > 0 while this thread does a tool's own work; a class default, read per call without a miss
    hidden: list | None = None  # the torch-function switches that tool work turned off (_hide), innermost last


# Torch-function modes under the tools' own (a user's, pushed before a tool started): a tool's own torch calls would
# reach them, and a mode that logs, counts or changes calls would see thousands a step that the program never made.
# Inside a mode's __torch_function__ the stack holds the modes under it only; the common case has none.
_modes_below = torch._C._len_torch_function_stack


def _hide() -> Any:
    """Torch-function handling off until ``_unhide``: tool work where ``_modes_below()``."""
    switch = torch._C.DisableTorchFunction()
    switch.__enter__()
    return switch


def _unhide(switch: Any) -> None:
    switch.__exit__(None, None, None)


def _hidden(work, *args):
    """``work(*args)`` with torch-function handling off: its reads of tensors' devices are the engine's, no
    program's."""
    with torch._C.DisableTorchFunction():
        return work(*args)


_thread = _ThreadState()
_forward_ids = itertools.count(1)
_announced: dict[tuple[str, str, bool], None] = {}  # (hook, op, decision): a later opposite decision is announced
_reported_failures: dict[tuple[str, str], None] = {}
_announce_lock = threading.Lock()
_unseen_said = False


def _say_unseen_collectives(logger: logging.Logger, only_if_distributed: bool = False) -> None:
    """Once per process, at the first collective a tool handles, or where a process group is up when a tool starts
    or stops (``only_if_distributed``: a torch whose collectives dispatch none, 2.4's, has no first collective):
    those of this torch that no tool sees."""
    global _unseen_said
    if _unseen_said:
        return
    if only_if_distributed and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    _unseen_said = True
    unseen = unseen_collectives()
    if unseen:
        logger.warning("torch %s: %s dispatch no __torch_function__, so no tool sees them: they are neither checked "
                       "nor counted (torch 2.13 dispatches every one)", torch.__version__,
                       ", ".join(unseen))


_CPU = torch.device("cpu")
_BACKWARD_CALLS = frozenset({"torch.Tensor.backward", "torch.autograd.backward", "torch.autograd.grad"})
_is_compiling = torch_versions.is_compiling  # True while dynamo traces (compiled_regions.py keeps that rare)
# Dynamo's frame hook (what torch._dynamo.disable turns off), where this torch has one.
_set_eval_frame = getattr(getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None), "set_eval_frame", None)


class RegionRun:
    """The function of a compiled graph's call (``OpTool.check_region``): the graph run compiled, its inner calls
    (an ``aot_eager`` graph's aten ops) as tool work."""

    __slots__ = ("region",)

    def __init__(self, region: compiled_regions.Region) -> None:
        self.region = region

    def __call__(self, *args):
        _thread.depth += 1
        try:
            return self.region.run_compiled(*args)
        finally:
            _thread.depth -= 1


class OpToolsAbortError(RuntimeError):
    """Raised by a tool on purpose (e.g. OP_OVERFLOW_CHECK_RAISE=1): propagates, never swallowed."""


def in_tool_work() -> bool:
    return _thread.depth > 0


compiled_regions.in_tool_work = in_tool_work


class _ToolWork(contextlib.ContextDecorator):
    """What ``tool_work()`` returns: a class rather than a generator, as it is entered several times per handled
    call (a generator-based context manager costs a few µs each time). Reentrant: what each entry turned off is kept
    per thread, and turned back on by its exit."""

    def __enter__(self) -> None:
        _thread.depth += 1
        hidden = _thread.hidden
        if hidden is None:
            hidden = _thread.hidden = []
        hidden.append(_hide() if _modes_below() else None)

    def __exit__(self, *exc) -> None:
        _thread.depth -= 1
        switch = _thread.hidden.pop()  # type: ignore[union-attr]  # what its entry turned off: a block that started
        if switch is not None:  # or stopped a tool changed the modes under it since
            _unhide(switch)


_TOOL_WORK = _ToolWork()


def tool_work() -> _ToolWork:
    """Mark this thread as doing a tool's own work: no tool handles the torch calls made inside."""
    return _TOOL_WORK


# Functions named as metadata queries (the same for every tool): the mode's second fast path.
_query_functions: set = set()


def _run_query(func, args: tuple, kwargs: dict):
    """A metadata query runs as tool work: torch calls inside it (formatting in ``__repr__``) are not user ops.

    ``tool_work()`` inlined: queries are about a third of a training step's calls.
    """
    _thread.depth += 1
    try:
        return func(*args, **kwargs)
    finally:
        _thread.depth -= 1


class OpCall:
    """One handled call: what the tool sees. ``state`` is the tool's scratch space, kept for backward."""

    __slots__ = ("name", "func", "runs", "args", "kwargs", "result", "forward_id", "device", "state", "_site",
                 "_full_stack", "first_node", "grad_inputs", "module_path", "unchecked", "step", "time",
                 "__weakref__")

    def __init__(self, name: str, func, args: tuple, kwargs: dict, device: torch.device | None,
                 full_stack: bool = False) -> None:
        self.name = name
        # ``func``: the torch function, which a tool reruns (a reference, a meta run) and names; ``runs``: what runs
        # the call itself (``OpTool.run``), another tool's run of it where that tool runs it in the device's place
        # (``_Beneath``), which must not take the tools' own reruns for the call's
        if type(func) is _Beneath:
            self.func, self.runs = func.op, func
        else:
            self.func = self.runs = func
        self.args = args
        self.kwargs = kwargs
        self.result: Any = None
        self.forward_id = next(_forward_ids)
        self.device: torch.device = device  # type: ignore[assignment]  # None only in the engine's stand-in calls
        self.state: Any = {}  # a dict, or the tool's own typed object (OpAutoCompare's CompareState)
        self._site: reporting.Site | None = None  # where the call came from: taken on first use, formatted when shown
        self._full_stack = full_stack
        self.first_node = -1  # autograd sequence number before the call: its nodes are numbered from here
        self.grad_inputs: list[torch.Tensor] = []  # filled by before(): the inputs after_call_backward reports on
        # The module running the call (module_path.py): "model.layers.1.mlp.down_proj"; "" outside any module or
        # when no started tool tracks modules.
        self.module_path = module_path.current()
        self.unchecked = False  # a step of the tool failed on this call: counted once in OpTool.unchecked
        # What every record of the call carries (docs/tools/README.md#ranks-steps-and-times): the optimizer steps
        # finished since the tool started (set by OpTool.handle, steps.py) and the wall-clock time it started.
        self.step = 0
        self.time = time.time()

    @property
    def location(self) -> str:
        """The user's source line (the whole user stack with OP_TOOLS_PRINT_STACK=1), found on first use."""
        return self.keep_location().text()

    def keep_location(self) -> reporting.Site:
        """Where the call came from, taken now if not yet (while the user's frames are on the stack: before a
        backward hook needs it) and formatted only when shown (``Site.text()``)."""
        if self._site is None:
            self._site = reporting.user_site(self._full_stack)
        return self._site

    def release(self) -> None:
        """Drop the arguments and results so that a pending backward hook does not keep them alive (another tool's run
        of the call holds that tool's call, with its own)."""
        self.args, self.kwargs, self.result, self.runs = (), {}, None, self.func

    def without_values(self) -> OpCall:
        """A copy without the arguments and results (the same state), for a tool that keeps the call past its return:
        the engine still reads this one's result, and a result held on (a view keeps its base) is visible to the
        program (``torch.utils.swap_tensors``, which ``Module.to`` uses, refuses a tensor with a view alive)."""
        copy = OpCall.__new__(OpCall)
        for name in _CALL_FIELDS:
            setattr(copy, name, getattr(self, name))
        copy.args, copy.kwargs, copy.result, copy.runs = (), {}, None, self.func  # another tool's run holds its call
        return copy


_CALL_FIELDS = tuple(name for name in OpCall.__slots__ if name != "__weakref__")


class _ToolMode(TorchFunctionMode):
    def __init__(self, tool: OpTool) -> None:
        super().__init__()
        self.tool = tool
        # Whether compiled_regions hands this mode each compiled graph's run (check_region). A bool: dynamo guards
        # on what it reads here, and a value equal for every tool compiles a frame once for all of them.
        self.checks_regions = tool.checks_regions

    def check_region(self, region: compiled_regions.Region, args: tuple):
        return self.tool.check_region(region, args)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # The common case first: a function this tool already decided to skip runs as it is, whatever its
        # arguments (the decision depends on the name only, and the name on the function only).
        try:
            skipped = func in self.tool._skipped
            query = not skipped and func in _query_functions
        except TypeError:  # an unhashable callable: the full path names it
            skipped = query = False
        if skipped:
            return func(*args, **(kwargs or {}))
        if query:
            return _run_query(func, args, kwargs or {})
        return self.tool.handle(func, args, kwargs or {})


class _RegionCheckingMode(_ToolMode):
    """The mode of a tool that keeps compiled code compiled (``checks_regions``): dynamo traces under it, and its
    calls from the compiled code's eager parts (after a graph break) run under dynamo's frame hook, which would
    compile the tool's own functions as the program's (failing, or slowly): the tool works with the hook off."""

    def check_region(self, region: compiled_regions.Region, args: tuple):
        return _outside_dynamo(self.tool.check_region, region, args)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if _is_compiling():
            # dynamo traces the user's code under this mode: the graph gets the call as it is (the compiled graph is
            # checked whole when it runs, compiled_regions.py)
            return func(*args, **(kwargs or {}))
        return _outside_dynamo(super().__torch_function__, func, types, args, kwargs)


# Called from a compiled model's code that dynamo gave up on (run eagerly under its frame hook), the modes'
# __torch_function__ was compiled as a frame of its own, traced down its "dynamo traces" branch: the tool saw no call
# from there on. Never compiled as frames (dynamo still inlines them where it traces under the mode).
compiled_regions.frame_skipped_hooks += [_ToolMode.__torch_function__, _RegionCheckingMode.__torch_function__]


def _outside_dynamo(work, *args):
    """``work(*args)`` with dynamo's frame hook off: the tool's own Python is never compiled (as sim's kernels)."""
    if _set_eval_frame is None:
        return work(*args)
    prior = _set_eval_frame(None)
    try:
        return work(*args)
    finally:
        _set_eval_frame(prior)


def _outside_compiled_code(method):
    """``method`` run by dynamo as a call it does not trace (a graph break), with its frame hook off: a tool started or
    stopped inside a compiled function (dynamo traced start() into torch.compiler.set_stance, a callable it forbids,
    and the compilation failed)."""
    @functools.wraps(method)
    def outside(*args):
        return _outside_dynamo(method, *args)

    outside._torchdynamo_disable = True  # what torch.compiler.disable marks
    return outside


class OpTool:
    """Base of every tool. Use as ``with Tool():`` or ``tool.start()`` … ``tool.stop()`` (``end()`` too)."""

    hook_name: ClassVar[str] = "OpToolHook"       # the name in `apply <hook_name> on <op>` lines
    env_prefix: ClassVar[str] = ""                # OP_<TOOL>: its _LIST / _DISABLE_LIST variables
    results_folder: ClassVar[str] = ""            # subfolder of OP_TOOLS_RESULTS_DIR
    feature: ClassVar[str] = ""                   # name for apply_feature (set by @feature)
    # The tool's own keyword arguments: keyword -> the EnvVar (or settings.Family) it stands for. Every tool also
    # takes ops, disable (its LIST and DISABLE_LIST), results_dir, verbose, print_stack and strict (settings.py).
    keywords: ClassVar[dict] = {}

    # Whether calls carry the path of the module running them (OpCall.module_path): the global module hooks of
    # module_path.py are installed while such a tool is started.
    tracks_modules: ClassVar[bool] = False

    # where its messages go: op_tools.<module> (op_tools.autocompare), set for each subclass; a class attribute, so
    # that a subclass may use any attribute name of its own
    _logger: ClassVar[logging.Logger] = logging.getLogger("op_tools")

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls._logger = reporting.tool_logger(cls)  # type: ignore[arg-type]  # classes are hashable
        if "__init__" not in vars(cls):  # a subclass with its own constructor shows its own signature
            cls.__signature__ = signature_of(cls)  # type: ignore[attr-defined]  # what inspect.signature reads

    def __init__(self, **settings) -> None:
        """``settings``: the keyword arguments of the tool's docstring, each overriding its variable; validated now
        (TypeError for an unknown keyword, ValueError/TypeError naming a malformed value and its expected form)."""
        self.arguments = validate_arguments(type(self), settings)  # variable name -> parsed value
        self.sources: Sources | None = None  # arguments and config file, gathered at start()
        # Typed as read by start(), before any call is handled, so that the per-call path reads them unchecked
        self.common: CommonConfig = None  # type: ignore[assignment]  # None until start()
        self.filter: OpFilter = None  # type: ignore[assignment]  # None until start()
        self._activations: list = []  # per start(): its _ToolMode, or its Targeting (a LIST of plain names)
        self._threads: list[int] = []  # per start(): the thread it started on
        self._decisions: dict[str, bool] = {}
        self._refused: set[str] = set()  # names the LIST selects that the tool does not handle (``accepts``)
        self._disabled: set[str] = set()  # names of calls met that the DISABLE_LIST excluded
        self._skipped: set = set()  # functions whose name this tool skips: the mode's fast path
        self._lock = threading.Lock()
        self._open_backwards: set = set()  # CallBackward trackers whose hooks started and did not finish
        self._tracking: list[bool] = []  # per start(): whether it acquired the module hooks (module_path.py)
        self._can_match = True  # whether the LIST of the latest start() can match a call
        self._step_base = 0  # steps.STEPS.count at start(): a call's step is counted from there
        # True while a mode shows this tool every torch call of its thread (not with targeted wrappers or
        # apply_feature, which see only the functions they wrap: writes elsewhere go unseen)
        self.sees_every_call = False
        self.stem = ""  # pid<pid>_<time>_<n>: this session's file names (result_files.session_stem)
        self._running_markers: list[str] = []  # ``running_<stem>.json`` of each session not yet ended (write_unchecked)
        # Set by configure() to handle calls whose tensors are all on the CPU too (by default the CPU is the
        # reference and its calls run untouched); such calls get device cpu.
        self.handles_cpu_calls = False
        # Set by configure() to keep torch.compile'd code compiled and have each compiled graph's runs handled as
        # calls (compiled_regions.py); otherwise compiled code runs eagerly while the tool is active.
        self.checks_regions = False
        # Set by configure() when the tool chose its LIST itself (the user set none): no call matching it is no
        # user's LIST matching nothing.
        self.default_list = False
        self._hooks_backward = False  # wants_backward(), read at start()
        # A tool may pause its handling until a time (``pause_until``): its calls then run untouched, at the cost of a
        # comparison (the engine's own work per handled call is tens of µs on a fast device), except those named in
        # ``unpausable`` (calls every rank must see alike: collectives).
        self._paused_until = 0.0
        self.paused_calls = 0
        self.unpausable: frozenset = frozenset()
        # (op name, module path) pairs whose calls the tool has no work for now (OpSelfCheck: every site of theirs had
        # its turn this round): they run untouched as paused calls do, while ``settled_skips`` (counted down per
        # call skipped so) lasts; the tool renews it whenever it finds work, so that a pair it waits for in vain
        # hands its calls back to the tool.
        self.settled: set = set()
        self.settled_skips = 0
        self._reset_account()

    def pause_until(self, deadline: float) -> None:
        """Run the calls this tool handles untouched until ``time.perf_counter()`` reaches ``deadline`` (counted in
        ``paused_calls``): a tool that has no work for them (a budget spent) costs them nothing."""
        self._paused_until = deadline

    # --- what a tool overrides ---

    def configure(self) -> None:
        """Read the tool's own variables (called by ``start()`` after the shared ones)."""

    def accepts(self, name: str) -> bool:
        """Name-level exclusions of this tool beyond its LIST/DISABLE_LIST (views for fallback, …)."""
        return True

    def before(self, call: OpCall) -> None:
        """Before the op; may replace ``call.args``/``call.kwargs``."""

    def run(self, call: OpCall):
        """Run the op; tools that run it elsewhere (fallback, dtype cast) override this."""
        return call.runs(*call.args, **call.kwargs)

    def run_inside(self, call: OpCall):
        """Run the op with the torch calls it makes handled too (a Python function of torch calls, such as
        ``multi_head_attention_forward``; a C++ op has none to show). Only under this tool's mode, which torch
        takes off its stack while the mode handles a call: pushed back for the calls inside, one hop of dispatch
        skipped so the op itself is not handled twice. Under targeted wrappers, the wrapped calls inside are handled.
        Otherwise the op runs as it is, as does another tool's run of it (``_Beneath``)."""
        if call.runs is not call.func:
            return call.runs(*call.args, **call.kwargs)
        mode = self._activations[-1] if self._activations else None
        if isinstance(mode, targeting.Targeting):
            with targeting.calls_inside_handled():
                return call.func(*call.args, **call.kwargs)
        modes = _get_current_function_mode_stack()
        # The skipped hop skips every mode: another one (a user's) would see what the op calls instead of the op.
        # torch.device's DeviceContext acts on constructors only.
        if not isinstance(mode, _ToolMode) or (body := one_hop.skipping(call.func)) is None or \
                any(m is not mode and not isinstance(m, DeviceContext) for m in modes):
            return call.func(*call.args, **call.kwargs)
        with contextlib.ExitStack() as stack:
            if all(m is not mode for m in modes):  # off the stack when the call came through it
                stack.enter_context(mode)
            return body(call.args, call.kwargs)

    def after(self, call: OpCall) -> None:
        """After the op; may replace ``call.result``."""

    before_backward: Callable[[OpCall, tuple], None] | None = None  # defining it makes the engine hook backward
    after_backward: Callable[[OpCall, tuple, tuple], None] | None = None  # (call, grad_inputs, grad_outputs)
    # (call, grad_inputs, grad_outputs) -> None, after each autograd node the call created other than its
    # outputs' own: the inside of a composite function (cross_entropy = log_softmax + nll_loss).
    inner_node_backward: Callable[[OpCall, tuple, tuple], None] | None = None
    # (call, upstream, input_grads, complete) -> None, once every autograd node the call created ran: the gradients
    # of its outputs and of the tensors before() listed in call.grad_inputs (call_backward.py); complete is False
    # when the backward pass ended with only part of them run.
    after_call_backward: Callable[[OpCall, tuple, tuple, bool], None] | None = None
    # (call, output index, gradient) -> None, with after_call_backward: as each upstream gradient of the call arrives,
    # before the node that reads it runs (a kernel may write it: what the tool reads later is not what it was given)
    upstream_arrived: Callable[[OpCall, int, torch.Tensor], None] | None = None
    # (op name) -> None, each time a call's backward runs again over a graph kept for it (``retain_graph=True``):
    # ``after_call_backward`` saw its first run only.
    backward_again: Callable[[str], None] | None = None
    # Whether the tool keeps host copies of device tensors across calls (OpAutoCompare): it is then told of every
    # write of a call it does not handle (note_writes), and functions that can write never take the skip fast path.
    tracks_writes: ClassVar[bool] = False
    # Whether the tool handles calls inside torch.func transforms (``in_transform``): a tool that reads what a call
    # is (its name, shapes, time) or runs it otherwise (on the CPU, in another dtype) does; the others cannot read
    # functorch's tensors, and count such calls as not checked.
    handles_transformed: ClassVar[bool] = False
    # Whether the run report reads the tool's findings: it then writes what it did not check (``write_unchecked``).
    reports_unchecked: ClassVar[bool] = False
    # Whether the tool changes what a call saves for backward (OpFallback: the CPU's tensors): a non-reentrant
    # checkpoint's recomputation, which runs without the tool unless asked (recomputation.py), then fails its check.
    changes_saved_tensors: ClassVar[bool] = False
    # Whether the tool's run() runs a call in the device's place, as its own work (OpFallback on the CPU, OpDtypeCast
    # in a wider dtype): the other tools see the call, with its own arguments, as the one that run answers
    # (``_run_beneath``), never the run's inner calls.
    replaces_runs: ClassVar[bool] = False
    # Whether that run hands the call on with another device's tensors (OpFallback: the CPU's): among the wrappers of
    # one name it is innermost, so that another such tool (OpDtypeCast) meets the call on its device, not the CPU's.
    runs_off_device: ClassVar[bool] = False

    def note_writes(self, tensors: list) -> None:
        """A call this tool does not handle is about to write ``tensors`` (only for tools with ``tracks_writes``)."""

    def backward_done(self) -> None:
        """After ``Tensor.backward()``/``torch.autograd.backward()`` returned, on the calling thread: the place to
        raise about what backward hooks found (an exception raised inside a hook on an autograd device thread
        can abort some backends)."""

    def wants_backward(self) -> bool:
        """Whether the engine hooks this call's backward; by default when a backward step is defined."""
        return self.before_backward is not None or self.after_backward is not None

    def finish(self) -> None:
        """Called by ``stop()``: write what the tool aggregated."""

    # --- lifecycle ---

    @_outside_compiled_code
    def start(self) -> OpTool:
        """Read the configuration (``ValueError`` if malformed) and start handling calls on this thread."""
        if threading.get_ident() in self._threads:  # each call would be handled twice, counted and written twice
            raise RuntimeError(f"{type(self).__name__} is already started on this thread: stop() it before starting "
                               "it again (one `with tool:` around the code, or tool.start() ... tool.stop())")
        self._decisions = {}
        self._refused = set()
        self._disabled = set()
        self._skipped = set()
        self._paused_until, self.paused_calls = 0.0, 0
        self.settled, self.settled_skips = set(), 0
        self._read_configuration()
        self._can_match = True
        self._step_base = STEPS.acquire()
        if not self._activations:
            STEPS.before_step.append(self._waits.run_followed)
        REPLICAS.acquire(self.common, self.stem)
        gradient_communication.acquire()
        collective_waits.marking_callbacks.acquire()
        self._activations.append(self._activate())
        self._threads.append(threading.get_ident())
        compiled_regions.enter(type(self).__name__, self._logger, self.checks_regions)
        _say_unseen_collectives(self._logger, only_if_distributed=True)
        # a LIST no call can match needs no module paths (the global module hooks slow every module call)
        self._tracking.append(self.tracks_modules and self._can_match)
        if self._tracking[-1]:
            module_path.acquire()
        _track_unfinished(self)
        return self

    def _activate(self):
        """Wrap the functions a LIST of plain names selects (see targeting.py); otherwise push a mode."""
        names = self.filter.exact_names()
        if names is not None:
            targets, problems = targeting.plan(names)
            # every name one that no call can have (a typo of a torch name): nothing to wrap, follow or track, so a
            # tool started per step around such a list costs nothing per call
            self._can_match = bool(problems or targets)
            if self._can_match and (type(self).backward_done is not OpTool.backward_done
                                    or self.after_call_backward is not None):
                backward_targets, backward_problems = targeting.plan(tuple(sorted(_BACKWARD_CALLS)))
                targets.update(backward_targets)
                problems += backward_problems
            if not problems:
                activation = targeting.Targeting(self, targets)
                with contextlib.suppress(AttributeError, TypeError):  # a read-only place: the mode instead
                    activation.enter()
                    self.sees_every_call = False
                    return activation
            else:  # once per process and list: a tool started per step says it once
                typo_check.warn_once(("targeting", self.env_prefix, names), "%s_LIST: %s; the tool checks the name of "
                                     "every call instead", self.env_prefix, "; ".join(problems))
        mode = (_RegionCheckingMode if self.checks_regions else _ToolMode)(self)
        fast_paths.acquire()  # before the mode is on the stack: MultiheadAttention's fast path as without it
        mode.__enter__()
        self.sees_every_call = True
        return mode

    @_outside_compiled_code
    def stop(self) -> None:
        if not self._activations:
            return
        activation = self._activations.pop()
        self._threads.pop()
        if isinstance(activation, _ToolMode):
            _remove_mode(activation)
            fast_paths.release()
        else:
            activation.exit()
        compiled_regions.exit()
        _say_unseen_collectives(self._logger, only_if_distributed=True)
        STEPS.release()
        REPLICAS.release()
        gradient_communication.release()
        collective_waits.marking_callbacks.release()
        if self._tracking.pop():
            module_path.release()
        if not self._activations:
            _unfinished.pop(id(self), None)
            if self._waits.run_followed in STEPS.before_step:
                STEPS.before_step.remove(self._waits.run_followed)
            self._waits.give_up_all(collective_waits.NOT_WAITED)  # a wait after the verdict: said not checked now
        try:
            with tool_work():  # what finish() computes (results still in flight) is no program call of a tool still on
                self.finish()
        except OpToolsAbortError:
            raise
        except Exception as error:  # the run goes on; the verdict says its end was not reached
            if self.common is not None and self.common.strict:
                raise
            self.finish_failure = f"{type(error).__name__}: {error}"
            self._logger.error("%s: finishing failed: %s", type(self).__name__, self.finish_failure, exc_info=True)
        self.write_unchecked()
        self.tally.close()
        self._log_closing()

    def _running_marker(self) -> tuple[str, str] | None:
        """For the run report: ``running_<session>.json``, written in the tool's folder at its start (as the probe of
        the folder) and there until its verdict is written (``write_unchecked``). A process killed meanwhile
        (SIGKILL, the OOM killer: no exit handler runs) leaves it, and the report says the session was not judged to
        its end, where its folder alone (OpOverflowCheck and OpSelfCheck write nothing when clean, OpAutoCompare's
        CSV comes at stop) said clean."""
        if not self.reports_unchecked:
            return None
        record = {"format": "op_tools running", "version": 1, "tool": type(self).__name__, "rank": self.common.rank,
                  "pid": os.getpid()}
        return f"running_{self.stem}.json", json.dumps(record)

    def write_unchecked(self) -> None:
        """For the run report (``python -m op_tools.report``), which reads what the tools wrote: a tool that judges
        calls and did not check every one says so in ``unchecked_<session>.json``, else the report would find no
        anomaly in its files and call the run clean. Then the sessions' ``running_`` markers go: their verdicts are
        written."""
        try:
            self._write_unchecked()
        finally:
            self._end_running()

    def _end_running(self) -> None:
        markers, self._running_markers = self._running_markers, []
        for path in markers:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def _write_unchecked(self) -> None:
        if not (self.reports_unchecked and self.results_folder) or self.verdict() != "unchecked":
            return
        path = result_files.results_path(self.common, self.results_folder, f"unchecked_{self.stem}.json")
        record = {"format": "op_tools unchecked", "version": 1, "tool": type(self).__name__,
                  "rank": self.common.rank, "not_checked": self.not_checked()}
        try:
            self.tally.add(path, result_files.write_json(path, record), "what it did not check")
        except OSError as error:
            self._logger.warning("%s: %s not written: %s", type(self).__name__, path, error)

    end = stop

    def _prepare_output(self) -> None:
        """Logging levels and handler, the tables' width, this session's file tally, and the results folder probed
        for writing."""
        reporting.configure_logging(self.common.verbose, self.common.rank, self.common.print_ranks)
        reporting.configure_tables(self.common.table_width, self.common.rank)
        self.tally = result_files.Tally(result_files.results_path(self.common, self.results_folder)
                                     if self.results_folder else None, f"{type(self).__name__} writing")
        self._reset_account()
        if self.results_folder:
            marker = self._running_marker()
            folder = result_files.prepare_results_folder(self.common, self.results_folder, type(self).__name__,
                                                         marker)
            if marker is not None:
                self._running_markers.append(os.path.join(folder, marker[0]))

    def _reset_account(self) -> None:
        """Counts of one ``start()``…``stop()``: what its verdict accounts for."""
        self.handled: collections.Counter = collections.Counter()  # calls handled per op name
        # calls per op name that a step of the tool failed on (so they went unchecked), and the first one's error
        self.unchecked: collections.Counter = collections.Counter()
        self.first_unchecked: tuple[str, str] | None = None
        # calls not checked by design (UnsupportedInputError), per reason, and the first op each was met in
        self.unsupported: collections.Counter = collections.Counter()
        self.first_unsupported: dict[str, str] = {}
        self.raised: collections.Counter = collections.Counter()  # handled calls whose op raised, per op name
        # calls per op name that apply_feature's condition_func declined (run without the tool, as asked)
        self.declined: collections.Counter = collections.Counter()
        # calls per op name met while torch.compile traced (a region that could not be made eager): run, unchecked
        self.compiled: collections.Counter = collections.Counter()
        # calls per op name on torch.func transforms' tensors, by a tool that cannot read them: run, unchecked
        self.transformed: collections.Counter = collections.Counter()
        # handled calls per op name still running when SIGTERM ended the process (``_note_calls_in_flight``)
        self.interrupted: collections.Counter = collections.Counter()
        # how the run ended where not normally (an exception out of the with-block, SIGTERM): '' until then; files
        # that mark themselves complete (the run recording) say so, else a run cut short reads as one that ended
        self.ended_by = ""
        self._variables_read: dict[str, str | None] = {}  # what its configuration was read from, and their texts
        self.finish_failure = ""  # finish() raised: what it had still to judge or write is lost
        # asynchronous collectives whose check waits for the program's wait, and those given up (collective_waits.py)
        self._waits: collective_waits.WaitedChecks = collective_waits.WaitedChecks(self._run_waited_check, tool_work)

    def _log_closing(self) -> None:
        """Log the closing line fitted to the console (``reporting.fit_path``: its folder shortened from the start
        where the line is too long, its clauses wrapped where its verdict is) and, before it at INFO, the folder
        whole with the files a user opens (``Tally.listing``) where the tool named some or the closing line could
        not name the folder whole."""
        if self.handled and self.filter is not None and self.filter.allow is not None and not self.default_list:
            unmet = self._list_entries_unmet()  # said, not counted: the calls that ran were all handled
            if unmet:
                self._logger.warning(reporting.fit_line(f"{type(self).__name__}: {'; '.join(unmet)}"))
        for name in changed_since(self._variables_read):  # the original ditorch read them at each call
            was, now = (repr(text) if text is not None else "unset"
                        for text in (self._variables_read[name], os.environ.get(name)))
            self._logger.warning(reporting.fit_line(
                f"{type(self).__name__}: {name} changed while the tool ran ({was} when it started, {now} now): "
                f"it read it once, at start() or apply_feature(); set it before"))
        line, folder = self.closing_line(), self.tally.folder()
        fitted = reporting.fit_path(line, folder)
        if self.tally.named or (folder and f" {folder}" not in reporting.unwrapped(fitted)):
            self._logger.info(self.tally.listing(type(self).__name__))
        self._logger.log(self._closing_level(), fitted)

    def closing_line(self) -> str:
        """The line logged at ``stop()``: what the tool handled, what it wrote where, and what it could not check
        (then logged as a WARNING: see ``not_checked``)."""
        ops, calls = len(self.handled), sum(self.handled.values())
        line = (f"{type(self).__name__}: {calls} call{'s' if calls != 1 else ''} of {ops} op{'s' if ops != 1 else ''} "
                f"handled{self.handled_note()}; {self.tally.describe()}")
        problem = self.not_checked()
        return f"{line}; {problem}" if problem else line

    def handled_note(self) -> str:
        """What the tool did to the calls it handled, after "handled" in the closing line (" (3 cast)"): overridden."""
        return ""

    # --- the verdict: every handled call checked, or said not to be ---

    def found(self) -> str:
        """What the tool found wrong ('' for nothing, or for a tool that judges nothing): overridden."""
        return ""

    def _list_entries_unmet(self) -> list[str]:
        """The user's LIST entries that no handled call matched (a typo, an op that never ran, a name the tool does
        not handle): what the user asked for that did not happen. With no call handled at all, the verdict's
        ``not_checked``; else a warning at ``stop()`` (a list of many ops, some of which this run never makes, is no
        unchecked call)."""
        assert self.filter is not None and self.filter.allow is not None
        met = (*self.handled, *self.compiled, *self.transformed)
        entries = [p for p in dict.fromkeys(self.filter.allow)
                   if not any(p.pattern == n or p.fullmatch(n) for n in met)]
        if not entries:
            return []
        refused, disabled = sorted(self._refused), sorted(self._disabled)
        excluded = [p.pattern for p in entries if any(p.pattern == n or p.fullmatch(n) for n in disabled)]
        unmet = [p.pattern for p in entries if p.pattern not in excluded and
                 not any(p.pattern == n or p.fullmatch(n) for n in refused)]
        where = self._list_origin()
        parts = [f"{where} matched no call: {', '.join(unmet)}"] if unmet else []
        if excluded:
            parts.append(f"{where} named calls {self._list_origin('disable')} excludes: {', '.join(excluded)}")
        if refused:
            parts.append(f"{where} named calls {type(self).__name__} does not handle: {', '.join(refused)}")
        return parts

    def _list_origin(self, keyword: str = "ops") -> str:
        """Where the LIST (or with ``keyword="disable"``, the DISABLE_LIST) came from, as the user gave it:
        ``OpFallback(ops=...)``, the variable, or the config file's key (a tool of its own without the keyword: its
        variable)."""
        try:
            return origin(self, keyword)
        except (KeyError, AttributeError):
            return f"{self.env_prefix}_{'DISABLE_LIST' if keyword == 'disable' else 'LIST'}"

    def not_checked(self) -> str:
        """'' when every handled call was checked; else what was not: calls a step of the tool failed on, the LIST's
        entries that matched no handled call, anything else a tool adds (``unchecked_parts``)."""
        if self.common is None:  # never started (nor applied): its tool state was never made
            return "never started: no call was handled"
        parts = []
        if not (self.handled or self.compiled or self.transformed or self.unchecked):  # no call met (those met
            # unchecked: below)
            if self.declined:  # apply_feature's condition said no to every call: that, not the list, is why
                names = sorted(self.declined)
                parts.append(f"condition_func declined every call ({sum(self.declined.values())} of "
                             f"{', '.join(names[:3])}{', ...' if len(names) > 3 else ''})")
            elif self.filter is not None and self.filter.allow is not None and not self.default_list:
                parts.extend(self._list_entries_unmet() or [f"{self._list_origin()} matched no call"])
            elif self._disabled:  # calls ran on a device, and the DISABLE_LIST took every one
                names = sorted(self._disabled)
                parts.append(f"{self._list_origin('disable')} excluded every call that ran ({', '.join(names[:3])}"
                             f"{', ...' if len(names) > 3 else ''})")
            elif self.default_list:  # its own list: the device's calls, if any ran, were none of its ops
                parts.append("no call of the ops it checks ran on a device")
            else:  # nothing checked is no clean verdict (a device package not imported: all on the CPU)
                parts.append("no call was handled" + ("" if self.handles_cpu_calls else
                                                      " (the CPU's calls are the reference: none ran on a device)"))
        with _announce_lock:
            failed, first = sum(self.unchecked.values()), self.first_unchecked
        if failed and first is not None:
            parts.append(f"{failed} call{'s' if failed != 1 else ''} not checked (the tool failed), the first "
                         f"{first[0]}: {first[1]}")
        with _announce_lock:
            unsupported, firsts = dict(self.unsupported), dict(self.first_unsupported)
        parts.extend(f"{n} call{'s' if n != 1 else ''} not checked ({why}), the first {firsts[why]}"
                     for why, n in unsupported.items())
        compiled = sum(self.compiled.values())
        if compiled:
            parts.append(f"{compiled} call{'s' if compiled != 1 else ''} inside torch.compile'd regions not checked "
                         f"(traced by the compiler, the first {next(iter(self.compiled))})")
        transformed = sum(self.transformed.values())
        if transformed:
            parts.append(f"{transformed} call{'s' if transformed != 1 else ''} inside torch.func transforms (vmap, "
                         f"grad, jacrev) not checked (their batched or wrapped tensors cannot be read, the first "
                         f"{next(iter(self.transformed))})")
        interrupted = sum(self.interrupted.values())
        if interrupted:
            parts.append(f"{interrupted} call{'s' if interrupted != 1 else ''} running when SIGTERM ended the run, "
                         f"with no verdict ({', '.join(self.interrupted)})")
        parts.extend(self._waits.parts())
        if self.finish_failure:
            parts.append(f"finishing failed ({self.finish_failure}): what was still in flight was not judged")
        parts.extend(self.unchecked_parts())
        return "; ".join(parts)

    def unchecked_parts(self) -> list[str]:
        """What else the tool could not check or write (files lost, spans unread): overridden."""
        return []

    def verdict(self) -> str:
        """``"found"`` (the tool found something wrong), ``"unchecked"`` (some calls went unchecked) or
        ``"clean"``: the exit status of ``python -m op_tools`` (``exit_status.status_of``: 3, 4 or 0)."""
        if self.common is None:  # never started: nothing found, nothing checked
            return "unchecked"
        if self.found():
            return "found"
        return "unchecked" if self.not_checked() else "clean"

    def _closing_level(self) -> int:
        return logging.WARNING if self.not_checked() else logging.INFO

    def __enter__(self) -> OpTool:
        return self.start()

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc is not None and not ended_normally(exc):
            self.ended_by = ended_by_exception(exc)
        self.stop()

    def ensure_configured(self) -> None:
        """For use without a mode (apply_feature): read the configuration once."""
        if self.common is None:
            self._read_configuration()
            self._step_base = STEPS.acquire()  # never stopped: counts steps until the process ends
            STEPS.before_step.append(self._waits.run_followed)
            collective_waits.marking_callbacks.acquire()
            _track_unfinished(self)  # never stopped: what it aggregated is written at exit

    def _read_configuration(self) -> None:
        """Arguments > variables > config file > defaults, parsed once; then the typo checks (typo_check.py)."""
        self.sources = sources_for(self)
        self.common = CommonConfig.from_env(self.sources)  # the output's settings apply process-wide at each start
        with recorded_reads() as read:  # the tool's own: a change while it runs is said at its end
            self.filter = OpFilter.from_env(self.env_prefix, self.sources) if self.env_prefix else \
                OpFilter(None, None)
        self.stem = result_files.session_stem()
        self._prepare_output()
        try:
            with recorded_reads() as reads:
                self.configure()
            self._variables_read = {**read, **reads}
        except BaseException:  # a malformed variable of its own: the session never starts, so no marker says it ran
            self._end_running()
            self.common = None  # type: ignore[assignment]  # nor did its state: its verdict is a never-started tool's
            raise
        self._hooks_backward = self.wants_backward()  # read per handled call: asked once, after configure()
        typo_check.check_environment()
        typo_check.check_op_lists(self)

    # --- the engine ---

    def check_region(self, region: compiled_regions.Region, args: tuple):
        """A compiled graph's run, handled as one call named ``region.name`` (its own calls are not handled)."""
        return self.handle(RegionRun(region), tuple(args), {}, name=region.name)

    def handle(self, func, args: tuple, kwargs: dict, name: str | None = None):
        """Run one call, through this tool if it handles it. Used by the mode and by apply_feature."""
        if _thread.depth:  # in tool work
            return func(*args, **kwargs)
        if name is None:
            name = resolve_op_name(func)
        decision = self._decisions.get(name)
        if decision and self._paused_until and name not in self.unpausable:
            if time.perf_counter() < self._paused_until:
                self.paused_calls += 1
                return func(*args, **kwargs)
            self._paused_until = 0.0
        if decision and self.settled and self.settled_skips > 0 and name not in self.unpausable and \
                (name, module_path.current()) in self.settled:
            self.settled_skips -= 1
            self.paused_calls += 1
            return func(*args, **kwargs)
        if decision is None:  # backward calls and metadata queries are never given a decision
            if name in _BACKWARD_CALLS:
                try:
                    result = func(*args, **kwargs)
                except RuntimeError as error:
                    self._explain_recomputation(error)
                    raise
                with tool_work():
                    self._guarded(lambda _: self._backward_finished(), OpCall(name, func, (), {}, None))
                return result
            if is_metadata_query(name):
                with contextlib.suppress(TypeError):  # unhashable callables keep taking this path
                    _query_functions.add(func)
                return _run_query(func, args, kwargs)
        elif not decision:  # decided (and announced) at an earlier call on a device
            return self._run_unhandled(name, func, args, kwargs)
        below = _modes_below()  # asked once a call: a program's mode under the tools' is there for its whole run
        device = call_device(args, kwargs, name) if not below else _hidden(call_device, args, kwargs, name)
        if device is None:  # the CPU is taken as correct
            if not self.handles_cpu_calls:
                return func(*args, **kwargs)
            device = _CPU
        if decision is None and not self._decide(name):
            if type(func) is not _Beneath and (not self.tracks_writes or call_writes(name).never) and \
                    not has_twin(func):  # a twin (torch.mm and torch.spmm, equal keys) skipped by function would
                # skip the other, which a LIST may select; another tool's run handed on holds its call's tensors
                with contextlib.suppress(TypeError):  # unhashable callables keep taking this path
                    self._skipped.add(func)
            return self._run_unhandled(name, func, args, kwargs)
        if _is_compiling():  # a tool's steps cannot run in a graph dynamo traces: the call runs, counted unchecked
            self.compiled[name] += 1
            return func(*args, **kwargs)
        # runs as it is, counted unchecked (the C query first: a Python call less per call outside transforms)
        if _transforms_active() and not self.handles_transformed and in_transform(args, kwargs):
            self.transformed[name] += 1
            return self._run_unhandled(name, func, args, kwargs)
        call = OpCall(name, func, args, kwargs, device, self.common.print_stack)
        call.step = STEPS.count - self._step_base
        self.handled[name] += 1
        tracker = None
        _thread.depth += 1  # tool_work() inlined here and below: ~1 µs a call less
        switch = _hide() if below else None
        try:
            if not self._guarded(self.before, call):
                call.args, call.kwargs = args, kwargs
            elif call.grad_inputs and self.after_call_backward is not None:
                tracker = self._guarded_value(CallBackward, call, call.grad_inputs)  # edges before an in-place op
        finally:
            _thread.depth -= 1
            if switch is not None:
                _unhide(switch)
        if self._hooks_backward:  # the nodes the call creates are numbered from here: not its inputs' (hooks)
            call.first_node = _sequence_nr()
        try:
            call.result = self.run(call) if not self.replaces_runs else self._run_beneath(call, below)
        except BaseException:
            self.raised[name] += 1  # the op's own error: propagates unchanged, the call has nothing to check
            raise
        _thread.depth += 1
        switch = _hide() if below else None
        try:
            self._guarded(self.after, call)
            result = call.result
            if tracker is not None and call.grad_inputs:  # after() may have given up on the call's backward
                self._guarded(self._attach_call_backward, call, tracker)
            if self._hooks_backward:
                self._guarded(register_backward_hooks, call, self)
        finally:
            _thread.depth -= 1
            if switch is not None:
                _unhide(switch)
        return result

    def _run_beneath(self, call: OpCall, below: int):
        """``run(call)`` as the call that the other tools' modes under this one's handle, each once, the topmost
        first: their modes would otherwise meet the run's own calls only, in tool work (not handled), and the call
        would be missing from their summaries (a timing, a recording) while their verdicts stayed clean. A program's
        own mode among them sees no such call, as it sees no tool work. ``below``: the modes under the tools'."""
        if not below:
            return self.run(call)
        stack = _get_current_function_mode_stack()
        # under this tool's own mode where it is on the stack (handed a call by another such tool, not by its mode)
        mine = next((i for i, m in enumerate(stack) if isinstance(m, _ToolMode) and m.tool is self), len(stack))
        tools = [m.tool for m in stack[:mine] if isinstance(m, _ToolMode)]
        if not tools:
            return self.run(call)

        run = _Beneath(call.func, functools.partial(_replaced_run, self, call))
        for tool in tools:  # the bottom one first: the topmost one's handle is outermost
            run = _Beneath(call.func, functools.partial(_handled_by, tool, run, call.name))
        return run(*call.args, **call.kwargs)

    def check_when_waited(self, call: OpCall, check: Callable[[OpCall], None], received: list | None,
                          bound: Any = None) -> None:
        """From ``after()``: ``check(call)`` once the program waits for the asynchronous collective ``call`` (its
        result, a ``Work``, is replaced by one that runs it: collective_waits.py). ``call`` keeps its state, not its
        arguments or result; a collective whose check never runs is said not checked, with why. ``received``: the
        tool's list of the tensors its check reads what arrived from (``CollectiveCall.received``), which a future the
        program takes replaces by copies made as the result arrives. ``bound``: the tool's ``CollectiveCall`` of it,
        where it has one (bound here otherwise: its group tells its library)."""
        call.keep_location()  # while the user's frames are on the stack
        if bound is None:
            bound = collective_call(call.name, call.func, call.args, call.kwargs)
        ordered = bound is not None and collective_waits.completes_when_queued(bound.group)
        call.result = self._waits.defer(call.without_values(), check, call.result, received, ordered)

    def waits_not_checked(self) -> int:
        """Asynchronous collectives handled whose check has not run: not waited for yet, or given up."""
        return self._waits.not_checked()

    def _run_waited_check(self, check: Callable[[OpCall], None], call: OpCall) -> None:
        with tool_work():
            self._guarded(check, call)

    def _explain_recomputation(self, error: RuntimeError) -> None:
        """Say why a non-reentrant checkpoint's recomputation differed, where this tool made its forward differ."""
        from torch.utils.checkpoint import CheckpointError

        if self.changes_saved_tensors and isinstance(error, CheckpointError):
            self._logger.error("%s: a checkpoint's recomputation differs from its forward. If the forward ran under "
                               "this tool and the recomputation in backward without it (PyTorch runs backward() with "
                               "no TorchFunctionMode, pytorch/pytorch#147995), pass "
                               "context_fn=op_tools.checkpoint_context_fn to torch.utils.checkpoint.checkpoint",
                               type(self).__name__)

    def _run_unhandled(self, name: str, func, args: tuple, kwargs: dict):
        if self.tracks_writes:  # told before the write: a tool may need what the tensors hold now
            written = call_writes(name).written(args, kwargs)
            if written:
                with tool_work():
                    self._guarded(lambda _: self.note_writes(written), OpCall(name, func, (), {}, None))
        return func(*args, **kwargs)

    def _attach_call_backward(self, call: OpCall, tracker: CallBackward) -> None:
        # Held until the call's backward: an object and a bound method, not two closures and their cells (what a
        # call holds that long is promoted by the garbage collector, see call_backward.CallBackward)
        again = None if self.backward_again is None else functools.partial(self.backward_again, call.name)
        done = _CallBackwardDone(self, call, tracker)
        why = tracker.attach(call.result, done, self._call_backward_started, again,
                             None if self.upstream_arrived is None else done.upstream)
        call.grad_inputs = []
        if why is not None:
            self.call_backward_skipped(call, why)
        elif not self._hooks_backward:
            call.release()  # the hooks hold the call: its outputs would keep their own graph alive

    def _call_backward_started(self, tracker: CallBackward) -> None:
        with self._lock:
            self._open_backwards.add(tracker)

    def _call_backward_done(self, call: OpCall, tracker: CallBackward, upstream: tuple, input_grads: tuple,
                            complete: bool) -> None:
        with self._lock:
            self._open_backwards.discard(tracker)
        with tool_work():
            after_call_backward = self.after_call_backward
            assert after_call_backward is not None  # attached only for a tool that defines it
            self._guarded(lambda c: after_call_backward(c, upstream, input_grads, complete), call)

    def call_backward_skipped(self, call: OpCall, why: str) -> None:
        """The call's backward cannot be followed (``why``; '' when no output carries gradients)."""

    def _backward_finished(self) -> None:
        with self._lock:
            open_ones, self._open_backwards = list(self._open_backwards), set()
        for tracker in open_ones:
            tracker.finish_incomplete()
        self.backward_done()

    def _guarded_value(self, make, call: OpCall, *extra):
        """``make(*extra)``, or None after reporting its failure as ``_guarded`` does."""
        out = []
        self._guarded(lambda _: out.append(make(*extra)), call)
        return out[0] if out else None

    def _decide(self, name: str) -> bool:
        decision = self._decisions.get(name)
        if decision is None:
            allowed = self.filter.allows(name)
            decision = self._decisions[name] = allowed and self.accepts(name)
            if not allowed and self.filter.denies(name):  # said where it leaves nothing handled
                self._disabled.add(name)
            if allowed and not decision and self.filter.allow is not None:  # a LIST entry naming it: said at the end
                self._refused.add(name)
            if decision and name.startswith("torch.distributed."):
                _say_unseen_collectives(self._logger)
            if self._logger.isEnabledFor(logging.DEBUG):  # announced once per process where shown
                key = (self.hook_name, name, decision)
                with _announce_lock:
                    first = key not in _announced
                    _announced[key] = None
                if first:
                    self._logger.debug("%s %s on %s", "apply" if decision else "skip", self.hook_name, name)
        return decision

    def _guarded(self, step, call: OpCall, *extra) -> bool:
        """Run a tool step; report a failure once per (tool, op) and go on, unless strict."""
        try:
            step(call, *extra)
            return True
        except OpToolsAbortError:
            raise
        except Exception as e:
            if self.common is not None and self.common.strict:
                raise
            self.tool_failed(call, e)
            return False

    def tool_failed(self, call: OpCall, error: Exception) -> None:
        """A step of the tool failed on ``call``: the call counts as not checked (once), the error is logged once
        per op name."""
        if isinstance(error, UnsupportedInputError):
            if not call.unchecked:
                call.unchecked = True
                why = str(error)
                with _announce_lock:
                    self.unsupported[why] += 1
                    self.first_unsupported.setdefault(why, call.name)
            return
        if not call.unchecked:
            call.unchecked = True
            described = f"{type(error).__name__}: {error}"
            with _announce_lock:
                self.unchecked[call.name] += 1
                if self.first_unchecked is None:
                    self.first_unchecked = (call.name, described if len(described) <= 200 else described[:197] + "...")
        self.report_failure(call.name, error)

    def count_unchecked(self, name: str, why: str) -> None:
        """A call the tool was meant to handle ran without it (``apply_feature``'s condition raised on it): counted
        as a call the tool failed on, ``why`` the first's reason."""
        with _announce_lock:
            self.unchecked[name] += 1
            if self.first_unchecked is None:
                self.first_unchecked = (name, why if len(why) <= 200 else why[:197] + "...")

    def report_failure(self, name: str, error: Exception) -> None:
        key = (self.hook_name, name)
        with _announce_lock:
            first = key not in _reported_failures
            _reported_failures[key] = None
        if first:
            self._logger.warning(reporting.fit_line(f"{self.hook_name} failed on {name} (reported once; the op ran "
                                                    f"unchanged): {type(error).__name__}: {error}"),
                                 exc_info=self._logger.isEnabledFor(logging.DEBUG))

    @property
    def pid_folder(self) -> str:
        return str(os.getpid())


# --- what is pending at exit: tools started and not stopped write their summaries and files ---

_unfinished: dict[int, OpTool] = {}  # id -> tool, in start order; plain dict operations (atomic) for a signal handler
_exit_hooks_installed = False
_previous_sigterm = None
_HANDLE_CODE = OpTool.handle.__code__  # the frames of calls in flight (_note_calls_in_flight)


def started_modes() -> list[_ToolMode]:
    """The modes of the tools started now, in start order: what a hook that runs where no mode is on the stack (DDP's
    communication hook, called by its reducer during backward) enters to have its calls handled."""
    modes = []
    for tool in list(_unfinished.values()):
        activations = tool._activations
        if activations and isinstance(activations[-1], _ToolMode):
            modes.append(activations[-1])
    return modes


gradient_communication.started_modes = started_modes
fast_paths.TOOL_MODES = (_ToolMode,)


# The uncaught error the interpreter held when a tool started (an earlier one: pytest's, an interactive session's):
# not what ends this run.
_stale_error: list = [None]


def _uncaught_error() -> BaseException | None:
    return getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)


def _track_unfinished(tool: OpTool) -> None:
    global _exit_hooks_installed
    if not _unfinished:
        _stale_error[0] = _uncaught_error()
    _unfinished[id(tool)] = tool
    if not _exit_hooks_installed:
        _exit_hooks_installed = True
        atexit.register(_flush_at_exit)
    if threading.current_thread() is threading.main_thread():
        _install_sigterm_handler()


def finish_unstopped(tool: OpTool) -> None:
    """Write the results of a tool that was never started as a mode (apply_feature) once it is done with."""
    if _unfinished.pop(id(tool), None) is not None:
        _finish_reporting_failure(tool)


def flush_unfinished() -> None:
    """``finish()`` every tool started and not stopped, latest first, then the replica fingerprints they wrote: at
    exit, and on SIGTERM before dying."""
    while _unfinished:
        try:
            _, tool = _unfinished.popitem()
        except KeyError:  # emptied meanwhile by another thread
            break
        _finish_reporting_failure(tool)
    try:
        REPLICAS.finish()
    except Exception:
        reporting.logger.exception("op_tools: finishing the replica fingerprints failed")


def ended_normally(error: BaseException) -> bool:
    """Whether an exception ends a run as it meant to: ``sys.exit()``, ``sys.exit(0)``."""
    return isinstance(error, SystemExit) and error.code in (None, 0)


def ended_by_exception(error: BaseException) -> str:
    """``an exception (RuntimeError: device lost)``: how a run ended, for ``OpTool.ended_by``; one line."""
    text = f"{type(error).__name__}: {error}".splitlines()[0] if str(error) else type(error).__name__
    return f"an exception ({text if len(text) <= 160 else text[:157] + '...'})"


def _mark_unfinished(ended_by: str) -> None:
    for tool in list(_unfinished.values()):
        tool.ended_by = tool.ended_by or ended_by


def _flush_at_exit() -> None:
    """``flush_unfinished`` at the interpreter's exit; tools still running when an exception no one caught ended
    the program (``sys.last_value``, set before exit handlers run) are marked ended by it."""
    error = _uncaught_error()
    if isinstance(error, BaseException) and error is not _stale_error[0] and not ended_normally(error):
        _mark_unfinished(ended_by_exception(error))
    flush_unfinished()


def _finish_reporting_failure(tool: OpTool) -> None:
    try:
        with tool_work():
            tool.finish()
        tool.write_unchecked()
        tool.tally.close()
        tool._log_closing()
    except Exception:
        reporting.logger.exception("%s: writing its results failed", tool.hook_name)


def _install_sigterm_handler() -> None:
    """Flush on SIGTERM, then do what the handler before ours did: call it, or die of the signal as by default.

    Not installed where SIGTERM is ignored or handled outside Python (the previous handler could not be chained).
    """
    global _previous_sigterm
    current = signal.getsignal(signal.SIGTERM)
    if current is _on_sigterm or current is None or current == signal.SIG_IGN:
        return
    _previous_sigterm = current
    signal.signal(signal.SIGTERM, _on_sigterm)


def _note_calls_in_flight() -> None:
    """Count, in each tool's ``interrupted``, the handled calls that SIGTERM caught running, on any thread: ``handle``
    frames past the call's making (its ``call`` local), each one call (a composite call's inner calls too). Read off
    the stacks when the signal comes, so that the handled path pays nothing for it."""
    for innermost in sys._current_frames().values():
        frame: types.FrameType | None = innermost
        while frame is not None:
            if frame.f_code is _HANDLE_CODE:
                names = frame.f_locals
                tool = names.get("self")
                if isinstance(tool, OpTool) and names.get("call") is not None:
                    tool.interrupted[names["call"].name] += 1
            frame = frame.f_back


def _on_sigterm(signum, frame) -> None:
    _note_calls_in_flight()
    _mark_unfinished("SIGTERM")
    flush_unfinished()
    previous = _previous_sigterm
    if callable(previous):
        previous(signum, frame)
        return
    signal.signal(signum, signal.SIG_DFL)  # the default action: the process ends by the signal, status -SIGTERM
    os.kill(os.getpid(), signum)


class _CallBackwardDone:
    """What runs when a call's whole backward has run: ``tool._call_backward_done``."""

    __slots__ = ("tool", "call", "tracker")

    def __init__(self, tool: OpTool, call: OpCall, tracker: CallBackward) -> None:
        self.tool, self.call, self.tracker = tool, call, tracker

    def __call__(self, upstream: tuple, input_grads: tuple, complete: bool) -> None:
        self.tool._call_backward_done(self.call, self.tracker, upstream, input_grads, complete)

    def upstream(self, index: int, gradient: torch.Tensor) -> None:
        tool = self.tool
        upstream_arrived = tool.upstream_arrived
        assert upstream_arrived is not None  # passed only for a tool that defines it
        with tool_work():
            tool._guarded(lambda c: upstream_arrived(c, index, gradient), self.call)


def register_backward_hooks(call: OpCall, tool: OpTool, nodes: list | None = None) -> None:
    """Hook the grad_fn nodes of ``call``'s outputs: ``tool.before_backward(call, grad_outputs)`` before each
    node runs, ``tool.after_backward(call, grad_inputs, grad_outputs)`` after. Hooks never change gradients;
    they run in tool work, once per node, and only ``call.state``, name, id and location stay alive for them.
    ``nodes``: these nodes instead, as ``call``'s (a custom autograd.Function's node, whose backward no call shows).
    An output's node made before the call (numbered below ``call.first_node``) is not the call's: an input handed
    back as it is (``x.to(x.dtype)``, ``x.contiguous()``), whose backward is the call's that made it.
    """
    if nodes is None:
        result, first = call.result, call.first_node
        if isinstance(result, torch.Tensor):  # most calls: one tensor, one node
            node = result.grad_fn
            if node is None or node._sequence_nr() < first:
                return
            nodes = [node]
        else:
            nodes = []
            for t in iter_tensors(result):
                node = t.grad_fn
                if node is not None and all(node is not n for n in nodes) and node._sequence_nr() >= first:
                    nodes.append(node)
            if not nodes:
                return
    call.keep_location()  # while the user's frames are on the stack
    call.release()
    if tool.inner_node_backward is not None and call.first_node >= 0:
        for node in _inner_nodes(nodes, call.first_node):
            node.register_hook(_NodeHook(tool, "inner_node_backward", call, False))
    before, after = tool.before_backward is not None, tool.after_backward is not None
    for node in nodes:
        pre = None
        if before:
            pre = _NodeHook(tool, "before_backward", call, False)
            node.register_prehook(pre)
        if after:
            post = _NodeHook(tool, "after_backward", call, True)
            post.pre = pre
            node.register_hook(post)


class _NodeHook:
    """A hook on a call's node: the tool's method ``step`` (by name) on ``(call, *its gradients)``, in tool work,
    guarded. A node's post-hook (``last``) then ends the node's hooks: a retained graph's next backward runs them no
    more, and the call is let go of (its handles are never removed: ``RemovableHandle.remove`` cost more than the
    check). One object, not a closure with its cells and a bound method: it lives until the backward (see
    ``_CallBackwardDone``)."""

    __slots__ = ("tool", "step", "call", "last", "pre")

    def __init__(self, tool: OpTool, step: str, call: OpCall, last: bool) -> None:
        self.tool, self.step, self.last = tool, step, last
        self.call: OpCall | None = call
        self.pre: _NodeHook | None = None  # a post-hook's: the node's pre-hook, ended with it

    def __call__(self, *grads) -> None:  # a pre-hook's (grad_outputs), a post-hook's (grad_inputs, grad_outputs)
        call = self.call
        if call is None:  # ended by the node's post-hook: its node ran before, in an earlier backward
            return
        tool = self.tool
        _thread.depth += 1  # tool_work() inlined
        switch = _hide() if _modes_below() else None
        try:
            tool._guarded(getattr(tool, self.step), call, *[g if type(g) is tuple else tuple(g) for g in grads])
        finally:
            _thread.depth -= 1
            if switch is not None:
                _unhide(switch)
        if self.last:
            self.call = None
            if self.pre is not None:
                self.pre.call = None


def _inner_nodes(outputs: list, first: int) -> list:
    """Autograd nodes behind ``outputs`` numbered from ``first`` on (created by the call, on this thread)."""
    seen = {id(n) for n in outputs}
    inner, stack = [], list(outputs)
    while stack:
        for next_node, _ in stack.pop().next_functions:
            if next_node is None or id(next_node) in seen:
                continue
            seen.add(id(next_node))
            if next_node._sequence_nr() >= first and type(next_node).__name__ != "AccumulateGrad":
                inner.append(next_node)
                stack.append(next_node)
    return inner


class _Beneath:
    """A call that a tool runs in the device's place (``OpTool._run_beneath``), as handed to the tools under it:
    calling it runs that tool's run; ``op``, the torch function, is what those tools see as the call's ``func`` and
    rerun (OpAutoCompare's reference, OpDtypeCast's meta run), never the other tool's run."""

    __slots__ = ("op", "_run")

    def __init__(self, op, run: Callable) -> None:
        self.op, self._run = op, run

    def __call__(self, *args, **kwargs):
        return self._run(*args, **kwargs)


def _replaced_run(tool: OpTool, call: OpCall, *args, **kwargs):
    """``tool.run(call)`` handed on by the tools under it: their arguments (another tool's) are the call's."""
    call.args, call.kwargs = args, kwargs
    _thread.depth += 1  # handled once: where run() runs the call as written, no tool handles it again
    try:
        return tool.run(call)
    finally:
        _thread.depth -= 1


def _handled_by(tool: OpTool, func, name: str, *args, **kwargs):
    """``func`` (a call another tool runs in the device's place) handled by ``tool`` as the call ``name``; dynamo's
    frame hook off, as in the tool's mode."""
    return _outside_dynamo(tool.handle, func, args, kwargs, name)


def _remove_mode(mode: TorchFunctionMode) -> None:
    """Pop ``mode`` from this thread's torch-function mode stack even when others were pushed after it."""
    from torch.overrides import _get_current_function_mode_stack, _pop_mode, _push_mode

    stack = _get_current_function_mode_stack()
    if not any(m is mode for m in stack):
        raise RuntimeError("op_tools: a tool must be stopped on the thread that started it")
    above = []
    while True:
        top = _pop_mode()
        if top is mode:
            break
        above.append(top)
    for m in reversed(above):
        _push_mode(m)
