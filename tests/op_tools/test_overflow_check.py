import gc
import sys

import pytest
import torch
from tiny_models import train_llama

import op_tools


def test_llama_losses_are_bit_identical_and_nothing_is_reported(sim):
    base = train_llama(sim, steps=2)
    with op_tools.OpOverflowCheck() as check:
        assert train_llama(sim, steps=2) == base
    assert check.first_overflow is None


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="an incremental collector promotes objects differently")
def test_a_checked_call_holds_few_objects_the_garbage_collector_promotes(sim):
    # What a check holds until its batch is read, and a call until its backward, is promoted into the collector's
    # oldest generation, whose full collections visit the program's whole heap (tests/gc_promotions.py): small
    # objects for the engine's hooks instead of closures, a check's names and flags in a tuple and a bytearray, the
    # indices its read-back values go to in tuples (25.5 with them in lists). 20.0-20.2 a handled call, averaged over
    # the collector's phases (one phase gave 17-30: where the program's allocations fall moves it), in host memory as
    # in device memory (DITORCH_SIM_DEVICE_MEMORY, a GPU's path); 35.8 with closures and lists; the same steps
    # without the tool promote none. Since views that compute nothing are not handled (op_facts' ``alias_only``, 15%
    # of these calls), 27.4 a handled call: the same checks, each waiting longer for its batch of 64 (the views no
    # longer count towards it), so more of them live through two young collections (10.8k -> 13.1k promoted over
    # the three steps; 9.8k -> 9.6k a real-size step, stay_on_cost.py).
    from gc_promotions import promoted_on_average

    def checked_steps():
        with op_tools.OpOverflowCheck() as check:
            train_llama(sim, steps=3)
        return sum(check.handled.values())

    train_llama(sim, steps=1)  # imports and caches: not the checks'
    gc.collect()
    gc.freeze()  # the process's objects aside: the count is then the tool's, and counting is cheap
    try:
        promoted, handled = promoted_on_average(checked_steps)
    finally:
        gc.unfreeze()
    assert handled[0] > 400 and promoted / handled[0] <= 30, promoted / handled[0]


def test_names_the_op_where_nan_appears_in_forward(sim):
    import ditorch.sim

    with ditorch.sim.faults("silu:nan"), op_tools.OpOverflowCheck() as check:
        train_llama(sim, steps=1)
    found = check.first_overflow
    assert (found.name, found.phase) == ("torch.nn.functional.silu", "forward")
    assert "modeling" in found.location or "activations.py" in found.location
    assert found.module == "model.layers.0.mlp.act_fn" and "in model.layers.0.mlp.act_fn" in str(found)


def test_names_the_op_where_nan_appears_in_backward(sim):
    import ditorch.sim

    with ditorch.sim.faults("embedding_dense_backward:nan"), op_tools.OpOverflowCheck() as check:
        train_llama(sim, steps=1)
    found = check.first_overflow
    assert (found.name, found.phase) == ("torch.nn.functional.embedding", "backward")
    assert "embed_tokens(input_ids)" in found.location
    assert found.module == "model.embed_tokens"  # the module of the forward call whose backward it is


def test_nan_inside_a_composite_function_backward_names_the_function(sim):
    # cross_entropy records log_softmax and nll_loss nodes; the nan is born in the inner one.
    import ditorch.sim

    with ditorch.sim.faults("_log_softmax_backward_data:nan"), op_tools.OpOverflowCheck() as check:
        train_llama(sim, steps=1)
    found = check.first_overflow
    assert (found.name, found.phase) == ("torch.nn.functional.cross_entropy", "backward")


@pytest.mark.parametrize("listing", [None, "torch.nn.functional.silu,torch.nn.functional.embedding"])
@pytest.mark.parametrize("fault", ["silu:nan", "embedding_dense_backward:nan"])
def test_raise_stops_at_the_first_overflow(sim, monkeypatch, fault, listing):
    # With a list of plain names the tool wraps those functions (and backward(), where it raises) instead of a mode.
    import ditorch.sim

    monkeypatch.setenv("OP_OVERFLOW_CHECK_RAISE", "1")
    if listing:
        monkeypatch.setenv("OP_OVERFLOW_CHECK_LIST", listing)
    with ditorch.sim.faults(fault), op_tools.OpOverflowCheck():
        with pytest.raises(op_tools.OverflowDetectedError, match="first inf/nan from finite inputs"):
            train_llama(sim, steps=1)


def test_statistics_table_has_the_original_columns(sim, logged, monkeypatch):
    monkeypatch.setenv("OP_TOOLS_VERBOSE", "1")
    x = torch.tensor([1.0, 2.0, float("inf")], device=sim)
    with op_tools.OpOverflowCheck() as check:
        x * 2
    out = logged()
    for column in ("inf_or_nan", "min", "max", "mean", "std", "norm"):
        assert f" {column} " in out
    assert check.first_overflow is None  # the input already held inf


def charged(work):
    """What ``work()`` charged the host on the sim device: synchronisations, copies (``torch.sim.device_counts``)."""
    before = torch.sim.device_counts()
    work()
    return torch.sim.device_counts() - before


def test_no_host_synchronisation_in_a_step_the_flags_read_in_batches(sim):
    plain = charged(lambda: train_llama(sim, steps=2))
    check = op_tools.OpOverflowCheck()

    def checked():
        with check:
            train_llama(sim, steps=2)

    counts = charged(checked)
    handled = sum(check.handled.values())
    assert check.first_overflow is None and handled > 300
    # one synchronisation in all: the tool's stop waits for the last batch; none per call, none per step
    assert counts.synchronizations - plain.synchronizations == 1
    copies = counts.device_to_host_copies - plain.device_to_host_copies
    # a check per call and per backward node (at most three a call here), 64 checks a copy
    assert 0 < copies <= 3 * handled // 64 + 1


def test_per_call_tables_read_each_call_once(sim, monkeypatch, logged):
    monkeypatch.setenv("OP_TOOLS_VERBOSE", "1")
    plain = charged(lambda: train_llama(sim, steps=1))
    check = op_tools.OpOverflowCheck()

    def checked():
        with check:
            train_llama(sim, steps=1)

    extra = charged(checked).synchronizations - plain.synchronizations
    assert check.first_overflow is None
    assert 0 < extra <= sum(check.handled.values()) * 3  # forward, and at most the backward nodes of each call
    assert "torch.nn.functional.silu    forward_id" in logged() and "| output[0] |" in logged()


@pytest.mark.parametrize("fault", ["silu:nan", "embedding_dense_backward:nan", "mm:inf"])
def test_the_first_overflow_read_in_batches_is_the_one_read_call_by_call(sim, monkeypatch, fault):
    import ditorch.sim

    found = {}
    for verbose in ("1", "0"):  # verbose: each call read as it runs, the behaviour before batches
        monkeypatch.setenv("OP_TOOLS_VERBOSE", verbose)
        with ditorch.sim.faults(fault), op_tools.OpOverflowCheck() as check:
            train_llama(sim, steps=1)
        first = check.first_overflow
        found[verbose] = (first.name, first.phase, first.module, first.location, first.step)
    assert found["0"] == found["1"]


def test_statistics_are_computed_for_the_overflowing_call_and_nothing_is_read_after_it(sim, logged):
    import ditorch.sim

    x, w = torch.ones(2, 4, device=sim), torch.randn(4, 4, device=sim)
    check = op_tools.OpOverflowCheck()

    def work():
        with ditorch.sim.faults("silu:inf"), check:
            h = torch.nn.functional.linear(x, w)
            torch.nn.functional.silu(h) * 2 + 1

    counts = charged(work)
    assert check.first_overflow.name == "torch.nn.functional.silu"
    assert counts.synchronizations == 2  # the batch's flags at stop, then the silu call's statistics
    out = logged()
    assert "OpOverflowCheck: first inf/nan from finite inputs: torch.nn.functional.silu (forward)" in out
    assert "|    name   | inf_or_nan |" in out  # the op is named in the line above the table
    assert "| output[0] |    True    |" in out and "|  input[0] |   False    |" in out
    assert "not kept" not in out  # the temporary silu output was kept, as an alias, for its statistics


def test_a_tensor_written_in_place_before_its_check_was_read_shows_its_flag_and_says_why(sim, logged):
    import ditorch.sim

    x = torch.ones(3, device=sim)
    with ditorch.sim.faults("exp:inf"), op_tools.OpOverflowCheck() as check:
        y = torch.exp(x)
        y.zero_()  # before the batch holding exp's flags is read
    assert check.first_overflow.name == "torch.exp"
    out = logged()
    assert "| output[0] |    True    | not kept |" in out and "statistics not kept" in out


def test_reading_first_overflow_mid_run_waits_for_the_checks_in_flight(sim):
    import ditorch.sim

    with ditorch.sim.faults("silu:nan"), op_tools.OpOverflowCheck() as check:
        torch.nn.functional.silu(torch.ones(2, device=sim))
        assert check.first_overflow is not None and check.first_overflow.name == "torch.nn.functional.silu"


def test_statistics_keep_the_values_of_the_original_computation(sim):
    from op_tools.tools.overflow_check import statistics_rows

    values = torch.tensor([[1.0, -2.0], [3.5, float("nan")]])
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        t = values.to(dtype)
        finite = t[0]
        (row, finite_row, ints, empty) = statistics_rows([("t", t.to(sim)), ("f", finite.to(sim)),
                                                          ("i", torch.arange(4, device=sim)),
                                                          ("e", torch.empty(0, device=sim))])
        assert row["inf_or_nan"] and not finite_row["inf_or_nan"] and not ints["inf_or_nan"]
        wide = finite.double() if dtype == torch.float64 else finite.float()
        assert finite_row["min"] == wide.min().item() and finite_row["max"] == wide.max().item()
        assert finite_row["mean"] == wide.mean().item() and finite_row["norm"] == wide.norm().item()
        assert finite_row["std"] == wide.std(correction=0).item()
        assert (ints["min"], ints["max"], ints["mean"]) == (0.0, 3.0, 1.5)
        assert empty == {"name": "e", "inf_or_nan": False}


def test_a_backend_without_foreach_norm_is_checked_tensor_by_tensor(sim, monkeypatch):
    import ditorch.sim

    def unsupported(*args, **kwargs):
        raise NotImplementedError("_foreach_norm is not implemented for this backend")

    monkeypatch.setattr(torch, "_foreach_norm", unsupported)
    monkeypatch.setattr("op_tools.numerics.tensor_stats._no_foreach_norm", set())
    with ditorch.sim.faults("silu:nan"), op_tools.OpOverflowCheck() as check:
        train_llama(sim, steps=1)
    assert (check.first_overflow.name, check.first_overflow.phase) == ("torch.nn.functional.silu", "forward")


@pytest.mark.parametrize("fault", ["silu:nan", "embedding_dense_backward:nan"])
def test_on_an_asynchronous_device_the_first_overflow_is_the_same_call(sim, fault):
    # sim's flags arrive 200 kernels late, as a GPU's run behind the host: read early, they would be NaN
    import ditorch.sim

    found = []
    for lag in (0, 200):
        with ditorch.sim.asynchronous(lag=lag), ditorch.sim.faults(fault), op_tools.OpOverflowCheck() as check:
            train_llama(sim, steps=2)
        first = check.first_overflow
        found.append((first.name, first.phase, first.module, first.location, first.step))
    assert found[0] == found[1]


def test_on_an_asynchronous_device_a_clean_run_stays_clean(sim):
    import ditorch.sim

    with ditorch.sim.asynchronous(lag=200), op_tools.OpOverflowCheck() as check:
        train_llama(sim, steps=2)
    assert check.first_overflow is None and check.verdict() == "clean"


def test_the_device_branch_fused_norms_finds_the_same_first_overflow(sim):
    # in device memory (a GPU's case, DITORCH_SIM_DEVICE_MEMORY) the flags come from one _foreach_norm per call
    import ditorch.sim
    from op_tools.tools import overflow_check

    found = []
    for device_memory in (False, True):
        overflow_check._host_memory.clear()
        with ditorch.sim.device_memory(device_memory), ditorch.sim.asynchronous(lag=100), \
                ditorch.sim.faults("silu:nan"), op_tools.OpOverflowCheck() as check:
            train_llama(sim, steps=1)
        assert overflow_check._host_memory["sim"] is (not device_memory)
        first = check.first_overflow
        found.append((first.name, first.phase, first.module, first.location))
    overflow_check._host_memory.clear()
    assert found[0] == found[1] and found[0][0] == "torch.nn.functional.silu"


def test_checks_in_flight_keep_no_tensor_object_of_the_program_alive(sim):
    import weakref

    with op_tools.OpOverflowCheck() as check:
        y = torch.exp(torch.ones(3, device=sim))
        ref = weakref.ref(y)
        del y
        assert ref() is None and len(check._checks) == 2  # ones and exp in flight, the tensor object gone


def _causal_block(sim, fault: str = ""):
    """A causal mask filled with -inf (how many models build it), softmax, then a gelu: (first overflow, result)."""
    import ditorch.sim

    torch.manual_seed(0)
    scores = torch.randn(2, 8, 8).to(sim)
    mask = torch.ones(8, 8, dtype=torch.bool).triu(1).to(sim)
    with ditorch.sim.faults(fault), op_tools.OpOverflowCheck(raise_on_overflow=False) as check:
        masked = scores.masked_fill(mask, float("-inf"))
        filled = torch.full((2, 8), float("-inf"), device=sim)  # a scalar fill value, positional
        clamped = torch.clamp(masked, min=float("-inf"))  # and by keyword
        out = torch.nn.functional.gelu(torch.softmax(clamped, dim=-1) @ scores)
    return check.first_overflow, (masked, filled, out)


@pytest.mark.parametrize("raise_on_overflow", ["0", "1"])
def test_an_inf_a_scalar_argument_puts_there_is_not_born_there_and_the_nan_after_it_is_found(sim, monkeypatch,
                                                                                               raise_on_overflow):
    monkeypatch.setenv("OP_OVERFLOW_CHECK_RAISE", raise_on_overflow)  # read call by call, or in batches
    clean, (masked, filled, _) = _causal_block(sim)
    assert clean is None and bool(masked.isinf().any()) and bool(filled.isinf().all())
    found, _ = _causal_block(sim, "gelu:nan")
    assert (found.name, found.phase) == ("torch.nn.functional.gelu", "forward"), found


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("raise_on_overflow", ["0", "1"])
@pytest.mark.parametrize("size,device_memory", [(8, False), (2**17, False), (8, True)])  # fused, aminmax, a GPU's
def test_a_minus_inf_fill_value_explains_minus_inf_only_and_a_kernel_writing_plus_inf_is_named(
        sim, monkeypatch, raise_on_overflow, size, device_memory, in_place):
    # masked_fill(mask, -inf) that writes +inf (a faulty kernel) was excused by its -inf argument: the softmax after it
    # was named. The results of a call whose float argument is an inf of one sign are read with their infs' signs.
    import ditorch.sim
    from op_tools.tools import overflow_check

    monkeypatch.setenv("OP_OVERFLOW_CHECK_RAISE", raise_on_overflow)
    overflow_check._host_memory.clear()
    found = {}
    with ditorch.sim.device_memory(device_memory):
        for fault in ("", "masked_fill.*:inf"):
            scores = torch.randn(size // 8 if size > 8 else 1, 8, 8).to(sim)
            mask = torch.ones(8, 8, dtype=torch.bool).triu(1).to(sim)
            with ditorch.sim.faults(fault), op_tools.OpOverflowCheck() as check:
                try:
                    # a causal mask: -inf above the diagonal
                    masked = scores.masked_fill_(mask, float("-inf")) if in_place else \
                        scores.masked_fill(mask, float("-inf"))
                    torch.softmax(masked, dim=-1).sum()
                except op_tools.OverflowDetectedError:
                    assert check.raise_on_overflow
            found[fault] = check.first_overflow
    overflow_check._host_memory.clear()
    assert found[""] is None, found[""]
    assert found["masked_fill.*:inf"] is not None, found
    name = "torch.Tensor.masked_fill_" if in_place else "torch.Tensor.masked_fill"
    assert found["masked_fill.*:inf"].name == name, found["masked_fill.*:inf"]


def test_an_inf_an_arithmetic_op_combines_may_come_out_of_either_sign(sim):
    # x * -inf is +inf where x < 0, x - inf is -inf: put there by the argument, not born there; its sign proves nothing
    x = torch.tensor([-1.0, 2.0]).to(sim)
    with op_tools.OpOverflowCheck() as check:
        assert bool((x * float("-inf")).isposinf().any()) and bool((x - float("inf")).isneginf().all())
        torch.where(x > 0, x, float("inf"))
    assert check.verdict() == "clean", check.found()


def test_a_nan_argument_explains_a_nan_not_an_inf(sim):
    import ditorch.sim

    x = torch.randn(4).to(sim)
    with op_tools.OpOverflowCheck() as check:
        torch.full((4,), float("nan"), device=sim) + x
    assert check.first_overflow is None
    with ditorch.sim.faults("fill_:inf"), op_tools.OpOverflowCheck() as check:  # full fills
        torch.full((4,), float("nan"), device=sim) + x
    assert check.first_overflow is not None and check.first_overflow.name == "torch.full", check.found()


def test_a_nan_born_from_infs_is_born_there(sim):
    x = torch.tensor([1.0, float("inf")]).to(sim)
    with op_tools.OpOverflowCheck() as check:
        y = x * 2  # inf in, inf out: not born here
        z = y - y  # inf - inf: a nan, born here
    assert bool(z.isnan().any())
    assert check.first_overflow is not None and check.first_overflow.name == "torch.Tensor.sub", check.first_overflow


_INF = float("inf")
_MAX_NORMS = {  # a norm of order inf (the largest magnitude), and the ops built on one: (call, the kernel faulted)
    "torch.functional.norm": (lambda x: torch.norm(x, _INF), "linalg_vector_norm"),
    "torch.Tensor.norm": (lambda x: x.norm(p=_INF), "linalg_vector_norm"),
    "torch.linalg.vector_norm": (lambda x: torch.linalg.vector_norm(x, ord=-_INF), "linalg_vector_norm"),
    "torch.linalg.matrix_norm": (lambda x: torch.linalg.matrix_norm(x, _INF), "amax"),
    "torch.functional.cdist": (lambda x: torch.cdist(x, x.flip(0), p=_INF), "_cdist_forward"),
    "torch.nn.functional.normalize": (lambda x: torch.nn.functional.normalize(x, p=_INF), "div"),
}


@pytest.mark.parametrize("name", _MAX_NORMS)
def test_a_norms_order_of_inf_puts_no_inf_in_its_result_and_excuses_none(sim, name):
    """A float inf argument (``masked_fill``'s value) puts inf in the result, which is then not born at the call; a
    norm's order of inf is the largest magnitude, finite for finite inputs. Taken for a value, it excused the inf a
    faulty kernel gave: 12 norms and ops built on them passed an inf fault under a clean verdict."""
    import ditorch.sim

    call, kernel = _MAX_NORMS[name]
    x = torch.randn(4, 8).to(sim)
    with op_tools.OpOverflowCheck() as check:
        assert bool(call(x).isfinite().all())
    assert check.verdict() == "clean"
    with ditorch.sim.faults(f"{kernel}:inf"), op_tools.OpOverflowCheck() as check:
        assert not bool(call(x).isfinite().all())
    assert check.first_overflow is not None and check.first_overflow.name == name, check.found()


@pytest.mark.parametrize("raise_on_overflow", ["0", "1"])
@pytest.mark.parametrize("size,device_memory", [(8, False), (2**17, False), (2**17, True)])  # one fused reduction
def test_an_in_place_op_that_overflows_its_finite_input_is_born_there(sim, monkeypatch, raise_on_overflow, size,
                                                                       device_memory):
    # What an in-place op overwrites is its input as it was: flagged before the op, or its inf is taken as brought in.
    # Small tensors, and a GPU's memory (sim's device_memory), take one fused reduction; large ones in host memory
    # an aminmax each, and flags taken over from earlier checks.
    import ditorch.sim
    from op_tools.tools import overflow_check

    monkeypatch.setenv("OP_OVERFLOW_CHECK_RAISE", raise_on_overflow)
    overflow_check._host_memory.clear()
    with ditorch.sim.device_memory(device_memory):
        _in_place_overflows(sim, size)
    overflow_check._host_memory.clear()


def _in_place_overflows(sim, size):
    for overflow, name in [(lambda x, _: x.mul_(10), "torch.Tensor.mul_"),
                           (lambda x, y: torch._foreach_mul_([y, x], 10.0), "torch._foreach_mul_"),
                           (lambda x, y: torch.mul(x, 10, out=y), "torch.mul")]:
        x = torch.full((size,), 1e38, device=sim)
        y = torch.ones(size, device=sim)
        check = op_tools.OpOverflowCheck()
        with check:
            x + 1  # flagged finite, an earlier check's flag the write must not let the op take over
            try:
                overflow(x, y)
            except op_tools.OverflowDetectedError:
                assert check.raise_on_overflow
        found = check.first_overflow
        assert found is not None and (found.name, found.phase) == (name, "forward"), (name, found)


def test_a_large_tensor_is_reduced_once_while_unchanged(sim):
    # In host memory each reduction reads a whole tensor once more: an op's result, the next op's input, is reduced
    # once, its flag taken over by the next check.
    x = torch.randn(2**17, device=sim)

    def chain():
        y = x
        for _ in range(20):
            y = y * 1.0001

    plain = charged(chain).kernel_launches
    with op_tools.OpOverflowCheck() as check:
        checked = charged(chain).kernel_launches
    assert check.first_overflow is None and check.verdict() == "clean"
    assert checked - plain <= 20 + 1 + 2  # one reduction a result and for x, a join and a copy for the batch


def test_a_reshaped_view_of_a_large_tensor_takes_over_its_flag(sim):
    # A flag depends on the values alone: a contiguous tensor's reshaped view (heads split, a gradient viewed back)
    # is not reduced again.
    x = torch.randn(2**17, device=sim)

    def chain():
        y = x
        for _ in range(10):
            y = (y * 1.0001).view(2, -1).view(-1)

    plain = charged(chain).kernel_launches
    with op_tools.OpOverflowCheck() as check:
        checked = charged(chain).kernel_launches
    assert check.first_overflow is None and check.verdict() == "clean"
    assert checked - plain <= 10 + 1 + 2  # one reduction a product and for x, a join and a copy for the batch


def test_a_flag_made_stale_by_a_write_no_call_shows_is_read_again_before_a_call_is_blamed(sim):
    import ditorch.sim
    from op_tools.core.engine import tool_work

    x = torch.ones(2**17, device=sim)
    with op_tools.OpOverflowCheck() as check:
        x * 2  # x flagged finite
        with tool_work(), ditorch.sim.faults("fill_:unversioned"):  # no call shows it, no counter moves
            x.fill_(float("inf"))
        x + 1  # inf in, inf out: not born here, though x's flag taken over says finite
    assert check.first_overflow is None and check.stale_flags == 1
    assert "1 flags taken over from an earlier call found out of date" in check.closing_line()


@pytest.mark.parametrize("raise_on_overflow", ["0", "1"])
@pytest.mark.parametrize("size", [8, 2**17])
def test_memory_never_written_is_no_ops_overflow_and_what_overwrites_it_is_judged_by_its_inputs(sim, monkeypatch,
                                                                                                raise_on_overflow,
                                                                                                size):
    # A GPU's torch.empty returns freed memory, which may hold nan (sim's empty:nan fault): neither the empty, nor an
    # op writing into it (out=, copy_) is where an inf/nan is born; an out= op overflowing its finite inputs is.
    import ditorch.sim

    monkeypatch.setenv("OP_OVERFLOW_CHECK_RAISE", raise_on_overflow)
    x = torch.ones(size, device=sim)
    with ditorch.sim.faults("empty:nan;empty_like:nan"), op_tools.OpOverflowCheck() as clean:
        buffer = torch.empty(size, device=sim)
        assert bool(buffer.isnan().all())
        torch.mul(x, 2, out=buffer)
        torch.empty_like(x).copy_(x).add_(1)
    assert clean.first_overflow is None and clean.verdict() == "clean"
    check = op_tools.OpOverflowCheck()
    with ditorch.sim.faults("empty:nan"), check:
        try:
            torch.mul(torch.full((size,), 1e38, device=sim), 10, out=torch.empty(size, device=sim))
        except op_tools.OverflowDetectedError:
            assert raise_on_overflow == "1"
    assert (check.first_overflow.name, check.first_overflow.phase) == ("torch.mul", "forward")


def test_the_programs_own_data_holding_an_inf_was_not_born_there(sim):
    with op_tools.OpOverflowCheck() as check:
        mask = torch.tensor([0.0, float("-inf")], device=sim)  # given, not computed
        torch.as_tensor([float("inf")], device=sim)
        scores = torch.ones(2, device=sim).new_tensor([1.0, 2.0]) + mask  # inf in, inf out
        weights = torch.softmax(scores, 0)  # finite from an inf: not an overflow
        (weights * 1e38 * 10).sum()  # an overflow from finite inputs
    assert (check.first_overflow.name, check.first_overflow.phase) == ("torch.Tensor.mul", "forward")


@pytest.mark.parametrize("workload", __import__("zoo").ZOO, ids=lambda w: w.name)
def test_flags_taken_over_name_the_same_first_overflow_on_every_recipe(sim, monkeypatch, workload):
    # Every tensor reduced by aminmax in host memory (LARGE lowered: the recipes' tensors are small), with flags taken
    # over from earlier checks and without (nothing remembered): a clean run stays clean, and a nan put in the
    # recipe's forward or backward fault op is the same first overflow either way (BatchNorm's running statistics,
    # GradScaler's unscale, the foreach optimizers and checkpointing write what they write).
    import ditorch.sim
    from op_tools.tools import overflow_check

    monkeypatch.setattr(overflow_check, "LARGE", 16)
    faults = [(workload.forward_fault, "forward")] + ([(workload.backward_fault, "backward")]
                                                     if workload.backward_fault else [])
    found: dict = {}
    for remembered, device_memory in ((overflow_check.KNOWN_ENTRIES, False), (0, False), (0, True)):
        # the third: a GPU's memory (one fused _foreach_norm a call, nothing taken over), arriving late
        monkeypatch.setattr(overflow_check, "KNOWN_ENTRIES", remembered)
        overflow_check._host_memory.clear()
        with ditorch.sim.device_memory(device_memory), ditorch.sim.asynchronous(lag=50 if device_memory else 0):
            with op_tools.OpOverflowCheck() as clean:
                workload.run(sim)
            assert clean.first_overflow is None and clean.stale_flags == 0 and clean.verdict() == "clean"
            for (spec, _), phase in faults:
                with ditorch.sim.faults(spec.split(":")[0] + ":nan"), op_tools.OpOverflowCheck() as check:
                    workload.run(sim)
                first = check.first_overflow
                found.setdefault(phase, []).append(first and (first.name, first.phase, first.module, first.location,
                                                              first.step))
        overflow_check._host_memory.clear()
    for (_, suffix), phase in faults:
        assert found[phase][0] is not None and found[phase][0] == found[phase][1] == found[phase][2], found
        assert found[phase][0][0].endswith(suffix) and found[phase][0][1] == phase, found


def test_a_strided_tensor_in_host_memory_is_flagged_through_its_minimum_and_maximum():
    """A large tensor whose last dimension is strided (a transposed weight, an attention's transposed keys) is reduced
    by amin and amax, not aminmax (which crawls there on the CPU): +inf, -inf and nan are each still found."""
    from op_tools.tools import overflow_check

    base = torch.randn(512, 256)
    plus, minus, nan = base.clone(), base.clone(), base.clone()
    plus[3, 5], minus[0, 0], nan[7, 1] = float("inf"), float("-inf"), float("nan")
    tensors = [t.t() for t in (base, plus, minus, nan)]
    assert tensors[0].stride(-1) != 1 and tensors[0].numel() >= overflow_check.LARGE
    assert overflow_check.nonfinite_kinds(tensors) == [overflow_check.FINITE, overflow_check.INF,
                                                       overflow_check.INF, overflow_check.NAN]


def test_a_nan_from_an_optimizers_foreach_kernel_is_named(sim):
    """AdamW's in-place foreach ops write the parameters and return nothing: the one that turns them to nan is named
    as the first overflow, its inputs finite."""
    import ditorch.sim

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64).to(sim)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    x = torch.randn(8, 64, device=sim)
    with op_tools.OpOverflowCheck() as tool:
        for i in range(3):
            with ditorch.sim.faults("_foreach_addcdiv_:nan" if i == 2 else ""):
                model(x).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
    assert tool.found().startswith("first inf/nan from finite inputs: torch._foreach_addcdiv_ (forward)"), tool.found()


def test_a_nan_born_in_a_sparse_result_is_named_at_its_op(sim, logged):
    # A sparse tensor is checked through its values (its implicit zeros are finite). Before, sparse tensors were not
    # checked: the nan log1p made was first seen by to_dense, which was blamed.
    x = torch.full((4, 4), -2.0, device=sim)
    x[0, 0] = 0
    with op_tools.OpOverflowCheck() as check:
        values = torch.log1p(x.to_sparse())
        values.to_dense().sum()
    assert (check.first_overflow.name, check.first_overflow.phase) == ("torch.log1p", "forward")
    assert "output[0] (sparse values)" in logged() and "input[0] (sparse values)" in logged()


def test_a_sparse_gradient_is_checked_in_its_values(sim, logged, monkeypatch):
    monkeypatch.setenv("OP_TOOLS_VERBOSE", "1")
    embedding = torch.nn.Embedding(10, 4, sparse=True).to(sim)
    with op_tools.OpOverflowCheck() as check:
        embedding(torch.tensor([1, 2, 2], device=sim)).sum().backward()
    assert embedding.weight.grad.layout == torch.sparse_coo and check.first_overflow is None
    assert "grad_inputs[0] (sparse values)" in logged()  # its backward's table: the weight's gradient, checked


def test_what_holds_inf_or_nan_in_a_sparse_tensor_is_its_values():
    from op_tools.tools.overflow_check import held

    dense = torch.tensor([[0.0, 1.0], [float("nan"), 0.0]])
    uncoalesced = torch.sparse_coo_tensor(torch.tensor([[0, 0], [1, 1]]), torch.tensor([1.0, float("inf")]), (2, 2),
                                          check_invariants=True)
    views: dict = {}
    assert torch.equal(held(uncoalesced, views), torch.tensor([1.0, float("inf")]))
    assert held(uncoalesced, views) is held(uncoalesced, views)  # the same view for the same tensor in a call
    assert held(dense.to_sparse_csr()).isnan().tolist() == [False, True]  # a compressed layout's values
    assert held(dense) is dense


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_inf_or_nan_in_the_programs_data_is_said_where_it_came_in_and_no_op_is_blamed(sim, value):
    # Before, the backward of a call that read the data was blamed (square's, whose saved input held the inf/nan):
    # its gradients were its only inputs. A forward whose tensors held a nan, or whose outputs held an inf, now
    # brings it to its backward; and a run that held inf/nan no call made says where it came in.
    layer = torch.nn.Linear(4, 1).to(sim)
    batch = torch.randn(3, 4)
    batch[1, 2] = float(value)
    with op_tools.OpOverflowCheck() as check:
        layer(batch.to(sim)).square().mean().backward()
    assert check.first_overflow is None
    seen = check.first_seen
    assert (seen.name, seen.phase) == ("torch.Tensor.to", "forward")
    line = check.closing_line()
    assert f"torch.Tensor.to (forward) forward_id: {seen.forward_id} read {'a nan' if value == 'nan' else 'an inf'}"\
        " first, from outside the calls checked" in line and "no inf/nan from finite inputs" not in line


def test_a_masks_inf_is_read_by_design_and_an_overflow_in_the_backward_after_it_is_still_found(sim):
    # softmax reads the mask's -inf (put there by masked_fill's scalar): a clean run says nothing more; its backward
    # reads its finite output, so an inf there (an fp16 overflow) is the backward's own.
    import ditorch.sim

    scores = torch.randn(4, 4, device=sim, requires_grad=True)
    mask = torch.ones(4, 4, dtype=torch.bool, device=sim).triu(1)

    def attend():
        return torch.softmax(scores.masked_fill(mask, float("-inf")), -1).square().sum().backward()

    with op_tools.OpOverflowCheck() as check:
        attend()
    assert check.first_overflow is None and check.first_seen is None
    assert check.closing_line().endswith("no inf/nan from finite inputs")
    with ditorch.sim.faults("_softmax_backward_data:inf"), op_tools.OpOverflowCheck() as check:
        attend()
    assert (check.first_overflow.name, check.first_overflow.phase) == ("torch.softmax", "backward")


def test_an_overflow_in_a_complex_product_is_named_at_the_product(sim):
    # A complex tensor is checked as reals (a rotary embedding's complex product, an FFT). Before, complex tensors were
    # not checked: the view_as_real after the product was blamed.
    x = torch.randn(4, 8, 2, device=sim)
    scale = torch.polar(torch.full((4, 8), 1e30, device=sim), torch.zeros(4, 8, device=sim))  # finite
    with op_tools.OpOverflowCheck() as check:
        product = torch.view_as_complex(x) * scale
        torch.view_as_real(product * scale).sum()  # 1e60: inf in float32
    found = check.first_overflow
    assert found.name == "torch.Tensor.mul" and "torch.view_as_real(product * scale)" in found.location, found


def test_an_fft_whose_result_is_a_conjugate_view_is_checked(sim):
    # ifft of a real tensor returns a conjugate view: on sim every such call was counted not checked (the tool's read
    # of it failed) until sim's tensors carried the bit, as a device's do
    import ditorch.sim

    x = torch.randn(64).to(sim)
    with op_tools.OpOverflowCheck() as check:
        torch.fft.ifft(x)
    assert check.verdict() == "clean", check.not_checked()
    with ditorch.sim.faults("_fft_r2c:inf"), op_tools.OpOverflowCheck() as check:
        torch.fft.ifft(x)
    assert check.first_overflow is not None and check.first_overflow.name == "torch.fft.ifft", check.found()


def test_a_complex_tensor_and_its_conjugate_view_are_read_as_their_reals():
    from op_tools.tools.overflow_check import held

    z = torch.tensor([1 + 2j, float("nan") + 0j])
    assert held(z).tolist()[0] == [1.0, 2.0] and held(z).isnan().any()
    assert held(z.conj()).isnan().any() and held(z.conj()).shape == (2, 2)  # the base's memory: the same inf/nan


def test_a_backward_overflow_is_stamped_with_the_time_its_backward_ran(sim):
    # stamped with its forward's start, a backward overflow came before an earlier forward anomaly in the run report
    import time

    import ditorch.sim

    x = torch.randn(8, device=sim, requires_grad=True)
    with ditorch.sim.faults("gelu_backward:nan"), op_tools.OpOverflowCheck() as check:
        y = torch.nn.functional.gelu(x).sum()
        forward_done = time.time()
        time.sleep(0.05)
        y.backward()
    first = check.first_overflow
    assert first is not None and first.phase == "backward" and first.time > forward_done


def train_amp(device: str, iterations: int = 3, init_scale: float = 65536.0, blow_up: tuple = (),
              faults: dict | None = None, backward_faults: dict | None = None) -> list[float]:
    """float16 autocast with a real GradScaler (unscale_, clip_grad_norm_, step, update), as a recipe writes it;
    the loss of the iterations in ``blow_up`` multiplied by 1e30 (its scaled backward overflows in float16), the sim
    faults of ``faults`` on for the forward of an iteration, those of ``backward_faults`` for its backward. The
    scale after each iteration."""
    import ditorch.sim

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 10)).to(device)
    x, y = torch.randn(8, 16, device=device), torch.randint(0, 10, (8,), device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(device, init_scale=init_scale)
    scales = []
    for i in range(iterations):
        with ditorch.sim.faults((faults or {}).get(i, "")), torch.autocast(device, dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y) * (1e30 if i in blow_up else 1.0)
        with ditorch.sim.faults((backward_faults or {}).get(i, "")):
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # inf gradients times 0: nan, the scale's too
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        scales.append(scaler.get_scale())
    return scales


def test_an_iteration_gradscaler_skipped_for_its_scaled_overflow_is_no_finding_and_is_said(sim, logged):
    # The scaled backward overflowing in float16 is GradScaler's design: it skips the step and halves the scale.
    import json
    import os

    with op_tools.OpOverflowCheck() as check:
        scales = train_amp(sim, blow_up=(1,))
    assert scales == [65536.0, 32768.0, 32768.0]  # iteration 1 skipped
    assert check.first_overflow is None and check.first_seen is None and check.verdict() == "clean"
    (skipped,) = check.loss_scale_overflows
    assert (skipped["iteration"], skipped["scale"], skipped["new_scale"]) == (1, 65536.0, 32768.0)
    assert (skipped["op"], skipped["phase"]) == ("torch.nn.functional.cross_entropy", "backward")
    line = check.closing_line()
    assert "no inf/nan from finite inputs" in line and "1 loss-scale overflow, no finding" in line
    assert "scale 65536 -> 32768 in iteration 1: torch.nn.functional.cross_entropy (backward)" in line
    from op_tools.output import reporting

    assert "loss-scale overflow, no finding: torch.nn.functional.cross_entropy (backward)" in \
        reporting.unwrapped(logged())
    folder = os.path.join(os.environ["OP_TOOLS_RESULTS_DIR"], "op_overflow_check_result")
    (name,) = os.listdir(folder)  # no overflow file: the run report finds no anomaly
    assert name.startswith("loss_scale_overflows_")
    with open(os.path.join(folder, name)) as f:
        assert json.load(f)["iterations"][0]["new_scale"] == 32768.0


@pytest.mark.parametrize("where", ["forward of the next iteration", "forward of the skipped iteration"])
def test_an_overflow_outside_the_scaled_gradients_is_still_found_first(sim, where):
    faults = {2: "gelu:nan"} if where.endswith("next iteration") else {1: "gelu:nan"}
    with op_tools.OpOverflowCheck() as check:
        train_amp(sim, blow_up=(1,), faults=faults)
    first = check.first_overflow
    assert (first.name, first.phase) == ("torch.nn.functional.gelu", "forward")
    assert check.verdict() == "found"
    assert len(check.loss_scale_overflows) == (1 if where.endswith("next iteration") else 0)


def test_an_overflow_born_after_the_gradients_were_unscaled_is_a_finding_in_a_skipped_iteration(sim):
    # GradScaler computed its flags in unscale_, before this op, on gradients it then made small: no scale made what
    # an op born after it overflows (a user's metric between unscale_ and update), whatever GradScaler skips
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 10).to(sim)
    x, y = torch.randn(8, 16, device=sim), torch.randint(0, 10, (8,), device=sim)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(sim)
    metric = torch.full((4,), 1e30, device=sim)
    with op_tools.OpOverflowCheck() as check:
        with torch.autocast(sim, dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y) * 1e30
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        metric * 1e30  # finite inputs, inf out: born here
        scaler.step(optimizer)
        scaler.update()
    assert len(check.loss_scale_overflows) == 1
    first = check.first_overflow
    assert first is not None and (first.name, first.phase) == ("torch.Tensor.mul", "forward"), first
    assert check.verdict() == "found"


def test_through_apply_feature_an_iteration_gradscaler_skipped_is_no_finding_either(sim):
    # apply_feature's tool is never started: it heard no GradScaler call, and the skip was its first overflow
    from op_tools.core import features, loss_scaling

    op_tools.apply_feature("torch.nn.functional.cross_entropy", "overflow_check")
    tool = features._patched["torch.nn.functional.cross_entropy"][4]
    try:
        train_amp(sim, blow_up=(1,))
    finally:
        op_tools.remove_feature("torch.nn.functional.cross_entropy")
    assert len(tool.loss_scale_overflows) == 1 and tool.first_overflow is None and tool.first_seen is None
    assert tool not in loss_scaling._listeners  # finished at remove_feature: no longer told


def test_data_bringing_a_nan_after_a_held_loss_scale_overflow_is_still_first_seen(sim):
    # gradient accumulation: micro-batch 1's scaled backward overflows (GradScaler skips the iteration), micro-batch
    # 2's data holds a nan no call made; the skip excuses the first, not the second
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 10).to(sim)
    x, y = torch.randn(8, 16, device=sim), torch.randint(0, 10, (8,), device=sim)
    bad = x.clone()
    bad[0, 0] = float("nan")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(sim)
    with op_tools.OpOverflowCheck() as check:
        for inputs, factor in ((x, 1e30), (bad, 1.0)):
            with torch.autocast(sim, dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(inputs), y) * factor
            scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    assert len(check.loss_scale_overflows) == 1
    assert check.first_overflow is None
    assert check.first_seen is not None and (check.first_seen.name, check.first_seen.phase) == \
        ("torch.nn.functional.linear", "forward")
    assert check.verdict() != "clean"


def test_a_tool_started_on_two_threads_counts_each_gradscaler_iteration_once(sim):
    import threading

    check = op_tools.OpOverflowCheck()
    started, finished = threading.Event(), threading.Event()

    def other_thread():
        check.start()
        started.set()
        finished.wait()
        check.stop()

    thread = threading.Thread(target=other_thread)
    thread.start()
    started.wait()
    try:
        with check:
            train_amp(sim, blow_up=(1,))
    finally:
        finished.set()
        thread.join()
    assert [o["iteration"] for o in check.loss_scale_overflows] == [1]


@pytest.mark.parametrize("init_scale", [1.0, 0.5])
def test_a_backward_overflow_at_a_scale_of_one_or_less_is_a_finding(sim, init_scale):
    # scaling by 1 or less makes no overflow the unscaled backward would not have: GradScaler skipping it is no excuse
    with op_tools.OpOverflowCheck() as check:
        scales = train_amp(sim, init_scale=init_scale, blow_up=(1,))
    assert scales[:2] == [init_scale, init_scale / 2]  # iteration 1 skipped: GradScaler halved the scale
    first = check.first_overflow
    assert (first.name, first.phase) == ("torch.nn.functional.cross_entropy", "backward")
    assert check.loss_scale_overflows == []


def test_a_nan_from_finite_inputs_in_a_scaled_backward_is_a_finding(sim):
    # a scale makes finite values larger: an inf first, a nan only from infs; a nan from finite inputs is the op's
    with op_tools.OpOverflowCheck() as check:
        scales = train_amp(sim, backward_faults={1: "gelu_backward:nan"})
    assert scales == [65536.0, 32768.0, 32768.0]  # GradScaler skipped it too
    assert (check.first_overflow.name, check.first_overflow.phase) == ("torch.nn.functional.gelu", "backward")
    assert check.loss_scale_overflows == []


def test_a_backward_overflow_without_gradscaler_is_a_finding_as_before(sim):
    model = torch.nn.Linear(4, 3).to(sim)
    x, y = torch.randn(2, 4, device=sim), torch.tensor([0, 1], device=sim)
    with op_tools.OpOverflowCheck() as check:
        with torch.autocast(sim, dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y) * 1e30
        loss.backward()
    assert (check.first_overflow.name, check.first_overflow.phase) == ("torch.nn.functional.cross_entropy",
                                                                       "backward")


def test_raise_mode_goes_on_past_a_skipped_iteration_and_raises_at_a_real_overflow(sim, monkeypatch):
    monkeypatch.setenv("OP_OVERFLOW_CHECK_RAISE", "1")
    with op_tools.OpOverflowCheck() as check:
        train_amp(sim, iterations=3, blow_up=(0,))
    assert check.first_overflow is None and len(check.loss_scale_overflows) == 1
    with op_tools.OpOverflowCheck() as check:  # a fault in the forward after it: raised at its op
        with pytest.raises(op_tools.OverflowDetectedError, match="torch.nn.functional.gelu"):
            train_amp(sim, iterations=3, blow_up=(0,), faults={1: "gelu:nan"})


def test_raise_mode_raises_a_backward_overflow_gradscaler_does_not_excuse_at_its_update(sim, monkeypatch):
    monkeypatch.setenv("OP_OVERFLOW_CHECK_RAISE", "1")
    with op_tools.OpOverflowCheck():
        with pytest.raises(op_tools.OverflowDetectedError, match="cross_entropy") as raised:
            train_amp(sim, init_scale=1.0, blow_up=(1,))
    assert any(frame.name == "update" for frame in raised.traceback)  # known at scaler.update(), raised there


@pytest.mark.parametrize("blow_up", [(), (1,)])
def test_gradscaler_iterations_add_no_host_synchronisation(sim, blow_up):
    # found_inf and the scale travel with the flags: a skipped iteration costs no synchronisation of its own
    plain = charged(lambda: train_amp(sim, iterations=4, blow_up=blow_up))
    check = op_tools.OpOverflowCheck()

    def checked():
        with check:
            train_amp(sim, iterations=4, blow_up=blow_up)

    counts = charged(checked)
    assert check.first_overflow is None and len(check.loss_scale_overflows) == len(blow_up)
    assert counts.synchronizations - plain.synchronizations == 1  # the stop's


@pytest.mark.parametrize("order", ["monitor stops first", "check stops first"])
def test_with_training_monitor_patching_gradscaler_too_each_iteration_is_told_once(sim, tmp_path, order):
    # TrainingMonitor patches GradScaler.scale and update as well, and puts back what it found when it stops
    from torch.amp import GradScaler

    originals = {name: vars(GradScaler)[name] for name in ("scale", "unscale_", "update")}
    monitor = op_tools.TrainingMonitor(results_dir=str(tmp_path), tensorboard=False, html=False)
    check = op_tools.OpOverflowCheck()
    if order == "monitor stops first":
        check.start()
        monitor.start()
        train_amp(sim, blow_up=(1,))
        monitor.stop()
        check.stop()
    else:
        monitor.start()
        check.start()
        train_amp(sim, blow_up=(1,))
        check.stop()
        monitor.stop()
    assert monitor.skipped_iterations == 1 and len(check.loss_scale_overflows) == 1 and check.verdict() == "clean"
    with op_tools.OpOverflowCheck() as again:  # whatever was left in place tells each iteration once
        train_amp(sim, blow_up=(1,))
    assert len(again.loss_scale_overflows) == 1 and again.verdict() == "clean"
    for name, original in originals.items():  # put back, or a wrapper passing calls through
        method = vars(GradScaler)[name]
        assert method is original or getattr(method, "_op_tools_loss_scaling", False)


@pytest.mark.parametrize("device_memory", [False, True])
def test_on_an_asynchronous_device_the_loss_scale_overflow_is_told_apart_from_a_fault_after_it(sim, device_memory):
    # GradScaler's values arrive with the flags, 200 kernels late (read early they would be NaN); on a GPU's memory
    # each call's tensors are reduced by one fused _foreach_norm
    import ditorch.sim

    with ditorch.sim.device_memory(device_memory), ditorch.sim.asynchronous(lag=200):
        with op_tools.OpOverflowCheck() as clean:
            train_amp(sim, iterations=4, blow_up=(0, 2))
        with op_tools.OpOverflowCheck() as faulty:
            train_amp(sim, iterations=4, blow_up=(0, 2), faults={3: "gelu:inf"})
    assert clean.verdict() == "clean" and [o["iteration"] for o in clean.loss_scale_overflows] == [0, 2]
    assert [o["scale"] for o in clean.loss_scale_overflows] == [65536.0, 32768.0]
    assert (faulty.first_overflow.name, faulty.first_overflow.phase) == ("torch.nn.functional.gelu", "forward")
    assert len(faulty.loss_scale_overflows) == 2


def test_results_no_op_made_are_counted_skipped_with_why_as_autocompare_counts_them(sim):
    # memory never written (empty, resize_ growing a tensor) and the program's own data hold whatever they hold: no
    # op made an inf there, so none is judged; they were passed over uncounted, where OpAutoCompare counts its skips
    import ditorch.sim

    with ditorch.sim.faults("empty:inf;resize_:inf"), op_tools.OpOverflowCheck() as check:
        x = torch.empty(8, device=sim)
        x.resize_(16)
        torch.tensor([1.0, float("inf")], device=sim)
    assert check.verdict() == "clean" and check.first_overflow is None
    assert check.skipped == {"uninitialised": 2, "the program's own data": 1}, check.skipped


def test_a_gradient_sum_autograd_makes_overflowing_is_named_among_the_causes_of_an_inf_no_call_made(sim):
    # y read by two calls: each sends it a finite float16 gradient, 40000, and autograd's sum of them, 80000, is
    # inf. No call made it; the closing line named the program's data, a call not handled or a write as the causes
    x = torch.full((8,), 1.0, dtype=torch.float16).to(sim).requires_grad_()
    with op_tools.OpOverflowCheck() as check:
        y = x * 2.0
        (y * 1.0 + y * 1.0).backward(torch.full((8,), 40000.0, dtype=torch.float16).to(sim))
    assert check.first_overflow is None and check.first_seen is not None and check.first_seen.phase == "backward"
    assert "autograd's sum of the gradients several calls sent one tensor" in check.closing_line()


def test_views_that_compute_nothing_are_not_handled_and_what_they_pass_on_is_judged_where_it_is_read(sim):
    # A transpose, a view, an unsqueeze make no value, forward or backward (op_facts' ``alias_only``): not handled, as
    # a metadata query is not (an eighth of a Llama's calls). Reading bits as another dtype makes a nan no call made:
    # the call reading it says so, and the verdict is not clean.
    x = torch.randn(4, 8, device=sim, requires_grad=True)
    bits = torch.full((4,), 0x7E00, dtype=torch.int16, device=sim)  # float16's nan, as int16
    with op_tools.OpOverflowCheck() as check:
        (x * 2).view(8, 4).transpose(0, 1).unsqueeze(0).sum().backward()
        bits.view(torch.float16) + 1
    assert not {"torch.Tensor.transpose", "torch.Tensor.unsqueeze", "torch.Tensor.view"} & set(check.handled)
    assert check.handled["torch.Tensor.mul"] == 1 and check.first_overflow is None
    assert check.first_seen is not None and check.first_seen.name == "torch.Tensor.add"
    assert "read a nan first, from outside the calls checked" in check.closing_line()
    with op_tools.OpOverflowCheck(ops="torch.Tensor.transpose") as listed:  # asked for by name: handled
        x.transpose(0, 1)
    assert listed.handled["torch.Tensor.transpose"] == 1
    op_tools.apply_feature("torch.Tensor.transpose", "overflow_check")
    try:
        x.transpose(0, 1)
        applied = op_tools.core.features._patched["torch.Tensor.transpose"][4]
    finally:
        op_tools.remove_feature("torch.Tensor.transpose")
    assert applied.handled["torch.Tensor.transpose"] == 1


def test_cpu_calls_are_flagged_by_each_tensors_minimum_and_maximum(monkeypatch):
    # On the CPU an op costs about a microsecond, and vector_norm(inf), which _foreach_norm runs there per tensor,
    # costs four aminmax: each tensor is flagged by its minimum and maximum (both propagate nan), the flags of what an
    # in-place op writes read at once before it runs.
    def refused(*args, **kwargs):
        raise AssertionError("_foreach_norm on the CPU")

    monkeypatch.setattr(torch, "_foreach_norm", refused)
    check = op_tools.OpOverflowCheck()
    check.handles_cpu_calls = True
    x = torch.tensor([1e30, -2.0])
    w = torch.tensor([1.0, float("nan")], dtype=torch.float16)
    with check:
        x.clone().mul_(2.0)
        w.add_(1.0)  # a nan in, the same nan out: read first here, made by no call checked
        x * x  # 1e60: an inf from finite inputs
    assert check.first_overflow is not None and check.first_overflow.name == "torch.Tensor.mul"
    assert not check.not_checked(), check.not_checked()


class _NanBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        return a * 2

    @staticmethod
    def backward(ctx, g):
        return g * float("nan")  # a nan from finite gradients, where no tool sees it


def test_a_nan_born_in_a_custom_functions_backward_is_named_at_the_function(sim, logged):
    x = torch.randn(4, device=sim, requires_grad=True)
    w = torch.randn(4, device=sim, requires_grad=True)
    with op_tools.OpOverflowCheck() as check:
        (_NanBackward.apply(w) * x).sum().backward()
    assert w.grad.isnan().all()
    found = check.first_overflow
    assert found is not None and (found.name, found.phase) == ("autograd.Function _NanBackward", "backward")
    assert "_NanBackward.apply(w) * x" in found.location  # the line of the call that read its result
    assert check.verdict() == "found"


def test_a_nan_born_in_a_reentrant_checkpoints_backward_is_named_at_the_checkpoint_and_its_module(sim):
    # The recomputation and its backward run inside the checkpoint's node, on autograd's thread: no tool sees their
    # calls (they said nothing: a clean verdict over nan gradients). Its node is checked as one call.
    from torch.utils.checkpoint import checkpoint

    import ditorch.sim

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()),
                                torch.nn.Linear(8, 8)).to(sim)
    x = torch.randn(4, 8, device=sim, requires_grad=True)

    def forward():
        return model[2](checkpoint(model[1], model[0](x), use_reentrant=True))

    with ditorch.sim.faults("atan2:nan"), op_tools.OpOverflowCheck() as check:  # clean: said checked whole
        model(x)  # names the modules
        forward().pow(2).mean().backward()
    assert check.first_overflow is None and check.verdict() == "clean"
    assert "custom autograd.Function checked whole (CheckpointFunction" in check.closing_line()
    with ditorch.sim.faults("gelu_backward:nan"), op_tools.OpOverflowCheck() as check:
        model(x)
        forward().pow(2).mean().backward()
    assert x.grad.isnan().any()
    found = check.first_overflow
    assert found is not None and (found.name, found.phase, found.module) == (
        "autograd.Function CheckpointFunction", "backward", "1")


def test_a_reentrant_checkpoint_of_a_function_given_its_module_first_names_that_module():
    # transformers' GradientCheckpointingLayer checkpoints partial(forward, self, **kwargs)
    import functools

    from torch.utils.checkpoint import checkpoint

    from op_tools.ops.custom_functions import checkpointed_module

    layer = torch.nn.Linear(2, 2)
    for run in (layer, layer.__call__, functools.partial(torch.nn.Linear.forward, layer),
                functools.partial(functools.partial(layer.__call__))):
        y = checkpoint(run, torch.ones(1, 2, requires_grad=True), use_reentrant=True)
        assert checkpointed_module(y.grad_fn) is layer, run


@pytest.mark.parametrize("hand_back", ["to", "contiguous"])
def test_a_call_handing_its_input_back_is_not_named_for_the_backward_before_it(sim, hand_back):
    # x.to(x.dtype), x.contiguous(): x itself, computed nothing; it was named for the custom Function's nan
    x = torch.randn(4, 8, device=sim, requires_grad=True)
    with op_tools.OpOverflowCheck() as check:
        h = _NanBackward.apply(x * 2)
        y = h.to(torch.float32) if hand_back == "to" else h.contiguous()
        assert y is h
        (y * 3).sum().backward()
    assert (check.first_overflow.name, check.first_overflow.phase) == ("autograd.Function _NanBackward", "backward")


@pytest.mark.parametrize("fault", ["gelu:nan", "gelu_backward:nan"])
def test_raise_mode_shows_the_statistics_of_the_call_it_raises_at(sim, monkeypatch, logged, fault):
    # the table beside the raise: every cell was "not kept", under a note recommending the setting in use
    import ditorch.sim

    monkeypatch.setenv("OP_OVERFLOW_CHECK_RAISE", "1")
    x = torch.full((4,), 0.5, device=sim, requires_grad=True)
    with ditorch.sim.faults(fault), pytest.raises(op_tools.OverflowDetectedError):
        with op_tools.OpOverflowCheck():
            torch.nn.functional.gelu(x).sum().backward()
    out = logged()
    assert "not kept" not in out and "OP_OVERFLOW_CHECK_RAISE=1" not in out
    assert "|  input[0] |   False    | 0.5 | 0.5 |" in out if fault == "gelu:nan" else \
        "| grad_outputs[0] |   False    |  1  |  1  |" in out


@pytest.mark.parametrize("mode", ["batched", "raise", "tables"])
def test_the_input_an_in_place_op_overwrote_shows_its_flag_from_before_the_call_not_what_it_wrote(
        sim, monkeypatch, logged, mode):
    # "from finite inputs" above a table whose input[0] read inf: its statistics were taken after the op wrote it
    import ditorch.sim

    if mode == "raise":
        monkeypatch.setenv("OP_OVERFLOW_CHECK_RAISE", "1")
    elif mode == "tables":
        monkeypatch.setenv("OP_TOOLS_VERBOSE", "1")
    y = torch.ones(16, device=sim)
    with ditorch.sim.faults("mul_:inf"), op_tools.OpOverflowCheck() as check:
        try:
            y.mul_(2.0)
        except op_tools.OverflowDetectedError:
            assert mode == "raise"
    assert check.first_overflow.name == "torch.Tensor.mul_"
    found = logged().split("OpOverflowCheck: first inf/nan from finite inputs: torch.Tensor.mul_")[1]
    assert "|  input[0] |   False    | overwritten |" in found and "| output[0] |    True    |" in found
    assert "(overwritten: an input this call wrote in place; its inf_or_nan was read before the call" in found
    assert "|    True    |   inf" not in found.split("output[0]")[0]  # the written input's values: not shown
