"""vLLM keyword arguments that `LLM(...)` and `EngineArgs(...)` accept without acting on them.

Trainers build their engine with vLLM's full set of options (TRL passes a dozen:
disable_log_stats, model_impl, ...). Those that cannot change a result here (CUDA
graphs, Ray, tokenizer pools, logging, ...) are accepted with one warning that
lists them, so trainer code runs unchanged and its author still learns what was
ignored. Those that would change a result (a quantization, an fp8 KV cache, a
config override, LoRA, logits processors, ...) are refused by name when set to
anything but vLLM's default: a silently different model is worse than an error.
A name that vLLM does not know either is a TypeError, as Python gives for any
unexpected keyword, so a typo is never swallowed. The names come from vLLM's
EngineArgs and LLM.__init__ (docs/vllm-compatibility.md gives each a verdict).
"""

from __future__ import annotations

import logging

from spmd_engine.config import DEFAULT_MAX_NUM_SEQS, CacheConfig, ConfigError

logger = logging.getLogger("spmd_engine")

IGNORED_VLLM_ARGS = frozenset("""
    served_model_name tokenizer task runner convert tokenizer_mode trust_remote_code
    allowed_local_media_path allowed_media_domains download_dir config_format kv_cache_dtype
    max_parallel_loading_workers disable_sliding_window use_v2_block_manager swap_space cpu_offload_gb
    disable_log_stats revision code_revision rope_scaling rope_theta hf_token
    hf_overrides tokenizer_revision quantization max_seq_len_to_capture
    disable_custom_all_reduce tokenizer_pool_size tokenizer_pool_type tokenizer_pool_extra_config
    limit_mm_per_prompt mm_processor_kwargs mm_processor_cache_gb disable_mm_preprocessor_cache
    mm_encoder_tp_mode enable_lora_bias fully_sharded_loras
    lora_extra_vocab_size long_lora_scaling_factors enable_prompt_adapter
    max_prompt_adapters max_prompt_adapter_token num_scheduler_steps multi_step_stream_outputs
    ray_workers_use_nsight num_gpu_blocks_override num_lookahead_slots model_loader_extra_config
    ignore_patterns preemption_mode scheduler_delay_factor guided_decoding_backend
    logits_processor_pattern logits_processors speculative_config speculative_model
    num_speculative_tokens otlp_traces_endpoint collect_detailed_traces disable_async_output_proc
    scheduling_policy scheduler_cls override_neuron_config override_pooler_config pooler_config
    worker_cls worker_extension_cls kv_transfer_config kv_events_config
    model_impl calculate_kv_scales
    disable_cascade_attn cuda_graph_sizes long_prefill_token_threshold max_num_partial_prefills
    max_long_partial_prefills structured_outputs_config reasoning_parser
    enable_eplb eplb_config num_redundant_experts all2all_backend enable_dbo data_parallel_rank
    data_parallel_size_local data_parallel_address data_parallel_rpc_port data_parallel_backend
    data_parallel_hybrid_lb data_parallel_external_lb pt_load_map_location use_tqdm_on_load
    safetensors_load_strategy attention_backend disable_hybrid_kv_cache_manager kv_sharing_fast_prefill
    kv_offloading_size kv_offloading_backend max_num_logprobs
    prefix_caching_hash_algo disable_chunked_mm_input enable_mfu_metrics show_hidden_metrics_for_version
    enable_extensible_kv_cache profiler_config attention_config quantization_config
    offload_group_size offload_num_in_group offload_prefetch_step offload_params spec_method spec_model
    spec_tokens
""".split())

# Ignored names that would change a result when set to anything but these values (None always
# means vLLM's default): refused by name then.
RESULT_CHANGING = {
    "quantization": None, "quantization_config": None, "kv_cache_dtype": "auto", "hf_overrides": None,
    "rope_scaling": None, "rope_theta": None, "tokenizer": None, "enable_prompt_adapter": False,
    "logits_processors": None, "runner": "auto", "convert": "auto", "task": "auto", "calculate_kv_scales": False,
    "mm_processor_kwargs": None, "disable_sliding_window": False,
    "logits_processor_pattern": None, "enable_lora_bias": False, "fully_sharded_loras": False,
    "tokenizer_mode": "auto",
}


# vLLM's own defaults of ignored arguments: passing one changes nothing, so it is not warned about.
VLLM_DEFAULTS = {"model_impl": "auto", "trust_remote_code": False, "swap_space": 4, "tokenizer_mode": "auto",
                 "kv_cache_dtype": "auto", "max_logprobs": 20,
                 "disable_custom_all_reduce": False, "cpu_offload_gb": 0}

# Sizing arguments of LLM(...) whose None means vLLM's default (trainers such as TRL pass None
# for what their own user left unset).
NONE_DEFAULTS = {"max_num_seqs": DEFAULT_MAX_NUM_SEQS, "block_size": CacheConfig.block_size,
                 "gpu_memory_utilization": CacheConfig.gpu_memory_utilization}


def none_means_default(**values):
    """The values in the order given, each None replaced by vLLM's default for it."""
    return tuple(NONE_DEFAULTS[k] if v is None else v for k, v in values.items())


def accept_vllm_kwargs(kwargs: dict, owner: str = "LLM", model: str | None = None) -> None:
    """TypeError for a name vLLM does not know; a ConfigError for one that would change a result
    (RESULT_CHANGING); one warning listing the arguments ignored here, leaving out None and
    vLLM's own defaults, which mean nothing either way."""
    unknown = sorted(k for k in kwargs if k not in IGNORED_VLLM_ARGS)
    if unknown:
        raise TypeError(f"{owner}.__init__() got an unexpected keyword argument {unknown[0]!r}"
                        + (f" (and {unknown[1:]})" if len(unknown) > 1 else ""))
    if kwargs.get("quantization") is not None:
        raise ConfigError(f"quantization={kwargs['quantization']!r} is not supported: spmd_engine runs "
                          f"unquantized checkpoints (float32, bfloat16, float16)")
    for name, neutral in RESULT_CHANGING.items():
        value = kwargs.get(name)
        if value is None or value == neutral or (name == "tokenizer" and value == model) or value in ({}, []):
            continue
        raise ConfigError(f"{name}={value!r} is not supported by spmd_engine (it would change the results; "
                          f"leave it at vLLM's default)")
    ignored = {k: v for k, v in kwargs.items()
               if v is not None and not (k in VLLM_DEFAULTS and v == VLLM_DEFAULTS[k])}
    if ignored:
        logger.warning("%s: vLLM argument(s) with no effect here, ignored: %s", owner,
                       ", ".join(f"{k}={ignored[k]!r}" for k in sorted(ignored)))
