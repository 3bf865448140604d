"""What one rank does each step: its model shard, its KV cache, inputs, forward, sampling.

The worker (device, groups, RPC surface) owns one ModelRunner. The runner keeps
what persists between steps on this rank: each running request's block table
and prompt length, the sampler's per-request streams, and the KV cache
tensors. Each SchedulerOutput is turned into packed inputs (every request's
new tokens back to back, no padding), attention metadata built once for all
layers, one forward of this PP stage, and on the last stage the logits of the
rows that sample.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from pathlib import Path

import torch

from spmd_engine.config import EngineConfig
from spmd_engine.core import kv_groups, kv_sizing
from spmd_engine.core.step_messages import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    PLACEHOLDER_TOKEN_ID,
    ModelRunnerOutput,
    SchedulerOutput,
)
from spmd_engine.sample.sampler import Sampler, SamplerOutput, logprob_entries
from spmd_engine.worker import group_tables

logger = logging.getLogger("spmd_engine")


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device, tp_group, pp_group,
                 broadcast_sampled_tokens: bool = False, moe_groups: dict | None = None):
        self.config = config
        self.moe_groups = moe_groups or {}
        self.device = device
        self.tp_group = tp_group
        self.pp_group = pp_group
        self.broadcast_sampled_tokens = broadcast_sampled_tokens
        self.model = None
        self.batch_invariant = config.model_config.batch_invariant
        self.sampler = Sampler(config.model_config.logprobs_mode, batch_invariant=self.batch_invariant)
        self.block_size = config.cache_config.block_size
        self.num_blocks = 0
        self.block_tables: dict[str, list[int]] = {}  # a tuple of one per group with kv_windows
        self.kv_windows: tuple = ()  # the KV groups' windows, set with the model (core/kv_groups.py)
        self.prompt_lens: dict[str, int] = {}
        self.known_lens: dict[str, int] = {}  # prompt + sampled tokens, by request (longrope.py reads it)
        # Async scheduling: each request's last sampled token, the input a step scheduled while
        # that token's step was in flight asks for (PLACEHOLDER_TOKEN_ID).
        self.async_scheduling = config.scheduler_config.async_scheduling
        self.last_sampled: dict[str, int] = {}
        # (sampling request ids, on the last stage (logits, output indices) or the greedy tokens
        # themselves, prompt logprobs)
        self._pending: tuple[list[str], tuple | torch.Tensor | None, dict | None] | None = None
        self.stats = {"steps": 0, "tokens": 0, "prefill_tokens": 0, "sampled": 0, "dummy_steps": 0}
        self.routing = None  # RoutingBuffer on the last stage with enable_return_routed_experts
        self._pending_routing: dict | None = None
        self.compile_seconds: float | None = None  # start-up compile time of the compiled forward
        self.decode_graphs = None  # decode_graphs.DecodeGraphs on CUDA unless eager
        self.lora = None  # model/lora/manager.py's LoRAManager with LLM(enable_lora=True)
        self.lora_of: dict[str, int] = {}  # request id -> its adapter id (0: base)

    # -- start-up ---------------------------------------------------------------
    def load_model(self) -> None:
        from spmd_engine.kernels.packed_weights import layout, pack_linear_weights, packing_applies
        from spmd_engine.model.loader import load_model
        mc = self.config.model_config
        if self.device.type == "cpu":  # the kernels build (first start only) while the checkpoint loads
            from spmd_engine.kernels import decode_attention, vnni_gemm
            from spmd_engine.model.loader import BUNDLED_MODEL_DIR, read_hf_config
            from spmd_engine.platform import resolve_dtype
            hf_config = read_hf_config(Path(mc.model_dir) if mc.model_dir is not None else BUNDLED_MODEL_DIR)
            vnni_gemm.start_building(resolve_dtype(mc.dtype, hf_config, self.device))
            decode_attention.start_building(self.device)
        self.model = load_model(mc.model_dir, self.tp_group, self.pp_group, dtype=mc.dtype,
                                device=self.device, pp_partition=mc.pp_partition,
                                load_format=mc.load_format, batch_invariant=mc.batch_invariant,
                                model_registration=mc.model_registration, **self.moe_groups)
        if packing_applies(self.model.dtype, self.device, mc.batch_invariant):
            packed = pack_linear_weights(self.model, batch_hint=self.config.scheduler_config.max_num_seqs,
                                         batch_invariant=mc.batch_invariant)
            kernels = Counter(layout(m.weight) for m in self.model.modules() if getattr(m, "packable_weight", False))
            logger.debug("%d linear weights packed: %s", packed,
                         ", ".join(f"{n} for {k}" for k, n in sorted(kernels.items())))
        if mc.enable_return_routed_experts:
            self.model.record_routing()
        self.kv_windows = kv_groups.group_windows(self.model.spec.layer_windows, mc)
        if self.config.lora_config is not None:
            from spmd_engine.model.lora.manager import LoRAManager
            self.lora = LoRAManager(self.model, self.config.lora_config, self.device)
            self.model.lora_state = self.lora.state
        cc = self.config.compilation_config
        if cc.compiled:
            if cc.cache_dir:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = cc.cache_dir
            self.model.compile_layers(backend=cc.backend, min_tokens=cc.min_tokens,
                                     layers_per_graph=cc.layers_per_graph)

    def load_weights(self, weights) -> set[str]:
        """In-place update from (HF name, full tensor) pairs: `CausalLM.update_weights`."""
        return self.model.update_weights(weights)

    def reload_weights(self) -> set[str]:
        """Restore what the engine should serve: the checkpoint's tensors (read from the model
        directory) when sleep(level=2) discarded the weights and nothing was loaded since;
        otherwise nothing, since the weights are the checkpoint's or a trainer's newer ones (TRL
        calls this after every weight sync). To go back to the checkpoint after an update:
        sleep(level=2), then reload_weights."""
        from spmd_engine.model.loader import checkpoint_weights
        model_dir = self.config.model_config.model_dir
        if not self.model.reload_pending:
            logger.debug("reload_weights: kept the weights loaded since the last discard (%s not read)",
                         model_dir)
            return set()
        return self.model.update_weights(checkpoint_weights(self.model, model_dir))

    def kv_budget_bytes(self) -> int:
        """This rank's KV budget from its device's memory (kv_sizing's rules). On CUDA the
        compiled forward is built first, on a scratch cache of two blocks: its tracing and
        inductor's autotuning then have the memory the KV cache would take, and give it back
        before the device is measured (vLLM profiles a compiled run before sizing its cache; at
        --gpu-memory-utilization 0.9 autotuning after sizing ran out of memory)."""
        if self.device.type == "cuda" and self.model.compiled_layers is not None and self.compile_seconds is None:
            self.model.allocate_kv_cache(2, self.block_size)
            try:
                self._compile()
            finally:
                self.model.bind_kv_cache(None)
                torch.cuda.empty_cache()
        memory = torch.cuda.mem_get_info(self.device) if self.device.type == "cuda" else None
        return kv_sizing.rank_budget(self.config, self.model.spec, self.tp_group.world_size,
                                     self.model.dtype.itemsize, memory)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Per layer K and V blocks, zeroed (unwritten slots are read under a mask: they must be
        finite). On CPU the zeros come from calloc, so untouched blocks cost no resident memory."""
        self.model.check_max_model_len(self.config.scheduler_config.max_model_len)
        graphs = self._wants_decode_graphs()
        if self.kv_windows:  # a KV cache of several groups: each group's layers its own count
            group_tables.allocate(self.model, kv_groups.blocks_per_group(
                num_blocks, self.kv_windows, self.block_size, self.config.scheduler_config), self.block_size, _zeros)
        else:  # with CUDA graphs one block more than the scheduler hands out: the graphs' padding rows'
            self.model.allocate_kv_cache(num_blocks + graphs, self.block_size, zeros=_zeros)
        self.num_blocks = num_blocks
        if self.model.compiled_layers is not None and self.compile_seconds is None:
            self._compile()
        if graphs:
            self._capture_decode_graphs(spare_block=num_blocks)
        if self.config.model_config.enable_return_routed_experts and self.pp_group.is_last_rank:
            from spmd_engine.worker.routing_replay import RoutingBuffer
            spec = self.model.spec
            moe_layers = sum(spec.is_moe_layer(i) for i in range(spec.num_layers))
            self.routing = RoutingBuffer(num_blocks * self.block_size, moe_layers, spec.moe.top_k,
                                         spec.moe.num_experts, self.block_size)

    def _wants_decode_graphs(self) -> bool:
        """CUDA graphs for decode steps: on CUDA where the config asks (arg_utils' rule), one rank
        alone in its TP and PP groups (a collective inside a graph is not proven here)."""
        if self.kv_windows:
            if self.device.type == "cuda":
                logger.info("CUDA graphs: off for a KV cache of several groups (a decode graph takes one "
                            "block table for every layer)")
            return False
        if self.device.type != "cuda" or self.config.compilation_config.cudagraph_mode in (None, "NONE"):
            return False
        if self.tp_group.world_size > 1 or self.pp_group.world_size > 1:
            if self.decode_graphs is None:
                logger.info("CUDA graphs: off with tensor or pipeline parallelism (not proven here)")
            return False
        return True

    def _capture_decode_graphs(self, spare_block: int) -> None:
        from spmd_engine.worker.decode_graphs import DecodeGraphs, default_sizes
        sc, cc = self.config.scheduler_config, self.config.compilation_config
        sizes = cc.cudagraph_capture_sizes or default_sizes(sc.max_num_seqs)
        self.decode_graphs = DecodeGraphs(self.model, sizes, -(-sc.max_model_len // self.block_size), spare_block,
                                          self.block_size, self.device)
        if not getattr(self, "_weights_on_host", False):  # else the first decode step captures
            with torch.inference_mode():
                self.decode_graphs.capture_all()

    def release_kv_cache(self) -> None:
        if self.decode_graphs is not None:
            self.decode_graphs.release()  # they write into the cache being dropped
        self.model.bind_kv_cache(None)
        self.num_blocks = 0
        self.routing = None  # its rows belong to the KV blocks just dropped

    # -- sleep mode ------------------------------------------------------------------
    def sleep(self, level: int) -> None:
        """Level 1: drop the KV cache (and on an accelerator move the weights to host memory);
        level 2: also discard the weights (a later load_weights / reload_weights brings them)."""
        if self.num_blocks:
            self._sleeping_blocks = self.num_blocks
        self.release_kv_cache()
        # The requests' own state stays: requests kept through the sleep (pause mode "keep")
        # recompute their KV on wake and go on; finished ones are dropped as every step drops them.
        self.block_tables.clear()
        if level == 2:
            self.model.discard_weights()
        elif self.device.type != "cpu":
            self.model.move_weights("cpu")
            self._weights_on_host = True

    def wake_up(self, tags: list[str]) -> None:
        if "weights" in tags:
            if getattr(self, "_weights_on_host", False):
                self.model.move_weights(self.device)
                self._weights_on_host = False
            # Weights discarded at level 2 get storage again; their values come from the next load.
            self.model.allocate_discarded_weights()
        if "kv_cache" in tags and not self.num_blocks and getattr(self, "_sleeping_blocks", 0):
            self.initialize_kv_cache(self._sleeping_blocks)

    # -- every step ----------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run this rank's stage. None means: ask sample_tokens for the result."""
        for rid in out.finished_request_ids:
            self.sampler.remove_request(rid)
            self.block_tables.pop(rid, None)
            self.prompt_lens.pop(rid, None)
            self.known_lens.pop(rid, None)
            self.last_sampled.pop(rid, None)
            self.lora_of.pop(rid, None)
        for new in out.new_requests:
            self.sampler.add_request(new.request_id, new.params, new.seed, new.stop_ids, new.prompt_token_ids)
            self.prompt_lens[new.request_id] = new.num_prompt_tokens
            if new.lora_int_id:
                self.lora_of[new.request_id] = new.lora_int_id
        if out.lora_loads or out.lora_evictions:
            self._apply_lora_residency(out)
        if not out.seqs:
            if self.config.dp_waves:  # the other replicas run a forward this step: match it
                self.execute_dummy_batch()
            return EMPTY_MODEL_RUNNER_OUTPUT
        if self.async_scheduling:
            self._fill_placeholders(out)
        input_ids, positions, attn, sample_index = self._prepare_inputs(out)
        intermediate = None
        if not self.pp_group.is_first_rank:
            intermediate = self.pp_group.recv_tensor_dict()
        lora = self._set_lora_step(out, attn, len(positions))
        step = attn.decode_step() if self.decode_graphs is not None and not lora else None
        all_logits = None
        try:
            if step is not None and self.decode_graphs.size_for(len(input_ids)) is not None:
                hidden_states, all_logits = self.decode_graphs.run(input_ids, positions, step)
                hidden = {"hidden_states": hidden_states}
            else:
                hidden = self.model.forward(input_ids if self.pp_group.is_first_rank else None,
                                            positions, attn, intermediate)
        finally:
            if lora:
                self.lora.clear_step()
        sampling = [s.request_id for s in out.seqs if s.sample]
        if not self.pp_group.is_last_rank:
            self.pp_group.send_tensor_dict(hidden)
            self._pending = (sampling, None, None)
            return None
        logits = tokens = None
        if sampling and all_logits is not None:  # a copy: the graph's outputs are overwritten by the next replay
            logits = all_logits.clone() if sample_index is None else all_logits[sample_index]
        elif sampling:
            rows = hidden["hidden_states"]
            rows = rows if sample_index is None else rows[sample_index]
            if self.sampler.all_plain(sampling):  # argmax only: the LM head may skip the logits
                tokens = self.model.greedy_tokens(rows)
            else:
                logits = self.model.compute_logits(rows)
        # The output index each sampled token will take, and the penalties' token history, both
        # from the schedule: a token dropped by the scheduler (preempted in flight) leaves no trace.
        for s in out.seqs:
            self.sampler.observe(s.request_id, s.context_len - self.prompt_lens[s.request_id], s.token_ids)
        outputs_at = [s.context_len + len(s.token_ids) - self.prompt_lens[s.request_id]
                      for s in out.seqs if s.sample]
        self._pending = (sampling, tokens if tokens is not None else (logits, outputs_at, out.grammar),
                         self._prompt_logprobs(out, attn, hidden["hidden_states"]))
        if self.routing is not None:
            self._pending_routing = self.routing.record(out.seqs, attn.row_start, attn.slot_mapping,
                                                        hidden["routed_experts"], self.block_tables)
        return None

    # -- LoRA adapters ------------------------------------------------------------------
    def _apply_lora_residency(self, out: SchedulerOutput) -> None:
        if self.lora is None:
            raise RuntimeError(f"step {out.step} carries LoRA adapters and this engine has no enable_lora")
        for lora_id in out.lora_evictions:
            self.lora.remove(lora_id)
        for source in out.lora_loads:
            self.lora.add(source, replace=True)

    def _set_lora_step(self, out: SchedulerOutput, attn, num_rows: int) -> bool:
        """Each packed row's adapter for this forward; False when every row is the base model's."""
        if self.lora is None or not any(self.lora_of.get(s.request_id) for s in out.seqs):
            return False
        rows = [0] * num_rows
        for i, s in enumerate(out.seqs):
            lora_id = self.lora_of.get(s.request_id, 0)
            if lora_id:
                start = attn.row_start[i]
                rows[start:start + len(s.token_ids)] = [lora_id] * len(s.token_ids)
        self.lora.set_step(rows)
        return True

    def add_lora(self, source, replace: bool = False) -> bool:
        return self._lora_manager().add(source, replace)

    def remove_lora(self, lora_id: int) -> bool:
        return self._lora_manager().remove(lora_id)

    def pin_lora(self, lora_id: int) -> bool:
        return self._lora_manager().pin(lora_id)

    def list_loras(self) -> set[int]:
        return self._lora_manager().list()

    def _lora_manager(self):
        if self.lora is None:
            raise ValueError("LoRA is not enabled: start the engine with enable_lora=True")
        return self.lora

    def _fill_placeholders(self, out: SchedulerOutput) -> None:
        """The tokens the previous step sampled, where this step was scheduled before they were
        known. Filled into the message itself: the penalties' history reads it too."""
        for s in out.seqs:
            if s.token_ids and s.token_ids[-1] == PLACEHOLDER_TOKEN_ID:
                try:
                    token = self.last_sampled[s.request_id]
                except KeyError:
                    raise RuntimeError(f"step {out.step}: request {s.request_id!r} asks for the token it "
                                       f"sampled last, and this rank sampled none for it") from None
                s.token_ids = [token if t == PLACEHOLDER_TOKEN_ID else t for t in s.token_ids]

    def _prompt_logprobs(self, out: SchedulerOutput, attn, hidden: torch.Tensor) -> dict | None:
        """Logprobs of the prompt tokens this step's rows predict, for requests that asked: the
        logits at position p rate prompt token p + 1. Positions already reported (a request
        recomputed after preemption) are skipped."""
        wanted = []
        for i, s in enumerate(out.seqs):
            state = self.sampler.requests.get(s.request_id)
            if state is None or state.params.prompt_logprobs is None:
                continue
            prompt = state.prompt_token_ids
            first = max(s.context_len, state.prompt_logprobs_done)
            stop = min(s.context_len + len(s.token_ids), len(prompt) - 1)
            if first >= stop:
                continue
            state.prompt_logprobs_done = stop
            rows = [attn.row_start[i] + p - s.context_len for p in range(first, stop)]
            wanted.append((s.request_id, rows, prompt[first + 1:stop + 1], state.params.prompt_logprobs))
        if not wanted:
            return None
        rows = torch.tensor([r for w in wanted for r in w[1]], dtype=torch.long).to(self.device)
        targets = torch.tensor([t for w in wanted for t in w[2]], dtype=torch.long).to(self.device)
        # Prompt tokens are not sampled: no processing applies, so the processed modes give
        # the raw values (log_softmax, or the logits themselves in the *_logits modes).
        entries = logprob_entries(self.model.compute_logits(hidden[rows]), targets,
                                  [w[3] for w in wanted for _ in w[1]],
                                  normalize=self.sampler.logprobs_mode.endswith("logprobs"),
                                  invariant=self.batch_invariant)
        result, start = {}, 0
        for rid, rows_of, _, _ in wanted:
            result[rid] = entries[start:start + len(rows_of)]
            start += len(rows_of)
        return result

    @torch.inference_mode()
    def execute_dummy_batch(self) -> None:
        """One token through this stage, for a replica with no work during a DP wave: its expert
        layers' collectives meet the busy replicas'. No KV write (the token attends only to
        itself), no logits, no output; counted in the stats as a dummy step."""
        from spmd_engine.model.layers.attention import AttentionMetadata
        attn = AttentionMetadata.build([0], [1], [[0]], self.block_size, self.device)
        attn.slot_mapping = None
        first, last = self.pp_group.is_first_rank, self.pp_group.is_last_rank
        intermediate = None if first else self.pp_group.recv_tensor_dict()
        input_ids = torch.zeros(1, dtype=torch.long, device=self.device) if first else None
        hidden = self.model.forward(input_ids, attn.positions, attn, intermediate)
        if not last:
            self.pp_group.send_tensor_dict(hidden)
        self.stats["dummy_steps"] += 1

    @torch.inference_mode()
    def _compile(self) -> None:
        """Compile at start-up, once per process: forwards of dummy tokens build the graphs every
        later step reuses (CompiledLayers.warm_up_steps): fresh prompts that write
        nothing, and decodes that write into block 0, zeroed again afterwards (no request holds
        a block yet). The time goes to the log and get_stats."""
        from spmd_engine.compilation.precompiled import cache_dir
        from spmd_engine.model.layers.attention import AttentionMetadata
        compiled = self.model.compiled_layers
        t = time.perf_counter()
        bs = self.block_size
        for n, decode in compiled.warm_up_steps():
            if decode:  # n requests with a few tokens cached in block 0, one new token each
                attn = AttentionMetadata.build([1 + i % bs for i in range(n)], [1] * n, [[0, 0]] * n, bs,
                                               self.device)
            else:
                attn = AttentionMetadata.build([0], [n], [[0] * -(-n // bs)], bs, self.device)
                attn.slot_mapping = None
            first = self.pp_group.is_first_rank
            ids = torch.zeros(n, dtype=torch.long, device=self.device) if first else None
            intermediate = None if first else {
                key: torch.zeros(n, self.model.spec.hidden_size, dtype=self.model.dtype, device=self.device)
                for key in ("hidden_states", "residual")}
            self.model.forward(ids, attn.positions, attn, intermediate)
        for layer in self.model._attention_layers():
            layer.k_cache[0].zero_()
            layer.v_cache[0].zero_()
        self.compile_seconds = time.perf_counter() - t
        n = compiled.min_tokens
        chunk_lengths = sorted({len(c) for c in compiled.chunks}, reverse=True)
        if compiled.ahead:
            how = "AOTInductor packages"
            source = f"{len(compiled.loaded)} of {compiled.graphs()} loaded, {compiled.graphs() - len(compiled.loaded)} built"
        else:
            how, source = "torch.compile", "traced"
        logger.info("compiled forward: %d decoder layers through %s (%s), graphs of %s layers (%s), "
                    "in %.2f s, steps of >= %d tokens (inductor cache %s)", len(self.model.model.layers), how,
                    self.config.compilation_config.backend, " and ".join(map(str, chunk_lengths)), source,
                    self.compile_seconds, n, cache_dir())

    def _prepare_inputs(self, out: SchedulerOutput):
        from spmd_engine.model.layers.attention import AttentionMetadata
        context, lens, tables = [], [], []
        prefill = 0
        for s in out.seqs:
            if self.kv_windows:
                table = group_tables.update(self.block_tables, s.request_id, s.block_ids, s.new_block_table)
            elif s.new_block_table:
                table = self.block_tables[s.request_id] = list(s.block_ids)
            else:
                table = self.block_tables[s.request_id]
                table.extend(s.block_ids)
            n = len(s.token_ids)
            context.append(s.context_len)
            lens.append(n)
            tables.append(table)
            prefill += max(0, min(s.context_len + n, self.prompt_lens.get(s.request_id, 0)) - s.context_len)
        if self.kv_windows:
            attn = group_tables.build(context, lens, tables, self.kv_windows, self.block_size, self.device,
                                      self.batch_invariant)
        else:
            attn = AttentionMetadata.build(context, lens, tables, self.block_size, self.device,
                                           invariant=self.batch_invariant)
        attn.known_lens = [max(self.prompt_lens.get(s.request_id, 0), self.known_lens.get(s.request_id, 0))
                           for s in out.seqs]
        for s, known in zip(out.seqs, attn.known_lens):  # a sampled token makes the request one longer
            self.known_lens[s.request_id] = max(known, s.context_len + len(s.token_ids) + s.sample)
        ids = attn.pack([s.token_ids for s in out.seqs])
        # The last token of each sampling request, in schedule order, wherever packing put it;
        # None when that is every row in order (a decode step): no gather.
        sample_index = [attn.row_start[i] + lens[i] - 1 for i, s in enumerate(out.seqs) if s.sample]
        self.stats["steps"] += 1
        self.stats["tokens"] += len(ids)
        self.stats["prefill_tokens"] += prefill
        self.stats["sampled"] += len(sample_index)
        input_ids = torch.tensor(ids, dtype=torch.long).to(self.device)
        if sample_index == list(range(len(ids))):
            return input_ids, attn.positions, attn, None
        return input_ids, attn.positions, attn, torch.tensor(sample_index, dtype=torch.long).to(self.device)

    @torch.inference_mode()
    def sample_tokens(self) -> ModelRunnerOutput | None:
        if self._pending is None:
            return None
        request_ids, head, prompt_logprobs = self._pending  # head: (logits, output indices, grammar) or tokens
        self._pending = None
        result = None
        if self.pp_group.is_last_rank:
            if not request_ids:
                sampled = SamplerOutput([])
            elif isinstance(head, torch.Tensor):  # the tokens themselves (greedy_tokens)
                sampled = self.sampler.take_greedy(request_ids, head)
            else:
                sampled = self.sampler.sample(request_ids, *head)
            result = ModelRunnerOutput(request_ids, sampled.token_ids, sampled.logprobs, prompt_logprobs,
                                       sampled.sampling_masks)
            if self.async_scheduling:
                self.last_sampled.update(zip(request_ids, map(int, sampled.token_ids)))
            result.routed_experts, self._pending_routing = self._pending_routing, None
        if self.broadcast_sampled_tokens and self.pp_group.world_size > 1:
            result = self.pp_group.broadcast_object(result, src=self.pp_group.world_size - 1)
        return result

    def get_stats(self) -> dict:
        """Tokens this rank computed: all of them, those of prompts (prefix hits excluded), steps."""
        compiled = self.model.compiled_layers if self.model is not None else None
        graphs = self.decode_graphs
        return dict(self.stats, num_blocks=self.num_blocks, block_size=self.block_size,
                    compile_seconds=self.compile_seconds,
                    cuda_graph_sizes=list(graphs.sizes) if graphs is not None else [],
                    cuda_graph_captures=graphs.captures if graphs is not None else 0,
                    cuda_graph_steps=graphs.steps if graphs is not None else 0,
                    compiled_graphs=compiled.graphs() if compiled is not None else 0,
                    compiled_graphs_loaded=len(compiled.loaded) if compiled is not None else 0,
                    compiled_calls_refused=compiled.refused if compiled is not None else 0)


def _zeros(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    device = torch.device(device)
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    import numpy as np
    nbytes = dtype.itemsize
    for d in shape:
        nbytes *= d
    # np.zeros of a large array is calloc: the kernel hands out zero pages on first touch.
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)
