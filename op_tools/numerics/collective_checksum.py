"""A collective checked by checksums across its ranks, on the device: what every rank sent, summed in chunks and
added up over the group, against what this rank received, summed in the same chunks.

Each rank sums its sent tensor in chunks of its received tensor's layout (before the call: an all-reduce writes its
input), and after the call joins those sums and their magnitudes (``sum |x|``) into one small vector, which one extra
``all_gather_into_tensor`` (c10d's own, on the collective's group: the tools never see it) brings to every rank,
where they are added up in rank order. Then, per chunk:

* ``all_reduce`` (sum, avg), ``reduce`` and ``broadcast``: this rank's received chunk sums against the total (avg:
  divided by the group's size; reduce: on its destination rank only; broadcast: only the source rank's part is
  non-zero);
* ``reduce_scatter_tensor``: this rank's received sums against the total's part for this rank;
* ``all_gather_into_tensor``: every rank's part of the received tensor against that rank's sent sums;
* ``all_to_all_single``: each rank sums its sent rows per destination (``input_split_sizes``, or equal parts), and
  this rank's piece received from each rank (``output_split_sizes``) against that rank's sums of the piece it sent
  here (not added up: gathered).

The bound per chunk: both sides' float32 sums (``gamma_m``), the extra all-reduce's, and for a reduction the
collective's own roundings in its dtype (one per rank on a ring). What it catches: a chunk lost, duplicated or taken
from the wrong rank, a flipped bit in a high place, a wrong scaling; what it misses: an error that cancels within a
chunk, noise below the sums' rounding (in bfloat16 about ``world * 2^-8`` of the chunk's magnitude).

All of it runs on the device; the excess, one number, is read back with the tool's other results (no
synchronisation). Every rank must check the same calls (the extra all-reduce is itself a collective): the tool
decides by the call's position in the group's sequence, never by time or values.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..ops.collectives import CollectiveCall, premul_factor, root_rank, split_sizes
from .rounding_bounds import gamma, worst_excess

CHUNKS = 256  # checksums per rank's part of a collective: the extra all-gather carries 2 x CHUNKS x ranks numbers
KINDS = ("all_reduce", "reduce", "broadcast", "reduce_scatter", "all_gather", "all_to_all")
_REDUCING = ("sum", "avg", "premul_sum")


def uncheckable(call: CollectiveCall) -> str | None:
    """Why this collective has no checksum here, or None."""
    if call.coalesced:
        return "collective inside a _coalescing_manager"
    if call.kind not in KINDS:
        return f"collective {call.kind}"
    if call.reduce_op and call.reduce_op not in _REDUCING:
        return f"collective with ReduceOp {call.reduce_op}"
    if len(call.sent) != 1 or len(call.received) != 1 or not call.received[0].is_floating_point():
        return "collective of tensor lists or integers"
    return None


def _group_size_and_rank(call: CollectiveCall) -> tuple[int, int]:
    from torch.distributed import distributed_c10d

    group: Any = call.group
    return distributed_c10d.get_world_size(group), distributed_c10d.get_rank(group)


def _chunk_sums(t: torch.Tensor, rows: int, wide: torch.dtype) -> torch.Tensor:
    """``t`` as ``rows`` equal parts, each summed in (up to) ``CHUNKS`` chunks of equal length: (rows, chunks, 2),
    the sums and the sums of magnitudes."""
    flat = t.detach().reshape(rows, -1)
    n = flat.size(1)
    length = max(1, math.ceil(n / CHUNKS))
    whole = (n // length) * length
    parts = [flat[:, :whole].reshape(rows, -1, length)]
    sums = [torch.stack([parts[0].sum(-1, dtype=wide), parts[0].abs().sum(-1, dtype=wide)], -1)]
    if whole < n:  # the remainder: one more chunk
        tail = flat[:, whole:]
        sums.append(torch.stack([tail.sum(-1, dtype=wide), tail.abs().sum(-1, dtype=wide)], -1).unsqueeze(1))
    return torch.cat(sums, 1) if len(sums) > 1 else sums[0]


def _wide(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _piece_sums(t: torch.Tensor, splits: list[int], wide: torch.dtype) -> torch.Tensor:
    """``t``'s rows in pieces of ``splits`` rows, each summed in chunks as ``_chunk_sums`` sums a tensor, padded with
    zeros to ``CHUNKS``: (pieces, CHUNKS, 2). The same piece gives the same chunks on the rank that sends it and on
    the rank that receives it."""
    out = torch.zeros(len(splits), CHUNKS, 2, dtype=wide, device=t.device)
    rows = t.detach().reshape(t.shape[0], -1)
    start = 0
    for i, count in enumerate(splits):
        if count:
            sums = _chunk_sums(rows[start:start + count].reshape(-1), 1, wide)[0]
            out[i, :sums.shape[0]] = sums
        start += count
    return out


def sent_sums(call: CollectiveCall) -> torch.Tensor:
    """This rank's contribution to the total, laid out as the received tensor's chunks (an all-to-all's: per
    destination rank): taken before the call."""
    size, rank = _group_size_and_rank(call)
    sent, received = call.sent[0], call.received[0]
    wide = _wide(received)
    if call.kind == "all_to_all":
        return _piece_sums(sent, split_sizes(call, "input", size), wide)
    if call.kind == "reduce_scatter":
        return _chunk_sums(sent, size, wide)  # a row per receiving rank
    if call.kind == "all_gather":
        mine = _chunk_sums(sent, 1, wide)
        placed = torch.zeros((size, *mine.shape[1:]), dtype=wide, device=mine.device)
        placed[rank] = mine[0]
        return placed
    sums = _chunk_sums(sent, 1, wide)
    if call.kind == "broadcast" and rank != root_rank(call):  # only the source's part is sent
        sums = torch.zeros_like(sums)
    return sums


def excess(call: CollectiveCall, before: torch.Tensor) -> torch.Tensor:
    """After the call: the largest violation over the chunks, as a multiple of what rounding allows (a 0-d tensor on
    the device). Runs one all_gather of ``before`` on the collective's group."""
    from torch.distributed import distributed_c10d

    size, rank = _group_size_and_rank(call)
    received = call.received[0]
    wide = _wide(received)
    # every rank's sums gathered and added up here, in rank order (the same total on every rank): an all_gather, not
    # an all_reduce, so that a faulty all_reduce does not corrupt the checks of the other collectives
    gathered = before.new_empty(size * before.numel())
    gather = getattr(distributed_c10d, "all_gather_single", None) or distributed_c10d.all_gather_into_tensor
    gather(gathered, before.reshape(-1), group=call.group)  # torch 2.13 names all_gather_into_tensor so
    total = gathered.view(size, *before.shape).sum(0)
    if call.kind == "reduce" and root_rank(call) != rank:  # the reduction arrives elsewhere: nothing here
        return total.new_zeros(())
    if call.kind == "all_to_all":  # each rank's piece for this one, against the piece received from it
        splits = split_sizes(call, "output", size)
        got, expected = _piece_sums(received, splits, wide), gathered.view(size, *before.shape)[:, rank]
        row = received.numel() // max(1, received.shape[0])
        length = max(1, *(math.ceil(count * row / CHUNKS) for count in splits))  # the longest piece's chunk
    elif call.kind == "all_gather":
        got = _chunk_sums(received, size, wide)
        expected = total
    elif call.kind == "reduce_scatter":
        got, expected = _chunk_sums(received, 1, wide), total[rank:rank + 1]
    else:
        got, expected = _chunk_sums(received, 1, wide), total
    if call.kind != "all_to_all":  # a chunk's length, as _chunk_sums made them
        length = max(1, math.ceil(received.numel() / got.shape[0] / CHUNKS))
    # what each rank's sent part counts for in the result: 1 / size for an average, the factor for premul_sum (a
    # number, or a 0-d tensor as the program gave it, on the device: no synchronisation)
    share = 1 / size if call.reduce_op == "avg" else premul_factor(call) if call.reduce_op == "premul_sum" else 1.0
    magnitude, target = expected[..., 1] * abs(share), expected[..., 0] * share
    u_wide = torch.finfo(wide).eps / 2
    u_own = torch.finfo(received.dtype).eps / 2
    # a ring's one rounding per rank, the result's, an average's; premul_sum's product on each rank
    rounds = (size + 2 + (size if call.reduce_op == "premul_sum" else 0)) if call.reduce_op else 0
    allowed = (2 * gamma(length + 1, u_wide) + gamma(size + 1, u_wide) + rounds * u_own) * magnitude * 1.001 + \
        length * torch.finfo(received.dtype).tiny
    return worst_excess(got[..., 0] - target, allowed)  # a rank that sent inf or nan: not checked
