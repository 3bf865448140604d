"""The model layer: parallel layers, Llama-family models, loading, tokenizers.

Every class takes its TP and PP groups explicitly; nothing here reads a
process-global group. The names below are imported when first asked for, so
importing one module of the package (a layer, the loader) does not import the
whole package with it: the package's files form no import cycle.
"""

import importlib

_WHERE = {
    "AttentionMetadata": "spmd_engine.model.layers.attention",
    "BUNDLED_MODEL_DIR": "spmd_engine.model.loader",
    "load_model": "spmd_engine.model.loader",
    "read_hf_config": "spmd_engine.model.loader",
    "CausalLM": "spmd_engine.model.models.llama",
    "PP_PARTITION_ENV": "spmd_engine.model.partition",
    "check_model_parallel": "spmd_engine.model.partition",
    "pp_layer_range": "spmd_engine.model.partition",
    "SUPPORTED_ARCHITECTURES": "spmd_engine.model.spec",
    "ModelSpec": "spmd_engine.model.spec",
    "ByteTokenizer": "spmd_engine.model.tokenizer",
    "load_tokenizer": "spmd_engine.model.tokenizer",
}

__all__ = sorted(_WHERE)


def __getattr__(name):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'spmd_engine.model' has no attribute {name!r}")
