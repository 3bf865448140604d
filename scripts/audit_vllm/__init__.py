"""The parts of the vLLM compatibility audit. scripts/vllm_audit.py is the command, and its
docstring says how the steps (snapshot, classify, verdicts, page) are run and why. One part a
step: `source` (following a default through vLLM's modules), `extract` (the names each audited
class has), `guess` and `probe` (our code classified against them), `page` (the verdict file
and the page), `cli`. What they share is here: where the files are, the verdict names, the
audited classes.
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SNAPSHOT = REPO / "docs" / "vllm-0.34-names.json"
VERDICTS = REPO / "docs" / "vllm-compatibility-verdicts.json"
PAGE = REPO / "docs" / "vllm-compatibility.md"
VERDICT_NAMES = ("same", "differs", "ignored", "refused")
GUESS_NAMES = VERDICT_NAMES + ("absent",)
REQUIRED = "<required>"

# The classes of the audit, in page order: (key, title, where vLLM defines it).
CLASSES = (
    ("LLM", "`LLM`: constructor parameters and methods", "vllm/entrypoints/llm.py"),
    ("LLMEngine", "`LLMEngine` (v1): methods", "vllm/v1/engine/llm_engine.py"),
    ("EngineArgs", "`EngineArgs`: fields", "vllm/engine/arg_utils.py"),
    ("SamplingParams", "`SamplingParams`: fields, methods and properties", "vllm/sampling_params.py"),
    ("StructuredOutputsParams", "`StructuredOutputsParams`: fields", "vllm/sampling_params.py"),
    ("RequestOutput", "`RequestOutput`: constructor parameters", "vllm/outputs.py"),
    ("CompletionOutput", "`CompletionOutput`: fields", "vllm/outputs.py"),
    ("LoRARequest", "`LoRARequest`: fields", "vllm/lora/request.py"),
    ("run-batch flags", "run-batch: command-line flags", "vllm/entrypoints/launchers/run_batch.py"),
    ("CompletionRequest", "run-batch: `/v1/completions` request body", "vllm/entrypoints/openai/completion/protocol.py"),
    ("ChatCompletionRequest", "run-batch: `/v1/chat/completions` request body",
     "vllm/entrypoints/openai/chat_completion/protocol.py"),
)
