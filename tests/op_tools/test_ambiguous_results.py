"""Results with more than one right answer: a device's kernel that makes the other choice (tied elements in another
order, an eigenvector of the other sign) passes, and one that gives a wrong answer is still found. Each sim kernel
here replaces the device's with one returning another valid (or a wrong) answer."""

import math
import os

import pytest
import torch

import op_tools

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _in_tmp(monkeypatch, tmp_path):
    for name in list(os.environ):
        if "AUTOCOMPARE" in name or name.endswith("_OP_DTYPE_CAST_DICT"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def kernels(monkeypatch):
    """``kernels(overload, fn)``: the sim device runs ``fn`` for ``overload`` for the test's length."""
    import ditorch.sim.kernels as sim_kernels

    return lambda op, fn: monkeypatch.setitem(sim_kernels.KERNELS, op, fn)


def compared(fn):
    with op_tools.OpAutoCompare() as tool:
        fn()
    return tool


def failing_ops(tool) -> list:
    return [(f["op"], f["phase"]) for f in tool.failures]


def _ties(sim):
    torch.manual_seed(0)
    return torch.randint(0, 4, (8, 16)).float().to(sim)  # many equal elements in each row


def _ties_reversed_sort(x, dim=-1, descending=False):
    values, indices = aten.sort.default(x.flip(dim), dim, descending)
    return values, x.shape[dim] - 1 - indices


def _ties_reversed_topk(x, k, dim=-1, largest=True, sorted=True):  # noqa: A002 - topk's own argument name
    values, indices = aten.topk.default(x.flip(dim), k, dim, largest, sorted)
    return values, x.shape[dim] - 1 - indices


def _swapped_ends(indices: torch.Tensor) -> torch.Tensor:
    """The first and last index of each row swapped: each then picks another value than the one beside it."""
    wrong = indices.clone()
    wrong[..., 0], wrong[..., -1] = indices[..., -1], indices[..., 0]
    return wrong


# --- indices of equal elements ---

def test_a_sort_returning_equal_elements_in_another_order_passes(sim, kernels):
    kernels(aten.sort.default, _ties_reversed_sort)
    x = _ties(sim)
    tool = compared(lambda: (torch.sort(x, dim=1), torch.sort(x, dim=1, descending=True), x.sort(dim=0),
                             torch.argsort(x, dim=1)))
    assert tool.failures == []
    assert tool.counts["forward passed"] == 4


def test_the_gradient_of_a_sort_with_ties_in_another_order_goes_where_the_device_sent_it(sim, kernels):
    kernels(aten.sort.default, _ties_reversed_sort)
    x = _ties(sim).requires_grad_()
    weights = torch.arange(16.0).to(sim)  # a different upstream for each position: ties' gradients differ

    def step():
        values, _ = torch.sort(x, dim=1)
        (values * weights).sum().backward()

    tool = compared(step)
    assert tool.failures == []
    assert tool.counts["backward passed"] >= 1


def test_a_captured_sort_with_ties_in_another_order_replays_ok_and_a_wrong_index_mismatches(sim, kernels,
                                                                                          tmp_path):
    # the offline replay's float64 reference takes the device's valid choice too, forward and backward
    from op_tools.offline.replay import ReplayOptions, find_entries, replay

    kernels(aten.sort.default, _ties_reversed_sort)
    x = _ties(sim).requires_grad_()
    weights = torch.arange(16.0).to(sim)
    with op_tools.OpCapture(results_dir=str(tmp_path / "capture")):
        values, _ = torch.sort(x, dim=1)
        (values * weights).sum().backward()
    (entry,) = [e for e in find_entries(str(tmp_path / "capture")) if "sort" in e.label]
    replayed = replay(entry, sim, ReplayOptions(acc_check=True, backward=True))
    assert replayed.status == "ok", replayed.checks
    assert [c["check"] for c in replayed.checks][:2] == ["output vs cpu float64", "grad vs cpu float64"]
    kernels(aten.sort.default, lambda x, dim=-1, descending=False: (
        lambda values, indices: (values, _swapped_ends(indices)))(*_ties_reversed_sort(x, dim, descending)))
    assert replay(entry, sim, ReplayOptions(acc_check=True, backward=True)).status == "mismatch"


def test_a_stable_sort_must_still_keep_equal_elements_in_order(sim, kernels):
    kernels(aten.sort.stable, lambda x, *, stable=None, dim=-1, descending=False:
            _ties_reversed_sort(x, dim, descending))
    x = _ties(sim)
    tool = compared(lambda: torch.sort(x, dim=1, stable=True))
    assert failing_ops(tool) == [("torch.sort", "forward")]
    assert "must match exactly" in tool.failures[0]["error_info"]


def test_a_sort_index_that_picks_another_value_is_found(sim, kernels):
    kernels(aten.sort.default, lambda x, dim=-1, descending=False: (
        lambda values, indices: (values, _swapped_ends(indices)))(*aten.sort.default(x, dim, descending)))
    x = _ties(sim)
    tool = compared(lambda: torch.sort(x, dim=1))
    assert failing_ops(tool) == [("torch.sort", "forward")]
    assert "pick other values than its own" in tool.failures[0]["error_info"]


def test_a_topk_returning_equal_elements_in_another_order_passes(sim, kernels):
    kernels(aten.topk.default, _ties_reversed_topk)
    x = _ties(sim)
    tool = compared(lambda: (torch.topk(x, 3, dim=1), x.topk(5, dim=1, largest=False)))
    assert tool.failures == []


def test_a_topk_index_that_picks_another_value_is_found(sim, kernels):
    kernels(aten.topk.default, lambda x, k, dim=-1, largest=True, sorted=True: (  # noqa: A006 - topk's argument
        lambda values, indices: (values, _swapped_ends(indices)))(*aten.topk.default(x, k, dim, largest, sorted)))
    torch.manual_seed(1)
    x = torch.randn(8, 16).to(sim)  # no ties: every index names one value
    tool = compared(lambda: torch.topk(x, 3, dim=1))
    assert failing_ops(tool) == [("torch.topk", "forward")]


def test_a_kthvalue_picking_another_of_equal_elements_passes(sim, kernels):
    def last_of_equals(x, k, dim=-1, keepdim=False):
        values, indices = aten.kthvalue.default(x.flip(dim), k, dim, keepdim)
        return values, x.shape[dim] - 1 - indices

    kernels(aten.kthvalue.default, last_of_equals)
    x = _ties(sim)
    tool = compared(lambda: (torch.kthvalue(x, 5, dim=1), torch.kthvalue(x, 2, 0, True)))
    assert tool.failures == []


# --- eigenvectors and singular vectors: free up to a sign ---

def _symmetric(sim, n=6, seed=0):
    torch.manual_seed(seed)
    a = torch.randn(n, n)
    return (a @ a.T + 0.1 * torch.eye(n)).to(sim)


def _other_signs(vectors: torch.Tensor) -> torch.Tensor:
    signs = torch.tensor([(-1.0) ** (i + 1) for i in range(vectors.shape[-1])], dtype=vectors.dtype)
    return vectors * signs  # every other vector the other way round


def _noise(t: torch.Tensor) -> torch.Tensor:
    """1e-3 of noise drawn from no generator (a kernel that draws is skipped as random)."""
    return 1e-3 * torch.linspace(-1, 1, t.numel(), dtype=t.dtype).reshape(t.shape).sin().mul(7).sin()


def _eigh_step(s: torch.Tensor):
    def step():
        w, v = torch.linalg.eigh(s)
        # sign-invariant, and not diagonal in the eigenbasis: the backward sees the vectors' signs
        (w.sum() + v.pow(4).sum()).backward()

    return step


@pytest.mark.parametrize("reference", ["cpu", "device"])
def test_eigenvectors_of_the_other_sign_pass_forward_and_backward(sim, kernels, reference):
    kernels(aten._linalg_eigh.default, lambda a, uplo="L", compute_v=True: (
        lambda w, v: (w, _other_signs(v)))(*aten._linalg_eigh.default(a, uplo, compute_v)))
    s = _symmetric(sim).requires_grad_()
    step = _eigh_step(s)
    with op_tools.OpAutoCompare(reference=reference) as tool:
        for _ in range(3):  # with the reference on the device, an op's first call is judged on the CPU, the next there
            step()
    assert tool.failures == []
    assert tool.counts["backward passed"] >= 3
    assert not tool.weak_passes  # the same-dtype run took the device's signs too: no order-1 error excused
    assert not tool.untrusted_here  # the device's float64 eigenvectors are no disagreement with the CPU's either


def test_eigenvectors_of_a_repeated_eigenvalue_in_another_basis_pass(sim, kernels):
    def turned(a, uplo="L", compute_v=True):
        w, v = aten._linalg_eigh.default(a, uplo, compute_v)
        c, s = math.cos(0.7), math.sin(0.7)
        turn = torch.eye(v.shape[-1], dtype=v.dtype)
        turn[:2, :2] = torch.tensor([[c, -s], [s, c]], dtype=v.dtype)  # within the repeated eigenvalue's space
        return w, v @ turn

    kernels(aten._linalg_eigh.default, turned)
    torch.manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(5, 5, dtype=torch.float64))
    a = (q @ torch.diag(torch.tensor([1.0, 1.0, 2.0, 3.0, 5.0], dtype=torch.float64)) @ q.T).float().to(sim)
    tool = compared(lambda: torch.linalg.eigh(a))
    assert tool.failures == []
    assert not tool.weak_passes  # judged within a correct run's error of the basis it was turned to, not of order 1


def test_noise_in_eigenvectors_is_found(sim, kernels):
    def noisy(a, uplo="L", compute_v=True):
        w, v = aten._linalg_eigh.default(a, uplo, compute_v)
        return w, _other_signs(v) + _noise(v)

    kernels(aten._linalg_eigh.default, noisy)
    tool = compared(lambda: torch.linalg.eigh(_symmetric(sim)))
    assert failing_ops(tool) == [("torch.linalg.eigh", "forward")]
    assert tool.failures[0]["failing"] == "output[1]"


def _reordered_eig(turn_noise: bool = False):
    """linalg.eig's kernel giving the eigenpairs in reverse order, each vector turned by a phase of its own (another
    solver's valid choice); with ``turn_noise``, 1e-3 of noise in the vectors as well."""
    def kernel(a):
        w, v = aten.linalg_eig.default(a)
        n = w.shape[-1]
        phases = torch.polar(torch.ones(n, dtype=w.real.dtype), torch.linspace(0.3, 2.9, n, dtype=w.real.dtype))
        v = v.flip(-1) * phases
        return w.flip(-1), v + _noise(v.real).to(v.dtype) if turn_noise else v

    return kernel


def _eig_step(a: torch.Tensor):
    def step():
        w, v = torch.linalg.eig(a)
        # order- and phase-invariant, and the backward sees the vectors
        (w.abs().sum() + v.abs().pow(4).sum() + torch.linalg.eigvals(a).abs().sum()).backward()

    return step


def test_eigenpairs_in_another_order_and_phase_pass_forward_and_backward(sim, kernels):
    # LAPACK orders a general matrix's eigenvalues and turns its vectors one way, another solver another: each was a
    # failure, the eigenvalues "differing" by their whole spread
    kernels(aten.linalg_eig.default, _reordered_eig())
    torch.manual_seed(0)
    a = torch.randn(6, 6).to(sim).requires_grad_()
    tool = compared(_eig_step(a))
    assert tool.failures == []
    assert tool.counts["forward passed"] >= 2 and tool.counts["backward passed"] >= 2
    assert not tool.weak_passes


def test_noise_in_eigenpairs_in_another_order_is_found(sim, kernels):
    kernels(aten.linalg_eig.default, _reordered_eig(turn_noise=True))
    torch.manual_seed(0)
    tool = compared(lambda: torch.linalg.eig(torch.randn(6, 6).to(sim)))
    assert failing_ops(tool) == [("torch.linalg.eig", "forward")]
    assert tool.failures[0]["failing"] == "output[1]"


def test_singular_vectors_of_the_other_sign_pass_forward_and_backward(sim, kernels):
    kernels(aten._linalg_svd.default, lambda a, full_matrices=False, compute_uv=True, *, driver=None: (
        lambda u, s, vh: (_other_signs(u), s, _other_signs(vh.mT).mT))(
        *aten._linalg_svd.default(a, full_matrices, compute_uv, driver=driver)))
    torch.manual_seed(0)
    m = torch.randn(5, 4).to(sim).requires_grad_()

    def step():
        u, s, vh = torch.linalg.svd(m, full_matrices=False)
        u2, s2, v2 = torch.svd(m)
        (s.sum() + ((u * s) @ vh).square().sum() + (u2 * v2.sum(0)).sum()).backward()

    tool = compared(step)
    assert tool.failures == []
    assert tool.counts["forward passed"] >= 2


def test_noise_in_singular_vectors_is_found(sim, kernels):
    kernels(aten._linalg_svd.default, lambda a, full_matrices=False, compute_uv=True, *, driver=None: (
        lambda u, s, vh: (-u, s, -vh + _noise(vh)))(
        *aten._linalg_svd.default(a, full_matrices, compute_uv, driver=driver)))
    torch.manual_seed(0)
    m = torch.randn(5, 4).to(sim)
    tool = compared(lambda: torch.linalg.svd(m, full_matrices=False))
    assert failing_ops(tool) == [("torch.linalg.svd", "forward")]
    assert tool.failures[0]["failing"] == "output[2]"


def test_a_qr_with_other_column_signs_passes_and_a_q_without_its_r_is_found(sim, kernels):
    torch.manual_seed(0)
    a = torch.randn(6, 4).to(sim)

    def flipped(x, mode="reduced"):
        q, r = aten.linalg_qr.default(x, mode)
        return _other_signs(q), _other_signs(r.mT).mT  # the same QR: each column of Q and row of R turned together

    kernels(aten.linalg_qr.default, flipped)
    assert compared(lambda: torch.linalg.qr(a)).failures == []

    kernels(aten.linalg_qr.default, lambda x, mode="reduced": (
        lambda q, r: (_other_signs(q), r))(*aten.linalg_qr.default(x, mode)))  # Q R is no longer the input
    tool = compared(lambda: torch.linalg.qr(a))
    assert failing_ops(tool) == [("torch.linalg.qr", "forward")]
