"""The run report as one self-contained HTML file: the verdict, a card per rank, the replicas, the time skew, the
training monitor's anomalies.

Each rank's card is coloured by what it was: where the fault was born (red), where it arrived through a collective
(orange, naming the collective and the sending rank), clean (green). The replica check names the first step and
parameter where ranks disagreed. The skew is a bar per rank and step, the slowest rank's marked, with its
costliest ops. TrainingMonitor's anomalies are a table, one row each, in the order they came. The rows travel as
JSON inside the page and a small script renders them: the file needs nothing else (no network, no external script
or style).
"""

from __future__ import annotations

import html
import json

from .analysis import RunReport
from .readers import MONITOR
from .report import MONITOR_COLUMNS, monitor_rows, read_lines, verdict_line


def render(report: RunReport) -> str:
    ranks = [{"rank": a.rank, "status": a.status, "text": a.text(),
              "step": a.first.step if a.first else (a.through.step if a.through else None)} for a in report.ranks]
    skew = [{"step": s.step, "slowest": s.slowest, "ms": {str(r): round(ms, 3) for r, ms in sorted(s.ms.items())},
             "top": [[op, round(ms, 3)] for op, ms in s.top_ops]} for s in report.skew]
    replicas = report.replicas_text()
    monitor = ("no anomaly" if MONITOR in report.results.tools else "not run (no op_training_monitor/)")
    # values travel as text: JSON has no NaN or Infinity
    payload = {"ranks": ranks, "skew": skew, "replicas": replicas,
               "desync": report.desync is not None or report.nonfinite is not None,
               "first": report.first.rank if report.first else None, "monitor": monitor_rows(report),
               "monitor_columns": MONITOR_COLUMNS, "monitor_none": monitor}
    data = json.dumps(payload, separators=(",", ":")).replace("</", "<\\/")
    read = "".join(f"<li>{html.escape(line)}</li>" for line in read_lines(report))
    return (_TEMPLATE.replace("__FOLDER__", html.escape(report.results.folder))
            .replace("__VERDICT__", html.escape(verdict_line(report)))
            .replace("__VERDICT_CLASS__", report.verdict())
            .replace("__READ__", read).replace("__DATA__", data))


_TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>op_tools run report</title>
<style>
body { font: 13px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
#verdict { font-size: 15px; font-weight: 600; padding: 0.5em 0.8em; border-radius: 4px; }
#verdict.found { background: #ffd6d6; } #verdict.clean { background: #d8f3dc; }
#verdict.unread { background: #fff0c2; }
#ranks { display: flex; flex-wrap: wrap; gap: 0.6em; margin: 1em 0; }
.rank { border: 1px solid #ccc; border-radius: 4px; padding: 0.5em 0.7em; width: 26em; }
.rank.origin { background: #ffd6d6; border-color: #c00; } .rank.received { background: #ffe8c8; }
.rank.clean { background: #eef8ef; } .rank .label { font-weight: 600; }
#replicas.desync { background: #ffd6d6; padding: 0.3em 0.6em; }
table { border-collapse: collapse; } th, td { border: 1px solid #ddd; padding: 2px 6px; text-align: left; }
td.bar div { background: #7aa6d8; height: 10px; } tr.slowest td.bar div { background: #d8893c; }
</style></head>
<body>
<h1>Run report</h1>
<p>__FOLDER__</p>
<div id="verdict" class="__VERDICT_CLASS__">__VERDICT__</div>
<ul>__READ__</ul>
<h2>Ranks</h2><div id="ranks"></div>
<h2>Replicas</h2><p id="replicas"></p>
<h2>Time per step</h2><table id="skew"><thead><tr><th>step</th><th>rank</th><th>ms</th><th></th>
<th>the slowest rank's costliest ops</th></tr></thead></table>
<h2>Training monitor</h2><p id="monitor-none"></p><table id="monitor"></table>
<script type="application/json" id="data">__DATA__</script>
<script>
"use strict";
const data = JSON.parse(document.getElementById("data").textContent);
function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined) e.textContent = text;
  if (cls) e.className = cls;
  return e;
}
const ranks = document.getElementById("ranks");
for (const r of data.ranks) {
  const card = el("div", undefined, "rank " + r.status);
  card.id = "rank-" + r.rank;
  card.append(el("div", "rank " + r.rank + ": " + r.status + (r.rank === data.first ? " (first)" : ""), "label"),
              el("div", r.text, "text"));
  ranks.append(card);
}
const replicas = document.getElementById("replicas");
replicas.textContent = data.replicas;
if (data.desync) replicas.className = "desync";
const table = document.getElementById("skew");
const longest = Math.max(1e-9, ...data.skew.flatMap(s => Object.values(s.ms)));
for (const s of data.skew) {
  const body = el("tbody");
  for (const [rank, ms] of Object.entries(s.ms)) {
    const tr = el("tr", undefined, Number(rank) === s.slowest ? "slowest" : "");
    const bar = el("td", undefined, "bar");
    const fill = el("div");
    fill.style.width = Math.round(200 * ms / longest) + "px";
    bar.append(fill);
    tr.append(el("td", String(s.step)), el("td", rank), el("td", ms.toFixed(2)), bar,
              el("td", Number(rank) === s.slowest ? s.top.map(t => t[0] + " " + t[1].toFixed(2) + " ms").join(", ")
                 : ""));
    body.append(tr);
  }
  table.append(body);
}
const monitor = document.getElementById("monitor");
if (data.monitor.length) {
  const head = el("tr");
  for (const column of data.monitor_columns) head.append(el("th", column));
  monitor.append(head);
  for (const row of data.monitor) {
    const tr = el("tr", undefined, "anomaly " + row.rule);
    for (const column of data.monitor_columns) tr.append(el("td", String(row[column])));
    monitor.append(tr);
  }
} else {
  document.getElementById("monitor-none").textContent = data.monitor_none;
}
</script>
</body></html>
"""
