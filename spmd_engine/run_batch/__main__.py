from spmd_engine.run_batch.main import entry

entry()
