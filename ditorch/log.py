"""ditorch's messages go through ``logging`` (logger ``ditorch``); nothing else configures logging.

While the application configured no handler that would take them, ditorch's own handler writes them to stderr as
plain lines (the banner, warnings), so that stdout stays the script's own. Once the application adds a handler
(``logging.basicConfig()``, one on ``ditorch``) that one decides, and ditorch's stays silent. Silence ditorch with
``logging.getLogger("ditorch").setLevel(logging.WARNING)`` (or ``DITORCH_QUIET=1`` for the banner).
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("ditorch")


class StderrHandler(logging.StreamHandler):
    """Plain lines on the current ``sys.stderr``, only while no other handler would take the record."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter("%(message)s"))
        self.addFilter(self._no_other_handler)

    @property
    def stream(self):  # looked up at each record: tests and applications replace sys.stderr
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass

    def _no_other_handler(self, record: logging.LogRecord) -> bool:
        # twin of op_tools/output/reporting.py's ConsoleHandler: the two packages import neither each other
        current: logging.Logger | None = logging.getLogger(record.name)
        while current is not None:
            if any(h is not self for h in current.handlers):
                return False
            if not current.propagate:
                break
            current = current.parent
        return True


def install() -> None:
    """ditorch's handler on the ``ditorch`` logger (once), and INFO unless the application set a level."""
    if not any(isinstance(h, StderrHandler) for h in logger.handlers):
        logger.addHandler(StderrHandler())
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
