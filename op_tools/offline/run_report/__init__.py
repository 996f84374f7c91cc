"""``python -m op_tools.report RESULTS_DIR``: one report for a run, across its ranks.

It reads what every tool wrote on every rank (readers.py), tells the rank where a fault was born from the ranks
that received it through a collective, compares the replicas' fingerprints step by step, and shows the time skew
between ranks (analysis.py); on the console, in a CSV and in a single-file HTML view. TrainingMonitor's anomalies
count as anomalies and have their own section. Exit status (``op_tools.output.exit_status``): 0 no anomaly in what
the tools wrote, 3 an anomaly or a replica desync, 4 no anomaly but a file could not be read, 2 the folder cannot be
read, 5 the report could not be written, 1 the report itself failed.

>>> report = analyse(read_results("op_tools_results"))
>>> report.first.text()
'rank 1: went wrong at step 1: inf/nan in torch.nn.functional.silu in model.layers.0.mlp.act_fn (forward), ...'
"""

from .analysis import RunReport, analyse
from .readers import Results, ResultsError, read_results

__all__ = ["Results", "ResultsError", "RunReport", "analyse", "main", "read_results"]


def main(argv=None) -> int:
    from .cli import main as run

    return run(argv)
