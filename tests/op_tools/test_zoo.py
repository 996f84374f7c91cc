"""The tools on the recipes people train with (tests/zoo.py), on sim: clean runs report nothing and keep their
losses bit for bit, an injected fault is the first failure, and a clean capture replays ok."""

import pytest
import torch
import zoo

import op_tools
from op_tools.offline.replay import ReplayOptions, find_entries, replay

OBSERVING = (op_tools.OpCapture, op_tools.OpAutoCompare, op_tools.OpTimeMeasure, op_tools.OpObserve,
             op_tools.OpOverflowCheck)
IDS = [w.name for w in zoo.ZOO]


@pytest.fixture(autouse=True)
def _no_autocompare_variables(monkeypatch):
    for name in list(__import__("os").environ):
        if "AUTOCOMPARE" in name or name.endswith("_OP_DTYPE_CAST_DICT"):
            monkeypatch.delenv(name)


def _expected(workload, device):
    """The workload's losses without a tool, or a skip when the device cannot run it."""
    try:
        return workload.run(device)
    except (RuntimeError, NotImplementedError) as e:
        if "_thnn_fused" in str(e):
            pytest.skip(f"sim cannot run {workload.name} yet: {str(e).splitlines()[0][:100]}")
        raise


@pytest.mark.parametrize("workload", zoo.ZOO, ids=IDS)
def test_clean_run_fails_nothing_and_every_observing_tool_keeps_its_losses(sim, workload):
    expected = _expected(workload, sim)
    assert expected == workload.run(sim)  # the workload itself is deterministic
    for tool_class in OBSERVING:
        with tool_class() as tool:
            losses = workload.run(sim)
        assert losses == expected, f"{tool_class.__name__} changed the losses"
        if tool_class is op_tools.OpAutoCompare:
            assert tool.failures == [], tool.failures[:3]
            assert tool.counts["forward compared"] > 10 and tool.stale_copies == 0


@pytest.mark.parametrize("workload", zoo.ZOO, ids=IDS)
def test_forward_fault_is_the_first_failure(sim, workload):
    import ditorch.sim

    _expected(workload, sim)
    spec, suffix = workload.forward_fault
    with op_tools.OpAutoCompare() as tool, ditorch.sim.faults(spec):
        workload.run(sim)
    assert tool.failures, f"{spec} was not found"
    first = tool.failures[0]
    assert first["op"].endswith(suffix) and first["phase"] == "forward", first


@pytest.mark.parametrize("workload", [w for w in zoo.ZOO if w.backward_fault], ids=lambda w: w.name)
def test_backward_fault_is_the_first_failure(sim, workload):
    import ditorch.sim

    _expected(workload, sim)
    spec, suffix = workload.backward_fault
    with op_tools.OpAutoCompare() as tool, ditorch.sim.faults(spec):
        workload.run(sim)
    assert tool.failures, f"{spec} was not found"
    first = tool.failures[0]
    assert first["op"].endswith(suffix) and first["phase"] == "backward", first
    assert tool.counts["forward failed"] == 0


@pytest.mark.parametrize("workload", zoo.ZOO, ids=IDS)
def test_with_nothing_in_the_host_copy_cache_a_clean_run_fails_nothing_and_the_fault_is_found_first(sim, workload,
                                                                                                  monkeypatch):
    """The cache keeps no tensor over a quarter of its room (a real model's activations on a GPU): the verdicts must
    not depend on it (a tensor passed twice once took two copies without it: a false failure)."""
    import ditorch.sim
    from op_tools.numerics.host_copies import HostCopies

    expected = _expected(workload, sim)
    monkeypatch.setattr(HostCopies, "MAX_BYTES", 1)
    with op_tools.OpAutoCompare() as tool:
        assert workload.run(sim) == expected
    assert tool.failures == [], tool.failures[:3]
    spec, suffix = workload.forward_fault
    with op_tools.OpAutoCompare() as tool, ditorch.sim.faults(spec):
        workload.run(sim)
    assert tool.failures and tool.failures[0]["op"].endswith(suffix), tool.failures[:1]


@pytest.mark.parametrize("workload", zoo.ZOO + zoo.IN_FLOAT32, ids=[w.name for w in zoo.ZOO + zoo.IN_FLOAT32])
def test_summing_as_a_gpu_a_clean_run_fails_nothing_and_the_faults_are_found_first(sim, workload):
    """``DITORCH_SIM_NUMERICS=gpu``: sim's sums in a CUDA reduction's order, legitimately not the CPU's (issue 34)."""
    import ditorch.sim

    _expected(workload, sim)
    with ditorch.sim.numerics("gpu"):
        with op_tools.OpAutoCompare() as clean:
            workload.run(sim)
        assert clean.failures == [] and clean.counts["forward compared"] > 10, clean.failures[:3]
        for fault, phase in ((workload.forward_fault, "forward"), (workload.backward_fault, "backward")):
            if fault is None:
                continue
            spec, suffix = fault
            with op_tools.OpAutoCompare() as tool, ditorch.sim.faults(spec):
                workload.run(sim)
            assert tool.failures, f"{spec} was not found"
            assert tool.failures[0]["op"].endswith(suffix) and tool.failures[0]["phase"] == phase, tool.failures[0]


@pytest.mark.parametrize("workload", zoo.ZOO, ids=IDS)
def test_clean_capture_replays_ok_for_every_entry(sim, workload, tmp_path):
    _expected(workload, sim)
    with op_tools.OpCapture():
        workload.run(sim)
    entries = find_entries(str(tmp_path / "results" / "op_capture_results"))
    assert len(entries) > 10
    results = [replay(entry, sim, ReplayOptions(acc_check=True)) for entry in entries]
    # "not checked" is no pass either: every entry of a clean capture is replayed and checked
    bad = [(r.entry.label, r.status, r.error or [c for c in r.checks if not c["ok"]]) for r in results
           if r.status != "ok"]
    assert not bad, bad[:5]


def test_one_tool_instance_per_step_compares_every_step_cleanly(sim):
    torch.manual_seed(0)
    model = zoo.tiny_llama(hidden=32).to(sim)
    ids = torch.randint(0, 128, (2, 16)).to(sim)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(4):  # a new tool every step: copies one made never pass for another's
        with op_tools.OpAutoCompare() as tool:
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        assert tool.failures == [] and tool.counts["backward compared"] > 10


def test_several_apply_feature_tools_in_one_process(sim, logged):
    expected = zoo.llama_float32(sim)
    names = {"torch.nn.functional.linear": "autocompare", "torch.nn.functional.silu": "autocompare",
             "torch.Tensor.__mul__": "autocompare", "torch.nn.functional.embedding": "op_capture",
             "torch.rsqrt": "measure_op_time"}
    for name, feature in names.items():
        op_tools.apply_feature(name, feature)
    try:
        losses = zoo.llama_float32(sim)
    finally:
        op_tools.remove_feature()
    out = logged()
    assert losses == expected
    summaries = [line for line in out.splitlines() if line.startswith("OpAutoCompare summary")]
    assert len(summaries) == 3 and all(", 0 failed" in s.split(";")[0] for s in summaries), summaries
    assert "no op failed" in out and "FAIL" not in out


@pytest.mark.gpu
def test_on_a_cuda_gpu_every_recipe_runs_clean_under_autocompare():
    """Issue 34, item 5: the recipes on CUDA (its own kernels, summation orders, TF32 convolutions and fused
    attention), 0 failing calls; the losses unchanged by the tool. One test, so that CUDA starts once."""
    rows, failing = [], {}
    for workload in zoo.ON_CUDA:
        expected, deterministic = zoo.cuda_baseline(workload)
        with op_tools.OpAutoCompare() as tool:
            losses = workload.run("cuda")
        rows.append(f"{workload.name}: {tool.counts['forward compared']} forward, "
                    f"{tool.counts['backward compared']} backward compared, {len(tool.failures)} failing")
        if tool.failures:
            failing[workload.name] = tool.failures[:3]
        assert losses == expected or not deterministic, f"OpAutoCompare changed {workload.name}'s losses on CUDA"
        assert tool.counts["forward compared"] > 10, rows[-1]
    print("\n".join(rows))
    assert not failing, failing
