"""Two recorded runs of a tiny Llama, on the CPU and on sim, compared: the first divergence and its layer."""

import csv
import json
import math
import os
import re
import signal
import subprocess
import sys
from unittest import mock

import pytest
import torch
from browser import needs_browser, open_once, require_browser
from subprocess_env import child_env
from tiny_models import tiny_llama

import op_tools
from op_tools.offline.compare_runs import Tolerances, compare
from op_tools.offline.compare_runs.html_view import render
from op_tools.offline.compare_runs.verdict import DEFAULT_TOLERANCES, difference

FAULTY_OP = "model.layers.1.mlp.act_fn"  # the silu of layer 1's MLP


def _record(folder, device, *, autocast=None, fault=None, fault_in=FAULTY_OP, backward_fault=None, extra_float=False):
    """One AdamW step of a tiny Llama on ``device``, recorded in ``folder``.

    ``fault``: a sim fault spec active only while the module ``fault_in`` runs its forward; ``backward_fault``: one
    active while the backward of layer 1's down_proj runs (armed by hooks on its output's and input's gradients).
    ``extra_float``: an additional ``.float()`` on the input of layer 1's MLP.
    """
    import ditorch.sim

    torch.manual_seed(0)
    model = tiny_llama().to(device)
    ids = torch.randint(0, 128, (2, 16)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    mlp = model.model.layers[1].mlp
    hooks = []
    if fault:
        faulty = model.get_submodule(fault_in)
        hooks.append(faulty.register_forward_pre_hook(lambda *_: ditorch.sim.set_faults(fault)))
        hooks.append(faulty.register_forward_hook(lambda *_: ditorch.sim.clear_faults()))
    if backward_fault:
        def arm(_, args, out):
            out.register_hook(lambda _: ditorch.sim.set_faults(backward_fault))
            args[0].register_hook(lambda _: ditorch.sim.clear_faults())

        hooks.append(mlp.down_proj.register_forward_hook(arm))
    if extra_float:
        hooks.append(mlp.register_forward_pre_hook(lambda _, args: (args[0].float(),)))
    env = {"OP_CAPTURE_MODE": "stats", "OP_TOOLS_RESULTS_DIR": str(folder), "OP_TOOLS_VERBOSE": "0"}
    with mock.patch.dict(os.environ, env), op_tools.OpCapture():
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=autocast is not None):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
    for hook in hooks:
        hook.remove()
    return str(folder)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, sim):
    """Recordings made once for the module, by name."""
    made = {}

    def get(name, device, **options):
        if name not in made:
            made[name] = _record(tmp_path_factory.mktemp(name), device, **options)
        return made[name]

    return get


def _cpu(runs):
    return runs("cpu", "cpu")


def test_clean_runs_on_cpu_and_sim_do_not_diverge(runs):
    result = compare(_cpu(runs), runs("sim", "sim"))
    assert result.divergences == []
    assert sum(not r.structural for r in result.rows) > 400
    assert {r.a["device"] for r in result.rows if r.a} == {"cpu"}
    on_sim = [r for r in result.rows if r.b and r.b["device"] == "sim:0"]
    assert len(on_sim) > 0.9 * len(result.rows)


def test_a_forward_fault_in_layer_1_mlp_is_named_as_the_first_forward_divergence(runs):
    result = compare(_cpu(runs), runs("sim_fault", "sim", fault="silu:noise=1e-3"))
    first = result.first_divergence()
    assert (first.phase, first.module, first.op) == ("forward", FAULTY_OP, "torch.nn.functional.silu")
    assert first.detail.startswith("outputs[0]") and first.difference > 5 * first.tolerance
    # the layers before it agree
    assert not any(r.diverged for r in result.rows if r.position < first.position)


def test_a_backward_fault_in_layer_1_mlp_is_named_as_the_first_backward_divergence(runs):
    result = compare(_cpu(runs), runs("sim_backward_fault", "sim", backward_fault="mm:noise=1e-3"))
    assert result.first_divergence("forward") is None
    first = result.first_divergence("backward")
    assert (first.module, first.op) == ("model.layers.1.mlp.down_proj", "torch.nn.functional.linear")
    assert first.detail.startswith("grad_inputs")
    assert result.first_divergence() is first  # before the optimizer step that the gradients then change


def test_an_inserted_float_call_is_a_structural_difference_and_changes_no_verdict(runs):
    clean = compare(_cpu(runs), runs("sim", "sim"))
    result = compare(_cpu(runs), runs("sim_float", "sim", extra_float=True))
    def structural(comparison):
        return [(r.match, r.phase, r.module, r.op) for r in comparison.structural]

    added = structural(result)
    for row in structural(clean):  # sim's own differences from the CPU (a backward contiguous copy)
        added.remove(row)
    assert added == [("only B", "forward", "model.layers.1.mlp", "torch.Tensor.float")]
    assert result.first_structural.op == "torch.Tensor.float"  # the first: the others are in backward
    assert result.divergences == []

    def verdicts(comparison):
        return [(r.module, r.op, r.a["index"], r.difference) for r in comparison.rows if not r.structural]

    assert verdicts(result) == verdicts(clean)


def test_bf16_autocast_on_sim_against_fp32_on_cpu_diverges_only_with_a_fault(runs):
    clean = compare(_cpu(runs), runs("sim_bf16", "sim", autocast=torch.bfloat16))
    assert clean.divergences == []
    assert any(r.b and any(t[1] == "bfloat16" for t in r.b["outputs"]) for r in clean.rows if r.phase == "forward")
    # A 1e-2 error is a few bfloat16 roundings: told apart from them where it is exact, in a float32 op (under
    # autocast, the RMSNorm before layer 1's MLP); bfloat16's own rounding of a faulty bfloat16 output can hide
    # half of it (docs/tools/compare_runs.md, "What statistics can tell").
    norm = "model.layers.1.post_attention_layernorm"
    faulty = compare(_cpu(runs), runs("sim_bf16_fault", "sim", autocast=torch.bfloat16, fault="rsqrt:noise=1e-2",
                                      fault_in=norm))
    first = faulty.first_divergence()
    assert (first.phase, first.module, first.op) == ("forward", norm, "torch.rsqrt")
    assert [r for r in faulty.divergences if r.phase == "forward"] == [first]  # what follows carries it


def test_runs_of_different_dtypes_say_so_in_the_closing_line_and_what_the_lower_precision_cannot_see(runs, tmp_path):
    # float32 on the CPU against bf16 autocast on sim: every pair is judged at its lower precision's tolerance, so a
    # 1e-3 fault in a bfloat16 op would be unseen; a clean verdict says so, never a plain "the runs agree"
    run_a, run_b = _cpu(runs), runs("sim_bf16", "sim", autocast=torch.bfloat16)
    result = compare(run_a, run_b)
    changed, pairs, kinds = result.dtype_changes()
    assert result.verdict() == "clean" and 0 < changed < pairs and ("float32", "bfloat16") in kinds
    assert compare(run_a, runs("sim", "sim")).dtype_changes()[0] == 0
    assert f"at the lower precision&#x27;s tolerance where the dtypes differ ({changed} pairs)" in render(result)
    done = _cli(run_a, run_b, "--csv", str(tmp_path / "c.csv"))
    assert done.returncode == 0, done.stdout + done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith(f"WARNING: the runs' dtypes differ in {changed} of {pairs} aligned pairs (float32 in A "
                           "against bfloat16 in B ("), last
    assert last.endswith("each is judged at its lower precision's tolerance, so a difference below bfloat16's "
                         "(0.005) cannot be seen"), last


def test_tolerances_are_read_from_the_variables(runs, monkeypatch):
    faulty = runs("sim_fault", "sim", fault="silu:noise=1e-3")
    monkeypatch.setenv("OP_COMPARE_RUNS_TOLERANCES", "float32=0.1")
    assert compare(_cpu(runs), faulty).divergences == []
    assert Tolerances.from_env().by_dtype["bfloat16"] == DEFAULT_TOLERANCES["bfloat16"]  # the others keep theirs
    monkeypatch.setenv("OP_COMPARE_RUNS_TOLERANCES", "float32:1")
    with pytest.raises(ValueError, match="OP_COMPARE_RUNS_TOLERANCES='float32:1'"):
        Tolerances.from_env()


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "op_tools.compare_runs", *args], capture_output=True, text=True,
                          env=child_env({"OP_TOOLS_VERBOSE": "1", **(env or {})}), timeout=120)


NUMBER = r"([\d.e+-]+)"


def test_the_command_line_reports_saves_a_csv_and_exits_3_on_a_divergence(runs, tmp_path):
    done = _cli(_cpu(runs), runs("sim_fault", "sim", fault="silu:noise=1e-3"), "--csv", str(tmp_path / "c.csv"))
    assert done.returncode == 3, done.stderr
    # the line says why: the silu's outputs differ by more than its inputs (equal in both runs) explain
    line = re.search(rf"first divergence in forward: step 0 forward {FAULTY_OP} #0 torch.nn.functional.silu: "
                     rf"outputs\[0\] \w+ differs by {NUMBER}, more than the {NUMBER} its inputs explain \(tolerance "
                     rf"{NUMBER} \+ 2 x its inputs' {NUMBER}\)\n", done.stdout)
    assert line, done.stdout
    difference, allowed, tolerance, carried = (float(x) for x in line.groups())
    assert difference > allowed == pytest.approx(tolerance + 2 * carried, rel=1e-2)
    assert "already differed" not in done.stdout and "that its inputs do not explain" not in done.stdout
    with open(tmp_path / "c.csv") as f:
        rows = list(csv.DictReader(f))
    diverged = [r for r in rows if r["diverged"] == "1"]
    assert diverged[0]["module"] == FAULTY_OP and diverged[0]["op_a"] == diverged[0]["op_b"]
    clean = _cli(_cpu(runs), runs("sim", "sim"), env={"OP_TOOLS_RESULTS_DIR": str(tmp_path / "r")})
    assert clean.returncode == 0, clean.stderr
    assert "first divergence in forward: none" in clean.stdout
    assert any(f.endswith(".csv") for f in os.listdir(tmp_path / "r" / "compare_runs"))


def test_the_command_line_refuses_a_recording_of_a_newer_format_with_exit_2(runs, tmp_path):
    from op_tools.output.run_recording import FORMAT_VERSION, find_recording

    lines = open(find_recording(_cpu(runs))).read().splitlines()
    header = json.loads(lines[0])
    header["version"] = FORMAT_VERSION + 1
    newer = tmp_path / "run_newer.jsonl"
    newer.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    done = _cli(_cpu(runs), str(newer))
    assert done.returncode == 2
    assert f"format version {FORMAT_VERSION + 1}, written by a newer op_tools" in done.stderr


# The page's state at load, then with only the blocks with differences, then after its banner's button; put back.
VIEW_PROBE = """
const banner = document.getElementById("banner"), table = document.getElementById("rows");
const blocks = [...table.tBodies];
const saved = blocks.map(b => b.className);
const shown = selector => [...document.querySelectorAll(selector)].filter(e => e.offsetParent !== null);
const state = () => ({blocks: shown("#rows tbody").length, calls: shown("tr.call").length,
    open: blocks.filter(b => !b.classList.contains("collapsed")).map(b => b.rows[0].textContent),
    clean_shown: shown("#rows tbody").filter(b => b.dataset.differences === "0").length});
const result = {inner_width: window.innerWidth, load: {scroll_y: window.scrollY, ...state()},
                banner_position: getComputedStyle(banner).position};
window.scrollTo(0, document.documentElement.scrollHeight);
result.scrolled = {scroll_y: window.scrollY, banner_top: banner.getBoundingClientRect().top};
window.scrollTo(0, 0);
document.getElementById("focus").click();
result.focus = state();
document.getElementById("go-first").click();
const first = document.getElementById("first-difference").getBoundingClientRect();
result.go_first = {scroll_y: window.scrollY, row_top: first.top, banner_bottom: banner.getBoundingClientRect().bottom};
blocks.forEach((b, i) => { b.className = saved[i]; });
window.scrollTo(0, 0);
return result;
"""


@pytest.fixture(scope="module")
def view(runs, tmp_path_factory):
    """The HTML view of the CPU run against sim's with the silu fault and an inserted ``.float()``, opened once in
    chromium at 1400 x 1000: ``(result, page text, DOM, what VIEW_PROBE measured)``; its screenshot is
    compare_runs.png in the test's folder (and in $OP_TOOLS_TEST_ARTEFACTS)."""
    browser = require_browser()
    result = compare(_cpu(runs), runs("sim_float_fault", "sim", extra_float=True, fault="silu:noise=1e-3"))
    folder = tmp_path_factory.mktemp("view")
    page = folder / "view.html"
    page.write_text(render(result), encoding="utf-8")
    dom, probe = open_once(browser, str(page), str(folder / "compare_runs.png"), VIEW_PROBE)
    return result, page.read_text(), dom, probe


@needs_browser
def test_the_html_view_shows_both_runs_aligned_with_the_first_divergence_highlighted(view):
    result, text, dom, _ = view
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", text)  # nothing fetched from elsewhere
    rows = re.findall(r'<tr class="call( [a-z ]+)?" id="[\w-]+">(.*?)</tr>', dom)
    assert len(rows) == len(result.rows)
    first = re.search(r'<tr class="call diverged first" id="first-difference">(.*?)</tr>', dom).group(1)
    assert re.match(r'<td class="op">torch\.nn\.functional\.silu #0 \(cpu\)</td><td class="tensors">[^<]*</td>'
                    r'<td class="diff">[^<]*</td><td class="op">torch\.nn\.functional\.silu #0 \(sim:0\)</td>', first)
    assert '<tr class="block has-divergence"><td colspan="6">step 0 forward model.layers.1.mlp.act_fn</td>' in dom
    inserted = re.search(r'<tr class="call structural" id="row-\d+"><td class="missing"></td><td class="missing">'
                         r'</td><td class="diff">only B</td><td class="op">torch\.Tensor\.float #0 \(sim:0\)</td>', dom)
    assert inserted


@needs_browser
def test_the_html_view_opens_on_a_fixed_banner_with_the_verdict_and_where_the_runs_first_part(view):
    result, _, dom, probe = view
    diverged = len(result.divergences)
    assert re.search(rf'<header id="banner" class="verdict-found">.*?<h1 id="verdict">The runs diverge: {diverged} of '
                     rf'{len(result.compared)} compared pairs diverged</h1>', dom)
    fields = dict(re.findall(r'<span class="field" data-field="(\w+)"><span class="field-name">\w+</span>'
                             r'<code>([^<]*)</code>', dom))
    assert fields == {"step": "0", "phase": "forward", "module": FAULTY_OP, "op": "torch.nn.functional.silu #0"}
    assert re.search(r'<p class="banner-line">why: outputs\[0\] \w+ differs by [\d.e-]+, more than', dom)
    assert "<ul" not in dom  # the verdict is a headline and a table of its lines, no bullets
    assert re.search(r"<tr><th>first structural difference</th><td>step 0 forward model.layers.1.mlp #0 "
                     r"torch.Tensor.float runs in B only</td></tr>", dom)
    assert probe["inner_width"] == 1400 and probe["banner_position"] == "sticky"
    assert probe["load"]["scroll_y"] == 0  # nothing scrolls the page away from its banner on load
    assert probe["scrolled"]["scroll_y"] > 0 and probe["scrolled"]["banner_top"] == 0  # it stays on top


@needs_browser
def test_the_html_view_opens_with_only_the_first_divergence_block_expanded_and_hides_clean_blocks_on_request(view):
    result, _, dom, probe = view
    block = "step 0 forward model.layers.1.mlp.act_fn"
    assert probe["load"]["open"] == [block]
    assert probe["load"]["calls"] == sum(
        r.step == 0 and r.phase == "forward" and r.module == FAULTY_OP for r in result.rows)
    differing = {(r.step, r.phase, r.module) for r in result.rows if r.diverged or r.structural or r.not_compared}
    # only blocks with differences: the others are hidden, headers too; those shown are opened
    assert probe["focus"]["clean_shown"] == 0 and probe["load"]["clean_shown"] > 0
    assert 0 < probe["focus"]["blocks"] < probe["load"]["blocks"] // 4
    assert probe["focus"]["blocks"] >= len(differing)  # a module's calls can form more than one block
    assert re.search(rf"{len(result.rows)} rows in \d+ blocks, {probe['focus']['blocks']} with differences", dom)
    # the banner's button goes to the row, below the banner, not under it
    go = probe["go_first"]
    assert go["scroll_y"] > 0 and go["row_top"] >= go["banner_bottom"]
    assert '<button id="go-first" type="button">show it</button>' in dom


# --- the account: every aligned pair compared, or not compared and said so (exit 4) ---

def _record_small(folder, monkeypatch):
    """A few CPU calls recorded; ``to_sparse``'s output has no statistics (a sparse tensor cannot be summed up)."""
    monkeypatch.setenv("OP_CAPTURE_MODE", "stats")
    monkeypatch.setenv("OP_TOOLS_RESULTS_DIR", str(folder))
    x = torch.linspace(-1, 1, 16).reshape(4, 4)
    with op_tools.OpCapture() as capture:
        y = torch.relu(x) * 2
        y.to_sparse()
        torch.sin(y).sum()
    return capture.recorder.file.path


def test_what_a_call_writes_without_reading_it_is_no_input_that_differed(sim, tmp_path, monkeypatch):
    # A GPU's torch.empty returns freed memory, different from run to run (sim's empty:nan fault in run A only):
    # an out= tensor, or copy_'s target, holding it before the call is not an input that differed.
    import contextlib

    import ditorch.sim

    monkeypatch.setenv("OP_CAPTURE_MODE", "stats")
    paths = []
    for run, fault in (("a", "empty:nan;empty_like:nan"), ("b", None)):
        monkeypatch.setenv("OP_TOOLS_RESULTS_DIR", str(tmp_path / run))
        x = torch.linspace(-1, 1, 64).to(sim)
        with ditorch.sim.faults(fault) if fault else contextlib.nullcontext(), op_tools.OpCapture() as capture:
            buffer = torch.empty(64, device=sim)
            torch.mul(x, 2, out=buffer)
            torch.empty_like(x).copy_(buffer).sin()
        paths.append(capture.recorder.file.path)
    result = compare(*paths)
    assert result.divergences == [] and len(result.compared) == 3 and len(result.skipped) == 2, result.divergences
    # nor a module's largest difference (it was inf: run A's fresh memory held nan)
    (module,) = result.modules()
    assert module["max_output_diff"] == 0.0, module


def test_a_call_whose_statistics_a_run_could_not_record_is_not_compared_but_named_and_exits_4(tmp_path, monkeypatch):
    a, b = _record_small(tmp_path / "a", monkeypatch), _record_small(tmp_path / "b", monkeypatch)
    result = compare(a, b)
    assert [r.op for r in result.not_compared] == ["torch.Tensor.to_sparse"]
    assert "run A has no statistics (UnsupportedInputError: sparse tensors are not measured)" in \
        result.not_compared[0].not_compared
    assert result.divergences == [] and result.verdict() == "unchecked"
    assert len(result.compared) == 4
    page = render(result)  # the view shows the pair, in grey, with its reason, and the WARNING
    assert '"unchecked":true' in page and "<tr><th>WARNING</th><td>1 aligned pair not compared" in page
    # its banner: no divergence, but not all compared, and the first pair not compared (it opens on its block)
    assert ('<header id="banner" class="verdict-unchecked"><div class="page-title">compare_runs: two runs side by '
            'side</div><h1 id="verdict">No divergence among the 4 compared pairs, but not all were compared, 1 not '
            'compared</h1><div class="where"><span class="where-label">first pair not compared</span>') in page
    assert '<span class="field" data-field="op"><span class="field-name">op</span><code>torch.Tensor.to_sparse #2' \
        in page and '<p class="banner-line">why: run A has no statistics (UnsupportedInputError: sparse' in page
    assert 'data-field="rank"' not in page  # recorded without torchrun: no rank to name
    result.header_a["rank"], result.header_b["rank"] = 0, 1  # rank 0 of one run against rank 1 of another
    assert '<span class="field" data-field="rank"><span class="field-name">rank</span><code>A 0, B 1</code>' in \
        render(result)
    done = _cli(a, b, "--csv", str(tmp_path / "c.csv"))
    assert done.returncode == 4, done.stderr
    assert "first divergence in forward: none among the pairs compared (1 not compared)" in done.stdout
    assert "first divergence in forward: none\n" not in done.stdout
    assert "compared: 4 (4 agree, 0 diverged); not compared: 1" in done.stdout
    assert done.stdout.strip().splitlines()[-1].startswith(
        "WARNING: 1 aligned pair not compared, the first step 0 forward (no module) #2 torch.Tensor.to_sparse: run A "
        "has no statistics (UnsupportedInputError: sparse")
    with open(tmp_path / "c.csv") as f:
        rows = {r["op_a"]: r for r in csv.DictReader(f)}
    assert rows["torch.Tensor.to_sparse"]["difference"] == "" and rows["torch.Tensor.to_sparse"]["not_compared"]


def test_damaged_lines_of_a_recording_are_counted_never_taken_for_agreement_and_a_divergence_still_wins(
        tmp_path, monkeypatch):
    a = _record_small(tmp_path / "a", monkeypatch)
    lines = open(a).read().splitlines(keepends=True)
    damaged = tmp_path / "run_damaged.jsonl"
    # line 3 (relu * 2) cut in the middle, a record without its op after it; the calls after them still compare
    damaged.write_text("".join([*lines[:2], lines[2][:50] + "\n", '{"seq": 1, "phase": "forward"}\n', *lines[3:]]))
    result = compare(a, str(damaged))
    (run, count, first), = result.unreadable()
    assert (run, count) == ("B", 2) and first.startswith("line 3: not JSON (")
    assert result.verdict() == "unchecked" and result.divergences == []
    assert [r.op for r in result.compared] == ["torch.relu", "torch.sin", "torch.Tensor.sum"]  # read past the damage
    done = _cli(a, str(damaged), "--csv", str(tmp_path / "c.csv"))
    assert done.returncode == 4, done.stderr
    assert "first divergence in forward: none among the pairs compared (1 not compared, and damaged lines)" \
        in done.stdout
    assert "WARNING: run B: 2 damaged lines (calls not compared), the first line 3: not JSON" in done.stdout
    # a divergence found is the verdict (exit 3), what was not compared is still said
    sin = next(i for i, line in enumerate(lines) if '"op":"torch.sin"' in line)
    record = json.loads(lines[sin])
    record["outputs"][0][4] *= 1.5  # its maximum
    changed = tmp_path / "run_changed.jsonl"
    changed.write_text("".join([*lines[:2], lines[2][:50] + "\n", *lines[3:sin], json.dumps(record) + "\n",
                                *lines[sin + 1:]]))
    done = _cli(a, str(changed), "--csv", str(tmp_path / "d.csv"))
    assert done.returncode == 3, done.stderr
    assert "first divergence in forward: step 0 forward (no module) #3 torch.sin: outputs[0] max" in done.stdout
    assert "WARNING: run B: 1 damaged line (calls not compared)" in done.stdout


# --- a divergence said with its reason: inputs that differed from the start, or outputs their inputs do not explain

def _record_embedding(folder, monkeypatch, weight_noise=0.0, scale=1.0):
    """An embedding and a linear layer, then ``sin(...) * scale``, recorded on the CPU; ``weight_noise`` changes the
    embedding's weight before the recording starts (as weights loaded differently would), ``scale`` the last op's
    result (an op that adds a difference of its own)."""
    monkeypatch.setenv("OP_CAPTURE_MODE", "stats")
    monkeypatch.setenv("OP_TOOLS_RESULTS_DIR", str(folder))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 16))
    ids = torch.randint(0, 32, (4, 8))
    with torch.no_grad():
        model[0].weight.mul_(1 + weight_noise * torch.linspace(-1, 1, 16))
    with op_tools.OpCapture() as capture:
        torch.sin(model(ids)) * scale
    return capture.recorder.file.path


def test_a_divergence_whose_inputs_already_differed_says_so_and_names_the_first_difference_they_do_not_explain(
        tmp_path, monkeypatch, capsys):
    from op_tools.offline.compare_runs import main

    a = _record_embedding(tmp_path / "a", monkeypatch)
    b = _record_embedding(tmp_path / "b", monkeypatch, weight_noise=3e-3, scale=1.01)
    result = compare(a, b)
    first = result.first_divergence("forward")
    assert first.op == "torch.nn.functional.embedding" and first.diverged
    assert first.inputs_differed_first and not first.outputs_unexplained
    assert first.carried > first.tolerance and first.carried_detail.startswith("inputs[1]")  # the weight
    assert first.verdict_detail == f"{first.carried_detail} (an input: the runs differed before this call)"
    later = result.first_unexplained("forward")
    assert later.op == "torch.Tensor.mul" and later.outputs_unexplained and not later.inputs_differed_first
    capsys.readouterr()
    assert main([a, b, "--csv", str(tmp_path / "c.csv")]) == 3  # found, in-process
    out = capsys.readouterr().out
    line = re.search(rf"first divergence in forward: step 0 forward 0 #0 torch.nn.functional.embedding: its inputs "
                     rf"already differed by {NUMBER} \(inputs\[1\] \w+\), more than the tolerance {NUMBER}, and no "
                     rf"recorded call before it differed: the difference came from outside the recording \(data, "
                     rf"weights, a call not recorded\); its outputs differ by {NUMBER}, within the {NUMBER} those "
                     rf"inputs explain \(tolerance {NUMBER} \+ 2 x its inputs' {NUMBER}\)\n", out)
    assert line, out
    carried, tolerance, difference, allowed, _, carried_again = (float(x) for x in line.groups())
    assert carried > tolerance and difference <= allowed and carried_again == carried
    assert re.search(r"first difference in forward that its inputs do not explain: step 0 forward \(no module\) #1 "
                     r"torch.Tensor.mul: outputs\[0\] \w+ differs by [\d.e-]+, more than the [\d.e-]+ its inputs "
                     r"explain", out), out
    with open(tmp_path / "c.csv") as f:
        embedding = next(r for r in csv.DictReader(f) if r["op_a"] == "torch.nn.functional.embedding")
    assert embedding["diverged"] == "1" and "(an input: the runs differed before this call)" in embedding["detail"]
    # the same inputs and nothing else: no later difference to name
    only_weights = _record_embedding(tmp_path / "w", monkeypatch, weight_noise=3e-3)
    capsys.readouterr()
    assert main([a, only_weights, "--csv", str(tmp_path / "w.csv")]) == 3
    assert "first difference in forward that its inputs do not explain: none\n" in capsys.readouterr().out


# --- outputs that cannot be written: a message and an exit status of their own (5), never a traceback

def test_an_output_folder_that_cannot_be_written_is_one_line_naming_it_and_exit_5(tmp_path, monkeypatch, capsys):
    from op_tools.offline.compare_runs import main
    from op_tools.offline.compare_runs.cli import _parser

    a = _record_embedding(tmp_path / "a", monkeypatch)
    (tmp_path / "a_file").write_text("")  # a file where a folder should be: unwritable even for root
    blocked = tmp_path / "a_file" / "sub"
    for args, results_dir, wanted in (
            (["--csv", str(blocked / "c.csv")], tmp_path, f"the CSV in {blocked} (--csv {blocked / 'c.csv'})"),
            (["--csv", str(tmp_path / "ok.csv"), "--html", str(blocked / "v.html")], tmp_path,
             f"the HTML view in {blocked} (--html {blocked / 'v.html'})"),
            ([], blocked, f"the CSV in {blocked / 'compare_runs'} (OP_TOOLS_RESULTS_DIR='{blocked}')")):
        monkeypatch.setenv("OP_TOOLS_RESULTS_DIR", str(results_dir))
        capsys.readouterr()
        assert main([a, a, *args]) == 5
        out, err = capsys.readouterr()
        assert err == (f"compare_runs: cannot write {wanted}: NotADirectoryError: Not a directory (a file stands "
                       "where a folder should be); choose a folder this process can write\n")
        assert out == ""  # tried before comparing
    # the variable naming a file itself: it failed to parse, a traceback and exit 1
    monkeypatch.setenv("OP_TOOLS_RESULTS_DIR", str(tmp_path / "a_file"))
    assert main([a, a]) == 5
    out, err = capsys.readouterr()
    assert err == (f"compare_runs: cannot write the CSV: OP_TOOLS_RESULTS_DIR='{tmp_path / 'a_file'}': exists and is "
                   "not a directory; expected a directory path\n")
    assert out == ""
    assert "5 the CSV or the HTML view cannot be written" in " ".join(_parser().format_help().split())


def test_a_file_that_fails_after_the_folder_passed_its_trial_still_prints_the_verdict_and_exits_5(
        tmp_path, monkeypatch, capsys):
    import errno

    from op_tools.offline.compare_runs import main
    from op_tools.output import result_files

    a = _record_embedding(tmp_path / "a", monkeypatch)
    b = _record_embedding(tmp_path / "b", monkeypatch, scale=1.01)
    full = OSError(errno.ENOSPC, "No space left on device")
    with mock.patch.object(result_files, "write_text", side_effect=full):
        assert main([a, b, "--csv", str(tmp_path / "c.csv")]) == 5
    out, err = capsys.readouterr()
    assert "first divergence in forward: step 0 forward (no module) #1 torch.Tensor.mul" in out
    assert f"saved {tmp_path / 'c.csv'}" in out and "c.html" not in out
    assert err == (f"compare_runs: cannot write the HTML view in {tmp_path / 'c.html'} (--csv {tmp_path / 'c.csv'}): "
                   "OSError: No space left on device; choose a folder this process can write\n")


def test_a_failure_of_compare_runs_itself_exits_1_as_a_crash_not_as_a_verdict(tmp_path, monkeypatch, capsys):
    from op_tools.offline.compare_runs import cli, main

    a = _record_embedding(tmp_path / "a", monkeypatch)
    with mock.patch.object(cli, "compare", side_effect=RuntimeError("a bug")):
        assert main([a, a, "--csv", str(tmp_path / "c.csv")]) == 1
    assert "the comparison failed (a bug of compare_runs): nothing compared" in capsys.readouterr().err


# --- what a run holds and the other does not: never a clean verdict ---

def _recording_lines(folder) -> list[str]:
    from op_tools.output.run_recording import find_recording

    return open(find_recording(folder)).read().splitlines(keepends=True)


def test_a_recording_with_no_call_compares_nothing_and_exits_4_not_agreeing(runs, tmp_path):
    lines = _recording_lines(runs("sim", "sim"))  # a run whose OP_CAPTURE_LIST matched nothing, or died at once
    empty = tmp_path / "run_empty.jsonl"
    empty.write_text(lines[0] + '{"end": {"records": 0, "bytes": 0}}\n')
    result = compare(str(empty), runs("sim", "sim"))
    assert result.compared == [] and result.verdict() == "unchecked"
    assert len(result.past_other_run) == len(lines) - 2  # every call of B: A's recording ends before them
    assert "The runs agree" not in render(result)
    assert '<h1 id="verdict">No divergence among the 0 compared pairs, but not all were compared, ' in render(result)
    done = _cli(str(empty), runs("sim", "sim"), "--csv", str(tmp_path / "c.csv"))
    assert done.returncode == 4, done.stdout + done.stderr
    assert "first divergence in forward: none\n" not in done.stdout
    assert re.search(r"first divergence in forward: none among the pairs compared \(\d+ past the other run's end\)",
                     done.stdout), done.stdout
    assert done.stdout.strip().splitlines()[-2:] == [
        f"WARNING: {len(lines) - 2} calls of run B not compared: run A's recording ends before them, the first step 0 "
        "forward model.embed_tokens #0 torch.nn.functional.embedding",
        f"WARNING: no pair of calls compared (run A holds 0 calls, run B {len(lines) - 2} calls)"]
    # two recordings of no call: nothing compared is no agreement either
    nothing = compare(str(empty), str(empty))
    assert nothing.rows == [] and nothing.verdict() == "unchecked"


def test_a_recording_cut_short_before_the_fault_is_not_clean_and_names_what_was_not_compared(runs, tmp_path):
    lines = _recording_lines(runs("sim_fault", "sim", fault="silu:noise=1e-3"))
    silu = next(n for n, line in enumerate(lines) if f'"module":"{FAULTY_OP}"' in line and '"phase":"forward"' in line)
    assert compare(_cpu(runs), runs("sim_fault", "sim", fault="silu:noise=1e-3")).verdict() == "found"
    # the run died before the faulty silu: a .partial file, its last line cut in the middle
    died = tmp_path / "died" / "run_x.jsonl.partial"
    died.parent.mkdir()
    died.write_text("".join(lines[:silu]) + lines[silu][:40])
    result = compare(_cpu(runs), str(died))
    assert result.divergences == [] and result.verdict() == "unchecked"
    assert result.incomplete() == [("B", "partial: the run did not stop its tool, its last line was cut short; its "
                                         "later calls are not in it")]
    first = result.past_other_run[0]
    assert (first.match, first.module, first.op) == ("only A", FAULTY_OP, "torch.nn.functional.silu")
    assert {r.match for r in result.past_other_run} == {"only A"} and len(result.past_other_run) > 300
    page = render(result)
    assert "The runs agree" not in page and "past the other run&#x27;s end, run B&#x27;s recording incomplete" in page
    done = _cli(_cpu(runs), str(died.parent), "--csv", str(tmp_path / "c.csv"))
    assert done.returncode == 4, done.stdout + done.stderr
    assert "WARNING: run B's recording is incomplete (partial: the run did not stop its tool" in done.stdout
    assert re.search(rf"WARNING: \d+ calls of run A not compared: run B's recording ends before them, the first step 0 "
                     rf"forward {FAULTY_OP} #0 torch.nn.functional.silu\n", done.stdout), done.stdout
    with open(tmp_path / "c.csv") as f:
        silu_row = next(r for r in csv.DictReader(f) if r["module"] == FAULTY_OP and r["phase"] == "forward")
    assert silu_row["not_compared"] == "run B's recording ends before it: not compared"
    # a complete file that lost lines (its end marker counts more records than it holds) is no whole run either
    lost = tmp_path / "run_lost.jsonl"
    lost.write_text("".join(lines[:silu]) + lines[-1])
    result = compare(_cpu(runs), str(lost))
    assert result.verdict() == "unchecked"
    assert result.incomplete() == [("B", f"its end marker counts {len(lines) - 1 - silu} more records than it holds: "
                                         "lines lost")]
    # cut after the fault: the divergence found is the verdict
    after = tmp_path / "run_after.jsonl.partial"
    after.write_text("".join(lines[:silu + 1]))
    assert compare(_cpu(runs), str(after)).verdict() == "found"


def _record_steps(folder, monkeypatch, steps: int, raise_at: int | None = None) -> str:
    """``steps`` steps of a few CPU calls recorded; ``raise_at``: the step at whose start an exception leaves the
    tool's with-block (the run dies)."""
    monkeypatch.setenv("OP_CAPTURE_MODE", "stats")
    monkeypatch.setenv("OP_TOOLS_RESULTS_DIR", str(folder))
    x = torch.linspace(-1, 1, 16).reshape(4, 4)
    with op_tools.OpCapture() as capture:
        for step in range(steps):
            if step == raise_at:
                raise RuntimeError("device lost")
            torch.sin(x * (step + 1)).sum()
    return capture.recorder.file.path


DYING_SCRIPTS = {  # a step of a few calls, then the run dies: how it dies, the exit status
    "sigterm": ("""
import os, signal
x = torch.linspace(-1, 1, 16).reshape(4, 4)
with op_tools.OpCapture(mode="stats"):
    torch.sin(x * 1).sum()
    os.kill(os.getpid(), signal.SIGTERM)
""", -signal.SIGTERM),
    # a tool never stopped, at the exit of a program an exception ended: the exit handler marks it
    "uncaught": ("""
x = torch.linspace(-1, 1, 16).reshape(4, 4)
op_tools.OpCapture(mode="stats").start()
torch.sin(x * 1).sum()
raise RuntimeError("device lost")
""", 1),
}


def test_an_uncaught_error_held_before_the_tool_started_does_not_mark_a_normal_exit(tmp_path, run_script):
    # sys.last_value outlives the error it holds (pytest sets it for each failed test, an interactive session keeps
    # it): a tool never stopped marked a normal exit as ended by that old error
    script = """
import sys
sys.last_value = sys.last_exc = RuntimeError("an earlier test's")
op_tools.OpCapture(mode="stats").start()
torch.sin(torch.ones(3)).sum()
"""
    done = run_script(script, {"OP_TOOLS_RESULTS_DIR": str(tmp_path / "run")})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ended_by" not in _recording_lines(tmp_path / "run")[-1]


def test_a_run_ended_by_an_exception_or_sigterm_is_an_incomplete_recording_never_agreeing(tmp_path, monkeypatch,
                                                                                          run_script):
    # Each run dies at the start of its second step; against a clean run of one step, what each recorded agrees,
    # and its file is whole (its end marker written on the way out), but the run is not: never "the runs agree".
    one = _record_steps(tmp_path / "one", monkeypatch, 1)
    with pytest.raises(RuntimeError, match="device lost"):
        _record_steps(tmp_path / "raised", monkeypatch, 2, raise_at=1)
    deaths = {"raised": ("an exception (RuntimeError: device lost)", _recording_lines(tmp_path / "raised"))}
    for name, (script, status) in DYING_SCRIPTS.items():
        done = run_script(script, {"OP_TOOLS_RESULTS_DIR": str(tmp_path / name)})
        assert done.returncode == status, done.stderr[-2000:]
        deaths[name] = ("SIGTERM" if name == "sigterm" else "an exception (RuntimeError: device lost)",
                        _recording_lines(tmp_path / name))
    for name, (how, lines) in deaths.items():
        assert json.loads(lines[-1])["end"].get("ended_by") == how, (name, lines[-1])
        result = compare(one, str(tmp_path / name))
        assert result.divergences == [] and len(result.compared) == 3 and result.verdict() == "unchecked", name
        assert result.incomplete() == [("B", f"the run ended by {how}; the calls it did not reach are not in it")]
        assert "The runs agree" not in render(result)
    done = _cli(one, str(tmp_path / "sigterm"), "--csv", str(tmp_path / "c.csv"))
    assert done.returncode == 4, done.stdout + done.stderr
    assert "(the run ended by SIGTERM)\n" in done.stdout
    assert "first divergence in forward: none among the pairs compared (an incomplete recording)" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == (
        "WARNING: run B's recording is incomplete (the run ended by SIGTERM; the calls it did not reach are not in it)")
    # a run that ended normally says nothing of it, as every recording before the field did
    assert "ended_by" not in _recording_lines(tmp_path / "one")[-1]
    assert compare(one, one).verdict() == "clean"
    from op_tools.offline.compare_runs.report import verdict_lines  # identical runs: no pair nearer than another

    assert "closest to diverging: none: every pair compared is equal to the bit" in verdict_lines(compare(one, one))


def _record_with_a_metric(folder, monkeypatch, ops: str | None = None, metric_scale: float = 2.0,
                          judged: bool = False) -> str:
    """A linear layer's loss and, beside it, a metric no recorded call reads (a softmax, scaled by ``metric_scale``:
    a fault in it; ``judged``: ended in a ``torch.allclose``, which returns no tensor); ``ops``: OP_CAPTURE_LIST."""
    monkeypatch.setenv("OP_CAPTURE_MODE", "stats")
    monkeypatch.setenv("OP_TOOLS_RESULTS_DIR", str(folder))
    if ops:
        monkeypatch.setenv("OP_CAPTURE_LIST", ops)
    else:
        monkeypatch.delenv("OP_CAPTURE_LIST", raising=False)
    x, w = torch.linspace(-1, 1, 32).reshape(4, 8), torch.linspace(-0.5, 0.5, 24).reshape(3, 8).requires_grad_()
    with op_tools.OpCapture() as capture:
        y = torch.nn.functional.linear(x, w)
        metric = torch.softmax(y.detach() * metric_scale, -1)
        torch.allclose(metric, metric * 2) if judged else metric.max()
        y.sum().backward()
    return capture.recorder.file.path


def test_calls_of_one_run_only_whose_results_reach_no_aligned_call_are_not_compared_and_op_lists_are_named(
        tmp_path, monkeypatch):
    # Run B recorded only the loss's ops (OP_CAPTURE_LIST), and its metric is wrong: run A's metric calls, in A only,
    # were compared with nothing. Never "the runs agree".
    every = _record_with_a_metric(tmp_path / "a", monkeypatch)
    listed = _record_with_a_metric(tmp_path / "b", monkeypatch, ops="torch.nn.functional.linear,torch.Tensor.sum",
                                   metric_scale=2.2)
    result = compare(every, listed)
    assert result.divergences == [] and result.verdict() == "unchecked"
    assert [r.op for r in result.unreached] == ["torch.Tensor.mul", "torch.softmax", "torch.Tensor.max"]
    assert {r.match for r in result.unreached} == {"only A"}
    assert result.recorded_ops() == "run A every op, run B OP_CAPTURE_LIST=torch.nn.functional.linear,torch.Tensor.sum"
    assert "The runs agree" not in render(result)
    done = _cli(every, listed, "--csv", str(tmp_path / "c.csv"))
    assert done.returncode == 4, done.stdout + done.stderr
    assert "recorded ops differ: run A every op, run B OP_CAPTURE_LIST=torch.nn.functional.linear,torch.Tensor.sum" \
        in done.stdout
    assert "of one run only reaching no aligned call: 3 (not compared)" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == (
        "WARNING: 3 calls of run A only not compared: what they computed reaches no call both runs recorded, the "
        "first step 0 forward (no module) #2 torch.Tensor.mul")
    # a call of one run only whose result an aligned call reads (detach, before the metric's mul) is compared
    # through it; the same selection in both runs compares every call, and says nothing of selections
    both = compare(listed, _record_with_a_metric(tmp_path / "c", monkeypatch,
                                                 ops="torch.nn.functional.linear,torch.Tensor.sum"))
    assert both.verdict() == "clean" and both.recorded_ops() == "" and both.rows and not both.structural
    # a metric ending in a call that returns no tensor (torch.allclose's bool) reaches nothing either: all([]) took
    # it, and the calls before it, for reached, and the runs agreed
    judged = compare(_record_with_a_metric(tmp_path / "d", monkeypatch, judged=True), listed)
    assert judged.verdict() == "unchecked" and [r.op for r in judged.unreached][-1] == "torch.allclose"
    # a recording made before headers said their selection: unknown, said only against a selection
    del result.header_a["ops"], result.header_a["disable"]
    assert result.recorded_ops().startswith("run A unknown (its recording does not say), run B OP_CAPTURE_LIST=")
    result.header_b.update(ops=None, disable=[])
    assert result.recorded_ops() == ""


def test_the_same_nan_in_both_runs_leaves_a_pair_not_compared_and_finite_extremes_still_compare(sim, tmp_path,
                                                                                               monkeypatch):
    import contextlib

    import ditorch.sim

    def record(run, bad, fault=None):
        monkeypatch.setenv("OP_CAPTURE_MODE", "stats")
        monkeypatch.setenv("OP_TOOLS_RESULTS_DIR", str(tmp_path / run))
        x = torch.linspace(-1, 1, 1000)
        x[0] = bad  # one element out of 1000
        x = x.to(sim)
        with ditorch.sim.faults(fault) if fault else contextlib.nullcontext(), op_tools.OpCapture() as capture:
            torch.mul(x, 3.0)  # run B: every element 10% off
        return capture.recorder.file.path

    nan = compare(record("a", float("nan")), record("b", float("nan"), "mul:noise=1e-1"))
    (row,) = nan.rows
    assert not row.diverged and nan.compared == [] and nan.verdict() == "unchecked"
    assert row.not_compared == "outputs[0] nan/inf 1/0 in both runs: its other values not compared"
    # with an inf, the minimum stays finite and is compared: the noise is found
    inf = compare(record("c", float("inf")), record("d", float("inf"), "mul:noise=1e-1"))
    assert inf.verdict() == "found" and inf.rows[0].detail == "outputs[0] min"


# --- alignment: a call one run inserts among like calls shifts the indices after it ---

def test_a_model_moved_to_the_device_while_recording_aligns_each_parameter_with_itself(sim, tmp_path, monkeypatch):
    # sim's Module.to makes a detach per parameter, the CPU's none: after the first one, the same index and op in
    # the module ("", its to) is the next parameter's, and pairing by it compared different tensors, the first of
    # them said to differ "from outside the recording" between two runs of the same numbers.
    from tiny_models import mlp

    monkeypatch.setenv("OP_CAPTURE_MODE", "stats")
    paths = []
    for device in ("cpu", sim):
        monkeypatch.setenv("OP_TOOLS_RESULTS_DIR", str(tmp_path / str(device)))
        torch.manual_seed(0)
        model, x = mlp(), torch.randn(4, 16)
        with op_tools.OpCapture() as capture:
            model.to(device)
            model(x.to(device)).sum()
        paths.append(capture.recorder.file.path)
    result = compare(*paths)
    moved = [r for r in result.rows if not r.structural and r.op == "torch.Tensor.to"]
    assert len(moved) == 7  # the 6 parameters and the input, each with itself
    assert all(r.a["inputs"][0][2] == r.b["inputs"][0][2] and r.difference == 0 for r in moved)
    assert [(r.match, r.op) for r in result.structural] == [("only B", "torch.Tensor.detach")] * 6
    assert result.divergences == [] and result.verdict() == "clean", [r.verdict_detail for r in result.divergences]


def test_the_same_nan_with_counts_unknown_in_one_run_is_not_compared_not_a_divergence(tmp_path, monkeypatch):
    # A tensor holding a NaN, written in place before its statistics were read back, has the counts -1 (unknown).
    # When they are read depends on the device (64 calls a copy, and when its event completes): here run B reads
    # each call's at once. The same NaN in both runs is no divergence: its values are not compared, and it says so.
    from op_tools.output import run_recording

    def record(run):
        monkeypatch.setenv("OP_CAPTURE_MODE", "stats")
        monkeypatch.setenv("OP_TOOLS_RESULTS_DIR", str(tmp_path / run))
        x = torch.linspace(-1, 1, 100)
        x[3] = float("nan")
        with op_tools.OpCapture() as capture:
            y = x * 2
            y.add_(1)  # y written before run A read its counts
            y.sum()
        return capture.recorder.file.path

    a = record("a")
    monkeypatch.setattr(run_recording, "READBACK_BATCH", 1)
    b = record("b")
    result = compare(a, b)
    mul = next(r for r in result.rows if r.op == "torch.Tensor.mul")
    assert mul.a["outputs"][0][7:9] == [-1, -1] and mul.b["outputs"][0][7:9] == [1, 0]  # the premise
    assert result.divergences == [] and result.verdict() == "unchecked"
    assert mul.not_compared == ("outputs[0] nan/inf ?/? vs 1/0 (? unknown: written in place before it was counted) "
                                "in both runs: its other values not compared")
    # a NaN in one run only is still a divergence, counted or not
    y = [0.0] * 22
    assert difference(["[0]", "float32", [4], *y[:4], -1, -1, *y[6:]], ["[0]", "float32", [4], *y])[0] == math.inf


def test_outputs_past_the_recorders_limit_are_not_compared_and_said_so_never_taken_for_agreement(sim, tmp_path,
                                                                                                  monkeypatch):
    # A foreach call over 20 tensors (an optimizer step over 20 parameters) recorded with a limit of 16 records the
    # first 16 of each side: run B's 19th differs by 1%, and no later call reads it. That pair's verdict covers 16 of
    # its 20 outputs.
    monkeypatch.setenv("OP_CAPTURE_MODE", "stats")
    monkeypatch.setenv("OP_CAPTURE_STATS_MAX_TENSORS", "16")

    def record(run, scale=1.0, bad=18):
        monkeypatch.setenv("OP_TOOLS_RESULTS_DIR", str(tmp_path / run))
        torch.manual_seed(0)
        xs = [torch.randn(8) for _ in range(20)]
        xs[bad] = xs[bad] * scale
        xs = [x.to(sim) for x in xs]
        with op_tools.OpCapture() as capture:
            torch._foreach_mul(xs, 2.0)
        return capture.recorder.file.path

    a = record("a")
    result = compare(a, record("b", 1.01))
    (row,) = result.rows
    assert row.b["omitted"] == {"inputs": 4, "outputs": 4}  # the premise: the 17th to 20th not recorded
    assert result.verdict() == "unchecked" and result.compared == []
    assert row.not_compared == ("outputs past OP_CAPTURE_STATS_MAX_TENSORS not recorded (4 in run A, 4 in run B; a "
                                "larger one records them): their values not compared")
    assert compare(a, record("c", 1.01, bad=3)).verdict() == "found"  # a difference among those recorded still is
    monkeypatch.delenv("OP_CAPTURE_STATS_MAX_TENSORS")  # by default a foreach step's lists are recorded whole
    assert compare(record("d"), record("e", 1.01)).verdict() == "found"


def test_two_runs_going_on_differently_after_their_last_aligned_pair_are_not_said_to_have_ended(sim, tmp_path,
                                                                                             monkeypatch):
    # One backend's optimizer steps per parameter, the other's in one foreach call: after the last pair aligned both
    # runs hold calls the other does not. Neither recording ended early, and the warning no longer says one did.
    monkeypatch.setenv("OP_CAPTURE_MODE", "stats")

    def record(run, foreach):
        monkeypatch.setenv("OP_TOOLS_RESULTS_DIR", str(tmp_path / run))
        xs = [torch.ones(4, device=sim) for _ in range(3)]
        with op_tools.OpCapture() as capture:
            torch.exp(xs[0])
            if foreach:
                torch._foreach_add_(xs, 1.0)
            else:
                for x in xs:
                    x.add_(1.0)
        return capture.recorder.file.path

    a, b = record("a", foreach=False), record("b", foreach=True)
    result = compare(a, b)
    assert {r.match for r in result.past_other_run} == {"only A", "only B"} and result.verdict() == "unchecked"
    assert all("ends before" not in r.no_counterpart for r in result.past_other_run)
    done = _cli(a, b)
    assert done.returncode == 4, done.stdout + done.stderr
    assert "WARNING: 3 calls of run A not compared: after the last aligned pair run B's calls are others" in done.stdout
    assert "ends before" not in done.stdout


def test_an_output_one_runs_call_has_and_the_others_has_not_is_not_compared_never_taken_for_agreement(
        sim, tmp_path, monkeypatch):
    # Two calls aligned by their op and index whose output lists differ in length (a foreach step over one more
    # tensor in run B): the outputs both have agree; run B's last one has nothing to be compared with. The pair is not
    # said to agree, and its row names the output.
    monkeypatch.setenv("OP_CAPTURE_MODE", "stats")

    def record(run, count):
        monkeypatch.setenv("OP_TOOLS_RESULTS_DIR", str(tmp_path / run))
        torch.manual_seed(0)
        xs = [torch.randn(8).to(sim) for _ in range(count)]
        with op_tools.OpCapture() as capture:
            torch._foreach_mul(xs, 2.0)
        return capture.recorder.file.path

    result = compare(record("a", 3), record("b", 4))
    (row,) = result.rows
    assert row.match == "exact" and len(row.b["outputs"]) == 4  # the premise: aligned, one output more in run B
    assert result.divergences == [] and result.verdict() == "unchecked" and result.compared == []
    assert row.not_compared == "outputs[3] in run B only: not compared"
    assert compare(record("c", 3), record("d", 3)).verdict() == "clean"


def test_a_backward_writing_the_gradient_it_passes_on_diverges_there_not_at_the_next_call(sim, tmp_path, monkeypatch):
    # remainder's backward passes its upstream gradient on to ``y`` unchanged and computes ``x``'s from it
    # (-grad * floor(y / x): 0 here). A kernel that writes its input as scratch (sim's fault in ``neg``, no version
    # bump) wrote the gradient passed on, whose statistics were taken over from when it arrived: the divergence
    # showed first at the next call reading it (the mul's backward), one call late.
    import ditorch.sim

    monkeypatch.setenv("OP_CAPTURE_MODE", "stats")

    def record(run, fault):
        monkeypatch.setenv("OP_TOOLS_RESULTS_DIR", str(tmp_path / run))
        leaf = torch.linspace(0.1, 0.5, 64).to(sim).requires_grad_()
        x = torch.full((64,), 2.0).to(sim).requires_grad_()
        with op_tools.OpCapture() as capture:
            y = leaf * 3.0
            out = torch.remainder(y, x)
            if fault:  # on while remainder's backward runs: armed by its output's gradient, off at its inputs'
                out.register_hook(lambda _: ditorch.sim.set_faults(fault))
                y.register_hook(lambda _: ditorch.sim.clear_faults())
            torch.sin(out).sum().backward()
        return capture.recorder.file.path

    result = compare(record("a", None), record("b", "neg:scratch=0.1"))
    first = result.first_divergence("backward")
    assert first is not None and result.verdict() == "found"
    assert (first.a or first.b)["op"] == "torch.remainder", [(r.a or r.b)["op"] for r in result.rows if r.diverged]


# --- a gradient summed to about zero (a conv's bias before a BatchNorm) is rounding, measured against its terms

def _record_conv_batch_norm(folder, device, monkeypatch, bias_offset=0.0):
    """A conv with a bias, a BatchNorm, an LSTM and a linear head, one AdamW step, recorded on ``device``. BatchNorm
    removes the mean over each channel, so the conv's bias gradient is exactly 0 in exact arithmetic: what the run
    holds (about 1e-8) is rounding, which the CPU and sim's fused LSTM cells leave different. ``bias_offset``: on
    sim, a convolution backward whose bias gradient is off by that much (sim's ``noise`` fault made an offset of
    its 1-D output)."""
    import ditorch.sim
    from ditorch.sim import fault_injection

    poison = fault_injection.FaultTable._poison

    def offset_bias(table, fault, out):
        if out.dim() == 1:
            out.add_(fault.value)
        else:
            poison(table, fault, out)

    monkeypatch.setattr(fault_injection.FaultTable, "_poison", offset_bias)
    monkeypatch.setenv("OP_CAPTURE_MODE", "stats")
    monkeypatch.setenv("OP_TOOLS_RESULTS_DIR", str(folder))
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"conv": torch.nn.Conv2d(3, 4, 3, padding=1), "bn": torch.nn.BatchNorm2d(4),
                                 "lstm": torch.nn.LSTM(4, 4, batch_first=True), "head": torch.nn.Linear(64, 5)})
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    images, labels = torch.randn(2, 3, 4, 4).to(device), torch.tensor([1, 3]).to(device)
    with op_tools.OpCapture() as capture:
        features = torch.relu(model["bn"](model["conv"](images))).flatten(2).transpose(1, 2)
        logits = model["head"](model["lstm"](features)[0].reshape(2, 64))
        if bias_offset:
            logits.register_hook(lambda _: ditorch.sim.set_faults(f"convolution_backward:noise={bias_offset}"))
        torch.nn.functional.cross_entropy(logits, labels).backward()
        ditorch.sim.clear_faults()
        optimizer.step()
    return capture.recorder.file.path


def test_a_gradient_summed_to_rounding_noise_is_no_divergence_and_a_fault_above_its_rounding_still_is(
        sim, tmp_path, monkeypatch):
    cpu = _record_conv_batch_norm(tmp_path / "cpu", "cpu", monkeypatch)
    result = compare(cpu, _record_conv_batch_norm(tmp_path / "sim", sim, monkeypatch))
    conv = next(r for r in result.rows if r.phase == "backward" and r.op == "torch.nn.functional.conv2d")
    bias_a, bias_b = (next(t for t in record["grad_inputs"] if t[2] == [4]) for record in (conv.a, conv.b))
    # the premise: the bias gradient is rounding noise, and it differs between the runs by about its own size
    assert bias_a[6] < 1e-7 and difference(bias_a, bias_b)[0] > 0.1
    assert result.divergences == [] and result.verdict() == "clean"
    # measured against its terms' size (the upstream gradient's norm / sqrt(4)), the difference is a rounding
    assert conv.difference < conv.tolerance
    # what AdamW reads from it differs as much: carried from the bias gradient, not from outside the recording
    assert not any(r.inputs_differed_first for r in result.rows)
    # a convolution backward whose bias gradient is off by 2e-5 (1e3 times its size, 6e-4 of its terms' size) on
    # the same rounding: found there, in the bias gradient
    faulty = compare(cpu, _record_conv_batch_norm(tmp_path / "fault", sim, monkeypatch, bias_offset=2e-5))
    first = faulty.first_divergence()
    assert (first.phase, first.op) == ("backward", "torch.nn.functional.conv2d") and first.outputs_unexplained
    assert first.detail.startswith("grad_inputs[1]") and first.difference > 3 * first.tolerance


# --- where the inputs of the first divergence changed: a call of one run only before it, named

def _record_variant(folder, monkeypatch, activation):
    """Two linear layers with ``activation`` between them, recorded on the CPU."""
    monkeypatch.setenv("OP_CAPTURE_MODE", "stats")
    monkeypatch.setenv("OP_TOOLS_RESULTS_DIR", str(folder))
    torch.manual_seed(0)
    first, second = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
    with op_tools.OpCapture() as capture:
        second(activation(first(torch.randn(4, 8))))
    return capture.recorder.file.path


def test_inputs_changed_by_a_call_of_one_run_only_name_that_call_not_a_difference_from_outside(tmp_path, monkeypatch,
                                                                                                capsys):
    from op_tools.offline.compare_runs import main

    relu = _record_variant(tmp_path / "relu", monkeypatch, torch.nn.functional.relu)
    gelu = _record_variant(tmp_path / "gelu", monkeypatch, torch.nn.functional.gelu)
    capsys.readouterr()
    assert main([relu, gelu, "--csv", str(tmp_path / "c.csv")]) == 3
    out = capsys.readouterr().out
    assert "outside the recording" not in out
    assert re.search(r"first divergence in forward: step 0 forward Linear #1 torch.nn.functional.linear: its inputs "
                     rf"already differed by {NUMBER} \(inputs\[0\] \w+\), more than the tolerance {NUMBER}, and no "
                     r"aligned call before it differed: the difference likely came from a call of one run only before "
                     r"it, the nearest step 0 forward \(no module\) #1 torch.nn.functional.relu \(in A only\); ",
                     out), out
    first = compare(relu, gelu).first_divergence()
    assert first.op == "torch.nn.functional.linear" and first.inputs_differed_first and not first.outputs_unexplained
    assert (first.origin.match, first.origin.op) == ("only A", "torch.nn.functional.relu")  # the nearest before it
    assert first.verdict_detail.endswith("(an input: the runs differed before this call, likely from "
                                         "torch.nn.functional.relu in A only before it)")


# --- calls past the other run's end are calls not compared, not structural differences

def test_calls_past_the_other_runs_end_are_not_announced_as_a_structural_difference(tmp_path, monkeypatch):
    monkeypatch.setenv("OP_CAPTURE_MODE", "stats")

    def record(run, calls):
        monkeypatch.setenv("OP_TOOLS_RESULTS_DIR", str(tmp_path / run))
        x = torch.linspace(-1, 1, 8)
        with op_tools.OpCapture() as capture:
            for _ in range(calls):
                x = torch.sin(x)
        return capture.recorder.file.path

    a, b = record("a", 3), record("b", 2)
    result = compare(a, b)
    assert [r.op for r in result.past_other_run] == ["torch.sin"] and result.verdict() == "unchecked"
    assert result.first_structural is None and result.structural == []
    assert result.modules() == [{"module": "", "calls": 3, "max_output_diff": 0.0, "max_grad_diff": 0.0,
                                 "diverged": 0, "structural": 0, "not_compared": 1}]
    done = _cli(a, b, "--csv", str(tmp_path / "c.csv"))
    assert done.returncode == 4, done.stdout + done.stderr
    assert "first structural difference: none\n" in done.stdout
    assert "WARNING: 1 call of run A not compared: run B's recording ends before them, the first step 0 forward " \
           "(no module) #2 torch.sin" in done.stdout
