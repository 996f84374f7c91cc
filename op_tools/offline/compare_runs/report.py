"""The comparison as a console report and as CSV rows (the HTML view is html_view.py)."""

from __future__ import annotations

from ...output import reporting
from .alignment import Row, sides, tensors
from .comparison import Comparison
from .verdict import precision_of, tolerance_key

CSV_COLUMNS = ("row", "step", "phase", "module", "match", "index_a", "op_a", "index_b", "op_b", "difference",
               "tolerance", "diverged", "detail", "dtypes_a", "dtypes_b", "shapes_a", "shapes_b", "seq_a", "seq_b",
               "not_compared")


def _describe(record: dict | None, field: int) -> str:
    if record is None:
        return ""
    return " ".join(str(t[field]).replace(" ", "") for t in tensors(record))


def csv_rows(result: Comparison) -> list[dict]:
    out = []
    for n, row in enumerate(result.rows):
        a, b = row.a or {}, row.b or {}
        judged = not row.structural and not row.not_compared
        out.append({
            "row": n, "step": row.step, "phase": row.phase, "module": row.module, "match": row.match,
            "index_a": a.get("index", ""), "op_a": a.get("op", ""), "index_b": b.get("index", ""),
            "op_b": b.get("op", ""), "difference": "" if not judged else f"{row.difference:.3g}",
            "tolerance": "" if not judged else f"{row.tolerance:.3g}",
            "diverged": int(row.diverged), "not_compared": row.not_compared or row.no_counterpart or row.unreached,
            "detail": row.verdict_detail, "dtypes_a": _describe(row.a, 1), "dtypes_b": _describe(row.b, 1),
            "shapes_a": _describe(row.a, 2), "shapes_b": _describe(row.b, 2), "seq_a": a.get("seq", ""),
            "seq_b": b.get("seq", ""),
        })
    return out


def where(row: Row) -> str:
    """``step 0 forward model.layers.1.mlp.act_fn #0 torch.nn.functional.silu``."""
    record = row.record
    return f"step {row.step} {row.phase} {row.module or '(no module)'} #{record['index']} {record['op']}"


def _calls(n: int) -> str:
    return f"{n} call{'s' if n != 1 else ''}"


def unchecked_lines(result: Comparison) -> list[str]:
    """What was not compared, as WARNING lines: pairs without a verdict (how many, the first, why), damaged lines
    of each run (calls lost), recordings that do not hold their whole run, calls past the other run's end, no pair
    compared at all; last, the runs' dtypes where they differ (what the pairs' tolerance cannot see). Empty when the
    verdict covers both runs."""
    lines = []
    rows = result.not_compared
    if rows:
        lines.append(f"WARNING: {len(rows)} aligned pair{'s' if len(rows) != 1 else ''} not compared, the first "
                     f"{where(rows[0])}: {rows[0].not_compared}")
    for label, count, first in result.unreadable():
        lines.append(f"WARNING: run {label}: {count} damaged line{'s' if count != 1 else ''} (calls not compared), "
                     f"the first {first}")
    for label, why in result.incomplete():
        lines.append(f"WARNING: run {label}'s recording is incomplete ({why})")
    for label in ("A", "B"):
        rows = [r for r in result.unreached if r.match == f"only {label}"]
        if rows:
            lines.append(f"WARNING: {_calls(len(rows))} of run {label} only not compared: what "
                         f"{'they' if len(rows) != 1 else 'it'} computed reaches no call both runs recorded, the "
                         f"first {where(rows[0])}")
    both = {r.match for r in result.past_other_run} >= {"only A", "only B"}  # both go on: neither ended first
    for label, other in (("A", "B"), ("B", "A")):
        rows = [r for r in result.past_other_run if r.match == f"only {label}"]
        if rows:
            why = (f"after the last aligned pair run {other}'s calls are others" if both
                   else f"run {other}'s recording ends before them")
            lines.append(f"WARNING: {_calls(len(rows))} of run {label} not compared: {why}, the first "
                         f"{where(rows[0])}")
    if not result.compared and not result.divergences:
        held = [sum(getattr(r, side) is not None for r in result.rows) for side in ("a", "b")]
        lines.append(f"WARNING: no pair of calls compared (run A holds {_calls(held[0])}, run B {_calls(held[1])})")
    dtypes = dtype_line(result)  # last: what the verdict could not see in the pairs it compared
    return lines + ([dtypes] if dtypes else [])


def dtype_line(result: Comparison) -> str:
    """The runs' dtypes where they differ, as a WARNING: how many aligned pairs, which dtypes, and what a verdict at
    the lower precision's tolerance cannot see; '' when the runs' dtypes are the same."""
    changed, pairs, kinds = result.dtype_changes()
    if not changed:
        return ""
    which = ", ".join(f"{a} in A against {b} in B ({n} pair{'s' if n != 1 else ''})"
                      for (a, b), n in kinds.most_common(3)) + (", ..." if len(kinds) > 3 else "")
    lowest = min((d for pair in kinds for d in pair), key=lambda d: precision_of(d) or 0)
    tolerance = result.tolerances.by_dtype[tolerance_key(precision_of(lowest))]
    return (f"WARNING: the runs' dtypes differ in {changed} of {pairs} aligned pairs ({which}): each is judged at "
            f"its lower precision's tolerance, so a difference below {lowest}'s ({tolerance:g}) cannot be seen")


def why_diverged(row: Row, growth: float) -> str:
    """Why a pair diverged, as the verdict decided (comparison._judge): what it read already differed beyond the
    tolerance before any recorded call differed (a difference from outside the recording), its outputs differ by
    more than the tolerance plus ``growth`` times what it read carried, or both."""
    allowed = row.tolerance + growth * row.carried
    budget = f"tolerance {row.tolerance:.3g} + {growth:g} x its inputs' {row.carried:.3g}"
    parts = []
    if row.inputs_differed_first:
        origin = row.origin
        source = ("no recorded call before it differed: the difference came from outside the recording (data, "
                  "weights, a call not recorded)" if origin is None else
                  "no aligned call before it differed: the difference likely came from a call of one run only "
                  f"before it, the nearest {where(origin)} (in {origin.match.removeprefix('only ')} only)")
        parts.append(f"its inputs already differed by {row.carried:.3g} ({row.carried_detail}), more than the "
                     f"tolerance {row.tolerance:.3g}, and {source}")
    if row.outputs_unexplained:
        parts.append(f"{row.detail} differs by {row.difference:.3g}, more than the {allowed:.3g} its inputs explain "
                     f"({budget})")
    else:
        parts.append(f"its {sides(row.record)[1]} differ by {row.difference:.3g}, within the {allowed:.3g} "
                     f"those inputs explain ({budget})")
    return "; ".join(parts)


def verdict_lines(result: Comparison) -> list[str]:
    """The first divergence per phase, the closest pair, the first structural difference; "none" is said only where
    every aligned pair was compared, no call lies past the other run's end and both recordings are whole
    (``unchecked_lines`` says what was not)."""
    lines = []
    recorded = result.recorded_ops()
    if recorded:  # a call one run did not record is compared only through the recorded calls that read it
        lines.append(f"recorded ops differ: {recorded}: a call one run did not record is compared only through the "
                     "calls both recorded that read what it computed")
    gaps = [what for what, present in (("damaged lines", result.unreadable()),  # calls of a phase no one knows
                                        ("an incomplete recording", result.incomplete())) if present]
    growth = result.tolerances.carried_growth
    for phase in ("forward", "backward", "optimizer"):
        row = result.first_divergence(phase)
        if row is None and phase == "optimizer" and not any(r.phase == phase for r in result.rows):
            continue
        missed = sum(r.phase == phase for r in result.not_compared)
        unpaired = sum(r.phase == phase for r in result.past_other_run)
        unreached = sum(r.phase == phase for r in result.unreached)
        why = [f"{n} {what}" for n, what in ((missed, "not compared"), (unpaired, "past the other run's end"),
                                             (unreached, "of one run only reaching no aligned call")) if n]
        why += gaps
        listed = ", and ".join([", ".join(why[:-1]), why[-1]] if len(why) > 1 else why)
        none = f"none among the pairs compared ({listed})" if why else "none"
        lines.append(f"first divergence in {phase}: " + (none if row is None else
                                                          f"{where(row)}: {why_diverged(row, growth)}"))
        if row is not None and not row.outputs_unexplained:  # where the runs part once those inputs are allowed for
            later = result.first_unexplained(phase)
            lines.append(f"first difference in {phase} that its inputs do not explain: " + (
                none if later is None else f"{where(later)}: {why_diverged(later, growth)}"))
    row = result.closest()
    if row is not None and not result.divergences:
        allowed = row.tolerance + result.tolerances.carried_growth * row.carried
        lines.append("closest to diverging: none: every pair compared is equal to the bit" if not row.difference else
                     f"closest to diverging: {where(row)}: {row.detail} at {row.difference / allowed:.2f} of what "
                     "it may differ by")
    row = result.first_structural
    lines.append("first structural difference: none" if row is None else
                 f"first structural difference: {where(row)} runs in {row.match.removeprefix('only ')} only")
    return lines


def _recomputations(result: Comparison) -> str:
    """The records the alignment left out, counted: a checkpoint's reruns of forward calls in backward."""
    counts = [result.header_a.get("recomputations", 0), result.header_b.get("recomputations", 0)]
    if not any(counts):
        return ""
    return (f"; left out: {counts[0]} recomputations in A, {counts[1]} in B (a checkpoint's reruns of forward calls, "
            "compared as their forward)")


def console_report(result: Comparison, saved: list[str]) -> str:
    counts: dict[str, int] = {}
    for row in result.rows:
        counts[row.match] = counts.get(row.match, 0) + 1
    lines = []
    for label, header in (("A", result.header_a), ("B", result.header_b)):
        complete = "" if header["complete"] else " (partial: the run did not stop its tool" + (
            "; its last line was cut short)" if header.get("cut") else ")")
        if header["complete"] and header.get("ended_by"):
            complete = f" (the run ended by {header['ended_by']})"
        lines.append(f"run {label}: {header['path']}  torch {header['torch']}{complete}")
    compared, diverged = len(result.compared), len(result.divergences)
    lines.append("aligned: " + ", ".join(f"{counts.get(m, 0)} {m}" for m in ("exact", "name", "similar"))
                 + f"; in A only: {counts.get('only A', 0)}; in B only: {counts.get('only B', 0)}; "
                 + f"compared: {compared} ({compared - diverged} agree, {diverged} diverged); "
                 + (f"skipped: {len(result.skipped)} (uninitialised memory); " if result.skipped else "")
                 + f"not compared: {len(result.not_compared)}"
                 + (f"; past the other run's end: {len(result.past_other_run)} (not compared)"
                    if result.past_other_run else "")
                 + (f"; of one run only reaching no aligned call: {len(result.unreached)} (not compared)"
                    if result.unreached else "")
                 + "".join(f"; damaged lines in {label}: {n}" for label, n, _ in result.unreadable())
                 + _recomputations(result))
    lines += verdict_lines(result)
    modules = [m for m in result.modules() if m["diverged"] or m["structural"] or m["not_compared"]]
    if modules:
        table_rows = [{**m, "module": m["module"] or "(no module)", "max_output_diff": f"{m['max_output_diff']:.3g}",
                       "max_grad_diff": f"{m['max_grad_diff']:.3g}"} for m in modules]
        lines.append("modules with divergent, unmatched or uncompared calls:")
        lines.append(reporting.table(table_rows).get_string())
    lines += [f"saved {path}" for path in saved]
    return "\n".join(lines + unchecked_lines(result))  # last: what the verdict could not cover
