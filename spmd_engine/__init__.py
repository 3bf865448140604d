"""spmd_engine: a decoder-LLM runtime for torchrun, SLURM and single-process launches.

`LLM` and `SamplingParams` are imported lazily so `import spmd_engine` (and the
plan CLI) stays free of torch until a model is actually needed.
"""

__all__ = ["LLM", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput", "Logprob", "SamplingMask",
           "ModelRegistry", "EngineArgs", "LLMEngine", "LoRARequest", "StructuredOutputsParams"]


def __getattr__(name):
    if name == "LLM":
        from spmd_engine.engine.llm import LLM
        return LLM
    if name == "LoRARequest":  # vLLM's lives in vllm.lora.request; here spmd_engine.lora_request
        from spmd_engine.lora_request import LoRARequest
        return LoRARequest
    if name in ("SamplingParams", "RequestOutputKind", "StructuredOutputsParams"):
        from spmd_engine import sampling_params
        return getattr(sampling_params, name)
    if name in ("RequestOutput", "CompletionOutput", "Logprob", "SamplingMask"):
        from spmd_engine.engine import outputs
        return getattr(outputs, name)
    if name == "EngineArgs":  # vLLM exports both at the top (torchtitan and ms-swift import them so)
        from spmd_engine.engine.arg_utils import EngineArgs
        return EngineArgs
    if name == "LLMEngine":
        from spmd_engine.engine.llm_engine import LLMEngine
        return LLMEngine
    if name == "ModelRegistry":
        from spmd_engine.model.registry import ModelRegistry
        return ModelRegistry
    raise AttributeError(f"module 'spmd_engine' has no attribute {name!r}")
