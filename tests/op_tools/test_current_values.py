"""The room of the caches of values derived from tensors (``numerics/current_values.py``): what a step reuses stays,
what it freed makes room. OpAutoCompare's host copies live in one: a copy evicted is a tensor copied to the host
again."""

import gc

import pytest
import torch

from op_tools.numerics.current_values import CurrentValues, locate
from op_tools.numerics.host_copies import HostCopies


def test_the_least_recently_used_value_is_dropped_first():
    a, b, c, d, e = (torch.zeros(4) for _ in range(5))
    values = CurrentValues(16, 1000)  # room for four values of 250 bytes (a quarter of it at most each)
    for t, name in ((a, "a"), (b, "b"), (c, "c"), (d, "d")):
        values.put(locate(t), name, 250)
    assert values.find(locate(a)) == "a"  # used again: b is now the oldest in use
    values.put(locate(e), "e", 250)
    assert [values.find(locate(t)) for t in (a, b, c, d, e)] == ["a", None, "c", "d", "e"]


def test_a_freed_storage_makes_room_at_once():
    kept, freed, others = torch.zeros(4), torch.zeros(4), [torch.zeros(4), torch.zeros(4)]
    values = CurrentValues(16, 1000)
    values.put(locate(kept), "kept", 250)
    values.put(locate(freed), "freed", 250)
    for t in others:
        values.put(locate(t), "other", 250)
    del freed
    gc.collect()
    new = torch.zeros(4)
    values.put(locate(new), "new", 250)  # fits beside "kept", the oldest, only once the freed one's room is back
    assert values.find(locate(kept)) == "kept" and values.find(locate(new)) == "new"


def test_a_weight_copy_outlives_the_temporaries_copied_after_it(sim):
    # A step: a weight copied, then activations copied and freed, more than the cache holds, then the weight read
    # again: it is reused, not copied to the host a second time.
    copies = HostCopies()
    copies.MAX_BYTES = 1 << 20
    copies._values.max_bytes = copies.MAX_BYTES
    weight = torch.randn(128, 256, device="sim")  # 128 KiB
    copies.get(weight)
    for _ in range(40):  # 40 x 128 KiB of temporaries, each freed before the next
        temporary = torch.randn(128, 256, device="sim")
        copies.fresh(temporary)
        del temporary
    assert copies.get(weight)[1], "the weight's copy was evicted by temporaries already freed"


def test_a_result_that_is_its_input_and_a_gradient_given_twice_are_copied_once(sim, tmp_path):
    import op_tools

    x = torch.randn(64, 32, device=sim)
    a, b = (torch.randn(64, 32, device=sim, requires_grad=True) for _ in range(2))
    with op_tools.OpAutoCompare(results_dir=str(tmp_path)) as tool:
        before = torch.sim.device_counts()
        x.to(torch.float32).contiguous()  # each returns the tensor itself: x's copy serves both
        copied = torch.sim.device_counts() - before
        total = a + b
        upstream = torch.ones(64, 32, device=sim)
        before = torch.sim.device_counts()
        total.backward(upstream)  # add gives its upstream gradient to both inputs: the copy made of torch.ones' result
        backward = torch.sim.device_counts() - before
    assert tool.verdict() == "clean" and tool.counts["backward compared"] == 1, dict(tool.counts)
    assert copied.device_to_host_copies == 1, copied
    assert backward.device_to_host_copies == 0, backward


def test_a_gradient_a_backward_passes_on_from_the_cache_is_not_copied_again(sim, tmp_path):
    import op_tools

    a, b = (torch.randn(64, 32, device=sim, requires_grad=True) for _ in range(2))
    c = torch.randn(64, 32, device=sim)
    with op_tools.OpAutoCompare(results_dir=str(tmp_path)) as tool:
        total = (a + b) * c
        before = torch.sim.device_counts()
        # mul's backward gives a + b its gradient, copied as mul's result; add passes that gradient on to a and b,
        # and receives it from the cache: its copy serves add's comparison too
        total.backward(torch.ones(64, 32, device=sim))
        backward = torch.sim.device_counts() - before
    assert tool.verdict() == "clean" and tool.counts["backward compared"] == 2, dict(tool.counts)
    assert backward.device_to_host_copies == 2, backward  # mul's upstream gradient and the one it gives


@pytest.mark.parametrize("reference", ["cpu", "device"])
def test_a_tensor_passed_twice_is_one_leaf_of_the_reference_even_where_no_cache_keeps_it(sim, tmp_path, monkeypatch,
                                                                                          reference):
    # x * x: the device's gradient of x sums both uses. The cache used to make the two arguments one copy, but it
    # keeps no tensor over a quarter of its room (a 128 MB activation on a GPU), nor a DTensor, and the float64
    # copies on the device were never cached: two leaves, half the gradient, a false failure.
    import op_tools

    monkeypatch.setattr(HostCopies, "MAX_BYTES", 1024)  # x (4 KB) is then too big to be kept, as 128 MB is
    x = torch.randn(1000, device=sim, requires_grad=True)
    with op_tools.OpAutoCompare(results_dir=str(tmp_path), reference=reference) as tool:
        (x * x).sum().backward()
    assert tool.verdict() == "clean", tool.failures
    assert tool.counts["backward compared"] == 2, dict(tool.counts)  # sum's and mul's
