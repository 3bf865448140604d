"""The model layer: parallel layers, Llama-family models, loading, tokenizers.

Every class takes its TP and PP groups explicitly; nothing here reads a
process-global group.
"""

from spmd_engine.model.layers.attention import AttentionMetadata
from spmd_engine.model.loader import BUNDLED_MODEL_DIR, load_model, read_hf_config
from spmd_engine.model.models.llama import CausalLM
from spmd_engine.model.partition import PP_PARTITION_ENV, check_model_parallel, pp_layer_range
from spmd_engine.model.spec import SUPPORTED_ARCHITECTURES, ModelSpec
from spmd_engine.model.tokenizer import ByteTokenizer, load_tokenizer

__all__ = [
    "AttentionMetadata",
    "BUNDLED_MODEL_DIR",
    "ByteTokenizer",
    "CausalLM",
    "ModelSpec",
    "PP_PARTITION_ENV",
    "SUPPORTED_ARCHITECTURES",
    "check_model_parallel",
    "load_model",
    "load_tokenizer",
    "pp_layer_range",
    "read_hf_config",
]
