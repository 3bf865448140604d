"""All parallel layers in one import: `from spmd_engine.model.layers import ...`."""

from spmd_engine.model.layers.attention import Attention, AttentionMetadata
from spmd_engine.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding, padded_vocab_size
from spmd_engine.model.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from spmd_engine.model.layers.mlp import SwiGLUMLP
from spmd_engine.model.layers.norm import RMSNorm
from spmd_engine.model.layers.rotary import RotaryEmbedding

__all__ = [
    "Attention",
    "AttentionMetadata",
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SwiGLUMLP",
    "VocabParallelEmbedding",
    "padded_vocab_size",
]
