"""Which ranks hold which part of the model, checked before any collective.

`check_model_parallel` is the gate between a user's sizes and a launch: every
rule a TP/PP layout can break for a given checkpoint gives one clear line here,
instead of a shape error inside a collective on some rank. `pp_layer_range`
places decoder layers on pipeline stages exactly as vLLM's `get_pp_indices`:
even split, remainder layers one each to the stages before the last (the last
stage also carries the final norm and LM head), counted from the second-to-last
stage backwards; a partition string (argument or SPMD_ENGINE_PP_PARTITION)
overrides it.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

from spmd_engine import envs
from spmd_engine.config import ConfigError
from spmd_engine.model.spec import ModelSpec

PP_PARTITION_ENV = envs.PP_PARTITION


def check_model_parallel(hf_config: Mapping[str, Any], tp: int, pp: int, source: str = "config.json",
                         ep_size: int | None = None, expert_width_ranks: int | None = None) -> ModelSpec:
    """Raise ConfigError unless this model can be cut into TP x PP (and its experts over an
    expert-parallel group of `ep_size` ranks, when given); returns its spec."""
    spec = ModelSpec.from_hf_config(hf_config, source)
    _check_experts(spec, tp, ep_size, expert_width_ranks or tp)
    if spec.num_heads % tp:
        raise ConfigError(
            f"tensor_parallel_size {tp} must divide num_attention_heads {spec.num_heads} of this model"
        )
    kv = spec.num_kv_heads
    if kv % tp and tp % kv:
        raise ConfigError(
            f"tensor_parallel_size {tp} and num_key_value_heads {kv} of this model must divide one another"
        )
    dense_layers = spec.moe is None or any(not spec.is_moe_layer(i) for i in range(spec.num_layers))
    if dense_layers and spec.intermediate_size % tp:
        raise ConfigError(
            f"tensor_parallel_size {tp} must divide intermediate_size {spec.intermediate_size} of this model"
        )
    if pp > spec.num_layers:
        raise ConfigError(
            f"pipeline_parallel_size {pp} exceeds num_hidden_layers {spec.num_layers} of this model "
            f"(every stage needs at least one layer)"
        )
    return spec


def check_layout(hf_config: Mapping[str, Any], parallel_config, source: str = "config.json") -> ModelSpec:
    """`check_model_parallel` for a whole parallel config: TP x PP, then the experts over the
    EP group, or each expert's width over DP x TP when a MoE spans DP replicas without EP."""
    pc = parallel_config
    tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
    spec = check_model_parallel(hf_config, tp, pp, source=source)
    ep_size = expert_parallel_size(pc, spec)
    across_dp = moe_width_ranks_across_dp(pc, spec) if ep_size is None else None
    if ep_size is not None or across_dp is not None:
        check_model_parallel(hf_config, tp, pp, source=source, ep_size=ep_size, expert_width_ranks=across_dp)
    return spec


def _check_experts(spec: ModelSpec, tp: int, ep_size: int | None, width_ranks: int) -> None:
    """Experts split whole over the EP group, or each expert's width over `width_ranks`
    (TP, or DP x TP when a MoE spans DP replicas without EP)."""
    moe = spec.moe
    if moe is None:
        return
    if ep_size is not None and moe.num_experts % ep_size:
        raise ConfigError(f"num_experts {moe.num_experts} of this model is not divisible by the expert "
                          f"parallel size {ep_size} (DP x PCP x TP)")
    if ep_size is None and moe.expert_intermediate_size % width_ranks:
        over = f"tensor_parallel_size {tp}" if width_ranks == tp else \
            f"the {width_ranks} ranks of DP x TP (each expert is split over them without expert parallelism)"
        raise ConfigError(f"{over} must divide the expert intermediate size "
                          f"{moe.expert_intermediate_size} of this model")
    if moe.shared_expert_intermediate_size % tp:
        raise ConfigError(f"tensor_parallel_size {tp} must divide shared_expert_intermediate_size "
                          f"{moe.shared_expert_intermediate_size} of this model")


def expert_parallel_size(parallel_config, spec: ModelSpec | None = None) -> int | None:
    """The EP group's size (DP x PCP x TP, as the topology builds it), or None when EP is off.

    With `spec`: EP asked for a dense model warns once and counts as off (as vLLM).
    Across DP replicas the EP group spans them; DP waves keep their MoE collectives
    in step (engine/dp_waves.py).
    """
    pc = parallel_config
    if not pc.enable_expert_parallel:
        return None
    if spec is not None and spec.moe is None:
        logging.getLogger("spmd_engine").warning(
            "enable_expert_parallel has no effect: %s is not a mixture-of-experts model", spec.architecture)
        return None
    return pc.data_parallel_size * pc.prefill_context_parallel_size * pc.tensor_parallel_size


def moe_width_ranks_across_dp(parallel_config, spec: ModelSpec) -> int | None:
    """Without expert parallelism a MoE under DP > 1 splits each expert's width over the
    flattened DP x PCP x TP ranks (vLLM's sharding; the replicas step in DP waves): that
    count, or None when the experts stay within each replica (DP = 1, dense, or EP)."""
    pc = parallel_config
    if spec.moe is None or pc.enable_expert_parallel or pc.data_parallel_size == 1:
        return None
    return pc.data_parallel_size * pc.prefill_context_parallel_size * pc.tensor_parallel_size


def moe_sharding(parallel_config, dp_waves: bool) -> tuple[str, bool]:
    """(the axis whose group MoE layers shard their experts over, whether whole experts are
    split): as vLLM, ("ep", True) with expert parallelism; ("ep", False) when the replicas
    step in DP waves (each expert's width over the flattened DP x TP ranks); else ("tp",
    False). The worker picks its groups by it, and the plan sizes each rank's experts by it."""
    if parallel_config.enable_expert_parallel:
        return "ep", True
    return ("ep", False) if dp_waves else ("tp", False)


def parse_pp_partition(partition: str | Sequence[int], num_layers: int, pp_size: int,
                       what: str = "pipeline partition") -> list[int]:
    """'3,3,2' -> [3, 3, 2], validated against the model and the PP size."""
    if isinstance(partition, str):
        try:
            counts = [int(part) for part in partition.split(",")]
        except ValueError:
            raise ConfigError(f"{what} {partition!r} is not a comma-separated list of integers") from None
    else:
        counts = [int(part) for part in partition]
    if len(counts) != pp_size:
        raise ConfigError(f"{what} {partition!r} has {len(counts)} entries but pipeline_parallel_size is {pp_size}")
    if any(count < 1 for count in counts):
        raise ConfigError(f"{what} {partition!r}: every stage needs at least 1 layer")
    if sum(counts) != num_layers:
        raise ConfigError(f"{what} {partition!r} sums to {sum(counts)} but the model has {num_layers} layers")
    return counts


def default_pp_partition(num_layers: int, pp_size: int) -> list[int]:
    """vLLM's placement: even split; the remainder goes one layer each to the
    stages just before the last (second-to-last first), so the first and last
    stages, which also hold the embedding and the head, get extras last."""
    counts = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        counts[-i] += 1
    return counts


def pp_layer_range(num_layers: int, pp_rank: int, pp_size: int,
                   partition: str | Sequence[int] | None = None) -> tuple[int, int]:
    """[start, end) of the decoder layers on stage `pp_rank`.

    `partition` (or, when None, the SPMD_ENGINE_PP_PARTITION environment
    variable) overrides the default placement.
    """
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank {pp_rank} outside 0..{pp_size - 1}")
    if pp_size > num_layers:
        raise ConfigError(f"pipeline_parallel_size {pp_size} exceeds num_hidden_layers {num_layers}")
    if partition is None and envs.pp_partition():
        counts = parse_pp_partition(envs.pp_partition(), num_layers, pp_size, PP_PARTITION_ENV)
    elif partition is not None:
        counts = parse_pp_partition(partition, num_layers, pp_size)
    else:
        counts = default_pp_partition(num_layers, pp_size)
    start = sum(counts[:pp_rank])
    return start, start + counts[pp_rank]
