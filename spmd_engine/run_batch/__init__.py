"""`python -m spmd_engine.run_batch`: an OpenAI batch file in, its results file out."""
