"""Benchmarks. Every claim is a ratio measured side by side in one run (see BENCHMARKS.md)."""
