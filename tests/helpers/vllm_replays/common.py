"""What every replay shares: where it runs (Launch), the calls the engine lacks (Gaps), the
engine classes imported the way the clients import them, and the checkpoint and output readers."""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch
from safetensors.torch import load_file

BREAK = set(os.environ.get("VLLM_CLIENTS_BREAK", "").split(","))
MAX_MODEL_LEN = 96


@dataclass
class Launch:
    """Where a replay runs: "external_launcher" under torchrun (two ranks), or "uni" in one process."""

    backend: str
    rank: int = 0
    world: int = 1

    @property
    def external(self) -> bool:
        return self.backend == "external_launcher"


class Gaps:
    """Calls of a client the engine does not have: each recorded, then replaced by `instead`."""

    def __init__(self):
        self.found: list[str] = []

    def call(self, what: str, fn, instead=None):
        try:
            return fn()
        except Exception as exc:
            gap = f"{what}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            if gap not in self.found:
                self.found.append(gap)
            return instead() if instead is not None else None


def import_engine_classes(gaps: Gaps):
    """`from vllm import EngineArgs, LLMEngine` (torchtitan, ms-swift)."""
    def top_level():
        from spmd_engine import EngineArgs, LLMEngine
        return EngineArgs, LLMEngine

    def modules():
        from spmd_engine.engine.arg_utils import EngineArgs
        from spmd_engine.engine.llm_engine import LLMEngine
        return EngineArgs, LLMEngine
    return gaps.call("from spmd_engine import EngineArgs, LLMEngine", top_level, modules)


def collect() -> None:
    """The clients never shut their engine down: the object goes away (a process ends, an actor
    drops it). The callers here drop their last reference, then the collector runs, which must
    end the engine (and the world it made)."""
    gc.collect()


def checkpoint(path: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(path, "model.safetensors"))


def tokens_and_logprobs(completion) -> dict:
    """Generated ids and each one's logprob, read the way the RL clients read them
    (`completion.logprobs[i][token_id].logprob`)."""
    ids = list(completion.token_ids)
    return {"tokens": ids, "logprobs": [completion.logprobs[i][t].logprob for i, t in enumerate(ids)]
            if completion.logprobs is not None else None,
            "entries": [len(d) for d in completion.logprobs] if completion.logprobs is not None else None}
