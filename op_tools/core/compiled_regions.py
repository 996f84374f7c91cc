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
"""

from __future__ import annotations

import functools
import logging
import sys
import threading

import torch

from ..numerics import fused_statistics

_lock = threading.RLock()
_active: list = []  # the started tools' loggers, one per activation, in start order
_stance = None  # the set_stance object that forced eager (its __exit__ restores the stance before), or None
_watch = None  # our wrapper of torch.compile while installed, or None

LINE = ("%s: torch.compile'd code runs eagerly while the tool is active, so that it sees every op "
        "(torch.compiler.set_stance(\"force_eager\"); compiled graphs are kept for after)")


def enter(name: str, logger: logging.Logger) -> None:
    """A tool named ``name`` starts: force eager where dynamo is loaded, else watch ``torch.compile``."""
    with _lock:
        _active.append((name, logger))
        if "torch._dynamo" in sys.modules:
            if _force_eager() and _compiled_anything():
                logger.info(LINE, name)
        elif len(_active) == 1:
            _watch_compile()


def exit() -> None:  # noqa: A001 - the pair of enter()
    """The latest activation stops: the stance and ``torch.compile`` are put back after the last one."""
    global _stance
    with _lock:
        _active.pop()
        if _active:
            return
        if _stance is not None:
            stance, _stance = _stance, None
            try:
                stance.__exit__(None, None, None)
            except RuntimeError as error:  # stopped inside a compiled region: the stance stays, said
                logging.getLogger("op_tools").warning("op_tools: could not restore torch.compile's stance: %s", error)
        _unwatch_compile()


def _force_eager() -> bool:
    """Force eager once for all activations; False when it cannot be (set inside a compiled region)."""
    global _stance
    if _stance is not None:
        return True
    try:
        _stance = torch.compiler.set_stance("force_eager")
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

        return counters["frames"]["total"] > fused_statistics.own_frames()  # the tools' own compiled statistics
    except (ImportError, AttributeError, KeyError):  # another dynamo: say it rather than stay silent
        return True


def _watch_compile() -> None:
    global _watch
    original = torch.compile

    @functools.wraps(original)
    def compile(*args, **kwargs):  # noqa: A001 - torch's name
        compiled = original(*args, **kwargs)  # imports torch._dynamo
        with _lock:
            if _active and _stance is None and _force_eager():
                for name, logger in _active:
                    logger.info(LINE, name)
        return compiled

    compile.__wrapped_by_op_tools__ = original  # type: ignore[attr-defined]  # what _unwatch_compile puts back
    torch.compile = compile
    _watch = compile


def _unwatch_compile() -> None:
    global _watch
    if _watch is not None and torch.compile is _watch:  # patched over since: ours stays, idle without tools
        torch.compile = _watch.__wrapped_by_op_tools__  # type: ignore[attr-defined]
    _watch = None
