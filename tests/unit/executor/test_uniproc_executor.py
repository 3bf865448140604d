"""UniProcExecutor from inside, over a stand-in Worker (no model, no groups): it runs the step in
the caller, answers collective_rpc with the worker's reply, and after a step raises refuses every
later call, naming the step, instead of running on a worker in an unknown state."""

import pytest
from fake_executor import counting_config

from spmd_engine.core.step_messages import ModelRunnerOutput, SchedulerOutput
from spmd_engine.executor.uniproc import UniProcExecutor


class StandInWorker:
    def __init__(self):
        self.calls, self.shut = [], False

    def init_device(self):
        self.calls.append("init_device")

    def load_model(self):
        self.calls.append("load_model")

    def execute_and_sample(self, out):
        if out.step == 3:
            raise ValueError("bad step")
        return ModelRunnerOutput([f"r{out.step}"], [out.step])

    def echo(self, value):
        return value

    def shutdown(self):
        self.shut = True


class StandInExecutor(UniProcExecutor):
    def _make_worker(self):
        return StandInWorker()


def step(n):
    return SchedulerOutput(n, [], [], [])


def test_the_step_runs_in_the_caller_and_rpcs_reach_the_worker(tmp_path):
    executor = StandInExecutor(counting_config(tmp_path))
    assert executor.driver_worker.calls == ["init_device", "load_model"] and executor.runs_steps_in_caller
    assert executor.execute_model_async(step(1))().sampled_token_ids == [1]
    assert executor.collective_rpc("echo", ("x",)) == ["x"]
    assert executor.collective_rpc(lambda worker, a: (type(worker).__name__, a), (2,)) == [("StandInWorker", 2)]
    executor.shutdown()
    executor.shutdown()  # twice is safe
    assert executor.driver_worker.shut


def test_after_a_step_raises_every_later_call_is_refused_naming_it(tmp_path):
    executor = StandInExecutor(counting_config(tmp_path))
    executor.execute_model_async(step(2))()
    with pytest.raises(ValueError, match="bad step"):
        executor.execute_model_async(step(3))
    assert executor.is_failed
    for call in (lambda: executor.execute_model_async(step(4)), lambda: executor.collective_rpc("echo", (1,))):
        with pytest.raises(RuntimeError, match=r"Executor failed. \(step 3 raised ValueError: bad step\)"):
            call()


def test_a_worker_that_fails_to_start_is_shut_down(tmp_path):
    class FailsToLoad(StandInWorker):
        def load_model(self):
            raise OSError("no weights")
    made = []

    class Executor(UniProcExecutor):
        def _make_worker(self):
            made.append(FailsToLoad())
            return made[-1]
    with pytest.raises(OSError, match="no weights"):
        Executor(counting_config(tmp_path))
    assert made[0].shut


class LauncherWorker(StandInWorker):
    def __init__(self, config, local_rank=0, rank=0, broadcast_sampled_tokens=False, **_):
        super().__init__()
        self.local_rank, self.rank, self.broadcast = local_rank, rank, broadcast_sampled_tokens


@pytest.fixture
def launcher_worker(monkeypatch):
    import spmd_engine.executor.uniproc as uniproc
    monkeypatch.setattr(uniproc, "Worker", LauncherWorker)


def test_external_launcher_takes_its_place_from_the_launch(tmp_path, monkeypatch, launcher_worker):
    """Each torchrun (or srun) process is an engine whose one worker sits at the launch's rank;
    every rank broadcasts its sampled tokens (a replica's ranks must hold the same ones)."""
    from spmd_engine.executor.uniproc import ExecutorWithExternalLauncher
    for name, value in {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    worker = ExecutorWithExternalLauncher(counting_config(tmp_path)).driver_worker
    assert (worker.rank, worker.local_rank, worker.broadcast) == (5, 1, True)


def test_external_launcher_without_a_launch_or_a_world_is_one_line(tmp_path, launcher_worker):
    from spmd_engine.config import ConfigError
    from spmd_engine.executor.uniproc import ExecutorWithExternalLauncher
    with pytest.raises(ConfigError, match="'external_launcher' needs a launcher \\(torchrun, srun\\)"):
        ExecutorWithExternalLauncher(counting_config(tmp_path))
