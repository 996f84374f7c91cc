"""The TrainingMonitor page (op_tools/offline/monitor_page.py), on files written in the monitor's format
(docs/tools/training_monitor.md): the reader and its errors, the layer grouping, a long run thinned, several ranks,
and the page opened in a real headless browser."""

from __future__ import annotations

import csv
import json
import math
import os
import re
from html.parser import HTMLParser

import pytest
from browser import chromium, dump_dom, needs_browser, open_once, require_browser, top_rows
from handmade_results import LAYERS, NAN_PARAMETER, NAN_STEP, STEPS, nan_spreading_run, write_session

from op_tools.offline.monitor_page import (
    CURVE_POINTS,
    HEATMAP_COLUMNS,
    STILL_NONFINITE,
    WENT_NONFINITE,
    layer_grad_norms,
    layer_of,
    log_scale,
    nonfinite_states,
    read_monitor,
    render_page,
    write_monitor_page,
)

COLUMNS = ("rank", "step", "time", "kind", "name", "statistic", "value")
T0 = 1_700_000_000.0


def parameters(layers: int) -> list[str]:
    inside = [f"model.layers.{k}.{p}.weight" for k in range(layers) for p in ("self_attn.q_proj", "mlp.down_proj")]
    return ["model.embed_tokens.weight", *inside, "model.norm.weight", "lm_head.weight"]


def grad_norm(name: str, step: int) -> float:
    """Decades apart per layer, growing with the step; NaN for one parameter at step 6."""
    if name == "model.layers.1.mlp.down_proj.weight" and step == 6:
        return math.nan
    depth = int(name.split(".")[2]) if ".layers." in name else 0
    return 10.0 ** -depth * (1 + 0.1 * step) * (2 if "down_proj" in name else 1)


def write_run(folder, layers: int = 2, steps: int = 10, rank: int | None = None, session: str = "pid1_s_1",
              anomalies: list[dict] | None = None) -> str:
    """``monitor_<session>.csv`` and ``anomalies_<session>.jsonl`` as TrainingMonitor writes them; the CSV's path."""
    os.makedirs(folder, exist_ok=True)
    names = parameters(layers)
    path = os.path.join(folder, f"monitor_{session}.csv")
    with open(path, "w", newline="", encoding="utf-8") as f:
        out = csv.writer(f)
        out.writerow(COLUMNS)
        for step in range(steps):
            at = T0 + step

            def row(kind, name, statistic, value, at=at, step=step):
                out.writerow(("" if rank is None else rank, step, f"{at:.6f}", kind, name, statistic, repr(value)))

            if rank in (None, 0):
                for name in names:
                    row("parameter", name, "grad_norm", grad_norm(name, step))
                    row("parameter", name, "weight_norm", 3.0)
            if rank is not None:
                for name in names:
                    row("parameter", name, "grad_norm_before_reduction", grad_norm(name, step) * (1 + rank))
            for k in range(layers):
                row("activation", f"model.layers.{k}", "norm", 5.0 + k + 0.01 * step)
            for k in reversed(range(layers)):  # backward meets the last layer first
                row("output_grad", f"model.layers.{k}", "norm", 1e-3 * (k + 1))
            row("step", "", "loss", math.nan if step == 6 else 2.0 - 0.1 * step + (rank or 0) * 0.05)
            if rank in (None, 0):
                row("step", "", "global_grad_norm", math.nan if step == 6 else 1.0 + 0.1 * step)
                row("step", "", "lr/param_groups[0]", 1e-3)
                row("step", "", "loss_scale", 65536.0 / 2 ** (step // 4))
            row("step", "", "step_time", 0.05 + 0.001 * step)
    if anomalies is None:  # written in the order they fired, not in step order
        nan_at = "model.layers.1.mlp.down_proj.weight"
        anomalies = [anomaly(6, "nonfinite", nan_at, math.nan, rank, statistic="grad_norm",
                             message=f"non-finite gradient norm at step 6: {nan_at} = nan"),
                     anomaly(3, "grad_norm_spike", "model.layers.0.self_attn.q_proj.weight", 40.0, rank, factor=10,
                             message="gradient norm spike at step 3")]
    with open(os.path.join(folder, f"anomalies_{session}.jsonl"), "w", encoding="utf-8") as f:
        f.writelines(json.dumps(record) + "\n" for record in anomalies)  # Python json: NaN as NaN
    return path


def anomaly(step, rule, module, value, rank=None, message="", **extra) -> dict:
    return {"rank": rank, "time": T0 + step + 0.5, "rule": rule, "step": step, "module": module,
            "phase": "optimizer", "value": value, "message": message or f"{rule} at step {step}", **extra}


def payload(page: str) -> dict:
    found = re.search(r'<script type="application/json" id="data">(.*?)</script>', page)
    assert found, "no data in the page"
    return json.loads(found.group(1))


class Elements(HTMLParser):
    """Every start tag of a page, with its attributes."""

    def __init__(self, page: str) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def find(self, tag: str, cls: str = "") -> list[dict]:
        return [a for t, a in self.tags if t == tag and (not cls or cls in (a.get("class") or "").split())]


def test_the_reader_returns_typed_rows_and_the_anomalies_in_step_order(tmp_path):
    write_run(tmp_path / "op_training_monitor")
    run = read_monitor(str(tmp_path))  # the results folder above it is taken too
    assert run.ranks == [None] and run.session == "pid1_s_1" and run.steps == list(range(10))
    loss = [r for r in run.rows if r.kind == "step" and r.statistic == "loss"]
    assert [(r.rank, r.step, r.time, r.name) for r in loss[:2]] == [(None, 0, T0, ""), (None, 1, T0 + 1, "")]
    assert loss[1].value == 1.9 and math.isnan(loss[6].value)
    assert [(a.step, a.rule, a.phase) for a in run.anomalies] == [(3, "grad_norm_spike", "optimizer"),
                                                                  (6, "nonfinite", "optimizer")]
    assert math.isnan(run.anomalies[1].value) and run.anomalies[1].extra == {"statistic": "grad_norm"}
    assert run.anomalies[0].extra == {"factor": 10}


def test_parameters_are_grouped_by_their_numbered_layer_else_by_their_module():
    assert layer_of("model.layers.3.mlp.up_proj.weight") == "model.layers.3"
    assert layer_of("model.layers.12.self_attn.q_proj.bias") == "model.layers.12"
    assert layer_of("transformer.h.0.attn.c_attn.weight") == "transformer.h.0"
    assert layer_of("0.weight") == "0"  # nn.Sequential
    assert layer_of("model.embed_tokens.weight") == "model.embed_tokens"
    assert layer_of("lm_head.weight") == "lm_head"
    assert layer_of("model.layers2.weight") == "model.layers2"  # a digit inside a name numbers no layer
    assert layer_of("scale") == "scale"


def test_a_layers_gradient_norm_is_the_root_of_its_parameters_squared_norms(tmp_path):
    write_run(tmp_path)
    layers, steps, norms = layer_grad_norms(read_monitor(str(tmp_path)))
    assert layers == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head"]
    assert steps == list(range(10))
    q, down = (grad_norm(f"model.layers.0.{p}.weight", 4) for p in ("self_attn.q_proj", "mlp.down_proj"))
    assert norms["model.layers.0", 4] == pytest.approx(math.sqrt(q * q + down * down), rel=1e-15)
    assert math.isnan(norms["model.layers.1", 6]) and math.isfinite(norms["model.layers.1", 5])
    assert sum(not math.isfinite(v) for v in norms.values()) == 1


def test_the_newest_session_of_each_rank_is_read_unless_one_is_named(tmp_path):
    for rank in (0, 1):
        old = write_run(tmp_path / f"rank{rank}", steps=3, rank=rank, session=f"pid{10 + rank}_old_1")
        new = write_run(tmp_path / f"rank{rank}", steps=5, rank=rank, session=f"pid{20 + rank}_new_1")
        os.utime(old, (T0, T0))
        os.utime(new, (T0 + 60, T0 + 60))
    run = read_monitor(str(tmp_path))
    assert [(f.rank, f.session) for f in run.files] == [(0, "pid20_new_1"), (1, "pid21_new_1")]
    assert run.steps == list(range(5)) and {r.rank for r in run.rows} == {0, 1}
    run = read_monitor(str(tmp_path), session="pid10_old_1")  # rank 0's: rank 1 has its own, newest
    assert [(f.rank, f.session) for f in run.files] == [(0, "pid10_old_1"), (1, "pid21_new_1")]
    assert write_monitor_page(str(tmp_path)) == str(tmp_path / "rank0" / "monitor_pid20_new_1.html")


def damage(tmp_path, what: str) -> str:
    """Damage one file of a run in ``tmp_path`` (or take it away); the file the error should name."""
    csv_path = write_run(tmp_path)
    jsonl = str(tmp_path / "anomalies_pid1_s_1.jsonl")
    lines = open(csv_path).read().splitlines(keepends=True)
    if what == "header":
        open(csv_path, "w").writelines(["rank,step,time,name,grad_norm\n", *lines[1:]])
    elif what == "value":
        lines[5] = lines[5].rsplit(",", 1)[0] + ",oops\n"
        open(csv_path, "w").writelines(lines)
    elif what == "fields":
        lines[5] = "0,1\n"
        open(csv_path, "w").writelines(lines)
    elif what == "no anomalies":
        os.remove(jsonl)
        return jsonl
    elif what == "not json":
        open(jsonl, "a").write("{\"rank\": null\n")
        return jsonl
    elif what == "key missing":
        open(jsonl, "a").write(json.dumps({k: v for k, v in anomaly(1, "nonfinite", "", 1.0).items()
                                           if k != "phase"}) + "\n")
        return jsonl
    return csv_path


@pytest.mark.parametrize("what, says", [
    ("header", "not a TrainingMonitor CSV (the first line should be rank,step,time,kind,name,statistic,value, not "
               "rank,step,time,name,grad_norm)"),
    ("value", "line 6: could not convert string to float: 'oops'"),
    ("fields", "line 6 has 2 fields, not 7"),
    ("no anomalies", "cannot be read: FileNotFoundError"),
    ("not json", "line 3 is not JSON"),
    ("key missing", "line 3 lacks phase"),
])
def test_a_missing_or_damaged_file_is_a_value_error_naming_it_and_what_is_wrong(tmp_path, what, says):
    path = damage(tmp_path, what)
    with pytest.raises(ValueError) as error:
        write_monitor_page(str(tmp_path))
    assert str(error.value).startswith(f"{path}: ") and says in str(error.value), str(error.value)
    assert not list(tmp_path.glob("*.html"))


def test_a_folder_without_monitor_files_is_a_value_error(tmp_path):
    for folder, says in ((tmp_path, "no monitor_<session>.csv here nor in a rank<N>/ folder"),
                         (tmp_path / "missing", "not a folder")):
        with pytest.raises(ValueError, match=re.escape(f"{folder}: {says}")):
            read_monitor(str(folder))


def test_a_run_still_writing_is_read_up_to_its_last_complete_line_and_the_page_says_so(tmp_path):
    csv_path = write_run(tmp_path)
    jsonl = str(tmp_path / "anomalies_pid1_s_1.jsonl")
    open(csv_path, "a").write("0,10,1700000010.0,step,,loss,1.2")  # no newline: the writer is mid-line
    os.rename(jsonl, jsonl + ".partial")
    open(jsonl + ".partial", "a").write('{"rank": null, "ti')
    run = read_monitor(str(tmp_path))
    assert run.steps == list(range(10)) and len(run.anomalies) == 2
    assert run.files[0].cut_line and run.files[0].anomalies_path == jsonl + ".partial"
    page = render_page(run)
    assert f"{csv_path}: its last line was cut" in page and f"{jsonl}.partial: still being written" in page


@pytest.mark.parametrize("started", ["", "rank,step,ti"], ids=["empty", "header cut"])
def test_another_rank_just_starting_is_read_as_in_progress_not_an_error(tmp_path, started):
    # rank 0's page at its stop may find rank 1's file created and its header not yet written (2 of 8 torchrun runs)
    write_run(tmp_path / "op_training_monitor" / "rank0", rank=0, session="pid0_s_1")
    rank1 = tmp_path / "op_training_monitor" / "rank1"
    write_run(rank1, rank=1, session="pid1_s_1")
    (rank1 / "monitor_pid1_s_1.csv").write_text(started)
    run = read_monitor(str(tmp_path))
    assert {row.rank for row in run.rows} == {0} and [f.cut_line for f in run.files] == [False, True]
    assert "monitor_pid1_s_1.csv: its last line was cut or not written yet" in render_page(run)


def test_several_ranks_have_a_line_each_where_each_wrote_its_own(tmp_path):
    for rank in (0, 1):
        write_run(tmp_path / "op_training_monitor" / f"rank{rank}", rank=rank, session=f"pid{rank}_s_1")
    page = render_page(read_monitor(str(tmp_path)))
    data = payload(page)
    assert '<ul id="constants"><li>lr: 0.001 at every step</li></ul>' in page  # rank 0's alone: one line
    lines = {chart["id"]: [s["label"] for s in chart["series"]] for chart in data["charts"]}
    assert lines == {"loss": ["rank 0", "rank 1"], "global_grad_norm": [""], "loss_scale": [""],
                     "step_time": ["rank 0", "rank 1"], "grad-norm-before-reduction": ["rank 0", "rank 1"]}
    assert [(c["title"], [s["label"] for s in c["series"]]) for c in data["modules"]] == [
        (f"{kind} (rank {rank})", ["model.layers.0", "model.layers.1"])
        for kind in ("activation norm", "output gradient norm") for rank in (0, 1)]
    assert len(data["heatmap"]["layers"]) == 5  # rank 0's reduced gradients only
    assert [a["text"] for a in data["anomalies"]] == [
        "rank 0: gradient norm spike at step 3\nrank 1: gradient norm spike at step 3",
        "rank 0: non-finite gradient norm at step 6: model.layers.1.mlp.down_proj.weight = nan\n"
        "rank 1: non-finite gradient norm at step 6: model.layers.1.mlp.down_proj.weight = nan"]


def test_a_long_run_is_thinned_and_its_page_stays_small(tmp_path):
    write_run(tmp_path, layers=12, steps=500)
    page = render_page(read_monitor(str(tmp_path)))
    heatmap = payload(page)["heatmap"]
    assert heatmap["of"] == 500 and len(heatmap["steps"]) == HEATMAP_COLUMNS
    assert heatmap["steps"][:4] == [0, 2, 5, 7] and heatmap["last"][:4] == [1, 4, 6, 9]  # stretches of 2 or 3
    assert heatmap["steps"][-1] == 497 and heatmap["last"][-1] == 499
    assert len(heatmap["layers"]) == 12 + 3 and all(len(row) == HEATMAP_COLUMNS for row in heatmap["values"])
    layer_1 = heatmap["values"][heatmap["layers"].index("model.layers.1")]
    assert layer_1[2] == "NaN" and layer_1.count("NaN") == 1  # steps 5-6: the NaN is kept
    down_9 = grad_norm("model.layers.1.mlp.down_proj.weight", 9)  # steps 7-9: the largest, step 9's
    assert layer_1[3] == pytest.approx(math.hypot(down_9, down_9 / 2), rel=1e-15)
    loss = next(c for c in payload(page)["charts"] if c["id"] == "loss")["series"][0]
    assert len(loss["x"]) <= CURVE_POINTS and "NaN" in loss["y"]  # the NaN survives the thinning
    assert len(page.encode()) < 400_000


@needs_browser
def test_a_long_runs_heatmap_has_a_column_per_stretch_of_steps_in_a_browser(tmp_path):
    write_run(tmp_path, layers=12, steps=500)
    rendered = dump_dom(chromium(), write_monitor_page(str(tmp_path)), "", str(tmp_path / "profile"))
    dom = Elements(rendered)
    assert len(dom.find("rect", "cell")) == (12 + 3) * HEATMAP_COLUMNS
    assert [(c["data-layer"], c["data-step"]) for c in dom.find("rect", "nonfinite")] == [("model.layers.1", "5")]
    assert "<title>model.layers.1, steps 5 to 6 (the largest): NaN</title>" in rendered
    assert "The 500 monitored steps are shown in 200 columns" in rendered


# --- the decisions the page draws by ---

def test_a_chart_is_on_a_log_scale_from_one_and_a_half_decades_of_positive_values():
    assert not log_scale([1.0, 10 ** 1.49]) and log_scale([1.0, 10 ** 1.5])
    assert log_scale([4.0, 0.05])  # a loss falling by just under two decades: linear would show its end as 0
    assert log_scale([0.0, 1.0, 40.0])  # a zero sits on the axis's floor
    assert not log_scale([-1.0, 1.0, 100.0]) and not log_scale([0.0, 0.0]) and not log_scale([math.nan])
    assert log_scale([1.0, math.nan, math.inf, 50.0])  # non-finite values are marks, not part of the span


def test_a_layer_is_marked_at_the_step_its_gradient_went_non_finite_not_at_every_step_after():
    assert nonfinite_states([1.0, math.nan, math.nan, 2.0, None, math.inf]) == [0, WENT_NONFINITE, STILL_NONFINITE,
                                                                               0, 0, WENT_NONFINITE]
    assert nonfinite_states([math.nan, math.nan]) == [WENT_NONFINITE, STILL_NONFINITE]


def test_a_long_runs_column_is_marked_where_a_layer_went_non_finite_within_its_stretch(tmp_path):
    rows = [(None, step, T0 + step, "parameter", "model.layers.0.weight", "grad_norm",
             math.nan if step >= 301 else 1.0) for step in range(500)]
    write_session(tmp_path, "pid1_s_1", rows, [])
    heatmap = payload(render_page(read_monitor(str(tmp_path))))["heatmap"]
    column = heatmap["steps"].index(300)  # the stretch of steps 300 and 301
    assert heatmap["last"][column] == 301 and heatmap["values"][0][column] == "NaN"
    assert heatmap["states"][0][column - 1:column + 3] == [0, WENT_NONFINITE, STILL_NONFINITE, STILL_NONFINITE]


def test_a_line_constant_at_every_step_is_a_sentence_and_its_chart_is_left_out(tmp_path):
    rows = [(None, step, T0 + step, "step", "", statistic, value) for step in range(5)
            for statistic, value in (("lr/param_groups[0]", 1e-3), ("lr/param_groups[1]", 1e-4),
                                     ("loss_scale", 1024.0), ("loss", 3.0 - 0.1 * step))]
    write_session(tmp_path, "pid1_s_1", rows, [])
    page = render_page(read_monitor(str(tmp_path)))
    assert [c["id"] for c in payload(page)["charts"]] == ["loss"]
    assert re.findall(r"<li>([^<]*at every step)</li>", page) == [
        "loss scale: 1024 at every step", "lr (group 0): 0.001 at every step", "lr (group 1): 0.0001 at every step"]
    rows = [row if row[1] < 4 or row[5] != "lr/param_groups[1]" else row[:6] + (5e-5,) for row in rows]
    write_session(tmp_path, "pid1_s_1", rows, [])  # a scheduler lowers group 1's rate: both groups drawn
    page = render_page(read_monitor(str(tmp_path)))
    assert [c["id"] for c in payload(page)["charts"]] == ["loss", "lr"]
    assert re.findall(r"<li>([^<]*at every step)</li>", page) == ["loss scale: 1024 at every step"]


# --- a two-rank run whose NaN spread from one weight to every layer, opened once in a browser ---

@pytest.fixture(scope="module")
def nan_run(tmp_path_factory):
    """(page path, DOM after its scripts ran, screenshot path) of ``handmade_results.nan_spreading_run``'s page."""
    browser = require_browser()
    root = tmp_path_factory.mktemp("nan_run")
    nan_spreading_run(root)
    page = write_monitor_page(str(root))
    png = str(root / "monitor_page.png")
    dom, _ = open_once(browser, page, png, window=(1400, 1300))
    return page, dom, png


def figure(dom: str, chart: str) -> str:
    """The markup of one chart of the page."""
    found = re.search(rf'<figure class="chart" id="chart-{chart}">.*?</figure>', dom, re.S)
    assert found, f"no chart {chart}"
    return found.group(0)


@needs_browser
def test_the_banner_stays_at_the_top_and_names_the_first_anomalys_rank_step_module_and_phase(nan_run):
    page, dom, png = nan_run
    assert re.search(r"#banner \{ position: sticky; top: 0;", dom)
    assert re.search(r'<body>\s*<header id="banner" class="verdict-found"><div class="page-title">Training monitor: '
                     r'[^<]+</div><h1 id="verdict">2 anomalies in \d+ monitored steps</h1>', dom)
    facts = re.findall(r'<span class="field" data-field="(\w+)"><span class="field-name">\w+</span><code>([^<]+)'
                       r'</code></span>', dom)
    assert facts == [("rank", "1"), ("step", str(NAN_STEP)), ("module", NAN_PARAMETER), ("phase", "backward"),
                     ("rule", "nonfinite")]
    # on load, the window shows it first: the found verdict's red edge and the banner's white, from the top row down
    assert [(row[2], row[20]) for row in top_rows(png, 8)] == [((0xcc, 0, 0), (0xff, 0xff, 0xff))] * 8
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", open(page).read())  # nothing fetched from elsewhere
    rows = re.findall(r'<tr class="anomaly" data-step="(\d+)"><td>(\d)</td><td>\d+</td><td>([a-z_]+)</td>', dom)
    assert rows == [(str(NAN_STEP), "1", "nonfinite"), (str(NAN_STEP), "0", "nonfinite")]  # in the order they came


@needs_browser
def test_each_chart_has_axis_titles_with_units_and_a_falling_loss_is_on_a_log_scale(nan_run):
    _, dom, _ = nan_run
    charts = re.findall(r'<figure class="chart" id="chart-([\w-]+)">', dom)
    assert charts == ["loss", "global_grad_norm", "step_time", "grad-norm-before-reduction", "activation-0",
                      "activation-1", "output_grad-0", "output_grad-1"]  # lr is constant: no chart
    titles = {chart: re.findall(r'class="axis-title (x|y)"[^>]*>([^<]+)</text>', figure(dom, chart))
              for chart in charts}
    assert all(found[0] == ("x", "step") for found in titles.values())
    assert titles["loss"][1] == ("y", "loss (log scale)") and "<span class=\"scale\">log scale</span>" in \
        figure(dom, "loss")  # from 4 to 0.05: under two decades, linear showed its end as 0
    assert titles["step_time"][1] == ("y", "time per step (s)")
    assert titles["global_grad_norm"][1] == ("y", "gradient L2 norm")  # 1.1 to 1.5: linear
    assert titles["activation-0"][1] == ("y", "output L2 norm")
    assert '<ul id="constants"><li>lr: 0.001 at every step</li></ul>' in dom


@needs_browser
def test_nan_marks_are_drawn_per_line_in_its_colour(nan_run):
    _, dom, _ = nan_run
    chart = figure(dom, "grad-norm-before-reduction")
    lines = dict(re.findall(r'<polyline [^>]*stroke="(#\w+)"><title>(rank \d)</title>', chart))
    lines = {rank: colour for colour, rank in lines.items()}
    assert set(lines) == {"rank 0", "rank 1"} and lines["rank 0"] != lines["rank 1"]
    marks = re.findall(r'<circle [^>]*class="nonfinite-point" fill="(#\w+)"[^>]*><title>(rank \d), step (\d+): '
                       r"NaN</title>", chart)
    assert marks == [(lines[rank], rank, str(step)) for rank, first in (("rank 0", NAN_STEP + 1), ("rank 1", NAN_STEP))
                     for step in range(first, STEPS)]  # rank 1's gradient went NaN before the reduction, a step first


@needs_browser
def test_the_heatmap_marks_where_each_layer_went_non_finite_and_pales_the_steps_after(nan_run):
    _, dom, _ = nan_run
    cells = re.findall(r'<rect [^>]*class="cell([\w -]*)" data-layer="([\w.]+)" data-step="(\d+)" fill="([^"]+)"',
                       dom)
    assert len(cells) == len(LAYERS) * STEPS
    went = [(layer, int(step)) for kind, layer, step, _ in cells if kind == " nonfinite"]
    assert went == [(layer, NAN_STEP + (layer != "model.layers.1")) for layer in LAYERS]  # layers.1 a step first
    still = {(layer, int(step)) for kind, layer, step, _ in cells if kind == " still-nonfinite"}
    assert still == {(layer, step) for layer in LAYERS for step in range(NAN_STEP + 1, STEPS)} - set(went)
    assert len({fill for kind, _, _, fill in cells if not kind}) > 20  # the finite ones on a colour scale
    assert "<title>model.layers.1, step 10: NaN (non-finite since step 8)</title>" in dom
    _, _, norms = layer_grad_norms(read_monitor(os.path.dirname(os.path.dirname(nan_run[0]))))
    assert f"<title>model.layers.0, step 4: {norms['model.layers.0', 4]!r}</title>" in dom  # the exact value
