"""The comparison as one self-contained HTML file: the two runs side by side, aligned, one block per module.

Run A's calls on the left, run B's on the right, each aligned pair on one line with its difference and tolerance;
a call of one run only leaves the other side empty. Consecutive calls of one module (in one step and phase) form
a block whose header collapses it. Divergent pairs are red, the first divergence is outlined and scrolled to,
structural differences are yellow, pairs not compared grey with their reason. The rows travel as JSON inside the
page and a small script renders them: the file needs nothing else (no network, no external script or style).
"""

from __future__ import annotations

import html
import json
import math

from .alignment import PHASE_SIDES, Row
from .comparison import Comparison
from .report import unchecked_lines, verdict_lines


def _side(record: dict | None) -> dict | None:
    if record is None:
        return None
    into, out_of = PHASE_SIDES[record["phase"]]
    return {"op": record["op"], "index": record["index"], "seq": record["seq"], "device": record["device"],
            "in": [t[:3] for t in record.get(into, ())], "out": [t[:3] for t in record.get(out_of, ())]}


def _number(value: float):
    return None if math.isnan(value) else ("inf" if math.isinf(value) else float(f"{value:.3g}"))


def _row(row: Row, n: int) -> dict:
    return {"n": n, "step": row.step, "phase": row.phase, "module": row.module, "match": row.match,
            "a": _side(row.a), "b": _side(row.b), "difference": _number(row.difference),
            "tolerance": _number(row.tolerance), "carried": _number(row.carried), "diverged": row.diverged,
            "detail": row.not_compared or row.verdict_detail, "unchecked": bool(row.not_compared)}


def render(result: Comparison) -> str:
    """The page, as text."""
    first = result.first_divergence()
    payload = {
        "rows": [_row(row, n) for n, row in enumerate(result.rows)],
        "first": None if first is None else result.rows.index(first),
        "growth": result.tolerances.carried_growth,
    }
    data = json.dumps(payload, separators=(",", ":")).replace("</", "<\\/")
    runs = "".join(f"<li><b>{label}</b>: {html.escape(h['path'])} (torch {html.escape(h['torch'])})</li>"
                   for label, h in (("A", result.header_a), ("B", result.header_b)))
    verdicts = "".join(f"<li>{html.escape(line)}</li>" for line in verdict_lines(result) + unchecked_lines(result))
    return (_TEMPLATE.replace("__RUNS__", runs).replace("__VERDICTS__", verdicts).replace("__DATA__", data))


_TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>compare_runs</title>
<style>
body { font: 13px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; width: 100%; }
th, td { border: 1px solid #ddd; padding: 2px 6px; text-align: left; vertical-align: top; }
thead th { background: #f3f3f3; position: sticky; top: 0; }
td.tensors { font-family: monospace; font-size: 12px; color: #555; }
td.diff { white-space: nowrap; font-family: monospace; }
tr.block td { background: #eef2f8; cursor: pointer; font-weight: 600; }
tr.block.has-divergence td { background: #f8dede; }
tbody.collapsed tr.call { display: none; }
tr.call.diverged td { background: #ffd6d6; }
tr.call.first td { outline: 2px solid #c00; }
tr.call.structural td { background: #fff3c4; }
tr.call.unchecked td { background: #e4e4e4; font-style: italic; }
td.missing { background: #fafafa !important; color: #aaa; }
#controls { margin: 0.8em 0; } #controls button { margin-right: 0.5em; }
</style></head>
<body>
<h1>Two runs side by side</h1>
<ul>__RUNS__</ul>
<ul id="verdicts">__VERDICTS__</ul>
<div id="controls"><button id="collapse">collapse all</button><button id="expand">expand all</button>
<button id="focus">only blocks with differences</button> <a href="#first-divergence">first divergence</a>
<span id="count"></span></div>
<table id="rows"><thead><tr><th>run A</th><th>A tensors</th><th>difference / tolerance</th><th>run B</th>
<th>B tensors</th><th>detail</th></tr></thead></table>
<script type="application/json" id="data">__DATA__</script>
<script>
"use strict";
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

let block = null, key = null, shown = 0;
const blocks = [];
for (const row of data.rows) {
  const rowKey = row.step + "|" + row.phase + "|" + row.module;
  if (rowKey !== key) {
    key = rowKey;
    block = document.createElement("tbody");
    block.className = "module";
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
  const structural = !row.a || !row.b;
  if (structural) tr.classList.add("structural");
  if (row.diverged) tr.classList.add("diverged");
  if (row.unchecked) tr.classList.add("unchecked");
  if (row.n === data.first) { tr.classList.add("first"); tr.id = "first-divergence"; }
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
  shown += 1;
}
document.getElementById("count").textContent = shown + " rows in " + blocks.length + " blocks";
document.getElementById("collapse").onclick = () => blocks.forEach(b => b.classList.add("collapsed"));
document.getElementById("expand").onclick = () => blocks.forEach(b => b.classList.remove("collapsed"));
document.getElementById("focus").onclick = () => blocks.forEach(
    b => b.classList.toggle("collapsed", b.dataset.differences === "0"));
const first = document.getElementById("first-divergence");
if (first) first.scrollIntoView({block: "center"});
</script>
</body></html>
"""
