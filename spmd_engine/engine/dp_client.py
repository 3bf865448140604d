"""DP > 1 without a launcher: one EngineCore_DP{i} process per replica.

Each replica is a whole engine (scheduler, KV cache, executor and its own
workers), but all replicas' workers join one torch world of world_size_across_dp
ranks, rank = dp * world_size + rank in the replica (vLLM's layout), at a store
this process hosts: the DP and EP groups `plan` prints exist. Requests go to the
replicas in turn, in the order added; each step() steps every replica with work
at once (all of them with DP waves) and gathers what made progress.

A replica sends back, each step, its finished requests and those that stream
(output_kind other than FINAL_ONLY). A replica that fails (an mp worker died, a
worker raised) fails the whole call at once: every replica's process is ended
(their workers follow by the parent-death signal and their own liveness checks),
and the error carries the requests that had finished in that step (`exc.finished`;
the front end adds those of earlier steps).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import signal
import traceback
from dataclasses import replace
from multiprocessing.connection import wait

from spmd_engine import topology
from spmd_engine.config import EngineConfig
from spmd_engine.core.request import Request
from spmd_engine.engine.core_client import EngineCoreClient, EngineDeadError
from spmd_engine.executor.abstract import dumps_method, loads_method

POLL_S = 0.2


class DPEngineClient(EngineCoreClient):
    def __init__(self, config: EngineConfig, executor_class, max_model_len: int, eos: int | None):
        dp_size = config.parallel_config.data_parallel_size
        self.config = config
        from spmd_engine.executor.proc_util import created_from_main_thread, mp_context
        ctx = mp_context()
        self.procs: list[mp.Process] = []
        self.conns = []
        self.failed: str | None = None
        self._added = 0
        self._owner: dict[str, int] = {}  # unfinished request id -> its replica
        self._pending: list[list[Request]] = [[] for _ in range(dp_size)]  # added, not yet sent
        self._unfinished = [0] * dp_size
        # Every replica's workers join one torch world (vLLM's layout), meeting at this store, on
        # a port the OS picks; it lives as long as the replicas do.
        from spmd_engine.distributed.loopback_store import loopback_store
        self._store = loopback_store(config.timeout_s)
        for dp_rank in range(dp_size):
            pc = replace(config.parallel_config, data_parallel_rank=dp_rank, data_parallel_rank_local=dp_rank,
                         distributed_executor_backend=config.parallel_config.distributed_executor_backend,
                         data_parallel_master_ip="127.0.0.1", data_parallel_master_port=self._store.port)
            replica_config = replace(config, parallel_config=pc)
            parent, child = ctx.Pipe()
            name = topology.engine_core_name(dp_rank, dp_size)
            proc = ctx.Process(target=run_engine_core, name=name, daemon=False,
                               args=(replica_config, executor_class, max_model_len, eos, name, child, os.getpid(),
                                     logging.getLogger("spmd_engine").getEffectiveLevel(),
                                     created_from_main_thread()))
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        try:
            for i in range(dp_size):
                self._reply(i, "start-up")
        except BaseException:
            self.shutdown()
            raise

    def _receive(self, i: int, what: str):
        """Replica i's next message (status, payload), once one has arrived; EngineDeadError
        if the replica died, closed its pipe, or reports an error."""
        conn, proc = self.conns[i], self.procs[i]
        if not conn.poll(0) and not proc.is_alive():
            raise EngineDeadError(f"{proc.name} (pid {proc.pid}) died during {what} "
                                  f"with exit code {proc.exitcode}")
        try:
            status, payload = conn.recv()
        except EOFError:
            raise EngineDeadError(f"{proc.name} (pid {proc.pid}) closed its pipe during {what}") from None
        if status == "error":
            raise EngineDeadError(f"{proc.name}: {payload}")
        return status, payload

    def _reply(self, i: int, what: str):
        while not self.conns[i].poll(POLL_S):
            if not self.procs[i].is_alive():
                break  # _receive reports how it died
        return self._receive(i, what)[1]

    def add_request(self, request: Request) -> None:
        i = self._added % len(self.procs)
        self._added += 1
        self._owner[request.request_id] = i
        self._pending[i].append(request)  # sent with replica i's next step

    def abort_requests(self, request_ids: list[str]) -> list[Request]:
        self._check_alive()
        aborted, sent = [], []
        for i, pending in enumerate(self._pending):
            kept = [r for r in pending if r.request_id not in request_ids]
            for r in pending:
                if r.request_id in request_ids:
                    r.finish_reason = "abort"
                    aborted.append(r)
            self._pending[i] = kept
        owners = sorted({self._owner[rid] for rid in request_ids if rid in self._owner})
        for i in owners:
            self.conns[i].send(("abort", [rid for rid in request_ids if self._owner.get(rid) == i]))
            sent.append(i)
        for i, done in self._gather(sent, "abort_request").items():
            aborted += done
            self._unfinished[i] -= len(done)
        for r in aborted:
            self._owner.pop(r.request_id, None)
        return aborted

    def step(self) -> list[Request]:
        """Every replica with work (or all, with DP waves) runs one step at once."""
        self._check_alive()
        busy = [i for i in range(len(self.procs))
                if self.config.dp_waves or self._unfinished[i] or self._pending[i]]
        for i in busy:
            adds, self._pending[i] = self._pending[i], []
            self._unfinished[i] += len(adds)
            self.conns[i].send(("step", adds))
        progressed = []
        for i, (shipped, unfinished) in self._gather(busy, "step").items():
            self._unfinished[i] = unfinished
            progressed += shipped
            for r in shipped:
                if r.finish_reason is not None:
                    self._owner.pop(r.request_id, None)
        return progressed

    def has_unfinished_requests(self) -> bool:
        if any(self._pending) or not self.config.dp_waves:
            return any(self._pending) or any(self._unfinished)
        return any(self.call_core("has_unfinished_requests"))  # every replica together: the wave's collective

    def drain(self) -> list[Request]:
        return [r for replica in self.call_core("drain") for r in replica]

    def _check_alive(self) -> None:
        if self.failed:
            raise EngineDeadError(f"Executor failed. (the DP replicas were shut down after: {self.failed})")

    def _gather(self, indices: list[int], what: str) -> dict:
        """The replies of these replicas, as they arrive; the first failure fails fast."""
        replies: dict = {}
        pending = {self.conns[i]: i for i in indices}
        while pending:
            ready = wait(list(pending), timeout=POLL_S)
            ready += [c for c, i in pending.items() if c not in ready and not self.procs[i].is_alive()]
            for conn in ready:
                i = pending.pop(conn)
                try:
                    replies[i] = self._receive(i, what)[1]
                except EngineDeadError as exc:
                    finished = [r for reply in replies.values() if what == "step"
                                for r in reply[0] if r.finish_reason is not None]
                    self._fail_fast(str(exc), finished)
        return dict(sorted(replies.items()))

    def _fail_fast(self, why: str, finished: list[Request]) -> None:
        """One replica failed: end every replica now (the others' work is lost with the call),
        keep what had already arrived, and raise."""
        self.failed = why
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()  # no handler in an EngineCore: it ends now, its workers with it
        for i, conn in enumerate(self.conns):  # requests finished before the fault, still in the pipes
            try:
                while conn.poll(0):
                    status, payload = conn.recv()
                    if status == "ok" and isinstance(payload, tuple) and len(payload) == 2:
                        finished.extend(r for r in payload[0] if r.finish_reason is not None)
            except (EOFError, OSError, ValueError, pickle.UnpicklingError):
                pass  # a message cut short by the kill
        _end_processes(self.procs, grace_s=5.0)
        raise EngineDeadError(why, finished)

    @property
    def vllm_config(self) -> EngineConfig:
        """The replicas' configuration, with the block count their workers agreed on (one
        world across DP: the same in every replica)."""
        cache = self.config.cache_config
        if cache.num_gpu_blocks is None:
            cache.num_gpu_blocks, cache.num_cpu_blocks = self.call_core("get_stats")[0]["num_blocks"], 0
        return self.config

    def collective_rpc(self, method, args=(), kwargs=None, unique_reply_rank=None):
        self._check_alive()
        for conn in self.conns:
            conn.send(("rpc", (dumps_method(method), args, kwargs, unique_reply_rank)))
        return [r for i in range(len(self.procs)) for r in self._reply(i, "collective_rpc")]

    def call_core(self, method: str, *args) -> list:
        """`EngineCore.method(*args)` in every replica, one reply each (prefix cache, stats)."""
        self._check_alive()
        for conn in self.conns:
            conn.send(("core", (method, args)))
        return list(self._gather(list(range(len(self.procs))), method).values())

    @property
    def llm_engine(self) -> "DPEngineClient":
        return self  # the replicas' cores live in their own processes

    def shutdown(self) -> None:
        for conn, proc in zip(self.conns, self.procs):
            if proc.is_alive():
                try:
                    conn.send(("shutdown", None))
                except (BrokenPipeError, OSError):
                    pass
        _end_processes(self.procs, grace_s=10.0)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []
        self._store = None  # the rendezvous TCPStore closes when dropped


def run_engine_core(config, executor_class, max_model_len, eos, name, conn, parent_pid,
                    log_level=logging.WARNING, parent_main_thread: bool = False) -> None:
    """Body of an EngineCore_DP{i} process: build the engine, then serve the front end."""
    from spmd_engine.engine.core import EngineCore
    from spmd_engine.executor.proc_util import die_with_parent, set_process_title
    set_process_title(name)
    die_with_parent(parent_pid, parent_main_thread)
    signal.signal(signal.SIGTERM, _end_with_workers)
    logging.basicConfig(level=log_level, format=f"[{name}] %(message)s")
    try:
        core = EngineCore(config, executor_class, max_model_len, eos)
    except BaseException as exc:
        conn.send(("error", _one_line(exc)))
        return
    conn.send(("ok", None))
    try:
        while True:
            try:
                kind, payload = conn.recv()
            except EOFError:
                return
            if kind == "shutdown":
                return
            try:
                if kind == "step":
                    for request in payload:
                        core.add_request(request)
                    progressed = core.step()
                    conn.send(("ok", (_shipped(progressed), core.get_num_unfinished_requests())))
                elif kind == "abort":
                    conn.send(("ok", core.abort_requests(payload)))
                elif kind == "core":
                    method, args = payload
                    conn.send(("ok", getattr(core, method)(*args)))
                elif kind == "rpc":
                    method, args, kwargs, reply_rank = payload
                    conn.send(("ok", core.executor.collective_rpc(loads_method(method), args, kwargs, reply_rank)))
            except Exception as exc:
                conn.send(("error", _one_line(exc)))
    finally:
        core.shutdown()


def _shipped(progressed: list[Request]) -> list[Request]:
    """What crosses back each step: finished requests, and those the front end streams."""
    from spmd_engine.sampling_params import RequestOutputKind
    return [r for r in progressed
            if r.finish_reason is not None or r.params.output_kind is not RequestOutputKind.FINAL_ONLY]


def _end_with_workers(signum, frame) -> None:
    """SIGTERM from the front end (fail fast): kill and reap this replica's workers, then exit,
    so that when the front end has joined this process its workers are gone too."""
    children = mp.active_children()
    for child in children:
        child.kill()
    for child in children:
        child.join(timeout=2)
    os._exit(128 + signum)


def _end_processes(procs: list[mp.Process], grace_s: float) -> None:
    """Join each process within the grace time, then SIGKILL what is left."""
    import time
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)


def _one_line(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()
