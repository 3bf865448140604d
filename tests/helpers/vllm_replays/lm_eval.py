"""lm-evaluation-harness's vLLM backend (lm_eval/models/vllm_causallms.py, with the torchrun
arguments of its PR #3304): loglikelihoods from `prompt_logprobs=1` and generate_until with stop
strings, requests reordered by its Collator and shared out over the ranks."""

from __future__ import annotations

import torch.distributed as dist

from spmd_engine import LLM, SamplingParams
from vllm_replays.common import (
    Gaps,
    Launch,
    collect,
)


def lm_eval(cfg: dict, launch: Launch) -> dict:
    gaps = Gaps()
    requests = cfg["lm_eval"]
    model_args = {"model": cfg["orig"], "revision": None, "dtype": "auto", "tokenizer": None,
                  "tokenizer_mode": "auto", "tokenizer_revision": None, "trust_remote_code": False,
                  "tensor_parallel_size": 1, "max_model_len": None, "max_num_seqs": None, "quantization": None,
                  "seed": 1234, "enable_lora": False, "max_lora_rank": 16}
    if launch.external:  # PR #3304: torchrun --nproc-per-node 2 lm_eval --model_args ...,data_parallel_size=2,...
        model_args.update(data_parallel_size=launch.world, distributed_executor_backend="external_launcher")
    llm = LLM(**model_args)
    gaps.call("llm.llm_engine.model_config", lambda: llm.llm_engine.model_config)  # chat template resolution
    max_length = gaps.call("llm.llm_engine.model_config.max_model_len",
                           lambda: llm.llm_engine.model_config.max_model_len,
                           lambda: llm.llm_engine.vllm_config.scheduler_config.max_model_len)

    def model_generate(inputs: list[list[int]], sampling_params=None):
        if sampling_params is None:  # loglikelihood
            sampling_params = SamplingParams(temperature=0, prompt_logprobs=1, max_tokens=1, detokenize=False)
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params] * len(inputs)
        return llm.generate([{"prompt_token_ids": ids} for ids in inputs], sampling_params=sampling_params,
                            use_tqdm=True, lora_request=None)

    # The evaluator hands each rank its share of the requests.
    ll_mine = list(enumerate(requests["loglikelihood"]))[launch.rank::launch.world]
    gen_mine = list(enumerate(requests["generate"]))[launch.rank::launch.world]

    # _loglikelihood_tokens: longest first (Collator), one batch ("auto")
    max_ctx = max_length - 1
    order = sorted(ll_mine, key=lambda item: (-len(item[1][0] + item[1][1]), tuple(item[1][0] + item[1][1])))
    inputs, ctxlens = [], []
    for _, (context_enc, continuation_enc) in order:
        inputs.append((context_enc + continuation_enc)[-max_ctx:])
        ctxlens.append(len(context_enc) - max(0, len(context_enc) + len(continuation_enc) - max_ctx))
    loglikelihoods = {}
    for (index, _), out, ctxlen, tokens in zip(order, model_generate(inputs), ctxlens, inputs):
        dicts = [{tok: getattr(lp, "logprob", lp) for tok, lp in d.items()} if d is not None else None
                 for d in out.prompt_logprobs]
        total = sum(d.get(tok) for tok, d in zip(tokens[ctxlen:], dicts[ctxlen:]))
        greedy = all(max(d, key=d.get) == tok for tok, d in zip(tokens[ctxlen:], dicts[ctxlen:]) if d)
        loglikelihoods[index] = [total, greedy]

    # generate_until: longest context first; greedy (do_sample False); HF defaults for the text
    order = sorted(gen_mine, key=lambda item: (-len(item[1]["context_ids"]), item[1]["context"]))
    params, inputs = [], []
    for _, req in order:
        until = list(req["until"])
        if requests["eos"] not in until:
            until.append(requests["eos"])
        kwargs = {"skip_special_tokens": False, "spaces_between_special_tokens": False, "temperature": 0.0}
        inputs.append(req["context_ids"][-(max_length - req["max_gen_toks"]):])
        params.append(gaps.call(
            "SamplingParams(spaces_between_special_tokens=False)",
            lambda: SamplingParams(max_tokens=req["max_gen_toks"], stop=until, **kwargs),
            lambda: SamplingParams(max_tokens=req["max_gen_toks"], stop=until,
                                   **{k: v for k, v in kwargs.items() if k != "spaces_between_special_tokens"})))
    generations = {}
    for (index, req), out, sp in zip(order, model_generate(inputs, params), params):
        text = out.outputs[0].text
        for term in sp.stop:  # postprocess_generated_text
            if term:
                text = text.split(term)[0]
        generations[index] = text

    if launch.external:  # the evaluator gathers every rank's answers
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (loglikelihoods, generations))
        loglikelihoods = {k: v for ll, _ in gathered for k, v in ll.items()}
        generations = {k: v for _, g in gathered for k, v in g.items()}
    llm = None
    collect()
    return {"loglikelihood": [loglikelihoods[i] for i in range(len(requests["loglikelihood"]))],
            "generate_until": [generations[i] for i in range(len(requests["generate"]))],
            "max_length": max_length, "gaps": gaps.found}
