"""Benchmarks run by ``belayer bench serve|handover|env|engine``.

Each module's ``main(json_path, **options) -> dict`` measures, prints one table (metric, value,
target, PASS/MISS) and writes the result as JSON; ``bench.report`` holds what they share.
"""
