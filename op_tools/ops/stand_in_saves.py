"""What a call run on stand-ins saves for its backward, checked against the originals' version counters.

OpFallback runs a call on CPU copies of the device's tensors, OpDtypeCast on widened copies: the call's autograd node
saves the copies, not the program's tensors. A program that then writes in place into a tensor the node needs (the
result of ``exp``, the input of ``sin``) gets PyTorch's error at ``backward()`` without the tool ("one of the
variables needed for gradient computation has been modified by an inplace operation"), and got none with it: the
copy the node saved was never written, so backward ran on values the program had overwritten, and the user's mistake
was hidden. ``SavedStandIns`` watches what the node saves while the call runs (autograd's saved-tensor hooks, chained
to any the program pushed), and once the call's results are back, ties each saved stand-in to its original and the
version the original holds then; at backward, a saved stand-in whose original's version has moved raises that
error. A tensor the node derives and saves sharing a stand-in's memory (a composite's view of it: ``linear`` saves its
3-d input flattened) is tied to that stand-in's original, whose version counter a view shares on the device too; an
intermediate of the node's own shares no original's memory, and no program can write it.

    saves = SavedStandIns.watching(stand_ins)  # None where nothing can be saved (no grad, a functorch transform)
    with saves or contextlib.nullcontext():
        out = op(*stand_ins)
    if saves is not None and saves.saved():
        saves.tie(pairs, call_name)            # [(stand-in, original, role)], after the originals were written
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .arguments import iter_tensors, storage_address

_autograd: Any = torch._C._autograd
_SUPPORTED = all(hasattr(_autograd, name) for name in (
    "_push_saved_tensors_default_hooks", "_pop_saved_tensors_default_hooks", "_top_saved_tensors_default_hooks",
    "_saved_tensors_hooks_is_enabled"))
if _SUPPORTED:
    _push, _pop = _autograd._push_saved_tensors_default_hooks, _autograd._pop_saved_tensors_default_hooks
    _top, _enabled = _autograd._top_saved_tensors_default_hooks, _autograd._saved_tensors_hooks_is_enabled


_Tie = tuple[weakref.ref, int, str]  # a saved tensor's original, its version at the tie, and its role


class SavedStandIns:
    """Saved-tensor hooks for one call run on stand-ins (see the module's doc)."""

    __slots__ = ("_outer", "_saved", "_tied", "_call")

    def __init__(self) -> None:
        self._outer = _top(True)  # the program's own hooks, chained
        # per tensor saved, in order (its token): a weak reference to it, the same tensor at the tie as it is not
        # one made since, and its memory's place, taken as it is saved (a view made inside the call is gone by then)
        self._saved: list[tuple[weakref.ref, tuple | None]] = []
        self._tied: dict[int, _Tie] = {}  # token -> (original, version, role)
        self._call = ""

    @classmethod
    def watching(cls, stand_ins) -> SavedStandIns | None:
        """A watcher for the call about to run on ``stand_ins``, or None where its node saves none of them: none
        requires grad, grad is disabled, or hooks cannot be pushed (a functorch transform disables them, an older
        torch has none)."""
        if not _SUPPORTED or not torch.is_grad_enabled() or not any(t.requires_grad for t in stand_ins) or \
                not _enabled():
            return None
        return cls()

    def __enter__(self) -> SavedStandIns:
        _push(self._pack, self._unpack)
        return self

    def __exit__(self, *exc) -> None:
        _pop()

    def _pack(self, t: torch.Tensor):
        key = len(self._saved)
        self._saved.append((weakref.ref(t), _memory(t)))
        outer = self._outer
        # an alias without the node: an output the node saves, held as itself, would hold the node that holds it, a
        # cycle through C++ that the garbage collector cannot see (the graph of every call kept alive)
        return (outer[0](t) if outer else t.detach()), key

    def _unpack(self, packed):
        value, key = packed
        tied = self._tied.get(key)
        if tied is not None:
            _check(tied, self._call)
        outer = self._outer
        return outer[1](value) if outer else value

    def saved(self) -> bool:
        """Whether the node saved anything (most calls' nodes save no stand-in: nothing to tie)."""
        return bool(self._saved)

    def tie(self, pairs, call: str) -> None:
        """Tie each saved tensor that is a stand-in of ``pairs`` (``(stand-in, original, role)``: role ``"an
        input"``, ``"output 0"``), or shares one's memory, to its original at the version it holds now."""
        by_id: dict[int, tuple[torch.Tensor, _Tie]] = {}
        by_memory: dict[tuple, _Tie] = {}
        for stand_in, original, role in pairs:
            if original is not stand_in and not original.is_inference():
                tie = (weakref.ref(original), original._version, role)
                by_id.setdefault(id(stand_in), (stand_in, tie))
                memory = _memory(stand_in)
                if memory is not None:
                    by_memory.setdefault(memory, tie)
        for token, (kept, memory) in enumerate(self._saved):
            t = kept()
            mine = by_id.get(id(t)) if t is not None else None
            found = mine[1] if mine is not None and mine[0] is t else by_memory.get(memory) if memory else None
            if found is not None:
                self._tied[token] = found
        self._saved = []
        self._call = call


def _memory(t: torch.Tensor) -> tuple | None:
    """Where ``t``'s memory is (its device and storage: the same for its views), or None: none to share (empty,
    storage-less)."""
    address = storage_address(t)
    return (t.device, address) if address else None


def _check(tied: _Tie, call: str) -> None:
    """PyTorch's error where the original a saved stand-in stands for was written since the call."""
    original, version, role = tied[0](), tied[1], tied[2]
    if original is None or original._version == version:
        return
    try:
        kind = original.type()  # as autograd names it: torch.cuda.FloatTensor
    except Exception:  # noqa: BLE001 - a device torch has no legacy type name for
        kind = f"{original.dtype} on {original.device}"
    shape = ", ".join(str(n) for n in original.shape)
    raise RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"[{kind} [{shape}]], which is {role} of {call}, is at version {original._version}; expected version "
        f"{version} instead. (The call ran on stand-ins under an op_tools tool, which raises the error the device's "
        "autograd would.)")


def result_pairs(stand_in_result, result) -> list[tuple[torch.Tensor, torch.Tensor, str]]:
    """``(stand-in, original, "output i")`` for the tensors of a call's result on stand-ins and of the result handed
    back, in the same structure."""
    return [(s, r, f"output {i}") for i, (s, r) in enumerate(zip(iter_tensors(stand_in_result), iter_tensors(result)))]
