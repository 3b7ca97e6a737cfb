"""The control connection lives in `expertd.connection` (the CLI uses it without importing the client or torch)."""

from expertd.connection import OP_WORDS, Connection, check_running, op_words

__all__ = ["Connection", "OP_WORDS", "check_running", "op_words"]
