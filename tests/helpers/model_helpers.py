"""Small checkpoints and one paged-cache schedule that the model tests share."""

import numpy as np
import torch
from engine_helpers import packed_step
from make_random_checkpoint import make_random_checkpoint  # noqa: F401  (re-exported for the tests)

LLAMA = dict(architecture="LlamaForCausalLM", hidden_size=64, num_layers=5, num_heads=8, num_kv_heads=2,
             intermediate_size=96, vocab_size=200,
             rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
QWEN_TIED = dict(architecture="Qwen2ForCausalLM", hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                 intermediate_size=128, vocab_size=150, tie_word_embeddings=True)

# One schedule exercising the paged cache: (sequence, new tokens, tokens already cached) per row;
# sequence k owns blocks 4k..4k+3 of 4 tokens. Step 2 mixes a decode, a chunked-prefill
# continuation and a fresh prefill; rows are packed, never padded.
_gen = torch.Generator().manual_seed(7)
_TOKENS = {name: torch.randint(0, 150, (n,), generator=_gen).tolist() for name, n in (("a", 7), ("b", 7), ("c", 5))}
SCHEDULE = [
    [(2, _TOKENS["a"][:6], 0), (0, _TOKENS["b"][:3], 0)],
    [(2, _TOKENS["a"][6:7], 6), (0, _TOKENS["b"][3:6], 3), (1, _TOKENS["c"][:4], 0)],
    [(0, _TOKENS["b"][6:7], 6), (1, _TOKENS["c"][4:5], 4)],
]
SEQ_NAMES = {2: "a", 0: "b", 1: "c"}
BLOCK_SIZE, NUM_BLOCKS = 4, 12


def run_schedule(model, send=None, recv=None) -> list[np.ndarray]:
    """Run SCHEDULE on this stage; on the last stage return the logits of every token per step,
    in the schedule's row order."""
    model.allocate_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    logits = []
    for step in SCHEDULE:
        ids, positions, md = packed_step(step, BLOCK_SIZE)
        intermediate = None
        if not model.is_first_stage:
            shape = (len(ids), model.spec.hidden_size)
            intermediate = {"hidden_states": recv(shape), "residual": recv(shape)}
        out = model(ids if model.is_first_stage else None, positions, md, intermediate)
        if not model.is_last_stage:
            send(out["hidden_states"])
            send(out["residual"])
            continue
        logits.append(model.compute_logits(md.to_row_order(out["hidden_states"])).numpy())
    return logits
