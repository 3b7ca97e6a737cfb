"""What the tests and the benchmarks share: daemon and worker processes, checkpoint edits, fixed inputs.

Importing `helpers` imports nothing itself; the worker script (`helpers/worker.py`) runs in client
processes, which must not import server or kernel code.
"""
