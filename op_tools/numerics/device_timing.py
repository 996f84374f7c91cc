"""How long a span of device work takes: timing events where the device has them, synchronisations otherwise.

A *clock* times spans on one device; ``mark()`` before the work and ``mark()`` after it return opaque marks,
and ``span(start, end)`` turns them into ``(start_ns, duration_ns)``, the start on the host's
``time.perf_counter_ns()`` timeline:

- ``EventClock``: a timing event recorded on the device's current stream at each mark, as the device's profiler
  does it; no host synchronisation per span. ``span()`` waits for the end event only (resolve spans in batches,
  long after they were recorded, and it seldom waits at all). Start times come from the device's own timeline,
  placed on the host's by an origin event read once per clock.
- ``SyncClock``: the device synchronised at each mark, the host clock read between: a span is the whole work
  queued on the device, finished (``OP_TIME_MEASURE_SYNC=1``, or a device without timing events).
- ``HostClock``: the host clock alone, for a device with neither (the time to queue the work).
"""

from __future__ import annotations

import logging
import time

import torch

logger = logging.getLogger("op_tools")  # reporting's logger; numerics sits below output

_synchronizers: dict[str, object] = {}


def device_synchronizer(device: torch.device):
    """``synchronize(device)`` of the device's module (``torch.cuda``, ``torch.<vendor>``, ``torch.sim``), cached.

    >>> device_synchronizer(torch.device("cuda", 0))   # doctest: +SKIP
    <function synchronize at ...>
    """
    sync = _synchronizers.get(device.type)
    if sync is None:
        module = getattr(torch, device.type, None)
        sync = getattr(module, "synchronize", None)
        if not callable(sync):
            raise RuntimeError(f"torch.{device.type} has no synchronize(): {device.type} times would be "
                               "the time to queue work, not to run it")
        _synchronizers[device.type] = sync
    return sync


class HostClock:
    """Host clock only: what it measures is the time to queue work on the device."""

    method = "the host clock, unsynchronised (no timing events, no synchronize())"

    def stream(self) -> None:
        return None

    def mark(self, stream=None) -> int:
        return time.perf_counter_ns()

    def span(self, start: int, end: int) -> tuple[int, int]:
        return start, end - start


class SyncClock(HostClock):
    """The host clock read after synchronising the device: a span is all the work queued meanwhile, finished."""

    method = "synchronisations of the device around each call"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._sync = device_synchronizer(device)  # RuntimeError where the device has no synchronize()

    def mark(self, stream=None) -> int:
        self._sync(self.device)
        return time.perf_counter_ns()


EVENT_METHOD = "timing events ({}) on the op's stream"


class EventClock:
    """Timing events recorded on the stream current for the device on the calling thread.

    Events are reused once their span is read (a free list), so a long run creates only as many as are pending.
    """

    def __init__(self, device: torch.device, make_event, current_stream, kind: str) -> None:
        self.device = device
        self.kind = kind
        self.method = EVENT_METHOD.format(kind)
        self._make_event = make_event
        self._current_stream = current_stream
        self._free: list = []
        # The origin: an event whose device time is the host instant read just before it is recorded. The stream is
        # drained first, so that it runs as it is recorded; the host instant after the wait would be later by the
        # wait itself (tens of µs, more on a loaded host), and every span read from this clock would start that much
        # late against the host's clock (a CPU call's span, timed by the host, would seem to overlap the one before
        # it). With a second event it is also the probe: a backend whose events cannot time raises here, and the
        # caller falls back to synchronising.
        stream = self.stream()
        drain, origin, probe = make_event(), make_event(), make_event()
        drain.record(stream)
        drain.synchronize()
        self.origin_ns = time.perf_counter_ns()
        origin.record(stream)
        probe.record(stream)
        probe.synchronize()
        origin.elapsed_time(probe)
        self._origin = origin
        self._free += (drain, probe)

    def stream(self):
        return None if self._current_stream is None else self._current_stream(self.device)

    def mark(self, stream=None):
        """Record an event on ``stream`` (default: the current stream of the device on this thread)."""
        try:
            event = self._free.pop()
        except IndexError:  # none free (a plain pop: atomic, as hooks run on autograd's threads too)
            event = self._make_event()
        event.record(self.stream() if stream is None else stream)
        return event

    def span(self, start, end) -> tuple[int, int]:
        """Wait for ``end`` (only it: no device synchronisation), read both events, free them for reuse."""
        end.synchronize()
        duration_ms = start.elapsed_time(end)
        start_ns = self.origin_ns + round(self._origin.elapsed_time(start) * 1e6)
        self._free += (start, end)
        return start_ns, round(duration_ms * 1e6)


def timing_methods(clocks) -> str:
    """How ``clocks`` timed their calls, each way said once: the kinds of timing events together
    (``timing events (torch.cuda.Event, torch.sim.Event) on the op's stream`` where a device answers to two
    names, as sim does to ``cuda``), then the other ways."""
    events = sorted({clock.kind for clock in clocks if isinstance(clock, EventClock)})
    others = sorted({clock.method for clock in clocks if not isinstance(clock, EventClock)})
    return "; ".join(([EVENT_METHOD.format(", ".join(events))] if events else []) + others)


def _event_makers(device: torch.device):
    """Ways to make timing events on ``device``, best first: the device module's ``Event`` (``torch.cuda.Event``,
    ``torch.npu.Event``, ``torch.sim.Event``), then ``torch.Event`` (recent PyTorch; on Python PrivateUse1
    backends it cannot synchronise, hence second)."""
    module = getattr(torch, device.type, None)
    event_class = getattr(module, "Event", None)
    if callable(event_class):
        yield (lambda: event_class(enable_timing=True)), getattr(module, "current_stream", None), \
            f"torch.{device.type}.Event"
    generic = getattr(torch, "Event", None)
    if callable(generic):
        yield (lambda: generic(device=device, enable_timing=True)), None, "torch.Event"


def clock_for(device: torch.device, synchronise: bool):
    """The clock for ``device``: timing events unless ``synchronise`` or the device has none that time; then
    synchronisations (``RuntimeError`` where the device has no ``synchronize()``: the caller reports it and may
    fall back to ``HostClock``)."""
    if not synchronise:
        for make_event, current_stream, kind in _event_makers(device):
            try:
                return EventClock(device, make_event, current_stream, kind)
            except Exception as error:  # any backend error: this kind of event cannot time here
                logger.debug("%s cannot time %s (%s: %s); trying the next way", kind, device, type(error).__name__,
                             error)
    return SyncClock(device)
