"""Structured outputs: grammar backends and the per-request matchers (docs/structured-outputs.md)."""
