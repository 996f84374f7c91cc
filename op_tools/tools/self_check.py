"""OpSelfCheck: an always-on fault detector. Calls are checked by an invariant of their op, with no CPU reference on
the hardware under suspicion, and within a budget of the run's time (``numerics/invariants.py``): a matrix product's
or a convolution's checksum, forward and backward, on the device; a softmax's row sums; a sample of an elementwise
op's or a norm's result rerun on the host in float64 (``numerics/sampled_reference.py``), and of one index of an
optimizer's foreach call (``invariants.foreach_element``); a collective's sums across ranks
(``numerics/collective_checksum.py``).

Each check leaves a few numbers on the device, read back with others in batches of ``READBACK_BATCH`` checks without
blocking (``numerics/device_readback.py``): no host synchronisation in a step. An excess above 1 is a finding: the
op, its module path, the rank, the step, the phase and by how much it exceeds what rounding allows.

**The budget** (``budget=0.02``, ``OP_SELF_CHECK_BUDGET``) is a share of the run's wall time since the tool started.
The tool times its own work per checked call; a call is checked while that total stays within the budget, and the
first call of each call site always is, a site being the op, its source line, the phase and the module that made the
call (every layer's ``q_proj`` its own): every module's ops are checked in the first step they run, so a fault present
from the start is named there. That sweep is a one-time cost outside the budget (``sweep_seconds``). Beyond it,
the checks the budget allows take turns over the sites: a round checks each site once, least recently checked first
(``_due``). The rest are counted as not checked (budget). Which calls are checked depends on timing and the order of
calls, never on values: a fault that begins later in one module is found within a round.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import re
import threading
import time
from typing import TypeVar

import torch

from ..config.variables import SELF_CHECK_BUDGET, OpFilter
from ..core import shards
from ..core.engine import OpCall, OpTool, feature, tool_work
from ..numerics import collective_checksum, invariants, sampled_reference
from ..numerics.device_math import DeviceMath
from ..numerics.device_readback import DeviceReadback
from ..numerics.rounding_bounds import NONFINITE_BOUND
from ..ops.arguments import is_dtensor, local_part
from ..ops.collectives import collective_call
from ..output import result_files

READBACK_BATCH = 64  # checked calls whose results travel to the host together: one copy, no synchronisation
BUDGET_SKIPPED = "not checked (budget)"
BACKWARD_CHECKED = "backward checked"  # calls whose backward products were checked too
NONFINITE_SKIPPED = "not checked (operands hold inf or nan)"  # a product's or convolution's: no bound to judge by
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
    phase: str = "forward"  # or "backward": one of the products of its backward
    tensor: str = ""  # an optimizer's call: the index of its lists, the parameter's, that was sampled, and its shape

    def record(self) -> dict:
        return {"op": self.op, "check": self.check, "excess": self.excess, "module": self.module, "step": self.step,
                "rank": self.rank, "forward_id": self.forward_id, "location": self.location,
                "time": round(self.time, 6), "phase": self.phase, "tensor": self.tensor}

    def __str__(self) -> str:
        where = (f" in {self.module}" if self.module else "") + (f" [{self.tensor}]" if self.tensor else "")
        rank = f", rank {self.rank}" if self.rank is not None else ""
        return (f"{self.op}{where} ({self.phase}, step {self.step}{rank}, forward_id {self.forward_id}) fails its "
                f"{self.check}: {self.excess:.3g}x what rounding allows\n{self.location}")


_Element = TypeVar("_Element", invariants.ElementCall, sampled_reference.AdamElement)


def _local_element(element: _Element | None) -> _Element | str:
    """The index of an optimizer's foreach or fused Adam call its sample is of (``invariants.foreach_element``,
    ``fused_adam_element``), or why it cannot be checked. An FSDP2 optimizer's lists hold DTensors laid out alike:
    the op then ran on each rank's local tensors, and is checked on them."""
    if element is None:
        return "not checked (no invariant for these arguments)"
    tensors = element.tensors()
    if not any(is_dtensor(t) for t in tensors):
        return element
    if not all(is_dtensor(t) for t in tensors) or not shards.same_layout(tensors[1:], tensors[0]):
        return "not checked (DTensor)"
    return dataclasses.replace(element, **{field.name: _local(getattr(element, field.name))
                                           for field in dataclasses.fields(element)})


def _local(value):
    """``value`` with each DTensor in it (a tuple's, a dict's) replaced by this rank's local tensor."""
    if isinstance(value, tuple):
        return tuple(map(local_part, value))
    if isinstance(value, dict):
        return {key: local_part(v) for key, v in value.items()}
    return local_part(value)


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
    reports_unchecked = True  # the run report reads its findings
    results_folder = "op_self_check_result"
    keywords = {"budget": SELF_CHECK_BUDGET}
    tracks_modules = True

    def configure(self) -> None:
        self.budget = SELF_CHECK_BUDGET.read(self.sources)
        norms = invariants.module_norms()  # transformers' RMSNorm modules loaded now, checked as rms_norm
        if self.filter.allow is None:  # no LIST: the ops with an invariant, wrapped (no mode sees every call)
            self.filter = OpFilter(tuple(re.compile(name) for name in (*invariants.WRAPPED, *norms)),
                                   self.filter.deny)
            self.default_list = True
        self._findings: list[Finding] = []
        self.counts: collections.Counter = collections.Counter()
        self._readback = DeviceReadback(READBACK_BATCH)
        # The call sites (op, phase, source line, module path) met: the round in which each was last chosen (a
        # site's first call is checked, budget or not; then the budget's checks take turns over them); the calls
        # looked at since the budget allowed a check, none of a site due (the step the hunt began, calls).
        self._sites: dict[tuple, int] = {}
        self._round = 0
        # per (op, module path): its sites met, and those chosen this round; a pair all of whose sites were chosen is
        # settled (the engine's ``settled``): its calls run untouched until the next round, as paused ones do, where
        # each would cost a handled call's dispatch to be looked at and let go
        self._pair_sites: collections.Counter = collections.Counter()
        self._pair_chosen: collections.Counter = collections.Counter()
        self._hunt: list[int] | None = None
        self.site_checks: collections.Counter = collections.Counter()  # calls chosen for a check, per site
        self._spent = 0.0  # seconds of the tool's own work on checked calls, within the budget
        # seconds of its work on each site's first call, outside the budget: a one-time sweep that checks every module
        # in the first step it runs, after which the budget's turns begin at once, not after a pause paying it back
        self.sweep_seconds = 0.0
        self._started = time.perf_counter()
        self._judge_lock = threading.Lock()
        self._collectives: collections.Counter = collections.Counter()  # calls per (collective, group)
        self.unpausable = invariants.COLLECTIVES  # every rank must see its collectives alike

    def accepts(self, name: str) -> bool:
        return name in invariants.CHECKS or name in invariants.SAMPLED or name in invariants.COLLECTIVES or \
            name in invariants.FUSED_ADAM or name == invariants.FOREACH_NORM

    @property
    def findings(self) -> list[Finding]:
        """The calls whose invariant failed, in execution order. Reading it waits for the checks in flight (one
        synchronisation)."""
        with tool_work():
            self._judge(wait=True)
        return list(self._findings)

    def before(self, call: OpCall) -> None:
        if invariants.in_place(call.name, call.args, call.kwargs):
            # the input the call overwrites, sampled now where its result will be (a few elements, on the device)
            rotation = self.counts["checked"]
            if call.name in invariants.FUSED_ADAM:  # its parameter, moments and gradient, at one index
                adam = _local_element(invariants.fused_adam_element(call.name, call.args, call.kwargs, rotation))
                if not isinstance(adam, str):
                    call.state = {"taken": (rotation, sampled_reference.adam_taken_before(adam))}
                return
            target, at = call.args[0] if call.args else None, rotation
            if call.name in invariants.FOREACH:  # the index of its lists the sample will be of
                element = _local_element(invariants.foreach_element(call.name, call.args, call.kwargs, None, rotation))
                target, at = (element.out, element.rotation) if not isinstance(element, str) else (None, at)
            if isinstance(target, torch.Tensor):
                call.state = {"taken": (rotation, {0: sampled_reference.taken_before(target, at)})}
            return
        if call.name not in invariants.COLLECTIVES:
            self._before_backward_products(call)
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

    def _before_backward_products(self, call: OpCall) -> None:
        """A product whose backward products are to be checked too: its gradients asked for (call.grad_inputs), its
        operands kept (autograd keeps them anyway) until they come."""
        if not torch.is_grad_enabled():
            return
        operands = invariants.product_operands(call.name, call.args, call.kwargs)
        if operands is None or not any(t.requires_grad for t in operands.inputs) or \
                any(is_dtensor(t) for t in operands.inputs):
            return
        begun = time.perf_counter()
        site = (call.name, "backward", call.keep_location().key(), call.module_path)
        first = site not in self._sites
        if not first:
            due = self._due(site, call.step, begun)
            if not due:
                if due is False:  # a site checked this round: its turn comes later
                    self._spent += time.perf_counter() - begun
                return
        else:
            self._chosen(site)
        call.grad_inputs = [t for t in operands.inputs if t.requires_grad]
        call.state = {"backward": (operands, [t._version for t in operands.inputs],
                                   DeviceMath.of(call.device, call.name), first)}
        self._charge(begun, first)

    def after_call_backward(self, call: OpCall, upstream: tuple, input_grads: tuple, complete: bool) -> None:
        kept = call.state.pop("backward", None) if isinstance(call.state, dict) else None
        if kept is None or not upstream or not isinstance(upstream[0], torch.Tensor):
            return
        begun = time.perf_counter()
        operands, versions, math_, first = kept
        inputs = operands.inputs
        if [t._version for t in inputs] != versions:  # written since: not what the backward multiplied
            return
        grads = {id(t): g for t, g in zip([t for t in inputs if t.requires_grad], input_grads)}
        grad_a, grad_b = operands.grads(grads.get(id(inputs[0])), grads.get(id(inputs[1])))
        excesses = invariants.backward_checksums(operands.a, operands.b, upstream[0], grad_a, grad_b, math_)
        if not excesses:
            return
        self.counts[BACKWARD_CHECKED] += 1
        token = (call.name, call.module_path, call.step, call.forward_id, call.location, call.time, None, "backward",
                 "")
        self._readback.put(torch.stack(excesses).amax().reshape(1), token)
        self._judge(wait=False)
        self._charge(begun, first)

    def after(self, call: OpCall) -> None:
        begun = time.perf_counter()
        if call.name in invariants.COLLECTIVES:
            if isinstance(call.state, tuple) and call.state[0].asynchronous:  # received once the program waits
                self.check_when_waited(call, self._after_collective, call.state[0].received, call.state[0])
                self._spent += time.perf_counter() - begun
            else:
                self._after_collective(call)
            return
        # the line unformatted: its text only when shown
        site = (call.name, "forward", call.keep_location().key(), call.module_path)
        first = site not in self._sites
        if not first:
            due = self._due(site, call.step, begun)
            if not due:
                self.counts[BUDGET_SKIPPED] += 1
                if due is None:
                    # until the budget allows a check again, the calls run untouched (the engine's work per call too)
                    self.pause_until(self._started + self._spent / self.budget)
                else:  # a site checked this round: its turn comes later; looking cost the tool's time
                    self._spent += time.perf_counter() - begun
                return
        args, kwargs, result, share = call.args, call.kwargs, call.result, 1.0
        if any(is_dtensor(a) for a in (*args, *kwargs.values(), result)):
            # checked on the rank's local tensors, where the invariant holds for what the rank computed (a column- or
            # row-parallel product); never on the DTensors: their ops run collectives, and the budget decides per rank
            local = shards.local_call(args, kwargs, result, invariants.addend_of(call.name, args, kwargs)) \
                if call.name in invariants.LOCAL or self._elementwise_locally(call.name, args, kwargs, result) \
                else "not a product"
            if isinstance(local, str):
                self.counts["not checked (DTensor)"] += 1
                return
            args, kwargs, result, share = local
        recipe = None
        tensor = ""  # which of an optimizer's parameters was sampled
        values: list[torch.Tensor] | torch.Tensor | None
        func = call.func
        sampler = invariants.SAMPLED.get(call.name)
        if call.name in invariants.FUSED_ADAM:  # one index of its lists, its update rerun on the host
            rotation, taken = call.state.get("taken", (0, None)) if isinstance(call.state, dict) else (0, None)
            adam = _local_element(invariants.fused_adam_element(call.name, args, kwargs, rotation))
            if isinstance(adam, str):
                self.counts[adam] += 1
                return
            sample = sampled_reference.adam_sample(adam, taken) if taken is not None else None
            values, recipe = sample if sample is not None else (None, None)
            result, tensor = adam.param, adam.place
        elif sampler is not None:  # a sample rerun on the host when it arrives
            rotation, taken = call.state.get("taken", (self.counts["checked"], None)) if isinstance(call.state, dict) \
                else (self.counts["checked"], None)
            if call.name in invariants.FOREACH:  # one index of its lists, as the per-tensor call it stands for
                element = _local_element(invariants.foreach_element(call.name, args, kwargs, result, rotation))
                if isinstance(element, str):
                    self.counts[element] += 1
                    return
                func, args, kwargs, result, rotation, tensor = \
                    element.func, element.args, element.kwargs, element.out, element.rotation, element.place
            sample = None if share != 1.0 or not isinstance(result, torch.Tensor) else \
                sampler(func, args, kwargs, result, rotation, taken=taken)
            values, recipe = sample if sample is not None else (None, None)
        elif call.name == invariants.FOREACH_NORM:  # one index of its list, its norm computed again on the device
            listed = args[0] if args else kwargs.get("self")
            if isinstance(listed, (list, tuple)) and any(is_dtensor(t) for t in listed):  # FSDP2's gradients
                self.counts["not checked (DTensor)"] += 1
                return
            checked = invariants.foreach_norm_excess(args, kwargs, result, self.counts["checked"])
            values, tensor = checked if checked is not None else (None, "")
        else:
            values = invariants.check(call.name, args, kwargs, result, DeviceMath.of(call.device), share)
        if values is None:
            exact = isinstance(result, torch.Tensor) and not result.is_floating_point() and not result.is_complex()
            self.counts[EXACT_SKIPPED if exact else "not checked (no invariant for these arguments)"] += 1
            return
        if first:
            self._chosen(site)
        self.counts["checked"] += 1
        token = (call.name, call.module_path, call.step, call.forward_id, call.location, call.time, recipe, "forward",
                 tensor)
        self._readback.put(values.reshape(1) if isinstance(values, torch.Tensor) else values, token)
        self._judge(wait=False)
        self._charge(begun, first)

    def _charge(self, begun: float, first: bool) -> None:
        """The time since ``begun`` to the budget, or to the sweep for a site's first call."""
        if first:
            self.sweep_seconds += time.perf_counter() - begun
        else:
            self._spent += time.perf_counter() - begun

    def _due(self, site: tuple, step: int, begun: float) -> bool | None:
        """Whether a call of a ``site`` already met is to be checked now: None while the budget is spent; else True
        when its site is due (not chosen since its round began, the site then chosen), False when it is not (its turn
        comes in the next round): the check the budget allows goes to the first call whose site is due. With a budget
        of 1 (the whole run's time) every call is checked.

        Looking for a due call (a hunt) is never paused: its time is the tool's, and lengthens the next pause; budget
        left unspent meanwhile is spent on the next due calls. A round ends when a hunt has seen a whole step with no
        site due (before the first optimizer step, or with none, twice as many calls as there are sites): every site
        a step makes has been chosen, and a site met no more (a warm-up's, an evaluation's) waits for the next round."""
        if self._hunt is None:
            if self._spent > self.budget * (begun - self._started):
                return None
            if self.budget >= 1:
                self._chosen(site)
                return True
            self._hunt = [step, 0]
        if self._sites.get(site, -1) == self._round:
            self._hunt[1] += 1
            if (step < self._hunt[0] + 2) if step else self._hunt[1] <= 2 * len(self._sites):
                return False
            self._new_round()
        self._chosen(site)
        return True

    def _chosen(self, site: tuple) -> None:
        """``site`` takes its turn in this round (a check, or a call its check could not cover). A pair (op, module)
        whose every site has had its turn is settled: its calls wait for the next round outside the tool; once every
        pair is, the next round begins."""
        pair, previous = (site[0], site[3]), self._sites.get(site)
        if previous is None:
            self._pair_sites[pair] += 1
        if previous != self._round:
            self._pair_chosen[pair] += 1
        self._sites[site] = self._round
        self.site_checks[site] += 1
        self._hunt = None
        if self.budget >= 1:  # every call checked: nothing waits
            return
        if self._pair_chosen[pair] >= self._pair_sites[pair]:
            self.settled.add(pair)
            if len(self.settled) >= len(self._pair_sites):
                self._new_round()
        # while looking for a due call, a pair's calls run outside the tool for about two steps' calls at most: a
        # site met no more (a warm-up's, an evaluation's) then hands them back, and the hunt ends the round
        self.settled_skips = 2 * len(self._sites)

    def _new_round(self) -> None:
        self._round += 1
        self._pair_chosen.clear()
        self.settled = set()

    @staticmethod
    def _elementwise_locally(name: str, args: tuple, kwargs: dict, result) -> bool:
        """An elementwise call on DTensors laid out alike (sequence parallel's activations), or a norm of a DTensor
        whose normalised dimensions are whole on every rank and whose weight and bias are replicated (its norms):
        each rank's local result is the op of its local inputs."""
        sampler = invariants.SAMPLED.get(name)
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if not tensors or not all(is_dtensor(t) for t in tensors) or not is_dtensor(result):
            return False
        if sampler in invariants.ELEMENTWISE:
            return shards.same_layout(tensors, result)
        normalized = invariants.normalized_dims(name, args, kwargs)
        if normalized is None:
            return False
        x, parameters = tensors[0], tensors[1:]
        return shards.same_layout([x], result) and shards.whole_along(x, normalized) and \
            all(shards.replicated(p) for p in parameters)

    def _after_collective(self, call: OpCall) -> None:
        if isinstance(call.state, str):
            self.counts[call.state] += 1
            return
        begun = time.perf_counter()
        bound, sent = call.state
        call.state = {}
        excess = collective_checksum.excess(bound, sent)
        self.counts["checked"] += 1
        token = (call.name, call.module_path, call.step, call.forward_id, call.location, call.time, None, "forward",
                 "")
        self._readback.put(excess.reshape(1), token)
        self._judge(wait=False)
        self._spent += time.perf_counter() - begun

    def _judge(self, wait: bool) -> None:
        with self._judge_lock:
            for token, values in (self._readback.drain() if wait else self._readback.ready()):
                name, module, step, forward_id, location, started, recipe, phase, tensor = token
                try:
                    excess = values[0] if recipe is None else sampled_reference.excess(recipe, values)
                except Exception as error:  # a rerun the host could not do: that call was not checked after all
                    self.counts["checked"] -= 1
                    self.counts["not checked (the host's rerun failed)"] += 1
                    if self.counts["not checked (the host's rerun failed)"] == 1:
                        self._logger.warning("OpSelfCheck: the host's rerun of %s failed: %r", name, error)
                    continue
                if excess == NONFINITE_BOUND:  # nothing to judge: said so, as not checked
                    self.counts[BACKWARD_CHECKED if phase == "backward" else "checked"] -= 1
                    self.counts[NONFINITE_SKIPPED] += 1
                    continue
                if not excess <= 1:  # nan counts as a violation
                    finding = Finding(name, invariants.KINDS[name], excess, module, step, self.common.rank,
                                      forward_id, location, started, phase, tensor)
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
                for reason, n in self.counts.items() if reason.startswith("not checked ") and
                reason not in (BUDGET_SKIPPED, EXACT_SKIPPED)]

    def closing_line(self) -> str:
        unchecked = {why: n for why, n in self.counts.items() if why.startswith("not checked ")}
        if self.paused_calls:  # run untouched while the budget was spent
            unchecked[BUDGET_SKIPPED] = unchecked.get(BUDGET_SKIPPED, 0) + self.paused_calls
        unwaited = self.waits_not_checked()
        if unwaited:  # asynchronous collectives whose wait the tool did not see (said why below)
            unchecked["not checked (asynchronous collectives unwaited)"] = unwaited
        why = ", ".join(f"{reason.removeprefix('not checked (').removesuffix(')')}: {n}"
                        for reason, n in unchecked.items())
        backward = self.counts[BACKWARD_CHECKED]
        line = (f"OpSelfCheck: {self.counts['checked']} calls checked on the device"
                f"{f' ({backward} in backward too)' if backward else ''}, {sum(unchecked.values())} not "
                f"checked{f' ({why})' if why else ''}; "
                f"{self.found() or ('no checked call failed' if self.counts['checked'] else 'no call was checked')}")
        problem = self.not_checked()
        return f"{line}; {problem}" if problem else line

    def _closing_level(self) -> int:
        return logging.WARNING if self._findings or self.not_checked() else logging.INFO
