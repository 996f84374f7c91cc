"""``simccl``: the sim device's collective library, staging tensors through gloo on the CPU.

``torch.distributed.init_process_group("simccl")`` (or ``"nccl"`` under ditorch's transfer) gives a
process group whose collectives copy sim tensors to the host, run gloo's collective there and copy
the result back, so DDP runs on sim under ``torchrun``.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

NAME = "simccl"
_lock = threading.Lock()
_registered = False


class _DoneWork(dist._Work):
    """A collective that finished before it was returned (the sim device is synchronous)."""

    def __init__(self, result) -> None:
        super().__init__()
        self._future: torch.futures.Future = torch.futures.Future()
        self._future.set_result(result)

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self):
        return self._future


def _to_host(tensors):
    return [t.to("cpu", copy=True) for t in tensors]


def _copy_back(targets, hosts) -> None:
    with torch.no_grad():
        for target, host in zip(targets, hosts):
            target.copy_(host)


class SimProcessGroup(dist.ProcessGroup):
    """Collectives over sim (or CPU) tensors, each carried out by a gloo group on host copies."""

    def __init__(self, store, rank: int, size: int, timeout) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # an overload missing from torch's stub
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)

    def getBackendName(self) -> str:  # noqa: N802 - ProcessGroup's name
        return NAME

    def allreduce(self, tensors, opts=None):
        hosts = _to_host(tensors)
        self._gloo.allreduce(hosts, opts or dist.AllreduceOptions()).wait()
        _copy_back(tensors, hosts)
        return _DoneWork(tensors)

    def broadcast(self, tensors, opts=None):
        hosts = _to_host(tensors)
        self._gloo.broadcast(hosts, opts or dist.BroadcastOptions()).wait()
        _copy_back(tensors, hosts)
        return _DoneWork(tensors)

    def allgather(self, output_lists, inputs, opts=None):
        host_outputs = [_to_host(outputs) for outputs in output_lists]
        self._gloo.allgather(host_outputs, _to_host(inputs), opts or dist.AllgatherOptions()).wait()
        for outputs, hosts in zip(output_lists, host_outputs):
            _copy_back(outputs, hosts)
        return _DoneWork(output_lists)

    def _allgather_base(self, output, input, opts=None):  # noqa: A002 - ProcessGroup's signature
        host_output = output.to("cpu", copy=True)
        self._gloo._allgather_base(host_output, input.to("cpu"), opts or dist.AllgatherOptions()).wait()
        _copy_back([output], [host_output])
        return _DoneWork([output])

    def reduce_scatter(self, outputs, input_lists, opts=None):
        host_outputs = _to_host(outputs)
        host_inputs = [_to_host(inputs) for inputs in input_lists]
        self._gloo.reduce_scatter(host_outputs, host_inputs, opts or dist.ReduceScatterOptions()).wait()
        _copy_back(outputs, host_outputs)
        return _DoneWork(outputs)

    def barrier(self, opts=None):
        self._gloo.barrier(opts or dist.BarrierOptions()).wait()
        return _DoneWork([])


def _create(store, rank: int, size: int, timeout) -> SimProcessGroup:
    return SimProcessGroup(store, rank, size, timeout)


def register() -> None:
    """Make ``simccl`` a torch.distributed backend for sim (and CPU) tensors. Idempotent."""
    global _registered
    with _lock:
        if _registered or not dist.is_available():
            return
        dist.Backend.register_backend(NAME, _create, devices=["sim", "cpu"])
        _registered = True
