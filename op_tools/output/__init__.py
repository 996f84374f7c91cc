"""What comes out: log records and tables, result files, run recordings, the capture file format."""
