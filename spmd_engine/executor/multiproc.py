"""MultiprocExecutor: the engine spawns its replica's TP x PP workers and drives them.

Each call is broadcast once through a shared-memory ring (one writer, every
worker a reader); replies come back on per-worker response queues, and only the
`unique_reply_rank`'s queue is read when one is named. A monitor thread waits on
the workers' sentinels: when any worker dies the executor marks itself failed,
terminates every worker of this replica and shuts its queues, so a blocked call
raises RuntimeError("cancelled") and a new one raises RuntimeError("Executor
failed."), as vLLM's MultiprocExecutor does.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection
import threading
import weakref
from typing import Any, Callable

from spmd_engine import topology
from spmd_engine.distributed.shm.message_queue import MessageQueue, PeerGoneError, UnpicklableError
from spmd_engine.executor.abstract import Executor, dumps_method
from spmd_engine.executor.worker_proc import FAILURE, SHUTDOWN, WorkerHandle, start_worker

# How long a failing call waits for a worker's death to become visible (its sentinel), so a
# survivor's "peer is gone" error still comes with the line naming the dead worker.
DEATH_GRACE_S = 0.2

logger = logging.getLogger("spmd_engine")


class MultiprocExecutor(Executor):
    def _init_executor(self) -> None:
        from spmd_engine.distributed.loopback_store import loopback_store
        pc = self.parallel_config
        tp, pp, pcp = pc.tensor_parallel_size, pc.pipeline_parallel_size, pc.prefill_context_parallel_size
        self.world_size = pc.world_size
        assert self.world_size == tp * pp * pcp, (
            f"world_size ({self.world_size}) must be equal to the tensor_parallel_size ({tp}) x "
            f"pipeline_parallel_size ({pp}) x prefill_context_parallel_size ({pcp}). "
        )
        self.shutting_down = False
        self.failure_callback: Callable[[], None] | None = None
        self.workers: list[WorkerHandle] = []
        self.response_mqs: list[MessageQueue] = []
        self.rpc_broadcast_mq = None
        self._in_flight = self._sent_steps = self._read_steps = 0  # steps sent, not yet read
        timeout = self.config.timeout_s
        # DP = 1: the workers' rendezvous store lives here, on a port the OS picks (no race, no
        # fixed port). DP > 1: every replica's workers join one world at the front end's store.
        self._store = None
        init_method = None
        if not pc.spans_dp_world:
            self._store = loopback_store(timeout)
            init_method = f"tcp://127.0.0.1:{self._store.port}"
        dp_rank = pc.data_parallel_rank
        try:
            self.rpc_broadcast_mq = MessageQueue.create(self.world_size, label=f"rpc_dp{dp_rank}")
            layout = pc.layout
            for local_rank in range(self.world_size):
                rank = dp_rank * self.world_size + local_rank  # the global rank formula
                coord = topology.rank_to_coord(layout, rank)
                response_mq = MessageQueue.create(1, reader_index=0, label=f"resp_dp{dp_rank}_r{local_rank}")
                self.response_mqs.append(response_mq)
                self.workers.append(start_worker(
                    self.config, local_rank, rank if pc.spans_dp_world else local_rank, init_method,
                    pc.data_parallel_rank_local or 0,
                    self.rpc_broadcast_mq.handle(), response_mq.handle(),
                    topology.worker_name(layout, coord)))
            self._wait_ready(timeout)
        except BaseException:
            self.shutdown()
            raise
        self._start_worker_monitor()

    def _wait_ready(self, timeout: float) -> None:
        for w in self.workers:
            status, detail = w.wait_ready(timeout)
            if status == FAILURE:
                raise RuntimeError(f"{w.name} failed to start: {detail}")
        alive = self._all_alive
        self.rpc_broadcast_mq.wait_attached(timeout, alive=alive)
        for mq in self.response_mqs:
            mq.wait_attached(timeout, alive=alive)

    def _all_alive(self) -> bool:
        return all(w.proc.is_alive() for w in self.workers)

    def _start_worker_monitor(self) -> None:
        workers = list(self.workers)
        self_ref = weakref.ref(self)

        def monitor_workers() -> None:
            sentinels = [w.proc.sentinel for w in workers]
            died = multiprocessing.connection.wait(sentinels)
            _self = self_ref()
            # Failed already: _fail named every worker that was dead by then.
            if not _self or getattr(_self, "shutting_down", False) or _self.is_failed:
                return
            _self.is_failed = True
            _log_death(next(w for w in workers if w.proc.sentinel in died))
            _self.shutdown(close_queues=False)
            callback = _self.failure_callback
            if callback is not None:
                _self.failure_callback = None
                callback()

        threading.Thread(target=monitor_workers, daemon=True, name="MultiprocWorkerMonitor").start()

    def collective_rpc(self, method: str | Callable, args: tuple = (), kwargs: dict | None = None,
                       unique_reply_rank: int | None = None, timeout: float | None = None) -> list[Any]:
        """Broadcast the call, then read the replies asked for, in rank order.

        Any failure -- a worker's exception (reported by whichever rank raised it,
        asked for or not), a timeout, a dead worker -- marks the executor failed and
        ends its workers before the error is raised: their queues may hold replies
        to this call that nobody will read, so no later call may run on them. Every
        later call raises RuntimeError("Executor failed.") before enqueueing anything.
        """
        if self.is_failed:
            raise RuntimeError("Executor failed.")
        if self._in_flight:  # their replies would be read as this call's
            raise RuntimeError(f"collective_rpc while {self._in_flight} steps are in flight")
        timeout = self.config.timeout_s if timeout is None else timeout
        name = self._send(method, args, kwargs, unique_reply_rank, timeout)
        ranks = list(range(self.world_size)) if unique_reply_rank is None else [unique_reply_rank]
        return self._receive(ranks, name, timeout)

    @property
    def max_concurrent_batches(self) -> int:
        """vLLM's batch queue: with PP, one step per stage in flight, so the stages overlap.
        Each worker takes its messages in order, so stage 0 starts step k+1 while the
        last stage still runs step k, and every stage sees the steps in the same order. Async
        scheduling keeps two in flight (the workers run step k while the engine schedules k+1)."""
        return max(self.parallel_config.pipeline_parallel_size, super().max_concurrent_batches)

    def execute_model_async(self, scheduler_output) -> Callable[[], Any]:
        """Send the step and return at once; the function returned reads its reply (replies
        come back in the order the steps were sent, and must be read in that order)."""
        if self.max_concurrent_batches == 1:
            return super().execute_model_async(scheduler_output)
        timeout = self.config.timeout_s
        name = self._send("execute_and_sample", (scheduler_output,), None, self.output_rank, timeout,
                          check_idle=not self._in_flight)
        self._in_flight += 1
        ticket = self._sent_steps = self._sent_steps + 1

        def result():
            if ticket != self._read_steps + 1:
                raise RuntimeError(f"step replies must be read in order: step {ticket} asked, "
                                   f"{self._read_steps + 1} next")
            self._read_steps += 1
            self._in_flight -= 1
            return self._receive([self.output_rank], name, timeout)[0]
        return result

    def _send(self, method: str | Callable, args: tuple, kwargs: dict | None, unique_reply_rank: int | None,
              timeout: float, check_idle: bool = True) -> str:
        if self.is_failed:
            raise RuntimeError("Executor failed.")
        if check_idle:
            self._check_no_late_reply()
        send_method = dumps_method(method)
        name = method if isinstance(method, str) else getattr(method, "__name__", "callable")
        try:
            self.rpc_broadcast_mq.enqueue((send_method, args, kwargs, unique_reply_rank), timeout=timeout)
        except UnpicklableError as exc:  # nothing was written: the call never happened
            raise TypeError(f"collective_rpc {name!r}: its arguments do not pickle ({exc})") from exc
        except TimeoutError:
            self._fail(f"collective_rpc {name!r}: the workers did not take the call within {timeout:g}s")
            raise TimeoutError(f"collective_rpc {name!r}: the workers did not take the call within "
                               f"{timeout:g}s") from None
        except BaseException:
            self._fail(f"collective_rpc {name!r}: could not send the call")
            raise
        return name

    def _receive(self, ranks: list[int], name: str, timeout: float) -> list[Any]:
        if self.is_failed:
            raise RuntimeError("Executor failed.")
        early: dict[int, tuple] = {}  # replies read ahead while waiting on a slower rank
        waiting_on = ranks[0]

        def no_failure_elsewhere() -> bool:
            """Checked every 0.1 s while a reply is awaited: has another worker failed?"""
            for r, mq in enumerate(self.response_mqs):
                if r != waiting_on and r not in early and mq.has_message():
                    early[r] = mq.dequeue(timeout=timeout)
            return not any(status == FAILURE for status, _ in early.values())

        results = []
        for rank in ranks:
            waiting_on = rank
            try:
                status, result = early.pop(rank) if rank in early else \
                    self.response_mqs[rank].dequeue(timeout=timeout, alive=no_failure_elsewhere)
            except PeerGoneError:
                status, result = next(v for v in early.values() if v[0] == FAILURE)
            except TimeoutError:
                message = (f"collective_rpc {name!r}: no reply from worker {rank} of this replica "
                           f"within {timeout:g}s")
                self._fail(message)
                raise TimeoutError(message) from None
            except BaseException:
                self._fail(f"collective_rpc {name!r}: interrupted while waiting for worker {rank}")
                raise
            if status == FAILURE:
                self._fail(f"collective_rpc {name!r}: a worker raised {result}")
                raise RuntimeError(f"Worker failed with error '{result}', please check the stack trace "
                                   f"above for the root cause")
            results.append(result)
        return results

    def _check_no_late_reply(self) -> None:
        """Between calls every response queue is empty, unless a worker whose reply was not
        asked for reported a failure after the call returned: fail on it now, before this
        call runs on a replica with a broken rank. (A memory read per worker.)"""
        for rank, mq in enumerate(self.response_mqs):
            if mq.has_message():
                status, result = mq.dequeue(timeout=self.config.timeout_s)
                if status == FAILURE:
                    self._fail(f"worker {rank} raised {result} after the previous call returned")
                    raise RuntimeError(f"Worker failed with error '{result}', please check the stack "
                                       f"trace above for the root cause")
                self._fail(f"worker {rank} sent a reply nobody asked for")
                raise RuntimeError("Executor failed.")

    def _fail(self, why: str) -> None:
        """Mark the executor failed and end this replica's workers (they may sit in a
        collective with the rank that failed); the queues stay mapped until shutdown."""
        if self.is_failed:
            return
        self.is_failed = True
        # A worker killed mid-call often shows first as a survivor's error ("a peer is gone"):
        # name the dead one too, as the monitor would have (it stands down once we failed).
        sentinels = {w.proc.sentinel: w for w in self.workers}
        for sentinel in multiprocessing.connection.wait(list(sentinels), timeout=DEATH_GRACE_S):
            _log_death(sentinels[sentinel])
        logger.error("%s; shutting down executor.", why)
        self.shutdown(close_queues=False)
        callback = self.failure_callback
        if callback is not None:
            self.failure_callback = None
            callback()

    def shutdown(self, close_queues: bool = True) -> None:
        """Stop every worker of this replica and cancel its queues; safe to call twice.

        The monitor thread calls it with close_queues=False: the engine thread may be
        blocked in a dequeue on those queues, and must wake to RuntimeError("cancelled"),
        not find the memory under it unmapped. The owner's own shutdown closes them.
        """
        queues = [mq for mq in [self.rpc_broadcast_mq, *self.response_mqs] if mq is not None]
        if not getattr(self, "shutting_down", False):
            self.shutting_down = True
            grace = 0.0  # a failed replica's survivors sit in collectives: terminate them now
            if self.rpc_broadcast_mq is not None and not self.is_failed and self._all_alive():
                try:
                    self.rpc_broadcast_mq.enqueue((SHUTDOWN, (), None, None), timeout=2)
                    grace = 5.0
                except Exception:
                    pass
            if self.is_failed:
                for mq in queues:  # wake a blocked call first: the caller learns at once
                    mq.shutdown()
            _ensure_worker_termination([w.proc for w in self.workers], grace)
            for w in self.workers:
                w.close()
        for mq in queues:
            mq.shutdown()
            if close_queues:
                mq.close()
        if close_queues:
            self._store = None  # the rendezvous TCPStore closes when dropped


def _ensure_worker_termination(procs: list[mp.Process], grace_s: float = 5.0) -> None:
    """Join, then SIGTERM, then SIGKILL: every worker of the replica goes."""
    import time
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=2)
        if p.is_alive():
            p.kill()
            p.join(timeout=2)


def _log_death(worker) -> None:
    """The line that names a dead worker: its name, local rank, pid and how it ended."""
    worker.proc.join(timeout=1.0)  # the sentinel can fire before the exit status is reapable
    logger.error("Worker proc %s (local rank %d, pid %d) died unexpectedly with %s, shutting down executor.",
                 worker.name, worker.local_rank, worker.proc.pid, _exit_description(worker.proc.exitcode))


def _exit_description(code: int | None) -> str:
    if code is None:
        return "unknown status"
    if code < 0:
        import signal
        return f"signal {signal.Signals(-code).name}"
    return f"exit code {code}"

