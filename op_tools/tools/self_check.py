"""OpSelfCheck: an always-on fault detector. Calls are checked on their device by an invariant of their op
(``numerics/invariants.py``: a matrix product's column checksum, a softmax's row sums), with no CPU reference, and
within a budget of the run's time.

Each checked call adds a few small kernels (a reduction and a matrix-vector product in float64) whose result, one
number, is kept on the device and read back with others in batches of ``READBACK_BATCH`` calls without blocking
(``numerics/device_readback.py``): no host synchronisation in a step. A result above 1 is a finding: the op, its
module path, the rank, the step and by how much it exceeds what rounding allows.

**The budget** (``budget=0.02``, ``OP_SELF_CHECK_BUDGET``) is a share of the run's wall time since the tool started.
The tool times its own work per checked call; a call is checked while that total stays within the budget, and the
first call of each call site (op and source line) always is, so every kind of op is covered early; the rest are
counted as not checked (budget). Which calls are checked depends on timing, never on values: a fault that persists is
found at the first checked call of its site.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import re
import threading
import time

import torch

from ..config.variables import SELF_CHECK_BUDGET, OpFilter
from ..core import shards
from ..core.engine import OpCall, OpTool, feature, tool_work
from ..numerics import collective_checksum, invariants, sampled_reference
from ..numerics.device_math import DeviceMath
from ..numerics.device_readback import DeviceReadback
from ..ops.arguments import is_dtensor
from ..ops.collectives import collective_call
from ..output import result_files

READBACK_BATCH = 64  # checked calls whose results travel to the host together: one copy, no synchronisation
BUDGET_SKIPPED = "not checked (budget)"
EXACT_SKIPPED = "not checked (integer result)"  # exact arithmetic (positions, indices): nothing to round, out of scope
COLLECTIVES_FIRST, COLLECTIVES_EVERY = 2, 8  # a group's first two calls of a collective checked, then one in 8
FINDINGS_WRITTEN = 100  # findings kept in a rank's file (the first ones: the first is where to look)


@dataclasses.dataclass(frozen=True)
class Finding:
    """A checked call whose invariant failed."""

    op: str
    check: str  # "column checksum", "row sums"
    excess: float  # the violation as a multiple of what rounding allows (> 1)
    module: str
    step: int
    rank: int | None
    forward_id: int
    location: str
    time: float = 0.0  # wall-clock seconds (time.time()) when the call started

    def record(self) -> dict:
        return {"op": self.op, "check": self.check, "excess": self.excess, "module": self.module, "step": self.step,
                "rank": self.rank, "forward_id": self.forward_id, "location": self.location,
                "time": round(self.time, 6)}

    def __str__(self) -> str:
        where = f" in {self.module}" if self.module else ""
        rank = f", rank {self.rank}" if self.rank is not None else ""
        return (f"{self.op}{where} (forward, step {self.step}{rank}, forward_id {self.forward_id}) fails its "
                f"{self.check}: {self.excess:.3g}x what rounding allows\n{self.location}")


@feature("self_check")
class OpSelfCheck(OpTool):
    """Check calls on their device by invariants of their ops (no CPU reference), within a budget of the run's time.

    Keyword arguments (each overrides its variable): ``budget`` (``OP_SELF_CHECK_BUDGET``: the share of the run's
    time the checks may take, 0.02), ``ops``, ``disable`` (``OP_SELF_CHECK_LIST``/``_DISABLE_LIST``), and
    ``results_dir``, ``verbose``, ``print_stack``, ``strict``, ``print_ranks`` as every tool.

    >>> with op_tools.OpSelfCheck() as check:
    ...     train(steps=100)
    >>> check.findings[:1]     # the first call whose invariant failed: op, module, step, rank, by how much
    """

    hook_name = "OpSelfCheckHook"
    env_prefix = "OP_SELF_CHECK"
    results_folder = "op_self_check_result"
    keywords = {"budget": SELF_CHECK_BUDGET}
    tracks_modules = True

    def configure(self) -> None:
        self.budget = SELF_CHECK_BUDGET.read(self.sources)
        if self.filter.allow is None:  # no LIST: the ops with an invariant, wrapped (no mode sees every call)
            self.filter = OpFilter(tuple(re.compile(name) for name in invariants.WRAPPED), self.filter.deny)
            self.default_list = True
        self._findings: list[Finding] = []
        self.counts: collections.Counter = collections.Counter()
        self._readback = DeviceReadback(READBACK_BATCH)
        self._sites: set = set()  # (op, source line) of the calls checked once
        self._spent = 0.0  # seconds of the tool's own work on checked calls
        self._started = time.perf_counter()
        self._judge_lock = threading.Lock()
        self._collectives: collections.Counter = collections.Counter()  # calls per (collective, group)

    def accepts(self, name: str) -> bool:
        return name in invariants.CHECKS or name in invariants.SAMPLED or name in invariants.COLLECTIVES

    @property
    def findings(self) -> list[Finding]:
        """The calls whose invariant failed, in execution order. Reading it waits for the checks in flight (one
        synchronisation)."""
        with tool_work():
            self._judge(wait=True)
        return list(self._findings)

    def before(self, call: OpCall) -> None:
        if call.name not in invariants.COLLECTIVES:
            return
        # every rank checks the same calls of a group (the check is itself a collective): by their position in it
        bound = collective_call(call.name, call.func, call.args, call.kwargs)
        reason = "collective whose arguments did not bind" if bound is None else \
            collective_checksum.uncheckable(bound)
        if bound is None or reason is not None:
            call.state = f"not checked ({reason})"
            return
        key = (call.name, id(bound.group), bound.received[0].dtype)
        seen = self._collectives[key]
        self._collectives[key] += 1
        if seen >= COLLECTIVES_FIRST and seen % COLLECTIVES_EVERY:
            call.state = BUDGET_SKIPPED
            return
        begun = time.perf_counter()
        call.state = (bound, collective_checksum.sent_sums(bound))
        self._spent += time.perf_counter() - begun

    def after(self, call: OpCall) -> None:
        begun = time.perf_counter()
        if call.name in invariants.COLLECTIVES:
            self._after_collective(call, begun)
            return
        site = (call.name, call.keep_location().key())  # unformatted: the line's text only for a checked call
        first = site not in self._sites
        if not first and self._spent > self.budget * (begun - self._started):
            self.counts[BUDGET_SKIPPED] += 1
            return
        args, kwargs, result, share = call.args, call.kwargs, call.result, 1.0
        if any(is_dtensor(a) for a in (*args, *kwargs.values(), result)):
            # checked on the rank's local tensors, where the invariant holds for what the rank computed (a column- or
            # row-parallel product); never on the DTensors: their ops run collectives, and the budget decides per rank
            local = shards.local_call(args, kwargs, result, invariants.addend_of(call.name, args, kwargs)) \
                if call.name in invariants.LOCAL else "not a product"
            if isinstance(local, str):
                self.counts["not checked (DTensor)"] += 1
                return
            args, kwargs, result, share = local
        recipe = None
        sampler = invariants.SAMPLED.get(call.name)
        if sampler is not None:  # a sample rerun on the host when it arrives
            sample = None if share != 1.0 or not isinstance(result, torch.Tensor) else \
                sampler(call.func, args, kwargs, result, self.counts["checked"])
            values, recipe = sample if sample is not None else (None, None)
        else:
            values = invariants.check(call.name, args, kwargs, result, DeviceMath.of(call.device), share)
        if values is None:
            exact = isinstance(result, torch.Tensor) and not result.is_floating_point() and not result.is_complex()
            self.counts[EXACT_SKIPPED if exact else "not checked (no invariant for these arguments)"] += 1
            return
        self._sites.add(site)
        self.counts["checked"] += 1
        token = (call.name, call.module_path, call.step, call.forward_id, call.location, call.time, recipe)
        self._readback.put(values if recipe is not None else values.reshape(1), token)
        self._judge(wait=False)
        self._spent += time.perf_counter() - begun

    def _after_collective(self, call: OpCall, begun: float) -> None:
        if isinstance(call.state, str):
            self.counts[call.state] += 1
            return
        bound, sent = call.state
        call.state = {}
        excess = collective_checksum.excess(bound, sent)
        self.counts["checked"] += 1
        token = (call.name, call.module_path, call.step, call.forward_id, call.location, call.time, None)
        self._readback.put(excess.reshape(1), token)
        self._judge(wait=False)
        self._spent += time.perf_counter() - begun

    def _judge(self, wait: bool) -> None:
        with self._judge_lock:
            for token, values in (self._readback.drain() if wait else self._readback.ready()):
                name, module, step, forward_id, location, started, recipe = token
                try:
                    excess = values[0] if recipe is None else sampled_reference.excess(recipe, values)
                except Exception as error:  # a rerun the host could not do: that call was not checked after all
                    self.counts["checked"] -= 1
                    self.counts["not checked (the host's rerun failed)"] += 1
                    if self.counts["not checked (the host's rerun failed)"] == 1:
                        self._logger.warning("OpSelfCheck: the host's rerun of %s failed: %r", name, error)
                    continue
                if not excess <= 1:  # nan counts as a violation
                    finding = Finding(name, invariants.KINDS[name], excess, module, step, self.common.rank,
                                      forward_id, location, started)
                    self._findings.append(finding)
                    if len(self._findings) == 1:
                        self._logger.warning("OpSelfCheck: %s", finding)

    def finish(self) -> None:
        """The findings, written for the run's other readers (``python -m op_tools.report``; each rank its own file
        under torchrun)."""
        self._judge(wait=True)
        if not self._findings:
            return
        self._logger.warning("OpSelfCheck: %d checked calls failed their invariant; the first: %s",
                             len(self._findings), self._findings[0])
        path = result_files.results_path(self.common, self.results_folder, f"findings_{self.stem}.json")
        record = {"format": "op_tools self check", "version": 1, "rank": self.common.rank,
                  "findings": len(self._findings), "checked": self.counts["checked"],
                  "first": [f.record() for f in self._findings[:FINDINGS_WRITTEN]]}
        self.tally.add(path, result_files.write_json(path, record), "findings")

    def found(self) -> str:
        if not self._findings:
            return ""
        first = self._findings[0]
        return f"{len(self._findings)} calls failed their invariant, the first {first.op} ({first.check})"

    def unchecked_parts(self) -> list[str]:
        """Calls it handled and could not check (a DTensor's, arguments no invariant covers): the verdict says so.
        Calls left for the budget, and integer arithmetic (no rounding to bound), are the tool's design, counted in the
        closing line only."""
        return [f"{n} {reason.removeprefix('not checked ')} call{'s' if n != 1 else ''} not checked"
                for reason, n in self.counts.items() if reason not in ("checked", BUDGET_SKIPPED, EXACT_SKIPPED)]

    def closing_line(self) -> str:
        unchecked = {why: n for why, n in self.counts.items() if why != "checked"}
        why = ", ".join(f"{reason.removeprefix('not checked ')} {n}" for reason, n in unchecked.items())
        line = (f"OpSelfCheck: {self.counts['checked']} calls checked on the device, {sum(unchecked.values())} not "
                f"checked{' ' + why if why else ''}; "
                f"{self.found() or ('no checked call failed' if self.counts['checked'] else 'no call was checked')}")
        problem = self.not_checked()
        return f"{line}; {problem}" if problem else line

    def _closing_level(self) -> int:
        return logging.WARNING if self._findings or self.not_checked() else logging.INFO
