import pytest
import torch
from test_fallback import writes_through_views
from tiny_models import train_llama

import op_tools


def test_ops_run_in_float32_and_return_the_original_dtype(sim):
    x = torch.randn(64, dtype=torch.float16)
    with op_tools.OpDtypeCast():
        y = torch.nn.functional.silu(x.to(sim))
    assert y.dtype == torch.float16 and y.device.type == sim
    assert torch.equal(y.cpu(), torch.nn.functional.silu(x.float()).half())


def test_outputs_keep_the_dtype_the_op_returns_without_the_tool(sim):
    x16 = torch.full((4096,), 60000.0, device=sim, dtype=torch.float16)
    x32 = torch.ones(4096, device=sim)
    mask = torch.arange(4096, device=sim) % 2 == 0
    calls = {"promotion": lambda: x16 + x32, "sum(dtype=)": lambda: torch.sum(x16, dtype=torch.float32),
             "softmax(dtype=)": lambda: torch.softmax(x16, -1, dtype=torch.float32),
             "sum": lambda: torch.sum(x16[:2]), "add": lambda: x16 + x16,  # same ops without a float32: float16
             "no meta kernel": lambda: torch.masked_select(x16, mask)}  # the dtype rule without a meta run
    plain = {name: call() for name, call in calls.items()}
    with op_tools.OpDtypeCast():
        tooled = {name: call() for name, call in calls.items()}
    assert {name: t.dtype for name, t in tooled.items()} == {name: t.dtype for name, t in plain.items()}
    # float32 the op asked for stays float32: the sum of 4096 * 60000 is no float16 overflow
    assert tooled["sum(dtype=)"].item() == plain["sum(dtype=)"].item() == 4096 * 60000.0


def test_in_place_updates_the_original_tensor(sim):
    x = torch.ones(4, device=sim, dtype=torch.bfloat16)
    with op_tools.OpDtypeCast():
        returned = x.mul_(3)
    assert returned is x and x.dtype == torch.bfloat16
    assert torch.equal(x.cpu(), torch.full((4,), 3.0, dtype=torch.bfloat16))


def test_views_and_conversions_are_left_alone(sim, logged, monkeypatch):
    monkeypatch.setenv("OP_TOOLS_VERBOSE", "1")
    x = torch.ones(4, device=sim, dtype=torch.float16)
    with op_tools.OpDtypeCast():
        v = x.view(2, 2)
        h = x.float()
        x.sin()
    assert v.dtype == torch.float16 and h.dtype == torch.float32
    out = logged()
    assert "skip OpDtypeCastHook on torch.Tensor.view" in out
    assert "| torch.Tensor.sin |  input[0] | torch.float16 -> torch.float32 |" in out
    for column in ("name", "target", "action", "config"):
        assert f" {column} " in out


def test_custom_dict_and_llama_under_bf16_autocast(sim, monkeypatch):
    monkeypatch.setenv("OP_DTYPE_CAST_DICT", "torch.bfloat16->torch.float32,torch.half->torch.float64")
    with op_tools.OpDtypeCast() as tool:
        losses = train_llama(sim, steps=1, autocast_dtype=torch.bfloat16)
    assert tool.cast == {torch.bfloat16: torch.float32, torch.float16: torch.float64}
    assert all(torch.isfinite(torch.tensor(losses)))


def _overflowing_linear(device):
    """A linear whose float16 result overflows (300 * 300 * 64 > 65504): float32 inputs, as autocast sees them."""
    x = (300 + torch.randn(2, 64)).to(device).requires_grad_()
    w = (300 + torch.randn(3, 64)).to(device)
    return x, w


def test_under_autocast_a_lowered_op_runs_in_the_wider_dtype(sim, logged, monkeypatch):
    monkeypatch.setenv("OP_TOOLS_VERBOSE", "1")
    monkeypatch.setenv("OP_TOOLS_TABLE_WIDTH", "full")  # the dtypes whole, as the assertions read them
    x, w = _overflowing_linear(sim)
    with torch.autocast(sim, dtype=torch.float16):
        plain = torch.nn.functional.linear(x, w)
        with op_tools.OpDtypeCast():
            widened = torch.nn.functional.linear(x, w)
    assert plain.dtype == torch.float16 and torch.isinf(plain).all()
    # what the op gives in float32 with autocast off, exactly, and differentiable
    assert widened.dtype == torch.float32 and torch.equal(widened, torch.nn.functional.linear(x, w))
    widened.sum().backward()
    assert torch.equal(x.grad.cpu(), w.sum(0).expand(2, 64).cpu())
    assert "| torch.nn.functional.linear | autocast | torch.float16 -> torch.float32 |" in " ".join(logged().split())


def test_under_autocast_the_table_decides_the_dtype_that_runs(sim, logged, monkeypatch):
    monkeypatch.setenv("OP_TOOLS_VERBOSE", "1")
    monkeypatch.setenv("OP_TOOLS_TABLE_WIDTH", "full")  # the dtypes whole, as the assertions read them
    x, w = _overflowing_linear(sim)
    with torch.autocast(sim, dtype=torch.float16), op_tools.OpDtypeCast(casts={torch.float16: torch.float64}):
        y = torch.nn.functional.linear(x, w)
    assert y.dtype == torch.float32  # computed in float64, returned in the inputs' own dtype
    assert torch.equal(y, torch.nn.functional.linear(x.double(), w.double()).float())
    out = " ".join(logged().split())  # table cells padded to their column
    assert "| torch.nn.functional.linear | autocast | torch.float16 -> torch.float64 |" in out
    assert "| torch.nn.functional.linear | input[1] | torch.float32 -> torch.float64 |" in out
    # a table that does not widen autocast's dtype leaves autocast to decide
    with torch.autocast(sim, dtype=torch.float16), op_tools.OpDtypeCast(casts={torch.bfloat16: torch.float32}):
        y = torch.nn.functional.linear(x, w)
    assert y.dtype == torch.float16 and torch.isinf(y).all()


def test_under_autocast_unlowered_outputs_keep_autocasts_dtypes(sim):
    h = torch.randn(4, 5, device=sim, dtype=torch.float16)
    target = torch.tensor([0, 1, 2, 3], device=sim)
    with torch.autocast(sim, dtype=torch.float16), op_tools.OpDtypeCast():
        probabilities = torch.softmax(h, -1)              # float32 by autocast's policy
        activated = torch.relu(h)                         # float16 in, float16 out: the tool's usual round trip
        loss = torch.nn.functional.cross_entropy(h, target)
    assert (probabilities.dtype, activated.dtype, loss.dtype) == (torch.float32, torch.float16, torch.float32)
    assert torch.equal(probabilities, torch.softmax(h.float(), -1))


def test_llama_under_fp16_autocast_trains_as_in_float32(sim, monkeypatch):
    monkeypatch.delenv("OP_DTYPE_CAST_DICT", raising=False)
    with op_tools.OpDtypeCast():
        widened = train_llama(sim, steps=2, autocast_dtype=torch.float16)
    assert widened == train_llama(sim, steps=2)
    assert widened != train_llama(sim, steps=2, autocast_dtype=torch.float16)


def test_what_a_widened_call_writes_reaches_the_callers_tensors_as_without_the_tool(sim):
    # BatchNorm's kernel writes its running statistics without moving their version counter: they stayed at their
    # start; and in inference mode, reading a cast copy's version counter raised out of the user's call
    x = torch.randn(4, 3, device=sim).half()
    batch_norm, expected = (torch.nn.BatchNorm1d(3).to(sim).half() for _ in range(2))
    expected(x)
    with op_tools.OpDtypeCast():
        batch_norm(x)
    assert torch.allclose(batch_norm.running_mean.cpu().float(), expected.running_mean.cpu().float(), atol=1e-3)
    assert batch_norm.running_mean.abs().sum().item() > 0
    with op_tools.OpDtypeCast(), torch.inference_mode():
        y = torch.nn.functional.relu(x * 2)
        y.add_(1)
    assert y.dtype == torch.float16 and torch.equal(y.cpu(), (torch.relu(x.cpu() * 2) + 1))


def test_writes_through_views_reach_the_original_tensor_as_without_the_tool(sim):
    # torch.split, swapaxes, broadcast_to & co ran on float32 copies: a write through their pieces was lost
    import contextlib

    plain = writes_through_views(sim, torch.float16, contextlib.nullcontext())
    assert "more than one element of the written-to tensor" in plain["meshgrid"]
    assert writes_through_views(sim, torch.float16, op_tools.OpDtypeCast()) == plain


def test_in_place_view_ops_change_the_original_tensor_as_without_the_tool(sim):
    # Run on a float32 copy, the float16 tensor kept its shape: unsqueeze_ and t_ raised, resize_ and as_strided_ left
    # a (2, 3) tensor holding the new values twice over.
    import contextlib

    changes = {"unsqueeze_": lambda x: x.unsqueeze_(0), "t_": lambda x: x.t_(), "resize_": lambda x: x.resize_(3),
               "as_strided_": lambda x: x.as_strided_((3,), (2,))}

    def run(tool):
        out = {}
        for name, change in changes.items():
            x = torch.arange(6.0, device=sim, dtype=torch.float16).view(2, 3).clone()
            with tool:
                returned = change(x)
            out[name] = (returned.shape, returned.stride(), returned.dtype, returned.cpu().tolist())
        return out

    assert run(op_tools.OpDtypeCast()) == run(contextlib.nullcontext())


def test_a_tensor_passed_twice_is_widened_once(sim):
    # Each occurrence had its own float32 copy: the write went to one, and the other, unwritten, was carried back
    # last (x.mul_(x) left x as it was).
    import contextlib

    from test_fallback import writes_through_a_tensor_passed_twice as writes

    assert writes(sim, torch.float16, op_tools.OpDtypeCast()) == writes(sim, torch.float16, contextlib.nullcontext())


def test_out_tensors_are_resized_as_without_the_tool(sim):
    # The op resized the wide copy, and its values could not be copied into the original: the user's call raised.
    import contextlib

    from test_fallback import outputs_resized

    assert outputs_resized(sim, torch.float16, op_tools.OpDtypeCast()) == \
        outputs_resized(sim, torch.float16, contextlib.nullcontext())


def test_under_autocast_the_inputs_of_a_widened_call_agree_in_dtype(sim):
    # The tool turned autocast off and widened the table's dtypes alone: a Linear of float32 tensors under float16
    # autocast met float64 weights and float16 activations ("mat1 and mat2 must have the same dtype").
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(sim)
    x, s = torch.randn(2, 8, device=sim), torch.randn(4, 4, device=sim)
    h = torch.randn(4, 4, device=sim, dtype=torch.float16)
    weight, bias = torch.randn(4, device=sim), torch.randn(4, device=sim)
    calls = {"model": lambda: model(x), "addmm": lambda: torch.addmm(h, s, s),
             "layer_norm": lambda: torch.nn.functional.layer_norm(h, (4,), weight, bias), "add": lambda: h + s}
    with torch.autocast(sim, dtype=torch.float16):
        plain = {name: call() for name, call in calls.items()}
    for casts in ({torch.float32: torch.float64}, {torch.float16: torch.float32, torch.float32: torch.float64}):
        with torch.autocast(sim, dtype=torch.float16), op_tools.OpDtypeCast(casts=casts) as tool:
            tooled = {name: call() for name, call in calls.items()}
        assert tool.verdict() == "clean", tool.closing_line()
        kept = {name: plain[name].dtype for name in ("layer_norm", "add")}  # float32 by autocast or promotion
        assert {name: tooled[name].dtype for name in kept} == kept
        assert torch.allclose(tooled["layer_norm"], plain["layer_norm"], atol=1e-3)
        if torch.float16 not in casts:  # autocast's dtype kept: autocast's own numbers
            assert torch.equal(tooled["model"], plain["model"]) and torch.equal(tooled["addmm"], plain["addmm"])
        else:  # float16 widened: matmuls run wider, returned in the dtype their inputs give without autocast
            assert tooled["addmm"].dtype == torch.float32


def test_a_sparse_gradient_reaches_its_parameter_as_without_the_tool(sim):
    # Tensor.to's backward converts the gradient to the parameter's layout: backward() raised "to(options) doesn't
    # support converting to a different layout".
    embedding = torch.nn.Embedding(10, 4, sparse=True).to(sim).half()
    index = torch.tensor([1, 2, 1], device=sim)
    embedding(index).float().sum().backward()
    plain, embedding.weight.grad = embedding.weight.grad, None
    with op_tools.OpDtypeCast():
        embedding(index).float().sum().backward()
    grad = embedding.weight.grad
    assert grad.layout == plain.layout == torch.sparse_coo and grad.dtype == torch.float16
    assert torch.equal(grad.to_dense(), plain.to_dense())


def test_a_call_the_device_cannot_widen_runs_as_written_and_is_said_not_cast(sim):
    import pytest

    import ditorch.sim

    ditorch.sim.inject_fault(".*", "unsupported", dtype=torch.float64)  # a device without float64 kernels
    x = torch.randn(3, device=sim)
    plain = torch.sin(x)
    with op_tools.OpDtypeCast(casts={torch.float32: torch.float64}) as tool:
        y = torch.sin(x)
    assert torch.equal(y, plain)
    assert tool.verdict() == "unchecked"
    assert "1 call not checked" in tool.closing_line() and "not cast (SimUnsupportedError" in tool.closing_line()
    with pytest.raises(ditorch.sim.SimUnsupportedError), op_tools.OpDtypeCast(casts={torch.float32: torch.float64},
                                                                               strict=True):
        torch.sin(x)
    # the user's own error, raised by the call as written, propagates as it is, with no trace of the tool's
    with pytest.raises(RuntimeError, match="must match the size") as raised, \
            op_tools.OpDtypeCast(casts={torch.float32: torch.float64}):
        torch.randn(2, device=sim) + x
    assert raised.value.__context__ is None and raised.value.__cause__ is None


def test_bincount_returns_the_dtype_it_returns_without_the_tool(sim):
    # No meta kernel: promotion guessed float16 for float16 weights, which bincount sums in float64.
    index = torch.tensor([0, 1, 1, 3], device=sim)
    casts = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float64}
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        weights = torch.rand(4, device=sim).to(dtype)
        plain = torch.bincount(index, weights=weights)
        with op_tools.OpDtypeCast(casts=casts):
            tooled = torch.bincount(index, weights=weights)
            method = index.bincount(weights)
        assert tooled.dtype == method.dtype == plain.dtype
        # float16's sums stay float64's (no float32 between); float32's are summed in float64
        assert torch.equal(tooled, plain) if dtype != torch.float32 else torch.allclose(tooled, plain)


def test_version_counters_end_as_the_op_leaves_them(sim):
    # The cast copy's values go back with copy_, which moves the counter once: a foreach op, BatchNorm's running
    # statistics and a foreach optimizer's step move it not at all on the device, stft's result twice.
    import contextlib

    def versions(tool):
        torch.manual_seed(0)
        linear, norm = torch.nn.Linear(3, 3).to(sim), torch.nn.BatchNorm1d(3).to(sim)
        optimizer = torch.optim.SGD(linear.parameters(), lr=0.1, foreach=True)
        ys, zs = [torch.randn(3, device=sim) for _ in range(2)], [torch.randn(3, device=sim) for _ in range(2)]
        x = torch.randn(3, device=sim)
        with tool:
            torch._foreach_add_(ys, zs)
            norm(linear(torch.randn(4, 3, device=sim))).sum().backward()
            optimizer.step()
            x.mul_(2)
            spectrum = torch.stft(torch.randn(16, device=sim), 8, window=torch.hann_window(8, device=sim),
                                  return_complex=True)
        return [t._version for t in (ys[0], norm.running_mean, linear.weight, x, spectrum)]

    plain = versions(contextlib.nullcontext())
    assert plain == [0, 0, 0, 1, 2]
    assert versions(op_tools.OpDtypeCast(casts={torch.float32: torch.float64})) == plain


def test_the_closing_line_counts_the_calls_cast_and_a_run_with_none_cast_is_not_clean(sim, monkeypatch):
    """A float32 run under the default table (float16, bfloat16), or an empty table, casts nothing: the run's numbers
    are its own, which the user asked to change, so the closing line says so and the verdict is not clean."""
    x16, x32 = torch.ones(4, device=sim, dtype=torch.float16), torch.ones(4, device=sim)
    with op_tools.OpDtypeCast() as tool:
        x16.sin(), x32.cos()
    assert tool.closing_line().startswith("OpDtypeCast: 2 calls of 2 ops handled (1 cast); wrote no file")
    assert tool.verdict() == "clean"

    with op_tools.OpDtypeCast() as tool:
        x32.sin()
    assert tool.closing_line() == ("OpDtypeCast: 1 call of 1 op handled (0 cast); wrote no file; no call was cast: "
                                   "none had an input in a dtype OP_DTYPE_CAST_DICT casts (torch.bfloat16, "
                                   "torch.float16)")
    assert tool.verdict() == "unchecked"

    with op_tools.OpDtypeCast(casts={torch.float32: torch.float32}) as tool:
        x32.sin()
    assert tool.not_checked() == "OpDtypeCast(casts=...) casts no dtype to another: no call was cast"

    monkeypatch.setenv("OP_DTYPE_CAST_DICT", "")
    with op_tools.OpDtypeCast() as tool:
        x16.sin()
    assert tool.not_checked() == "OP_DTYPE_CAST_DICT casts no dtype to another: no call was cast"


def test_a_run_whose_calls_raised_their_own_errors_says_so(sim):
    # The user's error propagated, and the closing line said no input was in a dtype the table casts: the input was
    # float16
    x16, w16 = torch.randn(3, 4, device=sim).half(), torch.randn(5, 6, device=sim).half()
    x32 = torch.ones(2, device=sim)
    with op_tools.OpDtypeCast() as tool:
        with pytest.raises(RuntimeError, match="cannot be multiplied"):
            torch.nn.functional.linear(x16, w16)
        x32.sin()
    assert tool.not_checked() == ("no call was cast: 1 call raised its own error; 1 other call had no input in a "
                                  "dtype OP_DTYPE_CAST_DICT casts (torch.bfloat16, torch.float16)")
    assert tool.verdict() == "unchecked"
    with op_tools.OpDtypeCast() as tool:
        with pytest.raises(RuntimeError, match="cannot be multiplied"):
            torch.nn.functional.linear(x16, w16)
    assert tool.not_checked() == "no call was cast: 1 call raised its own error"


def _outcome(call):
    try:
        result = call()
    except RuntimeError as error:
        return str(error)
    return result.dtype, result.cpu().tolist()


def test_a_call_mixing_dtypes_the_table_makes_one_runs_as_written(sim):
    # Widened to float32, linear of float16 by float32 ran where the device refuses it: the user's dtype error became
    # a float16 result, "1 cast", verdict clean (meta kernels let the mismatch through).
    x16, w32 = torch.randn(3, 4, device=sim).half(), torch.randn(2, 4, device=sim)
    refused = {"linear": lambda: torch.nn.functional.linear(x16, w32), "mm": lambda: torch.mm(x16, w32.t()),
               "matmul": lambda: x16 @ w32.t()}
    for name, call in refused.items():
        plain = _outcome(call)
        assert "expected m1 and m2 to have the same dtype" in plain, name
        with op_tools.OpDtypeCast() as tool:
            assert _outcome(call) == plain, name
        assert sum(tool.raised.values()) == 1 and tool.cast_calls == 0, name
    # ops that take mixed dtypes are widened as any call, with the dtypes they return without the tool: PyTorch's
    # promotion (x16 + x32), a layer_norm of a float16 input by float32 weights (float16 out; it ran as written, not
    # checked in the wider dtype, when every mixed call did)
    w4, b4 = torch.randn(4, device=sim), torch.randn(4, device=sim)
    taken = {"promoted": lambda: x16.t() + w32.t()[:, :1],
             "layer_norm": lambda: torch.nn.functional.layer_norm(x16, (4,), w4, b4)}
    for name, call in taken.items():
        plain = _outcome(call)
        with op_tools.OpDtypeCast() as tool:
            widened = _outcome(call)
        assert widened[0] == plain[0] and tool.cast_calls == 1, (name, widened, plain)
    with op_tools.OpDtypeCast() as tool:
        _outcome(refused["linear"])
        x16.sin()
    assert tool.raised["torch.nn.functional.linear"] == 1 and tool.cast_calls == 1, tool.closing_line()


def test_sync_batch_norms_statistics_kernels_update_the_callers_running_statistics(sim):
    # Their schemas do not say they write running_mean and running_var: the widened copies' statistics reached
    # nothing, and SyncBatchNorm's running statistics stayed where they were.
    x = torch.randn(6, 3, 4)

    def run(tool):
        import contextlib

        running_mean, running_var = torch.zeros(3, device=sim), torch.ones(3, device=sim)
        data = x.to(sim)
        mean, invstd = torch.batch_norm_stats(data, 1e-5)
        with tool or contextlib.nullcontext():
            torch.batch_norm_gather_stats_with_counts(data, mean[None], invstd[None], running_mean, running_var, 0.1,
                                                      1e-5, torch.tensor([18.0], device=sim))
            torch.batch_norm_update_stats(data, running_mean, running_var, 0.1)
        return running_mean.cpu(), running_var.cpu()

    plain = run(None)
    assert not torch.equal(plain[0], torch.zeros(3))
    for cast, expected in zip(run(op_tools.OpDtypeCast(casts={torch.float32: torch.float64})), plain):
        torch.testing.assert_close(cast, expected)


# OpAutoCompare beside OpDtypeCast under autocast: the op run widened where autocast lowers it returns float32, on
# purpose; each such call was a failure, "dtype differs", blaming the op. Its values are still judged: a faulty kernel
# is found.
@pytest.mark.parametrize("order", ["OpAutoCompare first", "OpDtypeCast first"])
def test_opautocompare_beside_opdtypecast_under_autocast_judges_values_not_the_widened_dtype(sim, tmp_path, order):
    import ditorch.sim

    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 16).to(sim)
    x = torch.randn(4, 16, device=sim)
    verdicts = []
    for fault in ("", "addmm:noise=1e-1"):
        compare = op_tools.OpAutoCompare(results_dir=str(tmp_path), backward=False)
        cast = op_tools.OpDtypeCast(results_dir=str(tmp_path))
        tools = [compare, cast] if order == "OpAutoCompare first" else [cast, compare]
        for tool in tools:
            tool.start()
        try:
            with torch.autocast(sim, dtype=torch.float16), ditorch.sim.faults(fault):
                y = torch.nn.functional.linear(x, layer.weight, layer.bias)
        finally:
            for tool in reversed(tools):
                tool.stop()
        assert y.dtype == torch.float32 and cast.cast_calls == 1
        verdicts.append((compare.verdict(), [f["error_info"][:13] for f in compare.failures]))
    assert verdicts[0] == ("clean", []), verdicts
    assert verdicts[1][0] == "found" and "dtype differs" not in str(verdicts[1][1]), verdicts
