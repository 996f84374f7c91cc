"""The run's account: which rank went wrong first and how the others received it, whether replicas agreed after
each step, and where the ranks' time went.

Origin and propagation. Each rank's first anomaly is its earliest (by step, then wall-clock time) inf/nan or
mismatch. It was *received* when OpOverflowCheck saw it arrive through a collective (this rank sent finite values),
or when it is a collective's own result other than a failed check of that collective; otherwise the rank is an
*origin*. An inf/nan OpOverflowCheck saw read on a rank where no call it checked made it came from the data or from
a write no tool saw (a collective run below the tools): that rank received it where another rank is an origin, and
is an origin only where none is. A rank with no anomaly of its own while another rank is an origin received that
rank's fault through the first collective the origin rank ran after its anomaly, when it ran that collective too (a
data-parallel all-reduce carries noise as well as NaN, and a noisy but correct all-reduce is no anomaly on the
receiving rank). The origin with the earliest first anomaly is what went wrong first.

TrainingMonitor's anomalies are anomalies like the others (their kind is the monitor's rule), with one more piece of
causality: every rank runs a step's phases in the same order (forward, backward, the optimizer step), the
collectives between them keeping the ranks in step. A rank whose first anomaly is the monitor's non-finite, at a
step where another rank saw an inf/nan in an earlier phase, received it from that rank (it was finite until then).
The monitor cannot see which collective brought it, and sees no collective inside a phase: when the first inf/nan
was seen at the same step and phase on several ranks and the monitor saw one of them, the report says it was first
seen on those ranks rather than guess which sent it.

Replicas. Before each optimizer step each rank wrote a checksum of every replicated parameter and gradient
(op_tools/core/replicas.py): the first step, and the first parameter in the optimizer's order, where two ranks'
checksums differ is where the replicas stopped agreeing. Each tool session (each run, where several wrote into one
folder) is compared alone, in the order they started; where there are several, the one that disagreed is named.

Skew. Per step, each rank's time in the calls OpTimeMeasure timed, collectives left out (their time includes the
wait for the slowest rank): the slowest rank, how much slower than the fastest, and its costliest ops there.
"""

from __future__ import annotations

import dataclasses

from .readers import MONITOR, MONITOR_PHASES, Event, FingerprintSession, Results

TOP_OPS = 3


@dataclasses.dataclass(frozen=True)
class RankAccount:
    rank: int
    status: str  # "origin", "received", "clean"
    first: Event | None  # its first anomaly
    through: Event | None = None  # the collective that brought another rank's fault
    from_ranks: tuple[int, ...] = ()
    # origins whose first inf/nan came at the same step and phase, which sent it unknown (TrainingMonitor's)
    first_seen_on: tuple[int, ...] = ()

    def text(self) -> str:
        if self.status == "origin":
            assert self.first is not None
            found = f"{self.first.kind} in {self.first.where()}, found by {self.first.tool}" + _detail(self.first)
            if self.first.came_in:
                found = (f"{self.first.kind} read first by {self.first.where()}, made by no call {self.first.tool} "
                         "checked (the program's data, or a write no tool saw)")
            if self.first_seen_on:
                return (f"rank {self.rank}: first seen on ranks {', '.join(map(str, self.first_seen_on))} at step "
                        f"{self.first.step} (which one sent it cannot be told): {found}")
            return f"rank {self.rank}: went wrong at step {self.first.step}: {found}"
        if self.status == "received":
            senders = ", ".join(map(str, self.from_ranks)) or "another rank"
            if self.through is None and self.first is not None and self.first.tool == MONITOR:
                return (f"rank {self.rank}: received it from rank {senders} at step {self.first.step}, in a later "
                        f"phase of the step (the monitor sees no collective); its first anomaly: {self.first.kind} "
                        f"in {self.first.where()}, found by {self.first.tool}" + _detail(self.first))
            if self.through is None and self.first is not None and self.first.came_in:  # it names no collective
                return (f"rank {self.rank}: received it from rank {senders} through a collective no tool saw (a "
                        f"functional collective, as DTensor's, runs below the tools); {self.first.kind} read first by "
                        f"{self.first.where()} at step {self.first.step}")
            through = self.through or self.first
            assert through is not None
            if self.first is None:
                own = "; no anomaly of its own"
            elif self.first is self.through:
                own = f"; {self.first.tool} saw the {self.first.kind} arrive there ({self.first.phase})"
            else:
                own = f"; its first anomaly: {self.first.kind} in {self.first.where()}"
            return (f"rank {self.rank}: received it from rank {senders} through {through.op}"
                    f"{' in ' + through.module if through.module else ''} at step {through.step}{own}")
        return f"rank {self.rank}: no anomaly"


def _detail(event: Event) -> str:
    if event.value is not None:  # TrainingMonitor's; its message is in the report's training monitor section
        return f" (value {event.value:.6g})"
    return f" ({event.detail})" if event.detail and event.kind == "mismatch" else ""


@dataclasses.dataclass(frozen=True)
class Desync:
    step: int
    what: str  # "parameter" or "gradient"
    name: str
    checksums: dict[int, int]  # rank -> checksum
    differing: int  # how many parameters (of this kind) differ at this step
    session: str = ""  # which session, where the folder holds several ("" for one)

    def text(self) -> str:
        groups: dict[int, list[int]] = {}
        for rank, value in sorted(self.checksums.items()):
            groups.setdefault(value, []).append(rank)
        sides = " vs ".join(("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))
                            for ranks in groups.values())
        more = f"; {self.differing} {self.what}s differ" if self.differing > 1 else ""
        return (f"disagree from step {self.step} (before its optimizer update){_in(self.session)}: {self.what} "
                f"{self.name} differs, {sides}{more}")


def _in(session: str) -> str:
    return f" in {session}" if session else ""


@dataclasses.dataclass(frozen=True)
class NonFiniteParameters:
    """The first step at which some rank's parameters held an inf or a NaN before its optimizer update."""

    step: int
    names: tuple[str, ...]  # the first such rank's, in the optimizer's order
    ranks: tuple[int, ...]  # the ranks whose parameters held one at that step
    session: str = ""  # which session, where the folder holds several ("" for one)

    def text(self) -> str:
        more = f" and {len(self.names) - 1} more" if len(self.names) > 1 else ""
        ranks = f"rank {self.ranks[0]}" if len(self.ranks) == 1 else f"ranks {','.join(map(str, self.ranks))}"
        return f"from step {self.step}{_in(self.session)}, parameter {self.names[0]}{more} hold inf/nan on {ranks}"


@dataclasses.dataclass(frozen=True)
class StepSkew:
    step: int
    ms: dict[int, float]  # rank -> milliseconds in the timed calls (collectives left out)
    slowest: int
    top_ops: tuple[tuple[str, float], ...]  # the slowest rank's costliest ops in the step
    session: str = ""  # "session 2 of 3" where the tool was started several times, or several runs wrote there

    @property
    def label(self) -> str:
        return f"{self.session}, step {self.step}" if self.session else f"step {self.step}"

    @property
    def skew_ms(self) -> float:
        return self.ms[self.slowest] - min(self.ms.values())

    def text(self) -> str:
        ops = ", ".join(f"{op} {ms:.2f} ms" for op, ms in self.top_ops)
        return (f"{self.label}: slowest rank {self.slowest}, {self.ms[self.slowest]:.2f} ms, {self.skew_ms:.2f} ms "
                f"more than the fastest; its time goes to {ops}")


@dataclasses.dataclass
class RunReport:
    results: Results
    ranks: list[RankAccount]
    first: RankAccount | None  # the origin that went wrong first
    desync: Desync | None
    replicas_compared: int  # steps whose fingerprints were compared across at least two ranks
    skew: list[StepSkew]
    nonfinite: NonFiniteParameters | None = None  # parameters holding inf/nan, from the fingerprints
    sessions_compared: int = 1  # tool sessions (runs, where several wrote into the folder) whose replicas were compared

    def replicas_text(self) -> str:
        """What the replica fingerprints say, true to what was read: a desync, agreement (with the parameters'
        inf/nan, which replicas can share bit for bit), or why nothing was compared."""
        if self.desync is not None:
            return self.desync.text()
        if self.replicas_compared:
            shared = f", but {self.nonfinite.text()}" if self.nonfinite is not None else ""
            sessions = f" in {self.sessions_compared} sessions" if self.sessions_compared > 1 else ""
            return f"agree at each of the {self.replicas_compared} steps compared{sessions}{shared}"
        return f"not compared ({replicas_not_compared(self.results)})"

    @property
    def monitor_anomalies(self) -> list[Event]:
        """TrainingMonitor's anomalies on every rank, in the order they came (step, then time)."""
        return sorted((e for e in self.results.anomalies if e.tool == MONITOR), key=lambda e: (e.order, e.rank))

    def verdict(self) -> str:
        """``"found"`` (an anomaly, a replica desync, parameters holding inf/nan), ``"unread"`` (none in what was
        read, but some file could not be read, a tool did not check every call, or a rank's run ended early: a clean
        verdict is not earned) or ``"clean"``."""
        if self.first is not None or self.desync is not None or self.nonfinite is not None or \
                any(r.status != "clean" for r in self.ranks):
            return "found"
        results = self.results
        return "unread" if results.unreadable or results.unchecked or results.ended_early else "clean"


def _first_collective_after(collectives: list[Event], rank: int, after: Event) -> Event | None:
    later = [c for c in collectives if c.rank == rank and c.order > after.order]
    return min(later, key=lambda c: c.order) if later else None


def _received(event: Event) -> bool:
    # A collective's own failed check is a fault of that collective (this rank's origin); any other anomaly on a
    # collective's result came with what it received.
    return event.received or (event.collective and event.kind != "mismatch")


def _phase_senders(event: Event, anomalies: list[Event]) -> tuple[int, ...]:
    """The ranks that saw an inf/nan in an earlier phase of the step where the monitor first saw ``event``'s
    non-finite: every rank runs the phases in the same order, so it came from them."""
    if event.tool != MONITOR or event.kind != "nonfinite":
        return ()
    phase = MONITOR_PHASES.index(event.phase)
    return tuple(sorted({e.rank for e in anomalies if e.nonfinite and e.rank != event.rank and e.step == event.step
                         and e.phase in MONITOR_PHASES and MONITOR_PHASES.index(e.phase) < phase}))


def _first_seen_together(origins: list[Event]) -> tuple[int, ...]:
    """The origins whose first inf/nan came at the same step and phase as the earliest's, when TrainingMonitor saw
    one of the two: it sees no collective inside a phase, so which rank sent it cannot be told (OpOverflowCheck
    can: an inf/nan it found from finite inputs was born there). One rank alone: ()."""
    first = origins[0]
    together = [o.rank for o in origins if o is first or (
        first.nonfinite and o.nonfinite and (o.step, o.phase) == (first.step, first.phase) and MONITOR in
        (o.tool, first.tool))]
    return tuple(sorted(together)) if len(together) > 1 else ()


def account_ranks(results: Results) -> tuple[list[RankAccount], RankAccount | None]:
    firsts: dict[int, Event] = {}
    for event in results.anomalies:
        if event.rank not in firsts or event.order < firsts[event.rank].order:
            firsts[event.rank] = event
    later_in_step = {rank: _phase_senders(e, results.anomalies) for rank, e in firsts.items()}
    candidates = [e for e in firsts.values() if not _received(e) and not later_in_step[e.rank]]
    # An inf/nan no call checked on its rank made came from the data, or from a write no tool saw (a collective
    # run below the tools: DTensor's, DDP's): an origin only where no rank made one.
    made = [e for e in candidates if not e.came_in]
    origins = sorted(made or candidates, key=lambda e: e.order)
    seen_together = _first_seen_together(origins) if origins else ()
    accounts: dict[int, RankAccount] = {}
    for origin in origins:
        accounts[origin.rank] = RankAccount(origin.rank, "origin", origin,
                                            first_seen_on=seen_together if origin.rank in seen_together else ())
    first_origin = origins[0] if origins else None
    for rank in sorted(results.ranks | set(firsts)):
        if rank in accounts:
            continue
        if later_in_step.get(rank):
            accounts[rank] = RankAccount(rank, "received", firsts[rank], None, later_in_step[rank])
            continue
        own = firsts.get(rank)
        senders = tuple(o.rank for o in origins if own is None or o.order <= own.order) or \
            tuple(o.rank for o in origins)
        if own is not None:  # received through a collective it names
            accounts[rank] = RankAccount(rank, "received", own, own if own.collective else None, senders)
            continue
        if first_origin is not None:
            carrier = _first_collective_after(results.collectives, first_origin.rank, first_origin)
            if carrier is not None and any(c.rank == rank and c.op == carrier.op and c.step == carrier.step
                                           for c in results.collectives):
                accounts[rank] = RankAccount(rank, "received", None, carrier, (first_origin.rank,))
                continue
        accounts[rank] = RankAccount(rank, "clean", None)
    ordered = [accounts[rank] for rank in sorted(accounts)]
    return ordered, (accounts[first_origin.rank] if first_origin is not None else None)


def compare_replicas(results: Results) -> tuple[Desync | None, int, int]:
    """The first step and parameter where two ranks' checksums differ, in the first session where they do; how many
    steps, and sessions, were compared."""
    steps = sessions = 0
    for session in results.fingerprints:
        desync, compared = _compare_session(session.ranks)
        steps, sessions = steps + compared, sessions + bool(compared)
        if desync is not None:
            return dataclasses.replace(desync, session=_session_name(results, session)), steps, sessions
    return None, steps, sessions


def _compare_session(prints: dict[int, dict[int, dict]]) -> tuple[Desync | None, int]:
    if len(prints) < 2:
        return None, 0
    compared = 0
    for step in sorted(set().union(*(steps.keys() for steps in prints.values()))):
        at_step = {rank: steps[step] for rank, steps in prints.items() if step in steps}
        if len(at_step) < 2:
            continue
        compared += 1
        for what, key in (("parameter", "params"), ("gradient", "grads")):
            names = next(iter(at_step.values()))[key]
            differing = [name for name in names
                         if len({record[key].get(name) for record in at_step.values()} - {None}) > 1]
            if differing:
                name = differing[0]
                return Desync(step, what, name, {rank: record[key][name] for rank, record in at_step.items()
                                                 if name in record[key]}, len(differing)), compared
    return None, compared


def _session_name(results: Results, session: FingerprintSession) -> str:
    """``session 2 of 3 (rank 0's fingerprints_<stem>.jsonl)`` where the folder holds several; "" for one."""
    sessions = results.fingerprints
    if len(sessions) < 2:
        return ""
    return f"session {sessions.index(session) + 1} of {len(sessions)} ({session.name()})"


def replicas_not_compared(results: Results) -> str:
    """Why no step's fingerprints were compared across two ranks, from what the folder holds."""
    wrote: dict[int, bool] = {}  # rank -> whether a file of its holds a step
    for session in results.fingerprints:
        for rank, steps in session.ranks.items():
            wrote[rank] = wrote.get(rank, False) or bool(steps)
    others = sorted(results.ranks - set(wrote))
    if len(results.ranks) < 2:
        return "the results hold one rank"
    if not wrote:
        return ("no rank wrote replica fingerprints: the op tools write them before each optimizer step they see, "
                "unless OP_TOOLS_REPLICA_FINGERPRINTS=0; TrainingMonitor does not")
    if len(wrote) == 1:
        early = [rank for rank in others if rank in results.ended_early]
        why = "" if not early else f": the run of rank{'s' if len(early) > 1 else ''} " \
            f"{','.join(map(str, early))} ended early"
        return f"only rank {next(iter(wrote))} wrote fingerprints, not rank{'s' if len(others) > 1 else ''} " \
            f"{','.join(map(str, others))}{why}"
    if not any(wrote.values()):
        return ("no optimizer step ran while an op tool was on (the fingerprints are written before each), or every "
                "parameter is sharded (FSDP2's: no replica holds another's)")
    if all(len(session.ranks) < 2 for session in results.fingerprints):
        return "no two ranks' fingerprints are of one session: the files of different runs, or not matched (above)"
    return "the ranks' fingerprints share no step"


def nonfinite_parameters(results: Results) -> NonFiniteParameters | None:
    """The first step at which a rank's fingerprints name a parameter holding inf/nan, in the first session where
    one does."""
    for session in results.fingerprints:
        at: dict[int, dict[int, list[str]]] = {}
        for rank, steps in session.ranks.items():
            for step, record in steps.items():
                if record.get("nonfinite"):
                    at.setdefault(step, {})[rank] = list(record["nonfinite"])
        if at:
            step = min(at)
            ranks = tuple(sorted(at[step]))
            return NonFiniteParameters(step, tuple(at[step][ranks[0]]), ranks, _session_name(results, session))
    return None


def time_skew(results: Results) -> list[StepSkew]:
    from ...ops.op_facts import op_facts

    skews = []
    for k, times in enumerate(results.times):
        session = f"session {k + 1} of {len(results.times)}" if len(results.times) > 1 else ""
        for step in sorted(set().union(*(per_step.keys() for per_step in times.values()))):
            per_rank = {rank: {op: ms for op, ms in per_step[step].items() if not op_facts(op).collective}
                        for rank, per_step in times.items() if step in per_step}
            if len(per_rank) < 2:
                continue
            totals = {rank: sum(ops.values()) for rank, ops in per_rank.items()}
            slowest = max(totals, key=lambda rank: totals[rank])
            top = sorted(per_rank[slowest].items(), key=lambda item: -item[1])[:TOP_OPS]
            skews.append(StepSkew(step, totals, slowest, tuple(top), session))
    return skews


def analyse(results: Results) -> RunReport:
    ranks, first = account_ranks(results)
    desync, compared, sessions = compare_replicas(results)
    return RunReport(results, ranks, first, desync, compared, time_skew(results), nonfinite_parameters(results),
                     sessions)
