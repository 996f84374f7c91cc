"""One module per tool (OpAutoCompare, OpCapture, ...), each a small OpTool subclass."""
