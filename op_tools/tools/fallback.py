"""OpFallback: run handled ops on the CPU and hand the results back on the device, in the original dtype."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch

from ..core.engine import OpCall, OpTool, feature, tool_work
from ..numerics.device_math import DeviceMath, emulated
from ..ops.arguments import UnsupportedInputError, dtensor_class, iter_items, iter_tensors, map_tensors, promoted_dtype
from ..ops.moves import moved
from ..ops.op_facts import op_facts
from ..ops.stand_in_saves import SavedStandIns, result_pairs
from ..ops.writes import WriteSpec, call_writes, carry_version, carry_writes, stand_in_made, writes_overlap
from ..output import reporting

LOW_PRECISION = (torch.float16, torch.bfloat16)
_CPU = torch.device("cpu")


class _StaysOnDeviceError(RuntimeError):
    """A tensor no CPU copy stands in for (a DTensor): the call runs on the device, said not fallen back."""


class CpuCopies:
    """The CPU stand-ins of a call's device tensors, and how to hand results back to the device."""

    def __init__(self, cast: dict | None = None) -> None:
        # (device tensor, cpu tensor, the cpu tensor's version and autograd node as made)
        self.pairs: list[tuple[torch.Tensor, torch.Tensor, int | None, Any]] = []
        self.cast = cast or {}  # dtype -> wider dtype used on the CPU
        # id(device tensor) -> its CPU copy: a tensor passed twice (x.mul_(x), out=x) is one tensor on the CPU too
        self._made: dict[int, torch.Tensor] = {}
        self._dtensor = dtensor_class()  # None until torch.distributed.tensor is imported: no DTensor exists

    def to_cpu(self, obj):
        return _map_values(obj, self._tensor_to_cpu, _device_to_cpu)

    def _tensor_to_cpu(self, t: torch.Tensor) -> torch.Tensor:
        if self._dtensor is not None and isinstance(t, self._dtensor):
            # Its local tensors' ops run under DTensor's dispatch, below any mode, and a sharded tensor cannot move
            # to the CPU as one: the call runs on the device, counted as not fallen back.
            raise _StaysOnDeviceError("a DTensor's call runs on the device")
        if t.is_meta:  # no values to move: the op makes its meta results on the CPU as on the device
            return t.to(self.cast.get(t.dtype, t.dtype))
        if t.device.type == "cpu" and t.dtype not in self.cast:
            return t
        cpu = self._made.get(id(t))
        if cpu is None:
            cpu = self._made[id(t)] = moved(t, _CPU, self.cast.get(t.dtype, t.dtype))  # gradients flow back
            self.pairs.append((t, cpu, *stand_in_made(cpu)))
        return cpu

    def write_back(self, writes: WriteSpec, args: tuple, kwargs: dict) -> None:
        """Device tensors whose CPU copy the call wrote get the new values (``writes.carry_writes``)."""
        carry_writes(self.pairs, writes, args, kwargs)

    def to_device(self, obj, device: torch.device, dtype_back: dict, writes: WriteSpec):
        originals = {id(cpu): device_tensor for device_tensor, cpu, _, _ in self.pairs}

        def back(t: torch.Tensor) -> torch.Tensor:
            original = originals.get(id(t))
            if original is not None:  # the op returned an argument (in-place, out=): the caller's tensor
                return original
            if t.is_leaf and t.requires_grad:  # made by the op (``torch.ones(..., requires_grad=True)``): a leaf
                back_on = t.detach().to(device=device, dtype=dtype_back.get(t.dtype, t.dtype)).requires_grad_()
            else:
                back_on = moved(t, device, dtype_back.get(t.dtype, t.dtype))
            carry_version(back_on, t, writes)  # the version counter the op left on its result (stft's: 2)
            return back_on

        return map_tensors(obj, back)


def _device_to_cpu(value):
    return _CPU if isinstance(value, torch.device) and value.type != "cpu" else value


def _map_values(obj, tensor_fn, other_fn):
    mapped = map_tensors(obj, tensor_fn)
    if isinstance(mapped, dict):
        return {k: (_CPU if k == "device" and v is not None and not isinstance(v, torch.Tensor) else other_fn(v))
                for k, v in mapped.items()}
    if isinstance(mapped, (list, tuple)) and not hasattr(mapped, "_fields"):
        return type(mapped)(other_fn(v) for v in mapped)
    return mapped


def _low_precision_dtypes(*objs) -> list[torch.dtype]:
    found = []
    for obj in objs:
        for t in iter_tensors(obj):
            if t.dtype in LOW_PRECISION and t.dtype not in found:
                found.append(t.dtype)
    return found


def _mixes_devices(obj) -> bool:
    """Whether the tensors in ``obj`` are on two devices other than the CPU, or on one beside a CPU tensor of
    dim > 0 (a CPU scalar goes with any device): what a device refuses, unless the op takes indices."""
    device, cpu = None, False
    for t in iter_tensors(obj):
        if t.device.type == "cpu":
            cpu = cpu or t.dim() > 0
        elif t.device.type != "meta":
            if device is not None and t.device != device:
                return True
            device = t.device
    return cpu and device is not None


# What PyTorch says where the CPU has no kernel of an op for a dtype (``"addmm_impl_cpu_" not implemented for 'Half'``)
_NO_KERNEL = "not implemented for"


@feature("fallback")
class OpFallback(OpTool):
    """Run every handled op on the CPU (the list variables narrow it down); results come back on the device.

    If the CPU kernel rejects float16/bfloat16 the op runs in float32 and results are cast back.
    In-place ops and ``out=`` update the device tensors; autograd flows through the CPU copies. Under the user's
    autocast the CPU run casts as the device's autocast would (``device_math``), so the op returns what it returns
    on the device.

    A call that mixes devices (a CPU tensor of dim > 0 beside a device's; index ops aside) or that the CPU cannot run
    runs on the device, as without the tool: the device's exception, the user's, propagates unchanged; a call it
    runs is counted as not fallen back.

    Keyword arguments (each overrides its variable): ``ops``, ``disable`` (``OP_FALLBACK_LIST``/``_DISABLE_LIST``:
    lists of op names, patterns or functions), and ``results_dir``, ``verbose``, ``print_stack``, ``strict``,
    ``print_ranks`` as every tool.

    >>> with op_tools.OpFallback(ops=["torch.nn.functional.silu"]):   # or OP_FALLBACK_LIST=torch.nn.functional.silu
    ...     loss = model(x).sum(); loss.backward()
    """

    hook_name = "OpFallbackHook"
    env_prefix = "OP_FALLBACK"
    handles_transformed = True  # functorch's tensors move to the CPU and back as any (``moved``)
    changes_saved_tensors = True  # the CPU's tensors
    replaces_runs = True
    runs_off_device = True

    def accepts(self, name: str) -> bool:
        # Device moves must stay device moves, views must keep aliasing their base, and a collective runs with every
        # other rank on the device's communication library (NCCL takes no host tensors).
        facts = op_facts(name)
        return not facts.conversion and not facts.view and not facts.collective and \
            not name.startswith("torch.Tensor.__get")

    def run(self, call: OpCall):
        if not op_facts(call.name).mixes_devices and _mixes_devices((call.args, call.kwargs)):
            # On the CPU the call would run, hiding the user's mistake (most ops on a device refuse it): the device
            # decides, as without the tool.
            return self._run_on_device(call, UnsupportedInputError("calls mixing devices run on the device"))
        writes = call_writes(call.name)
        if writes_overlap(writes, call.args, call.kwargs):
            # Its CPU copies share no memory: the call would run there, computing what the device refuses (or
            # computes otherwise, reading what it wrote). The device decides, as without the tool.
            return self._run_on_device(call, UnsupportedInputError(
                "a tensor the call writes shares memory with another of its tensors"))
        failed: Exception | None = None
        try:
            copies, args, kwargs, cpu_result, dtype_back, saves = self._run_on_cpu(call)
        except _StaysOnDeviceError as error:
            failed = UnsupportedInputError(str(error))
        except (RuntimeError, NotImplementedError) as error:  # a kernel's failures; not a hook's control flow (a
            # checkpoint's recomputation stops by raising): the device decides whether the error is the user's
            failed = error
        if failed is not None:  # outside the handler: the device's error, the user's, carries no trace of the CPU's
            return self._run_on_device(call, failed)
        with tool_work():
            copies.write_back(writes, call.args, call.kwargs)
            result = copies.to_device(cpu_result, call.device, dtype_back, writes)
            if saves is not None and saves.saved():  # the node's saved copies, tied to the device's tensors now
                saves.tie([(cpu, device, "an input") for device, cpu, _, _ in copies.pairs]
                          + result_pairs(cpu_result, result), call.name)
            call.state.update(cpu_args=args, cpu_kwargs=kwargs, cpu_result=cpu_result)
            return result

    def _run_on_cpu(self, call: OpCall) -> tuple:
        """The call run on CPU copies of its arguments: (copies, cpu args, cpu kwargs, cpu result, dtype_back, the
        watcher of what its node saves or None)."""
        with tool_work(), emulated(DeviceMath.of(call.device).autocast_only()):
            copies = CpuCopies()
            args, kwargs = copies.to_cpu(call.args), copies.to_cpu(call.kwargs)
            saves = SavedStandIns.watching([cpu for _, cpu, _, _ in copies.pairs])
            try:
                with saves or contextlib.nullcontext():
                    return copies, args, kwargs, call.runs(*args, **kwargs), {}, saves
            except (RuntimeError, NotImplementedError) as error:
                low = _low_precision_dtypes(call.args, call.kwargs)
                if not low or _NO_KERNEL not in str(error):  # a dtype error of the call's own (linear of float32
                    # by float16) stays the user's: in float32 the call would run where the device refuses it
                    raise
                # The CPU has no kernel for this dtype: compute in float32, hand back the original dtype.
                copies = CpuCopies({dtype: torch.float32 for dtype in low})
                args, kwargs = copies.to_cpu(call.args), copies.to_cpu(call.kwargs)
                saves = SavedStandIns.watching([cpu for _, cpu, _, _ in copies.pairs])
                try:
                    with saves or contextlib.nullcontext():
                        cpu_result = call.runs(*args, **kwargs)
                except (RuntimeError, NotImplementedError):
                    raise error from None
                # Outputs in the dtype the float32 copies promote to get the one the caller's tensors promote to
                # (float16 + float32 stays float32), unless the call names its dtype (OpDtypeCast's rule).
                wide, plain = promoted_dtype(args, kwargs), promoted_dtype(call.args, call.kwargs)
                named = any(isinstance(v, torch.dtype) for _, v in iter_items((call.args, call.kwargs)))
                dtype_back = {} if named or wide is None or plain is None else {wide: plain}
                return copies, args, kwargs, cpu_result, dtype_back, saves

    def _run_on_device(self, call: OpCall, why: Exception):
        """The call run as without the tool, for ``why`` (the CPU's failure): an exception raised here is the one
        the user gets without the tool, and propagates; else the call is counted as not fallen back."""
        result = call.runs(*call.args, **call.kwargs)
        if self.common.strict:
            raise why
        with tool_work():
            self.tool_failed(call, why)
        return result

    def after(self, call: OpCall) -> None:
        state = call.state
        if self._logger.isEnabledFor(logging.DEBUG) and "cpu_result" in state:  # not run on the device instead
            rows = reporting.value_rows(f"{call.name} inputs", call.args, call.kwargs)
            rows += reporting.value_rows(f"{call.name} cpu_inputs", state["cpu_args"], state["cpu_kwargs"])
            rows += reporting.value_rows(f"{call.name} cpu_outputs", reporting.as_tuple(state["cpu_result"]))
            rows += reporting.value_rows(f"{call.name} outputs", reporting.as_tuple(call.result))
            self._logger.debug(reporting.header(call.name, call.forward_id, call.location) + "\n"
                           + reporting.call_table(call.name, rows))
        state.clear()
