"""The conformance report as one self-contained HTML file: a banner fixed at the top with the verdict and the first
failure (op, dtype, phase, sample, output), the pass-rate table, then every row, failures first (then rows not
checked, skipped, passed), in a table that sorts by any column (click its header) and filters by status, by name,
and (with ``--compare``) to the rows where the two runs differ. A row that is a known gap (known_gaps.py) keeps its
status, with a "known gap" mark and the reason; a filter hides those rows. The table has a fixed layout that fits
the window (from about 1,100 px): long details and reproduce commands wrap in their cells, never past the edge.

The rows travel as JSON inside the page and a small script renders them, so the file needs nothing else. The
state of the filters lives in the URL fragment, e.g. ``conformance.html#status=mismatch,unsupported&sort=
device_error:desc&q=conv&gaps=0`` (``gaps=0``: known gaps hidden): a link reopens the same view (and a headless
browser can be pointed at one).
"""

from __future__ import annotations

import html
import json
import math
import re

from ...output.html_banner import BANNER_CSS, BANNER_SCRIPT, banner
from . import report
from .results import STATUSES, Row, measured

COLUMNS = ("op", "dtype", "direction", "status", "samples", "failing", "sample", "output", "device_error",
           "cpu_error", "error_ratio", "detail", "reproduce")


def _json_value(row: Row, column: str):
    """A cell's value as JSON has it: nan and inf as text (JSON has neither), a nan no one measured as null."""
    value = getattr(row, column)
    if isinstance(value, float) and math.isnan(value):
        return "nan" if measured(row, column) else None
    if isinstance(value, float) and math.isinf(value):
        return str(value)  # "inf": sorts as text after the numbers
    return value


def _banner(rows: list[Row], title: str) -> str:
    verdict = report.verdict(rows)
    account, *lines = report.closing_lines(rows)
    first = report.first_failure(rows)
    if verdict == "found":
        headline = lines[0]
        lines = lines[1:]  # what is left: the WARNING on rows not checked
    elif verdict == "unchecked":
        unchecked = sum(r.status == "unchecked" for r in rows)
        headline = f"{unchecked} row{'s' if unchecked != 1 else ''} not checked; none failed"
        lines = []  # the first not checked is the banner's row
    else:
        headline = "Every op that ran passed"
        lines = []
    where: dict[str, object] = {}
    if first is not None:
        where = {"op": first.op, "dtype": first.dtype, "phase": first.direction, "status": first.status,
                 "sample": first.sample, "output": first.output}
        lines = [first.detail, account, *lines]  # the detail first: it says what the fields point at
    else:
        lines = [account, *lines]
    label = "first failure" if verdict == "found" else "first not checked"
    return banner(title, headline, verdict, label, where, [line for line in lines if line])


def render(rows: list[Row], title: str, other: list[Row] | None = None, other_label: str = "") -> str:
    """The page, as text."""
    theirs = {r.key: r for r in other} if other is not None else None
    data = []
    for row in report.reading_order(rows):
        item = {c: _json_value(row, c) for c in COLUMNS}
        item["inputs"] = row.inputs
        item["known_gap"] = row.known_gap
        if theirs is not None:
            mate = theirs.get(row.key)
            item["other"] = mate.status if mate else ""
            item["other_detail"] = mate.detail if mate else ""
        data.append(item)
    columns = list(COLUMNS)
    if theirs is not None:
        columns.insert(columns.index("status") + 1, "other")
    summary = report.summary_rows(rows)
    head = "".join(f"<th>{html.escape(str(k))}</th>" for k in summary[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in line.values()) + "</tr>"
                   for line in summary)
    payload = json.dumps({"rows": data, "columns": columns, "statuses": list(STATUSES),
                          "other_label": other_label}).replace("</", "<\\/")
    known = sum(1 for r in rows if r.known_gap)
    gaps = (f"<p id='known-gaps'>{known} row{'s are' if known != 1 else ' is a'} known gap{'s' if known != 1 else ''}"
            " (marked in the table): still counted as what they are, not as passes.</p>") if known else ""
    parts = {"TITLE": html.escape(title), "BANNER_CSS": BANNER_CSS, "BANNER_SCRIPT": BANNER_SCRIPT,
             "BANNER": _banner(rows, title),
             "SUMMARY": f"<table class='summary'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{gaps}",
             "DATA": payload}
    return re.sub(r"__([A-Z_]+)__", lambda m: parts[m.group(1)], _TEMPLATE)  # one pass: no part is read twice


_TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
__BANNER_CSS__
table { border-collapse: collapse; }
th, td { border: 1px solid #ccc; padding: 3px 7px; text-align: left; vertical-align: top; }
/* a fixed layout at the window's width: the columns' widths are set, details and commands wrap inside theirs */
table.rows { table-layout: fixed; width: 100%; min-width: 1100px; font-size: 13px; }
table.rows th { cursor: pointer; background: #f3f3f3; position: sticky; top: var(--banner-height, 0px); }
table.rows td { overflow-wrap: break-word; }
th.sorted-asc::after { content: " \\25B2"; } th.sorted-desc::after { content: " \\25BC"; }
td.reproduce code { font-size: 12px; word-break: break-all; }
td.device_error, td.cpu_error, td.error_ratio { font-family: monospace; }
.status-pass td.status { background: #dff5dd; } .status-mismatch td.status { background: #ffd6d6; }
.status-unsupported td.status { background: #ffe9c7; } .status-crash td.status { background: #e6c6ff; }
.status-unchecked td.status { background: #d9d9d9; font-style: italic; }
.status-skipped td.status { background: #eee; color: #666; }
#filters label { margin-right: 1em; white-space: nowrap; } #filters { margin: 1em 0; }
span.known-gap { margin-left: 0.4em; padding: 0 4px; border-radius: 3px; background: #fff3b0; font-size: 12px; }
div.known-gap { margin-top: 0.3em; color: #555; }
</style></head>
<body>
__BANNER__
__SUMMARY__
<div id="filters"><span id="status-filters"></span>
<label id="differ-filter" hidden><input type="checkbox" id="differ"> only where the runs differ</label>
<label id="gaps-filter" hidden><input type="checkbox" id="gaps"> known gaps</label>
<label>op <input type="search" id="query" placeholder="name contains"></label>
<span id="count"></span></div>
<table class="rows"><colgroup id="widths"></colgroup><thead><tr id="header"></tr></thead><tbody id="rows"></tbody>
</table>
<script type="application/json" id="data">__DATA__</script>
<script>
"use strict";
__BANNER_SCRIPT__
const DATA = JSON.parse(document.getElementById("data").textContent);
const state = {statuses: new Set(DATA.statuses), differ: false, query: "", sort: "", desc: false, gaps: true};
const NUMERIC = new Set(["samples", "failing", "sample", "device_error", "cpu_error", "error_ratio"]);
// The columns' widths in the fixed layout; detail and reproduce share what is left.
const WIDTHS = {op: "9em", dtype: "5.4em", direction: "6.4em", status: "6.6em", other: "6em", samples: "5.4em",
  failing: "4.8em", sample: "5em", output: "6.4em", device_error: "5.8em", cpu_error: "5.8em", error_ratio: "5.8em"};

function readHash() {
  const params = new URLSearchParams(location.hash.slice(1));
  if (params.has("status")) state.statuses = new Set(params.get("status").split(",").filter(Boolean));
  state.differ = params.get("differ") === "1";
  state.query = params.get("q") || "";
  state.gaps = params.get("gaps") !== "0";
  const sort = (params.get("sort") || "").split(":");
  state.sort = sort[0] || ""; state.desc = sort[1] === "desc";
}

function writeHash() {
  const params = new URLSearchParams();
  params.set("status", [...state.statuses].join(","));
  if (state.differ) params.set("differ", "1");
  if (state.query) params.set("q", state.query);
  if (!state.gaps) params.set("gaps", "0");
  if (state.sort) params.set("sort", state.sort + (state.desc ? ":desc" : ":asc"));
  history.replaceState(null, "", "#" + params.toString());
}

// nan and inf come as text (JSON has neither): as errors, inf is above every number and nan above inf.
function rank(value) { return {"-inf": -1, "inf": 1, "nan": 2}[value] || 0; }

function compare(a, b) {
  const x = a[state.sort], y = b[state.sort];
  if (x === y) return 0;
  if (x === null || x === "") return 1;   // empty cells last, either way
  if (y === null || y === "") return -1;
  const order = NUMERIC.has(state.sort) ? rank(x) - rank(y) || (rank(x) === 0 ? x - y : 0)
    : String(x).localeCompare(String(y), undefined, {numeric: true});
  return state.desc ? -order : order;
}

function cell(row, column) {
  const td = document.createElement("td");
  td.className = column;
  const value = row[column];
  if (column === "reproduce" && value) {
    const code = document.createElement("code");
    code.textContent = value;
    td.appendChild(code);
    if (row.inputs) td.appendChild(document.createTextNode(" inputs: " + row.inputs));
  } else if (column === "other" && row.other_detail) {
    td.textContent = value; td.title = row.other_detail;
  } else if (column === "status" && row.known_gap) {
    const mark = document.createElement("span");
    mark.className = "known-gap"; mark.textContent = "known gap"; mark.title = row.known_gap;
    td.append(value, mark);
  } else if (column === "detail" && row.known_gap) {
    const why = document.createElement("div");
    why.className = "known-gap"; why.textContent = "known gap: " + row.known_gap;
    td.append(value || "", why);
  } else {
    td.textContent = value === null ? "" : (typeof value === "number" && !Number.isInteger(value)
      ? value.toPrecision(3) : String(value));
  }
  return td;
}

function render() {
  let rows = DATA.rows.filter(r => state.statuses.has(r.status)
    && (!state.differ || (r.other !== "" && r.other !== r.status))
    && (!state.query || r.op.includes(state.query))
    && (state.gaps || !r.known_gap));
  if (state.sort) rows = rows.slice().sort(compare);
  const body = document.getElementById("rows");
  body.replaceChildren(...rows.map(r => {
    const tr = document.createElement("tr");
    tr.className = "row status-" + r.status + (r.known_gap ? " known-gap" : "");
    DATA.columns.forEach(c => tr.appendChild(cell(r, c)));
    return tr;
  }));
  document.getElementById("count").textContent = `showing ${rows.length} of ${DATA.rows.length} rows`;
  document.querySelectorAll("#header th").forEach(th => {
    th.className = th.dataset.column === state.sort ? (state.desc ? "sorted-desc" : "sorted-asc") : "";
  });
  writeHash();
}

function build() {
  const header = document.getElementById("header");
  const widths = document.getElementById("widths");
  DATA.columns.forEach(c => {
    const col = document.createElement("col");
    if (WIDTHS[c]) col.style.width = WIDTHS[c];
    widths.appendChild(col);
    const th = document.createElement("th");
    th.textContent = c === "other" ? DATA.other_label : c.replace(/_/g, "_\\u200b");  // "device_error" may wrap
    th.dataset.column = c;
    th.addEventListener("click", () => {
      state.desc = state.sort === c ? !state.desc : false; state.sort = c; render();
    });
    header.appendChild(th);
  });
  const counts = {};
  DATA.rows.forEach(r => { counts[r.status] = (counts[r.status] || 0) + 1; });
  const filters = document.getElementById("status-filters");
  DATA.statuses.forEach(s => {
    const label = document.createElement("label");
    const box = document.createElement("input");
    box.type = "checkbox"; box.id = "show-" + s; box.defaultChecked = state.statuses.has(s);
    box.addEventListener("change", () => { box.checked ? state.statuses.add(s) : state.statuses.delete(s); render(); });
    label.append(box, ` ${s} (${counts[s] || 0})`);
    filters.appendChild(label);
  });
  const differ = document.getElementById("differ");
  if (DATA.columns.includes("other")) document.getElementById("differ-filter").hidden = false;
  differ.checked = state.differ;
  differ.addEventListener("change", () => { state.differ = differ.checked; render(); });
  const gaps = document.getElementById("gaps");
  const known = DATA.rows.filter(r => r.known_gap).length;
  if (known) {
    document.getElementById("gaps-filter").hidden = false;
    gaps.parentElement.lastChild.textContent = ` known gaps (${known})`;
  }
  gaps.defaultChecked = state.gaps;  // an attribute, so that the page's state shows in its DOM
  gaps.addEventListener("change", () => { state.gaps = gaps.checked; render(); });
  const query = document.getElementById("query");
  query.value = state.query;
  query.addEventListener("input", () => { state.query = query.value; render(); });
}

readHash();
build();
render();
</script>
</body></html>
"""
