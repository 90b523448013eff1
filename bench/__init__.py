"""Benchmarks: each module prints one JSON document; `python -m bench` runs them all side by side."""
