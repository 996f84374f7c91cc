"""Small per-call results computed on the device and read back by the host in batches, without waiting for them.

A tool that needs a few numbers per call (a flag, a handful of statistics) computes them on the device and ``put``s
them here with a token of its own. Every ``batch`` puts, the queued values are joined on the device (one kernel),
copied to the host with ``non_blocking=True`` (into pinned memory: no synchronisation) and an event is recorded
after the copy. ``ready()`` hands back, in put order, the tokens and values of every batch whose event has
completed (``query()``, which never blocks); ``drain()`` sends what is queued and waits for everything (one
synchronisation), for the end of a run or a caller that must know now.

So a step of N calls costs N small kernels, N/batch copies and no synchronisation, where reading each call's values
costs N synchronisations, each draining the device's queue and stalling the host: on a fast device that, not the
arithmetic, is a tool's cost. A device whose module has no ``Event`` is read with a blocking copy per batch; values
on the CPU need no copy at all.

>>> readback = DeviceReadback(batch=64)
>>> readback.put(torch.stack(torch._foreach_norm(tensors, float("inf"))), token=call)   # doctest: +SKIP
>>> for call, values in readback.ready(): ...                                             # doctest: +SKIP
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterator
from typing import Any

import torch

_CPU = torch.device("cpu")


class Reduced:
    """A put's value to be read back reduced by ``reduce``, which maps a list of such values to a ``(k, width)``
    tensor, ``k`` the sum of their ``count``: the values of every put of a batch with the same ``reduce`` object are
    handed to it together when the batch is sent, a few kernels a batch instead of a few a put (a run recording's
    fingerprints: a join, a product and a sum). The value is whatever ``reduce`` takes (a run recording's: one call's
    block sums, ``count`` rows of the result)."""

    __slots__ = ("value", "reduce", "width", "count")

    def __init__(self, value, reduce, width: int, count: int = 1) -> None:
        self.value, self.reduce, self.width, self.count = value, reduce, width, count


class _Batch:
    """Values of several puts, those on the device joined and on their way to the host, those on the host as they
    are (``None`` in ``on_host``: the put's values are ``segments`` of the joined copy, ``(start, size)`` each)."""

    __slots__ = ("tokens", "segments", "on_host", "host", "event")

    def __init__(self, tokens: list, segments: list, on_host: list, host: torch.Tensor | None, event) -> None:
        self.tokens, self.segments, self.on_host, self.host, self.event = tokens, segments, on_host, host, event

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def items(self) -> Iterator[tuple[Any, list[float]]]:
        values = self.host.tolist() if self.host is not None else []  # host memory: no device read
        for token, segments, on_host in zip(self.tokens, self.segments, self.on_host):
            if on_host is not None:
                yield token, on_host
            elif len(segments) == 1:
                start, size = segments[0]
                yield token, values[start:start + size]
            else:
                yield token, [v for start, size in segments for v in values[start:start + size]]


class DeviceReadback:
    """Queue of ``(token, 1-D device tensor)`` read back in batches of ``batch`` puts; thread-safe."""

    def __init__(self, batch: int = 64) -> None:
        if batch < 1:
            raise ValueError(f"DeviceReadback: batch must be at least 1, not {batch}")
        self.batch = batch
        self._lock = threading.Lock()
        self._queued: list[tuple[Any, torch.Tensor | list]] = []  # since the last send, one device
        self._in_flight: collections.deque[_Batch] = collections.deque()
        self._queued_device: torch.device | None = None  # the device of the values queued (host values aside)

    def __len__(self) -> int:
        """Puts not yet handed back."""
        with self._lock:
            return len(self._queued) + sum(len(b.tokens) for b in self._in_flight)

    def put(self, values: torch.Tensor | list, token: Any) -> None:
        """Queue ``values`` to be read back, flat, with ``token``: a tensor (any shape and floating dtype, on any
        device), or a list of tensors on one device (0-dim, or of any shape) and ``Reduced`` rows, joined only when
        the batch is sent (no kernel now)."""
        with self._lock:
            device = self._device(values)
            if device.type != "cpu":  # one device per batch (host values join any): batches stay in put order
                if self._queued_device is not None and self._queued_device != device:
                    self._send()
                self._queued_device = device
            self._queued.append((token, values))
            if len(self._queued) >= self.batch:
                self._send()

    def send(self) -> None:
        """Start the copy of what is queued now, a batch not yet full (a step's last calls); never waits."""
        with self._lock:
            if self._queued:
                self._send()

    def ready(self) -> Iterator[tuple[Any, list[float]]]:
        """``(token, values)`` of every batch already on the host, in put order; never waits."""
        while True:
            with self._lock:
                if not self._in_flight or not self._in_flight[0].done():
                    return
                batch = self._in_flight.popleft()
            yield from batch.items()

    def drain(self) -> Iterator[tuple[Any, list[float]]]:
        """Everything queued, in put order, waiting for the device where needed (one synchronisation)."""
        with self._lock:
            if self._queued:
                self._send()
            batches, self._in_flight = list(self._in_flight), collections.deque()
        for batch in batches:
            batch.wait()
            yield from batch.items()

    def discard(self) -> None:
        """Forget what is queued and in flight (a tool that found what it looked for)."""
        with self._lock:
            self._queued, self._in_flight, self._queued_device = [], collections.deque(), None

    @staticmethod
    def _device(values) -> torch.device:
        return values.device if isinstance(values, torch.Tensor) else values[0].device

    def _send(self) -> None:
        """Join the queued values on their device (one kernel, and a few for each kind of ``Reduced`` rows) and start
        their copy to the host; host values are joined as well, and read at once (no copy)."""
        tokens: list = []
        device_puts: list = []
        host_puts: list[tuple[int, Any]] = []  # (index, values) of the puts of host values
        on_host: list[list[float] | None] = []
        for token, values in self._queued:
            tokens.append(token)
            on_host.append(None)
            if self._device(values).type == "cpu":
                host_puts.append((len(on_host) - 1, values))
            else:
                device_puts.append(values)
        device, self._queued, self._queued_device = self._queued_device, [], None
        with torch.no_grad():
            device_segments, joined = _joined(device_puts)
            if host_puts:  # joined too, and reduced together: a reduction per put costs more than its arithmetic
                host_segments, host_joined = _joined([values for _, values in host_puts])
                host_values = host_joined.tolist() if host_joined is not None else []
                for (k, _), put_segments in zip(host_puts, host_segments):
                    on_host[k] = [v for start, size in put_segments for v in host_values[start:start + size]]
            from_device = iter(device_segments)
            segments = [None if values is not None else next(from_device) for values in on_host]
            if joined is None or device is None:
                self._in_flight.append(_Batch(tokens, segments, on_host, None, None))
                return
            event_class = getattr(getattr(torch, device.type, None), "Event", None)
            if event_class is None:  # no events to poll: read now, one synchronisation per batch
                self._in_flight.append(_Batch(tokens, segments, on_host, joined.to(_CPU), None))
                return
            host = joined.to(_CPU, non_blocking=True)  # PyTorch pins a non-blocking copy's host memory
            event = event_class()
            event.record(getattr(torch, device.type).current_stream(device))
        self._in_flight.append(_Batch(tokens, segments, on_host, host, event))


def _joined(puts: list) -> tuple[list[list[tuple[int, int]]], torch.Tensor | None]:
    """The values of ``puts`` (on one device) joined into one flat tensor, and where each put's lie in it
    (``(start, size)`` segments, in the put's order): its plain tensors as they are, its ``Reduced`` rows handed
    with the rows of every other put of the same ``reduce`` to it, reduced together: a few kernels a kind of rows."""
    segments_of: list[list[tuple]] = []  # per put: (reduce or None, first value or row, count)
    parts: list[torch.Tensor] = []
    rows: dict[Any, list] = {}  # reduce -> the values given it, in put order
    widths: dict[Any, int] = {}
    counted: dict[Any, int] = {}  # reduce -> rows of its result given so far
    plain = 0  # values of the plain parts so far
    for values in puts:
        mine: list[tuple] = []
        for t in [values] if isinstance(values, torch.Tensor) else values:
            if isinstance(t, Reduced):
                rows.setdefault(t.reduce, []).append(t.value)
                widths[t.reduce] = t.width
                first = counted.get(t.reduce, 0)
                counted[t.reduce] = first + t.count
                mine.append((t.reduce, first, t.count))
            else:
                parts.append(t)
                mine.append((None, plain, t.numel()))
                plain += t.numel()
        segments_of.append(mine)
    starts: dict[Any, int] = {}  # reduce -> where its values begin in the joined tensor
    for reduce, given in rows.items():  # one join and one reduction per kind of rows
        starts[reduce] = plain
        reduced = reduce(given)
        parts.append(reduced)
        plain += reduced.numel()
    segments = [[(first, count) if reduce is None else
                 (starts[reduce] + first * widths[reduce], count * widths[reduce])
                 for reduce, first, count in mine]
                for mine in segments_of]
    if not parts:
        return segments, None
    # stack and cat promote mixed dtypes (bfloat16 flags beside float32 statistics) in the same kernel
    dims = {p.dim() for p in parts}
    joined = torch.stack(parts) if dims == {0} else \
        torch.cat(parts if dims == {1} else [p.reshape(-1) for p in parts])
    return segments, joined


class KeptTensors:
    """Aliases of one call's tensors, kept until its values have been read back, for what only the tensors can still
    tell then (a table of their statistics, their nan and inf counts).

    Aliases, not the tensors: holding the program's tensor objects is visible to it (``torch.utils.swap_tensors``,
    which ``Module.to()`` uses, refuses a tensor referenced elsewhere). An alias shares its tensor's version counter,
    so ``get`` gives None for a tensor written in place since it was kept, and for one let go of (``KeepBudget``).
    """

    __slots__ = ("_aliases", "_versions", "nbytes", "done")

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._aliases: tuple[torch.Tensor, ...] | None
        try:
            self._aliases = tuple(t.detach() for t in tensors)
            self._versions = tuple(t._version for t in tensors)  # a tuple of ints: the collector stops tracking it
        except RuntimeError:  # inference tensors, or inference mode: no version counter tells a write, none kept
            self._aliases, self._versions = None, ()
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self.done = False

    def get(self, i: int) -> torch.Tensor | None:
        if self._aliases is None:
            return None
        alias = self._aliases[i]
        return alias if alias._version == self._versions[i] else None

    def let_go(self) -> None:
        self._aliases = None


class KeepBudget:
    """At most ``limit`` bytes of ``KeptTensors`` at a time, the oldest let go of first: the calls in flight mostly
    keep tensors the step holds anyway, and the bound holds for the temporaries it would have freed."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._kept: collections.deque[KeptTensors] = collections.deque()
        self._total = 0
        self._lock = threading.Lock()

    def keep(self, tensors: list[torch.Tensor]) -> KeptTensors:
        kept = KeptTensors(tensors)
        with self._lock:
            self._kept.append(kept)
            self._total += kept.nbytes
            while self._total > self.limit and self._kept:
                oldest = self._kept.popleft()
                if not oldest.done:  # done: no longer counted
                    oldest.done = True
                    self._total -= oldest.nbytes
                    oldest.let_go()
        return kept

    def release(self, kept: KeptTensors) -> None:
        """The call's values were read: its tensors are no longer needed."""
        with self._lock:
            if not kept.done:
                kept.done = True
                self._total -= kept.nbytes
            while self._kept and self._kept[0].done:
                self._kept.popleft()
        kept.let_go()
