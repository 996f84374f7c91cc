"""The run report as one self-contained HTML file: the verdict, a card per rank, the replicas, the time skew, the
training monitor's anomalies.

A banner that stays at the top of the window holds the verdict and what is known of the first anomaly: its rank,
step, module, op, phase, the tool that found it and its source line. Each rank's card is coloured by what it was:
where the fault was born (red), where it arrived through a collective (orange, naming the collective and the
sending rank), clean (green), with the source line of its first anomaly where the tool kept one. The replica check
names the first step and parameter where ranks disagreed. The skew is a bar per rank and step, the slowest rank's
marked, with its costliest ops. TrainingMonitor's anomalies are a table, one row each, in the order they came, and
a link leads to the monitor's own page when the results folder holds one. A section with nothing to show says why
in a line instead of an empty table. The rows travel as JSON inside the page and a small script renders them: the
file needs nothing else (no network, no external script or style).
"""

from __future__ import annotations

import html
import json
import re
import urllib.parse

from ...output.html_banner import BANNER_CSS, BANNER_SCRIPT, banner
from .analysis import RunReport
from .readers import MONITOR, TIME_FOLDER, TIME_MEASURE, Event
from .report import MONITOR_COLUMNS, monitor_rows, read_lines, verdict_line


def first_facts(report: RunReport) -> list[tuple[str, str]]:
    """(name, value) of what is known of what went wrong first: the first origin's anomaly, else the replicas'
    first disagreement, else the first rank that received a fault; [] for a clean run."""
    if report.first is not None and report.first.first is not None:
        return _event_facts(report.first.first)
    if report.desync is not None:
        d = report.desync
        facts = [("ranks", ", ".join(map(str, sorted(d.checksums)))), ("step", str(d.step)), (d.what, d.name)]
        return facts + ([("session", d.session)] if d.session else [])
    received = next((r for r in report.ranks if r.status == "received"), None)
    if received is not None:
        event = received.first or received.through
        return [("rank", str(received.rank))] + (_event_facts(event)[1:] if event is not None else [])
    return []


def _event_facts(event: Event) -> list[tuple[str, str]]:
    facts = [("rank", str(event.rank)), ("step", str(event.step)), ("module", event.module), ("op", event.op),
             ("phase", event.phase), ("found by", event.tool), ("source", event.location)]
    return [(name, value) for name, value in facts if value]


def skew_absent(report: RunReport) -> str:
    """Why the report has no time skew to show (it compares ranks' times at a step); "" where it has some."""
    if report.skew:
        return ""
    results = report.results
    if TIME_MEASURE not in results.tools:
        return f"not measured: OpTimeMeasure did not run ({TIME_FOLDER}/ is not in the folder)"
    if results.times_unmatched:
        return f"nothing to compare: {results.times_unmatched}"
    timed = sorted({rank for times in results.times for rank in times})
    if len(timed) < 2:
        ranks = f"only rank {timed[0]}'s calls were" if timed else "no rank's calls were"
        return f"nothing to compare: {ranks} timed, and the skew compares ranks"
    return f"nothing to compare: ranks {', '.join(map(str, timed))} timed their calls, but no step on two of them"


# the banner's tone per verdict: unread (a clean verdict not earned) is amber, as the other pages' unchecked
_TONES = {"found": "found", "unread": "unchecked", "clean": "clean"}


def _banner(report: RunReport) -> str:
    label = ("first anomaly" if report.first is not None else "first disagreement" if report.desync is not None
             else "first received")
    return banner("op_tools run report", verdict_line(report), _TONES[report.verdict()], label,
                  dict(first_facts(report)), [])


def render(report: RunReport, monitor_page: str | None = None) -> str:
    """The page, as text; ``monitor_page``: TrainingMonitor's page, relative to where this one is written."""
    ranks = [{"rank": a.rank, "status": a.status, "text": a.text(),
              "step": a.first.step if a.first else (a.through.step if a.through else None),
              "source": a.first.location if a.first else ""} for a in report.ranks]
    skew = [{"step": s.label if s.session else s.step, "slowest": s.slowest,
             "ms": {str(r): round(ms, 3) for r, ms in sorted(s.ms.items())},
             "top": [[op, round(ms, 3)] for op, ms in s.top_ops]} for s in report.skew]
    replicas = report.replicas_text()
    monitor = ("no anomaly" if MONITOR in report.results.tools else "not run (no op_training_monitor/)")
    # values travel as text: JSON has no NaN or Infinity
    payload = {"ranks": ranks, "skew": skew, "skew_none": skew_absent(report), "replicas": replicas,
               "desync": report.desync is not None or report.nonfinite is not None,
               "first": report.first.rank if report.first else None,
               "monitor": monitor_rows(report), "monitor_columns": MONITOR_COLUMNS, "monitor_none": monitor}
    data = json.dumps(payload, separators=(",", ":")).replace("</", "<\\/")
    read = "".join(f"<li>{html.escape(line)}</li>" for line in read_lines(report))
    link = (f'<p id="monitor-link">TrainingMonitor\'s own page (curves, gradient heatmap): <a href="'
            f'{html.escape(urllib.parse.quote(monitor_page))}">{html.escape(monitor_page)}</a></p>'
            if monitor_page else "")
    parts = {"FOLDER": html.escape(report.results.folder), "BANNER_CSS": BANNER_CSS, "BANNER_SCRIPT": BANNER_SCRIPT,
             "BANNER": _banner(report), "MONITOR_LINK": link, "READ": read, "DATA": data}
    return re.sub(r"__([A-Z_]+)__", lambda m: parts[m.group(1)], _TEMPLATE)  # one pass: no part is read twice


_TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>op_tools run report</title>
<style>
html { scroll-padding-top: var(--banner-height, 6em); }  /* an anchor jumped to lands below the banner */
body { font: 13px/1.4 system-ui, sans-serif; margin: 0 1.5em 1.5em; color: #222; }
__BANNER_CSS__
#ranks { display: flex; flex-wrap: wrap; gap: 0.6em; margin: 1em 0; }
.rank { border: 1px solid #ccc; border-radius: 4px; padding: 0.5em 0.7em; width: 26em; }
.rank.origin { background: #ffd6d6; border-color: #c00; } .rank.received { background: #ffe8c8; }
.rank.clean { background: #eef8ef; } .rank .label { font-weight: 600; }
.rank .source { font-family: ui-monospace, monospace; font-size: 12px; margin-top: 0.3em;
  overflow-wrap: anywhere; }
#replicas.desync { background: #ffd6d6; padding: 0.3em 0.6em; }
.none { color: #666; }
table { border-collapse: collapse; } th, td { border: 1px solid #ddd; padding: 2px 6px; text-align: left; }
td.bar div { background: #7aa6d8; height: 10px; } tr.slowest td.bar div { background: #d8893c; }
</style></head>
<body>
__BANNER__
<p>__FOLDER__</p>
<ul>__READ__</ul>
<h2>Ranks</h2><div id="ranks"></div>
<h2>Replicas</h2><p id="replicas"></p>
<h2>Time per step</h2><div id="skew-section"></div>
<h2>Training monitor</h2>__MONITOR_LINK__<div id="monitor-section"></div>
<script type="application/json" id="data">__DATA__</script>
<script>
"use strict";
__BANNER_SCRIPT__
const data = JSON.parse(document.getElementById("data").textContent);
function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined) e.textContent = text;
  if (cls) e.className = cls;
  return e;
}
function row(cells, cls) {
  const tr = el("tr", undefined, cls);
  for (const cell of cells) tr.append(typeof cell === "string" ? el("td", cell) : cell);
  return tr;
}
const ranks = document.getElementById("ranks");
for (const r of data.ranks) {
  const card = el("div", undefined, "rank " + r.status);
  card.id = "rank-" + r.rank;
  card.append(el("div", "rank " + r.rank + ": " + r.status + (r.rank === data.first ? " (first)" : ""), "label"),
              el("div", r.text, "text"));
  if (r.source) card.append(el("div", r.source, "source"));
  ranks.append(card);
}
const replicas = document.getElementById("replicas");
replicas.textContent = data.replicas;
if (data.desync) replicas.className = "desync";
// a section with no rows says why in a line: an empty table's header tells nothing
const skewSection = document.getElementById("skew-section");
if (data.skew.length) {
  const table = el("table");
  table.id = "skew";
  const head = el("thead");
  head.innerHTML = '<tr><th>step</th><th>rank</th><th colspan="2">ms in the timed calls</th>'
      + "<th>the slowest rank's costliest ops</th></tr>";
  table.append(head);
  const longest = Math.max(1e-9, ...data.skew.flatMap(s => Object.values(s.ms)));
  for (const s of data.skew) {
    const body = el("tbody");
    for (const [rank, ms] of Object.entries(s.ms)) {
      const bar = el("td", undefined, "bar");
      const fill = el("div");
      fill.style.width = Math.round(200 * ms / longest) + "px";
      bar.append(fill);
      const slowest = Number(rank) === s.slowest;
      body.append(row([String(s.step), rank, ms.toFixed(2), bar,
                       slowest ? s.top.map(t => t[0] + " " + t[1].toFixed(2) + " ms").join(", ") : ""],
                      slowest ? "slowest" : ""));
    }
    table.append(body);
  }
  skewSection.append(table);
} else {
  skewSection.append(el("p", data.skew_none, "none"));
}
const monitorSection = document.getElementById("monitor-section");
if (data.monitor.length) {
  const table = el("table");
  table.id = "monitor";
  const head = el("tr");
  for (const column of data.monitor_columns) head.append(el("th", column));
  table.append(head);
  for (const r of data.monitor) {
    table.append(row(data.monitor_columns.map(column => String(r[column])), "anomaly " + r.rule));
  }
  monitorSection.append(table);
} else {
  const none = el("p", data.monitor_none, "none");
  none.id = "monitor-none";
  monitorSection.append(none);
}
</script>
</body></html>
"""
