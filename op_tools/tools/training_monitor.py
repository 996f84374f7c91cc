"""TrainingMonitor: per-parameter gradient and weight norms, loss, learning rates and the global gradient norm, step
by step, with anomaly rules that fire as they happen.

It is not an ``OpTool``: it intercepts no op. torch.optim's global step hooks find the steps; before each monitored
``optimizer.step()`` it computes every parameter's gradient and weight norm on the device (``torch._foreach_norm``,
fused per device and dtype), stacks them with the loss (and a GradScaler's scale) and reads them back in one
device->host transfer per device; the post-step hook times the step on the host and writes its rows.

>>> import torch, op_tools
>>> model = torch.nn.Linear(4, 2)
>>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
>>> with op_tools.TrainingMonitor(model=model, results_dir="/tmp/monitor_doctest") as monitor:  # doctest: +SKIP
...     loss = model(torch.randn(8, 4)).square().mean()
...     loss.backward()
...     monitor.log_loss(loss)
...     optimizer.step()

Files (``<results_dir>/op_training_monitor/[rank<N>/]``): ``monitor_<session>.csv`` and
``anomalies_<session>.jsonl``; docs/tools/training_monitor.md describes their layout.
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import math
import re
import time
from typing import Any, TextIO

import torch

from ..config.variables import CommonConfig
from ..output import result_files
from ..output.reporting import logger

FOLDER = "op_training_monitor"
CSV_COLUMNS = ("rank", "step", "time", "name", "grad_norm", "weight_norm", "update_ratio", "value")
EMA_DECAY = 0.9  # the moving average a spike is measured against: new = 0.9 * old + 0.1 * value


@dataclasses.dataclass
class _ParamRow:
    name: str
    param: torch.Tensor


class TrainingMonitor:
    """Record per-parameter gradient/weight norms, the loss, learning rates and the global gradient norm per optimizer
    step, and flag the first non-finite gradient norm and gradient-norm spikes as they happen.

    Arguments: ``results_dir`` (default ``OP_TOOLS_RESULTS_DIR``), ``every`` (monitor every N-th step, from step 0),
    ``model`` (names parameters through ``named_parameters()``; without it ``param_groups[g][i]``), ``modules`` (regular
    expressions; a parameter is recorded when one matches the start of its name; ``None``: every parameter),
    ``spike_factor`` (a spike is a gradient norm above this times its moving average), ``warmup`` (steps observed
    before a parameter's spikes are judged), ``tensorboard`` (``None``: write event files when ``tensorboard`` is
    installed; ``True``: require it; ``False``: never), ``update_ratio`` (also ||new - old|| / ||old|| per parameter:
    keeps a copy of the selected weights over each monitored step, and costs a second transfer per step), ``scaler``
    (a ``torch.amp.GradScaler``: its scale is written per monitored step as ``loss_scale``), ``scale_drops`` (the
    ``loss_scale_dropping`` rule fires once the scale fell this many times in a row).
    """

    def __init__(self, results_dir: str | None = None, every: int = 1, modules: list[str] | str | None = None,
                 model: torch.nn.Module | None = None, spike_factor: float = 10.0, warmup: int = 3,
                 tensorboard: bool | None = None, update_ratio: bool = False,
                 scaler: torch.amp.GradScaler | None = None, scale_drops: int = 3) -> None:
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"TrainingMonitor(every={every!r}): expected an integer >= 1")
        if not isinstance(spike_factor, (int, float)) or not spike_factor > 1:
            raise ValueError(f"TrainingMonitor(spike_factor={spike_factor!r}): expected a number > 1")
        if not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"TrainingMonitor(warmup={warmup!r}): expected an integer >= 1")
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"TrainingMonitor(scaler=...): expected a torch.amp.GradScaler, "
                            f"got {type(scaler).__name__}")
        if not isinstance(scale_drops, int) or isinstance(scale_drops, bool) or scale_drops < 1:
            raise ValueError(f"TrainingMonitor(scale_drops={scale_drops!r}): expected an integer >= 1")
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"TrainingMonitor(model=...): expected a torch.nn.Module, got {type(model).__name__}")
        if tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise ImportError("TrainingMonitor(tensorboard=True) needs the tensorboard package: "
                              "pip install tensorboard")
        patterns = [modules] if isinstance(modules, str) else modules
        try:
            self._patterns = None if patterns is None else [re.compile(p) for p in patterns]
        except re.error as e:
            raise ValueError(f"TrainingMonitor(modules={modules!r}): not a regular expression: {e}") from e
        self.results_dir = results_dir
        self.every = every
        self.model = model
        self.spike_factor = float(spike_factor)
        self.warmup = warmup
        self.tensorboard = tensorboard
        self.update_ratio = bool(update_ratio)
        self.scaler = scaler
        self.scale_drops = scale_drops
        self._last_scale: float | None = None  # the scale last seen (at start(), then at each monitored step)
        self._drops = 0  # the scale's falls in a row, counted in backoff factors
        self._scale_fired = False
        self._step_end = 0.0  # time.perf_counter() at the last optimizer post-step hook (or start())
        self._pending: dict | None = None  # a step's host figures waiting for its update ratios (post-step)
        self.step = 0  # optimizer.step() calls finished since start()
        self.anomalies: list[dict] = []
        self._hooks: tuple = ()
        self._loss: torch.Tensor | None = None
        self._ema: dict[str, tuple[float, int]] = {}  # name -> (moving average, values seen)
        self._spiked: set[str] = set()
        self._nan_seen = False
        self._monitored = 0
        self._csv_file: TextIO | None = None
        self._csv: Any = None
        self._anomaly_file: result_files.JsonLinesFile | None = None
        self._writer: Any = None
        self._names: dict[int, str] = {}

    # --- lifecycle ---

    def start(self) -> TrainingMonitor:
        if self._hooks:
            return self
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        common = CommonConfig.from_env()
        if self.results_dir is not None:
            common = dataclasses.replace(common, results_dir=str(self.results_dir))
        self._common = common
        folder = result_files.prepare_results_folder(common, FOLDER, "TrainingMonitor")
        stem = result_files.session_stem()
        self.csv_path = f"{folder}/monitor_{stem}.csv"
        self.anomalies_path = f"{folder}/anomalies_{stem}.jsonl"
        self._csv_file = open(self.csv_path, "w", newline="", encoding="utf-8")  # noqa: SIM115 - closed by stop()
        self._csv = csv.writer(self._csv_file)
        self._csv.writerow(CSV_COLUMNS)
        self._anomaly_file = result_files.JsonLinesFile(self.anomalies_path)
        self.tensorboard_dir = None
        if self.tensorboard is not False and importlib.util.find_spec("tensorboard") is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard_dir = f"{folder}/tensorboard_{stem}"
            self._writer = SummaryWriter(self.tensorboard_dir)
        self._names = {} if self.model is None else {id(p): n for n, p in self.model.named_parameters()}
        self.step, self._monitored, self.anomalies = 0, 0, []
        self._ema, self._spiked, self._nan_seen, self._loss, self._pending = {}, set(), False, None, None
        self._drops, self._scale_fired, self._last_scale = 0, False, None
        if self.scaler is not None:  # the baseline the first monitored step's scale is compared with: one sync, once
            self._last_scale = self.scaler.get_scale()
        self._step_end = time.perf_counter()
        self._hooks = (register_optimizer_step_pre_hook(self._before_step),
                       register_optimizer_step_post_hook(self._after_step))
        return self

    def stop(self) -> None:
        if not self._hooks:
            return
        for hook in self._hooks:
            hook.remove()
        self._hooks = ()
        if self._pending is not None:  # its step never finished: written without update ratios nor step time
            self._write(self._pending, None)
            self._pending = None
        written = [self.csv_path, self.anomalies_path]
        if self._csv_file is not None:
            self._csv_file.close()
            self._csv_file = None
        if self._anomaly_file is not None:
            self._anomaly_file.close()
            self._anomaly_file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
            written.append(f"TensorBoard event files in {self.tensorboard_dir}")
            board = ""
        elif self.tensorboard is False:
            board = "; no TensorBoard files (tensorboard=False)"
        else:
            board = "; no TensorBoard files (tensorboard is not installed: pip install tensorboard)"
        logger.info("TrainingMonitor: %d steps, %d monitored, %d anomalies; wrote %s%s", self.step, self._monitored,
                    len(self.anomalies), ", ".join(written), board)

    end = stop

    def __enter__(self) -> TrainingMonitor:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_loss(self, loss: torch.Tensor | float) -> None:
        """The loss of the step about to be taken; a tensor is read with that step's statistics (no sync here)."""
        self._loss = loss.detach() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))

    # --- the optimizer's hooks ---

    def _after_step(self, optimizer, *_) -> None:
        pending, self._pending = self._pending, None
        now = time.perf_counter()  # the host's view: no device synchronisation added
        step_time, self._step_end = now - self._step_end, now
        try:
            if pending is not None:
                pending["scalars"]["step_time"] = step_time
                ratios = self._update_ratios(pending) if "old" in pending and pending["optimizer"] is optimizer \
                    else None
                self._write(pending, ratios)
        except Exception:  # noqa: BLE001 - a monitor failing never stops the user's step; said once
            if not getattr(self, "_failed", False):
                self._failed = True
                logger.exception("TrainingMonitor: recording step %d failed; later steps are tried again", self.step)
        finally:
            self.step += 1

    def _before_step(self, optimizer, *_) -> None:
        if self.step % self.every:
            self._loss = None
            return
        try:
            self._record(optimizer)
        except Exception:  # noqa: BLE001 - a monitor failing never stops the user's step; said once
            if not getattr(self, "_failed", False):
                self._failed = True
                logger.exception("TrainingMonitor: recording step %d failed; later steps are tried again", self.step)
        finally:
            self._loss = None

    def _selected(self, name: str) -> bool:
        return self._patterns is None or any(p.match(name) for p in self._patterns)

    def _rows(self, optimizer) -> list[_ParamRow]:
        rows = []
        for g, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                rows.append(_ParamRow(self._names.get(id(p)) or f"param_groups[{g}][{i}]", p))
        if self._names:  # model order: the order named_parameters() gives
            order = {name: k for k, name in enumerate(self._names.values())}
            rows.sort(key=lambda r: order.get(r.name, len(order)))
        return rows

    def _record(self, optimizer) -> None:
        rows = self._rows(optimizer)
        grads, weights, loss, scale = self._norms(rows)
        finite = [g for g in grads if g is not None and math.isfinite(g)]
        all_grads = [g for g in grads if g is not None]
        global_norm = math.sqrt(sum(g * g for g in all_grads)) if all_grads and len(finite) == len(all_grads) \
            else (float("nan") if all_grads else None)
        lrs = {f"lr/param_groups[{g}]": float(group["lr"]) for g, group in enumerate(optimizer.param_groups)
               if "lr" in group}
        scalars = {**({"loss": loss} if loss is not None else {}),
                   **({"global_grad_norm": global_norm} if global_norm is not None else {}), **lrs,
                   **({"loss_scale": scale} if scale is not None else {})}
        selected = [k for k, r in enumerate(rows) if self._selected(r.name)]
        record = {"optimizer": optimizer, "step": self.step, "time": time.time(), "scalars": scalars,
                  "rows": [(rows[k].name, grads[k], weights[k]) for k in selected]}
        self._monitored += 1
        self._check(self.step, [(name, g) for name, g, _ in record["rows"] if g is not None])
        if scale is not None:
            self._check_scale(self.step, scale)
        self._pending = record  # written by the post-step hook, with the step time (and the ratios)
        if not self.update_ratio:
            return
        with torch.no_grad(), torch._C.DisableTorchFunction():  # the tools' own work: no tool sees these calls
            record["params"] = [rows[k].param for k in selected]
            record["old"] = [p.detach().clone() for p in record["params"]]

    def _update_ratios(self, record: dict) -> list[float]:
        """||new - old|| / ||old|| of each selected weight over the step just taken: one transfer per device."""
        params, old = record["params"], record.pop("old")
        ratios: list[float] = [0.0] * len(params)
        by_device: dict[tuple, list[int]] = {}
        for k, p in enumerate(params):
            by_device.setdefault((p.device, p.dtype), []).append(k)
        with torch.no_grad(), torch._C.DisableTorchFunction():
            parts: dict[torch.device, list[torch.Tensor]] = {}
            order: dict[torch.device, list[int]] = {}
            for (device, _), indices in by_device.items():
                new = [params[k].detach() for k in indices]
                before = [old[k] for k in indices]
                delta = torch.stack(torch._foreach_norm(torch._foreach_sub(new, before))).float()
                ratio = delta / torch.stack(torch._foreach_norm(before)).float()
                parts.setdefault(device, []).append(ratio)
                order.setdefault(device, []).extend(indices)
            for device, tensors in parts.items():
                for k, value in zip(order[device], torch.cat(tensors).cpu().tolist()):
                    ratios[k] = value
        return ratios

    def _write(self, record: dict, ratios: list[float] | None) -> None:
        """A step's rows in the CSV (and TensorBoard): a row per selected parameter, then the step's scalars."""
        step, now = record["step"], f"{record['time']:.6f}"
        rank = "" if self._common.rank is None else self._common.rank
        write = self._csv.writerow
        for k, (name, grad, weight) in enumerate(record["rows"]):
            ratio = "" if ratios is None else repr(ratios[k])
            write((rank, step, now, name, "" if grad is None else repr(grad), repr(weight), ratio, ""))
        for name, value in record["scalars"].items():
            write((rank, step, now, name, "", "", "", repr(value)))
        if self._writer is not None:
            for name, value in record["scalars"].items():
                self._writer.add_scalar(name, value, step)
            for k, (name, grad, weight) in enumerate(record["rows"]):
                if grad is not None:
                    self._writer.add_scalar(f"grad_norm/{name}", grad, step)
                self._writer.add_scalar(f"weight_norm/{name}", weight, step)
                if ratios is not None:
                    self._writer.add_scalar(f"update_ratio/{name}", ratios[k], step)

    def _norms(self, rows: list[_ParamRow]) -> tuple[list[float | None], list[float], float | None, float | None]:
        """Every row's gradient and weight norm, the loss and the loss scale, on the host: norms computed on the device,
        fused per device and dtype, and read back with the loss and the scale in one transfer per device (one per step
        on one device)."""
        tensors: list[torch.Tensor] = [r.param for r in rows] + [r.param.grad for r in rows if r.param.grad is not None]
        values: list[float] = [0.0] * (len(tensors) + 2)  # then the loss, the scale
        by_device: dict[torch.device, dict[torch.dtype, list[int]]] = {}
        for k, t in enumerate(tensors):
            by_device.setdefault(t.device, {}).setdefault(t.dtype, []).append(k)
        loss = self._loss
        if loss is not None:
            by_device.setdefault(loss.device, {})
        # GradScaler keeps its scale in a device tensor (None until its first scale()); get_scale() would sync
        scale_tensor = getattr(self.scaler, "_scale", None) if self.scaler is not None and self.scaler.is_enabled() \
            else None
        if scale_tensor is not None:
            by_device.setdefault(scale_tensor.device, {})
        with torch.no_grad(), torch._C.DisableTorchFunction():  # the tools' own work: no tool sees these calls
            for device, groups in by_device.items():
                order = [k for indices in groups.values() for k in indices]
                parts = [torch.stack(torch._foreach_norm([tensors[k].detach() for k in indices])).float()
                         for indices in groups.values()]
                if loss is not None and loss.device == device:
                    parts.append(loss.float().reshape(1))
                    order.append(len(tensors))
                if scale_tensor is not None and scale_tensor.device == device:
                    parts.append(scale_tensor.detach().float().reshape(1))
                    order.append(len(tensors) + 1)
                for k, value in zip(order, torch.cat(parts).cpu().tolist()):
                    values[k] = value
        weights = values[:len(rows)]
        grad_values = iter(values[len(rows):len(tensors)])
        grads = [next(grad_values) if r.param.grad is not None else None for r in rows]
        scale = None if self.scaler is None else values[-1] if scale_tensor is not None else self.scaler.get_scale()
        return grads, weights, (values[-2] if loss is not None else None), scale

    # --- anomaly rules ---

    def _check(self, step: int, grads: list[tuple[str, float]]) -> None:
        bad = [(name, g) for name, g in grads if not math.isfinite(g)]
        if bad and not self._nan_seen:
            self._nan_seen = True
            self._anomaly({"rule": "nonfinite_grad", "step": step, "parameter": bad[0][0], "value": bad[0][1],
                           "nearest_output": bad[-1][0], "count": len(bad), "of": len(grads)},
                          f"first non-finite gradient norm at step {step}: {bad[0][0]} = {bad[0][1]} (first in model "
                          f"order; {len(bad)} of {len(grads)} gradients non-finite, the nearest the output "
                          f"{bad[-1][0]})")
        spikes = []
        for name, g in grads:
            if not math.isfinite(g):
                continue
            average, seen = self._ema.get(name, (g, 0))
            if seen >= self.warmup and g > self.spike_factor * average and name not in self._spiked:
                spikes.append((name, g, average))
            self._ema[name] = (EMA_DECAY * average + (1 - EMA_DECAY) * g, seen + 1)
        if spikes:
            self._spiked.update(name for name, _, _ in spikes)
            name, g, average = spikes[0]
            self._anomaly({"rule": "grad_norm_spike", "step": step, "parameter": name, "value": g,
                           "moving_average": average, "factor": self.spike_factor, "count": len(spikes),
                           "parameters": [n for n, _, _ in spikes]},
                          f"gradient norm spike at step {step}: {name} = {g:.6g} > {self.spike_factor:g} x its moving "
                          f"average {average:.6g} ({len(spikes)} parameters spiked)")

    def _check_scale(self, step: int, scale: float) -> None:
        """Count the scale's falls in a row, in backoff factors: a fall between two monitored steps spans the
        iterations GradScaler skipped (it skips optimizer.step() on inf gradients, so no hook sees them)."""
        last, self._last_scale = self._last_scale, scale
        if last is None or scale >= last or scale <= 0:
            self._drops = 0
            return
        backoff = getattr(self.scaler, "_backoff_factor", 0.5)
        self._drops += max(1, round(math.log(scale / last) / math.log(backoff))) if 0 < backoff < 1 else 1
        if self._drops >= self.scale_drops and not self._scale_fired:
            self._scale_fired = True
            self._anomaly({"rule": "loss_scale_dropping", "step": step, "value": scale, "drops": self._drops},
                          f"loss scale dropping at step {step}: {scale:g} after {self._drops} drops in a row "
                          f"(scale_drops={self.scale_drops})")

    def _anomaly(self, record: dict, message: str) -> None:
        record = {"rank": self._common.rank, "time": round(time.time(), 6), **record}
        self.anomalies.append(record)
        if self._anomaly_file is not None:
            self._anomaly_file.write(record)
        logger.warning("TrainingMonitor: %s", message)
