"""The command line: `expertd start`, `stop` and the other commands."""
