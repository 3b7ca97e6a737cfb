"""Surviving restarts: the sealed ledger and run state, and a successor's adoption of what they record."""
