"""The scheduler and its KV block bookkeeping: pure, deterministic, no torch."""
