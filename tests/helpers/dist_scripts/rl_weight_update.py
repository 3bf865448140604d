"""A trainer's weight update under torchrun (external_launcher, TP2 x PP2): every rank pushes
the new checkpoint's full tensors into its own model, resets the prefix cache, generates; then
a sleep(2) / reload_weights / wake_up round trip. One JSON line per rank."""

import json
import re
import sys

from safetensors.torch import load_file

from spmd_engine import LLM, SamplingParams

if __name__ == "__main__":
    old, new = sys.argv[1], sys.argv[2]
    prompts = [list(range(1, 40)), [4, 5, 6, 7, 8]]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(model=old, tensor_parallel_size=2, pipeline_parallel_size=2, max_model_len=64, seed=0,
             distributed_executor_backend="external_launcher", enable_sleep_mode=True) as llm:
        before = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        loaded = model.load_weights(load_file(f"{new}/model.safetensors").items())
        llm.reset_prefix_cache()
        after = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        llm.sleep(level=2)
        reloaded = llm.collective_rpc("reload_weights")[0]
        llm.wake_up()
        again = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        import torch.distributed as dist
        layers = sorted({int(m.group(1)) for n in loaded for m in [re.search(r"layers\.(\d+)\.", n)] if m})
        # One write under PIPE_BUF: the ranks share a stdout pipe, whole lines do not interleave.
        sys.stdout.write("REPORT " + json.dumps({
            "rank": dist.get_rank(), "start": model.start_layer, "end": model.end_layer, "layers": layers,
            "other": sorted(n for n in loaded if ".layers." not in n), "loaded": len(loaded),
            "reloaded": len(reloaded), "before": before, "after": after, "again": again}) + "\n")
        sys.stdout.flush()
    sys.exit(0)
