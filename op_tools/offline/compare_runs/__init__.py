"""``python -m op_tools.compare_runs RUN_A RUN_B``: where two recorded runs first diverge, and in which layer.

Record each run with ``OP_CAPTURE_MODE=stats`` (OpCapture, see op_tools/output/run_recording.py), on any device, then::

    python -m op_tools.compare_runs cpu_results/ npu_results/ [--csv out.csv] [--html out.html]

The two recordings are aligned (alignment.py), each aligned pair of calls is judged from its tensors' statistics
against a tolerance that knows the dtypes and the depth (verdict.py), and the report names the first divergence
in forward and in backward, the first structural difference, and per module the largest differences: on the
console, in a CSV, and in a single-file HTML side-by-side view. Every aligned pair is compared (agreeing or
diverged) or not compared, with its reason (a call a run could not record the statistics of, or whose tensors hold
the same nan/inf in both runs, leaving their values unknown); damaged lines of a recording, a recording that does
not hold its whole run (partial, lines lost) and the calls of one run past the other's end are counted as not
compared. Exit status (``op_tools.output.exit_status``): 0 when every aligned
pair was compared and none diverges, 3 when one diverges, 2 when a recording cannot be read or the arguments are
wrong, 4 when none diverges but some calls were not compared (the report's last lines, WARNING, say how many, the
first and why), 5 when the CSV or the HTML view cannot be written (a one-line message names the folder and the
option or variable that chose it), 1 when compare_runs itself failed.
"""

from .comparison import Comparison, Tolerances, compare

__all__ = ["Comparison", "Tolerances", "compare", "main"]


def main(argv=None) -> int:
    from .cli import main as run

    return run(argv)
