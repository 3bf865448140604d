"""DP > 1 without a launcher: one EngineCore_DP{i} process per replica.

Each replica is a whole engine (scheduler, KV cache, executor and its own
workers). The launching process splits the prompts over the replicas, waits for
every replica, and puts the results back in input order. A replica that fails
does not take the others down: their results are kept on the raised error.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import traceback
from dataclasses import replace
from multiprocessing.connection import wait

from spmd_engine import topology
from spmd_engine.config import EngineConfig
from spmd_engine.engine.core import EngineDeadError, ProgressCallback
from spmd_engine.engine.request import Request
from spmd_engine.executor.abstract import dumps_method, loads_method

POLL_S = 0.2


class DPEngineClient:
    def __init__(self, config: EngineConfig, executor_class, max_model_len: int, eos: int | None):
        dp_size = config.parallel_config.data_parallel_size
        from spmd_engine.proc_util import mp_context
        ctx = mp_context()
        self.procs: list[mp.Process] = []
        self.conns = []
        for dp_rank in range(dp_size):
            pc = replace(config.parallel_config, data_parallel_rank=dp_rank, data_parallel_rank_local=dp_rank,
                         distributed_executor_backend=config.parallel_config.distributed_executor_backend)
            replica_config = replace(config, parallel_config=pc)
            parent, child = ctx.Pipe()
            name = topology.engine_core_name(dp_rank, dp_size)
            proc = ctx.Process(target=run_engine_core, name=name, daemon=False,
                               args=(replica_config, executor_class, max_model_len, eos, name, child, os.getpid(),
                                     logging.getLogger("spmd_engine").getEffectiveLevel()))
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

    def generate(self, requests: list[Request], progress: ProgressCallback | None = None) -> list[Request]:
        """Every replica runs its share at once; their progress messages are relayed as they come."""
        shares = [requests[i::len(self.procs)] for i in range(len(self.procs))]
        for conn, share in zip(self.conns, shares):
            conn.send(("generate", (share, progress is not None)))
        finished, errors = [], []
        pending = {conn: i for i, conn in enumerate(self.conns)}
        while pending:
            ready = wait(list(pending), timeout=POLL_S)
            ready += [c for c, i in pending.items() if c not in ready and not self.procs[i].is_alive()]
            for conn in ready:
                i = pending[conn]
                try:
                    status, payload = self._receive(i, "generate")
                except EngineDeadError as exc:
                    errors.append(str(exc))
                    del pending[conn]
                    continue
                if status == "progress":
                    progress(*payload)
                else:
                    finished.extend(payload)
                    del pending[conn]
        if errors:
            err = EngineDeadError("; ".join(errors))
            err.partial = finished  # other replicas' results are intact
            raise err
        return finished

    def collective_rpc(self, method, args=(), kwargs=None, unique_reply_rank=None):
        for conn in self.conns:
            conn.send(("rpc", (dumps_method(method), args, kwargs, unique_reply_rank)))
        return [r for i in range(len(self.procs)) for r in self._reply(i, "collective_rpc")]

    def call_core(self, method: str, *args) -> list:
        """`EngineCore.method(*args)` in every replica, one reply each (prefix cache, stats)."""
        for conn in self.conns:
            conn.send(("core", (method, args)))
        return [self._reply(i, method) for i in range(len(self.procs))]

    def shutdown(self) -> None:
        for conn, proc in zip(self.conns, self.procs):
            if proc.is_alive():
                try:
                    conn.send(("shutdown", None))
                except (BrokenPipeError, OSError):
                    pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []


def run_engine_core(config, executor_class, max_model_len, eos, name, conn, parent_pid,
                    log_level=logging.WARNING) -> None:
    """Body of an EngineCore_DP{i} process: build the engine, then serve the front end."""
    from spmd_engine.engine.core import EngineCore
    from spmd_engine.proc_util import die_with_parent, set_process_title
    set_process_title(name)
    die_with_parent(parent_pid)
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
                if kind == "generate":
                    share, relay_progress = payload
                    for request in share:
                        core.add_request(request)
                    relay = (lambda n, tokens: conn.send(("progress", (n, tokens)))) if relay_progress else None
                    conn.send(("ok", core.run_until_done(relay)))
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


def _one_line(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()
