"""The vLLM compatibility audit (docs/vllm-compatibility.md): vLLM's public names, and ours against them.

The page promises every public name of vLLM's offline API one verdict (same / differs /
ignored / refused). Keeping that promise by hand over hundreds of names drifts, so:

    # 1. vLLM's names, read from its source with `ast` (vLLM is never imported: it needs CUDA
    #    wheels), written to a snapshot that CI reads instead of vLLM
    python scripts/vllm_audit.py --vllm-src DIR/vllm   # DIR: the unpacked wheel
    # 2. a first guess for each name by probing our code (this checkout, or another one)
    python scripts/vllm_audit.py --classify [--package-root CHECKOUT] [--diff]
    # 3. missing verdicts seeded from the guesses (then reviewed by hand), and the page written
    python scripts/vllm_audit.py --init-verdicts
    python scripts/vllm_audit.py --write-doc

The reviewed verdicts live in docs/vllm-compatibility-verdicts.json (name -> verdict, note,
probe): the page is generated from the snapshot plus that file, so it can be rewritten after
the code changes, and tests/unit/test_vllm_compatibility.py checks it against the code.

scripts/vllm_audit.py is the command; this package is its parts, one step each: `source`
(following a default through vLLM's modules), `extract` (the names each audited class has),
`guess` and `probe` (our code classified against them), `page` (the verdict file and the page),
`cli`. What they share is here: where the files are, the verdict names, the audited classes.
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
