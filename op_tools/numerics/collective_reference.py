"""A collective's result checked against a reference computed on the host from every rank's inputs.

Each rank copies what it sends to the host before the call; after it, the copies of every rank of the call's group
are gathered (as bytes) through a gloo group of the same ranks (one per group, made on first use
by its members), the reference is computed from them (the sum, average, maximum, ... of the ranks' inputs, their
concatenation, the root's tensor, the rows each rank sends this one in an all-to-all) and compared with what this
rank received.

The tolerance is the dtype's reduction bound: a sum of ``n`` values rounded to a dtype of epsilon ``eps``, in any
order, is within ``n * eps * sum|x_i|`` of the exact sum (an average within that over ``n``); copies (gather,
broadcast, all-to-all) and maximum/minimum must be exact, as must integers.

Where the work runs: two host copies per call (the sent tensor before, the received one after), one gloo all-gather
of the sent copies (an all-to-all's preceded by one of their lengths), and the reference in float64 on the host: a
host synchronisation and ``world size`` times the sent bytes over gloo per collective. OP_AUTOCOMPARE_COLLECTIVES=0
switches it off.
"""

from __future__ import annotations

import datetime
import threading

import torch

from ..ops.collectives import CollectiveCall, premul_factor, root_rank, split_sizes
from .comparison import Comparison

_VERIFIED = {"all_reduce", "reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"}
_REDUCTIONS = {"sum", "avg", "max", "min", "product", "premul_sum"}
_SUMS = ("sum", "avg", "premul_sum")  # reductions that add: bounded by their roundings
_twins: dict[tuple[int, ...], object] = {}
_twins_lock = threading.Lock()
# How long a rank waits for the others at a check: they reach it right after the collective itself, so only a rank
# that runs no check (a tool started on some ranks only) keeps it waiting; then the checks stop for the process.
TIMEOUT = datetime.timedelta(seconds=120)
_stopped: list[str] = []  # why the checks stopped, once one timed out or failed
NO_TENSORS = "collective without tensors"  # nothing moved: nothing to check
COALESCED = "collective inside a _coalescing_manager (run later, in one batch with the others)"


def unverifiable(call: CollectiveCall) -> str | None:
    """Why this collective's result cannot be checked here, or None."""
    if _stopped:
        return _stopped[0]
    if call.coalesced:
        return COALESCED
    if call.kind not in _VERIFIED:
        return f"collective {call.kind} (no host reference for it)"
    if call.reduce_op and call.reduce_op not in _REDUCTIONS:
        return f"collective with ReduceOp {call.reduce_op} (no host reference for it)"
    if not call.sent or not (call.received or call.functional):  # a functional one's: its result, after the call
        return NO_TENSORS
    return None


def _wide(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    dtype = torch.float64 if t.is_floating_point() else torch.int64
    return t.to("cpu", dtype, copy=True)


def sent_copies(call: CollectiveCall) -> list[torch.Tensor]:
    """Host copies of what this rank sends (in its own dtype: gathered as bytes), taken before the call writes them;
    an all-to-all's preceded by how many rows of it go to each rank (its ``input_split_sizes``, even when not given)."""
    copies = [t.detach().to("cpu", copy=True).contiguous() for t in call.sent]
    if call.kind == "all_to_all":
        from torch.distributed import distributed_c10d

        size = distributed_c10d.get_world_size(call.group)  # type: ignore[arg-type]  # a ProcessGroup or None
        copies.insert(0, torch.tensor(split_sizes(call, "input", size), dtype=torch.int64))
    return copies


def _twin(group) -> tuple[object, list[int]]:
    """A gloo group of the ranks of ``group`` (the tools' own channel: never the user's group), and those ranks."""
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    key = tuple(ranks)
    with _twins_lock:
        twin = _twins.get(key)
        if twin is None:
            # Every member says it checks before the group is made: a rank that runs no tool never answers, and the
            # store's wait ends at TIMEOUT (making a gloo group would wait minutes for it).
            store = dist.distributed_c10d._get_default_store()
            prefix = "op_tools/collective_checks/" + ",".join(map(str, ranks))
            store.set(f"{prefix}/{dist.get_rank()}", "checking")
            store.wait([f"{prefix}/{rank}" for rank in ranks], TIMEOUT)
            twin = _twins[key] = dist.new_group(list(ranks), backend="gloo", timeout=TIMEOUT,
                                                use_local_synchronization=True)
    return twin, ranks


def _gathered(copies: list[torch.Tensor], twin, size: int, uneven: bool = False) -> list[list[torch.Tensor]]:
    """Every rank's copies, rank by rank, widened to float64 (int64) after the exchange. They travel as their bytes
    (as few as the dtype has, and any dtype gloo lacks): the ranks' sent tensors have the same shapes and dtypes in
    these collectives, or with ``uneven`` (an all-to-all's uneven splits) the same dtypes and sizes past the first
    dimension, their lengths exchanged first."""
    import torch.distributed as dist

    flat = torch.cat([c.reshape(-1).view(torch.uint8) for c in copies]) if copies else \
        torch.zeros(0, dtype=torch.uint8)
    lengths = [[c.numel() * c.element_size() for c in copies]] * size
    if uneven:
        mine = torch.tensor(lengths[0], dtype=torch.int64)
        theirs = [torch.empty_like(mine) for _ in range(size)]
        dist.all_gather(theirs, mine, group=twin)
        lengths = [t.tolist() for t in theirs]
        flat = torch.cat([flat, flat.new_zeros(max(map(sum, lengths)) - flat.numel())])
    out = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(out, flat, group=twin)
    per_rank = []
    for gathered, rank_lengths in zip(out, lengths):
        pieces, offset = [], 0
        for c, size_bytes in zip(copies, rank_lengths):
            piece = gathered[offset:offset + size_bytes].view(c.dtype)
            pieces.append(_wide(piece.view(-1, *c.shape[1:]) if uneven and c.dim() else piece.view(c.shape)))
            offset += size_bytes
        per_rank.append(pieces)
    return per_rank


def _reduce(stacked: torch.Tensor, op: str, factor: float = 1.0) -> torch.Tensor:
    """The ranks' tensors (stacked on dim 0) reduced as ``op`` reduces them (``premul_sum``: each times ``factor``)."""
    if op == "sum":
        return stacked.sum(0)
    if op == "premul_sum":
        return stacked.sum(0) * factor
    if op == "avg":
        return stacked.sum(0) / len(stacked) if stacked.is_floating_point() else stacked.sum(0) // len(stacked)
    if op == "product":
        return stacked.prod(0)
    return stacked.amax(0) if op == "max" else stacked.amin(0)


def _reduced(values: list[torch.Tensor], op: str, factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The reduction of ``values`` and the sum of the magnitudes it adds (what its rounding scales with), from one
    stack."""
    stacked = torch.stack(values)
    result = _reduce(stacked, op, factor)
    magnitudes = stacked.abs_().sum(0)
    return result, magnitudes if factor == 1.0 else magnitudes.mul_(abs(factor))


def _expected(call: CollectiveCall, per_rank: list[list[torch.Tensor]], index: int, ranks: list[int]):
    """The reference for each received tensor, and the magnitudes a reduction's rounding scales with (or None)."""
    first = [rank_copies[0] for rank_copies in per_rank]
    kind = call.kind
    factor = float(premul_factor(call)) if call.reduce_op == "premul_sum" else 1.0  # read here, as every input is
    if kind == "all_reduce":
        result, scale = _reduced(first, call.reduce_op, factor)
        return [result], [scale]
    if kind == "reduce":  # the reduction arrives on the destination rank only: the others have nothing to check
        if root_rank(call) != index:
            return [], []
        result, scale = _reduced(first, call.reduce_op, factor)
        return [result], [scale]
    if kind == "broadcast":
        return [per_rank[root_rank(call)][0]], [None]
    if kind == "all_to_all":  # from each rank in turn, the rows it sends this rank
        chunks = []
        for splits, sent in per_rank:
            start = int(splits[:index].sum())
            chunks.append(sent[start:start + int(splits[index])])
        return [torch.cat(chunks)], [None]
    if kind == "all_gather":
        if len(call.received) == 1:  # into one tensor: the ranks' tensors one after the other
            return [torch.cat([f.reshape(-1) for f in first]).view(call.received[0].shape)], [None]
        return first, [None] * len(first)
    # reduce_scatter: this rank's part of the reduction over the ranks' inputs
    if len(call.sent) > 1:  # a list: one tensor per rank, this rank's is index `index`
        parts = [rank_copies[index] for rank_copies in per_rank]
    else:
        parts = [f.reshape(len(ranks), -1)[index].view(call.received[0].shape) for f in first]
    result, scale = _reduced(parts, call.reduce_op, factor)
    return [result], [scale]


def verify(call: CollectiveCall, copies: list[torch.Tensor]) -> list[Comparison]:
    """Compare what this rank received with the reference from every rank's ``copies`` (of what they sent)."""
    import torch.distributed as dist

    try:
        twin, ranks = _twin(call.group)
        index = ranks.index(dist.get_rank())
        per_rank = _gathered(copies, twin, len(ranks), uneven=call.kind == "all_to_all")
    except Exception as error:
        # This call goes unchecked (raised: the tool counts it); the later ones are skipped with the reason, rather
        # than each waiting TIMEOUT for ranks that do not check.
        _stopped.append("collective (checks stopped: gathering the ranks' inputs failed or timed out, is the tool "
                        "running on every rank?)")
        raise RuntimeError(f"gathering every rank's inputs failed or timed out after {TIMEOUT.total_seconds():g} s "
                           f"(is the tool running on every rank?): {type(error).__name__}: {error}") from error
    expected, scales = _expected(call, per_rank, index, ranks)
    comparisons = []
    for i, (received, reference, scale) in enumerate(zip(call.received, expected, scales)):
        name = "received" if len(call.received) == 1 else f"received[{i}]"
        got = _wide(received)
        comparisons.append(_compare(name, got, reference.to(got.dtype), scale, received.dtype, len(ranks), call))
    return comparisons


def _compare(name: str, got: torch.Tensor, reference: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype,
             n: int, call: CollectiveCall) -> Comparison:
    """``got`` (float64 or int64) against ``reference``: each element within the reduction's bound of it (in place
    where it can: these are whole gradient buckets, tens of megabytes)."""
    if got.shape != reference.shape:
        return Comparison(name, False, False, error_info=f"received shape {tuple(got.shape)}, the reference's "
                                                         f"{tuple(reference.shape)}")
    diff = (got - reference).abs_()
    ref_abs = reference.abs()
    if dtype.is_floating_point and scale is not None and call.reduce_op in _SUMS:
        info = torch.finfo(dtype)
        # rounding of n partial sums in the dtype (and of each product, for premul_sum), the division of an average,
        # and the tiniest normal number
        terms = n + 1 if call.reduce_op == "premul_sum" else n
        allowed = scale.mul_(terms * info.eps / (n if call.reduce_op == "avg" else 1)).add_(ref_abs, alpha=info.eps)
        allowed.add_(info.tiny)
        bound = f"{n} ranks × eps of {dtype} × the sum of |inputs|"
    else:
        allowed = torch.zeros((), dtype=diff.dtype)
        bound = "exact"
    bad = diff > allowed
    if got.is_floating_point() and bool(diff.isnan().any()):  # nan where only one side holds nan (or inf - inf)
        bad |= got.isnan() != reference.isnan()
    max_abs = float(diff.nan_to_num(nan=0.0).max()) if diff.numel() else 0.0
    if not diff.numel():
        max_rel = 0.0
    elif diff.is_floating_point():
        max_rel = float(diff.div_(ref_abs.clamp_min_(1e-300)).nan_to_num(nan=0.0).max())
    else:  # integers: true division gives floats
        max_rel = float((diff / ref_abs.clamp_min(1)).max())
    passed = not bool(bad.any())
    what = call.reduce_op or call.kind
    text = "" if passed else (f"{int(bad.sum())} of {bad.numel()} elements differ from the {what} of {n} ranks' "
                              f"inputs by up to {max_abs:.3g} (allowed: {bound})")
    return Comparison(name, passed, passed, max_abs, max_rel, atol=float(allowed.max()) if allowed.numel() else 0.0,
                      error_info=text)
