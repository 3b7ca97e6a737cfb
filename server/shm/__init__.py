"""Shared memory: the segments (arena), the folder they live in, and the host paths the daemon trusts."""
