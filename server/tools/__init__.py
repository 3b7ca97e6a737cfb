"""Offline tools around the weights: convert, inspect, doctor, and the test-data generator.

They use the daemon's pipeline (reader, layout, kernels); the pipeline never imports them.
"""
