"""Aligning two run recordings call by call, as a diff aligns two texts.

Calls are grouped by (step, phase, module path); groups of the same key are aligned with each other, a group in
one run only is a structural difference. Inside a group, the calls are matched in passes, each over what the
previous ones left between their matches (``difflib.SequenceMatcher``, order kept):

1. by op and tensor shapes, in order, whatever the index (a call inserted before shifts the indices): ``exact``
   where the indices are the same too, else ``name``. Not by index first: after a call one run inserts (a
   ``detach`` sim's ``Module.to`` makes per parameter), the same index and op is the next call of a run of like
   calls (the next parameter's ``to``), and pairing by it compared different tensors;
2. ``exact``: the same index in the module and the same op, among the calls left (their shapes differ between the
   runs: another batch size, another shard);
3. ``similar``: the same op type (``add`` for ``torch.add``, ``torch.Tensor.add_``), the same output shapes and
   output norms within the tolerance (one backend's ``torch.Tensor.add`` is the other's ``torch.add``).

What is left is in one run only: an inserted ``.to()``, an op one backend decomposes and the other runs fused.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Callable

PHASE_SIDES = {"forward": ("inputs", "outputs"), "backward": ("grad_outputs", "grad_inputs"),
               "optimizer": ("inputs", "outputs")}
CALL_SIDES = ("inputs", "outputs")


def sides(record: dict) -> tuple[str, str]:
    """What a record's call read and what it computed: a call's backward, its upstream gradients and its inputs'
    gradients; a call (in forward, in the optimizer, or one backward makes of its own, ``in_backward``: DDP's
    gradient all-reduce, a hook's ops), its inputs and outputs."""
    return CALL_SIDES if record.get("in_backward") else PHASE_SIDES[record["phase"]]


@dataclasses.dataclass
class Row:
    """One line of the side-by-side view: two aligned calls, or a call of one run only (``a`` or ``b`` None)."""

    step: int
    phase: str
    module: str
    a: dict | None
    b: dict | None
    match: str  # exact, name, similar, or "only A" / "only B"
    position: float = 0.0  # where the row sits in run A's order (a call of B only: after B's previous aligned call)
    difference: float = 0.0  # the largest relative difference of the pair's outputs (verdict.difference)
    detail: str = ""  # which tensor and statistic
    carried: float = 0.0  # the largest relative difference of what the call read (inputs; in backward also upstream
    # gradients and its forward's tensors)
    carried_detail: str = ""  # which of what it read differs the most, and in which statistic
    tolerance: float = 0.0  # for its precision and depth; the verdict adds carried_growth * carried
    diverged: bool = False  # inputs_differed_first or outputs_unexplained
    inputs_differed_first: bool = False  # what it read differed beyond the tolerance before any aligned call did
    # with inputs_differed_first: the nearest call of one run only before it (the likely origin), None when none was
    origin: Row | None = dataclasses.field(default=None, repr=False)
    outputs_unexplained: bool = False  # its outputs differ by more than tolerance + carried_growth * carried
    not_compared: str = ""  # why an aligned pair has no verdict (a call a run could not record); '' when judged
    skipped: str = ""  # why an aligned pair needs no verdict (its outputs are uninitialised memory); '' otherwise
    no_counterpart: str = ""  # why a call of one run only, past the other run's last aligned call, was not compared
    # why a call of one run only between aligned pairs was not compared: what it computed reaches no aligned call
    # (a metric one run recorded and the other did not), so nothing compared it; '' when it does, or not such a call
    unreached: str = ""

    @property
    def record(self) -> dict:
        """Run A's call, or run B's where only B has it."""
        record = self.a or self.b
        assert record is not None  # a row holds a call of at least one run
        return record

    @property
    def verdict_detail(self) -> str:
        """``detail``, or for a pair diverged only because what it read already differed, which input did."""
        if self.inputs_differed_first and not self.outputs_unexplained:
            after = "" if self.origin is None else (
                f", likely from {self.origin.op} in {self.origin.match.removeprefix('only ')} only before it")
            return f"{self.carried_detail} (an input: the runs differed before this call{after})"
        return self.detail

    @property
    def op(self) -> str:
        return self.record["op"]

    @property
    def structural(self) -> bool:
        return self.a is None or self.b is None


def tensors(record: dict) -> list[list]:
    into, out_of = sides(record)
    return [*record.get(into, ()), *record.get(out_of, ())]


def op_type(name: str) -> str:
    return name.rsplit(".", 1)[-1].strip("_")


def _exact_key(record: dict):
    return record["index"], record["op"]


def _name_key(record: dict):
    return record["op"], tuple(tuple(t[2]) for t in tensors(record))


def _similar(a: dict, b: dict, close: Callable[[list, list], bool]) -> bool:
    if op_type(a["op"]) != op_type(b["op"]):
        return False
    out_a, out_b = a.get(sides(a)[1], []), b.get(sides(b)[1], [])
    if [t[2] for t in out_a] != [t[2] for t in out_b]:
        return False
    return all(close(x, y) for x, y in zip(out_a, out_b))


def align_calls(la: list[dict], lb: list[dict], close: Callable[[list, list], bool]) -> list[tuple]:
    """``[(a or None, b or None, match)]`` for two calls lists of one group, in order."""
    out: list[tuple] = []
    _match(la, lb, [("name", _name_key), ("exact", _exact_key)], close, out)
    return [(a, b, "exact" if match == "name" and a["index"] == b["index"] else match) for a, b, match in out]


def _match(la: list, lb: list, passes: list, close, out: list) -> None:
    if not passes:
        _match_similar(la, lb, close, out)
        return
    (label, key), rest = passes[0], passes[1:]
    matcher = difflib.SequenceMatcher(None, [key(r) for r in la], [key(r) for r in lb], autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            out.extend((la[i], lb[j], label) for i, j in zip(range(i1, i2), range(j1, j2)))
        else:
            _match(la[i1:i2], lb[j1:j2], rest, close, out)


def _match_similar(la: list, lb: list, close, out: list) -> None:
    j = 0
    for a in la:
        found = next((k for k in range(j, len(lb)) if _similar(a, lb[k], close)), None)
        if found is None:
            out.append((a, None, "only A"))
            continue
        out.extend((None, b, "only B") for b in lb[j:found])
        out.append((a, lb[found], "similar"))
        j = found + 1
    out.extend((None, b, "only B") for b in lb[j:])


def group(records: list[dict]) -> dict[tuple, list[dict]]:
    """Records by (step, phase, module, whether a call backward made of its own), in order; recomputations left out
    (``recomputations`` counts them: the reruns of forward calls compared as their forward)."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if r["phase"] in PHASE_SIDES:
            groups.setdefault((r["step"], r["phase"], r["module"], bool(r.get("in_backward"))), []).append(r)
    return groups


def recomputations(records: list[dict]) -> int:
    """How many records are a checkpoint's recomputations, which the alignment leaves out."""
    return sum(r["phase"] == "recompute" for r in records)


def align(records_a: list[dict], records_b: list[dict], close: Callable[[list, list], bool]) -> list[Row]:
    """Every call of both runs, aligned, in run A's order (calls of B only where B ran them)."""
    groups_a, groups_b = group(records_a), group(records_b)
    rows: list[Row] = []
    for key in [*groups_a, *(k for k in groups_b if k not in groups_a)]:
        step, phase, module, _ = key
        if key not in groups_b:
            rows += [Row(step, phase, module, a, None, "only A") for a in groups_a[key]]
        elif key not in groups_a:
            rows += [Row(step, phase, module, None, b, "only B") for b in groups_b[key]]
        else:
            rows += [Row(step, phase, module, a, b, match)
                     for a, b, match in align_calls(groups_a[key], groups_b[key], close)]
    _place(rows, records_b)
    rows.sort(key=lambda r: r.position)
    return rows


def _place(rows: list[Row], records_b: list[dict]) -> None:
    """Give each row its place in A's order; a call of B only goes after B's previous call that is aligned."""
    row_of_b = {id(r.b): r for r in rows if r.b is not None}
    last, offset = -1.0, 0
    for b in records_b:
        row = row_of_b.get(id(b))
        if row is None:
            continue
        if row.a is not None:
            last, offset = float(row.a["seq"]), 0
        else:
            offset += 1
            row.position = last + offset / (len(records_b) + 1)
    for row in rows:
        if row.a is not None:
            row.position = float(row.a["seq"])
