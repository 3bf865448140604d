"""ParallelConfig validation and the seed's backend resolution."""

import pytest

from spmd_engine.config import ConfigError, ParallelConfig, resolve_backend

NO_LAUNCHER: dict = {}
TORCHRUN = {"RANK": "0", "WORLD_SIZE": "8", "LOCAL_RANK": "0"}


@pytest.fixture(autouse=True)
def _no_torchrun_env(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def test_world_size_excludes_dp():
    cfg = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2)
    assert cfg.world_size == 4 and cfg.world_size_across_dp == 8
    cfg = ParallelConfig(data_parallel_size=2)
    assert cfg.world_size == 1 and cfg.world_size_across_dp == 2


def test_backend_resolution_as_the_seed_traces_it():
    # TP = PP = DP = 1: uni. DP = 2 at TP = 1: world_size_across_dp = 2 > 1, so mp.
    assert ParallelConfig().distributed_executor_backend == "uni"
    assert ParallelConfig(data_parallel_size=2).distributed_executor_backend == "mp"
    assert ParallelConfig(tensor_parallel_size=2).distributed_executor_backend == "mp"
    # An explicit value wins.
    assert ParallelConfig(data_parallel_size=2, distributed_executor_backend="uni").distributed_executor_backend == "uni"
    # Under torchrun the launcher made every process.
    assert resolve_backend(None, 4, 8, TORCHRUN) == "external_launcher"
    assert resolve_backend("mp", 4, 8, TORCHRUN) == "mp"
    assert resolve_backend(None, 1, 1, NO_LAUNCHER) == "uni"


def test_backend_under_srun_is_external_launcher_as_the_cli_resolves_it():
    srun = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0"}
    assert resolve_backend(None, 2, 2, srun) == "external_launcher"
    assert resolve_backend(None, 1, 1, dict(srun, SLURM_NTASKS="1")) == "external_launcher"
    assert resolve_backend("mp", 2, 2, srun) == "mp"
    # A command typed in an sbatch / salloc shell sees the allocation but is no srun task.
    sbatch_shell = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "7"}
    assert resolve_backend(None, 2, 2, sbatch_shell) == "mp"


def test_backend_under_torchrun_env(monkeypatch):
    for k, v in TORCHRUN.items():
        monkeypatch.setenv(k, v)
    assert ParallelConfig(tensor_parallel_size=2).distributed_executor_backend == "external_launcher"


def test_executor_subclass_passes_through():
    class MyExecutor:
        pass
    assert ParallelConfig(distributed_executor_backend=MyExecutor).distributed_executor_backend is MyExecutor


@pytest.mark.parametrize("kwargs, message", [
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an integer >= 1, got 0"),
    ({"pipeline_parallel_size": -1}, "pipeline_parallel_size must be an integer >= 1, got -1"),
    ({"data_parallel_size": 1.5}, "data_parallel_size must be an integer >= 1, got 1.5"),
    ({"tensor_parallel_size": 4, "decode_context_parallel_size": 3}, "decode_context_parallel_size (3) must divide tensor_parallel_size (4)"),
    ({"prefill_context_parallel_size": 2, "data_parallel_size": 2}, "cannot be combined with data_parallel_size (2)"),
    ({"distributed_executor_backend": "ray"}, "Unknown distributed executor backend: 'ray'"),
    ({"tensor_parallel_size": 2, "distributed_executor_backend": "uni"}, "'uni' runs one worker"),
    ({"data_parallel_size": 2, "data_parallel_rank": 2}, "data_parallel_rank (2) must be in [0, data_parallel_size=2)"),
])
def test_validation_names_value_and_rule(kwargs, message):
    with pytest.raises(ConfigError) as err:
        ParallelConfig(**kwargs)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_output_rank_property():
    assert ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2).output_rank == 2


@pytest.mark.parametrize("tp, pp, dcp, dp", [(1, 1, 1, 1), (4, 2, 2, 2), (0, 1, 1, 1), (2, -1, 1, 1), (4, 1, 3, 1),
                                             (2, 1, 1, 1.5), (True, 1, 1, 1)])
def test_parallel_config_and_layout_judge_sizes_by_one_rule(tp, pp, dcp, dp):
    """ParallelConfig owns its sizes through topology's check: the two accept and refuse alike,
    each naming the axis its own way."""
    from spmd_engine.topology import Layout, TopologyError

    def verdict(make, error):
        try:
            make()
            return "ok"
        except error as exc:
            return str(exc).split(" must ")[1].split()[0]  # "be" (an integer >= 1) or "divide"
    config = verdict(lambda: ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                            decode_context_parallel_size=dcp, data_parallel_size=dp,
                                            distributed_executor_backend="mp"), ConfigError)
    layout = verdict(lambda: Layout(tp=tp, pp=pp, dcp=dcp, dp=dp), TopologyError)
    assert config == layout
    if config == "ok":
        assert ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp, decode_context_parallel_size=dcp,
                              data_parallel_size=dp, distributed_executor_backend="mp").layout == \
            Layout(tp=tp, pp=pp, dcp=dcp, dp=dp)
