"""Benchmarks; each prints one JSON line with --json."""
