"""``python -m op_tools.compare_runs RUN_A RUN_B``: the command's public name.

The code is ``op_tools.offline.compare_runs``."""

from ..offline.compare_runs import Comparison, Tolerances, compare, main

__all__ = ["Comparison", "Tolerances", "compare", "main"]
