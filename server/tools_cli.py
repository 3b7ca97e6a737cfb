"""Subcommands for the tools around the weights (convert, inspect, doctor)."""


def add_tool_commands(sub) -> None:
    """Register the tool subcommands on the `expertd` parser's subparsers."""
