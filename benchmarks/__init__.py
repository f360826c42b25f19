"""Benchmark entry points: ``python -m benchmarks.run`` wraps ``tandem bench`` (see tandem.bench)."""
