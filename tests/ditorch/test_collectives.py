"""Every c10d collective on sim's process group (simccl) and on the host's gloo, two processes under torchrun, against
values worked out by hand (tests/ditorch/scripts/collectives.py); and the original ditorch's distributed adapters
(AVG as SUM then divide, low-precision reductions carried in float32)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from subprocess_env import ROOT, child_env

from ditorch import distributed_adapters
from ditorch.adapters import npu, sim
from ditorch.backends import Backend
from ditorch.patches import Patches

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "collectives.py")


def run_collectives(out_dir, **env) -> list[dict]:
    env = child_env({"DITORCH_QUIET": "1", "OMP_NUM_THREADS": "1", **env}, drop=("DITORCH_",))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", SCRIPT,
               str(out_dir)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.fixture(scope="module")
def sim_reports(tmp_path_factory):
    return run_collectives(tmp_path_factory.mktemp("sim"), DITORCH_BACKEND="sim")


def failures(report: dict) -> dict:
    """The checks that went wrong, but for the library's own refusal of a collective it lacks, passed on as it said
    it (torch 2.11's gloo has no alltoall of tensor lists)."""
    return {name: outcome for name, outcome in report["checks"].items()
            if outcome != "ok" and "Backend gloo does not support alltoall" not in outcome}


def test_every_collective_on_sim_matches_hand_computed_values(sim_reports):
    for report in sim_reports:
        assert report["backend"] == "simccl" and report["group_class"] == "SimProcessGroup"
        assert report["group_name"]  # named: functional collectives and DeviceMesh find it
        assert failures(report) == {}
        names = report["checks"]
        # every ReduceOp, every dtype, sync and async, sim and CPU tensors
        for op in ("SUM", "PRODUCT", "MIN", "MAX", "AVG", "PREMUL_SUM"):
            assert f"all_reduce.{op}.bf16.cuda.async" in names and f"all_reduce.{op}.f32.cpu.sync" in names
        for op in ("BAND", "BOR", "BXOR", "AVG"):
            assert f"all_reduce.{op}.i32.cuda.sync" in names
        for name in ("reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                     "reduce_scatter_tensor", "all_to_all_single", "all_to_all_single_unequal", "all_to_all",
                     "gather", "scatter"):
            assert f"{name}.f16.cuda.async" in names and f"{name}.i32.cpu.sync" in names
        for name in ("send_recv", "isend_irecv", "isend_irecv_futures", "batch_isend_irecv", "coalesced",
                     "coalescing_manager"):
            assert f"{name}.bf16.cuda" in names
        for name in ("funcol.cuda", "async_is_completed.cuda", "init_device_mesh.cuda", "init_device_mesh.sim",
                     "fp32.fp16_avg.cuda", "fp32.fp16_reduce_scatter_avg.cpu", "fp32.all_reduce.AVG.bf16.cuda.sync",
                     "all_gather_into_tensor.one_row.cuda"):  # SyncBatchNorm's (1, world * n) output, as NCCL takes it
            assert name in names
        assert len(names) == 445


def test_sim_group_made_without_the_variable_reduces_fp16_in_fp16(sim_reports):
    # The float32 group's 60000 is earned: the same AVG on the world group overflows float16.
    assert [r["plain_fp16_avg"] for r in sim_reports] == [[float("inf")] * 2] * 2


def test_unsupported_call_names_itself(sim_reports):
    messages = sim_reports[0]["messages"]
    assert set(messages) == {"meta", "band_float", "allgather_coalesced", "split_group"}
    for name, text in messages.items():
        assert text.startswith("sim's process group does not implement "), (name, text)
        assert "No backend type" not in text
    assert "allreduce on meta tensors" in messages["meta"]
    assert "ReduceOp.BAND on torch.float32" in messages["band_float"]


def test_host_honours_avg_and_fp32_through_the_adapters(tmp_path):
    reports = run_collectives(tmp_path, DITORCH_BACKEND="cpu", DITORCH_REDUCE_LOW_PRECISION_IN_FP32="1")
    for report in reports:
        assert report["backend"] == "gloo"
        assert failures(report) == {}
        names = report["checks"]
        assert "all_reduce.AVG.i32.cuda.async" in names  # gloo has no integer AVG: SUM then divide
        for name in ("fp32.fp16_avg.cuda", "fp32.fp16_reduce_scatter_avg.cuda", "fp32.fp16_reduce_avg.cuda"):
            assert names[name] == "ok"


def fake_backend(adapter) -> Backend:
    return Backend(adapter.__name__, "cpu", "test", torch, "ccl", None, adapter)


def test_adapters_wrap_reductions_only_where_the_library_needs_it(monkeypatch):
    originals = {name: getattr(dist, name) for name in distributed_adapters.reductions()}
    patches = Patches()
    distributed_adapters.apply(fake_backend(sim), patches)  # simccl adapts its reductions itself
    assert len(patches) == 0
    distributed_adapters.apply(fake_backend(npu), patches)  # hccl: no AVG
    try:
        assert all(getattr(dist, name) is not originals[name] for name in distributed_adapters.reductions())
    finally:
        patches.undo()
    assert all(getattr(dist, name) is originals[name] for name in distributed_adapters.reductions())


def test_reduction_plan_for_avg_and_fp32():
    emulated = distributed_adapters.Reduction(dist.ReduceOp.AVG, torch.int32, 4, emulate_avg=True, in_fp32=False)
    assert emulated.op == dist.ReduceOp.SUM and emulated.divisor == 4
    total = torch.tensor([7, -7], dtype=torch.int32)  # a SUM over 4 ranks
    emulated.finish(total, total)
    assert total.tolist() == [1, -1]  # truncated, as NCCL's integer average
    carried = distributed_adapters.Reduction(dist.ReduceOp.SUM, torch.bfloat16, 2, emulate_avg=False, in_fp32=True)
    staged = carried.stage(torch.ones(2, dtype=torch.bfloat16), is_output=True, is_input=True)
    assert staged.dtype == torch.float32 and carried.op == dist.ReduceOp.SUM
    native = distributed_adapters.Reduction(dist.ReduceOp.AVG, torch.float32, 2, emulate_avg=False, in_fp32=True)
    assert not native.changes_anything


def test_on_a_torch_without_reduce_scatter_single_the_adapters_wrap_reduce_scatter_tensor(monkeypatch):
    import torch.distributed.distributed_c10d as c10d

    for owner in (dist, c10d):  # as torch 2.11 is: importing ditorch on a vendor backend raised AttributeError
        monkeypatch.delattr(owner, "reduce_scatter_single", raising=False)
    assert distributed_adapters.reductions()[-1] == "reduce_scatter_tensor"
    original, patches = dist.reduce_scatter_tensor, Patches()
    distributed_adapters.apply(fake_backend(npu), patches)  # hccl: no AVG
    try:
        assert dist.reduce_scatter_tensor is not original and c10d.reduce_scatter_tensor is dist.reduce_scatter_tensor
    finally:
        patches.undo()
    assert dist.reduce_scatter_tensor is original


def test_a_premul_sum_factor_is_read_from_its_state_where_it_has_no_attribute():
    class ReduceOp211:  # MOCK: torch 2.11's PREMUL_SUM ReduceOp keeps its factor in its state only
        def __getstate__(self):
            return (dist.ReduceOp.PREMUL_SUM, 2.5)

    assert distributed_adapters.premul_factor(ReduceOp211()) == 2.5
    assert distributed_adapters.premul_factor(dist._make_nccl_premul_sum(4.0)) == 4.0
