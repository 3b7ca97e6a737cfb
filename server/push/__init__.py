"""Pushes: updates staged by trainers and reloads built into new generations."""
