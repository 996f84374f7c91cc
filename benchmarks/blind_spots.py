"""The verdicts' blind spots: every OpInfo sample on sim, a fault in every kernel, and the calls a tool passed unseen.

For each OpInfo of PyTorch's ``op_db`` (or those named), the first few samples with elements run on sim under
``OpAutoCompare``, forward and backward, while a ``noise`` fault (every element times ``1 +- noise``) is on every aten
kernel that computes values: not the copies between devices nor ``clone`` (the tool's own copies of the inputs go
through them), and never a view (sim poisons no view). Independently of the tool, the device's results are checked
against a float64 CPU run of the same sample. Each sample runs twice: with the fault in its forward's kernels (its
outputs checked), then in its backward's alone (a correct forward, its gradients checked); ``--phase in-place`` runs
the OpInfo's in-place variant (``x.mul_(y)``) on copies of the sample, its first tensor checked. A result off by more
than ``--tolerance`` (relative to the reference's largest value) while the tool's verdict is clean (no failure, nothing
not checked) is a **silent pass**, the worst bug a verdict can have, unless a correct run in the dtype (the CPU's)
errs nearly as much: within 4x its error + 4 eps, the rule's margin, the fault is listed apart (in bfloat16 the
CPU's own error is large for some ops: op_autocompare.md, Limits). Calls the tool skips with their reason (random,
uninitialised memory) are listed apart.

    python benchmarks/blind_spots.py                           # every OpInfo, float32 (a few minutes)
    python benchmarks/blind_spots.py --ops select,narrow,split --phase backward
    python benchmarks/blind_spots.py --dtype bfloat16 --numerics gpu
    python benchmarks/blind_spots.py --reference device        # the float64 reference on the device

Other tools' verdicts: ``--tool compare_runs`` records each sample twice (``OP_CAPTURE_MODE=stats``), clean and
faulted, and takes compare_runs' verdict on the two recordings; ``--tool overflow --kind inf|nan`` sweeps
OpOverflowCheck, the fault kept to the kernels the sample's phase runs (found by running it first without the tool),
so that the tool's own reductions stay right; ``--tool replay`` captures each sample clean (``OpCapture``) and
replays its calls on sim with the fault (``run_op_from_data --acc_check``). A wrong result the tool said it had not
checked is listed apart.

With ``--reference device`` the fault is kept to kernels of the tested dtype (the device's float64 reference kernels
stay correct: a fault they share is the cross-check's question) and each sample runs twice unfaulted first, so that
the faulted run's calls are judged against the device's reference (an op's first call runs on the CPU, its first on
the device is cross-checked); the summary counts the samples judged there.

The tools' own kernels run unfaulted (``ToolsOwnKernels``): a verdict a faulted statistic, flag or sum decided
would not be the op's. A fault in a backward where the engine summed an input's gradient pieces (the input read twice
within the call) is listed apart: autograd sums them too, with a kernel no tool judges (op_autocompare.md, Limits);
so is one in a call OpAutoCompare's summary said passed only within a correct run's large error (``weak_passes``).

Exit status 1 when a silent pass is found. Results of 2026-11-30 are in docs/tools/op_autocompare.md,
op_overflow_check.md, compare_runs.md and run_op_from_data.md.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import fnmatch
import functools
import itertools
import logging
import os
import sys
import tempfile
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("OP_TOOLS_RESULTS_DIR", os.path.join(tempfile.gettempdir(), "blind_spots"))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import ditorch.sim  # noqa: E402
import op_tools  # noqa: E402
from ditorch.sim import fault_injection  # noqa: E402
from op_tools.core import call_backward  # noqa: E402
from op_tools.numerics import device_readback  # noqa: E402
from op_tools.offline import replay  # noqa: E402
from op_tools.offline.compare_runs import compare  # noqa: E402
from op_tools.offline.conformance import runs  # noqa: E402
from op_tools.ops.arguments import iter_tensors, map_tensors  # noqa: E402
from op_tools.output import run_recording  # noqa: E402
from op_tools.tools import overflow_check  # noqa: E402

# Kernels left unfaulted: copies between devices and clone (how the tool copies what it compares), the scalar read.
UNFAULTED = ("_to_copy", "copy_", "_copy_from", "_copy_from_and_resize", "clone", "_local_scalar_dense")
FAULT = "(?!(" + "|".join(UNFAULTED) + r")(\..*)?$).*{kind}"  # with or without the overload; kind: [@dtype]:k


def fault_except(kernels: set[str], kind: str) -> str:
    """``FAULT`` with ``kernels`` unfaulted too."""
    return "(?!(" + "|".join(UNFAULTED + tuple(sorted(kernels))) + r")(\..*)?$).*" + kind


class KernelNames(TorchDispatchMode):
    """The aten ops run under it, by name (``exp``, ``mul``)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func._schema.name.removeprefix("aten::"))
        return func(*args, **(kwargs or {}))


SKIPPED_ON_PURPOSE = ("random", "uninitialised")  # what the tool skips and says why: no verdict to be wrong


def off_by(device, reference) -> float:
    """The largest relative difference between the floating tensors of two results (``inf`` where one is finite
    and the other not): |d - r| over the reference's largest finite magnitude, the reference rounded to the
    device's dtype first (what the device can hold at best)."""
    device, reference = runs.on_cpu(device), runs.on_cpu(reference)
    pairs = zip(device, reference) if isinstance(device, (list, tuple)) else [(device, reference)]
    worst = 0.0
    for d, r in pairs:
        if not (isinstance(d, torch.Tensor) and isinstance(r, torch.Tensor)) or d.shape != r.shape or \
                not (d.is_floating_point() or d.is_complex()) or d.numel() == 0:
            continue
        wide = torch.complex128 if d.is_complex() else torch.float64
        d, r = d.to(wide), r.to(d.dtype).to(wide)
        if not torch.equal(torch.isfinite(d), torch.isfinite(r)):
            return float("inf")
        finite = torch.isfinite(r)
        if not finite.any():
            continue
        scale = r[finite].abs().max().item()
        difference = (d[finite] - r[finite]).abs().max().item()
        worst = max(worst, difference / scale if scale else (float("inf") if difference else 0.0))
    return worst


def in_place_copies(sample) -> tuple:
    """Copies of the sample's tensors for its in-place variant: ``(written, args, kwargs)``."""
    written, (rest, keywords) = map_tensors((sample.input, (sample.args, sample.kwargs)), lambda t: t.detach().clone())
    return written, rest, keywords


def on_sim(sample) -> runs.SampleArgs:
    """The sample's arguments as the OpInfo made them on sim."""
    return runs.SampleArgs(sample.input, sample.args, sample.kwargs, sample.output_process_fn_grad)


def only_kernels(kernels: set[str], kind: str) -> str:
    """A fault (``kind``: ``[@dtype]:k``) in ``kernels`` alone, never in the copies between devices nor ``clone``."""
    chosen = sorted(kernels - set(UNFAULTED))
    return "(" + "|".join(chosen) + r")(\..*)?" + kind if chosen else ""


def kernels_of(opinfo, sample, index: int, phase: str, wants_grad: bool) -> set[str]:
    """The aten kernels ``phase`` of the sample runs, found by running it unfaulted without a tool: with
    ``--tool overflow`` the fault is kept to them, so that the tool's own kernels (its flags' reductions) stay right."""
    names = KernelNames()
    if phase == "in-place":
        written, rest, keywords = in_place_copies(sample)
        with names:
            opinfo.inplace_variant(written, *rest, **keywords)
        return names.names
    device_sample = on_sim(sample)
    with names if phase == "forward" else contextlib.nullcontext():
        run = runs.run_op(opinfo, device_sample, {}, wants_grad and phase == "backward")
    if phase == "backward" and run.roots:
        with names:
            runs.gradients(run, runs.upstream_gradients(index, run.roots))
    return names.names


@contextlib.contextmanager
def unfaulted():
    """sim's faults off within the block, on again after it."""
    active, fault_injection.TABLE.active = fault_injection.TABLE.active, False
    try:
        yield
    finally:
        fault_injection.TABLE.active = active


def unfaulted_calls(function):
    """``function`` run with sim's faults off."""
    @functools.wraps(function)
    def run(*args, **kwargs):
        with unfaulted():
            return function(*args, **kwargs)
    return run


def recording(folder: str):
    """A run recording (``OP_CAPTURE_MODE=stats``) into ``folder``, as compare_runs reads one."""
    return op_tools.OpCapture(mode="stats", results_dir=folder)


SUMMED = call_backward.summed  # the engine's own, before the sweep wraps it


class ToolsOwnKernels:
    """Within it the tools' own kernels run unfaulted: the engine's sum of an input's gradient pieces, the run
    recording's statistics and nan/inf counts, OpOverflowCheck's flags, and the read-back's join of a batch's values
    (where the recording's block sums are summed). The sweep's question is the op's kernels; a faulted statistic or
    sum differs whatever the op did (a noise fault) or writes the tensor it reads (a scratch fault), and the verdict
    is then not the op's. ``pieces_summed``: how many times the engine summed an input's gradient pieces (an input
    read twice within one call: ``x - tanh(x)``); autograd sums them too, with its own kernel, which no tool judges
    (op_autocompare.md, Limits)."""

    def __init__(self) -> None:
        self.pieces_summed = 0
        self._patches = contextlib.ExitStack()

    def _summed(self, pieces, piece):
        self.pieces_summed += 1
        with unfaulted():
            return SUMMED(pieces, piece)

    def __enter__(self) -> ToolsOwnKernels:
        self._patches.enter_context(mock.patch.object(call_backward, "summed", self._summed))
        for module, name in ((run_recording, "calls_stats"), (run_recording, "nonfinite_counts"),
                             (overflow_check, "_witnesses"), (device_readback, "_joined")):
            self._patches.enter_context(mock.patch.object(module, name, unfaulted_calls(getattr(module, name))))
        return self

    def __exit__(self, *exc) -> None:
        self._patches.close()


def replayed(folder: str, fault: str, in_backward: bool) -> tuple[str, list[str]]:
    """The offline replay's verdict (``run_op_from_data --acc_check``) on every call captured under ``folder``, on sim
    with ``fault`` in its kernels (``in_backward``: in the backward's alone, the forward right): ``found`` where an
    entry is, ``unchecked`` where one could not be checked, else ``clean``; and the entries whose accuracy went
    unchecked on purpose, and why (an op that draws random numbers, memory never written)."""
    options = replay.ReplayOptions(acc_check=True)
    results = []
    backward = torch.autograd.backward

    def faulted_backward(*args, **kwargs):
        with ditorch.sim.faults(fault):
            return backward(*args, **kwargs)

    with contextlib.ExitStack() as stack:
        if in_backward:
            stack.enter_context(mock.patch.object(torch.autograd, "backward", faulted_backward))
        else:
            stack.enter_context(ditorch.sim.faults(fault))
        for entry in replay.find_entries(folder):
            results.append(replay.replay(entry, "sim", options))
    verdicts = {r.verdict() for r in results}
    skipped = [why for r in results for note in r.notes
               for start, why in (("random draws", "random"), ("memory never written", "uninitialised"))
               if note.startswith(start)]
    return ("found" if "found" in verdicts else "unchecked" if "unchecked" in verdicts else "clean"), skipped


def new_tool(args):
    """The tool under test, as a user starts it."""
    return op_tools.OpOverflowCheck() if args.tool == "overflow" else op_tools.OpAutoCompare(reference=args.reference)


def judged_in_fault(tool, args) -> None:
    """With a ``scratch`` fault, the calls are judged while it is on: a kernel that writes an input it only reads
    does so at every call, and the tool tells its write from a stale copy by rerunning it on the device."""
    if args.kind == "scratch" and args.tool == "autocompare":
        tool.judge_queued()


# where ``reference_place`` counts a call cleared or convicted through the device's reference: cleared there, or
# failing there and judged on the CPU (every failure is the CPU's verdict), the device's gradients cross-checked
ON_THE_DEVICE = ("device", "its verdict needed the CPU", "cross-checked")


def warm_up(opinfo, sample, wants_grad: bool, args, phase: str) -> None:
    """The sample twice, unfaulted, under a tool with the reference on the device: its ops' first calls (on the CPU)
    and their first on the device (cross-checked) are then behind, and the faulted run's calls judged there."""
    for _ in range(2):
        with ditorch.sim.numerics(args.numerics), op_tools.OpAutoCompare(reference=args.reference):
            if phase == "in-place":
                written, rest, keywords = in_place_copies(sample)
                opinfo.inplace_variant(written, *rest, **keywords)
                continue
            device_sample = on_sim(sample)
            run = runs.run_op(opinfo, device_sample, {}, wants_grad)
            if wants_grad and run.roots:
                runs.gradients(run, runs.upstream_gradients(0, run.roots))


def on_the_device(tool) -> bool:
    """Whether every call of the faulted run was judged against the device's reference (none on the CPU)."""
    places = getattr(tool, "reference_place", None)
    return bool(places) and all(why in ON_THE_DEVICE for (_, why), n in places.items() if n)


def phase_run(opinfo, index: int, sample, args, phase: str, fault: str, kind: str, tool, reference,
              wants_grad: bool) -> tuple:
    """The sample's ``phase`` run on sim under ``tool`` with ``fault`` in its kernels: its results (outputs, the
    written tensor, or the gradients) and the upstream gradients of a backward; ``(None, None)`` where there is
    nothing to compare. Measured after the tool stopped: a tool that records CPU calls (the run recording) would
    record the measurement's own calls too."""
    if phase == "in-place":  # on copies of the sample's tensors, the first one written
        written, rest, keywords = in_place_copies(sample)
        with ditorch.sim.faults(fault):
            opinfo.inplace_variant(written, *rest, **keywords)
            judged_in_fault(tool, args)
        return written, None
    device_sample = on_sim(sample)
    # A kernel that writes its input does so wherever it runs: with a scratch fault in the backward, the kernels
    # the forward ran stay correct (the tool's rerun of a failing backward reruns its forward).
    names = KernelNames() if args.kind == "scratch" and phase == "backward" and args.tool != "overflow" \
        else contextlib.nullcontext()
    with ditorch.sim.faults(fault if phase == "forward" else ""), names:
        run = runs.run_op(opinfo, device_sample, {}, wants_grad and phase == "backward")
        judged_in_fault(tool, args)
    if isinstance(names, KernelNames) and fault:
        fault = fault_except(names.names, kind)
    if phase == "forward":
        return run.output, None
    if not (reference.roots and [r.shape for r in run.roots] == [r.shape for r in reference.roots]):
        return None, None
    upstream = runs.upstream_gradients(index, run.roots)
    with ditorch.sim.faults(fault):
        grads = runs.gradients(run, upstream)
        judged_in_fault(tool, args)
    return tuple(grads), upstream


def run_sample(opinfo, index: int, sample, args, phase: str,
               dtype: torch.dtype) -> tuple[float, float, str, bool, bool] | str | None:
    """One sample with the fault in ``phase``'s kernels: how far off the device's results of that phase were (its
    outputs, or the gradients), how far off a correct run in the dtype is (the CPU's), and the tool's verdict;
    "skipped" for a call the tool skips with its reason; None for a sample this sweep cannot judge (no CPU reference,
    no gradient to compare)."""
    wants_grad = opinfo.supports_autograd and any(
        t.requires_grad for t in iter_tensors((sample.input, sample.args, sample.kwargs)))
    if phase == "backward" and not wants_grad:
        return None
    cpu = runs.copy_sample(sample, runs.CPU)
    try:
        reference, _ = runs.reference_run(opinfo, cpu, wants_grad)
        if runs.is_random(opinfo, cpu):
            return "skipped"
    except Exception:  # noqa: BLE001 - no CPU reference: not this sweep's question
        return None
    kind = f"noise={args.noise:g}" if args.kind == "noise" else \
        f"scratch={-args.noise:g}" if args.kind == "scratch" else args.kind
    if phase == "in-place" and (opinfo.inplace_variant is None or not isinstance(sample.input, torch.Tensor)):
        return None
    if args.reference != "cpu":  # the tested dtype's kernels only: the device's float64 reference stays correct
        kind = f"@{args.dtype}:{kind}"
        warm_up(opinfo, sample, wants_grad, args, phase)
    else:
        kind = f":{kind}"
    fault = FAULT.format(kind=kind)
    if args.tool == "overflow":
        with ditorch.sim.numerics(args.numerics):
            fault = only_kernels(kernels_of(opinfo, sample, index, phase, wants_grad), kind)
        if not fault:
            return None
    if args.tool == "replay":  # the sample captured clean, its calls replayed on sim with the fault
        with tempfile.TemporaryDirectory() as folder:
            with ditorch.sim.numerics(args.numerics), op_tools.OpCapture(results_dir=folder) as tool:
                phase_run(opinfo, index, sample, args, phase, "", kind, tool, reference, wants_grad)
            if args.kind == "scratch" and phase == "backward":  # as phase_run: the forward's kernels stay right
                fault = fault_except(kernels_of(opinfo, sample, index, "forward", wants_grad), kind)
            with ditorch.sim.numerics(args.numerics):
                verdict, skips = replayed(folder, fault, phase == "backward")
                result, upstream = phase_run(opinfo, index, sample, args, phase, fault, kind, None, reference,
                                             wants_grad)  # the faulted results, to know how far off they are
    elif args.tool == "compare_runs":  # run A clean, run B faulted, both recorded; compare_runs' verdict
        with tempfile.TemporaryDirectory() as folder:
            clean, faulted = os.path.join(folder, "a"), os.path.join(folder, "b")
            with ditorch.sim.numerics(args.numerics), recording(clean) as tool:
                phase_run(opinfo, index, sample, args, phase, "", kind, tool, reference, wants_grad)
            with ditorch.sim.numerics(args.numerics), recording(faulted) as tool:
                result, upstream = phase_run(opinfo, index, sample, args, phase, fault, kind, tool, reference,
                                             wants_grad)
            compared = compare(clean, faulted)
            verdict, skips = compared.verdict(), [row.skipped for row in compared.skipped]
    else:
        with ditorch.sim.numerics(args.numerics), new_tool(args) as tool:
            result, upstream = phase_run(opinfo, index, sample, args, phase, fault, kind, tool, reference,
                                         wants_grad)
        verdict, skips = tool.verdict(), [why for why, n in getattr(tool, "skipped", {}).items() if n]
    reference_grads = tuple(runs.gradients(reference, upstream)) if upstream is not None else None
    off = None if result is None else off_by(result, reference_grads if phase == "backward" else reference.output)
    if any(why.startswith(SKIPPED_ON_PURPOSE) for why in skips):
        return "skipped"
    if off is None:
        return None
    backward = phase == "backward"
    same = runs.SameDtypeRun(opinfo, cpu, dtype, upstream if backward else None)
    correct = same.backward() if backward else same.forward()
    own = off_by(correct, reference_grads if backward else reference.output) if correct is not None else 0.0
    return off, own, verdict, on_the_device(tool), bool(getattr(tool, "weak_passes", None))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default="", help="comma-separated OpInfo names or shell patterns (default: all)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kind", choices=("noise", "nan", "inf", "scratch"), default="noise",
                        help="the fault: noise (default), every element of the kernel's results nan or inf, or "
                             "scratch (the kernel scales its first input it only reads by 1 - noise, then computes)")
    parser.add_argument("--noise", type=float, default=None,
                        help="the fault's relative size (default 0.1; 0.3 for 16-bit dtypes)")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="how far off a result is wrong (default 1e-3; 0.1 for 16-bit dtypes, about 13 bfloat16 "
                             "eps: where the rule of 4x the CPU's own error + 4 eps finds a fault)")
    parser.add_argument("--numerics", choices=("cpu", "gpu"), default="cpu",
                        help="sim's numerics: the CPU's kernels (default) or a GPU's sums (DITORCH_SIM_NUMERICS)")
    parser.add_argument("--phase", choices=("both", "forward", "backward", "in-place", "all"), default="both",
                        help="which kernels the fault is in: forward, backward, both (each in turn), in-place (the "
                             "OpInfo's in-place variant, forward), all")
    parser.add_argument("--samples", type=int, default=3, help="samples with elements per op (default 3)")
    parser.add_argument("--shard", default="", help="I/N: this process's share of the ops")
    parser.add_argument("--reference", choices=("cpu", "device"), default="cpu",
                        help="where the tool's float64 reference runs (OpAutoCompare's reference=)")
    parser.add_argument("--tool", choices=("autocompare", "overflow", "compare_runs", "replay"),
                        default="autocompare",
                        help="the tool whose verdict is swept: OpAutoCompare (default), OpOverflowCheck (with "
                             "--kind nan or inf, the fault in the sample's own kernels alone), compare_runs (a "
                             "clean and a faulted run recorded, then compared), or the offline replay (a clean run "
                             "captured, its calls replayed with the fault: run_op_from_data --acc_check)")
    args = parser.parse_args()
    if args.tool == "overflow" and (args.kind not in ("nan", "inf") or args.reference != "cpu"):
        parser.error("--tool overflow sweeps --kind nan or inf, with no --reference")
    if args.tool in ("compare_runs", "replay") and args.reference != "cpu":
        parser.error(f"--tool {args.tool} takes no --reference")
    dtype = getattr(torch, args.dtype)
    narrow = dtype in (torch.float16, torch.bfloat16)
    tolerance = args.tolerance if args.tolerance is not None else 0.1 if narrow else 1e-3
    args.noise = args.noise if args.noise is not None else 0.3 if narrow else 0.1
    logging.disable(logging.CRITICAL)  # the tool's summaries, once per sample
    ditorch.sim.register()
    from torch.testing._internal.common_methods_invocations import op_db

    patterns = [p for p in args.ops.split(",") if p]
    shard, shards = map(int, args.shard.split("/")) if args.shard else (0, 1)
    silent, within, pieces, said, skipped = [], [], [], [], set()
    checked, on_device = collections.Counter(), collections.Counter()
    unchecked: list[str] = []
    phases = {"both": ("forward", "backward"), "all": ("forward", "backward", "in-place")}.get(args.phase,
                                                                                             (args.phase,))
    opinfos = [o for o in op_db if not patterns or any(
        fnmatch.fnmatchcase(o.name + (f".{o.variant_test_name}" if o.variant_test_name else ""), p) for p in patterns)]
    for position, opinfo in enumerate(opinfos):
        name = opinfo.name + (f".{opinfo.variant_test_name}" if opinfo.variant_test_name else "")
        if position % shards != shard or dtype not in opinfo.supported_dtypes("cpu"):
            continue
        try:
            samples = opinfo.sample_inputs("sim", dtype, requires_grad=opinfo.supports_autograd)
            samples = [s for s in itertools.islice(samples, 32)
                       if any(t.numel() for t in iter_tensors((s.input, s.args, s.kwargs)))][:args.samples]
        except Exception:  # noqa: BLE001 - the OpInfo cannot make samples on sim: not this sweep's question
            continue
        for index, sample in enumerate(samples):
            for phase in phases:
                try:
                    with ToolsOwnKernels() as own_kernels:
                        result = run_sample(opinfo, index, sample, args, phase, dtype)
                except Exception as e:  # noqa: BLE001 - an op sim cannot run: not this sweep's question
                    print(f"{name} sample {index}: not run ({type(e).__name__}: {str(e)[:100]})", flush=True)
                    continue
                if result == "skipped":
                    skipped.add(name)
                elif result is not None:
                    checked[phase] += 1
                    off, own, verdict, device, weak = result
                    on_device[phase] += device
                    if off > tolerance and verdict == "clean":
                        what = f"{name} sample {index}, a fault in its {phase}: off by {off:.3g} (a correct " \
                               f"{args.dtype} run: {own:.3g}), verdict clean"
                        # the rule's margin over the CPU's own error in the dtype (4x it + 4 eps): the limit the
                        # docs describe, not a call the tool did not look at
                        hidden = off <= 4 * own + 4 * torch.finfo(dtype).eps
                        if hidden:
                            within.append(what)
                            print("WITHIN A CORRECT RUN'S ERROR:", what, flush=True)
                        elif weak:  # the tool's summary said it passed calls within a correct run's large error
                            said.append(what)
                            print("PASSED WITHIN A CORRECT RUN'S LARGE ERROR, SAID SO:", what, flush=True)
                        elif own_kernels.pieces_summed and phase == "backward" and args.tool != "replay":
                            # autograd's own sum of the pieces may be the faulted kernel: the limit the docs describe
                            # (the replay compares the gradient autograd gave: no such limit)
                            pieces.append(what)
                            print("AN INPUT'S GRADIENT IN PIECES:", what, flush=True)
                        else:
                            silent.append(what)
                            print("SILENT PASS:", what, flush=True)
                    elif off > tolerance and verdict == "unchecked":  # honest, but the tool failed or could not look
                        unchecked.append(f"{name} sample {index}, a fault in its {phase}")
                        print("NOT CHECKED:", unchecked[-1], flush=True)
    faulted = ", ".join(f"{checked[phase]} in their {phase}" for phase in phases)
    kind = f"{args.kind} {args.noise:g}" if args.kind in ("noise", "scratch") else args.kind
    print(f"samples with a fault: {faulted} ({args.dtype}, {kind}, wrong when off by > {tolerance:g}); "
          f"{len(skipped)} ops skipped by the tool with their reason (random, uninitialised): "
          f"{', '.join(sorted(skipped)) or 'none'}")
    if args.reference != "cpu":
        print("judged against the device's reference throughout: "
              + ", ".join(f"{on_device[phase]} of the {checked[phase]} in their {phase}" for phase in phases))
    print(f"{len(unchecked)} wrong results the tool said it had not checked" +
          (f", the first {unchecked[0]}" if unchecked else ""))
    print(f"{len(within)} faults within 4x a correct {args.dtype} run's own error + 4 eps (the rule's margin: "
          "op_autocompare.md, Limits)")
    print(f"{len(said)} faults in calls the tool said passed within a correct run's own error of 0.1 or more of "
          "their scale (OpAutoCompare's weak_passes)" + (f", the first {said[0]}" if said else ""))
    print(f"{len(pieces)} faults in a backward whose input's gradient came in pieces, summed by autograd and, "
          "unfaulted, by the engine (autograd's sum is judged by no tool: op_autocompare.md, Limits)" +
          (f", the first {pieces[0]}" if pieces else ""))
    print(f"summary: blind_spots: {len(silent)} silent passes" +
          (f", the first {silent[0]}" if silent else ""))
    return 1 if silent else 0


if __name__ == "__main__":
    sys.exit(main())
