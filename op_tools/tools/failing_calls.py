"""OpAutoCompare's failing calls, saved for the offline replay in OpCapture's file format.

A call is saved under ``op_capture_results/<op>/<pid>/autocompare/<forward_id>/<time>/``: ``device/`` holds its
inputs as they were before the call, its outputs and, once its backward ran, its gradients; ``cpu/`` the same for
the float64 reference. At most ``OP_AUTOCOMPARE_MAX_SAVED`` calls of each op are saved, and at most
``OP_AUTOCOMPARE_MAX_SAVE_BYTES`` in all (a call's size counted before it is saved, its gradients' when they come);
later ones are counted. The
host copies are made when the call is saved; the files are written by a background thread (``stop()`` waits), and
a tensor two saved calls share is written once.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time

import torch

from ..config.variables import CommonConfig
from ..numerics.host_copies import snapshot
from ..numerics.reference import recast
from ..ops.arguments import iter_tensors, map_tensors
from ..output import reporting, result_files
from ..output.capture_format import TensorStore
from .compare_state import CompareState


class FailingCalls:
    """The failing calls of one OpAutoCompare session, written in the background."""

    def __init__(self, common: CommonConfig, max_saved: int, pid_folder: str, tally, logger: logging.Logger,
                 max_bytes: int = 64 << 20) -> None:
        self.common, self.max_saved, self.pid_folder, self._logger = common, max_saved, pid_folder, logger
        self.max_bytes, self.used = max_bytes, 0  # bytes the saved calls may take, and take so far
        self.over_bytes: collections.Counter = collections.Counter()  # op -> failing calls past max_bytes
        self.store = TensorStore(dedup=True, tally=tally)
        self.writer = result_files.BackgroundWriter("OpAutoCompare")
        self.saved: collections.Counter = collections.Counter()  # op -> failing calls saved
        self.not_saved: collections.Counter = collections.Counter()  # op -> failing calls past max_saved
        self._lock = threading.Lock()

    def save(self, name: str, forward_id: int, state: CompareState, cast: dict, device_out, ref_out,
             grads=None, record: dict | None = None) -> None:
        """Save a failing call's forward (the first time) and, given ``grads`` (device gradients, upstream gradients,
        reference gradients), its backward; ``state`` is the call's (its folder is kept there). ``record``: the
        call's rank, step and time (``result_files.record_fields``), kept in its ``input.pth`` files."""
        base = state.save_dir
        if base is None:
            size = _size((state.cpu_args, state.cpu_kwargs, device_out)) * 2 + _size(ref_out)  # float64 inputs
            with self._lock:
                allowed = self.saved[name] < self.max_saved
                if not allowed:
                    self.not_saved[name] += 1
                elif self.used + size > self.max_bytes:
                    allowed = False
                    self.over_bytes[name] += 1
                else:
                    self.saved[name] += 1
                    self.used += size
            base = state.save_dir = result_files.results_path(
                self.common, "op_capture_results", name, self.pid_folder, "autocompare", str(forward_id),
                time.strftime("%Y-%m-%d-%H-%M-%S", time.localtime())) if allowed else ""
        if not base:
            return
        if not state.saved_forward:
            # the inputs whose gradients were compared are saved requiring grad: the replay runs their backward
            marked = {id(h) for h in state.grad_snaps}
            device_args, device_kwargs = _marked(state.cpu_args, marked), _marked(state.cpu_kwargs, marked)
            ref_args, ref_kwargs = recast(device_args, cast), recast(device_kwargs, cast)
            for side, args, kwargs, out in (("device", device_args, device_kwargs, device_out),
                                            ("cpu", ref_args, ref_kwargs, ref_out)):
                self._write(base, side, "input", name, args, kwargs, record)
                self._write(base, side, "output", name, _flat_out(out), {})
        if grads is not None:
            device_grads, upstream, reference_grads = grads
            with self._lock:  # the call was saved within the budget: its gradients are its own
                self.used += _size((device_grads, upstream)) * 2 + _size(tuple(reference_grads))
            upstream64 = tuple(None if g is None else g.double() if g.is_floating_point() else g for g in upstream)
            self._write(base, "device", "grad_inputs", name, device_grads, {})
            self._write(base, "device", "grad_outputs", name, upstream, {})
            self._write(base, "cpu", "grad_inputs", name, tuple(reference_grads), {})
            self._write(base, "cpu", "grad_outputs", name, upstream64, {})
        self._logger.debug("OpAutoCompare: saved %s", base)

    def _write(self, base: str, side: str, identifier: str, name: str, args, kwargs, record: dict | None = None
               ) -> None:
        args = map_tensors(tuple(args), _on_host)  # values compared on their device are copied now
        path = os.path.join(base, side, f"{identifier}.pth")
        payload = {"name": name, "args": tuple(args), "kwargs": dict(kwargs), "identifier": identifier,
                   **(record or {})}
        self.writer.submit(lambda: self.store.save(path, payload), path)

    def drain(self) -> None:
        self.writer.drain()

    def lost(self) -> str:
        """The files of failing calls that could not be written ('' when none), for the verdict."""
        if not self.writer.failed:
            return ""
        return (f"{self.writer.failed} file{'s' if self.writer.failed != 1 else ''} of failing calls not written "
                f"(the first {self.writer.first_failure})")

    def summary_line(self) -> str:
        """What was saved where, and what was not, for the summary ("" when no failing call was met), fitted to the
        console (``reporting.fit_path``)."""
        if not (self.saved or self.over_bytes):
            return ""
        folder = self.folder()
        parts = [f"{sum(self.saved.values())} failing calls saved for the replay under {folder}"
                 + (f" ({self.used / 2**20:.1f} MiB at most)" if self.used else "")]
        if self.not_saved:
            parts.append(f"{sum(self.not_saved.values())} more not saved (OP_AUTOCOMPARE_MAX_SAVED={self.max_saved} "
                         "per op)")
        if self.over_bytes:
            parts.append(f"{sum(self.over_bytes.values())} not saved for their size (OP_AUTOCOMPARE_MAX_SAVE_BYTES="
                         f"{self.max_bytes / 2**20:g}M in all; the largest: {self.over_bytes.most_common(1)[0][0]})")
        return reporting.fit_path("; ".join(parts), folder)  # the listing below the summary names it whole

    def folder(self) -> str:
        """Where the failing calls are saved, as the console shows it (``reporting.shown_path``)."""
        return reporting.shown_path(result_files.results_path(self.common, "op_capture_results"))


def _size(obj) -> int:
    """The bytes of the tensors in ``obj`` (a call's arguments, outputs or gradients), as saved."""
    return sum(t.numel() * t.element_size() for t in iter_tensors(obj))


def _on_host(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_cpu else snapshot(t)


def _marked(obj, marked: set):
    """``obj`` with the tensors whose id is in ``marked`` as new leaves requiring grad (for a saved call)."""
    if not marked:
        return obj
    return map_tensors(obj, lambda t: t.detach().requires_grad_() if id(t) in marked else t)


def _flat_out(out) -> tuple:
    """The device and reference values a saved call holds: the outputs, then the written arguments."""
    result, *written = out
    return (*reporting.as_tuple(result), *written)
