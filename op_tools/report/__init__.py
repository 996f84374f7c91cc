"""``python -m op_tools.report RESULTS_DIR``: the command's public name.

The code is ``op_tools.offline.run_report``."""

from ..offline.run_report import Results, RunReport, analyse, main, read_results

__all__ = ["Results", "RunReport", "analyse", "main", "read_results"]
