"""The HTML report in a real headless browser (Debian's chromium): the table renders, the status filter, the name
filter, sorting and the compare filter work. The view is chosen by the URL fragment, as a user's link would."""

from __future__ import annotations

import math
import re

import pytest
from browser import require_browser
from cli_runs import chromium, dump_dom

from op_tools.offline.conformance import html, known_gaps
from op_tools.offline.conformance.results import Row

BROWSER = chromium()


@pytest.fixture(autouse=True)
def _browser_present():
    require_browser()  # each test opens the page: skipped without a browser, failed under CI

ROWS = [Row("add", "float32", "forward", "pass", samples=11, device="npu"),
        Row("add", "float32", "backward", "pass", samples=11, device="npu"),
        Row("atan2", "float32", "forward", "mismatch", samples=9, failing=8, sample=4, output="output[0]",
            device_error=0.0677, cpu_error=3e-8, detail="sample 4 output[0]: error 0.0677 > 4 x cpu", device="npu",
            reproduce="python -m op_tools.conformance --device npu --ops atan2 --dtypes float32 --sample 4"),
        Row("hypot", "float32", "forward", "mismatch", samples=9, failing=8, sample=5, device_error=0.3,
            device="npu"),
        Row("erf", "float32", "forward", "unsupported", samples=1, failing=1, sample=0,
            detail="RuntimeError: erf is not implemented", device="npu"),
        Row("nn.functional.conv2d", "float32", "forward", "crash", sample=3, device_error=math.nan,
            detail="the worker died from signal SIGSEGV", device="npu"),
        Row("nn.functional.dropout", "float32", "forward", "skipped", detail="random", device="npu")]
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


def test_the_table_renders_every_row_with_its_columns(page):
    dom = page()
    assert shown(dom) == [(r.status, r.op) for r in ROWS]
    assert "showing 7 of 7 rows" in dom
    header = re.findall(r'<th data-column="(\w+)"', dom)
    assert header[:5] == ["op", "dtype", "direction", "status", "other"] and "reproduce" in header
    assert "<code>python -m op_tools.conformance --device npu --ops atan2 --dtypes float32 --sample 4</code>" in dom
    assert re.search(r'<td class="device_error">0\.0677</td>', dom)


def test_filtering_by_status_shows_those_rows_only(page):
    dom = page("status=mismatch,crash")
    assert shown(dom) == [("mismatch", "atan2"), ("mismatch", "hypot"), ("crash", "nn.functional.conv2d")]
    assert "showing 3 of 7 rows" in dom
    boxes = dict(re.findall(r'<input type="checkbox" id="show-(\w+)"( checked="")?', dom))
    assert boxes == {"pass": "", "mismatch": ' checked=""', "unsupported": "", "crash": ' checked=""', "unchecked": "",
                     "skipped": ""}


def test_filtering_by_name_and_sorting_by_error(page):
    dom = page("status=pass,mismatch,unsupported,crash,skipped&sort=device_error:desc")
    assert [op for _, op in shown(dom)][:2] == ["hypot", "atan2"]  # 0.3, then 0.0677; empty errors last
    assert [op for _, op in shown(page("q=a&sort=op:asc"))] == ["add", "add", "atan2", "nn.functional.conv2d",
                                                                "nn.functional.dropout"]


def test_the_compare_filter_keeps_the_rows_where_the_two_runs_differ(page):
    dom = page("differ=1")
    assert [op for _, op in shown(dom)] == ["atan2", "erf", "nn.functional.conv2d", "nn.functional.dropout"]
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
    assert classes == [("pass", "", "add"), ("mismatch", " known-gap", "nn.functional.linear_cross_entropy.chunked"),
                       ("mismatch", "", "atan2")]
    (status,) = re.findall(r'<td class="status">mismatch<span class="known-gap" title="([^"]+)">known gap</span></td>',
                           dom)
    assert status.startswith("PyTorch accumulates chunked linear_cross_entropy in float32")
    assert '<div class="known-gap">known gap: PyTorch accumulates' in dom
    assert "1 row is a known gap" in dom and "showing 3 of 3 rows" in dom
    assert "mismatch (2)" in dom and re.search(r'<input type="checkbox" id="gaps" checked=""> known gaps \(1\)', dom)
    assert re.search(r"<td>bfloat16</td><td>forward</td><td>3</td><td>1</td><td>2</td>", dom)  # 1 pass, 2 mismatch
    hidden = dump_dom(BROWSER, str(path), "gaps=0", str(tmp_path / "profile"))
    assert [op for *_, op in re.findall(r'<tr class="row status-(\w+)( known-gap)?"><td class="op">([^<]+)</td>',
                                         hidden)] == ["add", "atan2"]
    assert "showing 2 of 3 rows" in hidden and re.search(r'<input type="checkbox" id="gaps">', hidden)
