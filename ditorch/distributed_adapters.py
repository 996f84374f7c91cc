"""The original ditorch's distributed adapters: what a backend's collective library lacks, done around it.

Two adaptations of the reductions (``all_reduce``, ``reduce``, ``reduce_scatter``, ``reduce_scatter_tensor``
and its newer name ``reduce_scatter_single``, which it calls in torch 2.13):

- ``ReduceOp.AVG`` where the library lacks it (its adapter says ``CCL_SUPPORTS_AVG = False``): run as SUM, then
  divide by the group's size (truncating for integers, as NCCL's integer average does);
- ``DITORCH_REDUCE_LOW_PRECISION_IN_FP32=1``: bfloat16/float16 reductions carried in float32 (cast up, reduce,
  copy back), at the cost of a float32 copy of each tensor and one more copy per collective.

A backend whose process group does both itself (sim's ``simccl``: ``CCL_ADAPTS_REDUCTIONS = True``) is left
alone; for the others ``apply`` wraps ``torch.distributed``'s four reductions. ``Reduction`` is the plan both
share; ``FinishingWork`` is the async work that is done once the library's work and the copy back are.

>>> import torch.distributed as dist                                   # doctest: +SKIP
>>> dist.all_reduce(t, op=dist.ReduceOp.AVG)  # on hccl, as SUM then t /= world size
"""

from __future__ import annotations

import functools
import threading

import torch
import torch.distributed as dist

from . import env

VARIABLE = "DITORCH_REDUCE_LOW_PRECISION_IN_FP32"
LOW_PRECISION = (torch.bfloat16, torch.float16)
BITWISE = ("BAND", "BOR", "BXOR")


def reductions() -> tuple[str, ...]:
    """The ``torch.distributed`` reductions ``apply`` wraps. In torch 2.13 reduce_scatter_tensor and
    _reduce_scatter_base call reduce_scatter_single, looked up in distributed_c10d; in torch 2.11 (no
    reduce_scatter_single) _reduce_scatter_base calls reduce_scatter_tensor, which calls the process group itself."""
    return ("all_reduce", "reduce", "reduce_scatter",
            "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor")


class FinishingWork(dist._Work):
    """An asynchronous collective that is done once the library's ``work`` is done and ``finish`` (copy back,
    divide) has run; ``wait()``, ``is_completed()`` and ``get_future()`` say so. ``result()`` is the caller's
    tensors, not the staged ones."""

    def __init__(self, work, result: list, finish=None) -> None:
        super().__init__()
        self._work = work
        self._result = result
        self._finish = finish
        self._lock = threading.Lock()
        self._waited = False  # gloo's reduce_scatter work never says is_completed(), even after wait()
        # One wait on the library's work: gloo's point-to-point works wait for another transfer when waited again
        # (a program's wait after its future's, then the group's shutdown), so a second waiter waits for the first.
        self._waiting = threading.Lock()
        try:
            future = work.get_future()
        except RuntimeError:  # a work without a future (some point-to-point works): finished on wait()
            future = None
        # Chained now, so the copy back happens when the library finishes, whoever looks.
        self._future = future.then(self._on_done) if future is not None else None

    def _complete(self) -> list:
        with self._lock:
            if self._finish is not None:
                finish, self._finish = self._finish, None
                finish()
        return self._result

    def _on_done(self, future) -> list:
        future.value()  # the library's error, if any, becomes this work's
        return self._complete()

    def wait(self, timeout=None) -> bool:
        with self._waiting:
            if self._waited:
                return True
            if timeout is None:
                self._work.wait()
            else:
                self._work.wait(timeout)
            if self._future is not None:
                self._future.wait()
            else:
                self._complete()
            self._waited = True
        return True

    def is_completed(self) -> bool:
        if self._future is not None:
            return self._future.done()
        return self._waited or (self._work.is_completed() and self._finish is None)

    def is_success(self) -> bool:
        return self.is_completed() and self.exception() is None

    def exception(self):
        return self._work.exception() if hasattr(self._work, "exception") else None

    def result(self) -> list:
        self.wait()
        return self._result

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            self.wait()
            done: torch.futures.Future = torch.futures.Future()
            done.set_result(self._result)
            return done
        return self._future


def op_name(op) -> str:
    kind = getattr(op, "op", op)  # a ReduceOp carries its RedOpType; a RedOpType is one
    return getattr(kind, "name", str(kind))


def premul_factor(op):
    """The factor of a ``PREMUL_SUM`` ``ReduceOp`` (``_make_nccl_premul_sum(factor)``): its ``factor`` (torch
    2.13), else the second item of its state, where torch 2.11 keeps it."""
    factor = getattr(op, "factor", None)
    if factor is None:
        state = op.__getstate__()
        factor = state[1] if len(state) > 1 else None
    if factor is None:
        raise ValueError(f"ReduceOp.PREMUL_SUM {op!r} carries no factor")
    return factor


class Reduction:
    """How one reduction runs in a library lacking AVG/PREMUL_SUM, or carried in float32: the op the library
    gets, the tensors it works on (``stage``), and what finishes it (``finish``, after the library's work)."""

    def __init__(self, op, dtype: torch.dtype, world_size: int, *, emulate_avg: bool, in_fp32: bool,
                 emulate_premul: bool = False) -> None:
        name = op_name(op)
        self.name = name
        self.upcast = in_fp32 and dtype in LOW_PRECISION
        self.factor = None
        self.divisor = None
        compute_dtype = torch.float32 if self.upcast else dtype
        integral = not (compute_dtype.is_floating_point or compute_dtype.is_complex)
        self.op = op
        if name == "AVG" and (emulate_avg or integral):
            self.op, self.divisor = dist.ReduceOp.SUM, world_size
        elif name == "PREMUL_SUM" and emulate_premul:
            self.op, self.factor = dist.ReduceOp.SUM, premul_factor(op)
        self.integral = integral

    @property
    def changes_anything(self) -> bool:
        return self.upcast or self.factor is not None or self.divisor is not None

    def stage(self, tensor: torch.Tensor, *, is_output: bool, is_input: bool) -> torch.Tensor:
        """The tensor the library works on in place of ``tensor``: itself, or a float32/scaled copy."""
        staged = tensor
        if self.upcast:
            staged = tensor.float() if is_input else torch.empty_like(tensor, dtype=torch.float32)
        if self.factor is not None and is_input:
            staged = staged * self.factor  # a copy: the caller's input stays as it was
        return staged

    def finish(self, staged: torch.Tensor, target: torch.Tensor) -> None:
        """After the library's work: divide for AVG, copy back into the caller's tensor."""
        with torch.no_grad():
            if self.divisor is not None:
                if self.integral:
                    staged.copy_(torch.div(staged, self.divisor, rounding_mode="trunc"))
                else:
                    staged.div_(self.divisor)
            if staged is not target:
                target.copy_(staged)


def _wrap_all_reduce(fn, emulate_avg: bool, in_fp32: bool):
    @functools.wraps(fn)
    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        plan = Reduction(op, tensor.dtype, dist.get_world_size(group), emulate_avg=emulate_avg, in_fp32=in_fp32)
        if not plan.changes_anything or _coalescing(group):
            return _after(fn(tensor, op, group, async_op), async_op, [tensor], None)
        staged = plan.stage(tensor, is_output=True, is_input=True)
        work = fn(staged, plan.op, group, async_op)
        return _after(work, async_op, [tensor], lambda: plan.finish(staged, tensor))

    return all_reduce


def _wrap_reduce(fn, emulate_avg: bool, in_fp32: bool):
    @functools.wraps(fn)
    def reduce(tensor, dst=None, op=dist.ReduceOp.SUM, group=None, async_op=False, group_dst=None):
        plan = Reduction(op, tensor.dtype, dist.get_world_size(group), emulate_avg=emulate_avg, in_fp32=in_fp32)
        given = {"group_dst": group_dst} if group_dst is not None else {}  # torch 2.5 on; no such argument before
        if not plan.changes_anything or _coalescing(group):
            return _after(fn(tensor, dst, op, group, async_op, **given), async_op, [tensor], None)
        staged = plan.stage(tensor, is_output=True, is_input=True)
        work = fn(staged, dst, plan.op, group, async_op, **given)
        return _after(work, async_op, [tensor], lambda: plan.finish(staged, tensor))

    return reduce


def _wrap_reduce_scatter(fn, emulate_avg: bool, in_fp32: bool):
    @functools.wraps(fn)
    def reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
        plan = Reduction(op, output.dtype, dist.get_world_size(group), emulate_avg=emulate_avg, in_fp32=in_fp32)
        if not plan.changes_anything or _coalescing(group):
            return _after(fn(output, input_list, op, group, async_op), async_op, [output], None)
        staged = plan.stage(output, is_output=True, is_input=False)
        inputs = [plan.stage(t, is_output=False, is_input=True) for t in input_list]
        work = fn(staged, inputs, plan.op, group, async_op)
        return _after(work, async_op, [output], lambda: plan.finish(staged, output))

    return reduce_scatter


def _wrap_reduce_scatter_single(fn, emulate_avg: bool, in_fp32: bool):
    @functools.wraps(fn)
    def reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):  # noqa: A002
        plan = Reduction(op, output.dtype, dist.get_world_size(group), emulate_avg=emulate_avg, in_fp32=in_fp32)
        if not plan.changes_anything or _coalescing(group):
            return _after(fn(output, input, op, group, async_op), async_op, [output], None)
        staged = plan.stage(output, is_output=True, is_input=False)
        work = fn(staged, plan.stage(input, is_output=False, is_input=True), plan.op, group, async_op)
        return _after(work, async_op, [output], lambda: plan.finish(staged, output))

    return reduce_scatter_single


_WRAPPERS = {
    "all_reduce": _wrap_all_reduce, "reduce": _wrap_reduce,
    "reduce_scatter": _wrap_reduce_scatter, "reduce_scatter_single": _wrap_reduce_scatter_single,
    "reduce_scatter_tensor": _wrap_reduce_scatter_single,  # the same arguments
}


def _after(work, async_op: bool, result: list, finish):
    # Async works are wrapped even with nothing to finish: gloo's reduce_scatter work never says is_completed().
    if async_op:
        return FinishingWork(work, result, finish) if work is not None else None
    if finish is not None:
        finish()
    return work


def _coalescing(group) -> bool:
    """Inside ``torch.distributed._coalescing_manager`` a reduction only records itself and runs later, so
    staged copies could not be copied back: those run as the library does them."""
    import torch.distributed.distributed_c10d as c10d

    return (group or c10d._get_default_group()) in c10d._world.pg_coalesce_state


def policy(backend) -> tuple[bool, bool]:
    """``(emulate_avg, in_fp32)`` for ``backend``: what its adapter declares, and the variable."""
    adapter = backend.adapter
    return not getattr(adapter, "CCL_SUPPORTS_AVG", True), bool(env.read(VARIABLE))


def apply(backend, patches) -> None:
    """Wrap ``torch.distributed``'s reductions where ``backend``'s library needs it (see the module's doc)."""
    if not dist.is_available() or getattr(backend.adapter, "CCL_ADAPTS_REDUCTIONS", False):
        return
    emulate_avg, in_fp32 = policy(backend)
    if not (emulate_avg or in_fp32):
        return
    import torch.distributed.distributed_c10d as c10d

    for name in reductions():
        wrapped = _WRAPPERS[name](getattr(c10d, name), emulate_avg, in_fp32)
        for owner in (dist, c10d):  # callers importing either way
            patches.set(owner, name, wrapped)
