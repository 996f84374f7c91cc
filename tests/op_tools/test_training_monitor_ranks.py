"""TrainingMonitor under torchrun (2 processes, sim): a tiny Llama trained 3 AdamW steps, each rank on its half of a
fixed global batch, by FSDP2, DDP and FSDP1 (``use_orig_params=True``), and by tensor parallelism (attention and MLP
projections split over both ranks, both on the whole batch). The global figures rank 0 writes (every parameter's
gradient norm, weight norm, update ratio and Adam moment norms; the global gradient norm) equal a single process's on
the whole batch, as full tensors' norms, not a shard's; rank 1 writes only its own rows. Under DDP
each rank's gradient norm before the reduction is its own, and a gradient changed on one rank after the reduction
is one replica mismatch, written by both ranks."""

from __future__ import annotations

import collections
import csv
import json
import os
import sys

import pytest
import torch
from subprocess_env import torchrun_on_sim

from op_tools.tools.training_monitor import GLOBAL_STATISTICS

pytestmark = pytest.mark.children_import("transformers")  # their scripts train transformers models

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")
sys.path.insert(0, SCRIPTS)
import monitor_ranks  # noqa: E402 - the script's model, data and loop, for the single-process reference

DATA_PARALLEL = ("fsdp2", "ddp", "fsdp1")
PLANS = (*DATA_PARALLEL, "tp")
COMPARED = ("grad_norm", "weight_norm", "update_ratio", "exp_avg_norm", "exp_avg_sq_norm", "global_grad_norm")
# float32 reassociation (two half-batch gradients averaged vs one whole-batch gradient; TP's row-wise layers' two
# partial products summed) moves these figures by up to 8e-6 relative on sim; a shard's norm instead of the full
# tensor's is off by 20% or more
RELATIVE = 1e-5
# update_ratio is ||old - new|| of float32 weights a step of 1e-3 apart: the reassociation above, seen through that
# cancellation, reached 1.05e-5 (FSDP2, transformers 5.24); a shard's norm is still 20% off
BOUNDS = {"update_ratio": 5e-5}


def _figures(folder) -> dict[tuple[int, str, str, str], float]:
    """(step, kind, name as the single process names it, statistic) -> value, from the one CSV in ``folder``."""
    [path] = folder.glob("monitor_*.csv")
    with open(path, newline="", encoding="utf-8") as f:
        return {(int(r["step"]), r["kind"], r["name"], r["statistic"]): float(r["value"])
                for r in csv.DictReader(f)}


def _anomalies(folder) -> list[dict]:
    [path] = folder.glob("anomalies_*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("monitor_ranks")


@pytest.fixture(scope="module")
def reports(out):
    result = torchrun_on_sim(monitor_ranks.__file__, out, ",".join([*PLANS, "ddp_mismatch"]))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    reports = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    errors = [plan["traceback"] for report in reports for plan in report.values() if "error" in plan]
    assert not errors, errors[0]
    return reports


def folder(out, plan: str, rank: int):
    return out / plan / "op_training_monitor" / f"rank{rank}"


@pytest.fixture(scope="module")
def reference(sim, tmp_path_factory):
    """The single process: the same model, loop and seed on the whole batch of each step (both ranks' halves)."""
    whole = [torch.cat(halves) for halves in zip(monitor_ranks.batches(0), monitor_ranks.batches(1))]
    results = tmp_path_factory.mktemp("single_process")
    monitor_ranks.train(monitor_ranks.tiny_llama().to(sim), whole, str(results), device=sim)
    return _figures(results / "op_training_monitor")


@pytest.mark.parametrize("plan", PLANS)
def test_rank_0_writes_the_single_processs_global_figures_at_every_step(reports, out, reference, plan):
    written = _figures(folder(out, plan, 0))
    expected = {k: v for k, v in reference.items() if k[3] in COMPARED}
    assert len(expected) == 3 * (5 * 21 + 1)  # 3 steps: 21 parameters x 5 statistics, and the global norm
    assert {k for k in written if k[3] in COMPARED} == set(expected)
    worst: dict[str, float] = collections.defaultdict(float)
    for key, value in expected.items():
        worst[key[3]] = max(worst[key[3]], abs(written[key] - value) / abs(value))
    assert all(worst[s] <= BOUNDS.get(s, RELATIVE) for s in worst), dict(worst)


def test_fsdp2_gradient_norms_are_the_full_tensors_not_rank_0s_shard(reports, out, reference):
    """Each parameter is sharded on dim 0 over both ranks, both shards with gradient here: a norm over rank 0's
    shard alone is lower than the full tensor's that rank 0 writes (which the test above finds equal to the single
    process's)."""
    written = _figures(folder(out, "fsdp2", 0))
    local = reports[0]["fsdp2"]["local_grad_norms"]
    assert len(local) == 3 and len(local[0]) == 21
    for step, norms in enumerate(local):
        for name, shard_norm in norms.items():
            full = written[(step, "parameter", name, "grad_norm")]
            assert shard_norm < 0.9 * full, (step, name, shard_norm, full)


def test_tp_norms_are_the_full_tensors_not_rank_0s_shard(reports, out, reference):
    """Attention's and the MLP's projections are split over both ranks (q/k/v, gate/up by rows: ``Shard(0)``; o,
    down by columns: ``Shard(1)``): a norm over rank 0's shard alone, of the gradient or the weight, is lower than
    the full tensor's that rank 0 writes (which the test above finds equal to the single process's)."""
    written = _figures(folder(out, "tp", 0))
    local = reports[0]["tp"]["local_norms"]
    assert len(local) == 3
    for step, shards in enumerate(local):
        assert {name.split(".", 3)[3]: shard["placements"] for name, shard in shards.items()} == {
            **dict.fromkeys(("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                             "mlp.gate_proj.weight", "mlp.up_proj.weight"), "(Shard(dim=0),)"),
            "self_attn.o_proj.weight": "(Shard(dim=1),)", "mlp.down_proj.weight": "(Shard(dim=1),)"}
        assert len(shards) == 2 * 7
        for name, shard in shards.items():
            for statistic in ("grad", "weight"):
                full = written[(step, "parameter", name, f"{statistic}_norm")]
                assert shard[statistic] < 0.9 * full, (step, name, statistic, shard[statistic], full)


@pytest.mark.parametrize("plan", PLANS)
def test_rank_1_writes_its_own_loss_and_layer_rows_and_no_global_rows(reports, out, plan):
    rank1 = _figures(folder(out, plan, 1))
    assert not [k for k in rank1 if k[3] in GLOBAL_STATISTICS or k[3].startswith("lr/")]
    kinds = collections.Counter((kind, name) for _, kind, name, s in rank1 if s in ("loss", "norm"))
    assert kinds == {("step", ""): 3, **{(kind, f"model.layers.{i}"): 3 for kind in ("activation", "output_grad")
                                         for i in (0, 1)}}


@pytest.mark.parametrize("plan", DATA_PARALLEL)
def test_data_parallel_ranks_losses_are_their_halves_and_average_to_the_single_processs(reports, out, reference,
                                                                                       plan):
    by_rank = [_figures(folder(out, plan, rank)) for rank in (0, 1)]
    for step in range(3):
        losses = [figures[(step, "step", "", "loss")] for figures in by_rank]
        assert losses[0] != losses[1]  # each rank's loss over its own half batch
        # both halves hold as many tokens: the mean of the ranks' losses is the single process's
        assert sum(losses) / 2 == pytest.approx(reference[(step, "step", "", "loss")], rel=RELATIVE)


def test_tp_ranks_both_write_the_single_processs_loss(reports, out, reference):
    for rank in (0, 1):
        written = _figures(folder(out, "tp", rank))
        for step in range(3):
            key = (step, "step", "", "loss")
            assert written[key] == pytest.approx(reference[key], rel=RELATIVE), (rank, step)


@pytest.mark.parametrize("plan", PLANS)
def test_no_anomalies_on_either_rank(reports, out, plan):
    assert [_anomalies(folder(out, plan, rank)) for rank in (0, 1)] == [[], []]


def test_ddp_gradient_norm_before_reduction_is_each_ranks_own(reports, out):
    """A plain copy of the model on the rank's half batch gives the gradients DDP holds before its reduction: each
    rank writes their norms; the two ranks' differ, and differ from the reduced gradient's norm."""
    written = [_figures(folder(out, "ddp", rank)) for rank in (0, 1)]
    for rank in (0, 1):
        by_hand = reports[rank]["ddp"]["local_grad_norms"]
        assert len(by_hand) == 3 and len(by_hand[0]) == 21
        for step, norms in enumerate(by_hand):
            for name, norm in norms.items():
                key = (step, "parameter", name, "grad_norm_before_reduction")
                assert written[rank][key] == pytest.approx(norm, rel=RELATIVE), (rank, key)
    before = [{k: v for k, v in figures.items() if k[3] == "grad_norm_before_reduction"} for figures in written]
    assert len(before[0]) == 3 * 21 and before[0].keys() == before[1].keys()
    for key, value in before[0].items():
        assert value != pytest.approx(before[1][key], rel=RELATIVE), key
        assert value != pytest.approx(written[0][key[:3] + ("grad_norm",)], rel=RELATIVE), key


def test_a_gradient_changed_on_rank_1_after_the_reduction_is_one_replica_mismatch_on_both_ranks(reports, out):
    name = monitor_ranks.PERTURBED.removeprefix("module.")  # named as the unwrapped model names it
    for rank in (0, 1):
        [anomaly] = _anomalies(folder(out, "ddp_mismatch", rank))
        assert anomaly["rule"] == "replica_mismatch" and anomaly["rank"] == rank
        assert (anomaly["step"], anomaly["module"], anomaly["phase"]) == (monitor_ranks.PERTURBED_FROM, name,
                                                                          "backward")
        assert anomaly["ranks"] == [1] and anomaly["parameters"] == [name]
        assert f"the gradient of {name} differs between data-parallel ranks" in anomaly["message"]
