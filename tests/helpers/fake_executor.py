"""An Executor with no workers and no model, for seam tests of the engine above it.

The "model" it stands for is arithmetic: the token after a sequence ending in t is
(t + 1) % vocab, so any step's right answer is known without a forward. It records every
SchedulerOutput it is given and can be told to fail on a given step, so tests see what
the engine sends and how it behaves after a worker error.
"""

from __future__ import annotations

from spmd_engine.core.step_messages import ModelRunnerOutput
from spmd_engine.executor.abstract import Executor

VOCAB = 100


class CountingExecutor(Executor):
    num_blocks = 64
    fail_at_step: int | None = None

    def _init_executor(self) -> None:
        self.steps: list = []
        self.last_token: dict[str, int] = {}
        self.rpcs: list[tuple] = []
        self.shut = False

    def collective_rpc(self, method, args=(), kwargs=None, unique_reply_rank=None, timeout=None):
        self.rpcs.append((method, args))
        if method == "determine_num_kv_blocks":
            return [(self.num_blocks, 64)]
        if method in ("initialize_kv_cache", "sleep", "wake_up", "reset_prefix_cache"):
            return [{"rank": 0, "pid": 0, "rss_before": 0, "rss_after": 0, "freed_bytes": 0}]
        if method == "get_runner_stats":
            return [{}]
        return [method(self, *args, **(kwargs or {}))] if callable(method) else [None]

    def execute_model(self, scheduler_output) -> ModelRunnerOutput:
        if self.is_failed:  # the executors' contract: after a worker error every call fails
            raise RuntimeError("executor failed earlier")
        self.steps.append(scheduler_output)
        if self.fail_at_step is not None and scheduler_output.step == self.fail_at_step:
            self.is_failed = True
            raise RuntimeError(f"worker failed at step {scheduler_output.step}")
        ids, tokens = [], []
        for seq in scheduler_output.seqs:
            if seq.token_ids:
                self.last_token[seq.request_id] = seq.token_ids[-1]
            if seq.sample:
                ids.append(seq.request_id)
                tokens.append((self.last_token[seq.request_id] + 1) % VOCAB)
        return ModelRunnerOutput(ids, tokens)

    def shutdown(self) -> None:
        self.shut = True


def counting_config(tmp_path, **scheduler):
    """An EngineConfig over a config.json-only model dir (no weights are read here)."""
    import json

    from spmd_engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 16, "intermediate_size": 32,
        "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 1, "vocab_size": VOCAB,
        "max_position_embeddings": 256}))
    return EngineConfig(model_config=ModelConfig(model=str(tmp_path)), parallel_config=ParallelConfig(),
                        scheduler_config=SchedulerConfig(**scheduler), cache_config=CacheConfig(block_size=4),
                        seed=0, device="cpu", timeout_s=60)
