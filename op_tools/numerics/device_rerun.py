"""Whether a failing call changed its own inputs: the op rerun on its device from host copies.

OpAutoCompare compares a call against host copies of its inputs, reused from a cache while proven current. When a call
fails and an input it took from the cache is found changed on re-reading it, two writes explain it:

- a write before the call that no call showed (a collective run from C++: DDP's gradient all-reduce before the
  optimizer reads the gradients). The cached copy was stale: the call is compared again on the input as re-read;
- the call's own kernel wrote an input it was only to read (a vendor kernel using it as scratch), then computed from
  it. The cached copy is what the call was given: its failure stands.

The device tells them apart: the op, rerun there from each candidate input (copies uploaded to its device, so the
user's tensors are never touched), reproduces the call's result from the input it was really given. A kernel that
scribbles its input scribbles the uploaded copy the same way, so the rerun from the cached copy gives the call's
result, and the rerun from the input as re-read (already written once) does not. Where the rerun from the cached
copy gives the call's result as well as the other (both exactly, an op blind to the change), the failure stands
too: the device computes that result from the cached copy, against which the call failed, so the device is wrong
on it whichever input the call was given. That rerun comes first; where it gives the call's result exactly, it is
the only one. Where it does not come near (an infinite difference: the result read while a collective still wrote
it), nothing is told, and the re-read stands as before. Run for a failing call with a changed cached input only:
never on a passing call's path.

This rests on the kernel writing its input at every call, as a kernel's bug does. One that wrote it once and not
at the rerun looks like a write before the call: the call is compared on the input as re-read.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable

import torch

from ..ops.arguments import iter_tensors, map_tensors
from .reference import device_named, reference_backward, run_reference


def forward_given_cached(func: Callable, device: torch.device, args, kwargs, on_host: Collection[int],
                         result, replaced: dict[int, torch.Tensor]) -> bool:
    """Whether ``func`` rerun on ``device`` from the host copies in ``args``/``kwargs`` reproduces ``result`` (the
    call's, on the host) exactly, or as well as rerun with the copies in ``replaced`` (id of a cached copy -> the
    input as re-read): the device computes the call's result from the cached copies, so its failure stands.
    ``on_host``: ids of the copies of the call's own host tensors (they stay on the host; the others are uploaded).
    False where the op cannot be rerun."""
    given = list(iter_tensors(result))
    if not given or names_a_device((args, kwargs)):
        return False

    def distance(swap: dict[int, torch.Tensor]) -> float:
        def up(h: torch.Tensor) -> torch.Tensor:
            return h if id(h) in on_host else swap.get(id(h), h).to(device)

        with torch.no_grad():
            rerun = func(*map_tensors(args, up), **map_tensors(kwargs or {}, up))
        return _apart(iter_tensors(rerun), given)

    try:
        cached = distance({})
        return cached == 0 or math.isfinite(cached) and cached <= distance(replaced)
    except Exception:  # noqa: BLE001 - an op that cannot be rerun so: the re-read stands, as it did before
        return False


def backward_given_cached(func: Callable, device: torch.device, args, kwargs, on_host: Collection[int],
                          owned: set[int], grad_snaps: Iterable[torch.Tensor], outputs_of: Callable, upstream: list,
                          reread: list, grads: tuple) -> bool:
    """The same for a backward: the op's forward rerun on ``device`` from its host copies, with ``grad_snaps`` as its
    leaves (``owned``: ids of the copies it writes), then its backward from the ``upstream`` gradients as cached and
    as ``reread``; True when the cached ones reproduce the device's input gradients ``grads`` exactly, or as well.
    ``outputs_of``: the result's tensors as the reference's backward pairs them with the upstream gradients."""
    if names_a_device((args, kwargs)):
        return False
    try:
        uploaded: dict[int, torch.Tensor] = {}

        def up(h: torch.Tensor) -> torch.Tensor:
            if id(h) in on_host:
                return h
            d = uploaded.get(id(h))
            if d is None:
                d = uploaded[id(h)] = h.to(device)
            return d

        snaps = [up(s) for s in grad_snaps]
        device_args, device_kwargs = map_tensors(args, up), map_tensors(kwargs or {}, up)
        reference, _ = run_reference(func, device_args, device_kwargs, [({}, "")],
                                     {id(uploaded[i]) for i in owned if i in uploaded}, snaps, keep_devices=True)
        if reference is None:
            return False
        outputs = outputs_of(reference.result)

        def distance(gradients: list, retain: bool) -> float:
            on_device = tuple(None if g is None else g.to(device) for g in gradients)
            rerun = reference_backward(outputs, reference.leaves, on_device, retain=retain)
            pairs = [(g, d) for g, d in zip(rerun, grads) if g is not None and d is not None]
            return _apart([g for g, _ in pairs], [d for _, d in pairs])

        cached = distance(upstream, retain=True)
        return cached == 0 or math.isfinite(cached) and cached <= distance(reread, retain=False)
    except Exception:  # noqa: BLE001 - an op that cannot be rerun so: the re-read stands, as it did before
        return False


def names_a_device(arguments) -> bool:
    """Whether ``arguments`` hold a device (as a ``torch.device`` or its name): their host form names the CPU where
    the call named its device, so a rerun from them would not run where the call did."""
    if isinstance(arguments, (list, tuple)):
        return any(names_a_device(v) for v in arguments)
    if isinstance(arguments, dict):
        return any(names_a_device(v) for v in arguments.values())
    if isinstance(arguments, torch.device):
        return True
    return isinstance(arguments, str) and device_named(arguments) is not None


def _apart(rerun: Iterable[torch.Tensor], given: list[torch.Tensor]) -> float:
    """The largest difference between a rerun's tensors and the call's (nan against nan: none; shapes or counts
    apart: infinite)."""
    rerun = list(rerun)
    if len(rerun) != len(given):
        return math.inf
    return max((_difference(a.cpu(), b.cpu()) for a, b in zip(rerun, given)), default=0.0)


def _difference(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return math.inf
    if not (a.is_floating_point() or a.is_complex()):
        return float((a != b).sum())
    wide = torch.complex128 if a.is_complex() or b.is_complex() else torch.float64
    a, b = a.to(wide), b.to(wide)
    apart = (a - b).abs().masked_fill((a == b) | (a.isnan() & b.isnan()), 0)  # an infinity against itself: none
    return float(apart.nan_to_num(math.inf).max()) if apart.numel() else 0.0
