"""`python -m spmd_engine.plan`: the layout of a launch, before the launch."""
