"""Results a correct kernel may choose among: the order of tied elements a sort or top-k returns, an eigenvector's
sign (or, for a repeated eigenvalue, its eigenspace's basis), a singular vector pair's, a QR factor's column signs.

The CPU's kernels make one choice and a GPU's (CUDA's sort and top-k, cuSOLVER) another, both right; compared
element by element, the other choice failed ("torch.int64 values differ at 114 of 128 elements (must match
exactly)", an eigenvector off by 2). ``adopt_choices(op_name, chosen, run)`` makes a CPU run (the float64 reference,
a same-dtype run) take ``chosen``'s choices (the device's result, or a reference that took them) where they are
valid for the run's own input, so the comparison then judges what the op defines and nothing else::

    >>> notes = adopt_choices("torch.sort", device_result, reference)   # doctest: +SKIP
    >>> notes                                                           # doctest: +SKIP
    {1: 'indices of equal elements in another order than the CPU's: each picks the value it sits beside'}

* indices (``sort`` unless ``stable=True``, ``argsort``, ``topk``, ``kthvalue``, ``mode``, ``median``/``nanmedian``
  with a dim): the device's are taken where each is in range, a sort's are a permutation and a top-k's distinct
  along the dim, and the input gathered at them equals both the device's values and the run's, exactly (a top-k
  with ``sorted=False``: the run's values as a set). The run's values become that gather, so its backward routes
  each gradient to the element the device picked. An index that picks another value is not taken: it fails as
  before, its note says where.
* vectors (``linalg.eigh``, ``svd``, ``linalg.svd``, ``qr``): the run's vectors are turned onto the device's by
  the nearest orthogonal (unitary) matrix that keeps each eigenspace: a sign (a phase) per vector, a rotation within
  a group of eigenvalues (singular values) no further apart than ``CLUSTER_EPS`` n eps of the largest, where the
  vectors are not unique. The rotation is a constant of the run's graph, so its backward is the backward of the
  device's choice. Noise in the device's vectors is not a rotation of them: it still fails.

* eigenpairs of a general matrix (``linalg.eig``, ``linalg.eigvals``): the eigenvalues in any order, each vector up to
  a phase (LAPACK makes each of unit norm with its largest component real; another solver orders and turns them as
  it likes). The run's eigenvalues are put in the device's order where each device eigenvalue's nearest run
  eigenvalue is a different one (a one-to-one match: not so for a repeated eigenvalue, compared as it is), and each
  vector turned by the phase that brings it nearest the device's. The order and the phases are constants of the
  run's graph. Noise in the device's values is no reordering of them: it still fails.

Vectorised torch on whichever device the run is (no per-element Python); a device result is copied to the run's
device once.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..ops.op_facts import op_facts

# Eigenvalues (singular values) closer than this many n eps of the largest, in the less precise of the two dtypes,
# are one group: a backward-stable solver's error is a few n eps of it, so their vectors are not determined.
CLUSTER_EPS = 16.0

Adopter = Callable[[Any, Any], dict[int, str]]
ADOPTERS: dict[str, Adopter] = {}  # op_facts' ``ambiguous`` kind -> how a run takes another run's choices


def adopts(kind: str) -> Callable[[Adopter], Adopter]:
    """Register the function that makes a run take ``chosen``'s choices for ops of the ``ambiguous`` kind."""

    def register(fn: Adopter) -> Adopter:
        ADOPTERS[kind] = fn
        return fn

    return register


def adopt_choices(op_name: str, chosen, run) -> dict[int, str]:
    """Make ``run`` (a ``reference.Reference``: its arguments and result) take ``chosen``'s choices where they are
    valid for its input; ``run.result`` is replaced (differentiably, where it has a graph). Returns a note per result
    leaf (by its index) saying how it is judged, or why the device's choice was not taken."""
    kind = op_facts(op_name).ambiguous
    adopter = ADOPTERS.get(kind) if kind else None
    if adopter is None or run is None or chosen is None:
        return {}
    with torch.set_grad_enabled(_has_graph(run.result)):
        return adopter(chosen, run)


def adopted(op_name: str, chosen, values):
    """``values``, another run's result of ``chosen``'s arguments (the device's float64 reference, for a cross-check
    of two references), with ``chosen``'s choices (a ``Reference``) where they are valid."""
    run = _Run(chosen.args, chosen.kwargs, values)
    adopt_choices(op_name, chosen.result, run)
    return run.result


def with_choices(op_name: str, chosen, args, kwargs, result):
    """``result`` of the op run on ``args``/``kwargs`` (a CPU rerun), with ``chosen``'s choices (the device's result)
    where they are valid: what the offline replay compares against."""
    run = _Run(args, kwargs, result)
    adopt_choices(op_name, chosen, run)
    return run.result


class _Run:
    """Arguments with another result: what an adopter reads and replaces."""

    def __init__(self, args, kwargs, result) -> None:
        self.args, self.kwargs, self.result, self.original = args, kwargs, result, result


def _has_graph(result) -> bool:
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in _leaves(result))


def _leaves(result) -> tuple:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def _rebuilt(result, leaves: list):
    """``leaves`` in ``result``'s structure (a ``torch.return_types`` tuple stays one)."""
    if not isinstance(result, (tuple, list)):
        return leaves[0]
    return type(result)(leaves) if isinstance(result, tuple) else list(leaves)


def _argument(run, position: int | None, keyword: str, default: Any) -> Any:
    if keyword in run.kwargs:
        return run.kwargs[keyword]
    if position is not None and len(run.args) > position:
        return run.args[position]
    return default


def _input(run) -> torch.Tensor | None:
    x = run.kwargs.get("input", run.kwargs.get("self", run.args[0] if run.args else None))
    return x if isinstance(x, torch.Tensor) else None


def _same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Element by element: equal, or both nan."""
    equal = a == b
    return equal | (a.isnan() & b.isnan()) if a.is_floating_point() else equal


# --- indices of equal elements ---

def _index_pair(result) -> bool:
    leaves = _leaves(result)
    return len(leaves) == 2 and all(isinstance(t, torch.Tensor) for t in leaves) and leaves[1].dtype == torch.int64


def _adopt_indices(chosen, run, dim: int, *, keepdim: bool = True, permutation: bool = False,
                   distinct: bool = False, ordered: bool = True) -> dict[int, str]:
    """The shared rule of the index kinds; ``keepdim=False``: the dim is reduced away in the results."""
    x = _input(run)
    if x is None or "out" in run.kwargs or not (_index_pair(run.result) and _index_pair(chosen)):
        return {}
    values, indices = run.result
    chosen_values, chosen_indices = chosen
    if chosen_indices.shape != indices.shape or chosen_values.shape != values.shape or x.dim() == 0:
        return {}  # the comparison says what differs
    dim = dim % x.dim()
    picked = chosen_indices.detach().to(x.device)
    if not keepdim:
        picked = picked.unsqueeze(dim)
    size = x.shape[dim]
    wrong = ((picked < 0) | (picked >= size)).sum()
    if wrong:
        return {1: f"{int(wrong)} of the device's indices out of range [0, {size})"}
    if picked.numel() and (permutation or distinct):
        steps = picked.sort(dim).values.diff(dim=dim)
        if not bool((steps > 0).all()) or (permutation and picked.shape[dim] != size):
            return {1: "the device's indices are not " + ("a permutation" if permutation else "distinct")}
    gathered = x.gather(dim, picked)
    if not keepdim:
        gathered = gathered.squeeze(dim)
    gathered = gathered.to(values.dtype)
    plain = gathered.detach()
    mine = _same(plain, chosen_values.detach().to(plain.device, plain.dtype))
    own = values.detach().to(plain.device)
    if ordered:
        runs = _same(plain, own)
    else:  # a top-k with sorted=False: its elements in any order
        runs = _same(plain.sort(dim).values, own.sort(dim).values)
    picks_other = int((~(mine & runs)).sum())
    if picks_other:
        return {1: f"the device's indices pick other values than its own at {picks_other} of {picked.numel()} "
                   "elements"}
    run.result = _rebuilt(run.result, [gathered.to(values.device), chosen_indices.to(indices.device)])
    return {1: "indices of equal elements may differ from the CPU's: judged by the values they pick"}


@adopts("sort")
def _sort(chosen, run) -> dict[int, str]:
    if _argument(run, None, "stable", False):
        return {}  # a stable sort has one answer
    return _adopt_indices(chosen, run, _argument(run, 1, "dim", -1), permutation=True)


@adopts("argsort")
def _argsort(chosen, run) -> dict[int, str]:
    """As a sort whose values are the input at the run's indices: the device's must pick those same values."""
    x, indices = _input(run), run.result
    if x is None or x.dim() == 0 or _argument(run, None, "stable", False) or not (
            isinstance(indices, torch.Tensor) and isinstance(chosen, torch.Tensor)) or chosen.shape != indices.shape:
        return {}
    dim = _argument(run, 1, "dim", -1) % x.dim()
    as_sort = _Run(run.args, run.kwargs, (x.gather(dim, indices.to(x.device)).detach(), indices))
    # the values the device's indices stand for are those of the sorted input (the run's): checked against the input
    chosen_pair = (as_sort.result[0], chosen)
    notes = _adopt_indices(chosen_pair, as_sort, dim, permutation=True)
    if as_sort.result is not as_sort.original:
        run.result = as_sort.result[1]
    return {0: notes[1]} if 1 in notes else {}


@adopts("topk")
def _topk(chosen, run) -> dict[int, str]:
    return _adopt_indices(chosen, run, _argument(run, 2, "dim", -1), distinct=True,
                          ordered=bool(_argument(run, 4, "sorted", True)))


@adopts("index of value")
def _index_of_value(chosen, run) -> dict[int, str]:
    """mode, median and nanmedian with a dim (input, dim, keepdim): one index per reduced row, any of the ties."""
    return _adopt_indices(chosen, run, _argument(run, 1, "dim", -1), keepdim=bool(_argument(run, 2, "keepdim", False)))


@adopts("kth value")
def _kth_value(chosen, run) -> dict[int, str]:
    """kthvalue (input, k, dim, keepdim): as ``index of value``."""
    return _adopt_indices(chosen, run, _argument(run, 2, "dim", -1), keepdim=bool(_argument(run, 3, "keepdim", False)))


# --- vectors free up to a sign, or a rotation within a repeated eigenvalue's space ---

def _eps(*dtypes: torch.dtype) -> float:
    return max(torch.finfo(d.to_real() if d.is_complex else d).eps for d in dtypes)


def _groups(values: torch.Tensor, eps: float) -> torch.Tensor:
    """A label per eigenvalue (singular value), sorted along the last dim: equal for neighbours within
    ``CLUSTER_EPS`` n eps of the largest magnitude (per matrix of a batch)."""
    values = values.detach()
    n = values.shape[-1]
    tolerance = CLUSTER_EPS * n * eps * values.abs().amax(-1, keepdim=True)
    apart = values.diff(dim=-1).abs() > tolerance
    return torch.cat([torch.zeros_like(values[..., :1], dtype=torch.int64), apart.long().cumsum(-1)], -1)


def _block_polar(m: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The unitary matrix nearest ``m`` among those that keep each group of equal ``labels`` (block diagonal);
    where every group is one vector, the sign (phase) of each diagonal element."""
    if bool((labels.diff(dim=-1) != 0).all()):  # no repeated values: a sign per vector, exactly
        diagonal = m.diagonal(dim1=-2, dim2=-1)
        size = diagonal.abs()
        sign = torch.where(size > 0, diagonal / size.clamp_min(torch.finfo(size.dtype).tiny),
                           torch.ones_like(diagonal))
        return torch.diag_embed(sign)
    mask = labels.unsqueeze(-1) == labels.unsqueeze(-2)
    u, _, vh = torch.linalg.svd(m * mask)
    return (u @ vh) * mask  # a group whose m is singular (a wrong device result) may not mix with another


def _group_note(labels: torch.Tensor, what: str) -> str:
    same_as_next = labels.diff(dim=-1) == 0
    edge = torch.zeros_like(same_as_next[..., :1])
    repeated = int((torch.cat([same_as_next, edge], -1) | torch.cat([edge, same_as_next], -1)).sum())
    if not repeated:
        return f"{what} compared up to each one's sign"
    return (f"{what} compared up to each one's sign, and up to a rotation within groups of (nearly) repeated values "
            f"({repeated} vector(s) not unique)")


def _tensor_pairs(result, chosen) -> tuple[tuple, tuple] | None:
    """The two tensors of ``result`` and of ``chosen`` (an eigen- or QR decomposition's), None where either is other."""
    leaves, chosen_leaves = _leaves(result), _leaves(chosen)
    if len(leaves) != 2 or len(chosen_leaves) != 2 or not all(isinstance(t, torch.Tensor)
                                                                for t in (*leaves, *chosen_leaves)):
        return None
    return leaves, chosen_leaves


@adopts("eigenvectors")
def _eigenvectors(chosen, run) -> dict[int, str]:
    pairs = _tensor_pairs(run.result, chosen)
    if pairs is None:
        return {}
    (w, vectors), theirs = pairs[0], pairs[1][1]
    if vectors.numel() == 0 or theirs.shape != vectors.shape or vectors.dim() < 2:
        return {}
    labels = _groups(w, _eps(vectors.dtype, theirs.dtype))
    theirs = theirs.detach().to(vectors.device, vectors.dtype)
    turn = _block_polar(vectors.detach().mH @ theirs, labels)
    run.result = _rebuilt(run.result, [w, vectors @ turn])
    return {1: _group_note(labels, "eigenvectors")}


def _singular_vectors(chosen, run, vh: bool) -> dict[int, str]:
    result = run.result
    leaves, chosen_leaves = _leaves(result), _leaves(chosen)
    if len(leaves) != 3 or len(chosen_leaves) != 3 or not all(isinstance(t, torch.Tensor)
                                                                for t in (*leaves, *chosen_leaves)):
        return {}
    u, s, v = leaves
    their_u, _, their_v = chosen_leaves
    if u.numel() == 0 or v.numel() == 0 or their_u.shape != u.shape or their_v.shape != v.shape or u.dim() < 2:
        return {}
    if vh:
        v, their_v = v.mH, their_v.mH
    eps = _eps(u.dtype, their_u.dtype)
    k = s.shape[-1]
    labels = _groups(s, eps)
    # a singular value of 0 leaves its u and v free apart, as are U's (V's) columns beyond k: one group of their own
    tolerance = CLUSTER_EPS * k * eps * s.detach().abs().amax(-1, keepdim=True)
    labels = torch.where(s.detach().abs() <= tolerance, torch.full_like(labels, -1), labels)
    on_u = u.detach().mH @ their_u.detach().to(u.device, u.dtype)
    on_v = v.detach().mH @ their_v.detach().to(v.device, v.dtype)
    both = on_u[..., :k, :k] + on_v[..., :k, :k]  # a pair (u, v) turns as one
    paired = (labels >= 0).unsqueeze(-1) & (labels >= 0).unsqueeze(-2)
    turns = []
    for on, columns in ((on_u, u.shape[-1]), (on_v, v.shape[-1])):
        on = on.clone()
        on[..., :k, :k] = torch.where(paired, both, on[..., :k, :k])
        extra = torch.full((*labels.shape[:-1], columns - k), -1, dtype=labels.dtype, device=labels.device)
        turns.append(_block_polar(on, torch.cat([labels, extra], -1)))
    new_u, new_v = u @ turns[0], v @ turns[1]
    run.result = _rebuilt(result, [new_u, s, new_v.mH if vh else new_v])
    return {0: _group_note(labels, "singular vectors"), 2: _group_note(labels, "singular vectors")}


@adopts("singular vectors")
def _svd_vh(chosen, run) -> dict[int, str]:
    return _singular_vectors(chosen, run, vh=True)


@adopts("singular vectors (V)")
def _svd_v(chosen, run) -> dict[int, str]:
    return _singular_vectors(chosen, run, vh=False)


@adopts("qr")
def _qr(chosen, run) -> dict[int, str]:
    """Q's columns (R's rows) up to a sign each: LAPACK's and cuSOLVER's Householder QR may choose apart. Columns of a
    complete Q beyond R's rank multiply zero rows of R: free within their space."""
    pairs = _tensor_pairs(run.result, chosen)
    if pairs is None:
        return {}
    (q, r), their_q = pairs[0], pairs[1][0]
    if q.numel() == 0 or r.numel() == 0 or their_q.shape != q.shape or q.dim() < 2:
        return {}
    k = min(q.shape[-2], r.shape[-1])
    columns = q.shape[-1]
    labels = torch.cat([torch.arange(k), torch.full((columns - k,), -1)]).to(q.device).expand(*q.shape[:-2], columns)
    turn = _block_polar(q.detach().mH @ their_q.detach().to(q.device, q.dtype), labels)
    run.result = _rebuilt(run.result, [q @ turn, turn.mH @ r])
    return {0: "Q's columns (R's rows) compared up to each one's sign"}


# --- eigenpairs of a general matrix: free in order and in each vector's phase ---

@adopts("eigenpairs")
def _eigenpairs(chosen, run) -> dict[int, str]:
    leaves, chosen_leaves = _leaves(run.result), _leaves(chosen)
    if not 1 <= len(leaves) <= 2 or len(chosen_leaves) != len(leaves) or not all(
            isinstance(t, torch.Tensor) for t in (*leaves, *chosen_leaves)):
        return {}
    w, their_w = leaves[0], chosen_leaves[0]
    if w.numel() == 0 or their_w.shape != w.shape or not w.is_complex():
        return {}
    their_w = their_w.detach().to(w.device, w.dtype)
    order = (their_w.unsqueeze(-1) - w.detach().unsqueeze(-2)).abs().argmin(-1)  # per device eigenvalue, the run's
    if not bool((order.sort(-1).values == torch.arange(w.shape[-1], device=order.device)).all()):
        return {0: "eigenvalues compared in the CPU's order: the device's are not matched one to one (a repeated "
                   "eigenvalue)"}
    new = [w.gather(-1, order)]
    notes = {0: "eigenvalues compared in the device's order"}
    if len(leaves) == 2:
        v, their_v = leaves[1], chosen_leaves[1].detach().to(leaves[1].device, leaves[1].dtype)
        if their_v.shape != v.shape or v.dim() < 2:
            return {}
        v = v.gather(-1, order.unsqueeze(-2).expand(v.shape))
        inner = (v.detach().conj() * their_v).sum(-2)  # each vector against the device's
        size = inner.abs()
        phase = torch.where(size > 0, inner / size.clamp_min(torch.finfo(size.dtype).tiny), torch.ones_like(inner))
        new.append(v * phase.unsqueeze(-2))
        notes[1] = "eigenvectors compared in the device's order, up to each one's phase"
    run.result = _rebuilt(run.result, new)
    return notes
