"""EngineCore: one DP replica's scheduler, KV block manager and executor, stepped until done."""

from __future__ import annotations

import hashlib
import logging
import time
from collections import deque

from spmd_engine.config import EngineConfig
from spmd_engine.core import kv_groups, kv_sizing
from spmd_engine.core.grouped_kv_cache_manager import GroupedKVCacheManager
from spmd_engine.core.kv_cache_manager import KVCacheManager
from spmd_engine.core.request import Request
from spmd_engine.core.scheduler import Scheduler
from spmd_engine.engine.core_client import EngineDeadError, FinishedCallback
from spmd_engine.engine.metrics import LatencyHistogram
from spmd_engine.engine.overlapped_steps import OverlappedSteps
from spmd_engine.engine.stop_strings import StopStringWatcher
from spmd_engine.engine.structured.manager import StructuredOutputManager
from spmd_engine.executor.abstract import Executor

logger = logging.getLogger("spmd_engine")

class EngineCore:
    def __init__(self, config: EngineConfig, executor_class: type[Executor], max_model_len: int,
                 eos_token_id: int | list[int] | None):
        self.config = config
        cache = config.cache_config
        config.scheduler_config.resolve(max_model_len, cache.block_size)
        self.executor = executor_class(config)
        try:
            num_blocks, per_token = self.executor.determine_num_kv_blocks()
            self.executor.initialize_kv_cache(num_blocks)
        except BaseException:
            self.executor.shutdown()
            raise
        self.num_kv_blocks = num_blocks
        cache.num_gpu_blocks, cache.num_cpu_blocks = num_blocks, 0
        from spmd_engine.model.windows import kv_freeing_window
        windows = _lora_spec(config).layer_windows
        window = kv_freeing_window(windows, config.model_config)
        groups = kv_groups.group_windows(windows, config.model_config)
        if groups:  # a model mixing windows: a table per group (core/grouped_kv_cache_manager.py)
            share = {w: per_token * windows.count(w) // len(windows) for w in groups}  # the layers' shares
            logger.info("engine ready: %s", kv_groups.describe(num_blocks, cache.block_size, share,
                                                               config.scheduler_config))
            kv = GroupedKVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching, groups,
                                       config.scheduler_config)
        else:
            logger.info("engine ready: %s", kv_sizing.describe(num_blocks, cache.block_size, per_token)
                        + kv_sizing.describe_window(window, config.scheduler_config, cache.block_size))
            kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching, window)
        lora = config.lora_config
        self.scheduler = Scheduler(config.scheduler_config, kv, eos_token_id, max_loras=lora.max_loras if lora else 0)
        from spmd_engine.engine.lora_adapters import LoRAAdapters
        self.loras = LoRAAdapters(lora, _lora_spec(config) if lora else None, self.executor)
        self._rope_scaling = _rope_scaling(config)  # longrope's prompts past the original context cache apart
        if self._rope_scaling and self._rope_scaling.get("rope_type") == "longrope":
            from spmd_engine.model.layers.longrope import LongRopeSwitch
            self.scheduler.stale_cache = LongRopeSwitch(self._rope_scaling)
        self.stop_strings = StopStringWatcher(config.model_config.model_dir)
        self.structured = StructuredOutputManager(config.model_config.model_dir, sorted(self.scheduler.eos_token_ids))
        self.dp_waves = config.dp_waves and config.parallel_config.data_parallel_size > 1
        self.wave_stats = {"waves": 0, "wave_steps": 0, "dummy_steps": 0}
        self._in_wave = False
        self._inter_token = LatencyHistogram()
        self._last_step = None  # (SchedulerOutput, ModelRunnerOutput) of the last step applied
        self._batch_queue: deque = deque()  # (SchedulerOutput, its result) of steps in flight
        self._peak_in_flight = 0
        self._overlap = None  # async scheduling where the step runs in this thread
        if config.scheduler_config.async_scheduling and self.dp_waves:
            logger.info("async scheduling: off during DP waves (a wave step is one forward on every replica)")
        elif config.scheduler_config.async_scheduling and self.executor.runs_steps_in_caller:
            self._overlap = OverlappedSteps(self._schedule, self.scheduler.has_unfinished, self._update,
                                            self._run_step)

    @property
    def vllm_config(self) -> EngineConfig:
        """vLLM's name for the engine's configuration (users read
        `vllm_config.cache_config.num_gpu_blocks`)."""
        return self.config

    @property
    def model_executor(self) -> Executor:
        """vLLM's name for the executor (trainers reach `model_executor.driver_worker`)."""
        return self.executor

    def add_request(self, request: Request) -> None:
        from spmd_engine.model.layers.longrope import prefix_cache_root
        request.cache_root = prefix_cache_root(self.loras.cache_root(request.lora_int_id), self._rope_scaling,
                                               request.num_prompt_tokens)
        self.structured.add(request)  # a constraint the backend refuses raises before it is queued
        self.scheduler.add_request(request)

    # -- LoRA adapters (engine/lora_adapters.py) ---------------------------------------------
    def add_lora(self, lora_request) -> bool:
        return self.loras.add(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        users = [r for r in (*self.scheduler.running, *self.scheduler.waiting) if r.lora_int_id == lora_id]
        return self.loras.remove(lora_id, in_use=len(users))

    def pin_lora(self, lora_id: int) -> bool:
        return self.loras.pin(lora_id)

    def list_loras(self) -> set[int]:
        return self.loras.list()

    def abort_requests(self, request_ids: list[str]) -> list[Request]:
        """Finish these requests now (finish_reason "abort", their tokens so far); unknown or
        finished ids are skipped. Their blocks are free when this returns."""
        aborted = self.scheduler.abort_requests(request_ids)
        for request in aborted:
            self.stop_strings.forget(request.request_id)
            self.structured.remove(request.request_id)
        return aborted

    def has_unfinished_requests(self) -> bool:
        """This replica has requests to run. With DP waves (engine/dp_waves.py): whether any
        replica has, agreed over the DP group, so every replica must call it together."""
        if not self.dp_waves:
            overlapped = self._overlap is not None and self._overlap.pending()
            return self.scheduler.has_unfinished() or bool(self._batch_queue) or overlapped
        return self._wave_open()

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.waiting)

    def step(self) -> list[Request]:
        """One engine step: schedule, run the model and sample (the executor's one step call),
        update. Returns the requests that made progress (a new token), the finished ones
        with their finish_reason set. Nothing to run: no step, nothing returned.

        With DP waves every replica steps together: the step first asks the DP group whether
        any replica has work; a replica with none then runs a dummy forward instead."""
        if self.dp_waves:
            if not self._wave_open():
                return []
            self._in_wave = True
            self.wave_stats["wave_steps"] += 1
            if not self.scheduler.has_unfinished():
                self._dummy_step()
                return []
        elif not self.has_unfinished_requests():
            return []
        if self._overlap is not None:
            return self._overlapped_step()
        if self.executor.max_concurrent_batches > 1 and not self.dp_waves:
            return self._step_with_batch_queue()  # (a wave step is exactly one forward: no queue)
        scheduler_output = self._schedule()
        return self._update(scheduler_output, self._run_step(scheduler_output))

    def _overlapped_step(self) -> list[Request]:
        progressed = self._overlap.step()
        if self._overlap.overlapped:
            self._peak_in_flight = 2
        return progressed

    def _run_step(self, scheduler_output):
        """One step, sent and read back (no other step in flight meanwhile)."""
        self._peak_in_flight = max(self._peak_in_flight, 1)
        try:
            return self.executor.execute_model_async(scheduler_output)()
        except Exception as exc:
            raise EngineDeadError(f"engine failed while running step {scheduler_output.step}: {exc}") from exc

    def _schedule(self, **in_flight):
        out = self.scheduler.schedule(**in_flight)
        if out is not None and self.loras.config is not None:  # the adapters every rank loads or drops first
            self.loras.plan_step(out)
        if out is not None and self.structured.tracks:  # the step's grammar rows, from the tokens so far
            out.grammar = self.structured.bitmask(out, {r.request_id: r for r in self.scheduler.running})
        now = time.time()
        for request in self.scheduler.running:
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
        return out

    def _update(self, scheduler_output, model_output) -> list[Request]:
        """The scheduler appends the tokens and finishes requests on EOS or length; then the
        stop strings, which need the text. The requests that got a token, in step order."""
        running = {r.request_id: r for r in self.scheduler.running}
        lengths = {rid: len(r.output_token_ids) for rid, r in running.items()}
        finished = self.scheduler.update_from_output(scheduler_output, model_output)
        self._check_stop_strings(model_output.request_ids, running, finished)
        if self.structured.tracks:
            self._end_structured(model_output.request_ids, running)
        progressed = [running[rid] for rid in dict.fromkeys(model_output.request_ids)
                      if rid in running and len(running[rid].output_token_ids) > lengths[rid]]
        now = time.time()
        for request in progressed:
            if request.first_token_time is None:
                request.first_token_time = now
            else:
                self._inter_token.observe(now - request.last_token_time)
            request.last_token_time = now
        self._last_step = (scheduler_output, model_output)
        return progressed

    @property
    def last_step_digest(self) -> str:
        """Of the last step applied: ranks of a replica compare theirs at each sync (hashed only
        when read, since only external_launcher's syncs read it)."""
        return "" if self._last_step is None else _step_digest(*self._last_step)

    def _check_stop_strings(self, sampled: list[str], running: dict[str, Request],
                            finished: list[Request]) -> None:
        """Requests whose text now holds a stop string finish with it. A request the scheduler
        finished for its length this step is checked too (the string then wins, as in vLLM);
        one that ended on an EOS or stop token is not (that token is not part of the text)."""
        done = {r.request_id for r in finished}
        for rid in sampled:
            request = running.get(rid)  # None: preempted while its step was in flight (PP)
            if request is None or not self.stop_strings.watches(request):
                continue
            ended = rid in done
            stop = None if ended and request.finish_reason != "length" else self.stop_strings.update(request)
            if ended or stop is not None:
                self.stop_strings.forget(rid)
            if stop is None:
                continue
            request.finish_reason, request.stop_reason = "stop", stop
            if not ended:
                self.scheduler.finish_request(request)

    def _end_structured(self, sampled: list[str], running: dict[str, Request]) -> None:
        """A constrained request whose grammar took a stop token ends there, even under min_tokens
        or ignore_eos (nothing after it could obey the grammar); finished ones drop their matcher."""
        for rid in dict.fromkeys(sampled):
            request = running.get(rid)
            if request is None:
                continue
            if request.finish_reason is None and self.structured.ended(request):
                token = request.output_token_ids[-1]
                request.finish_reason = "stop"
                request.stop_reason = None if token == self.scheduler.eos_token_id else token
                self.scheduler.finish_request(request)
                self.stop_strings.forget(rid)
            if request.finish_reason is not None:
                self.structured.remove(rid)

    def _wave_open(self) -> bool:
        """Whether any replica has work (collective over DP); a "no" closes the wave."""
        try:
            active = self.executor.dp_any_unfinished(self.scheduler.has_unfinished())
        except Exception as exc:
            raise EngineDeadError(f"engine failed while checking the DP wave: {exc}") from exc
        if not active and self._in_wave:
            self.wave_stats["waves"] += 1
            self._in_wave = False
        return active

    def _dummy_step(self) -> None:
        try:
            self.executor.execute_dummy_batch()
        except Exception as exc:
            raise EngineDeadError(f"engine failed while running a dummy step: {exc}") from exc
        self.wave_stats["dummy_steps"] += 1

    def _step_with_batch_queue(self) -> list[Request]:
        """vLLM's batch queue: send steps until `max_concurrent_batches` are in flight or
        nothing else can run, then take the oldest step's result. Which steps are sent
        depends only on the order of replies, never on timing, so output is unchanged."""
        queue, limit = self._batch_queue, self.executor.max_concurrent_batches
        if len(queue) < limit and self.scheduler.has_unfinished():
            out = self._schedule(in_flight=len(queue), max_in_flight=limit)
            if out is not None:
                try:
                    queue.append((out, self.executor.execute_model_async(out)))
                    self._peak_in_flight = max(self._peak_in_flight, len(queue))
                except Exception as exc:
                    queue.clear()
                    raise EngineDeadError(f"engine failed while running step {out.step}: {exc}") from exc
                if len(queue) < limit:
                    return []
        return self._take_oldest_in_flight()

    def _take_oldest_in_flight(self) -> list[Request]:
        out, result = self._batch_queue.popleft()
        try:
            model_output = result()
        except Exception as exc:
            self._batch_queue.clear()
            raise EngineDeadError(f"engine failed while running step {out.step}: {exc}") from exc
        return self._update(out, model_output)

    def drain(self) -> list[Request]:
        """Wait for the steps in flight (PP's batch queue) and apply them: the requests that
        made progress. Afterwards nothing is in flight (pause_generation(mode="keep"))."""
        progressed = []
        if self._overlap is not None:
            progressed += self._overlap.drain()
        while self._batch_queue:
            progressed += self._take_oldest_in_flight()
        return progressed

    def run_until_done(self, on_finished: FinishedCallback | None = None) -> list[Request]:
        """Step until every request has finished; `on_finished` gets each step's finished ones."""
        finished = []
        while self.has_unfinished_requests():
            done = [r for r in self.step() if r.finish_reason is not None]
            if done and on_finished is not None:
                on_finished(done)
            finished.extend(done)
        return finished

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached block (False, changing nothing, while requests hold blocks).
        `reset_running_requests`: running requests first give their blocks back and keep their
        tokens (their KV is recomputed), so the reset always succeeds."""
        if reset_running_requests:
            self.scheduler.reset_running_requests()
        return self.scheduler.reset_prefix_cache()

    def sleep(self, level: int) -> list[dict]:
        """Free the KV cache (and, by level, the weights) on every worker: only when no request
        holds a block (requests kept by pause "keep" gave theirs back and recompute their KV).
        The prefix cache is forgotten (its blocks' contents are gone)."""
        unfinished = len(self.scheduler.running) + len(self.scheduler.waiting)
        if not unfinished:
            self.drain()  # steps still naming finished requests (aborted ones): before the KV goes
        kv = self.scheduler.kv
        if kv.num_free_blocks != kv.pool.num_blocks:
            raise RuntimeError(f"cannot sleep: {unfinished} requests unfinished, "
                               f"{kv.pool.num_blocks - kv.num_free_blocks} KV blocks in use")
        self.scheduler.reset_prefix_cache()
        reports = self.executor.collective_rpc("sleep", (level,))
        self.executor.sleeping_tags |= {"weights", "kv_cache"}
        logger.info("sleep(level=%d): %.1f MiB of RSS given back over %d workers", level,
                    sum(r["freed_bytes"] for r in reports) / 2**20, len(reports))
        return reports

    def wake_up(self, tags: list[str]) -> None:
        self.executor.collective_rpc("wake_up", (tags,))
        self.executor.sleeping_tags -= set(tags)

    def get_stats(self) -> dict:
        """Scheduler and block counters, the output rank's runner counters (`runner`), and the DP
        waves: whether this engine runs them, waves, steps in waves, dummy steps it ran idle."""
        runner = self.executor.collective_rpc("get_runner_stats",
                                              unique_reply_rank=self.executor.output_rank)[0]
        return {**self.scheduler.get_stats(), "peak_in_flight": self._peak_in_flight, "runner": runner,
                "dp_waves": self.dp_waves, **self.wave_stats, "inter_token_latency": self._inter_token.to_dict()}

    def collective_rpc(self, method, args=(), kwargs=None, unique_reply_rank=None):
        return self.executor.collective_rpc(method, args, kwargs, unique_reply_rank)

    def shutdown(self) -> None:
        if self._overlap is not None:
            self._overlap.shutdown()
        self.executor.shutdown()


def _step_digest(scheduler_output, model_output) -> str:
    """What a step scheduled and sampled, in a few bytes: every rank of a replica must agree."""
    seqs = [(s.request_id, s.context_len, len(s.token_ids), s.block_ids) for s in scheduler_output.seqs]
    summary = (scheduler_output.step, seqs, model_output.request_ids, [int(t) for t in model_output.sampled_token_ids])
    grammar = scheduler_output.grammar
    if grammar is not None:  # structured outputs: every rank must mask alike
        summary += (grammar.request_ids, hashlib.sha256(grammar.bitmask.tobytes()).hexdigest())
    return hashlib.sha256(repr(summary).encode()).hexdigest()[:16]


def _rope_scaling(config: EngineConfig):
    """The model's rope_scaling as ModelSpec reads it (None without a config.json: the bundled model)."""
    import os
    model_dir = config.model_config.model_dir
    if not model_dir or not os.path.exists(os.path.join(model_dir, "config.json")):
        return None
    return _lora_spec(config).rope_scaling


def _lora_spec(config: EngineConfig):
    """The model's spec, which adapters are checked against (config.json, read once)."""
    import json
    import os

    from spmd_engine.model.spec import ModelSpec
    path = os.path.join(config.model_config.model_dir, "config.json")
    with open(path) as f:
        return ModelSpec.from_hf_config(json.load(f), path)
