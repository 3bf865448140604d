"""The compiled forward: chunks of decoder layers through torch.compile (compiled_layers.py),
exported as functions of tensors (chunk_program.py) and kept on disk as AOTInductor packages
(precompiled.py). It imports the kernels and the forward context, never the model: the model
imports it."""
