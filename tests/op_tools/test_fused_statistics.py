"""The comparison's statistics in one compiled pass (``numerics/fused_statistics.py``): the same numbers and verdicts as
the eager chunks, compiled only once a process has compared enough, never announced as the user's compiled code,
and the eager path kept where compiling fails. All tests here share one process's compiled graphs (one compile)."""

from __future__ import annotations

import csv
import logging
import math
import types

import pytest
import torch

import ditorch.sim
import op_tools
from op_tools.core import compiled_regions
from op_tools.numerics import error_statistics, fused_statistics

N = fused_statistics.FUSED_MIN * 2


@pytest.fixture
def fused(monkeypatch):
    """The fused pass on from the first large tensor (as after ``COMPILE_AFTER`` elements of a real run)."""
    monkeypatch.setattr(fused_statistics, "COMPILE_AFTER", 0)
    if fused_statistics._state == "idle":
        monkeypatch.setattr(fused_statistics, "_seen", 0)
    yield


@pytest.fixture
def eager(monkeypatch):
    monkeypatch.setattr(fused_statistics, "_state", "failed")


def _both(d, r, relative=None):
    """The statistics eagerly (chunk by chunk), then fused."""
    saved = fused_statistics._state
    fused_statistics._state = "failed"
    try:
        eager_values = error_statistics.error_stats(d, r, 1e-5, 1e-5, relative)
    finally:
        fused_statistics._state = saved
    fused_statistics.COMPILE_AFTER = 0
    values = error_statistics.error_stats(d, r, 1e-5, 1e-5, relative)
    assert fused_statistics._state == "ready"
    return eager_values, values


@pytest.mark.parametrize(("dtype", "relative"), [(torch.float32, None), (torch.bfloat16, (2.0 ** -8, 1e-38)),
                                                 (torch.float64, None)])
def test_the_fused_pass_gives_the_eager_statistics(fused, dtype, relative):
    torch.manual_seed(0)
    r = torch.randn(N, dtype=torch.float64) * torch.logspace(-3, 3, N, dtype=torch.float64)
    d = (r * (1 + 1e-3 * torch.randn(N, dtype=torch.float64))).to(dtype)
    eager_values, values = _both(d, r, relative)
    for a, b in zip(eager_values[:4], values[:4]):
        assert math.isclose(a, b, rel_tol=1e-12), (eager_values, values)  # maxima: the same elements
    assert eager_values[4] == values[4]  # allclose


def test_identical_tensors_and_a_nan_read_as_in_the_eager_path(fused):
    r = torch.randn(N, dtype=torch.float64)
    assert _both(r.clone(), r) == ((0.0, 0.0, 0.0, 1.0, True),) * 2
    d = r.float()
    d[7] = float("nan")
    assert _both(d, r) == (None, None)  # the caller compares nan/inf elementwise


def test_a_change_of_autocast_state_compiles_nothing_again(sim, fused):
    # Verdicts are judged inside a user's autocast region (a batch ending there) and outside it: dynamo guards on the
    # autocast state, and each change recompiled the statistics until its recompile limit left them uncompiled for
    # the rest of the process. They run with one autocast state; the user's is back after each call.
    from torch._dynamo.utils import counters

    r = torch.randn(N, dtype=torch.float64)
    d = r.float()
    expected = error_statistics.error_stats(d, r, 1e-5, 1e-5)
    assert fused_statistics._state == "ready"
    frames = counters["frames"]["total"]
    for _ in range(5):
        for region in (torch.autocast("cpu", dtype=torch.bfloat16), torch.autocast(sim, dtype=torch.bfloat16),
                       torch.autocast(sim, dtype=torch.float16, enabled=False)):
            with region:
                state = [(t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in ("cpu", "sim")]
                assert error_statistics.error_stats(d, r, 1e-5, 1e-5) == expected
                assert [(t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in ("cpu", "sim")] == state
    assert counters["frames"]["total"] == frames


def test_tensors_of_every_shape_and_both_error_forms_compile_once_per_dtype(fused):
    # Tensors are compared flattened: views of outputs and weights of every shape, which dynamo would guard on their
    # base's sizes; and the two forms of the error's denominator, each a function of its own. Past dynamo's limit of
    # 8 compilations of a function, the statistics ran uncompiled for the rest of the process.
    # What dynamo keeps compiled for each function: an entry per dtype (counted from its cache, not from the frames
    # dynamo converted, which other tests' state in this process moves: a flaky count)
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    shapes = [(2, 256, 144), (512, 144), (144, 512), (3, 7, 11, 290), (N,)]  # each fused: 2^16 elements or more
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
    for dtype in dtypes:
        for relative in (None, (2.0 ** -8, 1e-38)):
            for shape in shapes:
                r = torch.randn(shape, dtype=torch.float64) + 2
                error_statistics.error_stats(r.to(dtype), r, 1e-5, 1e-5, relative)
    entries = {f.__name__: len(_debug_get_cache_entry_list(f.__code__))
               for f in (fused_statistics._plain_statistics, fused_statistics._relative_statistics)}
    assert all(count <= len(dtypes) for count in entries.values()), entries


def test_small_tensors_and_an_early_process_stay_eager(monkeypatch):
    monkeypatch.setattr(fused_statistics, "_state", "idle")
    monkeypatch.setattr(fused_statistics, "_seen", 0)
    r = torch.randn(N, dtype=torch.float64)
    assert fused_statistics.fused(r.float(), r, -1e-5, 1.0, 1e-300, False) is None  # below COMPILE_AFTER
    assert fused_statistics._seen == N and fused_statistics._state == "idle"
    monkeypatch.setattr(fused_statistics, "COMPILE_AFTER", 0)
    small = r[:fused_statistics.FUSED_MIN - 1]
    assert fused_statistics.fused(small.float(), small, -1e-5, 1.0, 1e-300, False) is None


def test_a_failing_compile_is_logged_once_and_the_eager_path_stays(monkeypatch, caplog):
    monkeypatch.setattr(fused_statistics, "_state", "idle")
    monkeypatch.setattr(fused_statistics, "COMPILE_AFTER", 0)

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(fused_statistics, "_compiled", {False: broken, True: broken})
    r = torch.randn(N, dtype=torch.float64)
    with caplog.at_level(logging.INFO, logger="op_tools"):
        first = error_statistics.error_stats(r.float(), r, 1e-5, 1e-5)
        second = error_statistics.error_stats(r.float(), r, 1e-5, 1e-5)
    assert fused_statistics._state == "failed"
    assert first == second and first is not None and first[4]
    assert [m for m in caplog.messages if "stay eager" in m] == [
        "op_tools: comparison statistics stay eager: torch.compile failed (RuntimeError: no C++ compiler)"]


def test_a_disabled_dynamo_leaves_the_eager_path(monkeypatch, caplog):
    """``TORCHDYNAMO_DISABLE=1``: the compiled function would run eagerly on whole tensors; the chunks stay."""
    import torch._dynamo

    monkeypatch.setattr(fused_statistics, "_state", "idle")
    monkeypatch.setattr(fused_statistics, "_compiled", {})
    monkeypatch.setattr(fused_statistics, "_own_frames", 0)
    monkeypatch.setattr(fused_statistics, "COMPILE_AFTER", 0)
    monkeypatch.setattr(torch._dynamo.config, "disable", True)
    # Code run while dynamo is disabled is never compiled again in the process (until torch._dynamo.reset()): the
    # statistics run here as copies, so that the tests after this one still compile the real ones.
    for name in ("_plain_statistics", "_relative_statistics"):
        function = getattr(fused_statistics, name)
        monkeypatch.setattr(fused_statistics, name,
                            types.FunctionType(function.__code__.replace(), function.__globals__, name))
    r = torch.randn(N, dtype=torch.float64)
    with caplog.at_level(logging.INFO, logger="op_tools"):
        values = error_statistics.error_stats(r.float(), r, 1e-5, 1e-5)
    assert values is not None and fused_statistics._state == "failed"
    assert "compiling the comparison statistics" in caplog.text  # the pause announced
    assert "compiled nothing" in caplog.text


def _verdicts(path) -> list[tuple]:
    with open(path, newline="") as f:
        return [(row["op"], row["name"], row["verdict"], row["allclose"], row["max_abs_diff"],
                 row["max_relative_diff"], row["device_error"], row["cosine_similarity"]) for row in csv.DictReader(f)]


def _compared_run(sim, results) -> tuple[list, str]:
    from ditorch.sim import fault_injection

    torch.manual_seed(1)
    fault_injection.TABLE._noise_gen.manual_seed(0)  # the same injected noise in both runs
    x = torch.randn(N, device=sim, requires_grad=True)
    w = torch.randn(256, 256, device=sim)
    with op_tools.OpAutoCompare(results_dir=str(results)) as tool:
        y = torch.nn.functional.silu(x) * 3
        y.sum().backward()
        torch.matmul(w, w)
        with ditorch.sim.faults("mul:noise=1e-2"):
            torch.mul(x.detach(), 2)
    [csv_path] = results.glob("op_autocompare_result/*.csv")
    return _verdicts(csv_path), tool.found()


def test_a_compared_run_has_the_same_table_and_verdict_fused(sim, tmp_path, fused):
    """Fused from the first large tensor: every column the CSV prints and the closing line as with the eager path."""
    saved = fused_statistics._state
    fused_statistics._state = "failed"
    try:
        eager_rows, eager_line = _compared_run(sim, tmp_path / "eager")
    finally:
        fused_statistics._state = saved
    rows, line = _compared_run(sim, tmp_path / "fused")
    assert fused_statistics._state == "ready"
    assert rows == eager_rows and line == eager_line
    assert [r[0] for r in rows if r[2] == "FAIL"] == ["torch.mul"] and line == "1 op failed", (rows, line)


def test_the_tools_own_compile_is_not_announced_and_the_stance_comes_back(sim, fused, monkeypatch, caplog):
    """Compiled while a tool forces eager: the stance is force_eager again after each fused call, the frames compiled
    are counted as the tools' own, and the next tool does not say that torch.compile compiled the user's code."""
    from torch._dynamo import eval_frame
    from torch._dynamo.utils import counters

    monkeypatch.setattr(fused_statistics, "_compiled", {})  # compiled afresh here: dynamo compiles new frames
    monkeypatch.setattr(fused_statistics, "_state", "idle")
    users = counters["frames"]["total"] - fused_statistics.own_frames()  # other tests' compiled code, if any
    announced = compiled_regions._compiled_anything()
    r = torch.randn(N, dtype=torch.float64)
    with op_tools.OpAutoCompare():
        assert eval_frame._stance.stance == "force_eager"
        assert error_statistics.error_stats(r.float(), r, 1e-5, 1e-5) is not None
        assert fused_statistics._state == "ready"
        assert eval_frame._stance.stance == "force_eager"
    assert counters["frames"]["total"] > users + 0 and fused_statistics.own_frames() >= 1
    assert counters["frames"]["total"] - fused_statistics.own_frames() == users
    assert compiled_regions._compiled_anything() == announced
    with caplog.at_level(logging.INFO, logger="op_tools"), op_tools.OpAutoCompare():
        torch.add(torch.ones(2, device=sim), 1)
    assert any("runs eagerly" in m for m in caplog.messages) == announced, caplog.messages
