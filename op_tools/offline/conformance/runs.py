"""One sample of an OpInfo, run on the device and on the CPU: copies of its inputs, the runs, the upstream gradients.

A sample is made on the device (``make_samples``), as PyTorch's own device tests make it, and copied to the
CPU once (``copy_sample``); every run then works on fresh copies of its side's inputs (``run_op``), so an op
that writes into an input cannot change another run's. The CPU reference (``reference_run``) computes in
float64 where the CPU can, as OpAutoCompare's does; ``SameDtypeRun`` is the error floor, computed on demand.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable

import torch

from ...numerics.ambiguous_results import with_choices
from ...ops.arguments import iter_tensors, map_tensors
from ...ops.op_facts import op_facts
from .tally import describe_error

CPU = torch.device("cpu")
_WIDE = {torch.float16: torch.float64, torch.bfloat16: torch.float64, torch.float32: torch.float64,
         torch.complex32: torch.complex128, torch.complex64: torch.complex128}
_FLOAT32 = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.complex32: torch.complex64}
# The reference's dtypes, tried in order; the note says what a reference that is not float64 means.
_ATTEMPTS: tuple[tuple[dict[torch.dtype, torch.dtype], str], ...] = (
    (_WIDE, ""), (_FLOAT32, "reference in float32: the CPU has no float64 kernel"),
    ({}, "reference in the device's dtype: the CPU has no wider kernel"))
_UPSTREAM_SEED = 20240601


@dataclasses.dataclass
class Run:
    """One run of the op: on the device, or a CPU reference."""

    output: object = None
    leaves: list = dataclasses.field(default_factory=list)
    labels: list = dataclasses.field(default_factory=list)
    roots: list = dataclasses.field(default_factory=list)
    args: tuple = ()  # the op's arguments in this run (its first included), for taking another run's choices
    kwargs: dict = dataclasses.field(default_factory=dict)
    process: Callable | None = None  # the sample's output_process_fn_grad: the roots from the output

    def take_choices(self, op_name: str, chosen) -> None:
        """Where the op's result is one of several right answers (op fact ``ambiguous``: ties' indices, vectors'
        signs), take ``chosen``'s (the device's output) where they are valid for this run's input, as OpAutoCompare's
        reference does (``numerics/ambiguous_results.py``); the roots follow, so that backward goes where the device
        sent it."""
        if not op_facts(op_name).ambiguous:
            return
        self.output = with_choices(op_name, chosen, self.args, self.kwargs, self.output)
        if self.roots and self.process is not None:
            self.roots = [t for t in iter_tensors(self.process(self.output)) if t.requires_grad]


@dataclasses.dataclass
class SampleArgs:
    """A sample's arguments on one side (the device as the OpInfo made them, or their CPU copies)."""

    input: object
    args: tuple
    kwargs: dict
    output_process_fn_grad: Callable


def convert(value, path: str, tensor_fn: Callable, device, cast: dict):
    """A sample's argument for one run: tensors through ``tensor_fn(t, path)``, dtypes through ``cast``, device
    arguments (of factories) to ``device`` (None: as they are)."""
    if isinstance(value, torch.Tensor):
        return tensor_fn(value, path)
    if isinstance(value, torch.dtype):
        return cast.get(value, value)
    if isinstance(value, torch.device):
        return value if device is None else torch.device(device)
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        items = [convert(v, f"{path}[{i}]", tensor_fn, device, cast) for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        return {k: (v if device is None else str(device)) if k == "device" and isinstance(v, str)
                else convert(v, f"{path}[{k}]", tensor_fn, device, cast) for k, v in value.items()}
    return value


def copy_sample(sample, device) -> SampleArgs:
    """``sample`` with its tensors copied to ``device`` (those that require grad as leaves that do) and its device
    arguments naming ``device``."""
    def copy(t: torch.Tensor, _) -> torch.Tensor:
        return t.detach().to(device).requires_grad_(t.requires_grad)

    return SampleArgs(convert(sample.input, "", copy, device, {}), convert(sample.args, "", copy, device, {}),
                   convert(sample.kwargs, "", copy, device, {}), sample.output_process_fn_grad)


def run_op(opinfo, sample: SampleArgs, cast: dict, with_grad: bool) -> Run:
    """The op on fresh copies of the sample's inputs, where they are (floating inputs through ``cast``)."""
    run = Run()

    def tensor_fn(t: torch.Tensor, path: str) -> torch.Tensor:
        target = cast.get(t.dtype, t.dtype)
        copy = t.detach().clone() if target == t.dtype else t.detach().to(dtype=target, copy=True)
        if with_grad and t.requires_grad:
            copy.requires_grad_()
            run.leaves.append(copy)
            run.labels.append(path)
        return copy

    first = convert(sample.input, "input", tensor_fn, None, cast)
    args = convert(sample.args, "args", tensor_fn, None, cast)
    kwargs = convert(sample.kwargs, "kwargs", tensor_fn, None, cast)
    run.args, run.kwargs, run.process = (first, *args), kwargs, sample.output_process_fn_grad
    with torch.set_grad_enabled(with_grad):
        run.output = opinfo.op(first, *args, **kwargs)
        if with_grad and run.leaves:
            run.roots = [t for t in iter_tensors(sample.output_process_fn_grad(run.output)) if t.requires_grad]
    return run


def facts_name(opinfo) -> str:
    """The OpInfo's function as the tools name calls (``torch.linalg.svd``), for its op facts; ``torch.<name>`` for
    a function of the OpInfo's own."""
    from ...ops.naming import resolve_op_name

    try:
        name = resolve_op_name(opinfo.op)
    except Exception:  # noqa: BLE001 - an object torch cannot name
        name = ""
    return name if name.startswith("torch.") else f"torch.{opinfo.name}"


def reference_run(opinfo, sample: SampleArgs, with_grad: bool) -> tuple[Run, str]:
    """The CPU reference run and its note; raises the last attempt's error when the CPU cannot run it at all."""
    error: BaseException | None = None
    for cast, note in _ATTEMPTS:
        try:
            return run_op(opinfo, sample, cast, with_grad), note
        except Exception as e:  # noqa: BLE001 - the next, narrower, attempt
            error = e
    assert error is not None  # there are attempts, and each failed
    raise error


def on_cpu(obj):
    """CPU copies of the tensors of ``obj``, outside autograd, dense, conjugation and negation resolved."""
    def copy(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().to(CPU)
        if t.layout != torch.strided:
            t = t.to_dense()
        return t.resolve_conj().resolve_neg()

    return map_tensors(obj, copy)


def gradients(run: Run, upstream: list[torch.Tensor]) -> tuple:
    """The gradients of ``run``'s leaves for ``upstream`` gradients of its roots (None for an unused leaf)."""
    if not run.roots or not run.leaves:
        return tuple(None for _ in run.leaves)
    grad_outputs = [u.to(device=r.device, dtype=r.dtype) for u, r in zip(upstream, run.roots)]
    return torch.autograd.grad(run.roots, run.leaves, grad_outputs, allow_unused=True)


def upstream_gradients(index: int, roots: list[torch.Tensor]) -> list[torch.Tensor]:
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


class SameDtypeRun:
    """The same-dtype CPU run (OpAutoCompare's error floor), computed once, only when a comparison asks for it.

    Where the CPU has no kernel in the dtype, float32 rounded to it is what a correct implementation gives.
    """

    def __init__(self, opinfo, sample, dtype: torch.dtype, upstream: list | None, chosen=None) -> None:
        self.args = (opinfo, sample, dtype, upstream, chosen)  # chosen: the device's output, whose choices it takes
        self.result: tuple | None = None

    def _compute(self) -> tuple:
        opinfo, sample, dtype, upstream, chosen = self.args
        with_grad = upstream is not None
        for cast in ({}, _FLOAT32):
            try:
                run = run_op(opinfo, sample, cast, with_grad)
                run.take_choices(facts_name(opinfo), chosen)
                grads = gradients(run, upstream) if upstream is not None else None
            except Exception:  # noqa: BLE001 - the rounded float32 run, then no floor
                continue
            wide = cast.get(dtype, dtype)
            narrow = lambda t: t.to(dtype) if t.dtype == wide != dtype else t  # noqa: B023 - used at once
            grads = None if grads is None else map_tensors(on_cpu(grads), narrow)
            return map_tensors(on_cpu(run.output), narrow), grads
        return None, None

    def forward(self):
        if self.result is None:
            self.result = self._compute()
        return self.result[0]

    def backward(self):
        if self.result is None:
            self.result = self._compute()
        return self.result[1]


def is_random(opinfo, sample) -> bool:
    """Whether two CPU runs of the sample with different seeds give different outputs: a random op."""
    outputs = []
    for seed in (1, 2):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            try:
                outputs.append(run_op(opinfo, sample, {}, False).output)
            except Exception:  # noqa: BLE001 - no CPU kernel in the dtype: the reference decides alone
                return False
    return not _same_values(*outputs)


def _same_values(a, b) -> bool:
    """Whether two CPU results hold the same values (nan equal to nan); True when that cannot be told."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        try:
            x, y = on_cpu(a), on_cpu(b)
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


def make_samples(opinfo, dtype, device: torch.device, with_grad: bool, stop: int | None) -> tuple[list, str]:
    """The OpInfo's samples made on the device, as PyTorch's own tests make them (some arguments stay on the CPU
    on purpose); where the device cannot make them, made on the CPU and copied to it, with a note saying so."""
    try:
        return list(itertools.islice(opinfo.sample_inputs(str(device), dtype, requires_grad=with_grad), stop)), ""
    except Exception as e:  # noqa: BLE001 - the device's failure to make inputs is not the op's
        error = describe_error(e)
    samples = list(itertools.islice(opinfo.sample_inputs("cpu", dtype, requires_grad=with_grad), stop))
    try:
        copies = [copy_sample(s, device) for s in samples]
    except Exception as e:  # noqa: BLE001 - the device cannot hold them: unsupported, said by the caller
        raise DeviceInputError(e) from e
    return copies, f"samples made on the CPU and copied: the device could not make them ({error})"


class DeviceInputError(Exception):
    """The device can hold neither the samples it makes nor copies of the CPU's: every sample is unsupported."""
