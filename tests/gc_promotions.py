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


def full_collection_seconds_per_object() -> float:
    """The time of one full collection of this process's heap (frozen objects included), per tracked object."""
    gc.unfreeze()
    begin = time.perf_counter()
    gc.collect()
    seconds = time.perf_counter() - begin
    return seconds / max(len(gc.get_objects()), 1)
