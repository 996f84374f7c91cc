"""What every tool wrote on every rank, read from one results folder (``OP_TOOLS_RESULTS_DIR``).

Read, per rank (the ``rank<N>`` subfolder of each tool's folder; a run without torchrun is rank 0):

- OpOverflowCheck's first overflow (``op_overflow_check_result/overflow_*.json``); its folder alone says the tool
  ran there and found none;
- OpSelfCheck's findings (``op_self_check_result/findings_*.json``): calls whose invariant failed on the device, each
  a ``mismatch``; likewise its folder alone says it ran;
- OpAutoCompare's comparisons (``op_autocompare_result/op_autocompare_info_*.csv``): the failing rows, and the
  collectives it checked;
- OpTimeMeasure's calls (``op_time_measure_result/op_elasped_info_*.csv``, the original's spelling): times per
  step, and the collectives it timed;
- the replica fingerprints (``op_replica_fingerprints/fingerprints_*.jsonl``), one file per rank and tool session,
  matched into the sessions of each run (``_match_sessions``: runs written into one folder are compared one by one);
  a ``.partial`` one (empty where the process died before writing a line) is a rank whose run ended early, read as
  far as it goes;
- TrainingMonitor's anomalies (``op_training_monitor/anomalies_*.jsonl``, ``.partial`` from a run that died): each
  an anomaly whose ``kind`` is the monitor's rule and whose ``op`` is empty (the monitor watches modules and
  parameters, not calls);
- what OpOverflowCheck, OpSelfCheck and OpAutoCompare did not check (``unchecked_*.json``), and their sessions that
  never stopped (``running_*.json``, left by a process killed before the tool wrote its verdict).

A file that cannot be read is listed in ``Results.unreadable`` with why. What op_tools wrote that holds no verdict
read here (run recordings, the calls OpCapture saved, replay summaries, conformance sweeps) is a note naming what
judges it; a folder with nothing else, or with nothing op_tools wrote, is a ``ResultsError`` saying what it holds
(and, given the parent of the results folder, what its subfolders hold).
"""

from __future__ import annotations

import csv
import dataclasses
import glob
import io
import json
import os
import re

from ...ops.op_facts import op_facts
from ...output import result_files

OVERFLOW_FOLDER = "op_overflow_check_result"
SELF_CHECK_FOLDER = "op_self_check_result"
AUTOCOMPARE_FOLDER = "op_autocompare_result"
TIME_FOLDER = "op_time_measure_result"
FINGERPRINT_FOLDER = "op_replica_fingerprints"
CAPTURE_FOLDER = "op_capture_results"  # OpCapture's: its run recordings hold no verdict (compare_runs judges them)
MONITOR_FOLDER = "op_training_monitor"  # op_tools/tools/training_monitor.py's FOLDER (offline never imports tools)
REPLAY_FOLDER = "op_replay_result"  # offline/run_op_from_data.py's: each summary holds its replay's verdicts
CONFORMANCE_FOLDER = "op_conformance_result"  # offline/conformance/cli.py's: each sweep's folder holds its verdicts
MONITOR = "TrainingMonitor"
TIME_MEASURE = "OpTimeMeasure"
MONITOR_PHASES = ("forward", "backward", "optimizer")  # a step's phases, in the order every rank runs them
_RANK_FOLDER = re.compile(r"rank(\d+)$")
_SESSION_STEM = re.compile(r"_pid\d+_(\d{4}(?:-\d\d){5})_(\d+)\.")  # result_files.session_stem's


class ResultsError(ValueError):
    """The folder holds nothing the report can read."""


@dataclasses.dataclass(frozen=True)
class Event:
    """A call a tool wrote about: an anomaly (``kind`` "inf/nan", "mismatch" or a TrainingMonitor rule such as
    "nonfinite") or a collective it saw."""

    rank: int
    step: int
    time: float
    op: str
    module: str
    phase: str
    tool: str
    kind: str = ""  # "inf/nan", "mismatch"; "" for a collective seen
    detail: str = ""
    forward_id: int = 0
    received: bool = False  # OpOverflowCheck: this rank sent finite values and received inf/nan
    came_in: bool = False  # OpOverflowCheck: no call checked on this rank made it; this call read it first
    value: float | None = None  # TrainingMonitor: the figure its rule judged (nan, inf possible)
    location: str = ""  # ``file:line function: code`` of the call, where the tool kept it (the monitor has none)

    @property
    def collective(self) -> bool:
        return bool(self.op) and op_facts(self.op).collective

    @property
    def nonfinite(self) -> bool:
        return self.kind in ("inf/nan", "nonfinite")

    @property
    def order(self) -> tuple:
        return (self.step, self.time, self.forward_id)

    def where(self) -> str:
        if not self.op:  # TrainingMonitor's: a module or parameter, or "" for the step's own figures (the loss)
            return f"{self.module or 'the step'} ({self.phase})"
        module = f" in {self.module}" if self.module else ""
        return f"{self.op}{module} ({self.phase})"


@dataclasses.dataclass
class FingerprintSession:
    """The replica fingerprints of one tool session of a run, on each rank that wrote them."""

    ranks: dict[int, dict[int, dict]]  # rank -> step -> {"params": {name: checksum}, "grads": {...}, "nonfinite"}
    files: dict[int, str]  # rank -> its file's name
    launch: tuple = ()  # (torchrun's launch, world size), from the files' headers: the files of one run share it

    def name(self) -> str:
        rank = min(self.files)
        return f"rank {rank}'s {self.files[rank]}"


@dataclasses.dataclass
class Results:
    folder: str
    ranks: set[int] = dataclasses.field(default_factory=set)
    tools: dict[str, set[int]] = dataclasses.field(default_factory=dict)  # tool -> ranks whose folder exists
    anomalies: list[Event] = dataclasses.field(default_factory=list)
    collectives: list[Event] = dataclasses.field(default_factory=list)
    # OpTimeMeasure's times, one tool session after another in the order they started (each counts its steps from
    # 0): rank -> step -> op -> milliseconds (forward + backward). Several where the tool was started several times,
    # or several runs wrote into the folder; none where the ranks' files cannot be matched (``times_unmatched``)
    times: list[dict[int, dict[int, dict[str, float]]]] = dataclasses.field(default_factory=list)
    times_unmatched: str = ""
    # rank -> its file (one per tool session) -> step -> op -> milliseconds, as read: _match_time_sessions matches
    # them into ``times``
    time_files: dict[int, dict[str, dict[int, dict[str, float]]]] = dataclasses.field(default_factory=dict)
    # one per tool session, in the order they started; a rank whose file has no step yet maps to {}
    fingerprints: list[FingerprintSession] = dataclasses.field(default_factory=list)
    unreadable: list[str] = dataclasses.field(default_factory=list)  # "path: why"
    unchecked: list[str] = dataclasses.field(default_factory=list)  # "rank N: Tool: what it did not check"
    # rank -> how far its .partial fingerprints file goes: a run that ended early (killed, or still running)
    ended_early: dict[int, str] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)  # what the reader should know of how tools judged
    files: int = 0


def _rank_folders(root: str, folder: str) -> dict[int, str]:
    """rank -> its folder under ``root/folder`` (``rank<N>``, or the folder itself outside torchrun: rank 0)."""
    base = os.path.join(root, folder)
    if not os.path.isdir(base):
        return {}
    ranks = {}
    for entry in os.listdir(base):
        match = _RANK_FOLDER.match(entry)
        if match and os.path.isdir(os.path.join(base, entry)):
            ranks[int(match.group(1))] = os.path.join(base, entry)
    return ranks or {0: base}


def _number(text, default=0.0) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        return default


def _csv_rows(path: str) -> list[dict]:
    """The rows of a tool's CSV. ``ValueError`` naming the line of a row of fewer or more fields than the header
    (``DictReader`` fills the missing ones with None, keeps the extra ones under the key None), or a file whose last
    line has no line end (cut inside its last field): a row lost could be the one that failed."""
    with open(path, newline="", encoding="utf-8") as f:
        text = f.read()
    reader = csv.DictReader(io.StringIO(text))
    rows = []
    for row in reader:
        if None in row or None in row.values():
            fields = sum(v is not None for k, v in row.items() if k is not None) + len(row.get(None) or ())
            raise ValueError(f"line {reader.line_num}: {fields} fields, the header has {len(reader.fieldnames or ())} "
                             "(a row cut short, or run on)")
        rows.append(row)
    if text and not text.endswith("\n"):  # the writer ends every row with one
        raise ValueError(f"line {reader.line_num}: cut short (no line end)")
    return rows


def read_results(folder: str) -> Results:
    if not os.path.isdir(folder):
        raise ResultsError(f"{folder} is not a folder (give the OP_TOOLS_RESULTS_DIR of the run)")
    results = Results(folder)
    readers = ((OVERFLOW_FOLDER, "OpOverflowCheck", "overflow_*.json", _read_overflow),
               (SELF_CHECK_FOLDER, "OpSelfCheck", "findings_*.json", _read_self_check),
               (AUTOCOMPARE_FOLDER, "OpAutoCompare", "op_autocompare_info_*.csv", _read_autocompare),
               (AUTOCOMPARE_FOLDER, "OpAutoCompare", "reference_*.json", _read_reference_trust),
               (TIME_FOLDER, TIME_MEASURE, "op_elasped_info_*.csv", _read_times),
               (FINGERPRINT_FOLDER, "fingerprints", "fingerprints_*.jsonl*", _read_fingerprints),
               (MONITOR_FOLDER, MONITOR, "anomalies_*.jsonl*", _read_monitor_anomalies),
               *((folder, tool, pattern, read) for folder, tool in (
                   (OVERFLOW_FOLDER, "OpOverflowCheck"), (SELF_CHECK_FOLDER, "OpSelfCheck"),
                   (AUTOCOMPARE_FOLDER, "OpAutoCompare"))
                 for pattern, read in (("unchecked_*.json", _read_unchecked), ("running_*.json", _read_running))))
    for subfolder, tool, pattern, read in readers:
        for rank, path in sorted(_rank_folders(folder, subfolder).items()):
            results.tools.setdefault(tool, set()).add(rank)
            results.ranks.add(rank)
            for file in sorted(glob.glob(os.path.join(path, pattern))):
                try:
                    read(results, rank, file)
                    results.files += 1
                except (OSError, ValueError, KeyError, TypeError) as e:
                    results.unreadable.append(f"{file}: {type(e).__name__}: {e}")
    _match_sessions(results)
    _match_time_sessions(results)
    not_judged = _not_judged(folder)
    if not_judged and not results.tools:
        raise ResultsError(f"{folder} holds only what this report does not judge: {_listed(not_judged)}")
    # said, not judged: the verdict is the other tools' alone
    results.notes.extend(f"{what} not judged here: {judged_by}" for what, judged_by in not_judged)
    if not results.tools:
        below = _results_below(folder)
        if below:  # the parent of the run's OP_TOOLS_RESULTS_DIR (op_tools_results where unset) given for it
            raise ResultsError(f"{folder} holds nothing op_tools wrote, but " + "; ".join(below))
        raise ResultsError(f"{folder} holds nothing op_tools wrote (none of {', '.join(f + '/' for f in _WRITTEN)})")
    return results


def _not_judged(folder: str) -> list[tuple[str, str]]:
    """What op_tools wrote in ``folder`` that holds no verdict this report reads, and what judges it: said, so that
    the report's verdict is never taken for one over them."""
    said = []
    captures = _rank_folders(folder, CAPTURE_FOLDER).values()
    recordings = [file for path in captures for file in glob.glob(os.path.join(path, "run_*.jsonl*"))]
    if recordings:
        said.append((f"{_count(len(recordings), 'run recording')} in {CAPTURE_FOLDER}/",
                     "two runs' recordings are compared by python -m op_tools.compare_runs RUN_A RUN_B"))
    saved = 0
    for index in (file for path in captures for file in glob.glob(os.path.join(path, "index_*.csv"))):
        with open(index, newline="", encoding="utf-8", errors="replace") as f:
            saved += max(0, sum(1 for _ in csv.reader(f)) - 1)  # a row per call saved, after the header
    if saved:
        said.append((f"{_count(saved, 'call')} OpCapture saved in {CAPTURE_FOLDER}/",
                     f"python -m op_tools.run_op_from_data {os.path.join(folder, CAPTURE_FOLDER)} reruns and judges "
                     "them"))
    summaries = glob.glob(os.path.join(folder, REPLAY_FOLDER, "replay_summary_*.csv"))
    if summaries:
        said.append((f"{_count(len(summaries), 'replay summary', 'replay summaries')} in {REPLAY_FOLDER}/",
                     "each holds its replay's verdicts, in its status column"))
    sweeps = glob.glob(os.path.join(folder, CONFORMANCE_FOLDER, "*", "conformance.csv"))
    if sweeps:
        said.append((f"{_count(len(sweeps), 'conformance sweep')} in {CONFORMANCE_FOLDER}/",
                     "each holds its verdicts, in its conformance.csv and conformance.html"))
    return said


def _listed(not_judged: list[tuple[str, str]]) -> str:
    return "; ".join(f"{what} ({judged_by})" for what, judged_by in not_judged)


def _count(n: int, one: str, many: str = "") -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


# The folders of OP_TOOLS_RESULTS_DIR whose files this report judges, and the others op_tools writes there.
_JUDGED = (OVERFLOW_FOLDER, AUTOCOMPARE_FOLDER, TIME_FOLDER, FINGERPRINT_FOLDER, MONITOR_FOLDER, SELF_CHECK_FOLDER)
_WRITTEN = (*_JUDGED, CAPTURE_FOLDER, REPLAY_FOLDER, CONFORMANCE_FOLDER)


def _results_below(folder: str) -> list[str]:
    """What each subfolder of ``folder`` that holds folders op_tools writes holds: ``folder`` is then the parent of
    the run's OP_TOOLS_RESULTS_DIR (``op_tools_results`` where unset), given for it."""
    below = []
    for entry in sorted(os.listdir(folder)):
        path = os.path.join(folder, entry)
        held = [name for name in _WRITTEN if os.path.isdir(os.path.join(path, name))]
        if not held:
            continue
        not_judged = [] if set(held) & set(_JUDGED) else _not_judged(path)
        if not_judged:
            below.append(f"{path} holds only what this report does not judge: {_listed(not_judged)}")
        else:
            below.append(f"{path} holds {', '.join(name + '/' for name in held)}: give that folder (the run's "
                         "OP_TOOLS_RESULTS_DIR)")
    return below


def _record(path: str, form: str, what: str) -> dict:
    """A tool's JSON file of format ``form``; ValueError naming ``what`` it should be otherwise."""
    with open(path, encoding="utf-8") as f:
        record = json.load(f)
    if record.get("format") != form:
        raise ValueError(f"not {what}")
    return record


def _read_overflow(results: Results, rank: int, path: str) -> None:
    record = _record(path, "op_tools overflow", "an OpOverflowCheck overflow file")
    rank = record["rank"] if isinstance(record.get("rank"), int) else rank
    received, came_in = bool(record.get("received", False)), bool(record.get("came_in", False))
    detail = "inf/nan received from another rank" if received else \
        "inf/nan read first, made by no call checked (the data, or a write not seen)" if came_in else \
        "first inf/nan from finite inputs"
    results.anomalies.append(Event(rank, int(record.get("step", 0)), float(record.get("time", 0.0)), record["op"],
                                   record.get("module", ""), record.get("phase", "forward"), "OpOverflowCheck",
                                   "inf/nan", detail, int(record.get("forward_id", 0)), received, came_in=came_in,
                                   location=_location(record.get("location"))))


def _read_unchecked(results: Results, rank: int, path: str) -> None:
    """What a tool said it did not check (``OpTool.write_unchecked``): no clean verdict over it."""
    record = _record(path, "op_tools unchecked", "an op_tools unchecked file")
    rank = record["rank"] if isinstance(record.get("rank"), int) else rank
    results.unchecked.append(f"rank {rank}: {record['tool']}: {record['not_checked']}")


def _read_running(results: Results, rank: int, path: str) -> None:
    """A tool session whose verdict was never written (``OpTool._running_marker``): its process is still running, or
    was killed before the tool stopped. What it checked after its last file is unknown: no clean verdict over it."""
    record = _record(path, "op_tools running", "an op_tools running marker")
    rank = record["rank"] if isinstance(record.get("rank"), int) else rank
    results.unchecked.append(f"rank {rank}: {record['tool']}: its session (pid {record.get('pid', '?')}) never "
                             f"stopped: the process was killed, or is still running ({os.path.basename(path)}); its "
                             "calls are not all judged")


def _read_self_check(results: Results, rank: int, path: str) -> None:
    record = _record(path, "op_tools self check", "an OpSelfCheck findings file")
    for found in record["first"]:
        found_rank = found["rank"] if isinstance(found.get("rank"), int) else rank
        results.anomalies.append(Event(found_rank, int(found.get("step", 0)), float(found.get("time", 0.0)),
                                       found["op"], found.get("module", ""), found.get("phase", "forward"),
                                       "OpSelfCheck", "mismatch",
                                       f"{found.get('check', 'invariant')} {_number(found.get('excess')):.3g}x what "
                                       "rounding allows" + (f" ({found['tensor']})" if found.get("tensor") else ""),
                                       int(found.get("forward_id", 0)),
                                       location=_location(found.get("location"))))


def _location(text) -> str:
    """The innermost frame of a kept location (a full stack has one a line); "" where none was found."""
    line = text.splitlines()[0] if isinstance(text, str) and text else ""
    return "" if line == "<unknown location>" else line


def _row_event(row: dict, rank: int, tool: str, op_column: str, **fields) -> Event:
    row_rank = row.get("rank", "")
    return Event(int(row_rank) if str(row_rank).isdigit() else rank, int(_number(row.get("step"))),
                 _number(row.get("time")), row[op_column], row.get("module", ""), row.get("phase", "forward"), tool,
                 forward_id=int(_number(row.get("forward_id"))), **fields)


def _read_autocompare(results: Results, rank: int, path: str) -> None:
    failed: dict[tuple, Event] = {}
    for row in _csv_rows(path):
        if row["verdict"] == "FAIL":
            key = (row["op"], row["forward_id"], row["phase"])
            if key not in failed:
                failed[key] = _row_event(row, rank, "OpAutoCompare", "op", kind="mismatch",
                                         detail=f"{row.get('name', '')}: {row.get('error_info', '')}".strip(": "),
                                         location=_location(row.get("location")))
        elif op_facts(row["op"]).collective:
            results.collectives.append(_row_event(row, rank, "OpAutoCompare", "op"))
    results.anomalies.extend(failed.values())


def _read_reference_trust(results: Results, rank: int, path: str) -> None:
    """OpAutoCompare's float64 reference on the device, where its cross-checks found the device's float64 kernels
    wrong for an op (whose reference then ran on the CPU)."""
    record = _record(path, "op_tools reference trust", "an OpAutoCompare reference file")
    rank = record["rank"] if isinstance(record.get("rank"), int) else rank
    for op, what in record["untrusted"].items():
        results.notes.append(f"rank {rank}: OpAutoCompare's float64 reference on {record.get('device', 'the device')} "
                             f"disagreed with the CPU's for {op} ({what}); that op was judged on the CPU from then on")


def _read_times(results: Results, rank: int, path: str) -> None:
    name = os.path.basename(path)
    for row in _csv_rows(path):
        event = _row_event(row, rank, TIME_MEASURE, "name")
        scale = 1e-3 if row.get("unit") == "us" else 1.0  # milliseconds
        spent = (_number(row.get("forward_elasped")) + _number(row.get("backward_elasped"))) * scale
        per_op = results.time_files.setdefault(event.rank, {}).setdefault(name, {}).setdefault(event.step, {})
        per_op[event.op] = per_op.get(event.op, 0.0) + spent
        if event.collective:
            results.collectives.append(event)


def _match_time_sessions(results: Results) -> None:
    """Match the ranks' timing files (one per tool session) into sessions across ranks (``Results.times``), as
    ``_match_sessions`` does the fingerprints: each session counts its steps from 0, so a tool started twice, or a
    folder two runs wrote into, added up per step would compare one rank's two sessions with another's one. The k-th
    file to start on a rank goes with every other rank's k-th; where the ranks wrote different numbers of them, which
    go together cannot be told, and none is compared (said)."""
    ordered = {rank: sorted(files, key=_started) for rank, files in sorted(results.time_files.items())}
    counts = {rank: len(files) for rank, files in ordered.items()}
    if len(set(counts.values())) > 1:
        wrote = ", ".join(f"rank {rank}: {count}" for rank, count in counts.items())
        results.times_unmatched = (f"the ranks wrote different numbers of time files ({wrote}): which go together "
                                   "cannot be told, and no step is compared")
        results.notes.append(f"{os.path.join(results.folder, TIME_FOLDER)}: {results.times_unmatched}")
        return
    sessions = max(counts.values(), default=0)
    results.times = [{rank: results.time_files[rank][files[k]] for rank, files in ordered.items()}
                     for k in range(sessions)]


def _read_fingerprints(results: Results, rank: int, path: str) -> None:
    """One rank's fingerprints. A ``.partial`` file was left by a process that never finished it (killed, or
    running still: SIGTERM and exit finish it): its rank's run ended early, read to its last whole line."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    partial = path.endswith(".partial")
    texts = text.split("\n")
    if partial and texts[-1]:
        texts.pop()  # the process died while writing it
    lines = [json.loads(line) for line in texts if line.strip()]
    if partial and not lines:
        results.ended_early[rank] = f"it wrote no replica fingerprint ({os.path.basename(path)} is empty: the " \
            "process was killed before its first step's were written, or is still running)"
        return
    if not lines or lines[0].get("format") != "op_tools fingerprints":
        raise ValueError("not a replica fingerprints file")
    header = lines[0]
    rank = header.get("rank", rank)
    steps = {int(record["step"]): {"params": record.get("params", {}), "grads": record.get("grads", {}),
                                   "nonfinite": record.get("nonfinite", [])} for record in lines[1:]}
    # a session of its own until _match_sessions finds the other ranks' files of its run
    results.fingerprints.append(FingerprintSession({rank: steps}, {rank: os.path.basename(path)},
                                                   tuple(header.get(key) if isinstance(header.get(key), (str, int))
                                                         else None for key in ("launch", "world_size"))))
    if partial:
        written = f"its fingerprints go to step {max(steps)}" if steps else "it wrote no step's fingerprints"
        results.ended_early[rank] = f"{written} ({os.path.basename(path)}: the process was killed before its " \
            "tools stopped, or is still running)"


def _started(name: str) -> tuple:
    """A fingerprints file's place among its rank's: its session's start (the stem's local time, then the process's
    session count); a name of another form after those, by name."""
    match = _SESSION_STEM.search(name)
    return (0, match.group(1), int(match.group(2)), name) if match else (1, "", 0, name)


def _match_sessions(results: Results) -> None:
    """Match each rank's fingerprints files (one per tool session, read each as a session of its own) into the
    sessions of the runs that wrote them: a folder several runs wrote into holds several, each counting its steps
    from 0, and one compared with another would hide a desync or make one up. The files of one run share their
    header's launch (torchrun's rendezvous id and restart count) and world size; within that, a rank's k-th file by
    start goes with every other rank's k-th. Files without a launch (written before it was, or outside torchrun),
    or of launches given one ``--rdzv-id``, share one, and are matched by order only where every rank wrote as many:
    else which go together cannot be told, and none is compared (not read: no clean verdict over them)."""
    runs: dict[tuple, dict[int, list[FingerprintSession]]] = {}
    for file in results.fingerprints:
        for rank in file.ranks:
            runs.setdefault(file.launch, {}).setdefault(rank, []).append(file)
    sessions: list[FingerprintSession] = []
    for launch, by_rank in runs.items():
        counts = {rank: len(files) for rank, files in sorted(by_rank.items())}
        if len(set(counts.values())) > 1:
            wrote = ", ".join(f"rank {rank}: {count}" for rank, count in counts.items())
            named = f"of launch {launch[0]}" if launch[0] else "naming no launch"
            results.unreadable.append(f"{os.path.join(results.folder, FINGERPRINT_FOLDER)}: the ranks wrote different "
                                      f"numbers of fingerprints files {named} ({wrote}): which go together cannot be "
                                      "told, and none of them is compared")
            sessions.extend(file for files in by_rank.values() for file in files)
            continue
        ordered = [sorted(files, key=lambda f: _started(next(iter(f.files.values())))) for files in by_rank.values()]
        for matched in zip(*ordered):
            sessions.append(FingerprintSession({r: s for f in matched for r, s in f.ranks.items()},
                                               {r: n for f in matched for r, n in f.files.items()}, launch))
    results.fingerprints = sorted(sessions, key=lambda s: min(map(_started, s.files.values())))


def _read_monitor_anomalies(results: Results, rank: int, path: str) -> None:
    """One JSON object a line (the monitor's contract: docs/tools/training_monitor.md); an empty file is a clean
    session. A line that is not an anomaly makes the whole file unreadable, as for the other readers."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    lines = text.split("\n")
    if path.endswith(".partial") and lines[-1]:
        lines.pop()  # a run that died while writing it: the last line was cut short
    events = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                events.append(_monitor_event(json.loads(line), rank))
            except json.JSONDecodeError as e:
                raise ValueError(f"line {number}: not JSON ({e.msg}, column {e.colno})") from e
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"line {number}: {type(e).__name__}: {e}") from e
    results.anomalies.extend(events)


def _monitor_event(record: dict, rank: int) -> Event:
    def typed(key: str, *types: type):
        value = record[key]
        if not isinstance(value, types) or isinstance(value, bool):
            raise TypeError(f"{key} is {value!r}, not {' or '.join(t.__name__ for t in types)}")
        return value

    if not isinstance(record, dict):
        raise TypeError(f"{record!r} is not an object")
    if record["phase"] not in MONITOR_PHASES:
        raise ValueError(f"phase is {record['phase']!r}, not one of {', '.join(MONITOR_PHASES)}")
    value = record["value"]
    return Event(record["rank"] if isinstance(record.get("rank"), int) else rank, typed("step", int),
                 float(typed("time", int, float)), "", typed("module", str), record["phase"], MONITOR,
                 typed("rule", str), typed("message", str), value=None if value is None else
                 result_files.json_float(value))
