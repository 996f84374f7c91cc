"""The exit status of every op_tools command, in one table (``ExitStatus``).

``python -m op_tools TOOL script.py``, the run report (``python -m op_tools.report``), ``compare_runs``, the
conformance sweep and the offline replay (``run_op_from_data``) all exit by it, so that a shell script or a CI job
reads one scheme whichever command it ran:

    >>> from op_tools.output.exit_status import ExitStatus, status_of
    >>> status_of("found") is ExitStatus.FOUND == 3
    True
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from ..config.variables import torchrun_rank
from . import reporting


class ExitStatus(enum.IntEnum):
    """What a command's exit status says. "Found" is 3, not 1: Python exits 1 for an uncaught exception, so a 1
    would not tell a finding from a crash of the command or of the user's script (whose own status is kept); 2 is
    argparse's; 130 is how a shell reports Ctrl-C (128 + SIGINT)."""

    CLEAN = 0  # everything was checked (or read), nothing found
    RAISED = 1  # the command or the user's script raised: Python's own status, never given for a verdict
    USAGE = 2  # a bad command line or environment, or an input that cannot be read at all
    FOUND = 3  # something found: an op failed, an anomaly, runs or ranks diverged, a row failed, a replay mismatch
    INCOMPLETE = 4  # nothing found, but not everything was checked or read: a clean verdict is not earned
    NOT_WRITTEN = 5  # the results (a CSV, a report) could not be written: "fix the path", told from a verdict
    INTERRUPTED = 130  # Ctrl-C: what finished was reported


# The verdict words of the tools and commands (OpTool.verdict(), TrainingMonitor.verdict(), compare_runs' and the
# conformance sweep's "unchecked", the run report's "unread") -> their status.
VERDICT_STATUS = {"clean": ExitStatus.CLEAN, "found": ExitStatus.FOUND, "unchecked": ExitStatus.INCOMPLETE,
                  "unread": ExitStatus.INCOMPLETE}

# The worst first, for one status over several parts (compare_runs' ranks): a finding stands whatever else happened,
# then what stopped a part (a crash, an unreadable input, files not written), then what was left unchecked.
SEVERITY = (ExitStatus.FOUND, ExitStatus.RAISED, ExitStatus.USAGE, ExitStatus.NOT_WRITTEN, ExitStatus.INCOMPLETE,
            ExitStatus.CLEAN)

# The statuses a verdict gives, as the torchrun line names them.
_VERDICT_WORDS = {ExitStatus.FOUND: "found", ExitStatus.INCOMPLETE: "incomplete"}


def status_of(verdict: str) -> ExitStatus:
    """The exit status of a verdict word (``VERDICT_STATUS``); KeyError for a word not in it."""
    return VERDICT_STATUS[verdict]


def worst(statuses: Iterable[int]) -> ExitStatus:
    """The status of the worst part (``SEVERITY``); ``CLEAN`` for none."""
    present = set(statuses)
    return next((status for status in SEVERITY if status in present), ExitStatus.CLEAN)


def explain_under_torchrun(status: int) -> str | None:
    """Under torchrun, one WARNING line on every rank before a verdict's non-zero status ends it: torchrun then
    prints a ``ChildFailedError`` with that status, which reads like a crash without it. The line (``None`` where
    none is said: outside torchrun, or a status no verdict gives)."""
    rank = torchrun_rank()
    if rank is None or status not in _VERDICT_WORDS:
        return None
    line = (f"op_tools: rank {rank} exits with status {status}: {_VERDICT_WORDS[ExitStatus(status)]} (not a crash; "
            "see the summary above)")
    reporting.logger.warning(line)  # WARNING: shown on every rank, also those OP_TOOLS_PRINT_RANKS leaves quiet
    return line
