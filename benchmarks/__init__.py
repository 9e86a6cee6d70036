"""Benchmarks of persistent_delta (issue 4). Never run by ``make test``; see README.md."""
