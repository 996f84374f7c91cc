"""A CUDA-written torchrun script (set_device(local_rank), init_process_group("nccl", device_id=...), DDP with
device_ids=[local_rank]) on sim and on the host, two processes: one device per rank, as on a real node; DDP
finding unused parameters; on sim, SyncBatchNorm under DDP equal to one process's BatchNorm over the whole batch."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest
import torch
from subprocess_env import ROOT, child_env

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")
sys.path.insert(0, SCRIPTS)
import ddp_cuda  # noqa: E402 - the script's own models and data, for the reference runs
from ddp_cuda import model_and_batches  # noqa: E402


def single_process_params() -> torch.Tensor:
    """The two ranks' run done in one process: rank 0's weights, each step on both ranks' batches together."""
    model, batches0 = model_and_batches(0, 100)
    _, batches1 = model_and_batches(1, 101)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x0, x1 in zip(batches0, batches1):
        model(torch.cat([x0, x1])).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.fixture(scope="module", params=[("sim", "simccl"), ("cpu", "gloo")], ids=["sim", "cpu"])
def launch(request, tmp_path_factory):
    """One torchrun launch of ddp_cuda.py per backend (on sim with its SyncBatchNorm part): ``(backend, collective
    library, the ranks' reports)``."""
    backend, ccl = request.param
    out = tmp_path_factory.mktemp(f"ddp_{backend}")
    env = child_env({"DITORCH_BACKEND": backend, "DITORCH_QUIET": "1", "OMP_NUM_THREADS": "1"}, drop=("DITORCH_",))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               os.path.join(SCRIPTS, "ddp_cuda.py"), str(out), *(["sync_batch_norm"] if backend == "sim" else [])]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return backend, ccl, [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def test_torchrun_ddp_runs_one_device_per_rank_and_matches_one_process(launch):
    _, ccl, reports = launch
    assert [r["backend"] for r in reports] == [ccl, ccl]
    assert [r["device"] for r in reports] == ["cuda:0", "cuda:1"]  # shown as cuda, the rank's own device
    assert [r["device_count"] for r in reports] == [2, 2]  # one per local rank
    assert [r["current_device"] for r in reports] == [0, 1]  # ints, as CUDA's
    assert [r["as_device"] for r in reports] == ["cuda:0", "cuda:1"]
    assert reports[0]["params"] == reports[1]["params"]
    torch.testing.assert_close(torch.tensor(reports[0]["params"]), single_process_params(), rtol=1e-5, atol=1e-6)
    # find_unused_parameters=True (the reducer stages its map of used parameters in pinned memory): the same
    # training beside a layer never used, which gets no gradient
    assert [r["unused_grads"] for r in reports] == [[True, True], [True, True]]
    assert reports[0]["params_beside_unused"] == reports[1]["params_beside_unused"]
    torch.testing.assert_close(torch.tensor(reports[0]["params_beside_unused"]), single_process_params(), rtol=1e-5,
                               atol=1e-6)
    # torch.compile(DDP(model)) trains as the eager DDP module
    assert reports[0]["compiled_params"] == reports[1]["compiled_params"]
    torch.testing.assert_close(torch.tensor(reports[0]["compiled_params"]), single_process_params(), rtol=1e-5,
                               atol=1e-6)


def batch_norm_reference(norm, x: torch.Tensor, module=None) -> dict:
    """``ddp_cuda.sync_batch_norm_step`` in one process on the CPU, over the whole batch."""
    x = x.clone().requires_grad_()
    y = (module or norm)(x)
    y.float().pow(3).sum().backward()
    return {"output": y.detach().float(), "input_grad": x.grad.float(),
            "grads": {name: p.grad.float() for name, p in norm.named_parameters()},
            "buffers": {name: b.float() for name, b in norm.named_buffers()}}


def prefixed(name: str):
    return lambda message: f"{name}: {message}"


def joined(reports: list, key: str) -> torch.Tensor:
    """Both ranks' rows of ``key``, joined along the batch as the global batch holds them."""
    return torch.cat([torch.tensor(r[key]) for r in reports])


def test_sync_batch_norm_under_ddp_on_sim_equals_one_process_batch_norm(launch):
    backend, _, reports = launch
    if backend != "sim":
        pytest.skip("the host has no kernels for SyncBatchNorm's statistics (batch_norm_stats & co are CUDA's)")
    runs = [r["sync_batch_norm"] for r in reports]
    errors = [run["error"] for run in runs if "error" in run]
    assert not errors, errors[0]
    close = functools.partial(torch.testing.assert_close, rtol=1e-5, atol=1e-5)

    # A CNN's two SyncBatchNorm layers under DDP, channels-last, ranks with 3 and 5 of the 8 rows
    model = ddp_cuda.sync_batch_norm_model()
    expected = batch_norm_reference(model, ddp_cuda.sync_batch_norm_batch(), model)
    cnn = [run["cnn"] for run in runs]
    assert [c["channels_last"] for c in cnn] == [True, True]  # the layout kept through the batch norms
    close(joined(cnn, "output"), expected["output"])
    close(joined(cnn, "input_grad"), expected["input_grad"])
    for c in cnn:  # DDP averages the ranks' gradients, each of its own rows' loss: half the whole batch's
        for name, grad in expected["grads"].items():
            close(torch.tensor(c["grads"][name]), grad / 2, msg=prefixed(name))
        for name, buffer in expected["buffers"].items():  # running statistics: the variance unbiased over 8 rows
            close(torch.tensor(c["buffers"][name]), buffer, msg=prefixed(name))

    # float16 and bfloat16 inputs, float32 parameters (autocast's case): the output in the input's dtype
    for dtype in (torch.float16, torch.bfloat16):
        norm = torch.nn.BatchNorm2d(3)
        expected = batch_norm_reference(norm, ddp_cuda.sync_batch_norm_batch(dtype))
        low = [run[str(dtype)] for run in runs]
        assert [r["output_dtype"] for r in low] == [str(dtype)] * 2
        for key in ("output", "input_grad"):  # in the dtype, within its default tolerance
            torch.testing.assert_close(joined(low, key).to(dtype), expected[key].to(dtype), msg=prefixed(key))
        for name, grad in expected["grads"].items():  # no DDP: each rank's gradient is of its own rows
            close(sum(torch.tensor(r["grads"][name]) for r in low), grad, msg=prefixed(name))
        for name, buffer in expected["buffers"].items():
            for r in low:
                close(torch.tensor(r["buffers"][name]), buffer, msg=prefixed(name))

    # Rank 1's batch empty: rank 0's rows are the whole batch; rank 1 gets no gradient and the same statistics
    norm = torch.nn.BatchNorm2d(3)
    expected = batch_norm_reference(norm, ddp_cuda.sync_batch_norm_batch()[:4])
    first, empty = runs[0]["empty_rank1"], runs[1]["empty_rank1"]
    close(torch.tensor(first["output"]), expected["output"])
    close(torch.tensor(first["input_grad"]), expected["input_grad"])
    assert empty["output"] == [] and empty["input_grad"] is None and set(empty["grads"].values()) == {None}
    for name, buffer in expected["buffers"].items():
        close(torch.tensor(first["buffers"][name]), buffer, msg=prefixed(name))
        close(torch.tensor(empty["buffers"][name]), buffer, msg=prefixed(name))
