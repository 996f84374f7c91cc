"""TrainingMonitor: per-layer trends over optimizer steps, and anomaly rules that fire as they happen.

It is not an ``OpTool``: it intercepts no op. What it hooks, while started:

- torch.optim's global step hooks find the steps (``optimizer.step()``; GradScaler's skipped iterations are none);
- the model (``model=``, or the outermost modules called once started): forward hooks on the selected modules
  record their output's statistics, and a hook on that output its gradient's, in backward; under DDP, a hook on each
  parameter's accumulated gradient reads it before the data-parallel reduction;
- ``torch.autograd.backward`` (the loss is the root of the backward, unscaled when GradScaler scaled it),
  ``GradScaler.scale`` (the scale is found without ``scaler=``) and ``torch.nn.utils``' gradient clipping (the
  gradients' norms are taken before their first clipping in the step).

Where the work runs: every figure is computed on the device, without a host synchronisation (``_StepFigures``):
norms fused by ``torch._foreach_norm`` per device and dtype, a sharded tensor's squares summed across its shards
(``core/shards.py``, one ``all_reduce`` per group per step), and everything copied to the host in one non-blocking
transfer per device in the post-step hook (``numerics/device_readback.py``): the step never waits for the device.
The figures are taken in when their copy has arrived (at a later step's hook, polled, or at ``stop()``, which waits),
in step order; then the rules, the CSV rows and the TensorBoard event run on a writer thread, off the training
thread. A rule still names the step its figure belongs to; ``stop()`` waits for every step, so the closing line and
the files count everything.

>>> import torch, op_tools
>>> model = torch.nn.Linear(4, 2)
>>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
>>> with op_tools.TrainingMonitor(model=model, results_dir="/tmp/monitor_doctest") as monitor:  # doctest: +SKIP
...     model(torch.randn(8, 4)).square().mean().backward()
...     optimizer.step()

Files (``<results_dir>/op_training_monitor/[rank<N>/]``): ``monitor_<session>.csv`` and
``anomalies_<session>.jsonl``; docs/tools/training_monitor.md describes their layout.
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import functools
import importlib.util
import math
import os
import queue
import re
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TextIO

import torch

from ..config import typo_check
from ..config.training_monitor import TrainingMonitorConfig
from ..config.variables import BLOCKS
from ..core import shards
from ..numerics.device_readback import DeviceReadback
from ..numerics.tensor_stats import SUMMARY_FIELDS, summary
from ..ops.arguments import sparse_values
from ..ops.torch_versions import GradScaler, is_compiling
from ..output import reporting, result_files
from ..output.event_files import EventFile
from ..output.reporting import logger

FOLDER = "op_training_monitor"
CSV_COLUMNS = ("rank", "step", "time", "kind", "name", "statistic", "value")
EMA_DECAY = 0.9  # the moving average a spike is measured against: new = 0.9 * old + 0.1 * value
MOMENTS = {"exp_avg": "exp_avg_norm", "exp_avg_sq": "exp_avg_sq_norm"}  # Adam's state -> its statistic
# the gradient clipping functions of torch.nn.utils: the gradients' norms are read before their first call in a step
CLIPPING = ("clip_grad_norm_", "clip_grad_norm", "clip_grad_value_", "clip_grads_with_norm_")
# figures every data-parallel rank holds alike: written by rank 0 only
GLOBAL_STATISTICS = {"grad_norm", "weight_norm", "update_ratio", *MOMENTS.values(), "global_grad_norm", "loss_scale"}
PHASES = {"activation": "forward", "loss": "forward", "output_grad": "backward", "grad_norm_before_reduction":
          "backward", "grad_norm": "backward"}  # what the first non-finite figure says of where it arose

Key = tuple[str, str, str]  # kind, name, statistic


def tensorboard_tag(kind: str, name: str, statistic: str) -> str:
    if kind == "step":
        return statistic
    return f"{statistic}/{name}" if kind == "parameter" else f"{kind}_{statistic}/{name}"


def _combined(statistic: str, values: list[float]) -> float:
    """One figure from a module's several calls in a step (gradient accumulation): norms add as squares, extremes
    stay extreme, means and standard deviations are averaged over the calls."""
    if len(values) == 1:
        return values[0]
    if statistic in ("norm", "loss"):
        return math.sqrt(sum(v * v for v in values)) if statistic == "norm" else sum(values)
    if statistic == "min":
        return min(values)
    if statistic == "max":
        return max(values)
    return sum(values) / len(values)


class _StepFigures:
    """A step's figures on the device until sent: squares summed across their shards, then every figure copied to
    the host in one non-blocking transfer per device (``send``); ``read`` once they all arrived. Keys may repeat (a
    module called twice); ``read`` keeps them in order."""

    def __init__(self) -> None:
        self.parts: list[tuple[torch.Tensor, list[Key], bool, shards.Groups]] = []
        self._host: list[list[float]] = []
        self.remaining = 0  # devices whose transfer has not arrived

    def add(self, values: torch.Tensor, keys: list[Key], squared: bool = False, groups: shards.Groups = ()) -> None:
        self.parts.append((values.reshape(-1).float(), keys, squared, groups))

    def send(self, readback: DeviceReadback) -> None:
        summed = shards.sum_across_shards((values, groups) for values, _, _, groups in self.parts)
        by_device: dict[torch.device, list[int]] = {}
        for k, values in enumerate(summed):
            by_device.setdefault(values.device, []).append(k)
        self._host = [[] for _ in summed]
        self._sizes = [values.numel() for values in summed]
        self.remaining = len(by_device)
        for indices in by_device.values():
            readback.put(torch.cat([summed[k] for k in indices]), (self, indices))

    def arrived(self, indices: list[int], flat: list[float]) -> None:
        start = 0
        for k in indices:
            self._host[k], start = flat[start: start + self._sizes[k]], start + self._sizes[k]
        self.remaining -= 1

    def read(self) -> list[tuple[Key, float]]:
        out = []
        for (_, keys, squared, _), floats in zip(self.parts, self._host):
            for key, value in zip(keys, floats):
                out.append((key, math.sqrt(value) if squared and value >= 0 else value))
        return out


@dataclasses.dataclass(frozen=True)
class _Sent:
    """A monitored step whose figures are on their way: what writing them needs besides the figures."""

    figures: _StepFigures
    step: int
    time: float  # time.time() at the step's end
    step_time: float
    lrs: dict[str, float]
    skipped: bool = False  # an iteration GradScaler skipped: its forward figures only, judged, not written


class _HostWriter:
    """One thread doing the host's share of the monitored steps, in step order: rules, CSV rows, TensorBoard."""

    def __init__(self) -> None:
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="op_tools TrainingMonitor writer", daemon=True)
        self._thread.start()

    def submit(self, work: Callable[[], None]) -> None:
        self._work.put(work)

    def close(self) -> None:
        """Every submitted step written, then the thread ends."""
        self._work.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (work := self._work.get()) is not None:
            work()


def _dense_values(t: torch.Tensor) -> torch.Tensor:
    """A strided tensor with ``t``'s norm and inf/nan, which ``_foreach_norm`` takes (it takes no sparse tensor):
    ``t`` itself, or a sparse tensor's values, duplicates summed (an embedding's sparse gradient)."""
    values = sparse_values(t, summed=True) if t.layout is not torch.strided else None
    return t if values is None else values

def _squared_norms(items: list[tuple[Key, torch.Tensor, shards.Groups]], figures: _StepFigures) -> None:
    """Each tensor's squared norm added to ``figures``, one part per device and shard groups, in the items' order
    (the order every rank sums in, whatever the dtypes): one ``_foreach_norm`` per dtype within a part."""
    batches: dict[tuple, list[int]] = {}
    for k, (_, t, groups) in enumerate(items):
        batches.setdefault((t.device, tuple(id(g) for g in groups)), []).append(k)
    for indices in batches.values():
        by_dtype: dict[torch.dtype, list[int]] = {}
        for k in indices:
            by_dtype.setdefault(items[k][1].dtype, []).append(k)
        squares = torch.cat([torch.stack(torch._foreach_norm([_dense_values(items[k][1]) for k in ks])).float()
                             .square() for ks in by_dtype.values()])
        if len(by_dtype) > 1:  # back to the items' order
            order = [k for ks in by_dtype.values() for k in ks]
            position = {k: i for i, k in enumerate(order)}
            squares = squares[torch.tensor([position[k] for k in indices], device=squares.device)]
        figures.add(squares, [items[k][0] for k in indices], squared=True, groups=items[indices[0]][2])


def _first_tensor(output: Any) -> torch.Tensor | None:
    """The tensor a module returns, or the first of a tuple, list or mapping (a transformers ModelOutput)."""
    if isinstance(output, torch.Tensor):
        return output
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    return next((v for v in values if isinstance(v, torch.Tensor)), None)


_WRAPPERS = re.compile(r"(?:_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod)\.")


def _unwrapped(name: str, root: torch.nn.Module) -> str:
    """A name as the model's own, whatever wraps it: without DDP's ``module.``, FSDP1's, checkpoint_wrapper's and
    torch.compile's wrapper components, so that a run on many ranks names what a single process names."""
    if type(root).__name__ in ("DistributedDataParallel", "DataParallel") and name.startswith("module."):
        name = name[len("module."):]
    return _WRAPPERS.sub("", name)


@dataclasses.dataclass
class _Param:
    name: str
    param: torch.Tensor
    selected: bool
    groups: shards.Groups  # FSDP1's group for its parameters; DTensors carry theirs


class TrainingMonitor:
    """Record per-parameter gradient/weight norms, update ratios and Adam moment norms, per-module output and
    output-gradient statistics, the loss, learning rates, the global gradient norm, the loss scale and the step
    time per optimizer step; flag the first non-finite figure, gradient-norm spikes, a dropping loss scale and
    replicas whose gradients disagree, as they happen.

    Arguments (``None``: the ``OP_TRAINING_MONITOR_*`` variable, the config file's ``[monitor]`` key, the default):
    ``results_dir`` (default ``OP_TOOLS_RESULTS_DIR``), ``every`` (monitor every N-th step, from step 0),
    ``state_every`` (weight norms, update ratios and moment norms at every N-th monitored step; default 20),
    ``model`` (names parameters and modules; without it, the outermost modules called once started),
    ``parameters`` (regular expressions matched at the start of parameter names; ``None``: every parameter),
    ``activations`` (regular expressions matched against whole module names; ``"blocks"``: the items of every
    ``nn.ModuleList``; ``"none"`` or ``[]``: none), ``spike_factor`` (a spike is a gradient norm above this times its
    moving average), ``warmup`` (steps observed before a parameter's spikes are judged), ``tensorboard`` (``None``:
    event files when ``tensorboard`` is installed; ``True``: require it; ``False``: never), ``update_ratio``
    (||new - old|| / ||old|| per parameter: keeps a copy of the selected weights over the step), ``moments`` (norms
    of Adam's ``exp_avg`` and ``exp_avg_sq``), ``scaler`` (a ``torch.amp.GradScaler``; found without it when the
    script calls ``scaler.scale``), ``scale_drops`` (the ``loss_scale_dropping`` rule fires once the scale fell this
    many times in a row), ``replicas`` (under DDP, compare the ranks' gradient fingerprints each monitored step),
    ``html`` (the page at ``stop()``).
    """

    def __init__(self, results_dir: str | None = None, every: int | None = None, state_every: int | None = None,
                 parameters: list[str] | str | None = None, model: torch.nn.Module | None = None,
                 activations: list[str] | str | None = None, spike_factor: float | None = None,
                 warmup: int | None = None, tensorboard: bool | None = None, update_ratio: bool | None = None,
                 moments: bool | None = None, scaler: GradScaler | None = None,
                 scale_drops: int | None = None, replicas: bool | None = None, html: bool | None = None,
                 **shared: Any) -> None:
        if isinstance(results_dir, torch.nn.Module):  # TrainingMonitor(model), as other monitors are called
            if model is not None:
                raise TypeError(f"TrainingMonitor(): a module ({type(results_dir).__name__}) given first and model= "
                                "too; give the model once, as model=, and results_dir= a directory path")
            results_dir, model = None, results_dir
        if scaler is not None and not isinstance(scaler, GradScaler):
            raise TypeError(f"TrainingMonitor(scaler=...): expected a torch.amp.GradScaler, "
                            f"got {type(scaler).__name__}")
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"TrainingMonitor(model=...): expected a torch.nn.Module, got {type(model).__name__}")
        # None: not given (the variable, the config file's [monitor] key, then the default)
        config = TrainingMonitorConfig.resolve(
            results_dir=results_dir, every=every, state_every=state_every, parameters=parameters,
            activations=activations, spike_factor=spike_factor, warmup=warmup, tensorboard=tensorboard,
            update_ratio=update_ratio, moments=moments, scale_drops=scale_drops, replicas=replicas, html=html, **shared)
        if config.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise ImportError("TrainingMonitor(tensorboard=True) needs the tensorboard package: "
                              "pip install tensorboard")
        self.config = config
        self._parameter_patterns = None if config.parameters is None else list(config.parameters)
        self._activations_blocks = config.activations == BLOCKS
        self._activation_patterns = [] if isinstance(config.activations, str) else list(config.activations)
        self.model = model
        self.scaler = scaler
        self._hooks: list = []
        self._patches: list[tuple[Any, str, Any, Any, list[bool]]] = []
        self.step = 0  # optimizer.step() calls finished since start()
        self.anomalies: list[dict] = []
        self._csv_file: TextIO | None = None
        self._anomaly_file: result_files.JsonLinesFile | None = None
        self._writer: Any = None

    @property
    def every(self) -> int:
        return self.config.every

    @property
    def state_every(self) -> int:
        return self.config.state_every

    # --- lifecycle ---

    def start(self) -> TrainingMonitor:
        if self._hooks:
            return self
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        common = self._common = self.config.common
        reporting.configure_logging(common.verbose, common.rank, common.print_ranks)  # as every tool: rank labels
        reporting.configure_tables(common.table_width, common.rank)  # and the console's width
        typo_check.check_environment()  # as every tool: OP_TRAINING_MONITR_EVERY would be ignored in silence
        self._writes_global = common.rank in (None, 0)
        folder = result_files.prepare_results_folder(common, FOLDER, "TrainingMonitor")
        stem = result_files.session_stem()
        self._folder, self._stem = folder, stem
        self.csv_path = f"{folder}/monitor_{stem}.csv"
        self.anomalies_path = f"{folder}/anomalies_{stem}.jsonl"
        self._csv_file = open(self.csv_path, "w", newline="", encoding="utf-8")  # noqa: SIM115 - closed by stop()
        self._csv = csv.writer(self._csv_file)
        self._csv.writerow(CSV_COLUMNS)
        self._csv_file.flush()  # another rank's page reads this file: its header at once
        self._anomaly_file = result_files.JsonLinesFile(self.anomalies_path)
        self.tensorboard_dir = None
        if self.config.tensorboard is not False and importlib.util.find_spec("tensorboard") is not None:
            self.tensorboard_dir = f"{folder}/tensorboard_{stem}"
            self._writer = EventFile(self.tensorboard_dir)
        self.step, self._monitored, self.anomalies, self._state = 0, 0, [], False
        self._figures = _StepFigures()
        self._recording = True
        self._ema: dict[str, tuple[float, int]] = {}  # name -> (moving average, values seen)
        self._spiked: set[str] = set()
        self._fired: set[str] = set()  # the rules that fire once per run (nonfinite, loss scale, replicas)
        self._loss: torch.Tensor | None = None  # log_loss()'s
        self._roots: torch.Tensor | None = None  # the sum of the backward roots since the last step
        self._scaled: tuple[weakref.ref, GradScaler] | None = None  # GradScaler.scale's last output
        self._before_reduction: dict[str, torch.Tensor] = {}
        self._unclipped: dict[int, torch.Tensor] = {}  # id(parameter) -> its gradient's norm before clipping
        self._old: list[torch.Tensor] | None = None
        self._unmeasured: collections.Counter[str] = collections.Counter()
        self._compiled: set[str] = set()  # selected modules met inside a torch.compile region
        self._failed = False
        # per selection (parameters, activations): whether one was made (a step's parameters, a model attached)
        # and whether it matched anything: a pattern that matches nothing (a typo) monitors nothing, said at stop
        self._selections: dict[str, list[bool]] = {"parameters": [False, False], "activations": [False, False]}
        self._drops, self._last_scale = 0, None
        if self.scaler is not None:  # the baseline the first monitored step's scale is compared with: one sync, once
            self._last_scale = self.scaler.get_scale()
        self._names: dict[int, str] = {}
        self._order: dict[str, int] = {}  # parameter name -> its place in the model
        self._step_params: list[_Param] = []  # the monitored step's, from its pre-step hook
        self._roots_attached: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self._groups: dict[int, shards.Groups] = {}
        self._ddp_groups: list = []  # the process groups of the DDP modules found (replicas compared within)
        self._step_end = time.perf_counter()
        self._readback = DeviceReadback(batch=1)  # each step's figures leave as soon as they are computed
        self._sent: collections.deque[_Sent] = collections.deque()
        self._host_writer = _HostWriter()
        # Outside dynamo: under a torch.compile'd optimizer step dynamo would trace the hooks into its graph (and fail
        # on their host work); disabled, they break the graph and run eagerly at each step, as without compile.
        # (A partial, not the bound method: torch._disable_dynamo keeps its disabled form on the function it wraps.)
        self._hooks = [register_optimizer_step_pre_hook(torch._disable_dynamo(functools.partial(self._before_step))),
                       register_optimizer_step_post_hook(torch._disable_dynamo(functools.partial(self._after_step)))]
        if self.model is not None:
            self._attach(self.model)
        else:  # the outermost modules called: found by a global hook until the first step
            self._depth = 0
            self._finders = [torch.nn.modules.module.register_module_forward_pre_hook(self._enter_module),
                             torch.nn.modules.module.register_module_forward_hook(self._leave_module,
                                                                                     always_call=True)]
        self._patch(torch.autograd, "backward", self._backward_wrapper)
        self._patch(GradScaler, "scale", self._scale_wrapper)
        self._patch(GradScaler, "update", self._update_wrapper)
        from torch.nn.utils import clip_grad

        for owner in (torch.nn.utils, clip_grad):  # the module's own name too: clip_grad_norm calls it there
            for name in CLIPPING:
                if hasattr(owner, name):  # clip_grads_with_norm_ since torch 2.6
                    self._patch(owner, name, self._clip_wrapper)
        self._stepped = False  # an optimizer step since GradScaler's last update()
        self.skipped_iterations = 0
        return self

    def stop(self) -> None:
        if not self._hooks:
            return
        for hook in [*self._hooks, *getattr(self, "_finders", ())]:
            hook.remove()
        self._hooks, self._finders = [], []
        for owner, name, original, patched, on in reversed(self._patches):
            on[0] = False
            if getattr(owner, name) is patched:
                setattr(owner, name, original)
        self._patches = []
        self._guarded("reading the last steps' figures", lambda: self._take_in(wait=True))
        self._host_writer.close()  # every step's rows and rules done: the files below are complete
        written = [("figures per step", self.csv_path), ("anomalies", self.anomalies_path)]
        for f in (self._csv_file, self._anomaly_file, self._writer):
            if f is not None:
                f.close()
        self._csv_file = self._anomaly_file = None
        self.page_path: str | None = None
        if self.config.html and self._writes_global:  # rank 0's page holds what the other ranks had written by then
            self._guarded("writing the HTML page", self._write_page)
            if self.page_path:
                written.append(("page", self.page_path))
        if self._writer is not None:
            self._writer = None
            written.append(("TensorBoard event files", f"{self.tensorboard_dir}"))  # set with the writer
            board = ""
        elif self.config.tensorboard is False:
            board = "; no TensorBoard files (tensorboard=False)"
        else:
            board = "; no TensorBoard files (tensorboard is not installed: pip install tensorboard)"
        if self._compiled:  # said, not skipped in silence
            self._unmeasured[f"module outputs inside torch.compile regions ({', '.join(sorted(self._compiled))})"] = \
                len(self._compiled)
        unmeasured = "".join(f"; not measured: {n} x {what}" for what, n in sorted(self._unmeasured.items()))
        unmeasured += "".join(f"; {what}" for what in self._unmatched())
        made, matched = self._selections["activations"]
        if self._activations_blocks and made and not matched:  # the default: said, the verdict left as it is
            logger.info("TrainingMonitor: no module output measured (activations='blocks': the model has no "
                        "torch.nn.ModuleList; name modules with activations=[...])")
        if not self._monitored:
            unmeasured += ("; no step monitored" if self.step else
                           "; no step monitored (no optimizer step ran while it was on)")
        if self.skipped_iterations:
            unmeasured += f"; {self.skipped_iterations} iterations skipped by GradScaler (no step, figures dropped)"
        count = len(self.anomalies)
        folder = reporting.shown_path(self._folder)
        logger.info(reporting.files_text("TrainingMonitor", folder, written))
        logger.info(reporting.fit_path(f"TrainingMonitor: {self.step} steps, {self._monitored} monitored, {count} "
                                       f"{'anomaly' if count == 1 else 'anomalies'}{unmeasured}; results in {folder}"
                                       f"{board}", folder))

    end = stop

    def verdict(self) -> str:
        """``"found"`` (a rule fired: ``anomalies``), ``"unchecked"`` (none fired, but the monitor failed on some
        work, so what it would have judged went unjudged, or monitored no step) or ``"clean"``, as an op tool's
        verdict: the exit status of ``python -m op_tools monitor`` (3, 4 or 0)."""
        if self.anomalies:
            return "found"
        if getattr(self, "_failed", False) or not getattr(self, "_monitored", 0):  # none before the first start()
            return "unchecked"  # a failure, or no step monitored at all: nothing judged is no clean verdict
        return "unchecked" if self._unmatched() else "clean"  # asked to watch what it never found

    def _unmatched(self) -> list[str]:
        """What the closing line says of a selection that matched nothing it was applied to."""
        found = []
        selections = getattr(self, "_selections", {})
        made, matched = selections.get("parameters", (False, False))
        if self._parameter_patterns and made and not matched:  # [] (the variable empty) selects none on purpose
            found.append("parameters matched no parameter the optimizer updates: "
                         + ", ".join(p.pattern for p in self._parameter_patterns))
        made, matched = selections.get("activations", (False, False))
        if self._activation_patterns and made and not matched:  # not "blocks", the default: a model may have none
            found.append("activations matched no module of the model: "
                         + ", ".join(p.pattern for p in self._activation_patterns))
        return found

    def __enter__(self) -> TrainingMonitor:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _write_page(self) -> None:
        from ..offline.monitor_page import write_monitor_page

        results = self._folder if self._common.rank is None else os.path.dirname(self._folder)
        self.page_path = write_monitor_page(results, session=self._stem)

    def log_loss(self, loss: torch.Tensor | float) -> None:
        """The loss of the step about to be taken (instead of the backward roots); a tensor is read with that step's
        figures (no sync here)."""
        self._loss = loss.detach() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))

    def _patch(self, owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
        """``owner.name`` wrapped by ``make(original)`` until ``stop()``: put back there only where it is still ours;
        under another's later patch (a user's, another tool's) it is left to pass calls through, so that stopping
        never takes away what was installed over it."""
        original = getattr(owner, name)
        wrapped = make(original)
        on = [True]

        @functools.wraps(original)
        def patched(*args, **kwargs):
            return (wrapped if on[0] else original)(*args, **kwargs)

        self._patches.append((owner, name, original, patched, on))
        setattr(owner, name, patched)

    def _guarded(self, what: str, work: Callable[[], None], step: int | None = None) -> None:
        """A monitor failing never stops the user's step: said once, counted, later steps tried again (``step``: the
        step the work is for, when not the current one)."""
        try:
            work()
        except Exception:  # noqa: BLE001 - see the docstring
            self._unmeasured[f"{what} failed"] += 1
            if not self._failed:
                self._failed = True
                logger.exception("TrainingMonitor: %s at step %d failed; later steps are tried again", what,
                                 self.step if step is None else step)

    # --- the model: names, selected modules, hooks ---

    def _enter_module(self, module: torch.nn.Module, _args) -> None:
        if self._depth == 0 and module not in self._roots_attached:
            self._guarded("attaching to the model", lambda: self._attach(module))
        self._depth += 1

    def _leave_module(self, *_) -> None:
        self._depth = max(0, self._depth - 1)

    def _attach(self, root: torch.nn.Module) -> None:
        self._roots_attached.add(root)
        for name, p in root.named_parameters():
            self._names.setdefault(id(p), _unwrapped(name, root))
        self._order = {name: k for k, name in enumerate(self._names.values())}
        self._groups.update(shards.fsdp1_groups(root))
        modules = self._activation_modules(root)
        self._selections["activations"] = [True, self._selections["activations"][1] or bool(modules)]
        for name, module in modules:
            self._hooks.append(module.register_forward_hook(functools.partial(self._after_forward, name)))
        from torch.nn.parallel import DistributedDataParallel

        for ddp in (m for m in root.modules() if isinstance(m, DistributedDataParallel)):
            self._ddp_groups.append(ddp.process_group)
            for p in ddp.parameters():
                if p.requires_grad:
                    hook = functools.partial(self._accumulated, self._names.get(id(p), ""))
                    self._hooks.append(p.register_post_accumulate_grad_hook(hook))

    def _activation_modules(self, root: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
        if self._activations_blocks:
            return [(_unwrapped(f"{name}.{child}" if name else child, root), m) for name, lst in root.named_modules()
                    if isinstance(lst, torch.nn.ModuleList) for child, m in lst.named_children()]
        named = [(_unwrapped(name, root), m) for name, m in root.named_modules() if name]
        return [(name, m) for name, m in named if any(p.fullmatch(name) for p in self._activation_patterns)]

    def _after_forward(self, name: str, module: torch.nn.Module, _args, output) -> None:
        # training forwards only (not eval mode; not grad mode: a reentrant checkpoint runs the training forward
        # under no_grad), once: a checkpoint's recomputation inside backward only gives the output whose gradient
        # backward computes (a reentrant checkpoint's first output had none)
        if is_compiling():  # traced into a graph once: a hook's figures would not be taken per call
            self._compiled.add(name)
            return
        if not self._recording or not module.training:
            return
        t = _first_tensor(output)
        if t is None or not t.is_floating_point() or t.numel() == 0:
            return
        if hasattr(t, "placements"):
            self._unmeasured["DTensor module outputs"] += 1
            return
        if torch._C._current_graph_task_id() == -1:
            with torch.no_grad(), torch._C.DisableTorchFunction():  # the tools' own work: no tool sees these calls
                self._figures.add(summary(t.detach()), [("activation", name, s) for s in SUMMARY_FIELDS])
        if t.requires_grad:
            t.register_hook(functools.partial(self._output_grad, name))

    def _output_grad(self, name: str, grad: torch.Tensor) -> None:
        if grad is None or grad.numel() == 0:
            return
        with torch.no_grad(), torch._C.DisableTorchFunction():
            self._figures.add(summary(grad.detach()), [("output_grad", name, s) for s in SUMMARY_FIELDS])

    def _accumulated(self, name: str, p: torch.Tensor) -> None:
        """DDP: the gradient as this rank accumulated it, before the reduction (DDP's hooks run after this one)."""
        if self._recording and p.grad is not None:
            with torch.no_grad(), torch._C.DisableTorchFunction():
                self._before_reduction[name] = torch.linalg.vector_norm(p.grad).float().square()

    def _backward_wrapper(self, original: Callable) -> Callable:
        def backward(tensors, *args, **kwargs):
            # gradients before clipping are those of the clip after the last backward: a clip whose step the program
            # then skipped (its own check of the norm) would leave its norms to the next step's
            self._unclipped = {}
            if self._recording:
                self._guarded("reading the loss", lambda: self._root(tensors))
            return original(tensors, *args, **kwargs)
        return backward

    def _root(self, tensors: Any) -> None:
        if not isinstance(tensors, torch.Tensor) or tensors.numel() != 1:
            return
        with torch.no_grad(), torch._C.DisableTorchFunction():
            root = tensors.detach().float().reshape(1)
            scaled = self._scaled
            if scaled is not None and scaled[0]() is tensors:  # GradScaler multiplied the loss by its scale
                root = root / scaled[1]._scale.float()  # type: ignore[union-attr]
            self._roots = root if self._roots is None else self._roots + root

    def _scale_wrapper(self, original: Callable) -> Callable:
        def scale(scaler, outputs):
            scaled = original(scaler, outputs)
            if isinstance(scaled, torch.Tensor) and scaler.is_enabled():
                self._scaled = (weakref.ref(scaled), scaler)
                if self.scaler is None:
                    self.scaler, self._last_scale = scaler, scaler.get_scale()
            return scaled
        return scale

    def _update_wrapper(self, original: Callable) -> Callable:
        def update(scaler, *args, **kwargs):
            skipped, self._stepped = not self._stepped, False
            updated = original(scaler, *args, **kwargs)
            if skipped:  # GradScaler skipped this iteration's step (inf gradients): its figures are none
                self.skipped_iterations += 1
                self._guarded("recording", lambda: self._send_skipped(scaler))
                self._figures, self._old, self._loss, self._roots = _StepFigures(), None, None, None
                self._before_reduction, self._unclipped = {}, {}
            return updated
        return update

    def _clip_wrapper(self, original: Callable) -> Callable:
        def clip(parameters, *args, **kwargs):
            if self._recording:
                params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
                if not isinstance(parameters, (torch.Tensor, list, tuple)):  # an iterator, read here: given anew
                    parameters = (p for p in params)
                self._guarded("reading the gradients before clipping", lambda: self._read_unclipped(params))
            return original(parameters, *args, **kwargs)
        return clip

    def _read_unclipped(self, params: list[torch.Tensor]) -> None:
        """Each gradient's norm before the step's first clipping, kept on the device for ``_record_before``:
        measured after clipping, every norm is at most max_norm and a spike is never seen (Trainer clips at 1)."""
        by_kind: dict[tuple[torch.device, torch.dtype], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for p in params:
            if p.grad is not None and id(p) not in self._unclipped:
                by_kind.setdefault((p.grad.device, p.grad.dtype), []).append((p, p.grad))
        with torch.no_grad(), torch._C.DisableTorchFunction():
            for pairs in by_kind.values():
                norms = torch._foreach_norm([_dense_values(shards.local_part(grad)) for _, grad in pairs])
                for (p, _), norm in zip(pairs, norms):  # a shard's: squares summed across shards as the gradient's
                    self._unclipped[id(p)] = norm.float().reshape(1)

    def _send_skipped(self, scaler: GradScaler) -> None:
        """What is judged of an iteration GradScaler skipped: its forward figures (module outputs, the loss), by the
        non-finite rule (its gradients are scaled, and may overflow by design, its forward is not), and the scale
        its update() lowered, by the loss-scale rule (a run may end on skipped iterations: no step would see it)."""
        forward = _StepFigures()
        with torch.no_grad(), torch._C.DisableTorchFunction():
            if self._recording:
                forward.parts = [part for part in self._figures.parts
                                 if all(key[0] == "activation" for key in part[1])]
                loss = self._loss if self._loss is not None else self._roots
                if loss is not None:
                    forward.add(loss.float(), [("step", "", "loss")])
            scale = getattr(scaler, "_scale", None) if scaler is self.scaler and scaler.is_enabled() else None
            if scale is not None:
                forward.add(scale.detach(), [("step", "", "loss_scale")])  # copied by send(), below
            if forward.parts:
                forward.send(self._readback)
                self._sent.append(_Sent(forward, self.step, time.time(), 0.0, {}, skipped=True))

    # --- the optimizer's hooks ---

    def _before_step(self, optimizer, *_) -> None:
        if self.step == 0 and getattr(self, "_finders", None):  # the model is known by its first step
            for hook in self._finders:
                hook.remove()
            self._finders = []
        if self._recording:
            self._guarded("recording", lambda: self._record_before(optimizer))

    def _after_step(self, optimizer, *_) -> None:
        now = time.perf_counter()  # the host's view: no device synchronisation added
        step_time, self._step_end = now - self._step_end, now
        try:
            if self._recording:
                self._guarded("recording", lambda: self._record_after(optimizer, step_time))
            if self._sent:  # never waits: what has arrived, from this step or earlier ones
                self._guarded("reading", lambda: self._take_in(wait=False))
        finally:
            self._figures, self._old, self._loss, self._roots = _StepFigures(), None, None, None
            self._before_reduction, self._unclipped, self._step_params = {}, {}, []
            self._stepped = True
            self.step += 1
            self._recording = self.step % self.every == 0

    def _params(self, optimizer) -> list[_Param]:
        found = []
        for g, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                name = self._names.get(id(p)) or f"param_groups[{g}][{i}]"
                selected = self._parameter_patterns is None or any(r.match(name) for r in self._parameter_patterns)
                found.append(_Param(name, p, selected, self._groups.get(id(p), ())))
        self._selections["parameters"] = [True, self._selections["parameters"][1] or any(p.selected for p in found)]
        if self._order:  # model order: the order named_parameters() gives
            found.sort(key=lambda r: self._order.get(r.name, len(self._order)))
        return found

    def _tensor_groups(self, param: _Param, t: torch.Tensor) -> shards.Groups | None:
        """The groups ``t`` (the parameter, its gradient or its state) is sharded over; None when its local values
        are pending sums (no norm of them is the full tensor's)."""
        if shards.is_partial(t):
            return None
        return shards.dtensor_groups(t) if hasattr(t, "placements") else param.groups

    def _record_before(self, optimizer) -> None:
        params = self._step_params = self._params(optimizer)
        figures = self._figures
        # weights, updates and moments (a pass over every weight each) at every state_every-th monitored step
        self._state = (self.step // self.every) % self.state_every == 0
        with torch.no_grad(), torch._C.DisableTorchFunction():  # the tools' own work: no tool sees these calls
            loss = self._loss if self._loss is not None else self._roots
            if loss is not None:
                figures.add(loss.float(), [("step", "", "loss")])
            if self._before_reduction:  # filled in backward order: written in model order
                names = sorted(self._before_reduction, key=lambda n: self._order.get(n, len(self._order)))
                figures.add(torch.stack([self._before_reduction[n] for n in names]),
                            [("parameter", n, "grad_norm_before_reduction") for n in names], squared=True)
            items: list[tuple[Key, torch.Tensor, shards.Groups]] = []
            # FSDP1 (use_orig_params): a rank holding none of a parameter has no gradient nor Adam state for it, yet
            # every rank must add a part to each sum: an empty one, and a count of the ranks that have a gradient
            held: dict[tuple[int, ...], tuple[shards.Groups, list[Key], list[float]]] = {}
            for p in params:
                grad = p.param.grad
                if p.groups:
                    entry = held.setdefault(tuple(id(g) for g in p.groups), (p.groups, [], []))
                    entry[1].append(("_held", p.name, "grad"))
                    entry[2].append(0.0 if grad is None else 1.0)
                if grad is not None:
                    groups = self._tensor_groups(p, grad)
                    if groups is None:
                        self._unmeasured["gradients holding partial sums"] += 1
                    else:
                        # the norm of a one-element tensor holding a norm is that norm
                        measured = self._unclipped.get(id(p.param))
                        items.append((("parameter", p.name, "grad_norm"),
                                      shards.local_part(grad) if measured is None else measured, groups))
                elif p.groups:
                    items.append((("parameter", p.name, "grad_norm"), p.param.new_zeros(0), p.groups))
                if p.selected and self._state:
                    items.append((("parameter", p.name, "weight_norm"), shards.local_part(p.param),
                                  self._tensor_groups(p, p.param) or ()))
            _squared_norms(items, figures)
            for groups, keys, counts in held.values():
                figures.add(torch.tensor(counts, device=shards.local_part(params[0].param).device), keys,
                            groups=groups)
            scale = getattr(self.scaler, "_scale", None) if self.scaler is not None and self.scaler.is_enabled() \
                else None  # GradScaler keeps its scale in a device tensor (None until its first scale())
            if scale is not None:
                figures.add(scale.detach(), [("step", "", "loss_scale")])
            if self.config.replicas and self._ddp_groups:
                self._replica_flags(params, figures)
            if self.config.update_ratio and self._state:  # None where no parameter is selected: no update to take
                self._old = [shards.local_part(p.param).detach().clone() for p in params if p.selected] or None
        self._lrs = {f"lr/param_groups[{g}]": float(group["lr"]) for g, group in enumerate(optimizer.param_groups)
                     if "lr" in group}

    def _replica_flags(self, params: list[_Param], figures: _StepFigures) -> None:
        """DDP: each rank's gradient checksums gathered from every rank of the DDP group, compared on the device:
        per parameter, whether any rank differs from the group's first; per rank, whether it differs anywhere."""
        from torch.distributed import distributed_c10d

        from ..core.replicas import checksum

        replicated = [p for p in params if p.param.grad is not None and not p.groups and
                      not hasattr(p.param, "placements")]
        if not replicated:
            return
        group = self._ddp_groups[0]
        local = torch.stack([checksum(p.param.grad) for p in replicated])  # type: ignore[arg-type]
        gathered = [torch.empty_like(local) for _ in range(distributed_c10d.get_world_size(group))]
        distributed_c10d.all_gather(gathered, local, group=group)
        differs = torch.stack(gathered) != gathered[0]
        ranks = distributed_c10d.get_process_group_ranks(group)
        figures.add(torch.cat([differs.any(0), differs.any(1)]),
                    [("_replica", p.name, "differs") for p in replicated] +
                    [("_replica_rank", str(r), "differs") for r in ranks])

    def _record_after(self, optimizer, step_time: float) -> None:
        figures = self._figures
        with torch.no_grad(), torch._C.DisableTorchFunction():
            items: list[tuple[Key, torch.Tensor, shards.Groups]] = []
            selected = [p for p in self._step_params if p.selected]
            if self._old is not None:
                torch._foreach_sub_(self._old, [shards.local_part(p.param).detach() for p in selected])
                for p, delta in zip(selected, self._old):  # old - new, in place: no more memory
                    items.append((("parameter", p.name, "_update"), delta, self._tensor_groups(p, p.param) or ()))
            if self.config.moments and self._state:
                kept = {m for state in optimizer.state.values() for m in MOMENTS if m in state}
                for p in self._step_params:
                    state = optimizer.state.get(p.param, {}) if p.selected else {}
                    for moment, statistic in MOMENTS.items():
                        t = state.get(moment)
                        if isinstance(t, torch.Tensor) and t.shape == p.param.shape:  # not Adam's step count
                            items.append((("parameter", p.name, statistic), shards.local_part(t),
                                          self._tensor_groups(p, t) or ()))
                        elif p.selected and p.groups and moment in kept:  # FSDP1: see _record_before
                            items.append((("parameter", p.name, statistic), p.param.new_zeros(0), p.groups))
            _squared_norms(items, figures)
            figures.send(self._readback)
        self._monitored += 1
        self._sent.append(_Sent(figures, self.step, time.time(), step_time, self._lrs))

    def _take_in(self, wait: bool) -> None:
        """The figures that arrived (all of them, waiting, with ``wait``), handed to the writer in step order."""
        for (figures, indices), flat in (self._readback.drain() if wait else self._readback.ready()):
            figures.arrived(indices, flat)
        while self._sent and self._sent[0].figures.remaining == 0:
            self._host_writer.submit(functools.partial(self._write_guarded, self._sent.popleft()))

    def _write_guarded(self, sent: _Sent) -> None:
        self._guarded("writing", lambda: self._write(sent), sent.step)

    # --- host: rows, files, rules ---

    def _write(self, sent: _Sent) -> None:
        """On the writer thread: the step's figures combined, judged by the rules, written."""
        read, step, now, step_time = sent.figures.read(), sent.step, sent.time, sent.step_time
        if sent.skipped:  # dropped, as the iteration's other figures, once judged
            self._nonfinite(step, read, " (in an iteration GradScaler skipped)")
            scale = next((value for key, value in read if key == ("step", "", "loss_scale")), None)
            if scale is not None:
                self._check_scale(step, scale, skipped=True)
            return
        values: dict[Key, list[float]] = {}
        for key, value in read:
            values.setdefault(key, []).append(value)
        figures = {key: _combined(key[2], vs) for key, vs in values.items()}
        for (kind, name, _), count in list(figures.items()):
            if kind == "_held" and not count:  # no rank has its gradient: nothing to write but zeros
                for statistic in ("grad_norm", *MOMENTS.values()):
                    figures.pop(("parameter", name, statistic), None)
        for (kind, name, statistic), value in list(figures.items()):
            if statistic == "_update":
                weight = figures.get((kind, name, "weight_norm"))
                figures[(kind, name, "update_ratio")] = value / weight if weight else float("nan")
        grads = [v for (kind, _, s), v in figures.items() if kind == "parameter" and s == "grad_norm"]
        if grads:
            figures[("step", "", "global_grad_norm")] = math.sqrt(sum(g * g for g in grads))
        for name, lr in sent.lrs.items():
            figures[("step", "", name)] = float(lr)
        figures[("step", "", "step_time")] = step_time
        self._rules(step, read, figures)
        rank = "" if self._common.rank is None else self._common.rank
        order = {"step": 0, "parameter": 1, "activation": 2, "output_grad": 3}
        rows = sorted(((k, v) for k, v in figures.items() if k[0] in order and not k[2].startswith("_")
                       and self._writes(k)), key=lambda kv: order[kv[0][0]])
        stamp = f"{now:.6f}"
        for (kind, name, statistic), value in rows:
            self._csv.writerow((rank, step, stamp, kind, name, statistic, repr(value)))
        if self._writer is not None:  # one event per step holding every scalar: add_scalar writes one per value
            self._writer.add_scalars(step, [(tensorboard_tag(kind, name, statistic), float(value))
                                            for (kind, name, statistic), value in rows])

    def _writes(self, key: Key) -> bool:
        kind, name, statistic = key
        if kind == "parameter" and not self._is_selected(name):
            return False
        is_global = statistic in GLOBAL_STATISTICS or statistic.startswith("lr/")
        return self._writes_global or not is_global

    def _is_selected(self, name: str) -> bool:
        return self._parameter_patterns is None or any(r.match(name) for r in self._parameter_patterns)

    def _rules(self, step: int, read: list[tuple[Key, float]], figures: dict[Key, float]) -> None:
        self._nonfinite(step, read)
        self._spikes(step, [(name, v) for (kind, name, s), v in figures.items()
                            if kind == "parameter" and s == "grad_norm" and self._is_selected(name)])
        scale = figures.get(("step", "", "loss_scale"))
        if scale is not None:
            self._check_scale(step, scale)
        differing = [name for (kind, name, _), v in figures.items() if kind == "_replica" and v]
        if differing and "replica_mismatch" not in self._fired:
            self._fired.add("replica_mismatch")
            ranks = [int(r) for (kind, r, _), v in figures.items() if kind == "_replica_rank" and v]
            self._anomaly({"rule": "replica_mismatch", "step": step, "module": differing[0], "phase": "backward",
                           "value": None, "ranks": ranks, "parameters": differing},
                          f"replicas disagree at step {step}: the gradient of {differing[0]} differs between "
                          f"data-parallel ranks (ranks {ranks} differ from the group's first; {len(differing)} "
                          f"parameters differ)")

    def _nonfinite(self, step: int, read: list[tuple[Key, float]], where: str = "") -> None:
        """The first non-finite figure in the order it arose: forward outputs, the loss, output gradients in backward
        order, gradients before and after the reduction (the loss is added at the optimizer's step, after the
        gradients: put back between the forward's and the backward's figures). A module's norm, mean or std may
        overflow float32 while its values, their min and max, are all finite: said so, not called a non-finite value."""
        if "nonfinite" in self._fired:
            return
        extremes: dict[tuple[str, str], list[float]] = {}  # (kind, module) -> the min and max of its tensors
        for (kind, name, statistic), value in read:
            if statistic in ("min", "max"):
                extremes.setdefault((kind, name), []).append(value)
        # stable: each part keeps the order its figures were added in
        ordered = sorted(read, key=lambda item: 0 if item[0][0] == "activation" else 1 if item[0][2] == "loss" else 2)
        for (kind, name, statistic), value in ordered:
            what = "loss" if statistic == "loss" else kind if kind in ("activation", "output_grad") else statistic
            if what in PHASES and not math.isfinite(value):
                self._fired.add("nonfinite")
                count = sum(1 for (k, _, s), v in read if k == "parameter" and s == "grad_norm" and
                            not math.isfinite(v))
                label = {"activation": f"the output of {name}", "output_grad": f"the gradient of {name}'s output",
                         "loss": "the loss"}.get(what, f"the gradient of {name}" +
                                                 (" before the reduction" if what != "grad_norm" else ""))
                bounds = extremes.get((kind, name), [])
                overflow = bool(bounds) and all(math.isfinite(v) for v in bounds)
                said = (f"first non-finite figure at step {step}{where} in {PHASES[what]}: the {statistic} of {label} "
                        f"overflows float32 ({statistic} = {value}; its values are finite, from {min(bounds):g} to "
                        f"{max(bounds):g})" if overflow else
                        f"first non-finite value at step {step}{where} in {PHASES[what]}: {label} "
                        f"({statistic} = {value})")
                self._anomaly({"rule": "nonfinite", "step": step, "module": name, "phase": PHASES[what],
                               "statistic": f"{kind}:{statistic}" if kind != "step" else statistic, "value": value,
                               "overflow": overflow, "nonfinite_gradients": count},
                              f"{said}; {count} parameter gradients non-finite")
                return

    def _spikes(self, step: int, grads: list[tuple[str, float]]) -> None:
        spikes = []
        for name, g in grads:
            if not math.isfinite(g):
                continue
            average, seen = self._ema.get(name, (g, 0))
            if seen >= self.config.warmup and g > self.config.spike_factor * average and name not in self._spiked:
                spikes.append((name, g, average))
            self._ema[name] = (EMA_DECAY * average + (1 - EMA_DECAY) * g, seen + 1)
        if spikes:
            factor = self.config.spike_factor
            self._spiked.update(name for name, _, _ in spikes)
            name, g, average = spikes[0]
            self._anomaly({"rule": "grad_norm_spike", "step": step, "module": name, "phase": "backward",
                           "value": g, "moving_average": average, "factor": factor,
                           "parameters": [n for n, _, _ in spikes]},
                          f"gradient norm spike at step {step}: {name} = {g:.6g} > {factor:g} x its moving "
                          f"average {average:.6g} ({len(spikes)} parameters spiked)")

    def _check_scale(self, step: int, scale: float, skipped: bool = False) -> None:
        """Count the scale's falls in a row, in backoff factors: a fall between two monitored steps spans the
        iterations GradScaler skipped (it skips optimizer.step() on inf gradients, so no hook sees them). A skipped
        iteration's scale (``skipped``, after its update()) is judged as the next monitored step would judge it,
        and left for that step to count: the rule fires where the falls arose, even if no step follows."""
        last, backoff, falls = self._last_scale, getattr(self.scaler, "_backoff_factor", 0.5), 0
        if last is not None and 0 < scale < last:
            falls = max(1, round(math.log(scale / last) / math.log(backoff))) if 0 < backoff < 1 else 1
        drops = self._drops + falls
        if not skipped:
            self._last_scale, self._drops = scale, drops if falls else 0
        if falls and drops >= self.config.scale_drops and "loss_scale_dropping" not in self._fired:
            self._fired.add("loss_scale_dropping")
            where = " (in an iteration GradScaler skipped)" if skipped else ""
            self._anomaly({"rule": "loss_scale_dropping", "step": step, "module": "", "phase": "optimizer",
                           "value": scale, "drops": drops},
                          f"loss scale dropping at step {step}{where}: {scale:g} after {drops} drops in a row "
                          f"(scale_drops={self.config.scale_drops})")

    def _anomaly(self, record: dict, message: str) -> None:
        record = {"rank": self._common.rank, "time": round(time.time(), 6), **record, "message": message}
        self.anomalies.append(record)
        if self._anomaly_file is not None:
            self._anomaly_file.write(record)
            self._anomaly_file.flush()  # few a run (a rule once, a spike once a parameter): kept if the run dies
        logger.warning("TrainingMonitor: %s", message)
