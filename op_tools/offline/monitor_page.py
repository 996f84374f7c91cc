"""TrainingMonitor's results as one self-contained HTML page: a banner that stays at the top of the window with the
verdict and the first anomaly's rank, step, module and phase; the step curves (a statistic constant at every step
is a sentence instead); a layer x step heatmap of gradient norms, red where a layer went non-finite; the activation
and output-gradient norms per module; the anomalies.

>>> path = write_monitor_page("op_tools_results/op_training_monitor")  # doctest: +SKIP
>>> run = read_monitor("op_tools_results/op_training_monitor")  # doctest: +SKIP
>>> sorted({row.statistic for row in run.rows if row.kind == "step"})  # doctest: +SKIP
['global_grad_norm', 'loss', 'lr/param_groups[0]', 'step_time']

The folder is ``<results_dir>/op_training_monitor`` (or the results folder above it), with a ``rank<N>/`` folder per
rank under torchrun; in each, the newest session by file time is read (``monitor_<session>.csv`` and
``anomalies_<session>.jsonl``, docs/tools/training_monitor.md), unless a session is named. The figures travel as
JSON inside the page and a small script draws them as SVG: the file needs nothing else (no network, no external
script or style). Long runs are thinned so the page stays small, never losing a spike or a NaN: the heatmap has
at most ``HEATMAP_COLUMNS`` columns, each a stretch of consecutive steps showing its largest norm (a non-finite one
first; the page says so), and a curve at most ``CURVE_POINTS`` points, each stretch of steps kept by its lowest and
highest value and its first non-finite one.
"""

from __future__ import annotations

import csv
import dataclasses
import glob
import html
import json
import math
import os
import re

from ..output import result_files
from ..output.html_banner import BANNER_CSS, BANNER_SCRIPT, banner

FOLDER = "op_training_monitor"
CSV_COLUMNS = ("rank", "step", "time", "kind", "name", "statistic", "value")
ANOMALY_KEYS = ("rank", "time", "rule", "step", "module", "phase", "value", "message")
HEATMAP_COLUMNS = 200
CURVE_POINTS = 300
LOG_SCALE_DECADES = 1.5  # a chart's positive values spanning this many powers of ten: linear squashes the low end
_STEP_CHARTS = ("loss", "global_grad_norm", "loss_scale", "step_time", "lr")  # their order on the page
# each chart's y-axis title: the statistic, and its unit where it has one (norms, rates and the loss are numbers)
_Y_TITLES = {"loss": "loss", "global_grad_norm": "gradient L2 norm", "loss_scale": "loss scale (factor)",
             "step_time": "time per step (s)", "lr": "learning rate", "grad norm before reduction": "gradient L2 norm",
             "activation": "output L2 norm", "output_grad": "output grad L2 norm"}
NOT_NONFINITE, WENT_NONFINITE, STILL_NONFINITE = 0, 1, 2  # a heatmap cell's state
_RANK_FOLDER = re.compile(r"rank(\d+)$")


@dataclasses.dataclass(frozen=True)
class MonitorRow:
    """One figure of the CSV: ``kind`` "parameter", "activation", "output_grad" or "step"."""

    rank: int | None
    step: int
    time: float
    kind: str
    name: str
    statistic: str
    value: float


@dataclasses.dataclass(frozen=True)
class MonitorAnomaly:
    """One line of the anomalies file; ``extra`` holds the keys a rule adds (``statistic``, ``factor``, ...)."""

    rank: int | None
    time: float
    rule: str
    step: int
    module: str
    phase: str
    value: float | None
    message: str
    extra: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class SessionFiles:
    """The files read for one rank (``rank`` None: a run without torchrun)."""

    rank: int | None
    session: str
    csv_path: str
    anomalies_path: str  # ``.partial`` while the run writes it, or when it died
    cut_line: bool = False  # the CSV ended in a half-written line, left out


@dataclasses.dataclass
class MonitorRun:
    folder: str
    files: list[SessionFiles]
    rows: list[MonitorRow]
    anomalies: list[MonitorAnomaly]

    @property
    def session(self) -> str:
        """The first rank's session: the page is named after it."""
        return self.files[0].session

    @property
    def ranks(self) -> list[int | None]:
        return [f.rank for f in self.files]

    @property
    def steps(self) -> list[int]:
        return sorted({row.step for row in self.rows})


# --- reading ---

def read_monitor(folder: str, session: str | None = None) -> MonitorRun:
    """Every row and anomaly the monitor wrote in ``folder``: per rank its newest session (by file time), or
    ``session`` where that rank has it. A missing or damaged file is a ``ValueError`` naming the file and what is
    wrong with it."""
    files = [_session_files(rank, path, session) for rank, path in _rank_folders(folder, session)]
    rows: list[MonitorRow] = []
    anomalies: list[MonitorAnomaly] = []
    for k, found in enumerate(files):
        cut = _read_csv(found.csv_path, found.rank, rows)
        files[k] = dataclasses.replace(found, cut_line=cut)
        anomalies.extend(_read_anomalies(found.anomalies_path))
    anomalies.sort(key=lambda a: (a.step, a.time, _rank_order(a.rank)))
    return MonitorRun(folder, files, rows, anomalies)


def _rank_folders(folder: str, session: str | None) -> list[tuple[int | None, str]]:
    """(rank, folder) of each rank's files: the ``rank<N>`` folders, else the folder itself (rank None)."""
    if not os.path.isdir(folder):
        raise ValueError(f"{folder}: not a folder (give <results_dir>/{FOLDER})")
    if os.path.isdir(os.path.join(folder, FOLDER)):
        folder = os.path.join(folder, FOLDER)
    ranks = sorted((int(m.group(1)), os.path.join(folder, entry)) for entry in os.listdir(folder)
                   if (m := _RANK_FOLDER.match(entry)) and glob.glob(os.path.join(folder, entry, "monitor_*.csv")))
    if ranks:
        return list(ranks)
    if glob.glob(os.path.join(folder, "monitor_*.csv")):
        return [(None, folder)]
    raise ValueError(f"{folder}: no monitor_<session>.csv here nor in a rank<N>/ folder (is it TrainingMonitor's "
                     f"{FOLDER} folder?)")


def _session_files(rank: int | None, folder: str, session: str | None) -> SessionFiles:
    named = os.path.join(folder, f"monitor_{session}.csv")
    if session is not None and os.path.exists(named):
        path = named
    else:  # under torchrun each rank's session names its own process: the other ranks' newest go with it
        path = max(glob.glob(os.path.join(folder, "monitor_*.csv")), key=lambda p: (os.path.getmtime(p), p))
    stem = os.path.basename(path)[len("monitor_"):-len(".csv")]
    anomalies = os.path.join(folder, f"anomalies_{stem}.jsonl")
    if not os.path.exists(anomalies) and os.path.exists(anomalies + ".partial"):
        anomalies += ".partial"
    return SessionFiles(rank, stem, path, anomalies)


def _last_line_cut(path: str) -> bool:
    """True when the file's last line has no newline, or it has none yet: the run is still writing it (another rank
    just started), or died mid-line."""
    with open(path, "rb") as f:
        if f.seek(0, os.SEEK_END) == 0:
            return True
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


def _read_csv(path: str, folder_rank: int | None, rows: list[MonitorRow]) -> bool:
    """Append the file's rows; True when its last line was cut (the run still writing it, or dead) and left out."""
    try:
        cut = _last_line_cut(path)
        with open(path, newline="", encoding="utf-8") as f:
            lines = list(csv.reader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise ValueError(f"{path}: cannot be read: {type(e).__name__}: {e}") from e
    if not lines or cut and len(lines) == 1:  # created, its header not yet complete: another rank just starting
        return True
    if tuple(lines[0]) != CSV_COLUMNS:
        raise ValueError(f"{path}: not a TrainingMonitor CSV (the first line should be {','.join(CSV_COLUMNS)}, "
                         f"not {','.join(lines[0]) if lines else 'empty'})")
    body = lines[1:-1] if cut and len(lines) > 1 else lines[1:]
    names: dict[str, str] = {}  # one string per name: a long run repeats each name on every step
    for number, line in enumerate(body, start=2):
        if len(line) != len(CSV_COLUMNS):
            raise ValueError(f"{path}: line {number} has {len(line)} fields, not {len(CSV_COLUMNS)}")
        rank, step, time, kind, name, statistic, value = line
        try:
            row = MonitorRow(int(rank) if rank else folder_rank, int(step), float(time), names.setdefault(kind, kind),
                             names.setdefault(name, name), names.setdefault(statistic, statistic),
                             float(value))  # Python's repr of a float: "nan", "inf", "-inf" read back too
        except ValueError as e:
            raise ValueError(f"{path}: line {number}: {e}") from e
        rows.append(row)
    return cut


def _read_anomalies(path: str) -> list[MonitorAnomaly]:
    partial = path.endswith(".partial")
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot be read: {type(e).__name__}: {e}") from e
    if partial and lines[-1]:
        lines.pop()  # a line still being written
    anomalies = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}: line {number} is not JSON: {e}") from e
        missing = [key for key in ANOMALY_KEYS if not isinstance(record, dict) or key not in record]
        if missing:
            raise ValueError(f"{path}: line {number} lacks {', '.join(missing)}")
        extra = {k: v for k, v in record.items() if k not in ANOMALY_KEYS}
        value = record["value"]
        anomalies.append(MonitorAnomaly(record["rank"], float(record["time"]), str(record["rule"]),
                                        int(record["step"]), str(record["module"]), str(record["phase"]),
                                        None if value is None else result_files.json_float(value),
                                        str(record["message"]), extra))
    return anomalies


# --- what the page shows ---

def layer_of(parameter: str) -> str:
    """The heatmap row of a parameter: its name up to the first numbered component (``model.layers.3.mlp.up_proj
    .weight`` -> ``model.layers.3``), else its module (``lm_head.weight`` -> ``lm_head``)."""
    parts = parameter.split(".")
    for k, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[:k + 1])
    return ".".join(parts[:-1]) or parameter


def _norm(values: list[float]) -> float:
    return math.hypot(*values)  # sqrt of the sum of squares, without the squares overflowing


def layer_grad_norms(run: MonitorRun) -> tuple[list[str], list[int], dict[tuple[str, int], float]]:
    """(layers in model order, steps, (layer, step) -> sqrt(sum of its parameters' grad_norm squared)).

    Under torchrun rank 0 writes the parameters' (reduced) gradient norms: the first rank that has any is used."""
    rows = [r for r in run.rows if r.kind == "parameter" and r.statistic == "grad_norm"]
    ranks = [r.rank for r in rows]
    rows = [r for r in rows if r.rank == ranks[0]] if rows else []
    parts: dict[tuple[str, int], list[float]] = {}
    for row in rows:
        parts.setdefault((layer_of(row.name), row.step), []).append(row.value)
    layers = list(dict.fromkeys(layer for layer, _ in parts))
    steps = sorted({step for _, step in parts})
    return layers, steps, {key: _norm(values) for key, values in parts.items()}


def _number(value: float, digits: int | None = None):
    """A JSON number; NaN and infinities as the strings JavaScript's Number() reads."""
    return result_files.json_number(float(f"{value:.{digits}g}") if digits and math.isfinite(value) else value)


def _thin(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """At most ``CURVE_POINTS`` points: per stretch of steps its lowest and highest value and its first non-finite
    one, so that spikes and NaNs survive."""
    if len(points) <= CURVE_POINTS:
        return points
    stretches = CURVE_POINTS // 3
    keep: set[int] = set()
    for s in range(stretches):
        stretch = range(s * len(points) // stretches, (s + 1) * len(points) // stretches)
        finite = [k for k in stretch if math.isfinite(points[k][1])]
        if finite:
            keep.update((min(finite, key=lambda k: points[k][1]), max(finite, key=lambda k: points[k][1])))
        keep.update([k for k in stretch if not math.isfinite(points[k][1])][:1])
    return [points[k] for k in sorted(keep)]


def _series(label: str, points: list[tuple[int, float]]) -> dict:
    points = _thin(sorted(points))
    return {"label": label, "x": [s for s, _ in points], "y": [_number(v, 6) for _, v in points]}


def log_scale(values: list[float]) -> bool:
    """Whether a chart of ``values`` (all its lines') wants a log y axis: none negative, and the positive ones
    spanning ``LOG_SCALE_DECADES`` powers of ten or more (a zero then sits on the axis's floor).

    >>> log_scale([4.0, 0.2]), log_scale([4.0, 0.1]), log_scale([4.0, 0.0, 0.1]), log_scale([4.0, -1.0, 0.1])
    (False, True, True, False)
    """
    finite = [v for v in values if math.isfinite(v)]
    positive = [v for v in finite if v > 0]
    if not positive or min(finite) < 0:
        return False
    return math.log10(max(positive) / min(positive)) >= LOG_SCALE_DECADES - 1e-9  # 10**1.5 itself, rounded either way


def constant_value(points: list[tuple[int, float]]) -> float | None:
    """The value of a line that holds one finite value at every step (a fixed learning rate), else None: such a
    line says everything in one sentence, a chart would only draw it flat.

    >>> constant_value([(0, 1e-3), (1, 1e-3)]), constant_value([(0, 1e-3), (1, 2e-3)]), constant_value([(0, math.nan)])
    (0.001, None, None)
    """
    values = {v for _, v in points}
    return values.pop() if len(values) == 1 and all(math.isfinite(v) for v in values) else None


def _chart(chart_id: str, title: str, y_title: str, lines: list[tuple[str, list[tuple[int, float]]]],
           wide: bool = False) -> dict:
    series = [_series(label, points) for label, points in lines]
    values = [v for _, points in lines for _, v in points]
    return {"id": chart_id, "title": title, "y_title": y_title, "log": log_scale(values), "wide": wide,
            "series": series}


def _constant_lines(title: str, lines: list[tuple[str, list[tuple[int, float]]]]) -> list[str] | None:
    """"lr: 0.001 at every step" for a chart whose every line is constant (one sentence per line), else None."""
    values = [constant_value(points) for _, points in lines]
    if any(v is None for v in values):
        return None
    several = len(lines) > 1  # a line's label tells lines apart, as a chart's legend shows only for several
    return [f"{title}{f' ({label})' if label and several else ''}: {value:.6g} at every step"
            for (label, _), value in zip(lines, values)]


def _rank_label(rank: int | None) -> str:
    return "" if rank is None else f"rank {rank}"


def _rank_order(rank: int | None) -> int:
    return -1 if rank is None else rank


def _line_label(rank: int | None, group: str, several_ranks: bool) -> str:
    """"rank 1", "group 0", "rank 0 group 1", or "" for the only line of a chart."""
    group = re.sub(r"param_groups\[(\d+)\]", r"group \1", group)
    return " ".join(part for part in (_rank_label(rank) if several_ranks else "", group) if part)


def _step_charts(run: MonitorRun) -> tuple[list[dict], list[str]]:
    """A chart per step statistic (the ``lr/*`` of all groups in one), a line per rank (and group); a statistic
    constant on every line is a sentence instead ("lr: 0.001 at every step"). (charts, sentences)"""
    by_chart: dict[str, dict[tuple[int | None, str], list[tuple[int, float]]]] = {}
    for row in run.rows:
        if row.kind == "step":
            chart, group = ("lr", row.statistic[len("lr/"):]) if row.statistic.startswith("lr/") else \
                (row.statistic, "")
            by_chart.setdefault(chart, {}).setdefault((row.rank, group), []).append((row.step, row.value))
    before = [r for r in run.rows if r.kind == "parameter" and r.statistic == "grad_norm_before_reduction"]
    if before:
        per_step: dict[tuple[int | None, str], dict[int, list[float]]] = {}
        for row in before:
            per_step.setdefault((row.rank, ""), {}).setdefault(row.step, []).append(row.value)
        by_chart["grad norm before reduction"] = {key: [(s, _norm(v)) for s, v in steps.items()]
                                                  for key, steps in per_step.items()}
    order = [c for c in _STEP_CHARTS if c in by_chart] + sorted(c for c in by_chart if c not in _STEP_CHARTS)
    charts, constants = [], []
    for chart in order:
        lines = sorted(by_chart[chart].items(), key=lambda line: (_rank_order(line[0][0]), line[0][1]))
        several = len({rank for (rank, _), _ in lines}) > 1
        labelled = [(_line_label(rank, group, several), points) for (rank, group), points in lines]
        title = chart.replace("_", " ")
        sentences = _constant_lines(title, labelled)
        if sentences is not None:
            constants.extend(sentences)
        else:
            charts.append(_chart(re.sub(r"\W+", "-", chart), title, _Y_TITLES.get(chart, title), labelled))
    return charts, constants


def _module_charts(run: MonitorRun, kind: str) -> list[dict]:
    """Per rank, a chart of each module's ``norm`` of ``kind`` ("activation", "output_grad"), a line per module, in
    forward order (backward meets the modules the other way round)."""
    order = {name: k for k, name in enumerate(dict.fromkeys(
        row.name for row in run.rows if row.kind == "activation" and row.statistic == "norm"))}
    per_rank: dict[int | None, dict[str, list[tuple[int, float]]]] = {}
    for row in run.rows:
        if row.kind == kind and row.statistic == "norm":
            per_rank.setdefault(row.rank, {}).setdefault(row.name, []).append((row.step, row.value))
    for rank, modules in per_rank.items():
        per_rank[rank] = dict(sorted(modules.items(), key=lambda item: order.get(item[0], len(order))))
    title = "activation norm" if kind == "activation" else "output gradient norm"
    return [_chart(f"{kind}-{'r' if rank is None else rank}",
                   title + (f" ({_rank_label(rank)})" if len(per_rank) > 1 else ""), _Y_TITLES[kind],
                   list(modules.items()), wide=True)
            for rank, modules in sorted(per_rank.items(), key=lambda item: _rank_order(item[0]))]


def _largest(values: list[float]) -> float | None:
    """A stretch's cell: NaN if any, else inf if any, else the largest; None for no value."""
    if not values:
        return None
    return next((v for v in values if math.isnan(v)), max(values))


def nonfinite_states(row: list[float | None]) -> list[int]:
    """Per step of one layer's gradient norms (None: no gradient), ``WENT_NONFINITE`` where it went NaN or inf (it
    was finite, or had none, the step before), ``STILL_NONFINITE`` where it already was, else ``NOT_NONFINITE``.

    Once a NaN gradient reaches the optimizer the weight holds it, and from the next step on every gradient is NaN:
    coloured alike, every layer turns red after the first NaN and the layer where it began no longer shows.

    >>> nonfinite_states([1.0, math.nan, math.nan, 2.0, None, math.inf])
    [0, 1, 2, 0, 0, 1]
    """
    states, before = [], False
    for value in row:
        now = value is not None and not math.isfinite(value)
        states.append(NOT_NONFINITE if not now else STILL_NONFINITE if before else WENT_NONFINITE)
        before = now
    return states


def _stretch_state(states: list[int]) -> int:
    """A column of several steps: went non-finite if it did at any of them, else still non-finite if it was."""
    return WENT_NONFINITE if WENT_NONFINITE in states else max(states, default=NOT_NONFINITE)


def _heatmap(run: MonitorRun) -> dict:
    """Rows of layers, columns of steps: a step each, or for a long run, ``HEATMAP_COLUMNS`` stretches of steps;
    ``states``: each cell's ``nonfinite_states``."""
    layers, steps, norms = layer_grad_norms(run)
    columns = min(len(steps), HEATMAP_COLUMNS)
    bounds = [(k * len(steps) // columns, (k + 1) * len(steps) // columns) for k in range(columns)]
    stretches = [steps[a:b] for a, b in bounds]
    cells = [[_largest([norms[layer, step] for step in stretch if (layer, step) in norms]) for stretch in stretches]
             for layer in layers]
    per_step = [nonfinite_states([norms.get((layer, step)) for step in steps]) for layer in layers]
    return {"layers": layers, "steps": [stretch[0] for stretch in stretches],
            "last": [stretch[-1] for stretch in stretches], "of": len(steps),
            "values": [[None if v is None else _number(v) for v in row] for row in cells],
            "states": [[_stretch_state(row[a:b]) for a, b in bounds] for row in per_step]}


def _anomaly_marks(run: MonitorRun) -> list[dict]:
    """A mark per step with an anomaly, its title every message of that step."""
    by_step: dict[int, list[str]] = {}
    for a in run.anomalies:
        by_step.setdefault(a.step, []).append(f"{_rank_label(a.rank) + ': ' if a.rank is not None else ''}{a.message}")
    return [{"step": step, "text": "\n".join(messages)} for step, messages in sorted(by_step.items())]


def _value_text(value: float | None) -> str:
    return "" if value is None else f"{value:.6g}"


def _header(run: MonitorRun) -> str:
    steps = run.steps
    ranks = [r for r in run.ranks if r is not None]
    facts = [("folder", run.folder),
             ("ranks", ", ".join(map(str, ranks)) if ranks else "1 (not distributed)"),
             ("steps", f"{len(steps)} monitored, {steps[0]} to {steps[-1]}" if steps else "none"),
             ("session", run.session if len({f.session for f in run.files}) == 1 else
              "; ".join(f"{_rank_label(f.rank)}: {f.session}" for f in run.files))]
    times = [row.time for row in run.rows]
    if times:
        facts.append(("wall time", f"{max(times) - min(times):.1f} s between the first and the last row"))
    return "".join(f"<tr><th>{name}</th><td>{html.escape(text)}</td></tr>" for name, text in facts)


def _anomaly_rows(run: MonitorRun) -> str:
    return "".join(
        f'<tr class="anomaly" data-step="{a.step}">' + "".join(
            f"<td>{html.escape(text)}</td>" for text in (
                "" if a.rank is None else str(a.rank), str(a.step), a.rule, a.module, a.phase, _value_text(a.value),
                a.message)) + "</tr>" for a in run.anomalies)


def _notes(run: MonitorRun) -> str:
    notes = [f"{f.anomalies_path}: still being written (or the run died): its complete lines are read"
             for f in run.files if f.anomalies_path.endswith(".partial")]
    notes += [f"{f.csv_path}: its last line was cut or not written yet (still being written, or the run died): "
              "its complete lines are read" for f in run.files if f.cut_line]
    return "".join(f"<li>{html.escape(note)}</li>" for note in notes)


def first_anomaly_facts(run: MonitorRun) -> list[tuple[str, str]]:
    """(name, value) of what is known of the first anomaly: its rank (under torchrun), step, module, phase and rule;
    [] for a run without one. The monitor watches modules and parameters, not calls: it names no op."""
    if not run.anomalies:
        return []
    first = run.anomalies[0]
    facts = [("rank", str(first.rank))] if first.rank is not None else []
    facts += [("step", str(first.step)), ("module", first.module), ("phase", first.phase), ("rule", first.rule)]
    return [(name, value) for name, value in facts if value]


def _banner(run: MonitorRun, title: str) -> str:
    count = len(run.anomalies)
    steps = len(run.steps)
    monitored = f"{steps} monitored step{'s' if steps != 1 else ''}"
    if not count:
        ranks = [r for r in run.ranks if r is not None]
        where = f" on ranks {', '.join(map(str, ranks))}" if ranks else ""
        return banner(title, f"No anomaly in {monitored}{where}", "clean", "", {}, [])
    headline = f"{count} anomal{'y' if count == 1 else 'ies'} in {monitored}"
    return banner(title, headline, "found", "the first", dict(first_anomaly_facts(run)), [run.anomalies[0].message])


def render_page(run: MonitorRun) -> str:
    """The page, as text."""
    charts, constants = _step_charts(run)
    payload = {"steps": run.steps, "charts": charts, "heatmap": _heatmap(run),
               "modules": _module_charts(run, "activation") + _module_charts(run, "output_grad"),
               "anomalies": _anomaly_marks(run)}
    data = json.dumps(payload, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
    count = len(run.anomalies)
    files = "".join(f"<li>{html.escape(path)}</li>" for f in run.files for path in (f.csv_path, f.anomalies_path))
    title = f"Training monitor: {run.session}"
    constants_list = "".join(f"<li>{html.escape(line)}</li>" for line in constants)
    parts = {"TITLE": html.escape(title), "BANNER_CSS": BANNER_CSS, "BANNER_SCRIPT": BANNER_SCRIPT,
             "BANNER": _banner(run, title), "FACTS": _header(run), "FILES": files, "NOTES": _notes(run),
             "CONSTANTS": f'<ul id="constants">{constants_list}</ul>' if constants else "",
             "ANOMALY_ROWS": _anomaly_rows(run) or '<tr><td colspan="7" class="empty">none</td></tr>',
             "COUNT": str(count), "DATA": data}
    return re.sub(r"__([A-Z_]+)__", lambda m: parts[m.group(1)], _TEMPLATE)  # one pass: no part is read twice


def write_monitor_page(folder: str, out_path: str | None = None, session: str | None = None) -> str:
    """Write the page of the monitor's results in ``folder`` and return its path; by default
    ``monitor_<session>.html`` beside the first rank's CSV (rank 0's under torchrun)."""
    run = read_monitor(folder, session)
    path = out_path or os.path.join(os.path.dirname(run.files[0].csv_path), f"monitor_{run.session}.html")
    result_files.write_text(path, render_page(run))
    return path


_TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
html { scroll-padding-top: var(--banner-height, 5em); }  /* an anchor jumped to lands below the banner */
body { font: 13px/1.4 system-ui, sans-serif; margin: 0 1.5em 1.5em; color: #222; max-width: 1180px; }
__BANNER_CSS__
h2 { font-size: 15px; margin: 1.6em 0 0.5em; }
#facts th { text-align: left; color: #666; font-weight: normal; padding: 1px 12px 1px 0; border: 0; }
#facts td { border: 0; padding: 1px 0; font-family: ui-monospace, monospace; font-size: 12px; }
details { color: #555; margin: 0.3em 0; } details li, #notes li { font-family: ui-monospace, monospace;
  font-size: 12px; } #notes { color: #a15c00; }
#constants { margin: 0.2em 0 0.8em; padding-left: 1.2em; } #constants li { font-family: ui-monospace, monospace;
  font-size: 12px; }
.hint { color: #666; margin: 0.2em 0 0.6em; }
.charts { display: flex; flex-wrap: wrap; gap: 12px; }
figure.chart { margin: 0; border: 1px solid #e3e3e3; border-radius: 4px; padding: 6px 8px 4px; background: #fff; }
figcaption { font-weight: 600; } figcaption .scale { font-weight: normal; color: #888; margin-left: 0.4em; }
svg text { font: 10px system-ui, sans-serif; fill: #666; } svg text.axis-title { font-size: 11px; fill: #444; }
#heatmap svg { display: block; }
.grid { stroke: #eee; } .axis { stroke: #bbb; }
.line { fill: none; stroke-width: 1.5; stroke-linejoin: round; }
.nonfinite-point { stroke: #fff; stroke-width: 0.8; }
.anomaly-line { stroke: #d62728; stroke-opacity: 0.45; stroke-dasharray: 3 2; }
.anomaly-mark { fill: #d62728; }
.legend { display: flex; flex-wrap: wrap; gap: 2px 12px; max-width: 100%; font-size: 11px; color: #444; }
.legend span::before { content: ""; display: inline-block; width: 10px; height: 3px; margin-right: 4px;
  vertical-align: middle; background: var(--c); }
#heatmap-note { color: #666; margin: 0.2em 0 0.6em; }
table.anomalies { border-collapse: collapse; } .anomalies th, .anomalies td { border: 1px solid #ddd;
  padding: 2px 6px; text-align: left; vertical-align: top; } .anomalies th { background: #f3f3f3; }
.anomalies td:nth-child(6) { font-family: ui-monospace, monospace; white-space: nowrap; }
.empty { color: #888; font-style: italic; }
</style></head>
<body>
__BANNER__
<table id="facts">__FACTS__</table>
<ul id="notes">__NOTES__</ul>
<details><summary>files read</summary><ul>__FILES__</ul></details>
<h2>Per step</h2>
<p class="hint">Above a chart a dot marks a NaN and a triangle an infinity (below it, -inf), in its line's colour; a
dashed red line marks a step with an anomaly (hover it for the messages).</p>
__CONSTANTS__
<div class="charts" id="step-charts"></div>
<h2>Gradient norm per layer and step</h2><p id="heatmap-note"></p><div id="heatmap"></div>
<div id="module-section"><h2>Activation and output gradient norms per module</h2>
<div class="charts" id="module-charts"></div></div>
<h2 id="anomalies-title">Anomalies (__COUNT__)</h2>
<table class="anomalies" id="anomalies"><thead><tr><th>rank</th><th>step</th><th>rule</th><th>module</th>
<th>phase</th><th>value</th><th>message</th></tr></thead><tbody>__ANOMALY_ROWS__</tbody></table>
<script type="application/json" id="data">__DATA__</script>
<script>
"use strict";
__BANNER_SCRIPT__
const data = JSON.parse(document.getElementById("data").textContent);
const NS = "http://www.w3.org/2000/svg";
const PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#9c755f", "#ff9da7", "#bab0ac"];
const VIRIDIS = ["#440154", "#472d7b", "#3b528b", "#2c728e", "#21918c", "#28ae80", "#5ec962", "#addc30", "#fde725"];
const NONFINITE = "#d62728", STILL_NONFINITE = "#f1b9b9", MISSING = "#f0f0f0";
const WENT = 1, STILL = 2;  // a heatmap cell's state (monitor_page.py's nonfinite_states)

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined) e.textContent = text;
  if (cls) e.className = cls;
  return e;
}
function svg(tag, attrs, parent, title) {
  const e = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (title !== undefined) svg("title", {}, e).textContent = title;
  if (parent) parent.append(e);
  return e;
}
const num = v => typeof v === "string" ? Number(v) : v;  // "NaN", "Infinity": JSON has no such numbers
function fmt(v) {
  if (!Number.isFinite(v)) return String(v);
  const a = Math.abs(v);
  return a !== 0 && (a >= 1e5 || a < 1e-4) ? v.toExponential(1).replace(".0e", "e").replace("e+", "e")
      : String(Number(v.toPrecision(3)));
}
function viridis(t) {
  const x = Math.min(1, Math.max(0, t)) * (VIRIDIS.length - 1), k = Math.min(VIRIDIS.length - 2, Math.floor(x));
  const [a, b] = [VIRIDIS[k], VIRIDIS[k + 1]].map(c => [1, 3, 5].map(i => parseInt(c.slice(i, i + 2), 16)));
  return "rgb(" + a.map((v, i) => Math.round(v + (b[i] - v) * (x - k))).join(",") + ")";
}
function colors(n) {
  return n <= PALETTE.length ? PALETTE.slice(0, n) : Array.from({length: n}, (_, k) => viridis(k / (n - 1) * 0.9));
}
function tickStep(lo, hi, count) {  // 1, 2 or 5 times a power of ten
  const raw = (hi - lo) / count, mag = Math.pow(10, Math.floor(Math.log10(raw)));
  return [1, 2, 5, 10].map(f => f * mag).find(s => s >= raw);
}
function ticksWithin(lo, hi, step) {
  const ticks = [];
  for (let t = Math.ceil(lo / step - 1e-9) * step; t <= hi + step * 1e-9; t += step) {
    ticks.push(Number(t.toPrecision(12)));
  }
  return ticks;
}
// y scale over the finite values; log when the page chose it (monitor_page.py's log_scale), zeros on its floor
function yScale(values, bottom, top, log) {
  const finite = values.filter(Number.isFinite), positive = finite.filter(v => v > 0);
  if (!finite.length) return {at: () => bottom, ticks: [], log: false};
  if (log && positive.length) {
    const a = Math.floor(Math.log10(Math.min(...positive))), b = Math.ceil(Math.log10(Math.max(...positive)));
    const every = Math.ceil((b - a) / 5), ticks = [];
    for (let e = a; e <= b; e += every) {
      // a span of two decades or less: 2 and 5 times each power of ten as well, else too few ticks to read
      for (const f of b - a <= 2 && e < b ? [1, 2, 5] : [1]) ticks.push(Number((f * Math.pow(10, e)).toPrecision(12)));
    }
    const at = v => v > 0 ? bottom - (Math.log10(v) - a) / (b - a) * (bottom - top) : bottom;
    return {log, ticks, at};
  }
  let lo = Math.min(...finite), hi = Math.max(...finite);
  if (lo === hi) { const pad = Math.abs(lo) * 0.1 || 1; lo -= pad; hi += pad; }
  const step = tickStep(lo, hi, 4);  // the axis from a tick to a tick
  lo = Math.floor(lo / step + 1e-9) * step;
  hi = Math.ceil(hi / step - 1e-9) * step;
  return {log: false, ticks: ticksWithin(lo, hi, step), at: v => bottom - (v - lo) / (hi - lo) * (bottom - top)};
}
const firstStep = data.steps[0], lastStep = data.steps[data.steps.length - 1];

// a NaN or infinity of a line: a dot (NaN) or a triangle (inf) in the line's colour, above the plot (-inf below)
function nonfiniteMark(s, x, v, top, bottom, color, title) {
  const y = v === -Infinity ? bottom + 5 : top - 5;
  const attrs = {class: "nonfinite-point", fill: color, "data-value": String(v)};
  if (Number.isNaN(v)) return svg("circle", {cx: x, cy: y, r: 3.2, ...attrs}, s, title);
  const d = v > 0 ? `M${x - 3.6},${y + 3} L${x + 3.6},${y + 3} L${x},${y - 3.4} Z`
      : `M${x - 3.6},${y - 3} L${x + 3.6},${y - 3} L${x},${y + 3.4} Z`;
  return svg("path", {d, ...attrs}, s, title);
}

function lineChart(parent, chart) {
  const W = chart.wide ? 560 : 360, H = 186, m = {l: 60, r: 10, t: 14, b: 36};
  const fig = el("figure", undefined, "chart");
  fig.id = "chart-" + chart.id;
  const caption = el("figcaption", chart.title);
  fig.append(caption);
  const s = svg("svg", {width: W, height: H, viewBox: `0 0 ${W} ${H}`}, fig);
  const X = step => m.l + (lastStep === firstStep ? 0.5 : (step - firstStep) / (lastStep - firstStep))
      * (W - m.l - m.r);
  const y = yScale(chart.series.flatMap(sr => sr.y.map(num)), H - m.b, m.t, chart.log);
  if (y.log) caption.append(el("span", "log scale", "scale"));
  for (const t of y.ticks) {
    const at = y.at(t);
    svg("line", {x1: m.l, x2: W - m.r, y1: at, y2: at, class: "grid"}, s);
    svg("text", {x: m.l - 4, y: at + 3, "text-anchor": "end"}, s).textContent = fmt(t);
  }
  svg("line", {x1: m.l, x2: W - m.r, y1: H - m.b, y2: H - m.b, class: "axis"}, s);
  const span = Math.max(lastStep, firstStep + 1);
  for (const t of ticksWithin(firstStep, lastStep, Math.max(1, tickStep(firstStep, span, 5)))) {
    svg("text", {x: X(t), y: H - m.b + 13, "text-anchor": "middle"}, s).textContent = String(t);
  }
  svg("text", {x: m.l + (W - m.l - m.r) / 2, y: H - 4, "text-anchor": "middle", class: "axis-title x"}, s)
      .textContent = "step";
  const middle = m.t + (H - m.t - m.b) / 2;
  svg("text", {x: 11, y: middle, "text-anchor": "middle", transform: `rotate(-90 11 ${middle})`,
               class: "axis-title y"}, s).textContent = chart.y_title + (y.log ? " (log scale)" : "");
  for (const a of data.anomalies) {
    svg("line", {x1: X(a.step), x2: X(a.step), y1: m.t - 4, y2: H - m.b, class: "anomaly-line"}, s, a.text);
  }
  const palette = colors(chart.series.length), n = chart.series.length;
  chart.series.forEach((sr, k) => {
    let segment = [];
    const draw = () => {
      if (segment.length > 1) svg("polyline", {points: segment.join(" "), class: "line", stroke: palette[k]}, s,
                                  sr.label);
      else if (segment.length === 1) {
        const [cx, cy] = segment[0].split(",");
        svg("circle", {cx, cy, r: 1.8, fill: palette[k]}, s, sr.label);
      }
      segment = [];
    };
    const shift = n > 1 ? (k - (n - 1) / 2) * Math.min(4, 12 / n) : 0;  // lines' marks at one step side by side
    sr.x.forEach((step, i) => {
      const v = num(sr.y[i]);
      if (Number.isFinite(v)) { segment.push(X(step).toFixed(1) + "," + y.at(v).toFixed(1)); return; }
      draw();
      nonfiniteMark(s, X(step) + shift, v, m.t, H - m.b, palette[k],
                    (sr.label ? sr.label + ", " : "") + "step " + step + ": " + v).dataset.series = sr.label;
    });
    draw();
  });
  if (chart.series.length > 1) {
    const legend = el("div", undefined, "legend");
    chart.series.forEach((sr, k) => {
      const item = el("span", sr.label);
      item.style.setProperty("--c", palette[k]);
      legend.append(item);
    });
    legend.style.width = W + "px";
    fig.append(legend);
  }
  parent.append(fig);
}

function heatmap(parent, hm) {
  const note = document.getElementById("heatmap-note");
  if (!hm.layers.length) {
    note.textContent = "No parameter gradient norms in these files.";
    note.className = "empty";
    return;
  }
  note.textContent = "A row per layer: the square root of the sum of its parameters' squared gradient norms; "
      + "colour on a log scale; red where a layer's gradient went NaN or inf, pale red where it has stayed so "
      + "since an earlier step; hover a cell for its value."
      + (hm.steps.length < hm.of ? ` The ${hm.of} monitored steps are shown in ${hm.steps.length} columns: each column `
         + "a stretch of consecutive steps, with its largest norm (NaN or inf where there is one)." : "");
  const values = hm.values.map(row => row.map(v => v === null ? null : num(v)));
  const positive = values.flat().filter(v => v !== null && Number.isFinite(v) && v > 0);
  const lo = positive.length ? Math.log10(Math.min(...positive)) : 0;
  const hi = positive.length ? Math.log10(Math.max(...positive)) : 1;
  const color = v => viridis(hi > lo ? (Math.log10(v) - lo) / (hi - lo) : 0.5);
  const cw = Math.max(2, Math.min(36, Math.floor(880 / hm.steps.length))), ch = 18, gap = cw > 5 ? 1 : 0;
  const left = 12 + 6.2 * Math.max(...hm.layers.map(l => l.length)), top = 12;
  const W = left + cw * hm.steps.length + 8, H = top + ch * hm.layers.length + 34;
  const s = svg("svg", {width: W, height: H, viewBox: `0 0 ${W} ${H}`, id: "heatmap-grid"}, parent);
  const column = step => Math.max(0, hm.steps.findLastIndex(first => first <= step));  // the stretch holding it
  for (const a of data.anomalies) {
    const x = left + column(a.step) * cw + (cw - gap) / 2;
    svg("path", {d: `M${x - 4},${top - 9} L${x + 4},${top - 9} L${x},${top - 2} Z`, class: "anomaly-mark"}, s, a.text);
  }
  const since = (r, c) => {  // the first step of the stretch where a still non-finite cell went so
    let k = c;
    while (k > 0 && hm.states[r][k] !== WENT) k--;
    return hm.steps[k];
  };
  hm.layers.forEach((layer, r) => {
    svg("text", {x: left - 6, y: top + r * ch + ch / 2 + 3.5, "text-anchor": "end"}, s).textContent = layer;
    hm.steps.forEach((step, c) => {
      const v = values[r][c], state = hm.states[r][c];
      const kind = v === null ? " missing" : state === WENT ? " nonfinite" : state === STILL ? " still-nonfinite" : "";
      const fill = v === null ? MISSING : state === WENT ? NONFINITE : state === STILL ? STILL_NONFINITE
          : v > 0 ? color(v) : VIRIDIS[0];
      svg("rect", {x: left + c * cw, y: top + r * ch, width: cw - gap, height: ch - gap, class: "cell" + kind,
                   "data-layer": layer, "data-step": step, fill},
          s, `${layer}, ` + (hm.last[c] > step ? `steps ${step} to ${hm.last[c]} (the largest)` : `step ${step}`)
             + ": " + (v === null ? "no gradient" : String(v))
             + (state === STILL ? ` (non-finite since step ${since(r, c)})` : ""));
    });
  });
  const every = Math.max(1, Math.ceil(40 / cw));
  hm.steps.forEach((step, c) => {
    if (c % every === 0) svg("text", {x: left + c * cw + (cw - gap) / 2, y: H - 20, "text-anchor": "middle"}, s)
        .textContent = String(step);
  });
  svg("text", {x: left + cw * hm.steps.length / 2, y: H - 5, "text-anchor": "middle", class: "axis-title x"}, s)
      .textContent = "step";
  // the legend: the colour bar over the decades shown, then the non-finite and no-data swatches
  const L = svg("svg", {width: 760, height: 34, id: "heatmap-legend"}, parent);
  const gradient = svg("linearGradient", {id: "viridis"}, svg("defs", {}, L));
  VIRIDIS.forEach((c, k) => svg("stop", {offset: k / (VIRIDIS.length - 1), "stop-color": c}, gradient));
  svg("rect", {x: left, y: 4, width: 220, height: 10, fill: "url(#viridis)"}, L);
  let decades = [];  // the powers of ten within the range; its two ends where fewer than two
  for (let e = Math.ceil(lo); e <= Math.floor(hi); e++) decades.push(e);
  if (decades.length > 6) decades = decades.filter((_, k) => k % Math.ceil(decades.length / 6) === 0);
  if (decades.length < 2) decades = hi > lo ? [lo, hi] : [lo];
  for (const e of decades) {
    svg("text", {x: left + 220 * (hi > lo ? (e - lo) / (hi - lo) : 0.5), y: 27, "text-anchor": "middle"}, L)
        .textContent = fmt(Math.pow(10, e));
  }
  let x = left + 240;
  for (const [fill, text] of [[NONFINITE, "went NaN / inf"], [STILL_NONFINITE, "NaN / inf since an earlier step"],
                              [MISSING, "no gradient"]]) {
    svg("rect", {x, y: 4, width: 14, height: 10, fill, stroke: fill === MISSING ? "#ccc" : "none"}, L);
    svg("text", {x: x + 18, y: 13}, L).textContent = text;
    x += 30 + 5.6 * text.length;
  }
}

const stepCharts = document.getElementById("step-charts");
for (const chart of data.charts) lineChart(stepCharts, chart);
if (!data.charts.length) stepCharts.append(el("p", "No step figures in these files"
    + (document.querySelector("#constants li") ? " that change from step to step." : "."), "empty"));
heatmap(document.getElementById("heatmap"), data.heatmap);
const moduleCharts = document.getElementById("module-charts");
for (const chart of data.modules) lineChart(moduleCharts, chart);
if (!data.modules.length) document.getElementById("module-section").remove();
</script>
</body></html>
"""
