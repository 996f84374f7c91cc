"""``torch.compile``'d code runs eagerly while a tool is started, so that the tool sees every op.

A compiled region runs a graph that dynamo traced once: the torch calls inside it never reach a tool's
``TorchFunctionMode`` (and dynamo tracing a region under the mode would trace the tool itself). While any tool
is started, the compiler's stance is ``"force_eager"`` (``torch.compiler.set_stance``): compiled functions run
their Python code as written, nothing is compiled or recompiled, and the graphs compiled before stay cached for
after the last tool stops, when the stance before is restored. Each activation that finds that ``torch.compile``
compiled something, or that sees it called while active, says so in one line on its logger.

The stance is process-wide (dynamo has no per-thread one): while a tool is started on one thread, compiled code on
every thread runs eagerly. ``torch._dynamo`` (a second to import) is never imported here: where it is not loaded
yet, nothing was compiled, and ``torch.compile`` is watched until the last tool stops, so that a model compiled
while a tool is active runs eagerly too.

A tool that checks compiled code (OpAutoCompare's ``compiled="check"``: ``region_checker`` set) keeps it compiled
instead, unless an eager tool is active beside it. Each graph dynamo compiles is then compiled by the user's own
backend wrapped in ``_RegionBackend``, so that each run of the compiled graph is one call the tool handles, named
``compiled:<function>#<frame>`` (``Region``), with the graph dynamo traced (``torch.fx``) at hand to rerun as the
reference. The wrapping is done where dynamo picks a frame's callback for the stance
(``torch._dynamo.eval_frame._callback_from_stance``, replaced while such a tool is active): a graph compiled before
is compiled once more for the wrapped backend (dynamo keys its cache on the backend), and after the last such tool
stops the frames run their first compilation again. Dynamo traces a frame under the tool's mode: the engine's
``__torch_function__`` returns at once while dynamo traces, so the graph holds the user's calls only.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading

import torch

from ..numerics import fused_statistics

_lock = threading.RLock()
_active: list = []  # (name, logger, checks regions) of the started tools, one per activation, in start order
_stance = None  # the set_stance object that forced eager (its __exit__ restores the stance before), or None
_watch = None  # our wrapper of torch.compile while installed, or None
_callbacks = None  # dynamo's _callback_from_stance while ours replaces it, or None
# Activations started where dynamo was loaded and had compiled nothing (a model compiled before the tool, first run
# inside it): each says its line at the first compiled function that runs while it is active.
_pending: list = []

LINE = ("%s: torch.compile'd code runs eagerly while the tool is active, so that it sees every op "
        "(torch.compiler.set_stance(\"force_eager\"); compiled graphs are kept for after)")
LINE_CHECK = ("%s: torch.compile'd code runs compiled, each compiled graph checked as one call "
              "(compiled:<function>#<frame>); the code between graphs is checked op by op")
LINE_CHECK_OVERRIDDEN = ("%s: torch.compile'd code runs eagerly, not checked as compiled: another tool active beside "
                         "this one needs every op (torch.compiler.set_stance(\"force_eager\"))")


def enter(name: str, logger: logging.Logger, checks_regions: bool = False) -> None:
    """A tool named ``name`` starts: where dynamo is loaded, force eager (or, for a tool that ``checks_regions``
    alone, wrap the backends); else watch ``torch.compile``."""
    with _lock:
        entry = (name, logger, checks_regions)
        _active.append(entry)
        if "torch._dynamo" in sys.modules:
            if not _compiled_anything():
                _pending.append(entry)
            _apply(announce=[] if _pending and _pending[-1] is entry else [entry])
        elif len(_active) == 1:
            _watch_compile()


def exit() -> None:  # noqa: A001 - the pair of enter()
    """The latest activation stops: the stance, dynamo's callback and ``torch.compile`` are put back after the
    last one that needed them."""
    with _lock:
        entry = _active.pop()
        if any(p is entry for p in _pending):
            _pending.remove(entry)
        if "torch._dynamo" in sys.modules:
            _apply(announce=[])
        if not _active:
            _unwatch_compile()


def _apply(announce: list) -> None:
    """Force eager while an eager tool is active, wrap the backends while a region checker is: each as the active
    tools need; the tools in ``announce`` say what they get."""
    eager = any(not checks for _, _, checks in _active)
    if eager:
        forced = _force_eager()
        for name, logger, checks in announce:
            if forced:
                logger.info(LINE if not checks else LINE_CHECK_OVERRIDDEN, name)
    else:
        _restore_stance()
    checking = any(checks for _, _, checks in _active)
    if checking or _pending:
        _wrap_backends()
        if checking and not eager:
            for name, logger, _ in announce:
                logger.info(LINE_CHECK, name)
    else:
        _unwrap_backends()


def _announce_pending() -> None:
    """A compiled function runs while activations that found nothing compiled are active: each says its line."""
    with _lock:
        pending = list(_pending)
        _pending.clear()
        _apply(announce=pending)


def _restore_stance() -> None:
    global _stance
    if _stance is not None:
        stance, _stance = _stance, None
        try:
            stance.__exit__(None, None, None)
        except RuntimeError as error:  # stopped inside a compiled region: the stance stays, said
            logging.getLogger("op_tools").warning("op_tools: could not restore torch.compile's stance: %s", error)


def _force_eager() -> bool:
    """Force eager once for all activations; False when it cannot be (set inside a compiled region)."""
    global _stance
    if _stance is not None:
        return True
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None:  # torch < 2.6
        logging.getLogger("op_tools").warning(
            "op_tools: compiled regions keep running compiled (torch %s has no torch.compiler.set_stance, which "
            "torch 2.6 added): the calls inside them reach no tool and are neither checked nor counted",
            torch.__version__)
        return False
    try:
        _stance = set_stance("force_eager")
    except RuntimeError as error:  # "attempted to set_stance in a torch.compile region"
        logging.getLogger("op_tools").warning(
            "op_tools: compiled regions keep running compiled (%s); the calls the tool meets inside them are "
            "counted as not checked", error)
        return False
    return True


def _compiled_anything() -> bool:
    """Whether dynamo has compiled a frame in this process: libraries load it without compiling anything, and
    then there is nothing to say."""
    try:
        from torch._dynamo.utils import counters

        # frames, and graphs: torch.compile(fullgraph=True) compiles through a path that counts no frame
        return (counters["frames"]["total"] > fused_statistics.own_frames()  # the tools' own compiled statistics
                or counters["stats"]["unique_graphs"] > fused_statistics.own_graphs())
    except (ImportError, AttributeError, KeyError):  # another dynamo: say it rather than stay silent
        return True


def _watch_compile() -> None:
    global _watch
    original = torch.compile

    @functools.wraps(original)
    def compile(*args, **kwargs):  # noqa: A001 - torch's name
        compiled = original(*args, **kwargs)  # imports torch._dynamo
        with _lock:
            if _active and _stance is None and _callbacks is None:
                _apply(announce=list(_active))
        return compiled

    compile.__wrapped_by_op_tools__ = original  # type: ignore[attr-defined]  # what _unwatch_compile puts back
    torch.compile = compile
    _watch = compile


def _unwatch_compile() -> None:
    global _watch
    if _watch is not None and torch.compile is _watch:  # patched over since: ours stays, idle without tools
        torch.compile = _watch.__wrapped_by_op_tools__  # type: ignore[attr-defined]
    _watch = None


# --- compiled="check": each compiled graph run as one call of the tool that checks regions ---

in_tool_work = lambda: False  # noqa: E731  # the engine's: a tool's own compiled functions are not regions


# The tools' hooks that torch runs from the user's code (global module hooks): dynamo inlines them into a graph it
# traces (they return at once there), but called from a compiled model's eager parts (a frame it gave up on) under
# its frame hook, it would compile each as a frame of its own, whose trace returned at once: a no-op ever after.
frame_skipped_hooks: list = []


def _wrap_backends() -> None:
    global _callbacks
    if _callbacks is not None:
        return
    from torch._dynamo import eval_frame

    for hook in frame_skipped_hooks:  # never compiled as frames of their own (still inlined where traced)
        _skip_frames(eval_frame, hook.__code__)

    original = eval_frame._callback_from_stance

    def callback_from_stance(callback):
        if _pending and callback is not None and callback is not False and not in_tool_work() and \
                getattr(getattr(eval_frame, "_stance", None), "stance", None) == "force_eager":
            # a compiled function runs eagerly: compiled before the tool, first run inside it (not the tools' own
            # compiled statistics, which run under the default stance)
            _announce_pending()
        callback = original(callback)
        if callback is None or callback is False or in_tool_work() or \
                not any(checks for _, _, checks in _active):
            return callback
        return _wrapped_callback(callback)

    callback_from_stance.__wrapped_by_op_tools__ = original  # type: ignore[attr-defined]
    eval_frame._callback_from_stance = callback_from_stance
    _callbacks = callback_from_stance


def _skip_frames(eval_frame, code) -> None:
    """Dynamo runs ``code``'s frames, and the frames they call, as written (where this torch can say so)."""
    try:
        from torch._dynamo.types import FrameAction, FrameExecStrategy

        eval_frame.set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
    except (ImportError, AttributeError):  # an older dynamo: the frame alone
        skip = getattr(eval_frame, "skip_code", None)
        if skip is not None:
            skip(code)


def _unwrap_backends() -> None:
    global _callbacks
    if _callbacks is None:
        return
    from torch._dynamo import eval_frame

    if eval_frame._callback_from_stance is _callbacks:  # replaced since: ours stays, passing through
        eval_frame._callback_from_stance = _callbacks.__wrapped_by_op_tools__  # type: ignore[attr-defined]
    _callbacks = None


# id(user's backend) -> (that backend, dynamo's callback compiling with it wrapped): one per backend for the process,
# so that dynamo's cache entries for the wrapped backend serve every later tool.
_wrapped: dict[int, tuple] = {}


def _wrapped_callback(callback):
    from torch._dynamo import convert_frame, eval_frame

    backend = eval_frame.innermost_backend(callback)
    if isinstance(backend, _RegionBackend):
        return callback
    held = _wrapped.get(id(backend))
    if held is None:
        wrapped = _RegionBackend(backend)
        make = getattr(eval_frame, "_create_wrapped_callback", None)
        if make is not None:
            new = make(wrapped)
        else:  # PyTorch < 2.8 builds it in _callback_from_stance
            hooks = eval_frame.Hooks()
            new = convert_frame.catch_errors_wrapper(convert_frame.convert_frame(wrapped, hooks), hooks)
        held = _wrapped[id(backend)] = (backend, new)
    return held[1]


class _RegionBackend:
    """The user's backend, whose compiled graphs are each returned as a ``Region``."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self._torchdynamo_orig_backend = backend  # what innermost_backend() unwraps to

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        compiled = self.backend(gm, example_inputs)
        return Region(gm, compiled, self.backend).run_from_dynamo


class Region:
    """One compiled graph: ``compiled`` (what the user's ``backend`` made of it) and ``gm`` (the graph dynamo traced,
    for the reference), named ``compiled:<function>#<frame>``."""

    def __init__(self, gm: torch.fx.GraphModule, compiled, backend=None) -> None:
        self.gm, self.compiled, self.backend = gm, compiled, backend
        self.name, self.location = _region_name(gm)

    def run_compiled(self, *args):
        """The compiled graph, run as dynamo runs what a backend returns (unboxed)."""
        return self.compiled(*args)

    def run_from_dynamo(self, *args):
        for mode in reversed(_current_modes()):
            if getattr(mode, "checks_regions", False):
                return mode.check_region(self, args)
        return self.run_compiled(*args)


def _current_modes() -> list:
    from torch.overrides import _get_current_function_mode_stack

    return _get_current_function_mode_stack()


_frame_counts: dict[str, int] = {}


def _region_name(gm: torch.fx.GraphModule) -> tuple[str, str]:
    """``compiled:<function>#<n>`` (the function whose frame dynamo compiled, past the decorators' wrappers around it:
    ``LlamaForCausalLM.forward``; ``n`` counts that function's graphs in this process) and the source line of the
    graph's first call."""
    from torch._guards import TracingContext

    from ..numerics.graph_reference import SKIPPED_FRAMES, user_frames

    context = TracingContext.try_get()
    codes = list(getattr(context, "traced_code", None) or ())  # the frame's code first
    function = getattr(codes[0], "co_qualname", codes[0].co_name) if codes else ""
    library = bool(codes) and codes[0].co_filename.startswith(SKIPPED_FRAMES)  # torch's (a torch module's forward)
    first = next((frames for node in gm.graph.nodes if node.op in ("call_function", "call_method", "call_module")
                  and (frames := user_frames(node))), [])
    location = f"{first[-1][0]}:{first[-1][1]}" if first else ""
    if not function or "<locals>" in function or library:  # a decorator's wrapper, or torch's frame
        node = next((n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")), None)
        called = [name for _, _, name in user_frames(node, torch_frames=True)] if node is not None else []
        # no frame of the user's (dynamo records none inside torch's modules): the module column names the model
        function = "forward" if "forward" in called else called[0] if called else "graph"
    with _lock:
        n = _frame_counts[function] = _frame_counts.get(function, -1) + 1
    return f"compiled:{function}#{n}", location
