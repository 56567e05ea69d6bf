"""Benchmarks: every figure comes with its physical floor and its baseline from the same run."""
