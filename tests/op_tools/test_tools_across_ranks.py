"""op_tools under torchrun (2 processes, sim): every tool is clean over a clean DDP step on both ranks; over a
tensor-parallel MLP (DTensor) OpOverflowCheck checks each rank's part and finds a fault on rank 1 where it is born,
and OpAutoCompare compares the DTensor calls on their whole tensors: clean when clean, the faulty op found; over
FSDP2 steps OpSelfCheck checks every product and names noisy ones on the faulty rank alone."""

from __future__ import annotations

import collections
import csv
import json
import os
import re
import subprocess
import sys

import pytest
import torch.distributed as dist
from subprocess_env import ROOT, child_env, torchrun_on_sim

from op_tools.output import reporting

pytestmark = pytest.mark.children_import("transformers")  # their scripts train transformers models

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "tools_across_ranks.py")
TOOLS = ("OpAutoCompare", "OpCapture", "OpObserve", "OpTimeMeasure", "OpOverflowCheck", "OpFallback", "OpDtypeCast",
         "OpSelfCheck")


def _wrapped_line(output: str, rank: int, start: str) -> str:
    """Rank ``rank``'s console line that begins with ``start``, its continuation lines (wrapped at the console's
    width) joined back."""
    own = [line.removeprefix(f"[rank{rank}] ") for line in output.splitlines() if line.startswith(f"[rank{rank}] ")]
    first = next(i for i, line in enumerate(own) if line.startswith(start))
    last = next((i for i in range(first + 1, len(own)) if not own[i].startswith(reporting.CONTINUATION)), len(own))
    return reporting.unwrapped("\n".join(own[first:last]))


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("ranks")


@pytest.fixture(scope="module")
def reports(out):
    result = torchrun_on_sim(SCRIPT, out)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.parametrize("tool", TOOLS)
def test_a_clean_ddp_step_is_clean_under_each_tool_on_both_ranks(reports, tool):
    for report in reports:
        assert report["ddp"][tool] == {"verdict": "clean", "found": "", "not_checked": ""}, tool


def test_self_check_names_noisy_matmuls_on_the_one_faulty_rank_of_a_ddp_step(reports):
    noise = [report["ddp"]["OpSelfCheck noise"] for report in reports]
    assert noise[0] == {"verdict": "clean", "findings": 0, "first": None}, noise
    assert noise[1]["verdict"] == "found" and noise[1]["findings"] >= 1, noise
    assert noise[1]["first"][0] == "torch.nn.functional.linear" and noise[1]["first"][2:] == [1, 0], noise


@pytest.mark.parametrize("tool", ["OpAutoCompare", "OpSelfCheck"])
def test_a_ddp_hooks_all_reduce_waited_for_through_its_future_is_checked_and_a_flip_found_on_its_rank(reports, tool):
    # fp16_compress_hook takes each bucket's all-reduce's future: before, said not checked on both ranks (and
    # OpSelfCheck never saw DDP's buckets, all-reduced on autograd's thread)
    hooked = [report["ddp"][f"{tool} fp16 hook"] for report in reports]
    assert [h["found"] for h in hooked] == [[], ["torch.distributed.all_reduce"]], hooked
    assert all(h["not_checked"] == "" and h["all_reduces"] >= 1 for h in hooked), hooked


@pytest.mark.parametrize("tool", ["OpAutoCompare", "OpSelfCheck"])
def test_ddp_with_powersgd_has_every_all_reduce_checked_and_noise_found_on_its_rank(reports, tool):
    # PowerSGD's all-reduces of P and Q are issued in a future's callback. On sim (as on NCCL) a collective's future
    # is complete when taken, so the callbacks run at once, in program order: their collectives are checked (before,
    # said not checked; before that, a deadlock on sim). OpSelfCheck's sums of the empty all-reduce of uncompressed
    # gradients once failed the tool.
    clean = [report["ddp"][f"{tool} powerSGD clean"] for report in reports]
    assert all(c["verdict"] == "clean" and c["not_checked"] == "" and c["all_reduces"] >= 3 for c in clean), clean
    noise = [report["ddp"][f"{tool} powerSGD noise"] for report in reports]
    assert [n["found"] for n in noise] == [[], ["torch.distributed.all_reduce"]], noise
    assert all(n["not_checked"] == "" for n in noise), noise


def test_self_check_checks_a_tensor_parallel_mlps_products_on_each_ranks_local_part(reports):
    # the column-parallel up projection's local product is a product; the row-parallel down projection's local
    # result is a Partial sum holding half the replicated bias
    for report in reports:
        clean = report["tp"]["OpSelfCheck"]
        assert clean["verdict"] == "clean" and clean["findings"] == 0, clean
        # up, down, silu on up's local output; silu and a layer norm of a sequence-sharded DTensor, on the local
        # shard; a layer norm over a sharded dimension: not checked, and the verdict says so
        assert clean["counts"] == {"checked": 5}, clean
        assert report["tp"]["OpSelfCheck sharded rows"] == {"verdict": "unchecked",
                                                            "counts": {"not checked (DTensor)": 1}}, report["tp"]
    noise = [report["tp"]["OpSelfCheck noise"] for report in reports]
    assert noise[0] == {"verdict": "clean", "found": []}, noise
    assert noise[1]["verdict"] == "found", noise
    assert noise[1]["found"] == [["torch.nn.functional.linear", "down", 1], ["torch.nn.functional.linear", "up", 1]]


def test_self_check_is_quiet_under_fsdp2_and_names_noisy_products_on_the_faulty_rank_only(reports):
    # FSDP2 unshards the parameters into plain tensors before each module runs: every product is a plain one, checked
    for report in reports:
        clean = report["fsdp2"]["OpSelfCheck"]
        assert clean["verdict"] == "clean" and clean["findings"] == 0, clean
        assert clean["counts"].get("checked", 0) > 0 and "not checked (DTensor)" not in clean["counts"], clean
    noise = [report["fsdp2"]["OpSelfCheck noise"] for report in reports]
    assert noise[0] == {"verdict": "clean", "found": [], "first_step": None}, noise
    assert noise[1]["verdict"] == "found" and noise[1]["found"], noise
    assert all(rank == 1 and op == "torch.nn.functional.linear" for op, _, rank in noise[1]["found"]), noise
    assert noise[1]["first_step"] == 0, noise


def test_overflow_check_reads_no_nan_in_the_memory_fsdp2_stages_its_all_gathers_in(reports):
    # fsdp.all_gather_copy_in takes an empty buffer (a GPU's reused memory: nan here), copies this rank's part in and
    # hands it to the all-gather: the nan of the other ranks' parts was "read first" by it, a clean run said "found"
    for report in reports:
        assert report["fsdp2"]["OpOverflowCheck, empties nan"] == {"verdict": "clean", "not_checked": ""}, report


def test_fsdp2s_asynchronous_all_gathers_are_checked_at_fsdp2s_own_waits(reports):
    # _set_unshard_async_op(True): each unshard's all-gather returns a Work that FSDP2 waits for before the layer runs
    for report in reports:
        compare = report["fsdp2"]["OpAutoCompare async unshard"]
        assert compare["verdict"] == "clean" and compare["not_checked"] == "", compare
        assert not [reason for reason in compare["skipped"] if "collective" in reason], compare  # none skipped
        assert sum(n for name, n in compare["collectives"].items() if "all_gather" in name) >= 3, compare


def test_self_check_checks_collectives_by_their_sums_across_ranks_and_names_a_faulty_link(reports):
    # all_reduce (sum, avg), reduce_scatter_tensor, all_gather_into_tensor, broadcast, reduce, all_to_all_single (even
    # and uneven splits), in float32 and bfloat16
    for report in reports:
        clean = report["collectives"]["clean"]
        assert clean == {"verdict": "clean", "counts": {"checked": 16}, "found": [], "findings": 0}, clean
    faulty = [report["collectives"]["allreduce:bitflip=1,rank=1"] for report in reports]
    assert faulty[0]["verdict"] == "clean" and faulty[0]["findings"] == 0, faulty
    # rank 1's all-reduces received a flipped bit (sim's faulty link), in both dtypes, sum and average; the check's
    # own exchange is an all_gather, so the other collectives stay clean
    assert faulty[1]["found"] == [["torch.distributed.all_reduce", 1]] and faulty[1]["findings"] == 4, faulty
    # a bit flipped in what rank 1 received through its all-to-alls (even and uneven, both dtypes)
    faulty = [report["collectives"]["all_to_all_single:bitflip=1,rank=1"] for report in reports]
    assert faulty[0]["verdict"] == "clean" and faulty[0]["findings"] == 0, faulty
    assert faulty[1]["found"] == [["torch.distributed.all_to_all_single", 1]] and faulty[1]["findings"] == 4, faulty
    # and through its reduces, of which it is the destination
    faulty = [report["collectives"]["reduce:bitflip=1,rank=1"] for report in reports]
    assert faulty[0]["verdict"] == "clean" and faulty[0]["findings"] == 0, faulty
    assert faulty[1]["found"] == [["torch.distributed.reduce", 1]] and faulty[1]["findings"] == 2, faulty


def test_self_check_checks_asynchronous_collectives_at_their_waits_and_names_a_link_that_flips_a_bit_late(reports):
    # the same collectives with async_op=True, waited for last first; rank 1's all-reduces complete late (sim's slow
    # link) with a bit flipped: a check at the call would read them unflipped
    clean, faulty = (report["collectives"]["async, late"] for report in reports)
    assert clean == {"verdict": "clean", "counts": {"checked": 16}, "found": [], "findings": 0}, clean
    assert faulty["found"] == [["torch.distributed.all_reduce", 1]] and faulty["findings"] == 4, faulty


def test_self_check_says_an_all_reduce_of_a_nan_a_rank_sent_was_not_checked_and_finds_nothing(reports):
    # rank 0 sent a nan: both ranks rightly received it, and the sums have no finite bound to judge them by
    for report in reports:
        assert report["collectives"]["nan sent by rank 0"] == {
            "verdict": "unchecked", "counts": {"not checked (operands hold inf or nan)": 1}, "findings": 0}, report


def test_a_fault_in_a_tensor_parallel_mlp_is_found_where_it_is_born(reports):
    on_rank1 = reports[1]["tp"]["OpOverflowCheck"]
    assert on_rank1["verdict"] == "found", [report["tp"] for report in reports]
    assert on_rank1["first"].startswith("first inf/nan from finite inputs: torch.nn.functional.silu in MLP (forward)")
    # Rank 0 receives it through the all-reduce, which DTensor waits for below the tools: no op of rank 0 is blamed,
    # the first to read it is named (before, square's backward was blamed: its saved input's nan was not counted).
    on_rank0 = reports[0]["tp"]["OpOverflowCheck"]
    assert on_rank0["verdict"] == "found" and on_rank0["first"] == "None", [report["tp"] for report in reports]
    seen = on_rank0["seen"].split("\n")[0]
    assert seen.startswith("first inf/nan read, made by no call checked: ") and "silu" not in seen, on_rank0


def test_fallback_and_dtype_cast_run_a_tensor_parallel_step_and_dtensor_writes_without_crashing_it(reports):
    for report in reports:
        fallback, cast = report["tp"]["OpFallback"], report["tp"]["OpDtypeCast"]
        # a DTensor's call runs on the device, said not fallen back; the plain tensors' calls fall back
        assert fallback["verdict"] == "unchecked", fallback
        assert "a DTensor's call runs on the device" in fallback["not_checked"], fallback
        assert cast["verdict"] == "clean" and cast["not_checked"] == "", cast
        for changed in (fallback, cast):
            assert changed["loss"] and changed["filled"] == 16.0 and changed["grads"], changed


@pytest.mark.parametrize("rank", [0, 1])
def test_two_identical_ddp_recordings_compare_equal_on_every_rank(reports, out, rank):
    command = [sys.executable, "-m", "op_tools.compare_runs", str(out / "recording_a"), str(out / "recording_b"),
               "--rank", str(rank), "--csv", str(out / f"compared{rank}.csv")]
    result = subprocess.run(command, env=child_env(drop=("OP_",)), capture_output=True, text=True, timeout=120,
                            cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    summary = next(line for line in result.stdout.splitlines() if line.startswith("aligned:"))
    assert " 0 diverged" in summary and "not compared: 0" in summary and "in A only: 0; in B only: 0" in summary
    assert "aten." not in result.stdout  # the sim device's own kernels are not the program's calls
    assert "(uninitialised memory)" in summary  # the parameters' fresh memory, before their initialisers


def _compare_runs_command(results: str, *args) -> subprocess.CompletedProcess:
    """``python -m op_tools.compare_runs`` on ``args``, writing its files under ``results``."""
    return subprocess.run([sys.executable, "-m", "op_tools.compare_runs", *map(str, args)],
                          env=child_env({"OP_TOOLS_RESULTS_DIR": str(results)}, drop=("OP_",)),
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_compare_runs_takes_whole_run_folders_rank_by_rank_and_one_rank_against_another(reports, out):
    def compare_runs(*args):
        return _compare_runs_command(out / "compared", *args)

    whole = compare_runs(out / "recording_a", out / "recording_b")
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-2000:]
    assert whole.stdout.rstrip().endswith("2 ranks compared rank by rank: rank 0 agree, rank 1 agree")
    assert whole.stdout.count("aligned: ") == 2
    # a rank one run has no recording of is missing there, not "unreadable"
    import shutil

    partial = out / "recording_rank0_only"
    if not partial.exists():
        shutil.copytree(out / "recording_a", partial)
        shutil.rmtree(partial / "op_capture_results" / "rank1")
    one_short = compare_runs(out / "recording_a", partial)
    assert one_short.returncode == 2, one_short.stdout[-3000:] + one_short.stderr[-2000:]
    assert one_short.stdout.rstrip().endswith("2 ranks compared rank by rank: rank 0 agree, rank 1 missing in run B")
    # The two ranks of one run: each drew its own batch, so the replicas' computations differ from the data on.
    across = compare_runs(out / "recording_a", out / "recording_a", "--rank", 0, "--rank-b", 1)
    assert across.returncode == 3, across.stdout[-3000:] + across.stderr[-2000:]
    first = next(line for line in across.stdout.splitlines() if line.startswith("first divergence in forward:"))
    assert "torch.randint" in first


def test_a_faulty_link_in_ddps_gradient_all_reduce_is_named_at_the_collective_in_backward(reports, out):
    from op_tools.offline.compare_runs import compare
    from op_tools.output.run_recording import read_recording

    # DDP's all-reduce runs from its hook during backward: a call of backward's own, not a checkpoint's
    # recomputation (it was recorded as one, left out of the comparison, and the link blamed on a later call)
    _, records = read_recording(str(out / "recording_link"), rank=1)
    all_reduces = [r for r in records if r["op"] == "torch.distributed.all_reduce"]
    assert all_reduces and all(r["phase"] == "backward" and r["in_backward"] for r in all_reduces), all_reduces
    assert not any(r["phase"] == "recompute" for r in records)
    result = compare(str(out / "recording_a"), str(out / "recording_link"), rank=1)
    first = result.first_divergence()
    assert (first.phase, first.module, first.op) == (
        "backward", "DistributedDataParallel (gradient bucket 0)", "torch.distributed.all_reduce"), first
    assert first.outputs_unexplained and not first.inputs_differed_first and first.detail.startswith("outputs[0]")
    # what it received is an output, not a gradient, in the per-module table
    (bucket,) = [m for m in result.modules() if m["module"] == "DistributedDataParallel (gradient bucket 0)"]
    assert bucket["max_output_diff"] > 0 and bucket["max_grad_diff"] == 0, bucket
    assert compare(str(out / "recording_a"), str(out / "recording_link"), rank=0).verdict() == "clean"


def test_rank_by_rank_comparison_names_the_rank_step_and_op_that_diverged_first(reports, out, tmp_path):
    def compare_runs(*args):
        return _compare_runs_command(tmp_path / "compared", *args)

    link = compare_runs(out / "recording_a", out / "recording_link")
    assert link.returncode == 3, link.stdout[-3000:] + link.stderr[-2000:]
    assert link.stdout.rstrip().endswith(
        "2 ranks compared rank by rank: rank 0 agree, rank 1 diverged; the first divergence: rank 1, step 0 backward "
        "DistributedDataParallel (gradient bucket 0) #0 torch.distributed.all_reduce"), link.stdout[-2000:]
    # both ranks diverge: rank 0's recording replaced by rank 1's (another batch, from its first call), rank 1's
    # link noisy; the closing line names the earlier, rank 0's forward, not a list of ranks that diverged
    import shutil

    mixed = tmp_path / "mixed"
    shutil.copytree(out / "recording_link", mixed)
    for folder in (mixed / "op_capture_results" / "rank0",):
        for name in os.listdir(folder):
            os.remove(folder / name)
        source = out / "recording_link" / "op_capture_results" / "rank1"
        for name in os.listdir(source):
            shutil.copy(source / name, folder / name)
    both = compare_runs(out / "recording_a", mixed)
    assert both.returncode == 3, both.stdout[-3000:] + both.stderr[-2000:]
    assert re.search(r"rank 0 diverged, rank 1 diverged; the first divergence: rank 0, step 0 forward \(no module\) "
                     r"#\d+ torch.randint \(the earliest of 2 ranks diverged, by run A's clock\)$",
                     both.stdout.rstrip()), both.stdout[-2000:]


def test_a_recording_of_a_tensor_parallel_step_holds_each_ranks_part(reports, out):
    for rank, report in enumerate(reports):
        assert report["tp"]["OpCapture"] == {"verdict": "clean", "not_checked": ""}
        recording = next((out / "recording_tp" / "op_capture_results" / f"rank{rank}").glob("run_*.jsonl"))
        records = [json.loads(line) for line in recording.read_text().splitlines()[1:-1]]
        up = next(r for r in records if r["op"] == "torch.nn.functional.linear" and r["phase"] == "forward")
        assert up["inputs"][1][2] == [16, 16]  # the weight's shard: 32 output features over 2 ranks


def test_the_first_overflow_is_written_per_rank_with_its_rank_step_and_time(reports, out):
    folder = out / "results" / "op_overflow_check_result"
    written = {rank: json.loads(next((folder / f"rank{rank}").glob("overflow_*.json")).read_text()) for rank in (0, 1)}
    assert written[1]["op"] == "torch.nn.functional.silu" and written[1]["phase"] == "forward"
    assert [written[rank]["rank"] for rank in (0, 1)] == [0, 1]
    assert written[1]["step"] == 0 and written[1]["time"] > 1.7e9 and written[1]["format"] == "op_tools overflow"
    assert written[0]["op"] != "torch.nn.functional.silu" and written[0]["came_in"]  # rank 0 received it


def test_dtensor_calls_are_compared_on_their_whole_tensors_and_a_clean_step_is_clean(reports):
    for report in reports:
        compare = report["tp"]["OpAutoCompare"]
        assert compare["verdict"] == "clean" and compare["found"] == "" and compare["not_checked"] == ""
        assert compare["counts"]["forward compared"] >= 5 and compare["counts"]["backward compared"] >= 3


def test_with_the_reference_on_the_device_dtensor_calls_go_to_the_cpu_and_the_others_stay(reports):
    for report in reports:
        device = report["tp"]["OpAutoCompare device"]
        assert device["verdict"] == "clean" and device["not_checked"] == "", device
        places = device["places"]
        assert places.get("forward: a DTensor", 0) >= 2 and places.get("forward: device", 0) >= 1, places


def test_noise_in_a_tensor_parallel_mlp_is_found_in_the_faulty_op_on_the_faulty_rank(reports):
    # ColwiseParallel hands silu this rank's shard as a plain tensor (use_local_output): rank 1 compares its own
    # noisy silu; the linears (DTensor weights, compared whole) pass on both ranks.
    noise = [report["tp"]["OpAutoCompare noise"] for report in reports]
    assert noise[0] == {"verdict": "clean", "failures": []}
    assert noise[1]["verdict"] == "found" and len(noise[1]["failures"]) == 1
    first = noise[1]["failures"][0]
    assert (first["op"], first["phase"], first["module"]) == ("torch.nn.functional.silu", "forward", "MLP")


# 3 steps. FSDP2: 3 all-gathers in forward and 2 more in backward per step, 3 reduce-scatters; FSDP1 (one unit,
# flat parameters): its all-gathers and one reduce-scatter per step.
# Named as torch names the call the tools see: all_gather_into_tensor's inner all_gather_single in torch 2.13, the
# call itself in torch 2.11 (which has no all_gather_single).
_GATHER, _SCATTER = ("torch.distributed.all_gather_single", "torch.distributed.reduce_scatter_single") \
    if hasattr(dist, "all_gather_single") else \
    ("torch.distributed.all_gather_into_tensor", "torch.distributed.reduce_scatter_tensor")
FSDP_COLLECTIVES = {"fsdp2": {_GATHER: 15, _SCATTER: 9}, "fsdp1": {_GATHER: 4, _SCATTER: 3}}


@pytest.mark.parametrize("plan", sorted(FSDP_COLLECTIVES))
def test_fsdp_under_op_autocompare_compares_every_call_and_checks_its_all_gathers_and_reduce_scatters(tmp_path, plan):
    # FSDP all-gathers its parameters before a module runs (forward, and again in backward) and reduce-scatters the
    # gradients in its post-backward hooks, which run inside backward(): each is checked against both ranks' inputs.
    # The forward and backward ops see whole tensors; FSDP2's optimizer calls on DTensor shards are compared on the
    # whole tensors (gathered), FSDP1's on its flat shards. Nothing goes unchecked: the run exits 0.
    script = os.path.join(ROOT, "tests", "ditorch", "scripts", "parallel_llama.py")
    result = torchrun_on_sim("-m", "op_tools", "autocompare", script, tmp_path, plan,
                             extra={"OP_TOOLS_RESULTS_DIR": str(tmp_path / "results")})
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    for rank in (0, 1):
        report = json.loads((tmp_path / f"{plan}.rank{rank}.json").read_text())
        assert "error" not in report and len(report["losses"]) == 3
        assert _wrapped_line(output, rank, "OpAutoCompare summary").count(" 0 failed, 0 not checked;") == 2, \
            output[-3000:]  # forward and backward
        rows = [row for path in (tmp_path / "results" / "op_autocompare_result" / f"rank{rank}").glob("*.csv")
                for row in csv.DictReader(path.open())]
        checked = collections.Counter(row["op"] for row in rows if row["op"].startswith("torch.distributed."))
        assert checked == FSDP_COLLECTIVES[plan]
        assert all(row["verdict"] == "pass" for row in rows if row["op"] in checked)
