"""`python -m spmd_engine.run`: the batch-generation command line."""
