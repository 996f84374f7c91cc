"""One OpInfo in one dtype: its samples run on the device and on the CPU (``runs``), each compared by
OpAutoCompare's verdict, summed up into a forward and a backward ``Row`` (``tally``).

Per sample:

1. the CPU reference on the sample's CPU copy, in float64 (float32, then the dtype itself, where the CPU has
   no wider kernel), recording a graph when the sample has inputs that require grad;
2. the device run on copies of the sample where the OpInfo made it; an exception there is ``unsupported``;
3. forward: ``op_tools.numerics.comparison.compare_outputs(device, reference, same_dtype)``, the same-dtype CPU run (the
   error floor) computed only when an error is above the floor;
4. backward: the same upstream gradients (drawn from a private generator, in the device's output dtypes)
   through every run's graph, and the gradients of the inputs that require grad compared the same way.

``progress(sample, direction)`` is called before each device call, so that a hang or a crash can be
attributed to a sample. The sample shown for a row that did not pass is saved in OpCapture's format.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable

import torch

from ...numerics.comparison import Comparison, ToleranceSpec, compare_outputs
from ...ops.arguments import iter_tensors
from ...output.capture_format import TensorStore
from .opinfos import full_name, replay_name, skip_reason, supports_backward
from .results import Row
from .runs import (
    CPU,
    DeviceInputError,
    SameDtypeRun,
    convert,
    copy_sample,
    facts_name,
    gradients,
    is_random,
    make_samples,
    on_cpu,
    reference_run,
    run_op,
    synchronize,
    upstream_gradients,
)
from .tally import Tally, describe_error


@dataclasses.dataclass(frozen=True)
class CaseOptions:
    """How ``run_case`` works through an op's samples."""

    limit_samples: int | None = None   # the first N samples only
    sample: int | None = None          # this sample only (its index among all the op's samples)
    backward: bool = True              # compare gradients where the OpInfo supports autograd
    save_dir: str = ""                 # where the inputs of the sample shown for a non-pass are saved ("": not saved)
    details: bool = False              # keep every comparison of every sample (for --sample)


@dataclasses.dataclass
class CaseResult:
    rows: list[Row]
    comparisons: list[dict] = dataclasses.field(default_factory=list)  # with CaseOptions.details


def run_case(opinfo, dtype: torch.dtype, device: torch.device, options: CaseOptions,
             tolerance: ToleranceSpec | None = None,
             progress: Callable[[int, str], None] = lambda sample, direction: None) -> CaseResult:
    """Run ``opinfo``'s samples in ``dtype`` on ``device`` and on the CPU: a forward and a backward ``Row``."""
    start = time.perf_counter()
    name, dtype_name = full_name(opinfo), str(dtype).removeprefix("torch.")
    backward_row = dtype.is_floating_point or dtype.is_complex
    forward, backward = Tally(), Tally()
    reason = skip_reason(opinfo, dtype, device.type)
    grad_reason = supports_backward(opinfo, dtype, device.type) if options.backward else "--no-backward"
    with_grad = grad_reason is None
    details: list[dict] = []
    shown: dict[int, tuple] = {}  # sample index -> (sample, device output, upstream): what a saved input needs
    if reason is None:
        stop = options.limit_samples if options.sample is None else options.sample + 1
        try:
            samples, made = make_samples(opinfo, dtype, device, with_grad, stop)
        except DeviceInputError as e:
            samples, made = [], ""
            for tally in (forward, backward) if with_grad else (forward,):
                tally.raised_at(0, RuntimeError(f"the device cannot hold the sample inputs: "
                                                f"{describe_error(e.args[0])}"))  # the device's error
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


def _compare(tally: Tally, device_out, reference_out, same, tolerance, op_name: str, prefix: str) -> list | None:
    """``compare_outputs``, or None (noted) for results it cannot compare."""
    try:
        return compare_outputs(device_out, reference_out, same, tolerance, op_name=op_name, prefix=prefix)
    except Exception as e:  # noqa: BLE001 - a result the verdict does not handle: not checked, and said so
        tally.unchecked.append(f"not comparable: {describe_error(e)}")
        return None


def _run_sample(opinfo, sample, index: int, dtype, device, with_grad: bool, tolerance, forward: Tally,
                backward: Tally, progress, details: list | None, shown: dict) -> str | None:
    """One sample (as made on the device), forward and backward; returns a reason to skip the whole op (a random
    op), else None."""
    op_name = opinfo.name
    wants_grad = with_grad and any(t.requires_grad for t in iter_tensors((sample.input, sample.args, sample.kwargs)))
    cpu = copy_sample(sample, CPU)
    try:
        reference, note = reference_run(opinfo, cpu, wants_grad)
    except Exception as e:  # noqa: BLE001 - nothing to compare this sample with, in either direction: not checked
        for tally in (forward, backward) if wants_grad else (forward,):
            tally.unchecked.append(f"no CPU reference: {describe_error(e)}")
        return None
    if index == 0 and is_random(opinfo, cpu):
        return "random: two CPU runs with different seeds give different outputs"
    record: list = [cpu, None, None]  # what saving this sample's inputs needs: outputs and upstream gradients later
    if details is not None:  # a sample asked for by number is saved whatever its verdict
        shown[index] = record
    progress(index, "forward")
    try:
        run = run_op(opinfo, sample, {}, wants_grad)
        synchronize(device)
        device_out = record[1] = on_cpu(run.output)
    except Exception as e:  # noqa: BLE001 - the device raised: unsupported, forward and so backward
        forward.raised_at(index, e)
        if reference.roots:
            backward.raised_at(index, e)
        shown[index] = record
        return None
    reference.take_choices(facts_name(opinfo), device_out)  # a tie's index, a vector's sign: the device's choice
    # upstream gradients in the device's output dtypes: every run gets the same (rounded) values
    upstream = record[2] = upstream_gradients(index, run.roots) if reference.roots else None
    same = SameDtypeRun(opinfo, cpu, dtype, upstream, chosen=device_out)
    comparisons = _compare(forward, device_out, on_cpu(reference.output), same.forward, tolerance, op_name, "output")
    if comparisons is not None and not forward.compared(index, comparisons, note, _has_elements(device_out)):
        shown[index] = record
    if details is not None and comparisons is not None:
        details += [{"sample": index, "direction": "forward", **c.row()} for c in comparisons]
    if not reference.roots:
        return None
    assert upstream is not None  # made above, as the reference has differentiable outputs
    if [r.shape for r in run.roots] != [r.shape for r in reference.roots]:
        info = (f"differentiable outputs differ: device {[tuple(r.shape) for r in run.roots]}, reference "
                f"{[tuple(r.shape) for r in reference.roots]}")
        backward.compared(index, [Comparison("grad", False, error_info=info)], note)
        return None
    progress(index, "backward")
    try:
        device_grads = on_cpu(gradients(run, upstream))
        synchronize(device)
    except Exception as e:  # noqa: BLE001
        backward.raised_at(index, e)
        shown[index] = record
        return None
    try:
        reference_grads = on_cpu(gradients(reference, upstream))
    except Exception as e:  # noqa: BLE001 - the CPU has no backward for the reference: not checked
        backward.unchecked.append(f"no CPU reference gradient: {describe_error(e)}")
        return None
    comparisons = _compare(backward, tuple(device_grads), tuple(reference_grads), same.backward, tolerance, op_name,
                           "grad")
    if comparisons is None:
        return None
    for c, label in zip(comparisons, run.labels):
        c.name = f"{label}.grad"
    if not backward.compared(index, comparisons, note, _has_elements(device_grads)):
        shown[index] = record
    if details is not None:
        details += [{"sample": index, "direction": "backward", **c.row()} for c in comparisons]
    return None


def _has_elements(result) -> bool:
    """Whether a result holds an element to compare (an empty tensor checks its shape and dtype, no value)."""
    return any(t.numel() for t in iter_tensors(result))


# --- saving a sample's inputs in OpCapture's format ---

def _save_inputs(base: str, row: Row, device: torch.device, sample, device_out, upstream) -> str:
    """Write the sample's inputs (and the device's outputs, and the upstream gradients) as OpCapture does, for
    ``run_op_from_data``; return the folder, or why nothing was saved."""
    if not row.torch_name:
        return "not saved: the OpInfo calls a Python wrapper, not a torch operator (rerun it with --sample)"
    folder = os.path.join(base, row.op, row.dtype, f"sample{row.sample}")
    if os.path.exists(os.path.join(folder, "input.pth")):
        return folder  # the other direction saved the same sample
    store = TensorStore(dedup=False)
    # the CPU copies, with the device named where a factory takes one (as a user's call on the device would); each
    # keeps its requires_grad, which tells the replay the inputs to take gradients of (else it checks no backward)
    def kept(t: torch.Tensor, _) -> torch.Tensor:
        return t.detach().requires_grad_(t.requires_grad)

    args = convert((sample.input, *sample.args), "", kept, device, {})
    kwargs = convert(sample.kwargs, "", kept, device, {})
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
