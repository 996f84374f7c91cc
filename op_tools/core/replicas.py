"""Replica fingerprints: whether data-parallel ranks still hold the same parameters and gradients, step by step.

Under torchrun with more than one rank, while a tool runs, each rank writes before every optimizer step a checksum
of each replicated parameter and of its gradient: the sum of the tensor's bits read as integers (any one changed
element changes it). ``python -m op_tools.report`` compares them across ranks and names the first step and parameter
where replicas disagree. Sharded parameters (a DTensor with a ``Shard`` placement, FSDP1's flat parameters) differ
between ranks by design and are not written.

Where the work runs: one integer reduction per parameter and per gradient, and a floating sum per parameter (inf/nan
propagate through it), on the device, stacked and read back in one transfer per step (a host synchronisation per
step); only a parameter whose sum is not finite is looked at again, to tell an overflowing sum from an inf.
``OP_TOOLS_REPLICA_FINGERPRINTS=0`` switches it off.

File: ``<results>/op_replica_fingerprints/rank<N>/fingerprints_<session>.jsonl``: a header line (format, rank,
world size, and ``launch``, which every rank of one torchrun launch shares: the report matches by it the files of
one run where several wrote into one folder), then ``{"step", "time", "params": {name: checksum}, "grads": {name:
checksum}}`` per step, ``step`` counted as the tools count it (optimizer steps finished since the tool started), and
``"nonfinite"``: the parameters holding an inf or a NaN (replicas that agree bit for bit may all be NaN). Each step's
line is flushed as it is written (a killed process keeps the steps before); the file is ``.partial`` until the last
tool stops, or the process exits or is ended by SIGTERM with a tool still on (``finish``): a ``.partial`` file is a
rank whose run ended early.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import torch

from ..config.variables import CommonConfig
from ..output import result_files
from . import module_path
from .steps import STEPS

FOLDER = "op_replica_fingerprints"
FORMAT = "op_tools fingerprints"
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_logger = logging.getLogger("op_tools")


def _world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def _launch() -> str | None:
    """torchrun's rendezvous id (a new one per ``--standalone`` launch) and restart count; None outside torchrun."""
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    return None if run is None else f"{run}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _replicated(p: torch.Tensor) -> torch.Tensor | None:
    """The tensor every replica holds alike (a DTensor's local part when it is replicated), or None when sharded."""
    if type(p).__name__ == "FlatParameter":  # FSDP1: this rank's shard of a flattened group of parameters
        return None
    placements = getattr(p, "placements", None)
    if placements is not None:  # a DTensor
        if any(type(placement).__name__ != "Replicate" for placement in placements):
            return None
        return p._local_tensor  # type: ignore[attr-defined]
    return p


def checksum(t: torch.Tensor) -> torch.Tensor:
    """The sum of ``t``'s bits read as integers, an int64 on ``t``'s device."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    bits = _BITS.get(t.element_size())
    if bits is None or t.is_complex():
        t = t.view(torch.uint8)
    elif t.dtype != bits:
        t = t.view(bits)
    return t.sum(dtype=torch.int64)


def _float_sum(t: torch.Tensor) -> torch.Tensor:
    """A floating sum of ``t``: inf or NaN when an element is (or, rarely, when the sum overflows); the cheapest
    reduction that carries it (on a CPU, a float32 sum costs a third of an inf-norm or of ``isfinite().all()``)."""
    return t.detach().sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32)


class ReplicaFingerprints:
    """Installed by the first tool started under torchrun (``acquire``), removed with the last (``release``)."""

    def __init__(self) -> None:
        self._users = 0
        self._hook: Any = None  # the optimizer pre-step hook's handle while installed
        self._file: result_files.JsonLinesFile | None = None
        self._base = 0
        self._lock = threading.RLock()  # re-entrant: finish() runs in a SIGTERM handler, maybe inside acquire()

    def acquire(self, common: CommonConfig, stem: str) -> None:
        with self._lock:
            self._users += 1
            if self._hook is not None or common.rank is None or _world_size() < 2 or not common.replica_fingerprints:
                return
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            path = result_files.results_path(common, FOLDER, f"fingerprints_{stem}.jsonl")
            self._file = result_files.JsonLinesFile(path)
            self._file.write({"format": FORMAT, "version": 1, "rank": common.rank, "world_size": _world_size(),
                              "launch": _launch()})
            self._file.flush()  # once: a rank killed before its first step leaves a file that says whose it is
            self._base = STEPS.count
            self._hook = register_optimizer_step_pre_hook(self._before_step)

    def release(self) -> None:
        with self._lock:
            self._users = max(0, self._users - 1)
            if not self._users:
                self.finish()

    def finish(self) -> None:
        """Remove the hook and close the file (``.partial`` no more), whoever still holds it: at the last
        ``release``, and at exit or on SIGTERM with tools still on (``engine.flush_unfinished``), as their files."""
        with self._lock:
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
            if self._file is not None:
                self._file.close()
                self._file = None

    def _before_step(self, optimizer, *_) -> None:
        try:
            self._write(optimizer)
        except Exception:  # noqa: BLE001 - a fingerprint lost never stops the user's step; said once per process
            if not getattr(self, "_failed", False):
                self._failed = True
                _logger.exception("op_tools: writing the replica fingerprints failed; the report will not compare "
                                  "replicas after this step")

    def _write(self, optimizer) -> None:
        names = module_path.parameter_names()
        params, grads = [], []
        for g, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                local = _replicated(p)
                if local is None:
                    continue
                name = names.get(id(p)) or f"param_groups[{g}][{i}]"
                params.append((name, local))
                grad = p.grad
                if grad is not None:
                    local_grad = _replicated(grad)
                    if local_grad is not None:
                        grads.append((name, local_grad))
        if not params:
            return
        tensors = [t for _, t in params + grads]
        sums: list[int] = [0] * len(tensors)
        nonfinite: list[str] = []
        by_device: dict[torch.device, list[int]] = {}
        for i, t in enumerate(tensors):
            by_device.setdefault(t.device, []).append(i)
        with torch.no_grad(), torch._C.DisableTorchFunction():  # the tools' own work: no tool sees these calls
            for indices in by_device.values():  # one transfer per device
                checked = [i for i in indices if i < len(params) and tensors[i].is_floating_point()]
                values = torch.stack([checksum(tensors[i]) for i in indices])
                if checked:  # replicas that agree bit for bit may all hold inf/nan: say so beside the checksums
                    finite = torch.isfinite(torch.stack([_float_sum(tensors[i]) for i in checked]))
                    values = torch.cat([values, finite.to(torch.int64)])
                read = values.cpu().tolist()
                for i, value in zip(indices, read):
                    sums[i] = value
                suspects = [i for i, ok in zip(checked, read[len(indices):]) if not ok]
                if suspects:  # a sum can overflow where no element is inf: told apart only here, off the common path
                    nonfinite.extend(params[i][0] for i in suspects if not torch.isfinite(tensors[i]).all().item())
        record = {"step": STEPS.count - self._base, "time": round(time.time(), 6),
                  "params": dict(zip((n for n, _ in params), sums[:len(params)])),
                  "grads": dict(zip((n for n, _ in grads), sums[len(params):])),
                  "nonfinite": nonfinite}
        file = self._file
        if file is not None:
            file.write(record)
            file.flush()  # one line a step: on disk before the step runs, should the process be killed in it


REPLICAS = ReplicaFingerprints()
