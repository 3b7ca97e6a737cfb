"""Fixed inputs shared by the test process and the worker processes (imports nothing)."""

INPUT_IDS = [[0, 5, 17, 42, 99, 180, 250, 301, 7, 3, 64, 128]]
