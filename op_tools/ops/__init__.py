"""What a call is: op names, arguments, hidden writes, random draws, and the per-op facts registry (lowest layer)."""
