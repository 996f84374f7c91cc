"""What the user asked for: the variables, tool keywords and config file, the typo check, the tool registry."""
