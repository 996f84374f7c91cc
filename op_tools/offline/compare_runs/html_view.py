"""The comparison as one self-contained HTML file: the two runs side by side, aligned, one block per module.

A banner fixed at the top says the verdict (the runs diverge, agree, or were not all compared) and where the first
difference is: rank, step, phase, module and op. Below it, the verdict's lines, then run A's calls on the left and
run B's on the right, each aligned pair on one line with its difference and tolerance; a call of one run only
leaves the other side empty. Consecutive calls of one module (in one step and phase) form a block whose header
collapses it; the page opens with every block collapsed but the first difference's, and does not scroll: the
banner's button goes to that row. Divergent pairs are red, the first difference is outlined, structural
differences are yellow, pairs not compared grey with their reason; "only blocks with differences" hides the other
blocks, headers too. The rows travel as JSON inside the page and a small script renders them: the file needs
nothing else (no network, no external script or style).
"""

from __future__ import annotations

import html
import json
import math
import re

from ...output.html_banner import BANNER_CSS, BANNER_SCRIPT, banner
from .alignment import Row, sides
from .comparison import Comparison
from .report import unchecked_lines, verdict_lines, why_diverged


def _side(record: dict | None) -> dict | None:
    if record is None:
        return None
    into, out_of = sides(record)
    return {"op": record["op"], "index": record["index"], "seq": record["seq"], "device": record["device"],
            "in": [t[:3] for t in record.get(into, ())], "out": [t[:3] for t in record.get(out_of, ())]}


def _number(value: float):
    return None if math.isnan(value) else ("inf" if math.isinf(value) else float(f"{value:.3g}"))


def _row(row: Row, n: int) -> dict:
    return {"n": n, "step": row.step, "phase": row.phase, "module": row.module, "match": row.match,
            "a": _side(row.a), "b": _side(row.b), "difference": _number(row.difference),
            "tolerance": _number(row.tolerance), "carried": _number(row.carried), "diverged": row.diverged,
            "detail": row.not_compared or row.no_counterpart or row.unreached or row.verdict_detail,
            "unchecked": bool(row.not_compared or row.no_counterpart or row.unreached)}


def first_difference(result: Comparison) -> tuple[Row | None, str]:
    """The row the banner names and the page opens on, with what it is: the first divergence, else the first pair
    not compared, else the first call past the other run's end, else the first structural difference;
    ``(None, "")`` when the runs match call for call."""
    for row, what in ((result.first_divergence(), "first divergence"),
                      (next(iter(result.not_compared), None), "first pair not compared"),
                      (next(iter(result.past_other_run), None), "first call not compared"),
                      (next(iter(result.unreached), None), "first call not compared"),
                      (result.first_structural, "first structural difference")):
        if row is not None:
            return row, what
    return None, ""


def _rank(result: Comparison) -> str | None:
    """The ranks compared (``0``, or ``A 0, B 1``), None for recordings made without torchrun."""
    a, b = result.header_a.get("rank"), result.header_b.get("rank")
    if a is None and b is None:
        return None
    return str(a) if a == b else f"A {a}, B {b}"


def headline(result: Comparison) -> tuple[str, str]:
    """``(the verdict in a sentence, its tone)``: one per ``Comparison.verdict()``."""
    compared, diverged = len(result.compared), len(result.divergences)
    pairs = f"{compared} compared pair{'s' if compared != 1 else ''}"
    verdict = result.verdict()
    if verdict == "found":
        return f"The runs diverge: {diverged} of {pairs} diverged", verdict
    if verdict == "unchecked":
        missed = len(result.not_compared)
        damaged = sum(n for _, n, _ in result.unreadable())
        unpaired = len(result.past_other_run)
        unreached = len(result.unreached)
        also = "".join(f", {n} {what}" for n, what in ((missed, "not compared"), (unpaired, "past the other run's end"),
                                                       (unreached, "of one run only reaching no aligned call"),
                                                       (damaged, "damaged lines")) if n)
        also += "".join(f", run {label}'s recording incomplete" for label, _ in result.incomplete())
        return f"No divergence among the {pairs}, but not all were compared{also}", verdict
    changed = result.dtype_changes()[0]
    dtypes = f", at the lower precision's tolerance where the dtypes differ ({changed} pairs)" if changed else ""
    return f"The runs agree: none of the {pairs} diverges{dtypes}", verdict


def _banner(result: Comparison, first: Row | None, what: str) -> str:
    title = "compare_runs: two runs side by side"
    text, tone = headline(result)
    where: dict[str, object] = {}
    lines = []
    if first is not None:
        record = first.record
        where = {"rank": _rank(result), "step": first.step, "phase": first.phase,
                 "module": first.module or "(no module)", "op": f"{record['op']} #{record['index']}"}
        if first.diverged:
            lines.append("why: " + why_diverged(first, result.tolerances.carried_growth))
        elif first.not_compared or first.no_counterpart or first.unreached:
            lines.append("why: " + (first.not_compared or first.no_counterpart or first.unreached))
        else:
            lines.append(f"runs in {first.match.removeprefix('only ')} only")
    return banner(title, text, tone, what, where, lines, button="show it")


def _verdict_table(result: Comparison) -> str:
    """The runs, then the verdict's lines (the console's), as label and text: the first divergence per phase, the
    first structural difference, the WARNINGs."""
    cells = [f"<tr><th>run {label}</th><td>{html.escape(h['path'])} (torch {html.escape(h['torch'])})</td></tr>"
             for label, h in (("A", result.header_a), ("B", result.header_b))]
    for line in verdict_lines(result) + unchecked_lines(result):
        label, _, text = line.partition(": ")
        cells.append(f"<tr><th>{html.escape(label)}</th><td>{html.escape(text)}</td></tr>")
    return "".join(cells)


def render(result: Comparison) -> str:
    """The page, as text."""
    first, what = first_difference(result)
    payload = {
        "rows": [_row(row, n) for n, row in enumerate(result.rows)],
        "first": None if first is None else result.rows.index(first),
        "growth": result.tolerances.carried_growth,
    }
    data = json.dumps(payload, separators=(",", ":")).replace("</", "<\\/")
    parts = {"BANNER_CSS": BANNER_CSS, "BANNER_SCRIPT": BANNER_SCRIPT, "BANNER": _banner(result, first, what),
             "VERDICTS": _verdict_table(result), "DATA": data}
    return re.sub(r"__([A-Z_]+)__", lambda m: parts[m.group(1)], _TEMPLATE)  # one pass: no part is read twice


_TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>compare_runs</title>
<style>
body { font: 13px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
__BANNER_CSS__
table { border-collapse: collapse; width: 100%; }
th, td { border: 1px solid #ddd; padding: 2px 6px; text-align: left; vertical-align: top; }
table.verdicts { margin: 0.5em 0; } table.verdicts th { white-space: nowrap; background: #f7f7f7; width: 1%; }
#rows thead th { background: #f3f3f3; position: sticky; top: var(--banner-height, 0px); z-index: 1; }
td.tensors { font-family: monospace; font-size: 12px; color: #555; }
td.diff { white-space: nowrap; font-family: monospace; }
tr.block td { background: #eef2f8; cursor: pointer; font-weight: 600; }
tr.block td::before { content: "\\25BE  "; } tbody.collapsed tr.block td::before { content: "\\25B8  "; }
tr.block.has-divergence td { background: #f8dede; }
tbody.collapsed tr.call { display: none; }
table.only-differences tbody.clean { display: none; }
tr.call { scroll-margin-top: calc(var(--banner-height, 0px) + 3em); }
tr.call.diverged td { background: #ffd6d6; }
tr.call.first td { outline: 2px solid #c00; }
tr.call.structural td { background: #fff3c4; }
tr.call.unchecked td { background: #e4e4e4; font-style: italic; }
td.missing { background: #fafafa !important; color: #aaa; }
#controls { margin: 0.8em 0; } #controls button { margin-right: 0.5em; }
#focus[aria-pressed="true"] { background: #dde6f5; }
</style></head>
<body>
__BANNER__
<table class="verdicts" id="verdicts">__VERDICTS__</table>
<div id="controls"><button id="collapse">collapse all</button><button id="expand">expand all</button>
<button id="focus" aria-pressed="false">only blocks with differences</button>
<span id="count"></span></div>
<table id="rows"><thead><tr><th>run A</th><th>A tensors</th><th>difference / tolerance</th><th>run B</th>
<th>B tensors</th><th>detail</th></tr></thead></table>
<script type="application/json" id="data">__DATA__</script>
<script>
"use strict";
__BANNER_SCRIPT__
const data = JSON.parse(document.getElementById("data").textContent);
const table = document.getElementById("rows");

function cell(text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}
function shape(t) { return t[0] + " " + t[1] + "[" + t[2].join(",") + "]"; }
function sideCells(tr, side) {
  if (!side) { tr.append(cell("", "missing"), cell("", "missing")); return; }
  tr.append(cell(side.op + " #" + side.index + " (" + side.device + ")", "op"),
            cell(side.in.map(shape).join("  ") + " \u2192 " + side.out.map(shape).join("  "), "tensors"));
}

let block = null, key = null, firstBlock = null;
const blocks = [];
for (const row of data.rows) {
  const rowKey = row.step + "|" + row.phase + "|" + row.module;
  if (rowKey !== key) {
    key = rowKey;
    block = document.createElement("tbody");
    block.className = "module collapsed";  // every block starts collapsed; the first difference's opens below
    const head = document.createElement("tr");
    head.className = "block";
    const td = cell("step " + row.step + " " + row.phase + " " + (row.module || "(no module)"));
    td.colSpan = 6;
    head.append(td);
    head.addEventListener("click", () => head.parentElement.classList.toggle("collapsed"));
    block.append(head);
    block.dataset.differences = "0";
    table.append(block);
    blocks.push(block);
  }
  const tr = document.createElement("tr");
  tr.className = "call";
  tr.id = "row-" + row.n;
  const structural = (!row.a || !row.b) && !row.unchecked;  // past the other run's end: not compared
  if (structural) tr.classList.add("structural");
  if (row.diverged) tr.classList.add("diverged");
  if (row.unchecked) tr.classList.add("unchecked");
  if (row.n === data.first) { tr.classList.add("first"); tr.id = "first-difference"; firstBlock = block; }
  sideCells(tr, row.a);
  const diff = structural ? row.match : row.unchecked ? "not compared"
      : (row.difference === null ? "nan" : row.difference) + " / "
      + (row.tolerance + data.growth * row.carried).toPrecision(3);
  tr.append(cell(diff, "diff"));
  sideCells(tr, row.b);
  tr.append(cell(row.detail, "detail"));
  block.append(tr);
  if (structural || row.diverged || row.unchecked) {
    block.dataset.differences = String(Number(block.dataset.differences) + 1);
    if (row.diverged) block.firstChild.classList.add("has-divergence");
  }
}
const differing = blocks.filter(b => b.dataset.differences !== "0");
blocks.forEach(b => b.classList.toggle("clean", b.dataset.differences === "0"));
if (firstBlock) firstBlock.classList.remove("collapsed");
document.getElementById("count").textContent = data.rows.length + " rows in " + blocks.length + " blocks, "
    + differing.length + " with differences";
document.getElementById("collapse").onclick = () => blocks.forEach(b => b.classList.add("collapsed"));
document.getElementById("expand").onclick = () => blocks.forEach(b => b.classList.remove("collapsed"));
const focus = document.getElementById("focus");
focus.onclick = () => {
  const on = table.classList.toggle("only-differences");
  focus.setAttribute("aria-pressed", String(on));
  if (on) differing.forEach(b => b.classList.remove("collapsed"));
};
const go = document.getElementById("go-first");
if (go) go.onclick = () => {  // on request only: the page opens at the top, on the banner
  table.classList.remove("only-differences");
  focus.setAttribute("aria-pressed", "false");
  firstBlock.classList.remove("collapsed");
  document.getElementById("first-difference").scrollIntoView({block: "start"});
};
</script>
</body></html>
"""
