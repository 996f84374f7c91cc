"""The conformance report as one self-contained HTML file: the pass-rate table, then every row in a table that
sorts by any column (click its header) and filters by status, by name, and (with ``--compare``) to the rows
where the two runs differ. A row that is a known gap (known_gaps.py) keeps its status, with a "known gap" mark and
the reason; a filter hides those rows.

The rows travel as JSON inside the page and a small script renders them, so the file needs nothing else. The
state of the filters lives in the URL fragment, e.g. ``conformance.html#status=mismatch,unsupported&sort=
device_error:desc&q=conv&gaps=0`` (``gaps=0``: known gaps hidden): a link reopens the same view (and a headless
browser can be pointed at one).
"""

from __future__ import annotations

import html
import json
import math

from .report import summary_rows
from .results import STATUSES, Row

COLUMNS = ("op", "dtype", "direction", "status", "samples", "failing", "sample", "output", "device_error",
           "cpu_error", "error_ratio", "detail", "reproduce")


def _json_value(value):
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None if math.isnan(value) else str(value)  # JSON has no nan; inf sorts as text after numbers
    return value


def render(rows: list[Row], title: str, other: list[Row] | None = None, other_label: str = "") -> str:
    """The page, as text."""
    theirs = {r.key: r for r in other} if other is not None else None
    data = []
    for row in rows:
        item = {c: _json_value(getattr(row, c)) for c in COLUMNS}
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
    summary = summary_rows(rows)
    head = "".join(f"<th>{html.escape(str(k))}</th>" for k in summary[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in line.values()) + "</tr>"
                   for line in summary)
    payload = json.dumps({"rows": data, "columns": columns, "statuses": list(STATUSES),
                          "other_label": other_label}).replace("</", "<\\/")
    known = sum(1 for r in rows if r.known_gap)
    gaps = (f"<p id='known-gaps'>{known} row{'s are' if known != 1 else ' is a'} known gap{'s' if known != 1 else ''}"
            " (marked in the table): still counted as what they are, not as passes.</p>") if known else ""
    return (_TEMPLATE.replace("__TITLE__", html.escape(title))
            .replace("__SUMMARY__", f"<table class='summary'><thead><tr>{head}</tr></thead><tbody>{body}</tbody>"
                                    f"</table>{gaps}")
            .replace("__DATA__", payload))


_TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; }
th, td { border: 1px solid #ccc; padding: 3px 7px; text-align: left; vertical-align: top; }
table.rows th { cursor: pointer; background: #f3f3f3; position: sticky; top: 0; white-space: nowrap; }
th.sorted-asc::after { content: " \\25B2"; } th.sorted-desc::after { content: " \\25BC"; }
td.detail { min-width: 24em; max-width: 48em; word-break: break-word; }
td.reproduce { min-width: 16em; max-width: 36em; } td.reproduce code { font-size: 12px; word-break: break-all; }
.status-pass td.status { background: #dff5dd; } .status-mismatch td.status { background: #ffd6d6; }
.status-unsupported td.status { background: #ffe9c7; } .status-crash td.status { background: #e6c6ff; }
.status-unchecked td.status { background: #d9d9d9; font-style: italic; }
.status-skipped td.status { background: #eee; color: #666; }
#filters label { margin-right: 1em; white-space: nowrap; } #filters { margin: 1em 0; }
span.known-gap { margin-left: 0.4em; padding: 0 4px; border-radius: 3px; background: #fff3b0; font-size: 12px; }
div.known-gap { margin-top: 0.3em; color: #555; }
</style></head>
<body>
<h1>__TITLE__</h1>
__SUMMARY__
<div id="filters"><span id="status-filters"></span>
<label id="differ-filter" hidden><input type="checkbox" id="differ"> only where the runs differ</label>
<label id="gaps-filter" hidden><input type="checkbox" id="gaps"> known gaps</label>
<label>op <input type="search" id="query" placeholder="name contains"></label>
<span id="count"></span></div>
<table class="rows"><thead><tr id="header"></tr></thead><tbody id="rows"></tbody></table>
<script type="application/json" id="data">__DATA__</script>
<script>
"use strict";
const DATA = JSON.parse(document.getElementById("data").textContent);
const state = {statuses: new Set(DATA.statuses), differ: false, query: "", sort: "", desc: false, gaps: true};
const NUMERIC = new Set(["samples", "failing", "sample", "device_error", "cpu_error", "error_ratio"]);

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

function compare(a, b) {
  const x = a[state.sort], y = b[state.sort];
  if (x === y) return 0;
  if (x === null || x === "") return 1;   // empty cells last, either way
  if (y === null || y === "") return -1;
  const order = NUMERIC.has(state.sort) && typeof x === "number" && typeof y === "number" ? x - y
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
  DATA.columns.forEach(c => {
    const th = document.createElement("th");
    th.textContent = c === "other" ? DATA.other_label : c;
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
