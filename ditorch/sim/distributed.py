"""``simccl``: the sim device's collective library, c10d's own collectives run by gloo on the host memory.

``torch.distributed.init_process_group("simccl")`` (or ``"nccl"`` under ditorch's transfer) makes a
``SimProcessGroup``. PyTorch 2.13 cannot construct a Python subclass of c10d's ``Backend`` (its binding has
no constructor for Python), so a Python creator returns a ``ProcessGroup`` subclass, which c10d uses as the
group itself (``_new_process_group_helper``). Into it goes a gloo ``Backend``, registered for the "sim" and
"cpu" device types: c10d's dispatcher finds it for both, the group gets its name from it (functional
collectives and ``DeviceMesh`` look groups up by name), and every collective this class does not adapt runs
there. A sim tensor reaches gloo as the CPU tensor holding its values (the sim device runs a c10d op's CPU
kernel as it runs any op's), so gloo works on the device's memory in place, asynchronously, with no copy.

What the class adds to gloo: ``ReduceOp.AVG`` on integers and ``PREMUL_SUM`` (gloo has neither), float32
staging of bfloat16/float16 reductions (``DITORCH_REDUCE_LOW_PRECISION_IN_FP32``), works that are done only
once such a reduction is finished (``ditorch.distributed_adapters.FinishingWork``), and an error naming the
call for what it does not implement, instead of the dispatcher's "No backend type associated with ...".

>>> dist.init_process_group("simccl")                  # doctest: +SKIP
>>> dist.all_reduce(torch.ones(2, device="sim"), op=dist.ReduceOp.AVG)
"""

from __future__ import annotations

import atexit
import inspect
import threading
import weakref

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d  # AllgatherOptions is not re-exported by torch.distributed

from .. import distributed_adapters as adapters
from .. import env
from ..show_as_cuda import real_device
from . import fault_injection

NAME = "simccl"
DEVICE_TYPES = ("sim", "cpu")
_lock = threading.Lock()
_registered = False
_hidden = False  # hide_from_dynamo has run
_LIVE: weakref.WeakSet = weakref.WeakSet()  # the groups whose unwaited collectives must end before the interpreter


def _unsupported(name: str, detail: str = "") -> NotImplementedError:
    return NotImplementedError(f"sim's process group does not implement {name}{detail}")


class SimProcessGroup(dist.ProcessGroup):
    """Collectives over sim (or CPU) tensors, run by gloo through c10d's dispatcher (see the module's doc)."""

    def __init__(self, store, rank: int, size: int, timeout) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # an overload missing from torch's stub
        gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._gloo = gloo
        # The plain group that hands each collective to c10d's dispatcher (this class's methods override it).
        self._c10d = dist.ProcessGroup(store, rank, size)
        for device_type in self.device_types():
            device = torch.device(device_type)
            self._c10d._register_backend(device, dist.ProcessGroup.BackendType.GLOO, gloo)
            self._register_backend(device, dist.ProcessGroup.BackendType.CUSTOM, gloo)
        # Python code reads a sim tensor's device as cuda (show-as-cuda) and asks the group for that device's backend
        # (torch 2.14's batch_isend_irecv: `group._get_backend(tensor.device)`); collectives still dispatch on the
        # real device type.
        self._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.CUSTOM, gloo)
        self._in_fp32 = bool(env.read(adapters.VARIABLE))
        self._pending: list[adapters.FinishingWork] = []
        self._pending_lock = threading.Lock()
        _LIVE.add(self)

    @staticmethod
    def device_types() -> tuple[str, ...]:
        """The device types this group serves: sim's (when the sim device is registered) and the CPU."""
        return tuple(t for t in DEVICE_TYPES if t == "cpu" or torch._C._get_privateuse1_backend_name() == t)

    def getBackendName(self) -> str:  # noqa: N802 - ProcessGroup's name
        return NAME

    # -- what runs where: checks here, the collective in gloo, the finishing step in FinishingWork --------------

    def _check(self, name: str, tensors) -> None:
        for tensor in tensors:
            device_type = real_device(tensor).type
            if device_type not in DEVICE_TYPES:
                raise _unsupported(name, f" on {device_type} tensors (only sim and cpu ones)")
            if tensor.is_complex():
                raise _unsupported(name, f" on complex tensors ({tensor.dtype})")

    def _plan(self, name: str, op, dtype: torch.dtype) -> adapters.Reduction:
        kind = adapters.op_name(op)
        if kind in adapters.BITWISE and (dtype.is_floating_point or dtype.is_complex):
            raise _unsupported(name, f" with ReduceOp.{kind} on {dtype} (bitwise ops take integer tensors)")
        if kind == "PREMUL_SUM" and not dtype.is_floating_point:
            raise _unsupported(name, f" with ReduceOp.PREMUL_SUM on {dtype} (floating-point tensors only)")
        return adapters.Reduction(op, dtype, self.size(), emulate_avg=False, in_fp32=self._in_fp32,
                                  emulate_premul=True)

    def _work(self, work, result, finish=None, name: str = "") -> adapters.FinishingWork:
        faults = fault_injection.TABLE.for_collective(name) if fault_injection.TABLE.active else ()
        if faults:  # a faulty link or collective library: the result changed once the collective has finished
            tensors = [t for part in result for t in (part if isinstance(part, (list, tuple)) else [part])]
            dtypes = {t.dtype for t in tensors}
            delay = sum(f.value for f in faults if f.kind == "slow" and f.applies(dtypes)) / 1000.0
            if delay:  # a slow link: done that much later, whatever the call returned to its caller
                work = _LateWork(work, delay)
            finish = _with_faults(finish, faults, tensors, dtypes)
        finishing = _SimWork(work, result, finish, waits_for_peer=name in _POINT_TO_POINT)
        with self._pending_lock:  # the unfinished ones only: a list as long as the collectives in flight
            self._pending = [w for w in self._pending if not w.is_completed()]
            self._pending.append(finishing)
        return finishing

    def wait_for_pending_works(self) -> None:
        """Wait for every collective this rank started and nobody waited for (a ``full_tensor()`` dropped
        unread). Each finishes with a Python callback on gloo's thread: one left running when the interpreter
        exits aborts the process (``terminate called without an active exception``), and its peers, still
        exchanging with it, fail with "Connection reset by peer". destroy_process_group waits so only for
        c10d's own groups with hooks."""
        with self._pending_lock:
            pending, self._pending = self._pending, []
        for work in pending:
            try:
                work.wait()
            except RuntimeError:  # the collective's own error: the caller never asked for its result
                pass

    def shutdown(self, *args, **kwargs):  # destroy_process_group calls it on every group
        self.wait_for_pending_works()
        return super().shutdown(*args, **kwargs)

    def _reduce_in_place(self, name: str, tensors, opts, run):
        """allreduce, reduce: the output is the input."""
        self._check(name, tensors)
        plan = self._plan(name, opts.reduceOp, tensors[0].dtype)
        if not plan.changes_anything:
            return self._work(run(tensors, opts), tensors, name=name)
        staged = [plan.stage(t, is_output=True, is_input=True) for t in tensors]
        work = run(staged, _with_op(opts, plan.op))
        return self._work(work, tensors, lambda: _finish_all(plan, staged, tensors), name=name)

    def _reduce_scattered(self, name: str, outputs, inputs, opts, run):
        """reduce_scatter (inputs: a list per output), reduce_scatter_single and its coalesced form."""
        flat_inputs = [t for i in inputs for t in (i if isinstance(i, (list, tuple)) else [i])]
        self._check(name, [*outputs, *flat_inputs])
        plan = self._plan(name, opts.reduceOp, outputs[0].dtype)
        if not plan.changes_anything:
            return self._work(run(outputs, inputs, opts), outputs, name=name)
        staged = [plan.stage(t, is_output=True, is_input=False) for t in outputs]

        def stage_input(i):
            if isinstance(i, (list, tuple)):
                return [plan.stage(t, is_output=False, is_input=True) for t in i]
            return plan.stage(i, is_output=False, is_input=True)

        work = run(staged, [stage_input(i) for i in inputs], _with_op(opts, plan.op))
        return self._work(work, outputs, lambda: _finish_all(plan, staged, outputs), name=name)

    # -- reductions ---------------------------------------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        opts = opts if isinstance(opts, dist.AllreduceOptions) else _allreduce_options(opts)
        return self._reduce_in_place("allreduce", tensors, opts, self._c10d.allreduce)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts or dist.AllreduceCoalescedOptions()
        return self._reduce_in_place("allreduce_coalesced", tensors, opts, self._c10d.allreduce_coalesced)

    def reduce(self, tensors, opts=None):
        return self._reduce_in_place("reduce", tensors, opts or dist.ReduceOptions(), self._c10d.reduce)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        return self._reduce_scattered("reduce_scatter", outputs, input_lists, opts or dist.ReduceScatterOptions(),
                                      self._c10d.reduce_scatter)

    def reduce_scatter_single(self, output, input, opts=None):  # noqa: A002 - ProcessGroup's signature
        def run(outputs, inputs, opts):
            return self._c10d._reduce_scatter_base(outputs[0], inputs[0], opts)  # its name in every torch

        return self._reduce_scattered("reduce_scatter_single", [output], [input],
                                      opts or dist.ReduceScatterOptions(), run)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self._reduce_scattered("reduce_scatter_tensor_coalesced", outputs, inputs,
                                      opts or dist.ReduceScatterOptions(),
                                      self._c10d.reduce_scatter_tensor_coalesced)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- data movement: gloo as it is --------------------------------------------------------------------------

    def broadcast(self, tensors, opts=None):
        self._check("broadcast", tensors)
        return self._work(self._c10d.broadcast(tensors, opts or dist.BroadcastOptions()), tensors, name="broadcast")

    def allgather(self, output_lists, inputs, opts=None):
        self._check("allgather", [*inputs, *(t for outputs in output_lists for t in outputs)])
        work = self._c10d.allgather(output_lists, inputs, opts or _c10d.AllgatherOptions())
        return self._work(work, output_lists, name="allgather")

    def all_gather_single(self, output, input, opts=None):  # noqa: A002 - ProcessGroup's signature
        self._check("all_gather_single", [output, input])
        # NCCL takes any contiguous output of world_size times the input's elements (SyncBatchNorm gathers into a
        # (1, world * n) one), gloo only the inputs joined along dimension 0: gloo gathers into flat views
        flat = output.is_contiguous() and output.numel() == self.size() * input.numel()
        gathered, sent = (output.view(-1), input.reshape(-1)) if flat else (output, input)
        work = self._c10d._allgather_base(gathered, sent, opts or _c10d.AllgatherOptions())  # its name in every torch
        return self._work(work, [output], name="all_gather_single")

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        self._check("allgather_into_tensor_coalesced", [*outputs, *inputs])
        work = self._c10d.allgather_into_tensor_coalesced(outputs, inputs, opts or _c10d.AllgatherOptions())
        return self._work(work, outputs, name="allgather_into_tensor_coalesced")

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        raise _unsupported("allgather_coalesced", " (deprecated by PyTorch: use all_gather_into_tensor in "
                           "torch.distributed._coalescing_manager)")

    def gather(self, output_lists, inputs, opts=None):
        self._check("gather", [*inputs, *(t for outputs in output_lists for t in outputs)])
        work = self._c10d.gather(output_lists, inputs, opts or dist.GatherOptions())
        return self._work(work, output_lists, name="gather")

    def scatter(self, outputs, input_lists, opts=None):
        self._check("scatter", [*outputs, *(t for inputs in input_lists for t in inputs)])
        work = self._c10d.scatter(outputs, input_lists, opts or dist.ScatterOptions())
        return self._work(work, outputs, name="scatter")

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):  # noqa: A002
        self._check("all_to_all_single", [output, input])
        work = self._c10d.alltoall_base(output, input, output_split_sizes, input_split_sizes,  # in every torch
                                        opts or _c10d.AllToAllOptions())
        return self._work(work, [output], name="all_to_all_single")

    alltoall_base = all_to_all_single

    def alltoall(self, outputs, inputs, opts=None):
        self._check("alltoall", [*outputs, *inputs])
        work = self._c10d.alltoall(outputs, inputs, opts or _c10d.AllToAllOptions())
        return self._work(work, outputs, name="alltoall")

    def send(self, tensors, dst: int, tag: int = 0):
        self._check("send", tensors)
        return self._work(self._c10d.send(tensors, dst, tag), tensors, name="send")

    def recv(self, tensors, src: int, tag: int = 0):
        self._check("recv", tensors)
        return self._work(self._c10d.recv(tensors, src, tag), tensors, name="recv")

    def recv_anysource(self, tensors, tag: int = 0):
        self._check("recv_anysource", tensors)
        return self._work(self._c10d.recv_anysource(tensors, tag), tensors, name="recv_anysource")

    def barrier(self, opts=None):
        return self._work(self._c10d.barrier(opts or dist.BarrierOptions()), [])

    def monitored_barrier(self, timeout=None, wait_all_ranks: bool = False):
        monitored = self._gloo.monitored_barrier  # type: ignore[attr-defined]  # gloo's, missing from the stub
        return monitored(timeout, wait_all_ranks) if timeout else monitored(wait_all_ranks=wait_all_ranks)

    # -- group management this group does not do --------------------------------------------------------------

    def split_group(self, *args, **kwargs):
        raise _unsupported("split_group", " (use torch.distributed.new_group)")

    def merge_remote_group(self, *args, **kwargs):
        raise _unsupported("merge_remote_group")

    def _start_coalescing(self, device):
        raise _unsupported("_start_coalescing", " (collectives run one by one; batch_isend_irecv does so)")

    def _end_coalescing(self, device):
        raise _unsupported("_end_coalescing")


def _with_faults(finish, faults, tensors: list, dtypes: set):
    def finished() -> None:
        if finish is not None:
            finish()
        fault_injection.TABLE.after(faults, dtypes, tensors)

    return finished


_POINT_TO_POINT = frozenset({"send", "recv", "recv_anysource"})


class _SimWork(adapters.FinishingWork):
    """A collective on sim. Its future, once taken, is complete: waited for on the thread that takes it, as an NCCL
    collective's future is complete to the host once the collective is queued on its stream. So the program's
    callbacks run on the program's thread, in ``then()``, as on a GPU. Completed on gloo's threads, they ran there,
    and callbacks that wait for a collective of their own (PowerSGD's hook does, for each bucket) could hold both of
    gloo's threads while the collectives they wait for queued behind them: a deadlock no GPU has. Sim runs every
    kernel before returning, so a device's overlap of the collective with the program's work is not lost here.

    A point-to-point work (``waits_for_peer``) is the exception: its transfer needs the peer's matching call, which
    may come after this rank's ``get_future()`` (both ranks take their send's future before they receive); waited
    for there it would deadlock, where NCCL returns at once. Its future completes on a thread of its own, when the
    transfer has (a callback reading a received tensor then reads its values, which on a GPU the stream's order
    gives); one thread a work, made only when its future is taken, which few programs do."""

    def __init__(self, work, result: list, finish=None, *, waits_for_peer: bool = False) -> None:
        super().__init__(work, result, finish)
        self._waits_for_peer = waits_for_peer
        self._taken: torch.futures.Future | None = None

    def get_future(self) -> torch.futures.Future:
        if self._taken is None:
            self._taken = torch.futures.Future()
            if self._waits_for_peer:
                threading.Thread(target=self._settle, args=(self._taken,), name="simccl point-to-point",
                                 daemon=True).start()
            else:
                self._settle(self._taken)
        return self._taken

    def _settle(self, done: torch.futures.Future) -> None:
        try:
            self.wait()
        except Exception as error:  # the library's error, at the future's wait() as on a GPU
            done.set_exception(error)
        else:
            done.set_result(self._result)


class _LateWork:
    """A collective's library work, done ``delay`` seconds after the library's own (sim's ``slow`` fault): its future
    completes on a timer thread, never on the caller's (a future already done would run ``FinishingWork``'s callback
    inline, in the call)."""

    def __init__(self, work, delay: float) -> None:
        self._work = work
        self._done: torch.futures.Future = torch.futures.Future()
        timer = threading.Timer(delay, self._release)
        timer.daemon = True
        timer.start()

    def _release(self) -> None:
        try:
            self._work.wait()
        except Exception as error:  # the library's error becomes the caller's at its wait
            self._done.set_exception(error)
        else:
            self._done.set_result(None)

    def get_future(self) -> torch.futures.Future:
        return self._done

    def wait(self, timeout=None) -> bool:
        self._done.wait()
        return True

    def is_completed(self) -> bool:
        return self._done.done()

    def exception(self):
        return self._work.exception()


def _allreduce_options(op) -> dist.AllreduceOptions:
    opts = dist.AllreduceOptions()
    if op is not None:  # a ReduceOp passed where the options go (ProcessGroup.allreduce(tensors, op))
        opts.reduceOp = op if isinstance(op, dist.ReduceOp) else dist.ReduceOp(op)
    return opts


def _finish_all(plan: adapters.Reduction, staged: list, targets: list) -> None:
    for staged_tensor, target in zip(staged, targets):
        plan.finish(staged_tensor, target)


def _with_op(opts, op):
    """A copy of the options ``opts`` with the reduce op ``op`` (the caller's stay as they were)."""
    copy = type(opts)()
    for field in ("rootRank", "rootTensor", "timeout", "asyncOp"):
        if hasattr(opts, field):
            setattr(copy, field, getattr(opts, field))
    copy.reduceOp = op if isinstance(op, dist.ReduceOp) else dist.ReduceOp(op)
    return copy


def hide_from_dynamo() -> None:
    """Make compiled code call the group's methods instead of tracing them. c10d's groups are C++, which dynamo
    calls as they are; this one is Python, and dynamo inlined its collectives (DDP's forward under
    ``torch.compile(DDP(model))`` broadcasts) until it met an attribute it cannot trace ("opaque object",
    ``UnsafeScriptObjectError``). Run at the first ``torch.compile`` (``COMPILE_PREPARE``): importing dynamo costs a
    second, which a run that never compiles does not pay. Idempotent."""
    global _hidden
    with _lock:
        if _hidden:
            return
        import torch._dynamo

        for name, method in list(vars(SimProcessGroup).items()):  # plain functions: a staticmethod stays as it is
            if inspect.isfunction(method) and not name.startswith("__"):
                setattr(SimProcessGroup, name, torch._dynamo.disable(method))
        _hidden = True


def _create(store, rank: int, size: int, timeout) -> SimProcessGroup:
    return SimProcessGroup(store, rank, size, timeout)


def register() -> None:
    """Make ``simccl`` a torch.distributed backend for sim (and CPU) tensors. Idempotent."""
    global _registered
    with _lock:
        if _registered or not dist.is_available():
            return
        dist.Backend.register_backend(NAME, _create, devices=list(DEVICE_TYPES))
        atexit.register(_wait_for_live_groups)  # a script that exits without destroy_process_group
        _registered = True


def _wait_for_live_groups() -> None:
    for group in list(_LIVE):
        group.wait_for_pending_works()
