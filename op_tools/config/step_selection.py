"""A selection of training steps, as ``OP_CAPTURE_STEPS`` writes it: ``0,2-3`` (steps 0, 2 and 3), ``5-`` (5 and
later). Steps are counted as every tool counts them (``op_tools/core/steps.py``: ``optimizer.step()`` calls finished
since the tool started), so step 0 is the first.

>>> selection = parse_steps("0,2-3")
>>> [s for s in range(6) if s in selection]
[0, 2, 3]
>>> str(parse_steps("5-"))
'5-'
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class StepSelection:
    """Steps chosen by ranges ``(first, last)``, ``last`` None for "and every later step"; ``step in selection``."""

    ranges: tuple[tuple[int, int | None], ...]

    def __contains__(self, step: object) -> bool:
        return isinstance(step, int) and any(first <= step and (last is None or step <= last)
                                             for first, last in self.ranges)

    def __str__(self) -> str:
        return ",".join(str(first) if first == last else f"{first}-{'' if last is None else last}"
                        for first, last in self.ranges)


def _step(text: str, entry: str) -> int:
    if not text.strip().isdigit():
        raise ValueError(f"entry {entry!r} is not a step (an integer >= 0) nor a range such as 2-3 or 5-")
    return int(text)


def parse_steps(text: str | None) -> StepSelection | None:
    """``'0,2-3'``, ``'5-'`` -> the selection; unset, empty or ``'all'`` -> ``None`` (every step)."""
    value = (text or "").strip().lower()
    if value in ("", "all"):
        return None
    ranges = []
    for entry in (e.strip() for e in value.split(",")):
        first, dash, last = entry.partition("-")
        start = _step(first, entry)
        end = None if dash and not last.strip() else _step(last, entry) if dash else start
        if end is not None and end < start:
            raise ValueError(f"range {entry!r} ends before it starts")
        ranges.append((start, end))
    return StepSelection(tuple(ranges))


def convert_steps(value: Any) -> StepSelection | None:
    """A step (an int), a list of steps, a ``range``, or the variable's text."""
    if value is None or isinstance(value, str):
        return parse_steps(value)
    if isinstance(value, range):
        if value.step != 1 or not len(value) or value.start < 0:
            raise ValueError(f"{value!r} is not a non-empty range of steps >= 0 with step 1")
        return StepSelection(((value.start, value.stop - 1),))
    values = [value] if isinstance(value, int) else value
    if isinstance(values, (list, tuple, set, frozenset)) and values and \
            all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        return StepSelection(tuple((v, v) for v in sorted(set(values))))
    raise TypeError("neither a step, a list of steps (integers >= 0), a range nor a text such as '0,2-3'")
