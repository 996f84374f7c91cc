"""The conformance report's pieces that need no device: choosing ops and dtypes, the results file, the CSV, the
summary, the reproduce command (in this process, no op_db import)."""

from __future__ import annotations

import collections
import csv
import json
import math
import os
import re

import pytest
import torch

from op_tools.offline.conformance import cli, html, known_gaps, report
from op_tools.offline.conformance.opinfos import OpEntry, parse_dtypes, select
from op_tools.offline.conformance.results import ResultsFile, Row, read_csv, write_csv

ENTRIES = [OpEntry("max.reduction_with_dim", "max", ("float32",)), OpEntry("max.binary", "max", ("float32",)),
           OpEntry("softmax", "softmax", ("float32",)), OpEntry("softmax.with_dtype", "softmax", ("float32",)),
           OpEntry("nn.functional.gelu", "nn.functional.gelu", ("float32", "bfloat16")),
           OpEntry("nn.functional.relu", "nn.functional.relu", ("float32",))]


def names(entries):
    return [e.name for e in entries]


def test_an_op_name_selects_that_opinfo_a_stem_its_variants_a_pattern_what_it_matches():
    assert names(select(ENTRIES, ["softmax"])) == ["softmax"]
    assert names(select(ENTRIES, ["max"])) == ["max.reduction_with_dim", "max.binary"]
    assert names(select(ENTRIES, ["softmax*"])) == ["softmax", "softmax.with_dtype"]
    assert names(select(ENTRIES, ["nn.functional.*", "max.binary"])) == [
        "max.binary", "nn.functional.gelu", "nn.functional.relu"]  # op_db's order, each once
    assert names(select(ENTRIES, None)) == names(ENTRIES)


def test_an_op_name_that_selects_nothing_is_an_error_naming_the_closest():
    with pytest.raises(ValueError, match=r"--ops 'nn.functional.gleu' names no OpInfo .*closest: nn.functional.gelu"):
        select(ENTRIES, ["nn.functional.gleu"])


def test_dtypes_parse_by_name_and_all_means_each_ops_claimed_dtypes():
    assert parse_dtypes("float32, torch.bfloat16,float32") == ("float32", "bfloat16")
    assert parse_dtypes("all") is None
    with pytest.raises(ValueError, match="unknown dtype 'float31'"):
        parse_dtypes("float31")


def row(op="add", dtype="float32", direction="forward", status="pass", **fields) -> Row:
    return Row(op, dtype, direction, status, device="sim", **fields)


def test_the_results_file_keeps_finished_ops_across_a_kill_mid_line(tmp_path):
    results = ResultsFile(str(tmp_path / "results.jsonl"))
    results.start({"device": "sim", "ops": ["add"]})
    results.append([row(), row(direction="backward")])
    results.append([row("mul", status="mismatch", sample=3, device_error=0.25, detail="off")])
    with open(results.path, "a", encoding="utf-8") as f:
        f.write('{"kind": "rows", "rows": [{"op": "su')  # the sweep was killed while writing this line
    header, rows = results.read()
    assert header["device"] == "sim" and header["ops"] == ["add"]
    assert [r.key for r in rows] == [("add", "float32", "forward"), ("add", "float32", "backward"),
                                     ("mul", "float32", "forward")]
    assert rows[2].sample == 3 and rows[2].device_error == 0.25 and math.isnan(rows[2].cpu_error)
    results.repair()
    results.append([row("sub")])
    assert [r.op for r in results.read()[1]] == ["add", "add", "mul", "sub"]


def test_the_results_file_is_strict_json_with_nan_and_inf_as_text_read_back_as_floats(tmp_path):
    results = ResultsFile(str(tmp_path / "results.jsonl"))
    results.start({"device": "sim"})
    results.append([row("exp", status="mismatch", device_error=math.inf, cpu_error=-math.inf, max_abs_diff=math.nan)])

    def refuse(constant):  # what a strict reader (jq, a browser's JSON.parse) does with a bare NaN or Infinity
        raise ValueError(f"not JSON: {constant}")

    with open(results.path, encoding="utf-8") as f:
        lines = [json.loads(line, parse_constant=refuse) for line in f]
    assert lines[1]["rows"][0]["device_error"] == "inf" and lines[1]["rows"][0]["max_abs_diff"] == "nan"
    back = results.read()[1][0]
    assert back.device_error == math.inf and back.cpu_error == -math.inf and math.isnan(back.max_abs_diff)
    assert math.isnan(back.error_ratio)  # never measured: still nan, as written


def test_a_damaged_line_inside_the_results_file_is_an_error_naming_it(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text('{"kind": "run"}\nnot json\n{"kind": "rows", "rows": []}\n')
    with pytest.raises(ValueError, match="results.jsonl:2: not a results line"):
        ResultsFile(str(path)).read()


def test_the_csv_reads_back_the_rows_it_was_written_from(tmp_path):
    rows = [row(), row("mul", "bfloat16", "backward", "mismatch", samples=4, failing=1, sample=2, output="input.grad",
                       device_error=0.5, cpu_error=0.001, error_ratio=500.0, max_abs_diff=0.25,
                       detail='error 0.5 > 4 x cpu, "quoted", comma', reproduce="python -m op_tools.conformance")]
    path = str(tmp_path / "conformance.csv")
    write_csv(path, rows)
    back = read_csv(path)
    assert [r.key for r in back] == [r.key for r in rows]
    assert back[1] == rows[1]
    assert back[0].sample is None and math.isnan(back[0].device_error)


def test_a_nan_error_is_written_nan_in_the_csv_and_the_page_and_a_row_without_one_leaves_it_empty(tmp_path):
    nan = math.nan
    rows = [row("sin", status="mismatch", samples=1, failing=1, sample=0, output="output[0]", device_error=nan,
                max_abs_diff=nan, detail="sample 0 output[0]: nan/inf differ at 400 of 400 elements"),
            row("exp", status="mismatch", output="output[0]", device_error=math.inf, max_abs_diff=math.inf),
            row("argmax", status="mismatch", output="output[0]", max_abs_diff=3.0),  # integers: no normalised error
            row("add"), row("erf", status="unsupported", sample=0, detail="RuntimeError: no kernel")]
    path = str(tmp_path / "conformance.csv")
    write_csv(path, rows)
    with open(path, newline="") as f:
        cells = {r["op"]: (r["device_error"], r["max_abs_diff"], r["cpu_error"], r["error_ratio"])
                 for r in csv.DictReader(f)}
    assert cells == {"sin": ("nan", "nan", "", ""), "exp": ("inf", "inf", "", ""), "argmax": ("", "3", "", ""),
                     "add": ("", "", "", ""), "erf": ("", "", "", "")}  # the CPU's error was not needed: none, not nan
    back = read_csv(path)
    assert math.isnan(back[0].device_error) and back[1].device_error == math.inf
    page = html.render(rows, "t")
    assert re.search(r'"op": "sin", [^}]*"device_error": "nan", "cpu_error": null', page)
    assert re.search(r'"op": "exp", [^}]*"device_error": "inf"', page)
    assert re.search(r'"op": "add", [^}]*"device_error": null', page)
    assert re.search(r'"op": "argmax", [^}]*"device_error": null', page)


def test_the_report_reads_failures_first_known_gaps_after_them_then_not_checked_skipped_and_passed():
    rows = [row("a"), row("b", status="skipped"), row("c", status="mismatch", known_gap="a known gap"),
            row("d", status="unchecked"), row("e", status="crash"), row("f", status="mismatch"), row("g")]
    assert [r.op for r in report.reading_order(rows)] == ["e", "f", "c", "d", "b", "a", "g"]
    assert report.first_failure(rows).op == "e"
    assert report.first_failure([row("a"), row("d", status="unchecked")]).op == "d"
    assert report.first_failure([row("a"), row("b", status="skipped")]) is None
    page = html.render(rows, "t")
    assert re.findall(r'"op": "(\w)"', page) == ["e", "f", "c", "d", "b", "a", "g"]
    assert ('<h1 id="verdict">3 rows failed (2 mismatch, 0 unsupported, 1 crash), 1 of them known gaps</h1><div '
            'class="where"><span class="where-label">first failure</span>') in page
    clean = html.render([row("a"), row("b", status="skipped")], "t")
    assert '<header id="banner" class="verdict-clean">' in clean
    assert '<h1 id="verdict">Every op that ran passed</h1>' in clean
    assert 'class="where"' not in clean  # nothing failed: no row to point at
    unchecked = html.render([row("a"), row("d", status="unchecked", detail="no CPU reference")], "t")
    assert ('<h1 id="verdict">1 row not checked; none failed</h1><div class="where"><span class="where-label">first '
            'not checked</span><span class="field" data-field="op"><span class="field-name">op</span><code>d</code>'
            ) in unchecked and '<p class="banner-line">no CPU reference</p>' in unchecked


def test_a_csv_of_another_tool_is_refused_by_name(tmp_path):
    path = tmp_path / "other.csv"
    path.write_text("name,verdict\nx,pass\n")
    with pytest.raises(ValueError, match="not a conformance CSV"):
        read_csv(str(path))


def test_the_pass_rate_counts_the_rows_that_ran_and_not_the_skipped():
    rows = [row(), row("b"), row("c", status="mismatch"), row("d", status="skipped"), row("e", status="crash"),
            row("f", dtype="bfloat16", status="unsupported")]
    lines = {(line["dtype"], line["direction"]): line for line in report.summary_rows(rows)}
    assert lines[("float32", "forward")]["pass rate"] == "50.0%"  # 2 of pass, mismatch x1, crash x1
    assert lines[("bfloat16", "forward")]["pass rate"] == "0.0%"
    assert lines[("all", "both")]["ops"] == 6 and lines[("all", "both")]["skipped"] == 1
    text = report.summary(rows, "title")
    assert "4 rows did not pass" not in text and "3 rows did not pass" in text


def test_differences_pair_the_rows_two_runs_disagree_on():
    mine = [row(), row("mul", status="mismatch"), row("only_here")]
    theirs = [row(), row("mul"), row("only_there", status="crash")]
    assert [(a.op, a.status, b.status) for a, b in report.differences(mine, theirs)] == [("mul", "mismatch", "pass")]
    assert "1 of 2 rows differ" in report.differences_text(mine, theirs, "cuda")


def test_the_html_page_carries_its_rows_as_json_that_no_detail_can_break_out_of():
    page = html.render([row(detail="</script><script>alert(1)</script>", device_error=math.nan)], "t & <title>")
    assert "<title>t &amp; &lt;title&gt;</title>" in page
    assert "</script><script>alert(1)" not in page and r"<\/script><script>alert(1)<\/script>" in page
    assert '"device_error": null' in page


def test_the_reproduce_command_carries_the_variables_that_shape_the_run(monkeypatch):
    monkeypatch.setenv("DITORCH_SIM_FAULTS", "mm:noise=1e-3;.*@float64:unsupported")
    monkeypatch.setenv("LINEAR_AUTOCOMPARE_ERROR_TOLERANCE_FLOAT32", "1e-3,1e-3")
    monkeypatch.setenv("UNRELATED", "1")
    settings = cli.Settings("sim", ("ditorch.sim:register",), ["mm"], ("float32",), None, True)
    command = cli.reproduce_command(row("nn.functional.linear", sample=7), settings)
    assert command.startswith("DITORCH_SIM_FAULTS='mm:noise=1e-3;.*@float64:unsupported' "
                              "LINEAR_AUTOCOMPARE_ERROR_TOLERANCE_FLOAT32=1e-3,1e-3 python -m op_tools.conformance")
    # --device sim implies its setup again: the command stays short
    assert command.endswith("--device sim --ops nn.functional.linear --dtypes float32 --sample 7")
    other = cli.reproduce_command(row("abs"), cli.Settings("sim", ("ditorch.sim:register", "my_setup:faults"), ["abs"],
                                                           ("float32",), None, True))
    assert "--device sim --setup my_setup:faults --ops abs" in other
    assert "UNRELATED" not in command


def test_a_resumed_run_keeps_its_settings_unless_given_again(tmp_path):
    args = cli.build_parser().parse_args(["--resume", str(tmp_path), "--dtypes", "float32"])
    header = {"device": "cpu", "setup": [], "ops": ["add"], "dtypes": ["float32", "bfloat16"], "limit_samples": 2,
              "backward": False}
    settings = cli.settings_from(args, header)
    assert (settings.device, settings.ops, settings.dtypes, settings.limit_samples, settings.backward) == (
        "cpu", ["add"], ("float32",), 2, False)
    with pytest.raises(cli.UsageError, match="ran on cpu"):
        cli.settings_from(cli.build_parser().parse_args(["--resume", "x", "--device", "meta"]), header)


def test_the_report_of_a_results_file_needs_no_worker(tmp_path, capsys):
    folder = tmp_path / "run"
    results = ResultsFile(str(folder / "results.jsonl"))
    results.start({"device": "sim"})
    results.append([row(), row("mul", status="unsupported", sample=0, detail="RuntimeError: no kernel")])
    assert cli.main(["--report", str(folder)]) == 3  # found: a row is unsupported
    out = capsys.readouterr().out
    assert "RuntimeError: no kernel" in out and os.path.isfile(folder / "conformance.html")
    assert [r.op for r in read_csv(str(folder / "conformance.csv"))] == ["add", "mul"]


def test_a_report_or_compare_of_a_run_not_there_is_a_usage_error_naming_it(tmp_path, capsys):
    # --report of a missing path or an empty folder ended in a FileNotFoundError's traceback, exit 1
    (tmp_path / "empty").mkdir()
    missing = ((tmp_path / "gone", "no such file or folder"), (tmp_path / "empty", "no results.jsonl there"))
    for option in ("--report", "--compare"):
        for path, why in missing:
            assert cli.main([option, str(path)]) == 2
            assert capsys.readouterr().err == f"conformance: {option} {str(path)!r}: {why}\n"


def settings_of(*argv: str) -> cli.Settings:
    return cli.settings_from(cli.build_parser().parse_args(list(argv)), None)


def test_device_sim_implies_the_setup_that_registers_it(monkeypatch):
    monkeypatch.delenv("DITORCH_BACKEND", raising=False)
    settings = settings_of("--device", "sim", "--ops", "abs")
    assert (settings.device, settings.setup, settings.implied_by) == ("sim", ("ditorch.sim:register",), "--device sim")
    assert settings.header()["setup"] == ["ditorch.sim:register"]  # recorded: --resume runs it again
    given = settings_of("--device", "sim", "--setup", "ditorch.sim:register", "--setup", "extra:faults")
    assert (given.setup, given.implied_by) == (("ditorch.sim:register", "extra:faults"), "")  # never twice
    assert settings_of("--device", "sim:1", "--setup", "extra:faults").setup == ("ditorch.sim:register",
                                                                                  "extra:faults")
    assert settings_of("--device", "cpu").setup == ()


def test_ditorch_backend_sim_names_the_device_when_no_device_is_given(monkeypatch):
    monkeypatch.setenv("DITORCH_BACKEND", "sim")
    settings = settings_of("--ops", "abs")
    assert (settings.device, settings.setup, settings.implied_by) == (
        "sim", ("ditorch.sim:register",), "DITORCH_BACKEND=sim")
    assert settings_of("--device", "cpu").device == "cpu"  # --device wins


def test_an_implied_setup_whose_package_is_missing_is_a_usage_error_naming_it(monkeypatch):
    monkeypatch.setitem(cli.DEVICE_SETUPS, "sim", "no_such_package_here.sim:register")
    with pytest.raises(cli.UsageError, match=r"--device sim: the device is registered by no_such_package_here.sim:"
                                             r"register, and no_such_package_here is not installed here"):
        settings_of("--device", "sim")


def test_the_device_errors_close_every_parenthesis(monkeypatch):
    monkeypatch.delenv("DITORCH_BACKEND", raising=False)
    with pytest.raises(cli.UsageError) as unknown:
        settings_of("--device", "tpu")
    monkeypatch.setattr(cli, "run_setup", lambda setup: None)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    with pytest.raises(cli.UsageError) as missing:
        settings_of()
    for message in (str(unknown.value), str(missing.value)):
        depth = 0
        for char in message:
            depth += {"(": 1, ")": -1}.get(char, 0)
            assert depth >= 0, message
        assert depth == 0, message
    assert "--device 'tpu' is not a device torch knows" in str(unknown.value) and "--setup" in str(unknown.value)
    assert "--device sim" in str(missing.value) and "DITORCH_BACKEND=sim" in str(missing.value)


GAP = "nn.functional.linear_cross_entropy.chunked"


def test_known_gaps_match_by_op_dtype_and_status_only():
    assert known_gaps.gap_of(row(GAP + "_none", "bfloat16", status="mismatch")) is not None
    assert known_gaps.gap_of(row(GAP, "float16", "backward", status="mismatch")) is not None
    assert known_gaps.gap_of(row(GAP, "float32", status="mismatch")) is None  # float32 accumulates in float32
    assert known_gaps.gap_of(row(GAP, "bfloat16", status="crash")) is None    # a crash is never this gap
    assert known_gaps.gap_of(row("nn.functional.linear", "bfloat16", status="mismatch")) is None


def test_a_known_gap_is_marked_in_the_console_and_csv_and_still_fails(tmp_path):
    rows = known_gaps.mark([row(GAP, "bfloat16", status="mismatch", sample=126, detail="error 0.0473"),
                            row(GAP, "bfloat16", "backward", status="mismatch"), row("atan2", status="mismatch"),
                            row("add")])
    text = report.summary(rows, "title")
    marks = re.findall(r"^\|\s*(\S+)\s*\|\s*\w+\s*\|\s*(\w+)\s*\|\s*(mismatch(?: \(known gap\))?)\s*\|", text, re.M)
    assert marks == [(GAP, "forward", "mismatch (known gap)"), (GAP, "backward", "mismatch (known gap)"),
                     ("atan2", "forward", "mismatch")]
    assert "2 of them are known gaps" in text
    assert f"  {GAP}* in float16, bfloat16 (2 rows): PyTorch accumulates" in text
    assert "3 rows failed (3 mismatch, 0 unsupported, 0 crash), 2 of them known gaps" in text
    assert report.verdict(rows) == "found" and report.pass_rate(collections.Counter(r.status for r in rows)) == 0.25
    path = str(tmp_path / "conformance.csv")
    write_csv(path, rows)
    with open(path, newline="", encoding="utf-8") as f:
        marked = {(r["op"], r["direction"]): r["known_gap"] for r in csv.DictReader(f)}
    assert marked[(GAP, "forward")].startswith("PyTorch accumulates") and marked[("atan2", "forward")] == ""
    assert [r.known_gap for r in read_csv(path)] == [r.known_gap for r in rows]


def test_mm_is_written_under_its_own_name_not_its_twin_spmms():
    # torch.mm == torch.spmm (one C function, two names): torch's name table gave the conformance CSV's torch_name and
    # the captured call's name as torch.spmm
    from torch.testing._internal.common_methods_invocations import op_db

    from op_tools.offline.conformance.opinfos import replay_name

    by_name = {opinfo.name: opinfo for opinfo in op_db}
    assert replay_name(by_name["mm"]) == "torch.mm"
    assert replay_name(by_name["matmul"]) == "torch.matmul"
