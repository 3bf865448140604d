"""The engine end to end on a tiny random checkpoint: every executor and layout
gives the tokens of a no-cache reference decode, in input order."""

from __future__ import annotations

import os

import pytest
from engine_helpers import make_tiny_checkpoint, reference_greedy

from spmd_engine import LLM, SamplingParams
from spmd_engine.config import ConfigError

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11], [12, 13, 14, 15], [16, 17, 18]]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def expected(ckpt):
    return [reference_greedy(ckpt, p, MAX_TOKENS) for p in PROMPTS]


def generate(ckpt, **kwargs):
    with LLM(model=str(ckpt), **kwargs) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", [
    dict(),
    dict(max_num_seqs=2),  # requests wait for KV slots and enter as others finish
    dict(tensor_parallel_size=2),
    dict(tensor_parallel_size=4),  # TP > num_key_value_heads: KV heads replicated
    dict(pipeline_parallel_size=2),
    dict(tensor_parallel_size=2, pipeline_parallel_size=2),
    dict(data_parallel_size=2),
    dict(data_parallel_size=2, tensor_parallel_size=2, max_num_seqs=2),
], ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()) or "uni")
@pytest.mark.slow
def test_every_layout_matches_reference(ckpt, expected, layout):
    assert generate(ckpt, **layout) == expected


@pytest.mark.timeout(120)
def test_backend_resolution_in_llm(ckpt):
    with LLM(model=str(ckpt)) as llm:
        assert llm.config.parallel_config.distributed_executor_backend == "uni"
    with LLM(model=str(ckpt), data_parallel_size=2) as llm:
        assert llm.config.parallel_config.distributed_executor_backend == "mp"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_seeded_sampling_is_layout_independent(ckpt):
    params = SamplingParams(max_tokens=8, temperature=0.9, top_k=50, top_p=0.95, ignore_eos=True)
    results = []
    for layout in (dict(), dict(tensor_parallel_size=2), dict(data_parallel_size=2)):
        with LLM(model=str(ckpt), seed=7, **layout) as llm:
            results.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)])
    assert results[0] == results[1] == results[2]
    with LLM(model=str(ckpt), seed=8) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] != results[0]


@pytest.mark.timeout(120)
def test_collective_rpc_by_name_callable_and_reply_rank(ckpt):
    with LLM(model=str(ckpt), tensor_parallel_size=2, pipeline_parallel_size=2) as llm:
        ranks = llm.collective_rpc(lambda worker: (worker.tp_group.rank_in_group, worker.pp_group.rank_in_group,
                                                   os.getpid()))
        assert [r[:2] for r in ranks] == [(0, 0), (1, 0), (0, 1), (1, 1)]
        assert len({r[2] for r in ranks}) == 4 and os.getpid() not in {r[2] for r in ranks}
        assert llm.collective_rpc("check_health") == [True] * 4
        # The output rank: first TP worker of the last PP stage, local rank 2.
        only = llm.collective_rpc(lambda w: (w.tp_group.rank_in_group, w.pp_group.rank_in_group),
                                  unique_reply_rank=2)
        assert only == [(0, 1)]
        with pytest.raises(RuntimeError, match="Worker failed with error 'AttributeError"):
            llm.collective_rpc("no_such_method")
    with LLM(model=str(ckpt)) as llm:
        assert llm.collective_rpc(lambda w: w.tp_group.world_size) == [1]


@pytest.mark.timeout(60)
def test_logprobs_and_finish_reasons(ckpt, expected):
    with LLM(model=str(ckpt), max_model_len=8) as llm:
        outs = llm.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=20, logprobs=3, ignore_eos=True))
    # prompt 0 has 3 tokens: 5 more reach max_model_len 8.
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 3]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    first = outs[0].outputs[0]
    assert first.token_ids == expected[0][:5]
    assert all(len(step) >= 3 and first.token_ids[i] in step for i, step in enumerate(first.logprobs))
    assert max(lp.logprob for lp in first.logprobs[0].values()) == first.logprobs[0][first.token_ids[0]].logprob
    assert first.logprobs[0][first.token_ids[0]].rank == 1  # greedy = top-1


@pytest.mark.timeout(60)
def test_errors_before_any_process(ckpt):
    with pytest.raises(ConfigError, match="tensor_parallel_size 3 must divide num_attention_heads 8"):
        LLM(model=str(ckpt), tensor_parallel_size=3)
    with pytest.raises(ConfigError, match="pipeline_parallel_size 5 exceeds num_hidden_layers 4"):
        LLM(model=str(ckpt), pipeline_parallel_size=5)
    with LLM(model=str(ckpt), max_model_len=4) as llm:
        with pytest.raises(ConfigError, match="prompt 0 has 5 tokens; max_model_len is 4"):
            llm.generate([[1, 2, 3, 4, 5]])
        with pytest.raises(ConfigError, match="text prompts need a tokenizer"):
            llm.generate("hello")
        with pytest.raises(ConfigError, match="token id 300 outside the vocabulary"):
            llm.generate([[300]])


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`, from /proc (children of children included)."""
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                kids.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def process_names(pids) -> list[str]:
    names = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return sorted(n for n in names if not n.startswith("python"))  # multiprocessing's resource tracker


@pytest.mark.timeout(120)
def test_mp_processes_are_the_plan_and_visible_in_ps(ckpt):
    """DP=2 x TP=2 under mp: EngineCore_DP0 and EngineCore_DP1, each with its own two
    workers; with this front end, the plan's process total."""
    from spmd_engine import topology
    layout = topology.Layout(tp=2, dp=2)
    plan = topology.process_plan(layout, "mp")
    with LLM(model=str(ckpt), data_parallel_size=2, tensor_parallel_size=2):
        names = process_names(descendants(os.getpid()))
    expected = sorted([*plan.engine_cores, *(topology.worker_name(layout, topology.rank_to_coord(layout, r))
                                              for r in range(layout.world_size_across_dp))])
    assert names == [n[:15] for n in expected]  # the kernel keeps 15 characters of a name
    assert len(names) + 1 == plan.total


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_mp_workers_share_the_cores_unless_told_otherwise(ckpt, monkeypatch, capfd):
    """Unset OMP_NUM_THREADS: each of a host's workers gets cores // workers threads.
    Set above that share: it is kept, and the first worker warns once."""
    import torch
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with LLM(model=str(ckpt), tensor_parallel_size=2) as llm:
        assert llm.collective_rpc(lambda worker: torch.get_num_threads()) == [max(1, cores // 2)] * 2
    assert "contend for cores" not in capfd.readouterr().err
    asked = max(2, cores)  # always above the share of two workers
    monkeypatch.setenv("OMP_NUM_THREADS", str(asked))
    with LLM(model=str(ckpt), tensor_parallel_size=2) as llm:
        assert llm.collective_rpc(lambda worker: torch.get_num_threads()) == [asked] * 2
    assert capfd.readouterr().err.count("will contend for cores") == 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", [dict(), dict(data_parallel_size=2)], ids=["uni", "dp=2"])
def test_generate_reports_progress_as_requests_finish(ckpt, layout):
    """Every request is reported once, with its generated tokens; DP replicas relay theirs."""
    calls = []
    with LLM(model=str(ckpt), max_num_seqs=2, **layout) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                            progress=lambda requests, tokens: calls.append((requests, tokens)))
    assert sum(n for n, _ in calls) == len(PROMPTS)
    assert sum(t for _, t in calls) == sum(len(o.outputs[0].token_ids) for o in outs) == len(PROMPTS) * MAX_TOKENS
    assert len(calls) >= len(PROMPTS) // (2 * layout.get("data_parallel_size", 1))  # as they finish, not at the end
