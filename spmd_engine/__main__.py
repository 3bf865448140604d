from spmd_engine.run import entry

entry()
