"""When DP replicas must step in lockstep ("waves"): what vLLM's needs_dp_coordinator decides.

Dense replicas never talk to each other after start-up. A mixture-of-experts
model under DP does: its expert layers exchange tokens over the EP group, which
spans the replicas, so every replica must run a forward whenever any replica
does. Each engine step the replicas all-reduce over the DP group whether any of
them still has work; one with none runs a dummy forward (one token, no KV write,
no output); the wave ends when none has work (EngineCore.run_steps).

SPMD_ENGINE_DP_WAVES=1 turns waves on for any model under DP > 1 (tests and the
benchmark use it to measure a wave on a dense model); unset or "auto": MoE only.
"""

from __future__ import annotations

import os
from typing import Mapping

from spmd_engine import envs
from spmd_engine.config import ParallelConfig

WAVES_ENV = envs.DP_WAVES
# The config keys that give a mixture of experts its expert count: Mixtral, Qwen2/3-MoE, DeepSeek.
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def is_moe(hf_config: Mapping) -> bool:
    return any(int(hf_config.get(key) or 0) > 1 for key in EXPERT_COUNT_KEYS)


def needs_dp_waves(parallel_config: ParallelConfig, hf_config: Mapping,
                         environ: Mapping[str, str] = os.environ) -> bool:
    """True when the DP replicas of this model must run waves: DP > 1 and MoE (or forced)."""
    forced = envs.dp_waves(environ)
    if parallel_config.data_parallel_size == 1:
        return False
    return forced == "1" or is_moe(hf_config)
