"""Known reference gaps: rows that do not pass on a correct device, for a reason that is PyTorch's or the
reference's, not the device's kernels. The reports mark a matching row "known gap" with the reason; it still counts
as what it is (a mismatch is not a pass, the exit status does not change), but the reader is told it is understood.

One entry per gap, a table row (docs/conformance.md#known-gaps explains each): add one where a gap is understood, never
to silence a row that is not.

>>> [g.why[:40] for g in KNOWN_GAPS if g.matches(Row("nn.functional.linear_cross_entropy.chunked", "bfloat16",
...                                                   "forward", "mismatch"))]
['PyTorch accumulates chunked linear_cross_']
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Iterable

from .results import Row


@dataclasses.dataclass(frozen=True)
class KnownGap:
    ops: str                               # shell-style pattern of OpInfo full names
    dtypes: tuple[str, ...]                # the dtypes it shows in
    why: str                               # shown in the reports
    statuses: tuple[str, ...] = ("mismatch",)
    directions: tuple[str, ...] = ("forward", "backward")

    def matches(self, row: Row) -> bool:
        return (row.status in self.statuses and row.dtype in self.dtypes and row.direction in self.directions
                and fnmatch.fnmatchcase(row.op, self.ops))

    @property
    def label(self) -> str:
        """``ops in dtypes``, as the console lists it."""
        return f"{self.ops} in {', '.join(self.dtypes)}"


KNOWN_GAPS: tuple[KnownGap, ...] = (
    KnownGap("nn.functional.linear_cross_entropy.chunked*", ("float16", "bfloat16"),
             "PyTorch accumulates chunked linear_cross_entropy in float32 on the CPU and on CUDA, but in the input's "
             "dtype on any other device (LinearCrossEntropyOptions._resolve_auto_acc_dtype): the device computes "
             "what PyTorch asks of it, less precisely than the reference"),
)


def gap_of(row: Row, gaps: Iterable[KnownGap] = KNOWN_GAPS) -> KnownGap | None:
    """The first known gap ``row`` matches, or None."""
    return next((g for g in gaps if g.matches(row)), None)


def mark(rows: list[Row], gaps: Iterable[KnownGap] = KNOWN_GAPS) -> list[Row]:
    """Set each row's ``known_gap`` to the reason of the gap it matches ('' for none); returns ``rows``."""
    gaps = tuple(gaps)
    for row in rows:
        gap = gap_of(row, gaps)
        row.known_gap = gap.why if gap is not None else ""
    return rows
