"""`python -m spmd_engine.run_batch`: an OpenAI batch file through the engine."""
from spmd_engine.run.stop_guard import start as start_stop_guard

start_stop_guard()  # before torch is imported: a rank stopped for good must not hold the job

from spmd_engine.run_batch.main import entry  # noqa: E402

entry()
