"""The CPU kernel backend: hand-written C++ kernels (the decode GEMM, decode attention), their
build for this machine (native.py), and the packed-weight matmul dispatch that picks a kernel
(packed_weights.py). It imports nothing of the model or the compiler: those import it."""
