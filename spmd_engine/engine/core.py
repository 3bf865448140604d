"""EngineCore: one DP replica's scheduler, KV block manager and executor, stepped until done."""

from __future__ import annotations

import logging
from collections import deque
from typing import Iterator

from spmd_engine.config import EngineConfig
from spmd_engine.core.kv_cache_manager import KVCacheManager
from spmd_engine.core.request import Request
from spmd_engine.core.scheduler import Scheduler
from spmd_engine.engine.core_client import EngineDeadError, FinishedCallback
from spmd_engine.engine.stop_strings import StopStringWatcher
from spmd_engine.executor.abstract import Executor
from spmd_engine.worker import kv_sizing

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
        logger.info("engine ready: %s", kv_sizing.describe(num_blocks, cache.block_size, per_token))
        kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler_config, kv, eos_token_id)
        self.stop_strings = StopStringWatcher(config.model_config.model_dir)
        self.dp_waves = config.dp_waves and config.parallel_config.data_parallel_size > 1
        self.wave_stats = {"waves": 0, "wave_steps": 0, "dummy_steps": 0}
        self._batch_queue: deque = deque()  # (SchedulerOutput, its result) of steps in flight
        self._peak_in_flight = 0

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
        self.scheduler.add_request(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Request]:
        """Schedule, run the model and sample (the executor's one step call), update."""
        if self.executor.max_concurrent_batches > 1 and not self.dp_waves:
            return self._step_with_batch_queue()  # (a wave step is exactly one forward: no queue)
        scheduler_output = self.scheduler.schedule()
        self._peak_in_flight = max(self._peak_in_flight, 1)
        try:
            model_output = self.executor.execute_model_async(scheduler_output)()  # sent, then read
        except Exception as exc:
            raise EngineDeadError(f"engine failed while running step {scheduler_output.step}: {exc}") from exc
        return self._update(scheduler_output, model_output)

    def _update(self, scheduler_output, model_output) -> list[Request]:
        """The scheduler appends the tokens and finishes requests on EOS or length; then the
        stop strings, which need the text."""
        running = {r.request_id: r for r in self.scheduler.running}
        finished = self.scheduler.update_from_output(scheduler_output, model_output)
        return finished + self._check_stop_strings(model_output.request_ids, running, finished)

    def _check_stop_strings(self, sampled: list[str], running: dict[str, Request],
                            finished: list[Request]) -> list[Request]:
        """Requests whose text now holds a stop string finish with it. A request the scheduler
        finished for its length this step is checked too (the string then wins, as in vLLM);
        one that ended on an EOS or stop token is not (that token is not part of the text)."""
        stopped = []
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
                stopped.append(request)
        return stopped

    def run_steps(self) -> Iterator[list[Request]]:
        """Step until this replica's requests have finished, yielding each step's finished ones.

        With DP waves (engine/dp_waves.py), until no replica has work: every step first asks
        the DP group whether any replica has (so every replica takes the same number of steps),
        and a replica with none runs a dummy forward instead. Every replica must call this
        together (each generate call, even with no requests of its own).
        """
        if not self.dp_waves:
            while self.scheduler.has_unfinished():
                yield self.step()
            return
        steps = 0
        while self._any_replica_unfinished():
            steps += 1
            self.wave_stats["wave_steps"] += 1
            if self.scheduler.has_unfinished():
                yield self.step()
            else:
                self._dummy_step()
        self.wave_stats["waves"] += steps > 0

    def _any_replica_unfinished(self) -> bool:
        try:
            return self.executor.dp_any_unfinished(self.scheduler.has_unfinished())
        except Exception as exc:
            raise EngineDeadError(f"engine failed while checking the DP wave: {exc}") from exc

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
        if len(queue) < limit:
            out = self.scheduler.schedule(in_flight=len(queue), max_in_flight=limit)
            if out is not None:
                try:
                    queue.append((out, self.executor.execute_model_async(out)))
                    self._peak_in_flight = max(self._peak_in_flight, len(queue))
                except Exception as exc:
                    queue.clear()
                    raise EngineDeadError(f"engine failed while running step {out.step}: {exc}") from exc
                if len(queue) < limit:
                    return []
        out, result = queue.popleft()
        try:
            model_output = result()
        except Exception as exc:
            queue.clear()
            raise EngineDeadError(f"engine failed while running step {out.step}: {exc}") from exc
        return self._update(out, model_output)

    def run_until_done(self, on_finished: FinishedCallback | None = None) -> list[Request]:
        """Step until every request has finished; `on_finished` gets each step's finished ones."""
        finished = []
        for done in self.run_steps():
            if done and on_finished is not None:
                on_finished(done)
            finished.extend(done)
        return finished

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (False, changing nothing, while requests hold blocks)."""
        return self.scheduler.reset_prefix_cache()

    def sleep(self, level: int) -> list[dict]:
        """Free the KV cache (and, by level, the weights) on every worker: only when no request
        holds a block. The prefix cache is forgotten (its blocks' contents are gone)."""
        unfinished = len(self.scheduler.running) + len(self.scheduler.waiting)
        kv = self.scheduler.kv
        if unfinished or kv.num_free_blocks != kv.pool.num_blocks:
            raise RuntimeError(f"cannot sleep: {unfinished} requests unfinished, "
                               f"{kv.pool.num_blocks - kv.num_free_blocks} KV blocks in use")
        self.scheduler.reset_prefix_cache()
        reports = self.executor.collective_rpc("sleep", (level,))
        logger.info("sleep(level=%d): %.1f MiB of RSS given back over %d workers", level,
                    sum(r["freed_bytes"] for r in reports) / 2**20, len(reports))
        return reports

    def wake_up(self, tags: list[str]) -> None:
        self.executor.collective_rpc("wake_up", (tags,))

    def get_stats(self) -> dict:
        """Scheduler and block counters, the output rank's runner counters (`runner`), and the DP
        waves: whether this engine runs them, waves, steps in waves, dummy steps it ran idle."""
        runner = self.executor.collective_rpc("get_runner_stats",
                                              unique_reply_rank=self.executor.output_rank)[0]
        return {**self.scheduler.get_stats(), "peak_in_flight": self._peak_in_flight, "runner": runner,
                "dp_waves": self.dp_waves, **self.wave_stats}

    def collective_rpc(self, method, args=(), kwargs=None, unique_reply_rank=None):
        return self.executor.collective_rpc(method, args, kwargs, unique_reply_rank)

    def shutdown(self) -> None:
        self.executor.shutdown()
