"""All parallel layers in one import: `from spmd_engine.model.layers import ...`, each imported
when first asked for (a layer importing a sibling does not import every layer)."""

import importlib

_WHERE = {
    "Attention": "attention", "AttentionMetadata": "attention",
    "ParallelLMHead": "embedding", "VocabParallelEmbedding": "embedding", "padded_vocab_size": "embedding",
    "ColumnParallelLinear": "linear", "MergedColumnParallelLinear": "linear", "QKVParallelLinear": "linear",
    "RowParallelLinear": "linear", "SwiGLUMLP": "mlp", "RMSNorm": "norm", "RotaryEmbedding": "rotary",
}

__all__ = sorted(_WHERE)


def __getattr__(name):
    if name in _WHERE:
        return getattr(importlib.import_module(f"spmd_engine.model.layers.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'spmd_engine.model.layers' has no attribute {name!r}")
