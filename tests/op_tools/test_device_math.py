"""The device's declared math is part of the reference: TF32 (sim's own switches, as CUDA's and Ascend's HF32) and
fused attention kernels with another algorithm pass; detection stays."""

import os

import pytest
import torch
import zoo

import op_tools
from op_tools.numerics import device_math
from op_tools.numerics.device_math import DeviceMath, emulated, round_mantissa


@pytest.fixture(autouse=True)
def _no_autocompare_variables(monkeypatch):
    for name in list(os.environ):
        if "AUTOCOMPARE" in name or name.endswith("_OP_DTYPE_CAST_DICT"):
            monkeypatch.delenv(name)


@pytest.fixture
def tf32(sim):
    torch.sim.matmul.allow_tf32 = torch.sim.conv.allow_tf32 = True
    yield
    torch.sim.matmul.allow_tf32 = torch.sim.conv.allow_tf32 = False


def test_the_cpu_replays_tf32_as_the_device_computes_it(sim, tf32):
    torch.manual_seed(0)
    a, b = torch.randn(64, 128), torch.randn(128, 32)
    on_device = (a.to(sim) @ b.to(sim)).cpu()
    with emulated(DeviceMath.of(torch.device(sim))):
        replayed = a @ b
    assert torch.equal(replayed, on_device)
    assert not torch.equal(a @ b, on_device)  # TF32 is not float32
    assert torch.equal(round_mantissa(torch.tensor([1 + 2**-11, 1 + 3 * 2**-11]), 10), torch.tensor([1.0, 1 + 2**-9]))


# lstm: the CPU's float32 LSTM is one oneDNN kernel, whose products the replay cannot round (4 false failures
# before it ran on linears); the device runs cells and matmuls, rounded
@pytest.mark.parametrize("workload", [zoo.llama_float32, zoo.cnn_batchnorm, zoo.lstm_lm, zoo.gru_lm],
                         ids=["llama", "cnn", "lstm", "gru"])
def test_tf32_models_report_no_failure_and_say_tf32(sim, tf32, workload):
    with op_tools.OpAutoCompare() as tool:
        workload(sim)
    assert tool.failures == []
    assert "TF32 for" in tool.summary() and "matmul" in tool.summary()
    # counted where a same-dtype reference applied it, not for every call made while the switches were on
    assert 0 < sum(tool.device_math.values()) < tool.counts["forward compared"]


def test_a_fault_above_tf32_rounding_is_found_first_under_tf32(sim, tf32):
    import ditorch.sim

    with op_tools.OpAutoCompare() as tool, ditorch.sim.faults("silu:noise=1e-2"):
        zoo.llama_float32(sim)
    assert tool.failures and tool.failures[0]["op"] == "torch.nn.functional.silu"
    assert "TF32" not in tool.failures[0]["error_info"]  # silu has no TF32 operand: the note would mislead
    with op_tools.OpAutoCompare() as tool, ditorch.sim.faults("mm:noise=1e-2"):
        zoo.llama_float32(sim)
    assert tool.failures and tool.failures[0]["op"] == "torch.nn.functional.linear"
    assert "TF32" in tool.failures[0]["error_info"]


def test_a_fault_in_an_lstm_cell_is_found_under_tf32(sim, tf32):
    import ditorch.sim

    with op_tools.OpAutoCompare() as tool, ditorch.sim.faults("_thnn_fused_lstm_cell:noise=1e-2"):
        zoo.lstm_lm(sim)
    assert tool.failures and tool.failures[0]["op"] == "torch.lstm" and tool.failures[0]["phase"] == "forward"


def test_on_cuda_a_recurrent_op_follows_cudnns_tf32_switch_not_cublass(monkeypatch):
    # Seen on an H200: nn.LSTM and nn.GRU in float32 are one cuDNN call each, TF32 by cuDNN's switch (on by
    # default): 0.03 relative error, 4 false failures per recipe. No GPU needed: the switches are read, not used.
    # cuDNN's switch through its flags() context: torch.testing's import (the conformance tests') forbids setting it
    # directly for the rest of the process
    cudnn = torch.backends.cudnn

    def cudnn_tf32(on: bool):
        return cudnn.flags(enabled=cudnn.enabled, benchmark=cudnn.benchmark, deterministic=cudnn.deterministic,
                           allow_tf32=on)

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    cuda = torch.device("cuda")
    with cudnn_tf32(True):
        assert DeviceMath.of(cuda, "torch.lstm").reduced == (("matmul", "tf32"),)
        assert DeviceMath.of(cuda, "torch.gru").reduced == (("matmul", "tf32"),)
        assert DeviceMath.of(cuda, "torch.nn.functional.linear").reduced == (("conv", "tf32"),)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
    with cudnn_tf32(False):
        assert DeviceMath.of(cuda, "torch.lstm").reduced == ()


def test_an_embeddings_gradient_sums_in_float32_where_the_device_says_so_or_says_nothing(sim, monkeypatch, caplog):
    # The CPU's embedding backward adds bfloat16 rows in bfloat16, CUDA's in float32: where the device's kernel sums
    # in float32, its bound judges that gradient (an index_sums op only); sim declares what its numerics do.
    import ditorch.sim

    embedding = "torch.nn.functional.embedding"
    assert DeviceMath.of(torch.device("cuda"), embedding).float32_sums
    assert not DeviceMath.of(torch.device("cuda"), "torch.nn.functional.linear").float32_sums
    assert not DeviceMath.of(torch.device("cpu"), embedding).float32_sums
    assert not DeviceMath.of(torch.device(sim), embedding).float32_sums  # the CPU's kernels
    with ditorch.sim.numerics("gpu"):
        assert DeviceMath.of(torch.device(sim), embedding).float32_sums
    lookup = device_math._module_function  # the device module's functions, looked up once per process
    try:
        with monkeypatch.context() as patched:  # a device module that declares nothing is taken as a GPU's
            patched.delattr(torch.sim, "narrow_accumulation")
            lookup.cache_clear()
            assert DeviceMath.of(torch.device(sim), embedding).float32_sums
        monkeypatch.setattr(torch.sim, "narrow_accumulation", lambda: 1 / 0)
        lookup.cache_clear()
        assert not DeviceMath.of(torch.device(sim), embedding).float32_sums  # judged as the CPU's: said so
        assert "torch.sim.narrow_accumulation() failed (division by zero)" in caplog.text
    finally:
        monkeypatch.undo()
        lookup.cache_clear()


def test_without_tf32_a_small_fault_in_a_matmul_is_found(sim):
    import ditorch.sim

    with op_tools.OpAutoCompare() as tool, ditorch.sim.faults("mm:noise=1e-3"):
        zoo.llama_float32(sim)
    assert tool.failures and tool.failures[0]["op"] == "torch.nn.functional.linear"


def test_a_fused_attention_kernel_passes_forward_and_backward(sim):
    import ditorch.sim

    with ditorch.sim.sdpa_algorithm("chunked"), op_tools.OpAutoCompare() as tool:
        zoo.llama_float32(sim)
    sdpa = [row for row in tool.rows if row[0] == "torch.nn.functional.scaled_dot_product_attention"]
    assert {row[2] for row in sdpa} == {"forward", "backward"}
    assert tool.failures == []
    with ditorch.sim.sdpa_algorithm("chunked"), op_tools.OpAutoCompare() as tool, \
            ditorch.sim.faults("_scaled_dot_product_fused_attention_overrideable:noise=1e-3"):
        zoo.llama_float32(sim)
    assert tool.failures[0]["op"] == "torch.nn.functional.scaled_dot_product_attention"


SHOWN_AS_CUDA = """
import torch, ditorch, ditorch.sim, op_tools
import torch.nn.functional as F
assert torch.ones(1, device="cuda").device.type == "cuda"  # DITORCH_SHOW_DEVICE_AS_CUDA's default: sim shows cuda
torch.manual_seed(0)
conv, x = torch.nn.Conv2d(16, 16, 3, padding=1).cuda(), torch.randn(2, 16, 8, 8, device="cuda")
with ditorch.sim.faults("convolution:noise=1e-3"), op_tools.OpAutoCompare(backward=False) as compare:
    conv(x)  # sim's convolutions are full float32 (torch.sim.conv.allow_tf32 off), whatever cuDNN's switch says
print("RESULT conv", compare.verdict(), torch.backends.cudnn.allow_tf32)
image = torch.randn(2, 3, 8, 8, device="cuda", dtype=torch.bfloat16)
theta = torch.tensor([[[0.9, 0.1, 0.05], [-0.1, 0.8, 0.0]]], device="cuda", dtype=torch.bfloat16).repeat(2, 1, 1)
grid = F.affine_grid(theta, (2, 3, 6, 6), align_corners=False)
with op_tools.OpAutoCompare(backward=False) as compare:
    F.grid_sample(image, grid, align_corners=False)  # sim's kernel, the CPU's: adds in bfloat16 (narrow_accumulation)
print("RESULT grid_sample", compare.verdict())
"""


@pytest.mark.parametrize("build", ["cpu", "cuda"])
def test_a_device_shown_as_cuda_is_judged_by_its_own_declared_math_not_cudas(tmp_path, build):
    # ditorch shows the vendor's device as cuda by default; it is PrivateUse1's, whose module declares its math: read
    # as CUDA's, a 1e-3 fault in a float32 convolution passed as TF32 rounding, and a bfloat16 grid_sample summing in
    # bfloat16 (as sim declares) was failed. On a torch built with CUDA too (stood in for: the one fact read; the
    # CUDA-built torch's check runs sim so), where only a torch without CUDA was taken so
    import subprocess
    import sys

    from subprocess_env import child_env

    code = SHOWN_AS_CUDA.replace("import torch.nn.functional as F\n", "import torch.nn.functional as F\n" + (
        "torch.backends.cuda.is_built = lambda: True\n" if build == "cuda" else ""))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                            env=child_env({"DITORCH_BACKEND": "sim", "DITORCH_QUIET": "1"}, drop=("OP_",)),
                            timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    results = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert results == ["RESULT conv found True", "RESULT grid_sample clean"], result.stdout[-2000:]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_an_lstm_under_autocast_is_judged_as_the_devices_whole_network_in_autocasts_dtype(sim, dtype):
    # the device runs the network as one autocast op (sim's fused cells, CUDA's _cudnn_rnn): its states too in
    # autocast's dtype. The CPU's rerun ran its float32 oneDNN kernel, autocast reaching neither its products nor its
    # states: a clean network failed forward (its dtype) and backward (float32 math)
    import ditorch.sim

    torch.manual_seed(0)
    lstm, x = torch.nn.LSTM(16, 32, batch_first=True).to(sim), torch.randn(2, 5, 16, device=sim)

    def compared(faults: str = ""):
        with ditorch.sim.faults(faults), op_tools.OpAutoCompare() as compare, torch.autocast(sim, dtype=dtype):
            out, _ = lstm(x)
            out.float().square().mean().backward()
        return compare

    clean = compared()
    assert clean.verdict() == "clean", clean.failures
    faulty = compared("_thnn_fused_lstm_cell_backward_impl:noise=3e-2")
    assert [(f["op"], f["phase"]) for f in faulty.failures] == [("torch.lstm", "backward")]


def test_a_device_math_reads_as_one_item_of_the_summarys_list():
    # "autocast bfloat16 (6 calls), autocast bfloat16; TF32 for matmul, conv (1 calls)" read as three items, wrapped
    # at the "; " as two lines
    from op_tools.numerics.device_math import DeviceMath

    both = DeviceMath(torch.bfloat16, (("matmul", "tf32"), ("conv", "tf32")))
    assert both.describe() == "autocast bfloat16 and TF32 for matmul/conv"
    assert ", " not in both.describe() and "; " not in both.describe()
