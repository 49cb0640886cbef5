"""Benchmarks: each `python -m benchmarks.NAME` prints its figures as one JSON object on its last stdout line."""
