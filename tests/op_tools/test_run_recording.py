import contextlib
import gc
import json
import math
import os
import sys

import pytest
import torch
from tiny_models import tiny_llama
from torch.nn.modules import module as _module

import op_tools
import op_tools.offline.compare_runs
from op_tools.core import module_path
from op_tools.output.run_recording import FORMAT_VERSION, RecordingFormatError, read_recording


@pytest.fixture(autouse=True)
def _stats_mode(monkeypatch, sim):
    # sim registered before any backward: PyTorch sizes autograd's device queues at the first backward
    monkeypatch.setenv("OP_CAPTURE_MODE", "stats")


def _record_llama_steps(device, steps=2, checkpoint=None, record=True, foreach=False):
    torch.manual_seed(0)
    model = tiny_llama().to(device)
    if checkpoint is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpoint == "reentrant"})
        model.train()
    ids = torch.randint(0, 128, (2, 16)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)
    with op_tools.OpCapture() if record else contextlib.nullcontext() as capture:
        for _ in range(steps):
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return read_recording(capture.recorder.file.path) if record else None


def test_stats_mode_records_cpu_calls_forward_and_backward_with_module_paths_and_steps():
    header, records = _record_llama_steps("cpu")
    assert header["version"] == FORMAT_VERSION and header["complete"]
    forward = [r for r in records if r["phase"] == "forward"]
    backward = [r for r in records if r["phase"] == "backward"]
    down = [r for r in forward if r["module"] == "model.layers.1.mlp.down_proj"]
    assert [(r["step"], r["index"], r["op"]) for r in down] == [(0, 0, "torch.nn.functional.linear"),
                                                                 (1, 0, "torch.nn.functional.linear")]
    silu = next(r for r in forward if r["module"] == "model.layers.1.mlp.act_fn")
    assert silu["op"] == "torch.nn.functional.silu" and silu["device"] == "cpu"
    (where, dtype, shape, low, high, mean, norm, nan, inf, *fingerprints) = silu["outputs"][0]
    assert len(fingerprints) == 16 and len(set(fingerprints)) == 16
    x = silu["inputs"][0]
    assert (where, dtype, shape, nan, inf) == ("[0]", "float32", [2, 16, 128], 0, 0)
    assert low >= -0.28 and high <= max(x[4], 0) and norm > 0 and abs(mean) < high
    # backward: one record per call whose inputs take gradients, attributed to the forward call's module
    grads = [r for r in backward if r["module"] == "model.layers.1.mlp.down_proj"]
    assert len(grads) == 2 and all(r["complete"] for r in grads)
    assert grads[0]["forward_seq"] == down[0]["seq"] and grads[0]["step"] == 0
    assert [g[2] for g in grads[0]["grad_inputs"]] == [[2, 16, 128], [64, 128]]  # the input, then the weight
    # backward records come in the order backward ran them: the last layer's first
    order = [r["module"] for r in backward if r["module"].endswith("mlp.down_proj") and r["step"] == 0]
    assert order == ["model.layers.1.mlp.down_proj", "model.layers.0.mlp.down_proj"]
    optimizer = [r for r in records if r["phase"] == "optimizer"]
    assert optimizer and all(r["module"] == "" for r in optimizer)


def test_checkpoint_recomputation_adds_no_forward_records_and_keeps_backward_records():
    _, plain = _record_llama_steps("cpu", steps=1)
    for kind in ("non-reentrant", "reentrant"):
        _, checkpointed = _record_llama_steps("cpu", steps=1, checkpoint=kind)

        def forward_keys(records):
            return [(r["module"], r["index"], r["op"]) for r in records if r["phase"] == "forward"]

        layer_calls = [k for k in forward_keys(checkpointed) if k[0].startswith("model.layers.1.")]
        assert layer_calls == [k for k in forward_keys(plain) if k[0].startswith("model.layers.1.")], kind
        if kind == "non-reentrant":  # the forward ran with its graph: its calls' backward is recorded
            def backward_keys(records):
                # by op, not index: torch 2.11's non-reentrant checkpoint calls torch.empty twice in each layer it
                # wraps (its _NoopSaveInputs), which shifts the indices of that layer's own calls
                return sorted((r["module"], r["op"]) for r in records if r["phase"] == "backward")

            assert backward_keys(checkpointed) == backward_keys(plain)


def test_a_call_backward_makes_of_its_own_is_a_backward_call_compared_and_recomputations_are_counted(group,
                                                                                                       tmp_path):
    import torch.distributed as dist
    from torch.utils.checkpoint import checkpoint

    from op_tools.offline.compare_runs.report import console_report

    torch.manual_seed(0)
    layer, x = torch.nn.Linear(4, 4), torch.randn(2, 4, requires_grad=True)
    with op_tools.OpCapture() as capture:
        y = checkpoint(layer, x, use_reentrant=False, context_fn=op_tools.checkpoint_context_fn)
        y.register_hook(lambda g: dist.all_reduce(g))  # a call of backward's own, as DDP's all-reduce from its hook
        y.sum().backward()
    _, records = read_recording(capture.recorder.file.path)
    made = [(r["phase"], r["op"], r.get("in_backward", False)) for r in records if "forward_seq" not in r]
    assert ("backward", "torch.distributed.all_reduce", True) in made and not any(
        phase == "recompute" and op == "torch.distributed.all_reduce" for phase, op, _ in made), made
    reduced = next(r for r in records if r["op"] == "torch.distributed.all_reduce")
    assert [t[2] for t in reduced["inputs"]] == [[2, 4]] and [t[2] for t in reduced["outputs"]] == [[2, 4]]
    # compared as a call: aligned, judged; a recomputation (here the forward linear's record, marked so) left out
    # and counted
    lines = open(capture.recorder.file.path).read().splitlines(keepends=True)
    linear = next(json.loads(line) for line in lines if '"op":"torch.nn.functional.linear"' in line)
    recomputed = tmp_path / "run_recomputed.jsonl"
    recomputed.write_text("".join(lines[:-1]) + json.dumps({**linear, "phase": "recompute", "index": None,
                                                           "seq": 99}) + "\n" + lines[-1].replace(
        f'"records":{len(lines) - 2}', f'"records":{len(lines) - 1}'))
    result = op_tools.offline.compare_runs.compare(str(recomputed), str(recomputed))
    assert [r.op for r in result.compared].count("torch.distributed.all_reduce") == 1
    assert result.verdict() == "clean"
    assert "; left out: 1 recomputations in A, 1 in B (a checkpoint's reruns of forward calls, compared as their " \
           "forward)" in console_report(result, [])


def test_a_call_records_at_most_the_configured_number_of_tensors(monkeypatch):
    monkeypatch.setenv("OP_CAPTURE_STATS_MAX_TENSORS", "2")
    tensors = [torch.randn(3) for _ in range(5)]
    with op_tools.OpCapture() as capture:
        torch.cat(tensors)
    _, (record,) = read_recording(capture.recorder.file.path)
    assert [e[0] for e in record["inputs"]] == ["[0][0]", "[0][1]"]
    assert record["omitted"] == {"inputs": 3}


def test_the_number_of_tensors_recorded_is_a_keyword_taking_an_int_as_the_other_counts_do():
    # it took only text ("2"), an int was a TypeError
    tensors = [torch.randn(3) for _ in range(5)]
    with op_tools.OpCapture(mode="stats", stats_max_tensors=2) as capture:
        torch.cat(tensors)
    _, (record,) = read_recording(capture.recorder.file.path)
    assert record["omitted"] == {"inputs": 3}
    with pytest.raises(ValueError, match=r"OpCapture\(stats_max_tensors=0\): must be >= 1; expected an int >= 1"):
        op_tools.OpCapture(mode="stats", stats_max_tensors=0)


@pytest.mark.parametrize("device", ["cpu", "sim"])
def test_inputs_are_recorded_as_they_were_before_the_op_wrote_them(device, request):
    """An op that writes its inputs has them measured before it runs; one that cannot, with its outputs, after: the
    same values either way."""
    if device == "sim":
        request.getfixturevalue("sim")
    x = torch.arange(1.0, 2049.0, device=device)
    y = torch.full((2048,), 2.0, device=device)
    with op_tools.OpCapture() as capture:
        torch.mul(x, y)  # writes nothing: inputs measured with the output
        x.mul_(y)  # writes x: x measured before
        torch.add(x, 1, out=y)  # writes y (out=)
    _, (mul, mul_, add) = read_recording(capture.recorder.file.path)
    assert mul["inputs"][0][3:6] == [1.0, 2048.0, 1024.5] and mul["outputs"][0][3:5] == [2.0, 4096.0]
    assert mul_["inputs"][0][3:5] == [1.0, 2048.0] and mul_["outputs"][0][3:5] == [2.0, 4096.0]
    assert add["inputs"][0][3:5] == [2.0, 4096.0]
    assert [e[3:5] for e in add["inputs"][1:]] == [[2.0, 2.0]]  # y before add wrote it
    assert add["outputs"][0][3:5] == [3.0, 4097.0]
    assert mul["inputs"][0][6:] == mul_["inputs"][0][6:]  # the same tensor values: the same statistics


def test_statistics_count_nan_and_inf_and_empty_tensors_have_none():
    x, nothing = torch.tensor([1.0, float("nan"), float("inf"), -2.0]), torch.empty(0)
    with op_tools.OpCapture() as capture:
        torch.abs(x)
        torch.abs(nothing)
    _, (record, empty) = read_recording(capture.recorder.file.path)
    assert record["outputs"][0][7:9] == [1, 1]
    assert empty["outputs"][0] == ["[0]", "float32", [0]]


def test_sim_recording_names_the_real_device_even_shown_as_cuda(run_script, tmp_path):
    done = run_script("""
        import ditorch, op_tools
        from op_tools.output.run_recording import read_recording
        x = torch.ones(4, device="cuda")
        with op_tools.OpCapture() as capture:
            y = (x * 2).sum()
        _, records = read_recording(capture.recorder.file.path)
        print(x.device, sorted({r["device"] for r in records}))
    """, {"DITORCH_BACKEND": "sim", "DITORCH_SHOW_DEVICE_AS_CUDA": "1", "OP_CAPTURE_MODE": "stats",
          "OP_TOOLS_RESULTS_DIR": str(tmp_path / "r"), "OP_TOOLS_VERBOSE": "0"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == "cuda:0 ['sim:0']"


def test_a_recording_of_a_newer_format_version_is_refused_naming_both_versions(tmp_path):
    with op_tools.OpCapture() as capture:
        torch.ones(2).sum()
    path = capture.recorder.file.path
    lines = open(path).read().splitlines()
    header = json.loads(lines[0])
    header["version"] = FORMAT_VERSION + 1
    newer = tmp_path / "run_newer.jsonl"
    newer.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    with pytest.raises(RecordingFormatError, match=f"version {FORMAT_VERSION + 1}.*reads version {FORMAT_VERSION}"):
        read_recording(str(newer))
    del header["version"]  # it said "format version None, written by a newer op_tools"
    unversioned = tmp_path / "run_unversioned.jsonl"
    unversioned.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    with pytest.raises(RecordingFormatError, match=r"its header has no format version \("):
        read_recording(str(unversioned))
    other = tmp_path / "run_other.jsonl"
    other.write_text('{"name": "something else"}\n')
    with pytest.raises(RecordingFormatError, match="not a run recording"):
        read_recording(str(other))


def test_a_partial_recording_reads_up_to_its_last_complete_line(tmp_path):
    with op_tools.OpCapture() as capture:
        torch.ones(2).sum()
        torch.ones(3).sum()
    text = open(capture.recorder.file.path).read().splitlines()
    (tmp_path / "died").mkdir()
    partial = tmp_path / "died" / "run_x.jsonl.partial"
    partial.write_text("\n".join(text[:3]) + "\n" + text[3][:10])
    header, records = read_recording(str(tmp_path / "died"))
    assert not header["complete"] and len(records) == 2


def test_module_paths_name_unregistered_modules_by_class_and_stop_when_released():
    class Inner(torch.nn.Module):
        def forward(self, x):
            return x.relu()

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block = torch.nn.Linear(2, 2)
            self.helpers = [Inner()]  # not registered

        def forward(self, x):
            return self.helpers[0](self.block(x))

    model, x = Outer(), torch.ones(1, 2)
    with op_tools.OpCapture() as capture:
        model(x)
    _, records = read_recording(capture.recorder.file.path)
    assert [(r["module"], r["op"]) for r in records] == [("block", "torch.nn.functional.linear"),
                                                          ("Outer.Inner", "torch.Tensor.relu")]
    assert not any(module_path._enter is hook for hook in _module._global_forward_pre_hooks.values())  # released
    assert not any(module_path._leave is hook for hook in _module._global_forward_hooks.values())
    assert os.path.basename(capture.recorder.file.path).startswith("run_pid")


def test_a_distributed_data_parallel_wrapper_adds_nothing_to_the_paths(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model, x = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()), torch.ones(1, 2)
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        paths = []
        for run in (model, wrapped):
            with op_tools.OpCapture() as capture:
                run(x)
            _, records = read_recording(capture.recorder.file.path)
            # the wrapper's own calls (its record_function ranges) are its own, under its class name
            wrapper = ("", "DistributedDataParallel")
            paths.append([(r["module"], r["op"]) for r in records if r["module"] not in wrapper])
    finally:
        dist.destroy_process_group()
    assert paths[0] == paths[1] == [("0", "torch.nn.functional.linear"), ("1", "torch.nn.functional.relu")]


def test_a_tool_stopped_inside_a_forward_leaves_no_stale_path_for_the_next():
    tool = op_tools.OpCapture()

    class StopsInside(torch.nn.Module):
        def forward(self, x):
            tool.stop()
            return x

    StopsInside()(torch.ones(1)) if tool.start() else None
    with op_tools.OpCapture() as capture:
        torch.ones(2).sum()
    _, records = read_recording(capture.recorder.file.path)
    assert [r["module"] for r in records] == ["", ""]


def test_under_torchrun_each_rank_writes_its_own_recording_and_compare_runs_picks_one(run_script, tmp_path):
    for rank in (0, 1):
        done = run_script("""
            with op_tools.OpCapture():
                torch.ones(3).mul(2)
        """, {"RANK": str(rank), "WORLD_SIZE": "2", "OP_CAPTURE_MODE": "stats", "OP_TOOLS_VERBOSE": "0",
              "OP_TOOLS_RESULTS_DIR": str(tmp_path / "run")})
        assert done.returncode == 0, done.stderr
    header, _ = read_recording(str(tmp_path / "run"), rank=1)
    assert header["rank"] == 1 and f"{os.sep}rank1{os.sep}" in header["path"]
    with pytest.raises(ValueError, match="(?s)expected one run recording .*rank0.*rank1.*--rank"):
        read_recording(str(tmp_path / "run"))
    result = op_tools.offline.compare_runs.compare(str(tmp_path / "run"), str(tmp_path / "run"), rank=0)
    assert result.divergences == [] and result.rows


def test_a_folder_holding_two_recordings_of_no_rank_asks_for_a_file_not_a_rank(tmp_path):
    from op_tools.output.run_recording import find_recording

    for name in ("run_a.jsonl", "run_b.jsonl"):  # two sessions of one process, outside torchrun
        (tmp_path / name).write_text("")
    with pytest.raises(ValueError) as raised:
        find_recording(str(tmp_path))
    assert str(raised.value).endswith("run_b.jsonl\n(name a file)")  # --rank N would not tell them apart


def _without_times(records):
    return [{k: v for k, v in r.items() if k != "time"} for r in records]


def test_a_recording_waits_for_the_device_once_and_reads_its_statistics_in_batches(sim):
    _record_llama_steps(sim, steps=1)  # the fingerprints' weights go to the device once per process and dtype
    before = torch.sim.device_counts()
    header, records = _record_llama_steps(sim, steps=1)
    counts = torch.sim.device_counts() - before
    before = torch.sim.device_counts()
    _record_llama_steps(sim, steps=1, record=False)
    plain = torch.sim.device_counts() - before
    assert header["complete"] and len(records) > 400
    # the tool's one wait is its stop's, none when the last batch (sent as the step returned) is in by then: none per
    # call, none per step
    assert counts.synchronizations - plain.synchronizations <= 1
    assert counts.device_to_host_copies <= len(records) // 64 + 3  # 64 calls a copy (a few CPU calls end a batch)
    # kernels: a call's tensors measured together, inputs with outputs unless the op writes them, a tensor unchanged
    # since an earlier record (or a reshaped view of it) not measured again, the fingerprints of a batch in one product
    # (4.6 a record, 4.8 before reshaped views took over; 6.5 with a product a call, 13.0 measuring every tensor, 16.0
    # measuring one tensor at a time)
    assert (counts.kernel_launches - plain.kernel_launches) / len(records) <= 5.5


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="an incremental collector promotes objects differently")
def test_a_record_holds_few_objects_the_garbage_collector_promotes(sim):
    # What a record holds until its statistics arrive, and a call until its backward, lives across the collector's
    # young collections into its oldest generation; each such object costs about four visits of a full collection of
    # the program's heap (~2.3 us on a 2-core VM, tests/gc_promotions.py). Tuples of numbers (untracked), small
    # objects instead of closures, a stack per call instead of three 0-d tensors a tensor, no aliases kept for a
    # record whose statistics were all taken over: 16.4-19.4 a record averaged over the collector's phases, as the
    # program's other allocations fall (30.1 before this work; the same steps without the tool promote none).
    from gc_promotions import promoted_on_average

    _record_llama_steps(sim, steps=1)  # imports, caches and the fingerprints' weights: not the records'
    gc.collect()
    gc.freeze()  # the process's objects aside: the count is then the records', and counting is cheap
    try:
        promoted, recorded = promoted_on_average(lambda: len(_record_llama_steps(sim, steps=3)[1]))
    finally:
        gc.unfreeze()
    assert recorded[0] > 1000 and promoted / recorded[0] <= 23, promoted / recorded[0]


def test_statistics_taken_over_from_an_earlier_record_are_the_ones_measured_again(sim, monkeypatch):
    # A tensor unchanged since an earlier record takes over its statistics; the file is the one measuring every tensor
    # gives, also where sim's foreach optimizer writes its tensors without bumping their version counters (as CUDA's).
    from op_tools.output import run_recording

    _, taken_over = _record_llama_steps(sim, steps=2, foreach=True)
    monkeypatch.setattr(run_recording, "KNOWN_ENTRIES", 0)  # nothing remembered: every tensor measured
    _, measured = _record_llama_steps(sim, steps=2, foreach=True)
    assert any(r["phase"] == "optimizer" for r in measured)
    assert _without_times(taken_over) == _without_times(measured)


def test_a_reshaped_view_takes_over_the_statistics_of_the_contiguous_tensor_it_views(sim):
    # Every reduction behind the statistics reads contiguous memory in its flat order whatever the shape: a view
    # reshaping a measured contiguous tensor (a gradient viewed back, heads split) is not measured again; a transposed
    # one holds its values in another order, and is.
    x = torch.randn(64, 48).to(sim)
    with op_tools.OpCapture() as capture:
        y = x * 2
        before = torch.sim.device_counts()
        y.view(8, 8, 48)
        viewed = torch.sim.device_counts() - before
        y.t()
        transposed = torch.sim.device_counts() - before - viewed
    _, records = read_recording(capture.recorder.file.path)
    view = next(r for r in records if r["op"] == "torch.Tensor.view")
    mul = next(r for r in records if r["op"] == "torch.Tensor.mul")
    assert viewed.kernel_launches == 0 and transposed.kernel_launches > 0
    assert view["outputs"][0][3:] == view["inputs"][0][3:] == mul["outputs"][0][3:]
    assert view["outputs"][0][2] == [8, 8, 48]


def test_a_recording_on_an_asynchronous_device_equals_a_synchronous_ones(sim):
    import ditorch.sim

    _, synchronous = _record_llama_steps(sim, steps=1)
    with ditorch.sim.asynchronous(lag=500):  # statistics arrive 500 kernels late: more than a batch's worth
        _, late = _record_llama_steps(sim, steps=1)
    assert _without_times(late) == _without_times(synchronous)


def test_nan_and_inf_counts_are_read_from_the_tensor_kept_until_the_statistics_arrive(sim):
    import ditorch.sim

    x = torch.ones(4, device=sim)
    with ditorch.sim.asynchronous(lag=50), op_tools.OpCapture() as capture:
        y = torch.exp(x * torch.tensor([1.0, 100.0, 1000.0, 1.0], device=sim))  # inf twice
        z = y - y  # nan where inf
        y.zero_()  # written in place before exp's record was read: its counts are unknown, said as -1
        w = torch.exp(x * torch.tensor([1.0, 1000.0, 1.0, 1.0], device=sim))  # inf once
        v = w * 2  # w's statistics taken over from exp's record: its counts too, through exp's alias
        del z, v
    _, records = read_recording(capture.recorder.file.path)
    exp, exp_w = [r for r in records if r["op"] == "torch.exp"]
    sub = next(r for r in records if r["op"] == "torch.Tensor.sub")
    mul = [r for r in records if r["op"] == "torch.Tensor.mul"][-1]
    assert exp["outputs"][0][7:9] == [-1, -1]  # UNKNOWN_COUNT: the statistics say inf, the counts are lost
    assert sub["inputs"][0][7:9] == sub["inputs"][1][7:9] == [-1, -1]  # y, taken over from exp's record
    assert sub["outputs"][0][7:9] == [2, 0]  # nan twice, read from the kept alias
    assert exp_w["outputs"][0][7:9] == mul["inputs"][0][7:9] == [0, 1] and mul["outputs"][0][7:9] == [0, 1]


@pytest.mark.parametrize("workload", __import__("zoo").ZOO, ids=lambda w: w.name)
def test_every_recipe_records_the_same_file_with_statistics_taken_over(sim, monkeypatch, workload, tmp_path):
    # BatchNorm's running statistics, GradScaler's unscale, the foreach optimizers, in-place ReLU, checkpointing:
    # whatever they write is measured again, so the file equals the one measuring every tensor.
    from op_tools.output import run_recording

    recordings = []
    for remembered in (run_recording.KNOWN_ENTRIES, 0):
        monkeypatch.setattr(run_recording, "KNOWN_ENTRIES", remembered)
        monkeypatch.setenv("OP_TOOLS_RESULTS_DIR", str(tmp_path / str(remembered)))
        with op_tools.OpCapture() as capture:
            workload.run(sim)
        recordings.append(_without_memory_never_written(_without_times(read_recording(capture.recorder.file.path)[1])))
    assert len(recordings[0]) > 20 and recordings[0] == recordings[1]


def _without_memory_never_written(records):
    """The records without what each run found in fresh memory (an empty's result, an initialiser's target before
    it ran), which compare_runs skips too."""
    from op_tools.ops.op_facts import op_facts

    kept = []
    for record in records:
        facts = op_facts(record["op"])
        if not facts.uninitialised:
            kept.append({k: v for k, v in record.items() if k != "inputs"} if facts.overwrites else record)
    return kept


EDGE_VALUES = [0.0, -0.0, 2.0, -7.0, 0.1, 1 / 3, 12345678.0, 123456789.0, 99999999.6, 1.5e15, 1e16, 1.23e17, 1e-4,
               1.2345678e-5, 1e-300, 1e-308, 3e-310, 5e-324, 2.0**53, 1e308, float("inf"), float("-inf"), float("nan")]


@pytest.mark.parametrize("where", ["[0]", "[weight]", "[{x}]", '[a"b\\c]', "[größe]", "[info]"])
def test_a_sides_text_is_the_text_json_writes_for_its_entries(where):
    # A record's statistics are written straight from their values (one format call a side, no float parsed back, no
    # JSON repr): the text must be JSON's for the same entries, byte for byte, whatever the values and the names.
    import random

    from op_tools.output import result_files
    from op_tools.output.run_recording import _Side

    rng = random.Random(0)
    tensors = [(where, torch.ones(3, 5)), ("[1]", torch.ones(0)), ("[2]", torch.ones(2, dtype=torch.float64))]
    pools = {"edge": lambda: rng.choice(EDGE_VALUES),
             "nonfinite": lambda: rng.choice([float("inf"), float("-inf"), float("nan"), 0.5, -3.0]),
             "integral": lambda: float(rng.randint(-10**6, 10**6)),
             "run": lambda: rng.gauss(0, 1) * 10.0 ** rng.randint(-12, 6)}
    direct = dict.fromkeys(pools, 0)
    for trial in range(800):
        kind = list(pools)[trial % len(pools)]
        side = _Side("inputs", tensors, 0)
        for slot in side.slots:
            slot.values = tuple(pools[kind]() for _ in range(20))
            slot.counts = (rng.choice([0, 3, 123456789]) if kind == "edge" else 0, 0)
        text = side.text()
        direct[kind] += text is not None
        assert text is None or text == result_files.json_line(side.entries()), (trial, text)
    # what a run records (no inf/nan, no value from 1e7 to 1e16) takes the direct path, but where a name looks like it
    assert direct["nonfinite"] == 0 and direct["run"] == direct["integral"] == (0 if where == "[info]" else 200)


def test_a_recordings_lines_are_the_ones_json_wrote(sim, monkeypatch, tmp_path):
    # The same steps recorded with each line written straight and through JSON: the same bytes (but the times), and
    # every statistic a float, as JSON writes float(f"{v:.8g}").
    from op_tools.output import result_files, run_recording

    def recorded(folder):
        monkeypatch.setenv("OP_TOOLS_RESULTS_DIR", str(tmp_path / folder))
        torch.manual_seed(0)
        x = torch.randn(64, 48, device=sim) * 3e7  # sums and norms from 1e7 to 1e16: JSON's path
        with op_tools.OpCapture() as capture:
            (x * torch.tensor([1.0, float("inf")] * 24, device=sim)).exp()  # inf and nan: JSON's path
            _record_llama_steps(sim, steps=1, record=False, foreach=True)
        with open(capture.recorder.file.path) as f:
            return f.read().splitlines()

    direct = recorded("direct")
    monkeypatch.setattr(run_recording._Pending, "line", lambda self: result_files.json_line(self.finished()))
    through_json = recorded("json")
    assert len(direct) == len(through_json) > 400

    def compared(lines):  # but the times, and what fresh memory held (an empty's garbage)
        records = _without_memory_never_written(_without_times([json.loads(line) for line in lines[1:-1]]))
        return [result_files.json_line(record) for record in records]

    assert compared(direct) == compared(through_json)
    assert all(result_files.json_line(json.loads(line)) == line for line in direct)
    # standard JSON: NaN and the infinities, which it has no number for, as strings (they were bare NaN, Infinity)
    statistics = [v for line in direct[1:-1] for side in ("inputs", "outputs", "grad_outputs", "grad_inputs")
                  for entry in _standard_json(line).get(side, ()) for v in entry[3:]]
    assert len(statistics) > 10000 and {"NaN", "Infinity"} <= set(statistics)
    assert all(type(v) is float or v in ("NaN", "Infinity", "-Infinity") for v in statistics)
    _, records = run_recording.read_recording(str(tmp_path / "direct"))  # read back as floats
    read = [v for record in records for side in ("inputs", "outputs") for entry in record.get(side, ())
            for v in entry[3:]]
    assert all(type(v) is float for v in read) and any(math.isnan(v) for v in read) and math.inf in read


def _standard_json(line: str):
    def refused(constant):
        raise ValueError(f"{constant} is not standard JSON")

    return json.loads(line, parse_constant=refused)
