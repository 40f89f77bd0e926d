"""Benchmarks run by ``belayer bench``: each prints a table and writes JSON."""
