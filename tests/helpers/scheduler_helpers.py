"""A scheduler over a fake model, for tests of the scheduler and of what drives it."""

from spmd_engine.config import SchedulerConfig
from spmd_engine.core.kv_cache_manager import KVCacheManager
from spmd_engine.core.request import Request
from spmd_engine.core.scheduler import Scheduler
from spmd_engine.core.step_messages import ModelRunnerOutput
from spmd_engine.sampling_params import SamplingParams

EOS = 99


def make(rid, prompt_len=3, max_tokens=3, ignore_eos=False, first=1):
    return Request(str(rid), list(range(first, first + prompt_len)),
                   SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos), seed=rid)


def scheduler(num_blocks=64, block_size=4, max_num_seqs=256, budget=None, max_model_len=64, chunked=True,
              caching=True):
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             enable_chunked_prefill=chunked).resolve(max_model_len, block_size)
    return Scheduler(config, KVCacheManager(num_blocks, block_size, caching), EOS)


def drive(s, token_for=lambda rid, step: 7):
    """Run to completion with a fake model; return the trace of (id, new tokens, context, sample) per step."""
    trace = []
    while s.has_unfinished():
        out = s.schedule()
        trace.append([(q.request_id, len(q.token_ids), q.context_len, q.sample) for q in out.seqs])
        ids = [q.request_id for q in out.seqs if q.sample]
        s.update_from_output(out, ModelRunnerOutput(ids, [token_for(r, out.step) for r in ids]))
    return trace


def same_inputs_trace():
    s = scheduler(num_blocks=4, block_size=4, budget=9, max_model_len=16)
    for i in range(7):
        s.add_request(make(i, prompt_len=1 + (i * 5) % 11, max_tokens=1 + (i * 5) % 4, first=i % 3))
    return drive(s, lambda rid, step: (int(rid) * 31 + step) % 50), s.stats
