"""Helpers the tests (and benchmarks/) share: references, model zoos, probes. No tests here."""
