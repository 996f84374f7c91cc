"""A direction's samples summed up into one ``Row``: the worst mismatch, the first exception, what was not
checked and why.

Each sample ends as one of: compared (passed or mismatched), raised on the device (unsupported), or not checked
(no CPU reference, a result the verdict cannot compare): a row passes only when every sample was compared and
passed, and some sample had a value to compare; one with samples not checked and none failing is ``unchecked``,
never ``pass``, and so is one whose every compared result was empty (``--limit-samples 4`` takes only empty samples
of ``svd``, ``eye``, ``cholesky_solve``: their rows passed with no value of the op's checked)."""

from __future__ import annotations

import math

from ...numerics.comparison import Comparison
from .results import Row


class Tally:
    """The samples of one direction: the worst mismatch, the first exception, why samples were not compared."""

    def __init__(self) -> None:
        self.samples = self.failing = self.raised_count = 0
        self.valued = 0  # compared samples with an element in their results: an empty result checks no value
        self.worst: tuple[float, int, Comparison, int] | None = None  # (score, sample, comparison, failing outputs)
        self.raised: tuple[int, str] | None = None
        self.unchecked: list[str] = []  # why each sample not checked was not (no CPU reference, not comparable)
        self.notes: list[str] = []

    def compared(self, index: int, comparisons: list[Comparison], note: str, valued: bool = True) -> bool:
        self.samples += 1
        self.valued += valued
        if note and note not in self.notes:
            self.notes.append(note)
        failed = [c for c in comparisons if not c.passed]
        if not failed:
            return True
        self.failing += 1
        worst = max(failed, key=_score)
        if self.worst is None or _score(worst) > self.worst[0]:
            self.worst = (_score(worst), index, worst, len(failed))
        return False

    def raised_at(self, index: int, error: BaseException) -> None:
        self.samples += 1
        self.failing += 1
        self.raised_count += 1
        if self.raised is None:
            self.raised = (index, describe_error(error))

    def row(self, op: str, dtype: str, direction: str) -> Row:
        row = Row(op, dtype, direction, "pass", samples=self.samples, failing=self.failing)
        raised = f"{self.raised_count} of {self.samples} samples raised" if self.raised_count else ""
        if self.worst is not None:
            _, row.sample, c, count = self.worst
            row.status, row.output = "mismatch", c.name
            row.device_error, row.cpu_error, row.error_ratio = c.device_error, c.cpu_error, c.error_ratio
            row.max_abs_diff = c.max_abs_diff
            outputs = f" ({count} outputs fail)" if count > 1 else ""
            row.detail = "; ".join(filter(None, (
                f"sample {row.sample} {c.name}{outputs}: {c.error_info or 'differs'}",
                f"{self.failing - self.raised_count} of {self.samples} samples mismatch", raised)))
        elif self.raised is not None:
            row.status, (row.sample, message) = "unsupported", self.raised
            row.detail = f"sample {row.sample}: {message}" + (f" ({raised})" if self.raised_count > 1 else "")
        elif self.unchecked:
            row.status = "unchecked"
        elif self.samples and not self.valued:
            row.status = "unchecked"
            row.detail = f"the results of its {self.samples} samples were empty: no value compared"
        elif self.samples == 0:
            row.status = "skipped"
            row.detail = "no sample inputs"
        if self.unchecked:
            passed = f"; {self.samples} passed" if row.status == "unchecked" and self.samples else ""
            row.detail = "; ".join(filter(None, (row.detail, f"{len(self.unchecked)} of "
                                                              f"{len(self.unchecked) + self.samples} samples not "
                                                              f"checked, the first: {self.unchecked[0]}{passed}")))
        row.detail = "; ".join(filter(None, (row.detail, *self.notes)))
        return row


def _score(c: Comparison) -> float:
    """How bad a failed comparison is: its normalised error, infinite for nan or a structural difference."""
    error = c.device_error
    return math.inf if error is None or math.isnan(error) else error


def describe_error(error: BaseException) -> str:
    """``Type: first line`` of an exception, short enough for a table cell."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    text = f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return text if len(text) <= 300 else text[:297] + "..."
