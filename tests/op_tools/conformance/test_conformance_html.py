"""The HTML report in a real headless browser (Debian's chromium): the banner, the table (failures first, a nan
error as nan, the reproduce commands inside a 1,400 px window), the status filter, the name filter, sorting and the
compare filter. The view is chosen by the URL fragment, as a user's link would."""

from __future__ import annotations

import math
import re

import pytest
from browser import open_once, require_browser
from cli_runs import chromium, dump_dom

from op_tools.offline.conformance import html, known_gaps
from op_tools.offline.conformance.results import Row

BROWSER = chromium()


@pytest.fixture(autouse=True)
def _browser_present():
    require_browser()  # each test opens the page: skipped without a browser, failed under CI



def reproduce(op: str, sample: int) -> str:
    """The command a row carries, as long as a real one (the variables that shaped the run come first)."""
    return (f"DITORCH_SIM_FAULTS='sin:nan;atan2:noise=1e-2;erf:unsupported;hypot:inf' OP_TOOLS_RESULTS_DIR=/results "
            f"python -m op_tools.conformance --device npu --setup torch_npu --ops {op} --dtypes float32 "
            f"--sample {sample}")


ROWS = [Row("add", "float32", "forward", "pass", samples=11, device="npu"),
        Row("add", "float32", "backward", "pass", samples=11, device="npu"),
        Row("atan2", "float32", "forward", "mismatch", samples=9, failing=8, sample=4, output="output[0]",
            device_error=0.0677, cpu_error=3e-8, detail="sample 4 output[0]: error 0.0677 > 4 x cpu", device="npu",
            reproduce=reproduce("atan2", 4), inputs="/results/inputs/atan2/float32/sample4"),
        Row("hypot", "float32", "forward", "mismatch", samples=9, failing=8, sample=5, device_error=0.3,
            device="npu", reproduce=reproduce("hypot", 5)),
        Row("erf", "float32", "forward", "unsupported", samples=1, failing=1, sample=0,
            detail="RuntimeError: erf is not implemented", device="npu", reproduce=reproduce("erf", 0)),
        Row("nn.functional.conv2d", "float32", "forward", "crash", sample=3, device_error=math.nan,
            detail="the worker died from signal SIGSEGV", device="npu", reproduce=reproduce("nn.functional.conv2d", 3)),
        Row("nn.functional.dropout", "float32", "forward", "skipped", detail="random", device="npu"),
        Row("sin", "float32", "forward", "mismatch", samples=1, failing=1, sample=0, output="output[0]",
            device_error=math.nan, max_abs_diff=math.nan, device="npu", reproduce=reproduce("sin", 0),
            detail="sample 0 output[0]: nan/inf differ at 400 of 400 elements (device nan, reference finite)")]
READING_ORDER = ["atan2", "hypot", "erf", "nn.functional.conv2d", "sin", "nn.functional.dropout", "add", "add"]
OTHER = [Row(r.op, r.dtype, r.direction, "pass", device="cuda") for r in ROWS if r.op != "hypot"]


@pytest.fixture
def page(tmp_path):
    path = tmp_path / "conformance.html"
    path.write_text(html.render(ROWS, "conformance of npu", OTHER, "cuda"), encoding="utf-8")

    def open_at(fragment: str = "") -> str:
        return dump_dom(BROWSER, str(path), fragment, str(tmp_path / "profile"))

    return open_at


def shown(dom: str) -> list[tuple[str, str]]:
    """(status, op) of each row the page shows, in its order."""
    return re.findall(r'<tr class="row status-(\w+)"><td class="op">([^<]+)</td>', dom)


# Where the page is at load, where its banner is once scrolled, and whether anything is wider than the window.
REPORT_PROBE = """
const banner = document.getElementById("banner"), root = document.documentElement;
const reproduce = [...document.querySelectorAll("td.reproduce")].filter(td => td.textContent);
const result = {inner_width: window.innerWidth, client_width: root.clientWidth, scroll_width: root.scrollWidth,
    load_scroll_y: window.scrollY, banner_position: getComputedStyle(banner).position,
    reproduce: reproduce.map(td => ({right: td.getBoundingClientRect().right, cut: td.scrollWidth > td.clientWidth}))};
window.scrollTo(0, root.scrollHeight);
const head = document.querySelector("#header th").getBoundingClientRect();
result.scrolled = {scroll_y: window.scrollY, banner_top: banner.getBoundingClientRect().top,
                   banner_bottom: banner.getBoundingClientRect().bottom, header_top: head.top};
window.scrollTo(0, 0);
return result;
"""


@pytest.fixture(scope="module")
def report_view(tmp_path_factory):
    """The page with the rows of ROWS and a run on cuda to compare with, opened once at 1400 x 1000 with no
    fragment: ``(DOM, what REPORT_PROBE measured)``; its screenshot is conformance.png in the test's folder (and
    in $OP_TOOLS_TEST_ARTEFACTS)."""
    browser = require_browser()
    folder = tmp_path_factory.mktemp("report")
    path = folder / "conformance.html"
    path.write_text(html.render(ROWS, "conformance of npu", OTHER, "cuda"), encoding="utf-8")
    return open_once(browser, str(path), str(folder / "conformance.png"), REPORT_PROBE)


def test_the_table_renders_every_row_with_its_columns_failures_first(report_view):
    dom, _ = report_view
    assert [op for _, op in shown(dom)] == READING_ORDER  # failed, then skipped, then passed; the sweep's order in each
    assert "showing 8 of 8 rows" in dom
    header = re.findall(r'<th data-column="(\w+)"', dom)
    assert header[:5] == ["op", "dtype", "direction", "status", "other"] and "reproduce" in header
    assert f"<code>{reproduce('atan2', 4)}</code> inputs: /results/inputs/atan2/float32/sample4" in dom
    assert re.search(r'<td class="device_error">0\.0677</td>', dom)


def test_a_nan_error_shows_as_nan_and_a_row_without_one_shows_none(report_view):
    dom, _ = report_view
    cells = dict(re.findall(r'<tr class="row status-\w+"><td class="op">([^<]+)</td>.*?<td class="device_error">'
                            r'([^<]*)</td>', dom))
    assert cells["sin"] == "nan"  # its output is nan: never 0
    assert cells["nn.functional.conv2d"] == "" and cells["add"] == ""  # a crash, a pass: no error measured


def test_the_banner_stays_on_top_with_the_verdict_and_the_first_failure(report_view):
    dom, probe = report_view
    assert re.search(r'<header id="banner" class="verdict-found"><div class="page-title">conformance of npu</div>'
                     r'<h1 id="verdict">5 rows failed \(3 mismatch, 1 unsupported, 1 crash\)</h1>', dom)
    fields = dict(re.findall(r'<span class="field" data-field="(\w+)"><span class="field-name">\w+</span>'
                             r'<code>([^<]*)</code>', dom))
    assert fields == {"op": "atan2", "dtype": "float32", "phase": "forward", "status": "mismatch", "sample": "4",
                      "output": "output[0]"}
    assert '<p class="banner-line">sample 4 output[0]: error 0.0677 &gt; 4 x cpu</p>' in dom
    assert "8 rows: 2 pass, 3 mismatch, 1 unsupported, 1 crash, 0 unchecked, 1 skipped" in dom
    assert probe["load_scroll_y"] == 0 and probe["banner_position"] == "sticky"
    scrolled = probe["scrolled"]
    assert scrolled["scroll_y"] > 0 and scrolled["banner_top"] == 0
    assert scrolled["header_top"] == pytest.approx(scrolled["banner_bottom"], abs=1)  # the table's header under it


def test_at_1400_px_the_reproduce_commands_wrap_inside_the_window(report_view):
    _, probe = report_view
    assert probe["inner_width"] == 1400
    assert probe["scroll_width"] <= probe["client_width"]  # nothing wider than the window: no sideways scrolling
    assert len(probe["reproduce"]) == 5
    for cell in probe["reproduce"]:
        assert cell["right"] <= probe["client_width"] and not cell["cut"], cell


def test_filtering_by_status_shows_those_rows_only(page):
    dom = page("status=mismatch,crash")
    assert shown(dom) == [("mismatch", "atan2"), ("mismatch", "hypot"), ("crash", "nn.functional.conv2d"),
                          ("mismatch", "sin")]
    assert "showing 4 of 8 rows" in dom
    boxes = dict(re.findall(r'<input type="checkbox" id="show-(\w+)"( checked="")?', dom))
    assert boxes == {"pass": "", "mismatch": ' checked=""', "unsupported": "", "crash": ' checked=""', "unchecked": "",
                     "skipped": ""}


def test_filtering_by_name_and_sorting_by_error(page):
    dom = page("status=pass,mismatch,unsupported,crash,skipped&sort=device_error:desc")
    assert [op for _, op in shown(dom)][:3] == ["sin", "hypot", "atan2"]  # nan (the worst), 0.3, 0.0677; empty last
    assert [op for _, op in shown(page("q=a&sort=op:asc"))] == ["add", "add", "atan2", "nn.functional.conv2d",
                                                                "nn.functional.dropout"]


def test_the_compare_filter_keeps_the_rows_where_the_two_runs_differ(page):
    dom = page("differ=1")
    assert [op for _, op in shown(dom)] == ["atan2", "erf", "nn.functional.conv2d", "sin", "nn.functional.dropout"]
    assert re.search(r'<th data-column="other"[^>]*>cuda</th>', dom)


def test_a_known_gap_is_marked_with_its_reason_and_stays_a_mismatch(tmp_path):
    rows = known_gaps.mark([
        Row("add", "bfloat16", "forward", "pass", samples=11, device="sim"),
        Row("nn.functional.linear_cross_entropy.chunked", "bfloat16", "forward", "mismatch", samples=161, failing=1,
            sample=126, device_error=0.0473, detail="sample 126 output[0]: error 0.0473", device="sim"),
        Row("atan2", "bfloat16", "forward", "mismatch", samples=9, failing=8, sample=4, detail="off", device="sim")])
    path = tmp_path / "conformance.html"
    path.write_text(html.render(rows, "conformance of sim"), encoding="utf-8")
    dom = dump_dom(BROWSER, str(path), "", str(tmp_path / "profile"))
    classes = re.findall(r'<tr class="row status-(\w+)( known-gap)?"><td class="op">([^<]+)</td>', dom)
    # failures first, a known gap after the other failures
    assert classes == [("mismatch", "", "atan2"),
                       ("mismatch", " known-gap", "nn.functional.linear_cross_entropy.chunked"), ("pass", "", "add")]
    (status,) = re.findall(r'<td class="status">mismatch<span class="known-gap" title="([^"]+)">known gap</span></td>',
                           dom)
    assert status.startswith("PyTorch accumulates chunked linear_cross_entropy in float32")
    assert '<div class="known-gap">known gap: PyTorch accumulates' in dom
    assert "1 row is a known gap" in dom and "showing 3 of 3 rows" in dom
    assert "mismatch (2)" in dom and re.search(r'<input type="checkbox" id="gaps" checked=""> known gaps \(1\)', dom)
    assert re.search(r"<td>bfloat16</td><td>forward</td><td>3</td><td>1</td><td>2</td>", dom)  # 1 pass, 2 mismatch
    hidden = dump_dom(BROWSER, str(path), "gaps=0", str(tmp_path / "profile"))
    assert [op for *_, op in re.findall(r'<tr class="row status-(\w+)( known-gap)?"><td class="op">([^<]+)</td>',
                                         hidden)] == ["atan2", "add"]
    assert "showing 2 of 3 rows" in hidden and re.search(r'<input type="checkbox" id="gaps">', hidden)
