"""``python -m op_tools.conformance``: the command's public name; the code is ``op_tools.offline.conformance``."""

from ..offline.conformance import DIRECTIONS, STATUSES, Row

__all__ = ["DIRECTIONS", "STATUSES", "Row"]
