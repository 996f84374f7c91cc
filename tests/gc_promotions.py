"""Objects a tool makes the garbage collector promote into its oldest generation: a host cost no device shows (for
the tests, which hold the tools to a budget of them, and the benchmarks, which print them).

CPython runs a full collection, which visits every tracked object of the program (a real model's process holds
hundreds of thousands), once the objects promoted since the last one exceed a quarter of those that survived it. So
each object a tool keeps alive across two younger collections (a record waiting for its statistics, a call waiting
for its backward) costs about four visits of a full collection, whatever the heap's size: ~2.3 us each on the
2-core VM of ``docs/performance.md`` (a full collection of 400k objects, 230-240 ms). The benchmarks steady their
times with ``gc.freeze()``, which takes the program's own objects out of every collection (a full collection of the
same run: 8 ms instead of 241 ms), so their times do not show this cost: it is estimated from the count and the
time of one full collection of the process's heap (``full_collection_seconds_per_object``).
"""

from __future__ import annotations

import gc
import time


class Promotions:
    """``with Promotions() as promoted: ...``; ``promoted.count``: objects moved into the oldest generation meanwhile
    (by the collections of the middle one). Costs two scans of that generation per such collection: for a counting
    round, not a timed one."""

    def __init__(self) -> None:
        self.count = 0
        self._before = 0

    def __enter__(self) -> Promotions:
        gc.callbacks.append(self._collected)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._collected)

    def _collected(self, phase: str, info: dict) -> None:
        if info["generation"] != 1:
            return
        held = len(gc.get_objects(generation=2))
        if phase == "start":
            self._before = held
        else:
            self.count += held - self._before


# Allocations made before each run (2.75 of CPython's young collections each): the runs start at four points of
# the collector's cycle of young and middle collections
PHASES = (0, 1925, 3850, 5775)


def phase_shift(allocations: int) -> list:
    """Allocations that move where the collector's next young collections fall, held as long as the list is: tuples
    of numbers, counted as allocations and untracked by the first collection that meets them (none promoted)."""
    return [(i,) for i in range(allocations)]


def promoted_on_average(work, phases=PHASES) -> tuple[float, list]:
    """The objects ``work()`` makes the collector promote, averaged over runs started at several points of its cycle,
    and ``work()``'s results. Which objects are alive when a collection comes depends on where each allocation falls
    in the cycle, so one run's count moves by a quarter when a tool allocates a few short-lived objects more anywhere
    (twenty lists a read-back batch, made and dropped: 11.8k -> 15.4k promoted in three steps of a tiny Llama)."""
    counts, results = [], []
    for allocations in phases:
        gc.collect()
        shift = phase_shift(allocations)
        with Promotions() as promoted:
            results.append(work())
        del shift
        counts.append(promoted.count)
    return sum(counts) / len(counts), results


def full_collection_seconds_per_object() -> float:
    """The time of one full collection of this process's heap (frozen objects included), per tracked object."""
    gc.unfreeze()
    begin = time.perf_counter()
    gc.collect()
    seconds = time.perf_counter() - begin
    return seconds / max(len(gc.get_objects()), 1)
