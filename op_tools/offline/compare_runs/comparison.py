"""Two run recordings compared: aligned rows, each pair's verdict, the first divergences, a summary per module."""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Callable

from ...config.variables import COMPARE_RUNS_CARRIED_GROWTH, COMPARE_RUNS_DEPTH_SCALE, COMPARE_RUNS_TOLERANCES
from ...ops.op_facts import op_facts
from ...ops.writes import call_writes
from ...output.run_recording import TENSOR_FIELDS, read_recording
from .alignment import Row, align, recomputations, sides, tensors
from .verdict import (
    DEFAULT_TOLERANCES,
    difference,
    nonfinite_in_both,
    precision_of,
    summed_gradient_floor,
    tolerance_key,
)


@dataclasses.dataclass(frozen=True)
class Tolerances:
    """Relative tolerances by precision (``exact`` for integer-only calls) and their growth with depth."""

    by_dtype: dict[str, float]
    depth_scale: int
    carried_growth: float

    @classmethod
    def from_env(cls) -> Tolerances:
        return cls({**DEFAULT_TOLERANCES, **COMPARE_RUNS_TOLERANCES.read(), "exact": 0.0},
                   COMPARE_RUNS_DEPTH_SCALE.read(), COMPARE_RUNS_CARRIED_GROWTH.read())

    def at(self, precision: int | None, depth: int) -> float:
        base = self.by_dtype[tolerance_key(precision)]
        return base if not self.depth_scale else base * math.sqrt(1 + depth / self.depth_scale)


@dataclasses.dataclass
class Comparison:
    """The result of ``compare(run_a, run_b)``; ``rows`` in run A's order."""

    header_a: dict
    header_b: dict
    rows: list[Row]
    tolerances: Tolerances

    @property
    def divergences(self) -> list[Row]:
        return [r for r in self.rows if r.diverged]

    @property
    def not_compared(self) -> list[Row]:
        """Aligned pairs with no verdict, each with its reason (``Row.not_compared``)."""
        return [r for r in self.rows if r.not_compared]

    @property
    def compared(self) -> list[Row]:
        """Aligned pairs judged: agreeing or diverged."""
        return [r for r in self.rows if not r.structural and not r.not_compared and not r.skipped]

    @property
    def skipped(self) -> list[Row]:
        """Aligned pairs needing no verdict: calls whose outputs are memory never written (``empty``), whatever
        each run found there."""
        return [r for r in self.rows if r.skipped]

    def unreadable(self) -> list[tuple[str, int, str]]:
        """``(run label, damaged lines, the first)`` per run with lines that are no call's record: calls lost."""
        return [(label, h.get("unreadable", 0), h.get("first_unreadable", ""))
                for label, h in (("A", self.header_a), ("B", self.header_b)) if h.get("unreadable")]

    @property
    def unreached(self) -> list[Row]:
        """Calls of one run only between aligned pairs whose results reach no aligned call (``Row.unreached``):
        nothing compared what they computed."""
        return [r for r in self.rows if r.unreached]

    @property
    def past_other_run(self) -> list[Row]:
        """Calls of one run after the last aligned pair (``Row.no_counterpart``): the other run holds nothing to
        compare them with (it was cut short, ran fewer steps, or recorded no call)."""
        return [r for r in self.rows if r.no_counterpart]

    def recorded_ops(self) -> str:
        """What each run recorded where their op selections differ (``run A every op, run B OP_CAPTURE_LIST=...``),
        '' where they are the same or a recording does not say (made before recordings said it) and the other
        recorded every op."""
        a, b = recorded_ops(self.header_a), recorded_ops(self.header_b)
        if a == b or {a, b} == {None, EVERY_OP}:
            return ""
        return ", ".join(f"run {label} {what or 'unknown (its recording does not say)'}"
                         for label, what in (("A", a), ("B", b)))

    def dtype_changes(self) -> tuple[int, int, collections.Counter]:
        """``(aligned pairs whose tensors' floating dtypes differ, aligned pairs, Counter of (dtype in A, dtype in
        B))``: such a pair is judged at its lower precision's tolerance (a float32 run against a bfloat16-autocast
        one), so a difference below that precision's rounding cannot be seen."""
        changed, pairs = 0, 0
        kinds: collections.Counter = collections.Counter()
        for row in self.rows:
            if row.a is None or row.b is None:
                continue
            pairs += 1
            found = {(x[1], y[1]) for x, y in zip(tensors(row.a), tensors(row.b))
                     if x[1] != y[1] and precision_of(x[1]) is not None and precision_of(y[1]) is not None}
            if found:
                changed += 1
                kinds.update(found)
        return changed, pairs, kinds

    def incomplete(self) -> list[tuple[str, str]]:
        """``(run label, why)`` per recording that does not hold the whole run: partial (the run did not stop its
        tool), a complete file with fewer lines than its end marker counts, or a file whose run did not end
        normally (SIGTERM, an exception out of the tool's with-block: its end marker says so)."""
        out = []
        for label, h in (("A", self.header_a), ("B", self.header_b)):
            if not h["complete"]:
                out.append((label, "partial: the run did not stop its tool" + (
                    ", its last line was cut short" if h.get("cut") else "") + "; its later calls are not in it"))
            elif h.get("lost"):
                out.append((label, f"its end marker counts {h['lost']} more record{'s' if h['lost'] != 1 else ''} "
                                   "than it holds: lines lost"))
            elif h.get("ended_by"):
                out.append((label, f"the run ended by {h['ended_by']}; the calls it did not reach are not in it"))
        return out

    def verdict(self) -> str:
        """``"found"`` (a pair diverges), ``"unchecked"`` (none does, but some calls were not compared: pairs
        without statistics, damaged lines, calls past the other run's end, calls of one run only whose results
        reach no aligned call, an incomplete recording, or no pair at all) or ``"clean"``; the command's exit status
        (``exit_status.status_of``)."""
        if self.divergences:
            return "found"
        gaps = (self.not_compared or self.unreadable() or self.past_other_run or self.unreached or self.incomplete()
                or not self.compared)
        return "unchecked" if gaps else "clean"

    @property
    def structural(self) -> list[Row]:
        """Calls of one run only between aligned pairs (not those past the other run's end: ``past_other_run``)."""
        return [r for r in self.rows if r.structural and not r.no_counterpart]

    def first_divergence(self, phase: str | None = None) -> Row | None:
        """The first aligned pair (in run A's order) that diverges, of ``phase`` if given."""
        return next((r for r in self.rows if r.diverged and phase in (None, r.phase)), None)

    def first_unexplained(self, phase: str | None = None) -> Row | None:
        """The first aligned pair whose outputs differ by more than what it read explains, of ``phase`` if given:
        past a pair that diverged only because its inputs already differed (``Row.inputs_differed_first``)."""
        return next((r for r in self.rows if r.outputs_unexplained and phase in (None, r.phase)), None)

    def closest(self) -> Row | None:
        """The aligned pair nearest to diverging: the largest difference relative to what it was allowed."""
        growth = self.tolerances.carried_growth
        return max((r for r in self.rows
                    if not r.structural and not r.not_compared and r.tolerance + growth * r.carried > 0),
                   key=lambda r: r.difference / (r.tolerance + growth * r.carried), default=None)

    @property
    def first_structural(self) -> Row | None:
        """The first call of one run only between aligned pairs; calls past the other run's end are no structural
        difference but calls not compared (``past_other_run``)."""
        return next((r for r in self.rows if r.structural and not r.no_counterpart), None)

    def modules(self) -> list[dict]:
        """Per module path, in order of first appearance: its calls, the largest relative difference of its
        forward outputs and of its gradients (backward ``grad_inputs``), calls diverged and in one run only."""
        out: dict[str, dict] = {}
        for row in self.rows:
            entry = out.setdefault(row.module, {"module": row.module, "calls": 0, "max_output_diff": 0.0,
                                                "max_grad_diff": 0.0, "diverged": 0, "structural": 0,
                                                "not_compared": 0})
            entry["calls"] += 1
            entry["diverged"] += row.diverged
            entry["structural"] += row.structural and not row.no_counterpart
            entry["not_compared"] += bool(row.not_compared or row.no_counterpart or row.unreached)
            if row.a is not None and row.b is not None and not row.not_compared and not row.skipped:  # judged (not
                # fresh memory's values, which differ between any two runs)
                side = sides(row.a)[1]
                worst = max((difference(x, y)[0] for x, y in _pairs(row.a.get(side, []), row.b.get(side, []))),
                            default=0.0)
                # a call backward makes of its own (DDP's all-reduce) has outputs, not gradients
                column = "max_grad_diff" if row.phase == "backward" and not row.a.get("in_backward") else \
                    "max_output_diff"
                entry[column] = max(entry[column], worst)
        return list(out.values())


EVERY_OP = "every op"


def recorded_ops(header: dict) -> str | None:
    """The op selection a recording used, in words (``every op``, ``OP_CAPTURE_LIST=linear,softmax``); None when
    its header does not say (a recording made before headers said it)."""
    if "ops" not in header and "disable" not in header:
        return None
    ops, disable = header.get("ops"), header.get("disable") or []
    parts = ([] if ops is None else [f"OP_CAPTURE_LIST={','.join(map(str, ops))}"]) + \
        ([f"OP_CAPTURE_DISABLE_LIST={','.join(map(str, disable))}"] if disable else [])
    return "; ".join(parts) or EVERY_OP


def _pairs(xs: list[list], ys: list[list]) -> list[tuple[list, list]]:
    """Tensors of two calls paired by their place in the arguments when both name the same places, else in order."""
    if [x[0] for x in xs] == [y[0] for y in ys]:
        return list(zip(xs, ys))
    by_place = {y[0]: y for y in ys}
    if all(x[0] in by_place for x in xs):
        return [(x, by_place[x[0]]) for x in xs]
    return list(zip(xs, ys))


def _unpaired(xs: list[list], ys: list[list], pairs: list[tuple[list, list]]) -> list[tuple[str, list]]:
    """``("A" or "B", tensor)`` for each tensor ``pairs`` (``_pairs(xs, ys)``) leaves out: one run's call has it, the
    other's not (another count of outputs, a place the other run does not name)."""
    paired = {id(t) for pair in pairs for t in pair}
    return [(label, t) for label, side in (("A", xs), ("B", ys)) for t in side if id(t) not in paired]


def _lowest_precision(row: Row) -> int | None:
    ranks = [p for record in (row.a, row.b) if record is not None
             for p in (precision_of(t[1]) for t in tensors(record)) if p is not None]
    return min(ranks, default=None)


def _no_floor(x: list, y: list) -> float:
    return 0.0


def _largest(a: dict, b: dict, side: str, floor: Callable[[list, list], float] = _no_floor) -> tuple[float, str]:
    worst, detail = 0.0, ""
    for x, y in _pairs(a.get(side, []), b.get(side, [])):
        rel, stat = difference(x, y, floor(x, y))
        if rel > worst:
            worst, detail = rel, f"{side}{x[0]} {stat}"
    return worst, detail


def _summed_gradient_floors(row: Row, forward: Row | None) -> Callable[[list, list], float]:
    """Per pair of a backward's gradients, the RMS it is measured against at least (``summed_gradient_floor``): the
    larger of the two runs', each from its own upstream gradients and forward call."""
    if forward is None or forward.a is None or forward.b is None or row.a is None or row.b is None:
        return _no_floor
    sides = [(record.get("grad_outputs", []), fwd.get("inputs", []), fwd.get("outputs", []))
             for record, fwd in ((row.a, forward.a), (row.b, forward.b))]
    return lambda x, y: max(summed_gradient_floor(t, *side) for t, side in ((x, sides[0]), (y, sides[1])))


def _judge(rows: list[Row], tolerances: Tolerances) -> None:
    """Each aligned pair's verdict (see verdict.py): its outputs' difference against the tolerance of the lowest
    precision used so far (either run, from the start) at its depth (calls before it in its step in run A), plus
    ``carried_growth`` times the difference its inputs carried in. A pair whose inputs differ beyond the tolerance
    before any pair differed is a divergence too: what its inputs carry came from a call of one run only before it
    (``Row.origin``, the nearest), else from outside the recording."""
    carried_precision: int | None = None
    step_start: dict[int, int] = {}
    forward_rows: dict[int, Row] = {}
    seen_difference = False
    only_one_run: Row | None = None  # the latest call of one run only: it may change what the calls after it read
    for row in rows:
        precision = _lowest_precision(row)
        if precision is not None:
            carried_precision = precision if carried_precision is None else min(carried_precision, precision)
        if row.a is None or row.b is None:  # structural: nothing to compare
            only_one_run = row
            continue
        if op_facts(row.a["op"]).uninitialised:  # what each run found in fresh memory: nothing to compare
            row.skipped = "uninitialised memory"
            continue
        unrecorded = [(label, r["unrecorded"]) for label, r in (("A", row.a), ("B", row.b)) if "unrecorded" in r]
        if unrecorded:
            row.not_compared = "; ".join(f"run {label} has no statistics ({why})" for label, why in unrecorded)
            continue
        into, out_of = sides(row.a)
        read_a, read_b = row.a, row.b
        # what a call writes without reading (copy_'s target, out=) is no input of it
        if row.phase == "forward" or row.a.get("in_backward"):
            first, unread = _unread_inputs(row.a["op"])
            if first or unread:
                read_a, read_b = ({**r, into: [e for i, e in enumerate(r.get(into, []))
                                               if not (first and i == 0) and e[0] not in unread]}
                                  for r in (row.a, row.b))
        forward = forward_rows.get(row.a["forward_seq"]) if into == "grad_outputs" else None
        try:
            # the verdict's difference measures a gradient summed to about zero against its terms' rounding; what
            # differed (for the calls after it: what they read, and whether any call differed) is the plain one
            row.difference, row.detail = _largest(row.a, row.b, out_of, _summed_gradient_floors(row, forward))
            differed = _largest(row.a, row.b, out_of)[0] if forward is not None else row.difference
            carried, carried_detail = _largest(read_a, read_b, into)
        except Exception as e:  # noqa: BLE001 - a pair this comparison cannot judge: counted, named, not agreeing
            row.difference, row.detail = 0.0, ""
            row.not_compared = f"the comparison failed ({type(e).__name__}: {e})"
            continue
        if into == "grad_outputs":  # a call's backward also reads its forward's inputs and outputs
            if forward is not None:
                for value, what in ((forward.carried, forward.carried_detail), (forward.difference, forward.detail)):
                    if value > carried:
                        carried, carried_detail = value, f"its forward's {what}"
        else:
            forward_rows[row.a["seq"]] = row
        row.carried, row.carried_detail = carried, carried_detail
        depth = row.a["seq"] - step_start.setdefault(row.step, row.a["seq"])
        row.tolerance = tolerances.at(carried_precision, depth)
        row.outputs_unexplained = row.difference > row.tolerance + tolerances.carried_growth * carried
        row.inputs_differed_first = carried > row.tolerance and not seen_difference
        if row.inputs_differed_first:  # no aligned call differed: a call of one run only may have made it
            row.origin = only_one_run
        row.diverged = row.outputs_unexplained or row.inputs_differed_first
        seen_difference = seen_difference or max(differed, carried) > row.tolerance
        outputs_a, outputs_b = row.a.get(out_of, []), row.b.get(out_of, [])
        pairs = _pairs(outputs_a, outputs_b)
        masked = [f"{out_of}{x[0]} {why}" for x, y in pairs if (why := nonfinite_in_both(x, y))]
        # an output one run's call has and the other's has not: nothing to compare it with, no agreement either
        masked += [f"{out_of}{t[0]} in run {label} only: not compared"
                   for label, t in _unpaired(outputs_a, outputs_b, pairs)]
        # outputs past the recorder's limit (OP_CAPTURE_STATS_MAX_TENSORS) have no statistics: a foreach optimizer
        # step's parameters past it, whose fault no later call may read
        omitted = [f"{n} in run {label}" for label, r in (("A", row.a), ("B", row.b))
                   if (n := (r.get("omitted") or {}).get(out_of))]
        if omitted:
            masked.append(f"{out_of} past OP_CAPTURE_STATS_MAX_TENSORS not recorded ({', '.join(omitted)}; a larger "
                          "one records them): their values not compared")
        if masked and not row.diverged:  # what was not compared is no agreement
            row.not_compared = masked[0] + (f" (and {len(masked) - 1} more)" if len(masked) > 1 else "")


def _mark_past_the_end(rows: list[Row]) -> None:
    """Mark the calls of one run after the last aligned pair: nothing of the other run follows to compare them with.
    A call of one run only between aligned pairs (a copy one backend makes) stays a structural difference: what it
    computed reaches the aligned calls after it, which are compared."""
    last = max((n for n, r in enumerate(rows) if not r.structural), default=-1)
    tail = rows[last + 1:]
    both = any(r.a is None for r in tail) and any(r.b is None for r in tail)  # both go on: neither ended first
    for row in tail:
        other = "B" if row.b is None else "A"
        row.no_counterpart = (f"run {other}'s calls after the last aligned pair are others: not compared" if both
                              else f"run {other}'s recording ends before it: not compared")


def _values(entry: list) -> tuple | None:
    """What identifies a recorded tensor's values: its dtype and statistics but the nan and inf counts (unknown in
    one record of a tensor, known in another) and the shape (a view of it reshaped); None for an empty tensor."""
    if len(entry) != len(TENSOR_FIELDS):
        return None
    return (entry[1], *entry[3:7], *entry[9:])


def _mark_unreached(rows: list[Row]) -> None:
    """Mark the calls of one run only between aligned pairs whose results reach no aligned call of their run.

    Such a call is compared through the aligned calls that read what it computed (a copy one backend makes, a
    ``.float()`` one script adds): it needs no pair of its own. One whose results no aligned call reads (a metric
    one run recorded and the other did not, under another OP_CAPTURE_LIST) was compared by nothing: not compared.
    A result reaches an aligned call when one of that run's aligned records holds a tensor of the same values
    (``_values``: 16 fingerprints and the extremes, mean and norm), directly or through calls of that run only
    that do (walked from the end)."""
    reached: dict[str, set] = {"A": set(), "B": set()}
    for row in rows:
        if row.a is not None and row.b is not None:
            for label, record in (("A", row.a), ("B", row.b)):
                reached[label].update(v for t in tensors(record) if (v := _values(t)) is not None)
    for row in reversed(rows):
        if not row.structural or row.no_counterpart:
            continue
        label = "A" if row.b is None else "B"
        record = row.record
        into, out_of = sides(record)
        if "unrecorded" in record:
            row.unreached = f"in run {label} only, without statistics ({record['unrecorded']}): not compared"
            continue
        if op_facts(record["op"]).uninitialised:  # fresh memory: nothing to compare
            continue
        results = [v for t in record.get(out_of, ()) if (v := _values(t)) is not None]
        if results and all(v in reached[label] for v in results):  # none (torch.allclose's bool) reaches nothing
            reached[label].update(v for t in record.get(into, ()) if (v := _values(t)) is not None)
        else:
            row.unreached = (f"in run {label} only, and what it computed reaches no call both runs recorded: "
                             "not compared")


def _unread_inputs(op: str) -> tuple[bool, frozenset[str]]:
    """Whether ``op`` overwrites its first argument (``op_facts``' ``overwrites``), and the ``where`` of the keyword
    arguments it writes (``[out]``): what the tensors held before the call is no input of it (an ``empty``'s memory,
    which differs from run to run)."""
    return op_facts(op).overwrites, frozenset(f"[{k}]" for k in call_writes(op).keywords)


def compare(run_a: str, run_b: str, tolerances: Tolerances | None = None, rank: int | None = None,
            rank_b: int | None = None) -> Comparison:
    """Align and compare two recordings (files, or folders holding one each; ``rank``: the ``rank<N>`` ones, and
    ``rank_b`` run B's when it is another rank: rank A against rank B of one run).

    >>> result = compare("cpu_run/", "npu_run/")
    >>> row = result.first_divergence()
    >>> row.module, row.op, row.detail   # ('model.layers.1.mlp.act_fn', 'torch.nn.functional.silu', 'outputs[0] max')
    """
    tolerances = tolerances or Tolerances.from_env()
    header_a, records_a = read_recording(run_a, rank)
    header_b, records_b = read_recording(run_b, rank if rank_b is None else rank_b)

    def close(x: list, y: list) -> bool:
        precision = min((p for p in (precision_of(x[1]), precision_of(y[1])) if p is not None), default=None)
        return difference(x, y)[0] <= tolerances.at(precision, 0)

    # left out of the alignment, counted: a checkpoint's reruns of forward calls, compared as their forward
    header_a["recomputations"], header_b["recomputations"] = recomputations(records_a), recomputations(records_b)
    rows = align(records_a, records_b, close)
    _judge(rows, tolerances)
    _mark_past_the_end(rows)
    _mark_unreached(rows)
    return Comparison(header_a, header_b, rows, tolerances)
