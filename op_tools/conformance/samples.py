"""One OpInfo in one dtype: its sample inputs run on the device and on the CPU, and the verdict per direction.

Samples are generated on the CPU (seeded per sample by PyTorch's OpInfo iterator, so ``--sample K`` sees
the same numbers again), and each run gets its own copies of them:

1. the CPU reference: the op on the inputs in float64 (float32, then the dtype itself, where the CPU has
   no wider kernel), recording a graph when the sample has inputs that require grad;
2. the device run on copies moved to the device; an exception there is ``unsupported``;
3. forward: ``op_tools.comparison.compare_outputs(device, reference, same_dtype)``, OpAutoCompare's
   verdict, the same-dtype CPU run (the error floor) computed only when an error is above the floor;
4. backward: the same upstream gradients (drawn from a private generator, in the device's dtype) through
   both graphs, and the gradients of the inputs that require grad compared the same way.

``run_case`` returns one ``Row`` per direction; samples are worked through one at a time and
``progress(sample, direction)`` is called before each device call, so that a hang or a crash can be
attributed to a sample.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import time
from typing import Callable

import torch

from ..arguments import iter_tensors, map_tensors
from ..comparison import Comparison, ToleranceSpec, compare_outputs
from .opinfos import replay_name, skip_reason, supports_backward
from .results import Row

_CPU = torch.device("cpu")
_WIDE = {torch.float16: torch.float64, torch.bfloat16: torch.float64, torch.float32: torch.float64,
         torch.complex32: torch.complex128, torch.complex64: torch.complex128}
_FLOAT32 = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.complex32: torch.complex64}
# The reference's dtypes, tried in order; the note says what a reference that is not float64 means.
_ATTEMPTS = ((_WIDE, ""), (_FLOAT32, "reference in float32: the CPU has no float64 kernel"),
             ({}, "reference in the device's dtype: the CPU has no wider kernel"))
_UPSTREAM_SEED = 20240601


@dataclasses.dataclass(frozen=True)
class CaseOptions:
    """How ``run_case`` works through an op's samples."""

    limit_samples: int | None = None   # the first N samples only
    sample: int | None = None          # this sample only (its index among all the op's samples)
    backward: bool = True              # compare gradients where the OpInfo supports autograd
    save_dir: str = ""                 # where the inputs of the sample shown for a non-pass are saved ("": not saved)
    details: bool = False              # keep every comparison of every sample (for --sample)


@dataclasses.dataclass
class _Run:
    """One run of the op: on the device, or a CPU reference."""

    output: object = None
    leaves: list = dataclasses.field(default_factory=list)
    labels: list = dataclasses.field(default_factory=list)
    roots: list = dataclasses.field(default_factory=list)


class _Tally:
    """The samples of one direction: the worst mismatch, the first exception, why samples were not compared."""

    def __init__(self) -> None:
        self.samples = self.failing = self.raised_count = 0
        self.worst: tuple[float, int, Comparison, int] | None = None  # (score, sample, comparison, failing outputs)
        self.raised: tuple[int, str] | None = None
        self.skips: list[str] = []
        self.notes: list[str] = []

    def compared(self, index: int, comparisons: list[Comparison], note: str) -> bool:
        self.samples += 1
        if note and note not in self.notes:
            self.notes.append(note)
        failed = [c for c in comparisons if not c.passed]
        if not failed:
            return True
        self.failing += 1
        worst = max(failed, key=_score)
        if self.worst is None or _score(worst) > self.worst[0]:
            self.worst = (_score(worst), index, worst, len(failed))
        return False

    def raised_at(self, index: int, error: BaseException) -> None:
        self.samples += 1
        self.failing += 1
        self.raised_count += 1
        if self.raised is None:
            self.raised = (index, describe_error(error))

    def row(self, op: str, dtype: str, direction: str) -> Row:
        row = Row(op, dtype, direction, "pass", samples=self.samples, failing=self.failing)
        raised = f"{self.raised_count} of {self.samples} samples raised" if self.raised_count else ""
        if self.worst is not None:
            _, row.sample, c, count = self.worst
            row.status, row.output = "mismatch", c.name
            row.device_error, row.cpu_error, row.error_ratio = c.device_error, c.cpu_error, c.error_ratio
            row.max_abs_diff = c.max_abs_diff
            outputs = f" ({count} outputs fail)" if count > 1 else ""
            row.detail = "; ".join(filter(None, (
                f"sample {row.sample} {c.name}{outputs}: {c.error_info or 'differs'}",
                f"{self.failing - self.raised_count} of {self.samples} samples mismatch", raised)))
        elif self.raised is not None:
            row.status, (row.sample, message) = "unsupported", self.raised
            row.detail = f"sample {row.sample}: {message}" + (f" ({raised})" if self.raised_count > 1 else "")
        elif self.samples == 0:
            row.status = "skipped"
            row.detail = self.skips[0] if self.skips else "no sample inputs"
        if row.status != "skipped" and self.skips:
            row.detail = "; ".join(filter(None, (row.detail, f"{len(self.skips)} samples not compared: "
                                                              f"{self.skips[0]}")))
        row.detail = "; ".join(filter(None, (row.detail, *self.notes)))
        return row


def _score(c: Comparison) -> float:
    """How bad a failed comparison is: its normalised error, infinite for nan or a structural difference."""
    error = c.device_error
    return math.inf if error is None or math.isnan(error) else error


def describe_error(error: BaseException) -> str:
    """``Type: first line`` of an exception, short enough for a table cell."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    text = f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return text if len(text) <= 300 else text[:297] + "..."


# --- the runs ---

@dataclasses.dataclass
class _Sample:
    """A sample's arguments on one side (the device as the OpInfo made them, or their CPU copies)."""

    input: object
    args: tuple
    kwargs: dict
    output_process_fn_grad: Callable


def _convert(value, path: str, tensor_fn: Callable, device, cast: dict):
    """A sample's argument for one run: tensors through ``tensor_fn(t, path)``, dtypes through ``cast``, device
    arguments (of factories) to ``device`` (None: as they are)."""
    if isinstance(value, torch.Tensor):
        return tensor_fn(value, path)
    if isinstance(value, torch.dtype):
        return cast.get(value, value)
    if isinstance(value, torch.device):
        return value if device is None else torch.device(device)
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        items = [_convert(v, f"{path}[{i}]", tensor_fn, device, cast) for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        return {k: (v if device is None else str(device)) if k == "device" and isinstance(v, str)
                else _convert(v, f"{path}[{k}]", tensor_fn, device, cast) for k, v in value.items()}
    return value


def _copy_sample(sample, device) -> _Sample:
    """``sample`` with its tensors copied to ``device`` (those that require grad as leaves that do) and its device
    arguments naming ``device``."""
    def copy(t: torch.Tensor, _) -> torch.Tensor:
        return t.detach().to(device).requires_grad_(t.requires_grad)

    return _Sample(_convert(sample.input, "", copy, device, {}), _convert(sample.args, "", copy, device, {}),
                   _convert(sample.kwargs, "", copy, device, {}), sample.output_process_fn_grad)


def _run(opinfo, sample: _Sample, cast: dict, with_grad: bool) -> _Run:
    """The op on fresh copies of the sample's inputs, where they are (floating inputs through ``cast``)."""
    run = _Run()

    def tensor_fn(t: torch.Tensor, path: str) -> torch.Tensor:
        target = cast.get(t.dtype, t.dtype)
        copy = t.detach().clone() if target == t.dtype else t.detach().to(dtype=target, copy=True)
        if with_grad and t.requires_grad:
            copy.requires_grad_()
            run.leaves.append(copy)
            run.labels.append(path)
        return copy

    first = _convert(sample.input, "input", tensor_fn, None, cast)
    args = _convert(sample.args, "args", tensor_fn, None, cast)
    kwargs = _convert(sample.kwargs, "kwargs", tensor_fn, None, cast)
    with torch.set_grad_enabled(with_grad):
        run.output = opinfo.op(first, *args, **kwargs)
        if with_grad and run.leaves:
            run.roots = [t for t in iter_tensors(sample.output_process_fn_grad(run.output)) if t.requires_grad]
    return run


def _reference(opinfo, sample: _Sample, with_grad: bool) -> tuple[_Run, str]:
    """The CPU reference run and its note; raises the last attempt's error when the CPU cannot run it at all."""
    error: BaseException | None = None
    for cast, note in _ATTEMPTS:
        try:
            return _run(opinfo, sample, cast, with_grad), note
        except Exception as e:  # noqa: BLE001 - the next, narrower, attempt
            error = e
    raise error


def _on_cpu(obj):
    """CPU copies of the tensors of ``obj``, outside autograd, dense, conjugation and negation resolved."""
    def copy(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().to(_CPU)
        if t.layout != torch.strided:
            t = t.to_dense()
        return t.resolve_conj().resolve_neg()

    return map_tensors(obj, copy)


def _grads(run: _Run, upstream: list[torch.Tensor]) -> tuple:
    """The gradients of ``run``'s leaves for ``upstream`` gradients of its roots (None for an unused leaf)."""
    if not run.roots or not run.leaves:
        return tuple(None for _ in run.leaves)
    grad_outputs = [u.to(device=r.device, dtype=r.dtype) for u, r in zip(upstream, run.roots)]
    return torch.autograd.grad(run.roots, run.leaves, grad_outputs, allow_unused=True)


def _upstream(index: int, roots: list[torch.Tensor]) -> list[torch.Tensor]:
    """Upstream gradients for ``roots`` (the device's outputs), on the CPU in their dtype: each run of the sample
    gets these values."""
    generator = torch.Generator().manual_seed(_UPSTREAM_SEED + index)
    grads = []
    for root in roots:
        wide = torch.complex128 if root.is_complex() else torch.float64
        grads.append(torch.randn(root.shape, generator=generator, dtype=wide).to(root.dtype))
    return grads


def synchronize(device: torch.device) -> None:
    """Wait for the device (its asynchronous errors surface here, as on CUDA or sim's backward)."""
    if device.type == "cpu":
        return
    module = torch.get_device_module(device.type) if hasattr(torch, "get_device_module") else \
        getattr(torch, device.type, None)
    if module is not None and hasattr(module, "synchronize"):
        module.synchronize()


class _SameDtype:
    """The same-dtype CPU run (OpAutoCompare's error floor), computed once, only when a comparison asks for it.

    Where the CPU has no kernel in the dtype, float32 rounded to it is what a correct implementation gives.
    """

    def __init__(self, opinfo, sample, dtype: torch.dtype, upstream: list | None) -> None:
        self.args = (opinfo, sample, dtype, upstream)
        self.result: tuple | None = None

    def _compute(self) -> tuple:
        opinfo, sample, dtype, upstream = self.args
        with_grad = upstream is not None
        for cast in ({}, _FLOAT32):
            try:
                run = _run(opinfo, sample, cast, with_grad)
                grads = _grads(run, upstream) if with_grad else None
            except Exception:  # noqa: BLE001 - the rounded float32 run, then no floor
                continue
            wide = cast.get(dtype, dtype)
            narrow = lambda t: t.to(dtype) if t.dtype == wide != dtype else t  # noqa: B023 - used at once
            grads = None if grads is None else map_tensors(_on_cpu(grads), narrow)
            return map_tensors(_on_cpu(run.output), narrow), grads
        return None, None

    def forward(self):
        if self.result is None:
            self.result = self._compute()
        return self.result[0]

    def backward(self):
        if self.result is None:
            self.result = self._compute()
        return self.result[1]


def _random_outputs(opinfo, sample) -> bool:
    """Whether two CPU runs of the sample with different seeds give different outputs: a random op."""
    outputs = []
    for seed in (1, 2):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            try:
                outputs.append(_run(opinfo, sample, {}, False).output)
            except Exception:  # noqa: BLE001 - no CPU kernel in the dtype: the reference decides alone
                return False
    return not _same_values(*outputs)


def _same_values(a, b) -> bool:
    """Whether two CPU results hold the same values (nan equal to nan); True when that cannot be told."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        try:
            x, y = _on_cpu(a), _on_cpu(b)
            if x.shape != y.shape or x.dtype != y.dtype:
                return False
            if x.is_floating_point() or x.is_complex():  # wide enough for any kernel to compare (complex32 too)
                wide = torch.complex128 if x.is_complex() else torch.float64
                x, y = x.to(wide), y.to(wide)
                return bool(torch.equal(x, y) or torch.allclose(x, y, rtol=0, atol=0, equal_nan=True))
            return bool(torch.equal(x, y))
        except Exception:  # noqa: BLE001 - not comparable here: the verdict decides later
            return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_values(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001
        return True


# --- one op x dtype ---

@dataclasses.dataclass
class CaseResult:
    rows: list[Row]
    comparisons: list[dict] = dataclasses.field(default_factory=list)  # with CaseOptions.details


def run_case(opinfo, dtype: torch.dtype, device: torch.device, options: CaseOptions,
             tolerance: ToleranceSpec | None = None,
             progress: Callable[[int, str], None] = lambda sample, direction: None) -> CaseResult:
    """Run ``opinfo``'s samples in ``dtype`` on ``device`` and on the CPU: a forward and a backward ``Row``."""
    start = time.perf_counter()
    name, dtype_name = opinfo.full_name, str(dtype).removeprefix("torch.")
    backward_row = dtype.is_floating_point or dtype.is_complex
    forward, backward = _Tally(), _Tally()
    reason = skip_reason(opinfo, dtype, device.type)
    grad_reason = supports_backward(opinfo, dtype, device.type) if options.backward else "--no-backward"
    with_grad = grad_reason is None
    details: list[dict] = []
    shown: dict[int, tuple] = {}  # sample index -> (sample, device output, upstream): what a saved input needs
    if reason is None:
        stop = options.limit_samples if options.sample is None else options.sample + 1
        try:
            samples, made = _make_samples(opinfo, dtype, device, with_grad, stop)
        except _DeviceInputError as e:
            samples, made = [], ""
            for tally in (forward, backward) if with_grad else (forward,):
                tally.raised_at(0, RuntimeError(f"the device cannot hold the sample inputs: "
                                                f"{describe_error(e.__cause__)}"))
        except Exception as e:  # noqa: BLE001 - PyTorch's sample generator fails on the CPU too
            samples, reason = [], f"the OpInfo's sample inputs cannot be made: {describe_error(e)}"
        else:
            if made:
                forward.notes.append(made)
            if options.sample is not None and len(samples) <= options.sample:
                reason = f"no sample {options.sample}: the OpInfo has {len(samples)} samples in {dtype_name}"
    if reason is None:
        for index, sample in enumerate(samples):
            if options.sample is not None and index != options.sample:
                continue
            reason = _run_sample(opinfo, sample, index, dtype, device, with_grad, tolerance, forward, backward,
                                 progress, details if options.details else None, shown)
            if reason is not None:  # a random op: nothing of it is comparable
                break
    rows = []
    for direction, tally in (("forward", forward), ("backward", backward)):
        if direction == "backward" and not backward_row:
            continue
        row = tally.row(name, dtype_name, direction)
        if reason is not None:
            row = Row(name, dtype_name, direction, "skipped", detail=reason)
        elif direction == "backward" and grad_reason is not None:
            row = Row(name, dtype_name, direction, "skipped", detail=grad_reason)
        elif direction == "backward" and row.status == "skipped" and row.detail == "no sample inputs":
            row.detail = "no sample has an input that requires grad"
        rows.append(row)
    torch_name = replay_name(opinfo)
    seconds = time.perf_counter() - start
    for row in rows:
        row.torch_name, row.seconds, row.device = torch_name, round(seconds, 3), device.type
        if options.sample is not None and row.status == "pass":
            row.sample = options.sample  # asked for by number: saved even when it passes
        if options.save_dir and row.status != "skipped" and row.sample in shown:
            row.inputs = _save_inputs(options.save_dir, row, device, *shown[row.sample])
    return CaseResult(rows, details)


def _make_samples(opinfo, dtype, device: torch.device, with_grad: bool, stop: int | None) -> tuple[list, str]:
    """The OpInfo's samples made on the device, as PyTorch's own tests make them (some arguments stay on the CPU
    on purpose); where the device cannot make them, made on the CPU and copied to it, with a note saying so."""
    try:
        return list(itertools.islice(opinfo.sample_inputs(str(device), dtype, requires_grad=with_grad), stop)), ""
    except Exception as e:  # noqa: BLE001 - the device's failure to make inputs is not the op's
        error = describe_error(e)
    samples = list(itertools.islice(opinfo.sample_inputs("cpu", dtype, requires_grad=with_grad), stop))
    try:
        copies = [_copy_sample(s, device) for s in samples]
    except Exception as e:  # noqa: BLE001 - the device cannot hold them: unsupported, said by the caller
        raise _DeviceInputError(e) from e
    return copies, f"samples made on the CPU and copied: the device could not make them ({error})"


class _DeviceInputError(Exception):
    """The device can hold neither the samples it makes nor copies of the CPU's: every sample is unsupported."""


def _compare(tally: _Tally, device_out, reference_out, same, tolerance, op_name: str, prefix: str) -> list | None:
    """``compare_outputs``, or None (noted) for results it cannot compare."""
    try:
        return compare_outputs(device_out, reference_out, same, tolerance, op_name=op_name, prefix=prefix)
    except Exception as e:  # noqa: BLE001 - a result the verdict does not handle: not compared, and said so
        tally.skips.append(f"not comparable: {describe_error(e)}")
        return None


def _run_sample(opinfo, sample, index: int, dtype, device, with_grad: bool, tolerance, forward: _Tally,
                backward: _Tally, progress, details: list | None, shown: dict) -> str | None:
    """One sample (as made on the device), forward and backward; returns a reason to skip the whole op (a random
    op), else None."""
    op_name = opinfo.name
    wants_grad = with_grad and any(t.requires_grad for t in iter_tensors((sample.input, sample.args, sample.kwargs)))
    cpu = _copy_sample(sample, _CPU)
    try:
        reference, note = _reference(opinfo, cpu, wants_grad)
    except Exception as e:  # noqa: BLE001 - nothing to compare this sample with, in either direction
        for tally in (forward, backward) if wants_grad else (forward,):
            tally.skips.append(f"no CPU reference: {describe_error(e)}")
        return None
    if index == 0 and _random_outputs(opinfo, cpu):
        return "random: two CPU runs with different seeds give different outputs"
    record = [cpu, None, None]  # what saving this sample's inputs needs: outputs and upstream gradients come later
    if details is not None:  # a sample asked for by number is saved whatever its verdict
        shown[index] = record
    progress(index, "forward")
    try:
        run = _run(opinfo, sample, {}, wants_grad)
        synchronize(device)
        device_out = record[1] = _on_cpu(run.output)
    except Exception as e:  # noqa: BLE001 - the device raised: unsupported, forward and so backward
        forward.raised_at(index, e)
        if reference.roots:
            backward.raised_at(index, e)
        shown[index] = record
        return None
    # upstream gradients in the device's output dtypes: every run gets the same (rounded) values
    upstream = record[2] = _upstream(index, run.roots) if reference.roots else None
    same = _SameDtype(opinfo, cpu, dtype, upstream)
    comparisons = _compare(forward, device_out, _on_cpu(reference.output), same.forward, tolerance, op_name, "output")
    if comparisons is not None and not forward.compared(index, comparisons, note):
        shown[index] = record
    if details is not None and comparisons is not None:
        details += [{"sample": index, "direction": "forward", **c.row()} for c in comparisons]
    if not reference.roots:
        return None
    if [r.shape for r in run.roots] != [r.shape for r in reference.roots]:
        info = (f"differentiable outputs differ: device {[tuple(r.shape) for r in run.roots]}, reference "
                f"{[tuple(r.shape) for r in reference.roots]}")
        backward.compared(index, [Comparison("grad", False, error_info=info)], note)
        return None
    progress(index, "backward")
    try:
        device_grads = _on_cpu(_grads(run, upstream))
        synchronize(device)
    except Exception as e:  # noqa: BLE001
        backward.raised_at(index, e)
        shown[index] = record
        return None
    try:
        reference_grads = _on_cpu(_grads(reference, upstream))
    except Exception as e:  # noqa: BLE001 - the CPU has no backward for the reference: not comparable
        backward.skips.append(f"no CPU reference gradient: {describe_error(e)}")
        return None
    comparisons = _compare(backward, tuple(device_grads), tuple(reference_grads), same.backward, tolerance, op_name,
                           "grad")
    if comparisons is None:
        return None
    for c, label in zip(comparisons, run.labels):
        c.name = f"{label}.grad"
    if not backward.compared(index, comparisons, note):
        shown[index] = record
    if details is not None:
        details += [{"sample": index, "direction": "backward", **c.row()} for c in comparisons]
    return None


# --- saving a sample's inputs in OpCapture's format ---

def _save_inputs(base: str, row: Row, device: torch.device, sample, device_out, upstream) -> str:
    """Write the sample's inputs (and the device's outputs, and the upstream gradients) as OpCapture does, for
    ``run_op_from_data``; return the folder, or why nothing was saved."""
    if not row.torch_name:
        return "not saved: the OpInfo calls a Python wrapper, not a torch operator (rerun it with --sample)"
    from ..capture import TensorStore

    folder = os.path.join(base, row.op, row.dtype, f"sample{row.sample}")
    if os.path.exists(os.path.join(folder, "input.pth")):
        return folder  # the other direction saved the same sample
    store = TensorStore(dedup=False)
    # the CPU copies, with the device named where a factory takes one (as a user's call on the device would)
    args = _convert((sample.input, *sample.args), "", lambda t, _: t.detach(), device, {})
    kwargs = _convert(sample.kwargs, "", lambda t, _: t.detach(), device, {})
    store.save(os.path.join(folder, "input.pth"),
               {"name": row.torch_name, "args": tuple(args), "kwargs": kwargs, "identifier": "input"})
    if device_out is not None:
        outputs = tuple(device_out) if isinstance(device_out, (list, tuple)) else (device_out,)
        store.save(os.path.join(folder, "output.pth"),
                   {"name": row.torch_name, "args": outputs, "kwargs": {}, "identifier": "output"})
    if upstream is not None:
        store.save(os.path.join(folder, "grad_outputs.pth"),
                   {"name": row.torch_name, "args": tuple(upstream), "kwargs": {}, "identifier": "grad_outputs"})
    return folder
