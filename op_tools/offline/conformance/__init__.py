"""The device conformance report: which operators does this device get right?

``python -m op_tools.conformance`` (console script ``op_tools_conformance``) runs the sample inputs of
PyTorch's operator database (``op_db``, one OpInfo per operator) on the device and on the CPU, forward
and backward, in worker processes, and gives each op x dtype x direction one status by OpAutoCompare's
verdict (``op_tools.numerics.comparison``): ``pass``, ``mismatch``, ``unsupported``, ``crash`` or ``skipped``.
Needs the ``expecttest`` package (``pip install 'ditorch[conformance]'``). See docs/conformance.md.

Modules: ``opinfos`` (op_db, what an OpInfo claims, selection), ``runs`` (one sample on the device and
on the CPU), ``tally`` (samples summed up into a row), ``case`` (one op x dtype), ``workers`` (the
processes), ``results`` (rows, the results file, CSV), ``report`` (console), ``html`` (the report
page), ``cli`` (the command).
"""

from .results import DIRECTIONS, STATUSES, Row

__all__ = ["DIRECTIONS", "STATUSES", "Row"]
