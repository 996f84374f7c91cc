"""What the tools print and where: logging levels, quiet defaults, tables that fit, the results folder, file modes."""

import logging
import os
import re
import stat
import subprocess
import sys

import pytest
import torch
from subprocess_env import child_env

import ditorch.sim
import op_tools
from op_tools.output import reporting, result_files

TOOLS = ("OpObserve", "OpAutoCompare", "OpTimeMeasure", "OpCapture", "OpOverflowCheck", "OpFallback", "OpDtypeCast")

# Four training steps of a small TransformerEncoderLayer under each tool in turn, with a marker line between tools.
FOUR_STEPS = """
import sys
import torch, ditorch, op_tools

torch.manual_seed(0)
layer = torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True).cuda()
optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-3)
x = torch.randn(2, 8, 32, device="cuda")
for name in sys.argv[1:]:
    print(f"=== {name}", flush=True)
    with getattr(op_tools, name)():
        for step in range(4):
            optimizer.zero_grad()
            loss = layer(x).square().mean()
            loss.backward()
            optimizer.step()
"""


def _run_four_steps(tmp_path, env: dict, tools=TOOLS) -> dict[str, list[str]]:
    done = subprocess.run([sys.executable, "-c", FOUR_STEPS, *tools], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env=child_env({"DITORCH_BACKEND": "sim", "DITORCH_QUIET": "1",
                                                      "OP_TOOLS_RESULTS_DIR": str(tmp_path / "results"),
                                                      # the layer is float32: a table that casts it
                                                      "OP_DTYPE_CAST_DICT": "torch.float32->torch.float64", **env},
                                                     drop=("OP_",)))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr == "", done.stderr[-3000:]
    lines: dict[str, list[str]] = {}
    for line in done.stdout.splitlines():
        if line.startswith("=== "):
            current = lines.setdefault(line[4:], [])
        else:
            current.append(line)
    return lines


@pytest.fixture(scope="module")
def four_steps_default(tmp_path_factory):
    return _run_four_steps(tmp_path_factory.mktemp("default"), {})


@pytest.mark.parametrize("tool", TOOLS)
def test_four_training_steps_print_a_few_dozen_lines_at_default_settings(four_steps_default, tool):
    lines = four_steps_default[tool]
    assert 1 <= len(lines) <= 45, "\n".join(lines)
    assert lines[-1].startswith(f"{tool}: ") and " calls of " in lines[-1]  # the closing line
    assert not any("forward_id:" in line or line.startswith(("apply ", "skip ")) for line in lines)
    assert all(len(line) <= reporting.CONSOLE_WIDTH for line in lines if line.startswith(("+", "|")))


def test_verbose_0_prints_no_per_call_line_and_verbose_1_prints_the_tables(tmp_path):
    quiet = _run_four_steps(tmp_path, {"OP_TOOLS_VERBOSE": "0"})
    for tool in TOOLS:
        assert not any("forward_id:" in line or line.startswith("apply ") for line in quiet[tool]), tool
        assert quiet[tool][-1].startswith(f"{tool}: ")
    verbose = _run_four_steps(tmp_path, {"OP_TOOLS_VERBOSE": "1"}, ("OpObserve", "OpAutoCompare"))
    assert any(line.startswith("apply OpObserveHook on ") for line in verbose["OpObserve"])
    assert sum("forward_id:" in line for line in verbose["OpObserve"]) > 50
    tables = [line for lines in verbose.values() for line in lines if line.startswith(("+", "|"))]
    assert tables and max(len(line) for line in tables) <= reporting.CONSOLE_WIDTH


def test_levels_per_call_tables_debug_closing_line_info_failures_warning(sim, caplog, monkeypatch):
    monkeypatch.setenv("OP_TOOLS_VERBOSE", "1")
    caplog.set_level(logging.DEBUG, logger="op_tools")
    x = torch.ones(2, 3, device=sim)
    with op_tools.OpAutoCompare(), ditorch.sim.faults("sigmoid:noise=1e-1"):
        x.sin()
        x.sigmoid()
        x.sigmoid()
    records = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    assert ("op_tools.autocompare", logging.DEBUG, "apply OpAutoCompareHook on torch.Tensor.sin") in records
    sin_table = [r for r in records if r[2].lstrip().startswith("torch.Tensor.sin    forward_id:")]
    assert [level for _, level, _ in sin_table] == [logging.DEBUG]
    sigmoid_tables = [r for r in records if r[2].lstrip().startswith("torch.Tensor.sigmoid    forward_id:")]
    # the first failing call of an op is a warning; the next is a per-call table, counted in the summary
    assert [level for _, level, _ in sigmoid_tables] == [logging.WARNING, logging.DEBUG]
    summary = next(r for r in records if "OpAutoCompare summary" in r[2])
    assert summary[1] == logging.WARNING and "torch.Tensor.sigmoid" in summary[2]
    assert records[-1][:2] == ("op_tools.autocompare", logging.INFO) and records[-1][2].startswith(
        "OpAutoCompare: 3 calls of 2 ops handled; wrote ")


def test_verbose_unset_leaves_a_level_the_application_set(sim, caplog, monkeypatch):
    monkeypatch.delenv("OP_TOOLS_VERBOSE")
    logger = logging.getLogger("op_tools")
    old = logger.level
    logger.setLevel(logging.WARNING)
    try:
        with op_tools.OpObserve():
            torch.ones(2, device=sim).sin()
        assert logger.level == logging.WARNING
        assert not [r for r in caplog.records if r.name.startswith("op_tools")]
    finally:
        logger.setLevel(old)


SILENCED = """
import logging, sys
import torch, ditorch, op_tools
{setup}
x = torch.ones(2, device="cuda")
with op_tools.OpObserve():
    x.sin()
"""


@pytest.mark.parametrize("setup, stdout, stderr", [
    ("", "OpObserve: 1 call of 1 op handled; wrote no file\n", ""),
    ('logging.getLogger("op_tools").setLevel(logging.WARNING)', "", ""),
    ('logging.basicConfig(stream=sys.stderr, format="%(name)s %(levelname)s %(message)s", level=logging.INFO)', "",
     "op_tools.observe INFO OpObserve: 1 call of 1 op handled; wrote no file\n"),
    ('logging.getLogger("op_tools").addHandler(logging.NullHandler())', "", ""),
], ids=["default", "level", "application-handler", "null-handler"])
def test_an_application_silences_or_redirects_the_tools_with_standard_logging_calls(tmp_path, setup, stdout, stderr):
    done = subprocess.run([sys.executable, "-c", SILENCED.format(setup=setup)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120,
                          env=child_env({"DITORCH_BACKEND": "sim", "DITORCH_QUIET": "1"}, drop=("OP_",)))
    assert done.returncode == 0, done.stderr
    assert (done.stdout, done.stderr) == (stdout, stderr)


def test_ditorch_banner_goes_through_the_ditorch_logger_to_stderr(tmp_path):
    code = "import torch, ditorch"
    env = child_env({"DITORCH_BACKEND": "sim"}, drop=("DITORCH_QUIET",))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.stdout == "" and done.stderr.startswith("ditorch: sim ")
    silenced = "import logging; logging.getLogger('ditorch').setLevel(logging.WARNING); " + code
    done = subprocess.run([sys.executable, "-c", silenced], capture_output=True, text=True, timeout=120, env=env)
    assert done.stdout == "" and done.stderr == ""


def test_long_cells_are_shortened_to_fit_and_files_keep_them_whole(tmp_path):
    rows = [{"name": "torch.nn.functional.scaled_dot_product_attention inputs[0]" * 3, "value": "x" * 300, "n": 1}]
    text = reporting.table_text(rows, width=120)
    assert max(len(line) for line in text.splitlines()) <= 120
    # whole words from the start of a shortened cell, the middle of one with no space
    assert "| torch.nn.functional.scaled_dot_product_attention … |" in text and "xxx…xxx" in text
    result_files.write_csv(str(tmp_path / "t.csv"), rows)
    assert rows[0]["value"] in (tmp_path / "t.csv").read_text()
    assert reporting.table_text([{"a": "short"}]) == reporting.table([{"a": "short"}]).get_string()


# Two decoder layers whose module paths differ only by their index, as a transformers Llama's do.
class _Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up_proj = torch.nn.Linear(8, 8)
        self.act_fn = torch.nn.SiLU()

    def forward(self, x):
        return self.act_fn(self.up_proj(x))


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = _Mlp()

    def forward(self, x):
        return x + self.mlp(x)


class _Decoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Layer(), _Layer()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model = _Decoder()

    def forward(self, x):
        return self.model(x)


@pytest.fixture
def console_width_kept():
    """The tables' width as it was before the test (a tool's start sets it for the whole process)."""
    before = reporting.console_width()
    yield
    reporting.configure_tables(before)


def _failure_summary(sim, caplog) -> tuple[list[str], list[dict]]:
    x = torch.randn(4, 8, device=sim)
    model = _Model().to(sim)
    with op_tools.OpAutoCompare() as compare, ditorch.sim.faults("silu:noise=1e-1"):
        model(x)
    summary = next(r.getMessage() for r in caplog.records if "OpAutoCompare summary" in r.getMessage())
    return [line for line in summary.splitlines() if line.startswith(("+", "|"))], compare.failures


@pytest.mark.parametrize("setting", ["220", "120", "100", "full"])
def test_the_failure_summary_fits_the_width_set_and_tells_the_layers_apart(sim, caplog, monkeypatch,
                                                                           console_width_kept, setting):
    monkeypatch.setenv("OP_TOOLS_TABLE_WIDTH", setting)
    table, failures = _failure_summary(sim, caplog)
    rows = [line for line in table if line.startswith("|") and "silu" in line]
    assert [f["module"] for f in failures] == ["model.layers.0.mlp.act_fn", "model.layers.1.mlp.act_fn"]
    assert len(rows) == 2
    if setting == "full":  # nothing shortened: the cells as the CSV has them
        assert all("…" not in line for line in table)
        assert failures[0]["error_info"] in rows[0] and max(len(line) for line in table) > 220
        return
    assert max(len(line) for line in table) <= int(setting)
    if setting == "220":
        assert "model.layers.0.mlp.act_fn" in rows[0] and "model.layers.1.mlp.act_fn" in rows[1]
    else:  # shortened by whole names, each keeping its layer's index and its last name
        assert "model.layers.1.mlp.act_fn" not in rows[1]
        assert [re.search(r"layers\.(\d+)…act_fn ", row).group(1) for row in rows] == ["0", "1"]


def test_module_paths_lose_whole_names_never_their_indices():
    path = "model.layers.1.mlp.act_fn"
    assert reporting.shorten_dotted(path, 25) == path
    assert reporting.shorten_dotted(path, 21) == "model.layers.1…act_fn"
    assert reporting.shorten_dotted(path, 16) == "…layers.1…act_fn"
    assert reporting.shorten_dotted(path, 10) == "…1…act_fn"
    deep = "model.decoder.layers.11.encoder_attn.k_proj"
    for width in range(8, len(deep) + 1):
        shortened = reporting.shorten_dotted(deep, width)
        assert len(shortened) <= width and shortened.endswith("k_proj"), shortened
        # an index stays whole or goes whole: never "1" cut from "11"
        assert re.findall(r"\d+", shortened) in (["11"], []), shortened


def test_shapes_and_numbers_are_shortened_without_cutting_a_number():
    shapes = "[0]:[4, 16, 64, 32] [1]:[64, 32] [2]:[32]"
    assert reporting.shorten_values(shapes, 40) == "[0]:[4,16,64,32] [1]:[64,32] [2]:[32]"
    assert reporting.shorten_values(shapes, 33) == "[0]:[4,16,64,32] [1]:[64,32] …+1"
    assert reporting.shorten_values(shapes, 30) == "[0]:[4,16,64,32] …+2"
    assert reporting.shorten_values(shapes, 16) == "[0]:[4,…,32] …+2"
    assert reporting.shorten_values("torch.Size([4, 16, 64, 32])", 12) == "[4,16,64,32]"
    assert reporting.shorten_cell("0.00328157139", 7) == "0.00328"
    numbers = set(re.findall(r"\d+", shapes))
    for width in range(1, len(shapes)):
        assert set(re.findall(r"\d+", reporting.shorten_values(shapes, width))) <= numbers


def test_under_torchrun_the_rank_label_is_taken_from_the_width(console_width_kept):
    reporting.configure_tables(100, rank=3)
    assert reporting.console_width() == 100 - len("[rank3] ")
    reporting.configure_tables(None, rank=3)
    assert reporting.console_width() is None  # full: nothing shortened


def test_words_keep_every_word_by_its_last_name_where_that_fits():
    assert reporting.shorten_cell("torch.float16 -> torch.float32", 24) == "…float16 -> …float32"
    assert reporting.shorten_cell("torch.float16 -> torch.float32", 18) == "torch.float16 -> …"  # else whole words


def test_summary_capture_tables_keep_whole_shapes_at_120_columns(sim, caplog, monkeypatch, console_width_kept):
    monkeypatch.setenv("OP_CAPTURE_MODE", "summary")
    monkeypatch.setenv("OP_TOOLS_TABLE_WIDTH", "120")
    a, b = torch.randn(4, 16, 64, 32, device=sim), torch.randn(4, 16, 64, 32, device=sim)
    with op_tools.OpCapture():
        torch.addcmul(a, a, b)
        torch.cat([a, b, a, b], dim=1)
    table = [line for r in caplog.records for line in r.getMessage().splitlines() if line.startswith("|")]
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in table]
    names = rows[0]
    shapes = {row[0]: row[names.index("shapes")] for row in rows[1:]}
    assert max(len(line) for line in table) <= 120
    assert shapes["torch.addcmul"].startswith("[0]:[4,16,64,32]") and "…+" in shapes["torch.addcmul"]
    assert all(set(re.findall(r"\d+", cell)) <= {"0", "1", "2", "3", "4", "16", "64", "32"}
               for cell in shapes.values())


def test_full_width_shortens_nothing(console_width_kept):
    reporting.configure_tables(None)
    rows = [{"module": "model.layers.1.mlp.act_fn" * 10, "shapes": "[0]:[4, 16, 64, 32]" * 10}]
    assert reporting.table_text(rows) == reporting.table(rows).get_string()


def test_tables_take_the_terminals_width_and_100_columns_elsewhere(monkeypatch):
    import fcntl
    import io
    import pty
    import struct
    import termios

    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert reporting.terminal_width() == reporting.CONSOLE_WIDTH == 100
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 220, 0, 0))
    try:
        with os.fdopen(os.dup(follower), "w") as terminal:
            monkeypatch.setattr(sys, "stderr", terminal)  # stdout piped to a file, stderr on the terminal
            assert reporting.terminal_width() == 220
            monkeypatch.setenv("COLUMNS", "150")  # as shutil.get_terminal_size: COLUMNS wins
            assert reporting.terminal_width() == 150
    finally:
        os.close(follower)
        os.close(leader)


LAYERS_ON_A_TERMINAL = """
import sys
import torch, ditorch, op_tools
sys.path.insert(0, sys.argv[1])
from test_output import _Model

with op_tools.OpAutoCompare():
    _Model().cuda()(torch.randn(4, 8, device="cuda"))
"""


def test_a_220_column_terminal_gets_220_column_tables_and_a_pipe_100(tmp_path):
    import fcntl
    import pty
    import struct
    import termios

    env = child_env({"DITORCH_BACKEND": "sim", "DITORCH_QUIET": "1", "DITORCH_SIM_FAULTS": "silu:noise=1e-1",
                     "OP_TOOLS_RESULTS_DIR": str(tmp_path / "results")}, drop=("OP_", "COLUMNS"))
    command = [sys.executable, "-c", LAYERS_ON_A_TERMINAL, os.path.dirname(__file__)]
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 220, 0, 0))
    try:  # stderr on the terminal (little is written there), stdout read through a pipe
        on_terminal = subprocess.run(command, stdout=subprocess.PIPE, stderr=follower, text=True, timeout=120,
                                     cwd=tmp_path, env=env)
    finally:
        os.close(follower)
        os.close(leader)
    piped = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    for done, width in ((on_terminal, 220), (piped, 100)):
        assert done.returncode == 0, done.stdout[-3000:]
        table = [line for line in done.stdout.splitlines() if line.startswith(("+", "|"))]
        assert table and max(len(line) for line in table) <= width
        cells = "\n".join(table)
        assert ("model.layers.1.mlp.act_fn" in cells) == (width == 220)
        assert "layers.1" in cells and "act_fn" in cells
        # shortened in its cell, whole on a line of its own under the table
        assert ("  [2] module: model.layers.1.mlp.act_fn" in done.stdout.splitlines()) == (width == 100)


@pytest.mark.parametrize("value", ["39", "wide", "0", "-200"])
def test_a_malformed_table_width_fails_at_start_naming_the_variable(sim, monkeypatch, value):
    monkeypatch.setenv("OP_TOOLS_TABLE_WIDTH", value)
    with pytest.raises(ValueError, match=f"OP_TOOLS_TABLE_WIDTH={value!r}.*an integer >= 40, or full"):
        op_tools.OpObserve().start()


@pytest.mark.parametrize("tool", [op_tools.OpCapture, op_tools.OpTimeMeasure, op_tools.OpAutoCompare])
def test_a_results_folder_that_cannot_be_written_fails_at_start_naming_the_variable(sim, tmp_path, monkeypatch,
                                                                                       tool):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("OP_TOOLS_RESULTS_DIR", str(blocker / "results"))
    instance = tool()
    with pytest.raises(OSError, match="OP_TOOLS_RESULTS_DIR") as error:
        instance.start()
    assert str(blocker / "results") in str(error.value)
    assert not instance._activations  # nothing started: no mode, no wrapper
    assert torch.ones(2, device=sim).sin().device.type == "sim"


def test_a_tool_that_writes_no_file_starts_anywhere(sim, tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("OP_TOOLS_RESULTS_DIR", str(blocker / "results"))
    with op_tools.OpObserve():
        torch.ones(2, device=sim).sin()


UMASK = """
import os, sys
import torch, ditorch, op_tools
with op_tools.OpCapture(), op_tools.OpTimeMeasure():
    torch.ones(2, device="cuda").sin()
modes = set()
for folder, _, files in os.walk(sys.argv[1]):
    modes.update(oct(os.stat(os.path.join(folder, f)).st_mode & 0o777) for f in files)
print(sorted(modes))
"""


@pytest.mark.parametrize("umask, mode", [(0o022, "0o644"), (0o077, "0o600"), (0o002, "0o664")])
def test_files_honour_the_umask(tmp_path, umask, mode):
    results = tmp_path / "results"
    done = subprocess.run([sys.executable, "-c", UMASK, str(results)], capture_output=True, text=True, timeout=120,
                          umask=umask, cwd=tmp_path,
                          env=child_env({"DITORCH_BACKEND": "sim", "DITORCH_QUIET": "1",
                                         "OP_TOOLS_RESULTS_DIR": str(results)}, drop=("OP_",)))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == f"['{mode}']"


def test_closing_line_counts_the_files_and_bytes_written(sim, caplog):
    x = torch.ones(2, device=sim)
    with op_tools.OpCapture() as capture:
        x.sin()
    line = caplog.records[-1].getMessage()
    files = [os.path.join(d, f) for d, _, names in os.walk(os.environ["OP_TOOLS_RESULTS_DIR"]) for f in names]
    size = sum(os.path.getsize(f) for f in files)
    assert capture.tally.files == len(files) == 3 and capture.tally.bytes == size  # input, output, the index
    folder = os.path.join(os.environ["OP_TOOLS_RESULTS_DIR"], "op_capture_results")
    shown = reporting.shown_path(folder)
    closing = f"OpCapture: 1 call of 1 op handled; wrote 3 files ({result_files.human_size(size)}) in "
    assert line == reporting.fit_path(closing + shown, shown) and line.startswith(closing)
    header = reporting.fit_line(f"OpCapture results in {shown}:")  # the folder on a line of its own where long
    assert caplog.records[-2].getMessage().startswith(f"{header}\n  index of the calls saved: ")
    assert stat.S_ISREG(os.stat(files[0]).st_mode)


PROGRESS = """
import torch, ditorch, op_tools
from op_tools.output import result_files
result_files.Tally.PROGRESS_AFTER = result_files.Tally.PROGRESS_EVERY = 0.0  # draw at once: a short run in a test
x = torch.ones(2, device="cuda")
with op_tools.OpCapture():
    for _ in range(5):
        x = x.sin()
"""


@pytest.mark.parametrize("env, shown", [({}, True), ({"CI": "true"}, False), ({"OP_TOOLS_PROGRESS": "0"}, False)],
                         ids=["terminal", "ci", "variable-off"])
def test_capture_shows_a_progress_bar_on_a_terminal_only(tmp_path, env, shown):
    import fcntl
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a terminal 120 wide
    try:
        done = subprocess.run([sys.executable, "-c", PROGRESS], stdout=subprocess.PIPE, stderr=follower, timeout=120,
                              cwd=tmp_path, env=child_env({"DITORCH_BACKEND": "sim", "DITORCH_QUIET": "1", **env},
                                                         drop=("OP_", "CI")))
        os.close(follower)
        follower = -1
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the child's end is closed: all read
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        if follower >= 0:
            os.close(follower)
        os.close(leader)
    terminal = b"".join(chunks).decode(errors="replace")
    assert done.returncode == 0, terminal
    assert ("OpCapture writing: 10 files [" in terminal and " KB]" in terminal) == shown, terminal
    lines = done.stdout.decode().splitlines()
    first = max(i for i, line in enumerate(lines) if line.startswith("OpCapture: "))
    closing = reporting.unwrapped("\n".join(lines[first:]))  # wrapped where longer than the width
    assert closing.startswith("OpCapture: 5 calls of 1 op handled; wrote 11 files")  # and the index


def test_no_progress_bar_when_stderr_is_not_a_terminal(capfd):
    assert not sys.stderr.isatty()  # pytest's captured stderr
    assert reporting.progress_bar(10, "replay") is None


def test_an_apply_line_not_shown_at_info_is_shown_by_a_later_verbose_session(sim, caplog, monkeypatch):
    from op_tools.core.engine import OpTool

    class Quiet(OpTool):
        hook_name = "QuietHook"

    x = torch.ones(2, device=sim)
    with Quiet():  # OP_TOOLS_VERBOSE=0 (tests/op_tools/conftest.py): INFO
        x.cos()
    assert not any(r.getMessage().startswith("apply QuietHook") for r in caplog.records)
    monkeypatch.setenv("OP_TOOLS_VERBOSE", "1")
    for _ in range(2):
        with Quiet():
            x.cos()
    assert [r.getMessage() for r in caplog.records].count("apply QuietHook on torch.Tensor.cos") == 1


SITE_CHILD = """
import torch, ditorch.sim
from op_tools.output import reporting
ditorch.sim.register()
x = torch.ones(2, device="sim", requires_grad=True)
seen = []
x.register_hook(lambda g: seen.append(reporting.user_site(full_stack=True).text()))
(x * 2).sum().backward()  # the line to find
print(repr(seen[0]))
"""


@pytest.mark.fresh_interpreter  # it prints the whole stack: a forked child's holds the fork server's frames below
def test_a_location_skips_the_device_layer_between_the_users_line_and_torch(tmp_path):
    # With several sim devices backward runs through sim's engine (ditorch/sim/multi_device.py): OpOverflowCheck's
    # "received" line named its run_backward where the user's loss.backward() was
    script = tmp_path / "train.py"
    script.write_text(SITE_CHILD)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env=child_env({"DITORCH_SIM_DEVICE_COUNT": "2", "DITORCH_QUIET": "1"}, drop=("DITORCH_",)))
    assert done.returncode == 0, done.stderr[-3000:]
    frames = eval(done.stdout.strip().splitlines()[-1]).splitlines()  # noqa: S307 - our own repr
    assert "ditorch" not in "".join(frames) and frames[-1].endswith("(x * 2).sum().backward()  # the line to find")


# A results folder as long as a shared cluster's: the closing lines would pass 100 columns if they named it whole.
LONG_RESULTS = os.path.join("cluster_share", "team_numerics", "experiments", "llama_pretraining_bf16", "run_2026_11_28")
CLOSING_RUNS = {  # a tool, and what it runs on the tiny MLP: enough for every file it writes
    "OpAutoCompare": (lambda: op_tools.OpAutoCompare(), "gelu:noise=1e-1"),
    "OpCapture": (lambda: op_tools.OpCapture(), ""),
    "OpTimeMeasure": (lambda: op_tools.OpTimeMeasure(), ""),
    # a clean run: it writes no file (runs that find something, their lines wrapped: FINDING_RUNS below)
    "OpOverflowCheck": (lambda: op_tools.OpOverflowCheck(), ""),
    "TrainingMonitor": (lambda: op_tools.TrainingMonitor(), ""),
}


@pytest.mark.parametrize("tool", CLOSING_RUNS)
def test_the_closing_line_fits_100_columns_and_the_lines_above_name_every_file(sim, tmp_path, caplog, monkeypatch,
                                                                                console_width_kept, tool):
    import io

    from tiny_models import train_mlp

    monkeypatch.setenv("OP_TOOLS_RESULTS_DIR", str(tmp_path / LONG_RESULTS))
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(sys, "stdout", io.StringIO())  # no terminal: the default width
    make, fault = CLOSING_RUNS[tool]
    with caplog.at_level(logging.INFO, logger="op_tools"), ditorch.sim.faults(fault), make():
        train_mlp(sim, steps=1)
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("op_tools")]
    closing = messages[-1]
    assert closing.startswith(f"{tool}: ") and len(closing) <= reporting.CONSOLE_WIDTH == 100, closing
    if "; wrote no file" in closing:
        return
    listing = messages[-2].splitlines()
    # the folder, shortened on the closing line, is whole above it (on a line of its own: it is longer than the
    # header's line), with each file a user opens
    assert listing[0] == f"{tool} results in"
    header = re.fullmatch(rf"{tool} results in (\S+):", reporting.unwrapped("\n".join(listing[:2])))
    assert header and closing.split(" in …")[1].split(";")[0] in header.group(1), listing
    folder = header.group(1)
    assert folder.startswith(str(tmp_path / LONG_RESULTS)) and len(listing) > 2
    for line in listing[2:]:
        assert line.startswith("  ") and os.path.exists(os.path.join(folder, line.rpartition(": ")[2])), line
        assert len(line) <= 100, line


def test_a_table_at_100_columns_writes_each_shortened_module_path_whole_under_it(monkeypatch, console_width_kept):
    from op_tools.config.variables import TABLE_WIDTH

    columns = ("order", "op", "phase", "module", "forward_id", "failing", "error_info", "location")
    rows = [{"order": i, "op": "torch.nn.functional.scaled_dot_product_attention", "phase": "forward",
             "module": f"model.decoder.layers.{i}.self_attention.core_attention", "forward_id": 100 + i,
             "failing": "outputs[0]", "error_info": "max_abs_diff 0.5 > atol 1e-05 + rtol 1e-05 x |cpu|",
             "location": "/opt/venv/lib/python3.11/site-packages/model/modeling.py:123 forward: out = sdpa(q, k, v)"}
            for i in (1, 2, 3)]
    monkeypatch.delenv("OP_TOOLS_TABLE_WIDTH", raising=False)
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(sys, "stdout", __import__("io").StringIO())  # no terminal: the default width
    reporting.configure_tables(TABLE_WIDTH.read())
    lines = reporting.table_text(rows, columns, keep="op").splitlines()
    table = [line for line in lines if line.startswith(("+", "|"))]
    assert max(len(line) for line in table) <= 100
    assert lines[:len(table)] == table  # the whole names come under the table, a line each, naming the row
    assert lines[len(table):] == [  # the rows a name is in, once per name
        "  [1,2,3] op: torch.nn.functional.scaled_dot_product_attention",
        *(f"  [{i}] module: model.decoder.layers.{i}.self_attention.core_attention" for i in (1, 2, 3))]
    assert not any("self_attention.core_attention" in line for line in table)
    monkeypatch.setenv("OP_TOOLS_TABLE_WIDTH", "full")
    reporting.configure_tables(TABLE_WIDTH.read())
    whole = reporting.table_text(rows, columns, keep="op")
    assert "…" not in whole and "] module: " not in whole
    assert all(row["module"] in whole and row["location"] in whole for row in rows)


# Runs whose closing and summary lines say what the tool found or left out: past 100 columns, each wrapped at its
# clauses. A results folder that a line of its own holds: every console line fits.
FINDING_RESULTS = os.path.join("cluster_share", "numerics", "run_2026_11_28")
FINDING_RUNS = {  # a tool, its settings and fault on the tiny MLP
    "OpOverflowCheck": (op_tools.OpOverflowCheck, {}, "gelu:nan"),
    "OpCapture": (op_tools.OpCapture, {"OP_CAPTURE_STEPS": "0", "OP_CAPTURE_MAX_CALLS_PER_OP": "1"}, ""),
    "OpAutoCompare": (op_tools.OpAutoCompare, {}, "gelu:noise=1e-1"),
}
_LOCATION_LINE = re.compile(r"\S+\.py:\d+ ")  # a call's location: the user's code, never wrapped


def _finding_run(sim, tmp_path, caplog, monkeypatch, tool: str, width: str):
    """Two steps of the tiny MLP under ``tool`` at ``OP_TOOLS_TABLE_WIDTH=width``, in ``tmp_path``; the tool, the
    messages of op_tools at INFO and above."""
    from reliability.test_errors import device_only_op  # a vendor op with no CPU kernel: not checked
    from tiny_models import train_mlp

    make, settings, fault = FINDING_RUNS[tool]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OP_TOOLS_RESULTS_DIR", FINDING_RESULTS)
    monkeypatch.setenv("OP_TOOLS_TABLE_WIDTH", width)
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    with caplog.at_level(logging.INFO, logger="op_tools"), ditorch.sim.faults(fault), make() as running:
        train_mlp(sim, steps=2)
        device_only_op(torch.ones(3, device=sim))
    return running, [r.getMessage() for r in caplog.records if r.name.startswith("op_tools")]


def _wrapped_line(lines: list[str], first: int) -> str:
    """The console line that starts at ``lines[first]``, its continuation lines joined back."""
    last = first + 1
    while last < len(lines) and lines[last].startswith(reporting.CONTINUATION):
        last += 1
    return reporting.unwrapped("\n".join(lines[first:last]))


@pytest.mark.parametrize("tool", FINDING_RUNS)
def test_closing_and_summary_lines_that_find_something_wrap_within_100_columns_whole(
        sim, tmp_path, caplog, monkeypatch, console_width_kept, tool):
    running, messages = _finding_run(sim, tmp_path, caplog, monkeypatch, tool, "100")
    for line in "\n".join(messages).splitlines():
        assert len(line) <= 100 or _LOCATION_LINE.match(line), line
    closing, whole = messages[-1], running.closing_line()
    lines = closing.splitlines()
    # the verdict words start the first line; the clauses that found something follow, whole once joined back
    assert len(whole) > 100 and len(lines) > 1, closing
    assert re.match(rf"{tool}: \d+ calls of \d+ ops handled;", lines[0]), closing
    assert all(line.startswith("  ") and not line.startswith("   ") for line in lines[1:]), closing
    assert reporting.unwrapped(closing) == whole
    found = {"OpOverflowCheck": r"; first inf/nan from finite inputs: torch\.nn\.functional\.gelu in 1 \(forward\) "
                                r"forward_id: \d+$",
             "OpCapture": r"; \d+ calls outside steps 0 \(OP_CAPTURE_STEPS\) not saved; ",
             "OpAutoCompare": r"; 1 call not checked \(the tool failed\), the first "
                              r"reliability\.test_errors\.device_only_op: RuntimeError: "}[tool]
    assert re.search(found, reporting.unwrapped(closing))
    if tool != "OpAutoCompare":
        return
    summary = next(m for m in messages if "OpAutoCompare summary" in m).splitlines()
    reporting.configure_tables(None)  # the summary at full width: each of its lines whole
    whole_summary = running.summary().splitlines()
    c = running.counts
    assert summary[:2] == ["", f"OpAutoCompare summary: forward {c['forward compared']} compared, "
                               f"{c['forward passed']} passed, {c['forward failed']} failed, 1 not checked;"]
    assert _wrapped_line(summary, 1) == whole_summary[1] and summary[2].startswith("  backward ")
    not_checked = next(i for i, line in enumerate(summary) if line.startswith("NOT CHECKED: "))
    assert _wrapped_line(summary, not_checked) in whole_summary and summary[not_checked + 1].startswith("  ")
    saved = next(line for line in summary if re.match(r"\d+ failing calls saved for the replay under ", line))
    folder = os.path.join(FINDING_RESULTS, "op_capture_results")
    assert f"under {folder} " in next(line for line in whole_summary if " failing calls saved " in line)
    # shortened from its start on the console, named whole in the listing above the closing line
    assert re.search(r" under …\S*op_capture_results ", saved) and len(saved) <= 100, saved
    listing = messages[-2].splitlines()
    assert listing[0] == f"OpAutoCompare results in {FINDING_RESULTS}:"
    assert "  failing calls, for run_op_from_data: op_capture_results" in listing


@pytest.mark.parametrize("tool", FINDING_RUNS)
def test_at_full_width_closing_and_summary_lines_stay_whole(sim, tmp_path, caplog, monkeypatch, console_width_kept,
                                                            tool):
    running, messages = _finding_run(sim, tmp_path, caplog, monkeypatch, tool, "full")
    assert messages[-1] == running.closing_line() and len(messages[-1]) > 100
    if tool == "OpAutoCompare":
        summary = next(m for m in messages if "OpAutoCompare summary" in m).splitlines()
        assert summary[1].startswith("OpAutoCompare summary: ") and "; backward " in summary[1]
        assert not any(line.startswith("  ") and not line.startswith("  [") for line in summary), summary


def test_a_long_line_wraps_at_its_clauses_first_and_joins_back_whole(console_width_kept):
    line = ("OpCapture: 9 calls of 2 ops handled; wrote 3 files (1.2 KB) in results; 4 calls outside steps 0 "
            "(OP_CAPTURE_STEPS) not saved; 2 calls of 1 op past 1 per op (OP_CAPTURE_MAX_CALLS_PER_OP) not saved")
    wrapped = reporting.fit_line(line, 80)
    assert wrapped.splitlines() == [
        "OpCapture: 9 calls of 2 ops handled; wrote 3 files (1.2 KB) in results;",
        "  4 calls outside steps 0 (OP_CAPTURE_STEPS) not saved;",
        "  2 calls of 1 op past 1 per op (OP_CAPTURE_MAX_CALLS_PER_OP) not saved"]
    assert reporting.unwrapped(wrapped) == line
    # a clause longer than a line breaks after its commas, then between words; a word longer stays whole
    clause = "skipped: " + ", ".join(f"reason number {i}: {i}" for i in range(8)) + " " + "x" * 90
    wrapped = reporting.fit_line(clause, 60)
    assert reporting.unwrapped(wrapped) == clause and wrapped.splitlines()[-1] == "  " + "x" * 90
    assert all(len(part) <= 60 for part in wrapped.splitlines()[:-1])
    assert all(part.endswith(",") for part in wrapped.splitlines()[:-2])
    indented = "  47 comparisons: " + "a" * 50 + " " + "b" * 40
    assert reporting.fit_line(indented, 80).splitlines() == ["  47 comparisons: " + "a" * 50, "    " + "b" * 40]
    reporting.configure_tables(None)  # OP_TOOLS_TABLE_WIDTH=full: unchanged
    assert reporting.fit_line(line) == line and reporting.fit_path(line, "results") == line


def test_a_replay_table_at_100_columns_keeps_the_failed_checks_named(console_width_kept):
    from op_tools.offline.run_op_from_data import ReplayOptions, console_row

    detail = "output vs cpu float64: output[0]: error 0.00897 > 4 x cpu torch.float32 error 1.26e-07 + 4 eps"
    rows = [console_row({"name": "torch.nn.functional.gelu", "shapes": "[2, 16, 128]", "status": "mismatch",
                         "forward_median_ms": 0.214701, "backward_median_ms": 0.327802, "detail": detail, "step": 0,
                         "checks": checks}, ReplayOptions(run_times=3, backward=True, time=True, acc_check=True))
            for checks in ("output vs cpu float64: fail; grad vs cpu float64: pass",
                           "output vs cpu float64: fail; output vs captured output: fail")]
    text = reporting.table_text(rows, width=100)
    table = [line for line in text.splitlines() if line.startswith(("+", "|"))]
    assert max(len(line) for line in table) == 100
    cells = [[cell.strip() for cell in line.split("|")[1:-1]] for line in table if "mismatch" in line]
    assert [row[5] for row in cells] == ["FAIL: output", "FAIL: output, …"]  # the first failed check whole
    assert all(row[6].startswith("output vs cpu") for row in cells)  # and the detail's first words
    assert "  [1,2] op: torch.nn.functional.gelu" in text.splitlines()  # the op cut to make room, whole below
