"""LLMEngine from inside, over an EngineCore whose executor is arithmetic (fake_executor.py): the
request API, outputs and their kinds, aborts, pause and sleep, collective_rpc's timeout, with no
model and no process."""

import time

import pytest
from fake_executor import CountingExecutor, counting_config

from spmd_engine.engine.core import EngineCore
from spmd_engine.engine.core_client import InProcClient
from spmd_engine.engine.input_processor import InputProcessor
from spmd_engine.engine.llm_engine import LLMEngine
from spmd_engine.sampling_params import RequestOutputKind, SamplingParams


@pytest.fixture
def engine(tmp_path):
    config = counting_config(tmp_path)
    inputs = InputProcessor(config.model_config.model_dir)
    core = EngineCore(config, CountingExecutor, inputs.max_model_len, None)
    return LLMEngine(InProcClient(core), inputs, seed=0, admission="identical", external=False,
                     enable_sleep_mode=True, config=config)


def params(**kw):
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 3, "ignore_eos": True, **kw})


def run(engine):
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


def test_add_request_returns_the_id_and_each_kind_reports_as_vllm(engine):
    assert engine.add_request("c", [10], params()) == "c"
    engine.add_request("d", [20], params(output_kind=RequestOutputKind.DELTA))
    engine.add_request("f", [30], params(output_kind=RequestOutputKind.FINAL_ONLY))
    outs = run(engine)
    by_id = {}
    for out in outs:
        by_id.setdefault(out.request_id, []).append(out.outputs[0].token_ids)
    assert by_id["c"] == [[11], [11, 12], [11, 12, 13]]  # cumulative
    assert by_id["d"] == [[21], [22], [23]]  # deltas
    assert by_id["f"] == [[31, 32, 33]]  # once, finished


def test_max_tokens_none_runs_to_the_context(engine):
    engine.add_request("n", [1, 2], params(max_tokens=None, output_kind=RequestOutputKind.FINAL_ONLY))
    (out,) = run(engine)
    assert len(out.outputs[0].token_ids) == 256 - 2 and out.outputs[0].finish_reason == "length"


def test_abort_reports_once_with_the_tokens_so_far(engine):
    engine.add_request("a", [5], params(max_tokens=50))
    engine.step()
    engine.step()
    engine.abort_request("a")
    (out,) = engine.step()
    assert out.outputs[0].finish_reason == "abort" and out.outputs[0].token_ids == [6, 7]
    assert not engine.has_unfinished_requests()


def test_sleep_aborts_in_the_default_mode_and_keep_holds_the_request(engine):
    engine.add_request("a", [5], params(max_tokens=50))
    engine.step()
    engine.sleep(level=1)
    with pytest.raises(RuntimeError, match="asleep"):
        engine.step()
    assert engine.wake_up() is True
    (aborted,) = engine.step()
    assert aborted.outputs[0].finish_reason == "abort"
    engine.add_request("k", [5], params(max_tokens=4, output_kind=RequestOutputKind.FINAL_ONLY))
    engine.step()
    engine.sleep(level=1, mode="keep")
    engine.wake_up(["weights"])
    assert engine.is_sleeping()  # the KV cache and scheduling are still away
    engine.wake_up(["kv_cache"])
    (kept,) = run(engine)
    assert kept.outputs[0].token_ids == [6, 7, 8, 9]


def test_a_collective_rpc_past_its_timeout_leaves_the_engine_refusing(engine):
    assert engine.collective_rpc(lambda executor, x: x * 2, None, (4,)) == [8]
    with pytest.raises(TimeoutError):
        engine.collective_rpc(lambda executor: time.sleep(0.5), timeout=0.05)
    with pytest.raises(RuntimeError, match="refuses every call"):
        engine.step()
    time.sleep(0.5)


def test_weight_versions_follow_vllms_calls(engine):
    assert engine.get_weight_version() == "default"
    engine.start_weight_update()
    with pytest.raises(RuntimeError, match="a weight update is in progress"):
        engine.step()
    engine.finish_weight_update("v1")
    engine.add_request("w", [1], params(output_kind=RequestOutputKind.FINAL_ONLY))
    (out,) = run(engine)
    assert out.weight_version == "v1" and engine.get_weight_version() == "v1"
    engine.update_weight_version(7)
    assert engine.get_weight_version() == 7


def test_a_second_sleep_is_a_warning_and_nothing_else_as_in_vllm(engine, caplog):
    engine.sleep(level=1)
    assert engine.sleep(level=2) == [] and "already asleep" in caplog.text
    assert not engine.sleep_mode.weights_discarded  # the first sleep's level stands
    assert engine.wake_up() is True
    engine.add_request("after", [3], params(output_kind=RequestOutputKind.FINAL_ONLY))
    (out,) = run(engine)
    assert out.outputs[0].token_ids == [4, 5, 6]
