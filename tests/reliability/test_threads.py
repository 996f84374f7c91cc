"""Threads: two threads training at once, each under its own OpTimeMeasure / OpCapture (a tool handles the calls
of the thread that started it: torch's function-mode stack is per thread).

No crash, and each tool's records are intact (the same per-op counts as a lone run) and attributed to its own
thread."""

from __future__ import annotations

import collections
import functools
import threading

import pytest
from tiny_models import tiny_llama, train_llama

import op_tools

one_layer = functools.partial(tiny_llama, layers=1)


@pytest.mark.parametrize("tool_class", [op_tools.OpTimeMeasure, op_tools.OpCapture], ids=lambda t: t.__name__)
def test_two_threads_each_under_a_tool_keep_their_own_intact_records(tool_class, sim, monkeypatch):
    if tool_class is op_tools.OpCapture:
        monkeypatch.setenv("OP_CAPTURE_MODE", "summary")
    with tool_class() as alone:
        train_llama(sim, steps=2, model_factory=one_layer)
    results, tools, errors = {}, {}, []

    def worker(index: int) -> None:
        try:
            with tool_class() as tool:
                tools[index] = (tool, threading.get_ident())
                results[index] = train_llama(sim, steps=2, seed=0, model_factory=one_layer)
        except BaseException as e:  # reported below: a thread's exception would otherwise be lost
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    # both trained (the losses differ from a lone run: torch's random generator is shared by the threads)
    assert all(len(losses) == 2 and losses[1] < losses[0] for losses in results.values()) and len(results) == 2
    if tool_class is op_tools.OpTimeMeasure:
        per_op = lambda m: {n: (t.calls, t.backward_calls) for n, t in m.totals.items()}  # noqa: E731
        for tool, ident in tools.values():
            records = tool.measurements.records
            assert {r.thread for r in records} == {ident}  # forward calls: only this thread's
            assert per_op(tool.measurements) == per_op(alone.measurements)  # every call, none of the other's
            assert all(r.forward_ns > 0 and r.input for r in records)
    else:
        counts = lambda tool: collections.Counter({k: v["count"] for k, v in tool.summary.items()})  # noqa: E731
        for tool, _ in tools.values():
            assert counts(tool) == counts(alone)
