from spmd_engine.run.main import entry

entry()
