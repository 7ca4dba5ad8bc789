"""Benchmarks of the relay's own cost (see bench/README.md); run with `make bench`."""
