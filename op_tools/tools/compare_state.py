"""OpAutoCompare's per-call state (``OpCall.state``): what before() copied, what after() compares, what the backward
needs. Its own module so that the failing calls' saving (``failing_calls.py``) reads it without importing the tool."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:  # annotations only: nothing is imported at run time
    import torch

    from ..numerics.comparison import PendingStats
    from ..numerics.device_math import DeviceMath
    from ..numerics.device_reference import DeviceCopies
    from ..numerics.reference import Reference
    from ..ops.collectives import CollectiveCall


class Launched(NamedTuple):
    """A forward whose float64 reference ran on the device when it returned, its verdict queued."""

    reference: Reference
    stats: PendingStats | None  # its statistics, read with the batch's (None: it is judged on the CPU)
    outputs: int  # how many of the statistics' pairs are outputs (the rest: the written arguments)
    device_args: tuple  # the call's arguments as empty tensors of their dtypes, for a bound that reads them


class CompareState:
    """One call's state, a slot per field where other tools keep a dict (read per call: a slot is faster than a key,
    and a misspelt field fails at once). It holds device tensors and host copies: ``release()``,
    ``release_backward()`` and ``drop_forward()`` let them go as soon as the call no longer needs them."""

    __slots__ = ("written", "skip", "inside", "tensors", "cpu_args", "cpu_kwargs", "compared_writes", "math", "rng",
                 "grad_labels", "device_cpu", "extra", "extra_cpu", "extra_labels", "host_of", "signature",
                 "precedent", "math_used", "owned", "grad_snaps", "reference", "device_out", "ref_out",
                 "saved_forward", "save_dir", "collective", "replay", "func", "region_args", "device_copies",
                 "cross_check", "device_reference", "cpu_reason", "queued", "wants_backward", "grad_ids", "rereads",
                 "launched", "upstream_early", "upstream_kept", "host_inputs")

    # --- set by before() ---
    written: Sequence[torch.Tensor]  # the arguments the op writes (each once; every tensor of an unknown function)
    skip: str | None  # why the call is not compared (counted as skipped there), or None
    inside: bool  # a random composite: run() descends into it and its calls are compared one by one
    # (device tensor, its host copy, whether the cache supplied it) in argument order; after() drops it
    tensors: Sequence[tuple[torch.Tensor, torch.Tensor, bool]]
    cpu_args: tuple | None  # the arguments with host copies for tensors; None: before() did not get that far
    cpu_kwargs: dict | None  # the same for the keyword arguments
    compared_writes: Sequence[torch.Tensor]  # the written arguments whose values are compared (none when unknown)
    math: DeviceMath | None  # what the device declared it computes in (autocast, TF32): the same-dtype reruns' math
    rng: Any  # the device generator's token before the op: another after it means the op drew random numbers
    # a call whose dropout mask is replayed (numerics/attention.py): ((get_state, set_state), the state before it)
    replay: tuple | None
    func: Any  # what the reruns run in place of call.func (the call with its replayed mask); None: call.func
    region_args: tuple  # a compiled graph's device arguments, kept to narrow a failing backward (the call drops them)
    grad_labels: Sequence[str]  # the labels of call.grad_inputs ("input[0]"), for the gradients' rows
    # --- what after() gives _compare_forward (dropped when after() returns, as locals were) ---
    device_cpu: Any  # the result as compared: host copies, or large tensors on their device
    extra: Sequence[int]  # ids of the written arguments the result does not return (host_of keys)
    extra_cpu: Sequence[torch.Tensor]  # their values after the op, as compared
    extra_labels: Sequence[str]  # their labels ("written input[0]")
    host_of: dict[int, torch.Tensor] | None  # id of an argument tensor -> its host copy from before the op
    signature: tuple  # (op, input dtypes, device math): the key of the output dtypes learnt per signature
    # --- set by after() ---
    precedent: tuple  # the signature and input shapes: the key of the same-dtype error history
    math_used: DeviceMath | None  # the part of the device's math the same-dtype rerun applied (None: no rerun)
    owned: set[int] | None  # ids of the written arguments' host copies: the reruns may write into them
    grad_snaps: list[torch.Tensor] | tuple  # host copies of call.grad_inputs: the reference's leaves
    # --- kept for the backward ---
    reference: Reference | None  # the CPU reference run with its graph; None: the backward is not compared
    device_out: tuple | None  # (result, *written arguments) as compared: saved with a failing backward
    ref_out: tuple | None  # the reference's values of the same
    saved_forward: bool  # the forward was saved as failing: its backward is saved beside it
    save_dir: str | None  # the folder the call is saved in ('' past max_saved); None: not decided yet
    # a collective checked against every rank's inputs: the bound call and the host copies of what this rank sent
    collective: tuple[CollectiveCall, list[torch.Tensor]] | None
    # the reference on the device (numerics/device_reference.py): the call's float64 copies there, while cpu_args
    # holds them; None once the call is judged on the CPU (cpu_args then holds host copies)
    device_copies: DeviceCopies | None
    cross_check: bool  # this call runs both references and compares them
    device_reference: Reference | None  # a cross-checked call's device reference, kept for its backward
    cpu_reason: str  # with a device reference asked for: why this call's runs on the CPU ('' on the device)
    # --- a verdict deferred (verdict_queue.py) ---
    queued: bool  # the forward's verdict waits in the queue: the call's backward must wait behind it
    wants_backward: bool  # the call's backward is followed (call.grad_inputs, which the engine empties after after())
    grad_ids: Sequence[int]  # ids of call.grad_inputs: their host copies are the reference's leaves
    rereads: dict[int, torch.Tensor] | None  # id of an input the cache supplied -> it, re-read if the call fails
    launched: Launched | None  # a forward judged later against the device's reference (autocompare._launch_forward)
    # output index -> (host copy of its upstream gradient, whether the cache supplied it), taken as it arrived
    upstream_early: dict[int, tuple[torch.Tensor, bool]] | None
    # output index -> a device copy of its upstream gradient, taken as it arrived (a call whose reference is the
    # device's: its gradients are kept there)
    upstream_kept: dict[int, torch.Tensor] | None
    host_inputs: tuple[int, ...]  # ids of the copies of the call's own host tensors (a device rerun leaves them there)

    def release(self) -> None:
        """Every field back to its default, dropping the tensors and copies held: the call is compared no further."""
        self.written = self.tensors = self.compared_writes = self.grad_labels = self.grad_snaps = self.precedent = ()
        self.region_args = ()
        self.skip = self.cpu_args = self.cpu_kwargs = self.math = self.rng = self.math_used = self.owned = None
        self.inside = self.saved_forward = False
        self.reference = self.device_out = self.ref_out = self.save_dir = self.collective = None
        self.replay = self.func = self.device_copies = self.device_reference = None
        self.cross_check = self.queued = self.wants_backward = False
        self.cpu_reason = ""
        self.grad_ids = ()
        self.upstream_early = self.upstream_kept = None
        self.host_inputs = ()
        self.drop_forward()

    __init__ = release  # a new state is a released one (one call less per handled call)

    def drop_forward(self) -> None:
        """Drop what only after()'s comparison used: the outputs' copies and the written arguments."""
        self.device_cpu = self.host_of = self.rereads = self.launched = None
        self.extra = self.extra_cpu = self.extra_labels = self.signature = ()

    def release_backward(self) -> None:
        """Drop what only the backward's comparison needed: the reference graph, the outputs, the inputs' copies."""
        self.reference = self.device_out = self.ref_out = self.device_reference = self.device_copies = None
        self.grad_snaps = self.region_args = ()
        self.upstream_early = self.upstream_kept = None
