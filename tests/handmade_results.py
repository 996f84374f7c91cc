"""Results folders written by hand, for the tests of the pages that read them: TrainingMonitor's files
(docs/tools/training_monitor.md), OpOverflowCheck's, and one two-rank run whose NaN spreads as a real one does.
Nothing here imports op_tools, so the same run can be drawn by an older checkout's pages (the "before" screenshots
of docs/images/)."""

from __future__ import annotations

import csv
import json
import math
import os

COLUMNS = ("rank", "step", "time", "kind", "name", "statistic", "value")
T0 = 1_700_000_000.0
NAN = math.nan


def write_session(folder, session: str, rows: list[tuple], anomalies: list[dict]) -> str:
    """``monitor_<session>.csv`` (``rows``: tuples in ``COLUMNS`` order) and ``anomalies_<session>.jsonl`` as the
    monitor writes them; the CSV's path."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"monitor_{session}.csv")
    with open(path, "w", newline="", encoding="utf-8") as f:
        out = csv.writer(f)
        out.writerow(COLUMNS)
        for rank, step, time, kind, name, statistic, value in rows:
            out.writerow(("" if rank is None else rank, step, f"{time:.6f}", kind, name, statistic, repr(value)))
    with open(os.path.join(folder, f"anomalies_{session}.jsonl"), "w", encoding="utf-8") as f:
        f.writelines(json.dumps(record) + "\n" for record in anomalies)  # Python's json: NaN as NaN
    return path


# --- a DDP run on two ranks: rank 1's gradient of one weight turns NaN at step NAN_STEP ---

LAYERS = ("model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2", "model.norm", "lm_head")
PARAMETERS = ("model.embed_tokens.weight",
              *(f"model.layers.{k}.{p}.weight" for k in range(3) for p in ("self_attn.q_proj", "mlp.down_proj")),
              "model.norm.weight", "lm_head.weight")
NAN_PARAMETER = "model.layers.1.mlp.down_proj.weight"
NAN_STEP, STEPS, LR = 8, 12, 1e-3
SESSIONS = {0: "pid100_2025-01-01-00-00-00_1", 1: "pid101_2025-01-01-00-00-00_1"}


def _grad(name: str, step: int) -> float:
    """Finite gradient norms, decades apart by depth and falling over the steps."""
    depth = int(name.split(".")[2]) + 1 if ".layers." in name else (0 if "embed" in name else 4)
    return 10.0 ** -depth * (2.0 if "down_proj" in name else 1.0) * (1 + 0.5 * math.exp(-0.3 * step))


def _loss(rank: int, step: int) -> float:
    """From 4 down to about 0.05 at NAN_STEP: just under two decades."""
    return 4.0 * math.exp(-0.55 * step) + 0.002 * rank


def nan_spreading_run(results_dir) -> dict[int, str]:
    """Write ``results_dir/op_training_monitor/rank<N>/`` as TrainingMonitor does on each rank of a DDP run; the
    CSV path per rank.

    At step ``NAN_STEP`` rank 1's gradient of ``NAN_PARAMETER`` is NaN before DDP's all-reduce, and after it on both
    ranks (only that weight's). The optimizer writes it into that weight, so from the next step on the output of
    ``model.layers.1`` and every later one, the loss and every gradient are NaN: the layers below it were finite
    until then. The learning rate stays 1e-3."""
    paths = {}
    for rank in (0, 1):
        rows: list[tuple] = []
        for step in range(STEPS):
            at = T0 + 1.5 * step + 0.01 * rank
            broken = step > NAN_STEP  # the NaN weight is in use
            if rank == 0:  # the reduced gradients and the global figures: rank 0's alone
                grads = {p: NAN if broken or (step == NAN_STEP and p == NAN_PARAMETER) else _grad(p, step)
                         for p in PARAMETERS}
                rows += [(rank, step, at, "parameter", p, "grad_norm", g) for p, g in grads.items()]
            rows += [(rank, step, at, "parameter", p, "grad_norm_before_reduction",
                      NAN if broken or (rank == 1 and step == NAN_STEP and p == NAN_PARAMETER)
                      else _grad(p, step) * (1.1 if rank else 0.9)) for p in PARAMETERS]
            rows += [(rank, step, at, "activation", f"model.layers.{k}", "norm",
                      NAN if broken and k >= 1 else 8.0 + 2 * k + 0.05 * step + 0.1 * rank) for k in range(3)]
            rows += [(rank, step, at, "output_grad", f"model.layers.{k}", "norm",
                      NAN if broken else 2e-3 * (k + 1) * (1 + 0.1 * rank)) for k in reversed(range(3))]
            rows.append((rank, step, at, "step", "", "loss", NAN if broken else _loss(rank, step)))
            if rank == 0:
                norm = math.hypot(*grads.values())
                rows += [(rank, step, at, "step", "", "global_grad_norm", norm),
                         (rank, step, at, "step", "", "lr/param_groups[0]", LR)]
            rows.append((rank, step, at, "step", "", "step_time", 0.9 if step == 0 else 0.21 + 0.004 * (step % 3)))
        what = "grad_norm" if rank == 0 else "grad_norm_before_reduction"
        label = f"the gradient of {NAN_PARAMETER}" + (" before the reduction" if rank else "")
        anomaly = {"rank": rank, "time": T0 + 1.5 * NAN_STEP + 0.4 + 0.05 * (1 - rank), "rule": "nonfinite",
                   "step": NAN_STEP, "module": NAN_PARAMETER, "phase": "backward", "value": NAN,
                   "message": f"first non-finite value at step {NAN_STEP} in backward: {label} ({what} = nan); 1 "
                              "parameter gradients non-finite", "statistic": f"parameter:{what}",
                   "nonfinite_gradients": 1}
        folder = os.path.join(str(results_dir), "op_training_monitor", f"rank{rank}")
        paths[rank] = write_session(folder, SESSIONS[rank], rows, [anomaly])
    return paths


def write_overflow(results_dir, rank: int, session: str, record: dict) -> str:
    """``op_overflow_check_result/rank<N>/overflow_<session>.json``, as OpOverflowCheck writes its first overflow."""
    folder = os.path.join(str(results_dir), "op_overflow_check_result", f"rank{rank}")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"overflow_{session}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"format": "op_tools overflow", "version": 1, "rank": rank, "forward_id": 0, "received": False,
                   **record}, f)
    return path


DOWN_PROJ = "model.layers.1.mlp.down_proj"
# where the calls were made, as OpOverflowCheck keeps them: a backward op's is its forward's
BORN_AT = "/home/user/model.py:88 forward: return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))"
RECEIVED_AT = "/home/user/train.py:57 train_step: loss.backward()"


def nan_spreading_report_run(results_dir) -> None:
    """``nan_spreading_run`` with OpOverflowCheck beside it: on rank 1 the backward of ``DOWN_PROJ``'s linear made
    the first inf/nan from finite inputs, at ``BORN_AT``; rank 0 received it through DDP's gradient all-reduce."""
    nan_spreading_run(results_dir)
    born = T0 + 1.5 * NAN_STEP + 0.2
    write_overflow(results_dir, 1, SESSIONS[1], {
        "step": NAN_STEP, "time": born, "op": "torch.nn.functional.linear", "module": DOWN_PROJ,
        "phase": "backward", "forward_id": 412, "location": BORN_AT})
    write_overflow(results_dir, 0, SESSIONS[0], {
        "step": NAN_STEP, "time": born + 0.1, "op": "torch.distributed.all_reduce",
        "module": "DistributedDataParallel (gradient bucket 0)", "phase": "backward", "forward_id": 430,
        "received": True, "location": RECEIVED_AT})
