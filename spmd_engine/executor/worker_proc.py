"""The body of one mp worker process, and the engine-side handle to it.

A worker attaches to the broadcast queue as its reader and to its own response
queue as writer, builds its Worker (device, groups, model shard), reports ready
over a pipe, then serves calls until told to stop or until its engine is gone
(parent-death signal, plus a liveness check while idle).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import traceback
from dataclasses import dataclass

from spmd_engine.distributed.shm.message_queue import (
    MessageQueue,
    MessageQueueHandle,
    PeerGoneError,
    UnpicklableError,
)

SUCCESS, FAILURE = "success", "failure"
SHUTDOWN = "__shutdown__"


@dataclass
class WorkerHandle:
    name: str
    local_rank: int
    proc: mp.Process
    ready_conn: object

    def wait_ready(self, timeout: float):
        """("success", pid) once the worker loaded its shard; ("failure", why) otherwise."""
        import time
        deadline = time.monotonic() + timeout
        while not self.ready_conn.poll(0.1):
            if not self.proc.is_alive():
                return FAILURE, f"exited with code {self.proc.exitcode} during start-up"
            if time.monotonic() > deadline:
                return FAILURE, f"not ready after {timeout:g}s"
        try:
            return self.ready_conn.recv()
        except EOFError:
            return FAILURE, "closed its pipe during start-up"

    def close(self) -> None:
        self.ready_conn.close()


def start_worker(config, local_rank: int, rank: int, init_method: str | None, dp_local_rank: int,
                 rpc_handle: MessageQueueHandle, response_handle: MessageQueueHandle, name: str) -> WorkerHandle:
    from spmd_engine.executor.proc_util import created_from_main_thread, mp_context
    ctx = mp_context()
    reader, writer = ctx.Pipe(duplex=False)
    log_level = logging.getLogger("spmd_engine").getEffectiveLevel()
    proc = ctx.Process(target=worker_main, name=name, daemon=True,
                       args=(config, local_rank, rank, init_method, dp_local_rank, rpc_handle,
                             response_handle, writer, os.getpid(), name, log_level,
                             created_from_main_thread()))
    proc.start()
    writer.close()
    return WorkerHandle(name, local_rank, proc, reader)


def _share_cores(config, first_on_host: bool) -> None:
    """Give each worker its share of this host's cores (unless OMP_NUM_THREADS says otherwise).

    torch defaults every process to all cores; with several workers per host that
    oversubscribes the CPU and the ranks' threads fight over cores during every layer
    (TP ranks wait for each other at every all-reduce, so the slowest thread sets the pace).
    An explicit OMP_NUM_THREADS above the share is kept, with a warning.
    """
    import torch
    pc = config.parallel_config
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    per_host = max(1, pc.world_size * max(1, pc.data_parallel_size))
    share = max(1, cores // per_host)
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(share)
    elif first_on_host and torch.get_num_threads() > share:
        threads = torch.get_num_threads()
        logging.getLogger("spmd_engine").warning(
            "OMP_NUM_THREADS=%s gives each of the %d workers on this host %d threads, %d on %d cores: "
            "the workers will contend for cores (unset OMP_NUM_THREADS to share them out)",
            os.environ["OMP_NUM_THREADS"], per_host, threads, threads * per_host, cores)


def worker_main(config, local_rank, rank, init_method, dp_local_rank, rpc_handle, response_handle,
                ready_conn, parent_pid, name, log_level=logging.WARNING,
                parent_main_thread: bool = False) -> None:
    from spmd_engine.executor.abstract import loads_method, run_method
    from spmd_engine.executor.proc_util import die_with_parent, set_process_title
    from spmd_engine.worker.worker import Worker
    set_process_title(name)
    die_with_parent(parent_pid, parent_main_thread)
    logging.basicConfig(level=log_level, format=f"[{name}] %(message)s")
    _share_cores(config, first_on_host=local_rank == 0 and dp_local_rank == 0)
    rpc = MessageQueue.attach(rpc_handle, reader_index=local_rank)
    response = MessageQueue.attach_writer(response_handle)
    worker = None
    try:
        worker = Worker(config, local_rank=local_rank, rank=rank, distributed_init_method=init_method,
                        dp_local_rank=dp_local_rank)
        worker.init_device()
        worker.load_model()
    except BaseException as exc:
        traceback.print_exc()
        ready_conn.send((FAILURE, f"{type(exc).__name__}: {exc}"))
        return
    ready_conn.send((SUCCESS, os.getpid()))

    def engine_alive() -> bool:
        return os.getppid() == parent_pid

    try:
        while True:
            try:
                method, args, kwargs, reply_rank = rpc.dequeue(alive=engine_alive)
            except (PeerGoneError, EOFError, RuntimeError):
                return
            if method == SHUTDOWN:
                return
            method = loads_method(method)
            try:
                status, result = SUCCESS, run_method(worker, method, args, kwargs)
            except Exception as exc:
                traceback.print_exc()
                status, result = FAILURE, f"{type(exc).__name__}: {exc}"
            # A failure is always reported, even by a rank whose reply was not asked for:
            # the engine watches every response queue while it waits, and fails at once.
            if status == FAILURE or reply_rank is None or reply_rank == local_rank:
                try:
                    response.enqueue((status, result), alive=engine_alive)
                except UnpicklableError as exc:  # nothing was written: say why instead
                    response.enqueue((FAILURE, f"{exc} (the reply of {_method_name(method)} "
                                               f"could not be pickled)"), alive=engine_alive)
    finally:
        worker.shutdown()
        rpc.close()
        response.close()


def _method_name(method) -> str:
    return repr(method) if isinstance(method, str) else repr(getattr(method, "__name__", "callable"))
