"""`plan --gpu-memory`: does this model fit this layout, and how much KV cache is left?

Per rank: its weights (rank_weights.py: the engine's model on the meta device),
then the engine's own rules (core/kv_sizing.py) for the activation reserve and
the KV budget, fed the card's size less those weights where a GPU would report
its free memory, and the KV blocks all ranks then agree on (the minimum, as the
workers do). The verdict names the numbers and the smallest TP x PP that fits
such cards. On CPU the same numbers come from the CPU budget rule.
"""

from __future__ import annotations

from spmd_engine.config import ConfigError, ParallelConfig
from spmd_engine.core import kv_groups, kv_sizing
from spmd_engine.kernels.packed_weights import packing_applies
from spmd_engine.model.partition import check_layout, default_pp_partition
from spmd_engine.model.windows import kv_freeing_window
from spmd_engine.plan.rank_weights import RankModels
from spmd_engine.platform import resolve_dtype
from spmd_engine.topology import Layout


def memory_plan(setup, layout: Layout, gpu_memory: int | None, gpus_per_node: int = 8) -> dict:
    """The `"memory"` object of `plan --json` (DESIGN.md 4.3): per rank, fits, verdict.
    `gpu_memory`: each GPU's bytes (None: CPU ranks, the CPU budget rule)."""
    config, spec, hf = setup.config, setup.spec, setup.inputs.hf_config
    dtype = resolve_dtype(config.model_config.dtype, hf, config.device)
    models = RankModels(hf, dtype, spec.moe is not None,
                        packing_applies(dtype, config.device, config.model_config.batch_invariant))
    fit = _layout_memory(models, setup, layout, config.parallel_config, config.model_config.pp_partition,
                         gpu_memory)
    smallest = _smallest_fit(models, setup, gpu_memory, gpus_per_node) if gpu_memory else None
    return {"dtype": str(dtype).removeprefix("torch."), "per_rank": fit["per_rank"], "fits": fit["why_not"] is None,
            "verdict": _verdict(fit, layout, setup, gpu_memory, gpus_per_node, smallest)}


def _layout_memory(models: RankModels, setup, layout: Layout, parallel, partition, gpu_memory) -> dict:
    config, spec = setup.config, setup.spec
    cache, mml = config.cache_config, config.scheduler_config.max_model_len
    bs, itemsize = cache.block_size, models.dtype.itemsize
    ranks = models.for_layout(layout, parallel, config.dp_waves, partition)
    act = kv_sizing.step_activation_bytes(config.scheduler_config, spec, layout.tp, itemsize) if gpu_memory else 0
    budgets = [kv_sizing.rank_budget(config, spec, layout.tp, itemsize,
                                     (gpu_memory - m.weight_bytes, gpu_memory) if gpu_memory else None)
               for m in ranks]
    sc = config.scheduler_config
    if kv_groups.group_windows(spec.layer_windows, config.model_config):  # a pool per group, each its size
        blocks = min(kv_groups.num_blocks_for(b, bs, dict(m.kv_bytes_by_window), sc) for b, m in zip(budgets, ranks))
        kv_bytes = [kv_groups.bytes_held(blocks, bs, dict(m.kv_bytes_by_window), sc) for m in ranks]
    else:
        blocks = min(kv_sizing.num_blocks_for(b, bs, m.kv_bytes_per_token) for b, m in zip(budgets, ranks))
        kv_bytes = [blocks * bs * m.kv_bytes_per_token for m in ranks]
    # A sliding-only model's sequence holds its window and a chunk, not max_model_len (kv_sizing).
    seq = kv_sizing.sequence_tokens(mml, bs, kv_freeing_window(spec.layer_windows, config.model_config),
                                    sc.max_num_batched_tokens)
    per_rank = [{"rank": r, "weight_bytes": m.weight_bytes, "activation_bytes": act,
                 "kv_cache_bytes": kv_bytes[r], "kv_blocks": blocks,
                 "kv_tokens": blocks * bs, "max_concurrent_seqs": blocks * bs // seq}
                for r, m in enumerate(ranks)]
    why_not = None
    if gpu_memory:
        explicit = cache.kv_cache_memory_bytes is not None
        cap = gpu_memory if explicit else int(cache.gpu_memory_utilization * gpu_memory)
        need = [r["weight_bytes"] + act + kv_sizing.CUDA_RESERVE_BYTES + r["kv_cache_bytes"] for r in per_rank]
        worst = max(range(len(need)), key=need.__getitem__)
        if need[worst] > cap:
            w = per_rank[worst]
            kv = f" + {_size(w['kv_cache_bytes'])} KV cache" if explicit else ""
            limit = (f"the card's {_size(gpu_memory)}" if explicit else
                     f"{cache.gpu_memory_utilization:g} x {_size(gpu_memory)} = {_size(cap)}")
            why_not = (f"rank {worst} needs {_size(w['weight_bytes'])} of weights + {_size(act)} of activations "
                       f"+ {_size(kv_sizing.CUDA_RESERVE_BYTES)} reserve{kv}, more than {limit}")
    if why_not is None and blocks * bs < seq:
        why_not = (f"the KV cache left holds {blocks} blocks of {bs} = {blocks * bs} tokens per rank, fewer "
                   f"than one sequence of max_model_len {mml}" + (f" holds ({seq})" if seq < mml else ""))
    return {"per_rank": per_rank, "why_not": why_not}


def _smallest_fit(models: RankModels, setup, gpu_memory: int, gpus_per_node: int) -> tuple[int, int] | None:
    """The fewest GPUs per replica (then the least PP) whose every rank fits, TP within a node.
    A layout whose average rank already holds too much (every rank's weights together are
    at least the model's) is skipped without building it."""
    config, spec = setup.config, setup.spec
    pc, cache = config.parallel_config, config.cache_config
    one = ParallelConfig(distributed_executor_backend="uni")
    whole = models.for_layout(Layout.for_world(1), one, False, [spec.num_layers])[0].weight_bytes
    cap = gpu_memory if cache.kv_cache_memory_bytes is not None else cache.gpu_memory_utilization * gpu_memory
    replicas = pc.data_parallel_size * pc.prefill_context_parallel_size
    sizes = sorted(((tp, pp) for tp in range(1, gpus_per_node + 1) for pp in range(1, spec.num_layers + 1)),
                   key=lambda s: (s[0] * s[1], s[1]))
    for tp, pp in sizes:
        if whole / (tp * pp * replicas) > cap:
            continue
        try:
            parallel = ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                      data_parallel_size=pc.data_parallel_size,
                                      enable_expert_parallel=pc.enable_expert_parallel and spec.moe is not None,
                                      distributed_executor_backend="external_launcher")
            check_layout(setup.inputs.hf_config, parallel)
        except ConfigError:
            continue
        layout = Layout.for_world(parallel.world_size_across_dp, tp=tp, pp=pp, dp=pc.data_parallel_size)
        partition = (config.model_config.pp_partition if pp == pc.pipeline_parallel_size
                     else default_pp_partition(spec.num_layers, pp))
        if _layout_memory(models, setup, layout, parallel, partition, gpu_memory)["why_not"] is None:
            return tp, pp
    return None


def _verdict(fit: dict, layout: Layout, setup, gpu_memory, gpus_per_node: int, smallest) -> str:
    config = setup.config
    mml, bs = config.scheduler_config.max_model_len, config.cache_config.block_size
    gpus = layout.launched_world_size
    nodes = -(-gpus // gpus_per_node)
    where = (f"{gpus} GPUs of {_size(gpu_memory)} ({nodes} node{'s' * (nodes > 1)} of {gpus_per_node})"
             if gpu_memory else f"{gpus} CPU ranks")
    shape = f"TP={layout.tp} x PP={layout.pp}" + (f" x DP={layout.dp}" if layout.dp > 1 else "")
    if smallest is None:
        best = "; no TP x PP up to TP={gpus_per_node} fits such cards" if gpu_memory else ""
    else:
        best = f"; the smallest that fits: TP={smallest[0]} x PP={smallest[1]}"
    if fit["why_not"] is not None:
        return f"does not fit: {shape} on {where}: {fit['why_not']}{best}"
    per_rank = fit["per_rank"]
    full = max(per_rank, key=lambda r: r["weight_bytes"] + r["kv_cache_bytes"])
    r0 = per_rank[0]
    return (f"fits: {shape} on {where}: rank {full['rank']} holds {_size(full['weight_bytes'])} of weights + "
            f"{_size(full['activation_bytes'])} of activations + {_size(full['kv_cache_bytes'])} KV cache; "
            f"{r0['kv_blocks']} blocks of {bs} = {r0['kv_tokens']} tokens = {r0['max_concurrent_seqs']} "
            f"sequences of max_model_len {mml} at once{best}")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}".rstrip("0").rstrip(".") + f" {unit}"
    return f"{n} bytes"


def render_memory(memory: dict) -> str:
    """Ranks with the same numbers on one row, then the verdict."""
    rows, head = [], (f"{'ranks':>9} {'weights':>11} {'activations':>12} {'KV cache':>11} "
                      f"{'KV blocks':>10} {'KV tokens':>10} {'seqs at once':>13}")
    for r in memory["per_rank"]:
        numbers = tuple(v for k, v in r.items() if k != "rank")
        if rows and rows[-1][2] == numbers:
            rows[-1][1] = r["rank"]
        else:
            rows.append([r["rank"], r["rank"], numbers])
    lines = ["memory per rank", head]
    for first, last, (w, act, kv, blocks, tokens, seqs) in rows[:16]:
        span = str(first) if first == last else f"{first}-{last}"
        lines.append(f"{span:>9} {_size(w):>11} {_size(act):>12} {_size(kv):>11} {blocks:>10} {tokens:>10} "
                     f"{seqs:>13}")
    if len(rows) > 16:
        lines.append(f"{'':>9} ... {len(rows) - 16} more rows")
    lines.append(memory["verdict"])
    return "\n".join(lines)
