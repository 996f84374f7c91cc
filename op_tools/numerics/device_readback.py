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


class _Batch:
    """Values of several puts on one device, joined and on their way to the host."""

    __slots__ = ("tokens", "sizes", "host", "event")

    def __init__(self, tokens: list, sizes: list[int], host: torch.Tensor, event) -> None:
        self.tokens, self.sizes, self.host, self.event = tokens, sizes, host, event

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def items(self) -> Iterator[tuple[Any, list[float]]]:
        values = self.host.tolist()  # a host tensor: no device read
        start = 0
        for token, size in zip(self.tokens, self.sizes):
            yield token, values[start:start + size]
            start += size


class DeviceReadback:
    """Queue of ``(token, 1-D device tensor)`` read back in batches of ``batch`` puts; thread-safe."""

    def __init__(self, batch: int = 64) -> None:
        if batch < 1:
            raise ValueError(f"DeviceReadback: batch must be at least 1, not {batch}")
        self.batch = batch
        self._lock = threading.Lock()
        self._queued: list[tuple[Any, torch.Tensor | list[torch.Tensor]]] = []  # since the last send, one device
        self._in_flight: collections.deque[_Batch] = collections.deque()

    def __len__(self) -> int:
        """Puts not yet handed back."""
        with self._lock:
            return len(self._queued) + sum(len(b.tokens) for b in self._in_flight)

    def put(self, values: torch.Tensor | list[torch.Tensor], token: Any) -> None:
        """Queue ``values`` to be read back, flat, with ``token``: a tensor (any shape and floating dtype, on any
        device), or a list of 0-dim tensors on one device, joined only when the batch is sent (no kernel now)."""
        with self._lock:
            device = values.device if isinstance(values, torch.Tensor) else values[0].device
            if self._queued and self._device(self._queued[0][1]) != device:
                self._send()  # one device per batch: batches stay in put order
            self._queued.append((token, values))
            if len(self._queued) >= self.batch:
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
            self._queued, self._in_flight = [], collections.deque()

    @staticmethod
    def _device(values) -> torch.device:
        return values.device if isinstance(values, torch.Tensor) else values[0].device

    def _send(self) -> None:
        """Join the queued values on their device (one kernel) and start their copy to the host."""
        tokens = [token for token, _ in self._queued]
        sizes = [v.numel() if isinstance(v, torch.Tensor) else len(v) for _, v in self._queued]
        parts: list[torch.Tensor] = []
        for _, values in self._queued:
            parts.extend([values] if isinstance(values, torch.Tensor) else values)
        self._queued = []
        device = parts[0].device
        with torch.no_grad():
            # stack and cat promote mixed dtypes (bfloat16 flags beside float32 statistics) in the same kernel
            if all(p.dim() == 0 for p in parts):
                joined = torch.stack(parts)
            else:
                joined = torch.cat([p.reshape(-1) for p in parts])
            if device.type == "cpu":
                self._in_flight.append(_Batch(tokens, sizes, joined, None))
                return
            event_class = getattr(getattr(torch, device.type, None), "Event", None)
            if event_class is None:  # no events to poll: read now, one synchronisation per batch
                self._in_flight.append(_Batch(tokens, sizes, joined.to(_CPU), None))
                return
            host = joined.to(_CPU, non_blocking=True)  # PyTorch pins a non-blocking copy's host memory
            event = event_class()
            event.record(getattr(torch, device.type).current_stream(device))
        self._in_flight.append(_Batch(tokens, sizes, host, event))
