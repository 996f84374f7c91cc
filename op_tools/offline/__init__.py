"""Work on saved data, without the engine or a tool: the replay, run_op_from_data, conformance, compare_runs."""
