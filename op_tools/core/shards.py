"""Sharded tensors' full norms: which process groups a tensor's shards are spread over, and the sums across them.

A norm computed on a rank's shard is too low by about the square root of the number of shards. The full tensor's
squared norm is the sum of its shards' squared norms over the groups that shard it: a DTensor's mesh dimensions
with a ``Shard`` placement (FSDP2, tensor parallel), or an FSDP1 unit's process group (its flat parameter and, with
``use_orig_params=True``, the original parameters that view it). ``Replicate`` dimensions hold copies: not summed.

Where the work runs: the squares stay on the device; ``sum_across_shards`` makes one ``all_reduce`` per distinct
group per call (one per step for FSDP2's single mesh), through c10d's own function (``distributed_c10d``), which
the tools' collective wrappers do not replace: the tools never see this work.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

Groups = tuple  # of c10d ProcessGroups whose ranks hold one shard each: the full figure is the sum over all of them


def local_part(t: torch.Tensor) -> torch.Tensor:
    """The rank's own data: a DTensor's local tensor, any other tensor itself."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def is_partial(t: torch.Tensor) -> bool:
    """A DTensor holding pending sums (``Partial``): its local values are not a shard, no norm of them is the full."""
    return any(type(p).__name__ == "Partial" for p in getattr(t, "placements", ()))


def dtensor_groups(t: torch.Tensor) -> Groups:
    """The groups over which ``t`` (a DTensor) is sharded; ``()`` for a plain tensor or a replicated DTensor."""
    placements = getattr(t, "placements", None)
    if placements is None:
        return ()
    mesh = t.device_mesh  # type: ignore[attr-defined]
    return tuple(mesh.get_group(dim) for dim, p in enumerate(placements)
                 if type(p).__name__ in ("Shard", "_StridedShard"))


def fsdp1_groups(model: torch.nn.Module | None) -> dict[int, Groups]:
    """id(parameter) -> the group sharding it, for every FSDP1 unit in ``model`` with a sharded strategy."""
    found: dict[int, Groups] = {}
    for module in () if model is None else model.modules():
        if type(module).__name__ != "FullyShardedDataParallel":
            continue
        handle = getattr(module, "_handle", None)
        if handle is None or not handle.uses_sharded_strategy:
            continue
        flat = handle.flat_param
        group = (module.process_group,)
        for p in [flat, *(getattr(flat, "_params", None) or ()), *(getattr(flat, "_shared_params", None) or ())]:
            found[id(p)] = group
    return found


def sum_across_shards(parts: Iterable[tuple[torch.Tensor, Groups]]) -> list[torch.Tensor]:
    """Each part (a 1-D float tensor of squares) summed over its groups, in order: one ``all_reduce`` per distinct
    group tuple, the parts sharing it joined first. Every rank must call with the same groups in the same order."""
    from torch.distributed import distributed_c10d

    parts = list(parts)
    out = [t for t, _ in parts]
    by_groups: dict[tuple[int, ...], list[int]] = {}
    for k, (_, groups) in enumerate(parts):
        if groups:
            by_groups.setdefault(tuple(id(g) for g in groups), []).append(k)
    for indices in by_groups.values():
        joined = torch.cat([out[k] for k in indices])
        for group in parts[indices[0]][1]:
            distributed_c10d.all_reduce(joined, group=group)
        for k, piece in zip(indices, joined.split([out[k].numel() for k in indices])):
            out[k] = piece
    return out


def local_call(args: tuple, kwargs: dict, result, addend) -> tuple[tuple, dict, object, float] | str:
    """A DTensor call as its rank computed it: its arguments and result as their local tensors, and the share of a
    ``Replicate`` addend (a bias) the local result holds: DTensor divides one among a ``Partial(sum)`` result's ranks
    (``Partial._partition_value``). A string says why the local tensors are not the rank's computation: a ``Partial``
    input (DTensor reduces it before the op), a result pending another reduction than a sum."""
    arguments = [*args, *kwargs.values()]
    if any(is_partial(a) for a in arguments if isinstance(a, torch.Tensor)):
        return "a Partial input"
    share = 1.0
    placements = getattr(result, "placements", ())
    for dim, placement in enumerate(placements):
        if type(placement).__name__ != "Partial":
            continue
        if getattr(placement, "reduce_op", "sum") != "sum":
            return f"a {placement} result"
        if addend is not None and type(addend.placements[dim]).__name__ == "Replicate":
            share /= result.device_mesh.size(dim)
    locals_ = [local_part(a) if isinstance(a, torch.Tensor) else a for a in args]
    return (tuple(locals_), {k: local_part(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()},
            local_part(result) if isinstance(result, torch.Tensor) else result, share)


def same_layout(tensors: list[torch.Tensor], result) -> bool:
    """Whether DTensors ``tensors`` and ``result`` share one mesh and placements, none of them ``Partial``: an
    elementwise op then ran on each rank's local tensors as they are (DTensor redistributed nothing)."""
    layouts = {(id(getattr(t, "device_mesh", None)), tuple(getattr(t, "placements", ()))) for t in (*tensors, result)}
    return len(layouts) == 1 and not any(is_partial(t) for t in (*tensors, result))


def whole_along(t: torch.Tensor, trailing: int) -> bool:
    """Whether DTensor ``t``'s last ``trailing`` dimensions are whole on every rank (sharded on none of them)."""
    return all(not (type(p).__name__ in ("Shard", "_StridedShard") and p.dim % t.dim() >= t.dim() - trailing)
               for p in t.placements)  # type: ignore[attr-defined]


def replicated(t: torch.Tensor) -> bool:
    """Whether DTensor ``t`` is whole on every rank."""
    return all(type(p).__name__ == "Replicate" for p in t.placements)  # type: ignore[attr-defined]
