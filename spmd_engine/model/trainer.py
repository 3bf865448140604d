"""A trainer's forward of the engine's model: whole sequences, no KV cache, autograd.

RL trainers compare their own logprobs of the sampled tokens with the engine's; any
difference is off-policy noise they must correct for. This is the same CausalLM the engine
runs, in batch-invariant mode, on one rank: every kernel is batch_invariant.py's, so a
token's logprob here equals the engine's bit for bit (sampled-token and prompt logprobs,
any batch, any layout the engine ran), and gradients flow through all of it.
"""

from __future__ import annotations

import torch

from spmd_engine.model.layers import batch_invariant as bi
from spmd_engine.model.loader import load_model
from spmd_engine.model.models.llama import CausalLM
from spmd_engine.model.solo import SoloGroup


def trainer_model(model_dir, dtype: str | torch.dtype | None = None, device="cpu") -> CausalLM:
    """The whole model in one process, batch-invariant, its parameters requiring grad."""
    model = load_model(model_dir, SoloGroup(), SoloGroup(), dtype=dtype, device=device, batch_invariant=True)
    for param in model.parameters():
        param.requires_grad_(True)
    return model


def token_logprobs(model: CausalLM, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Per sequence, [len - 1]: log p(token t + 1 | tokens 0..t), teacher-forced, differentiable.

    Sequences of different lengths share one forward, right-padded (causal attention: the
    padding sees nothing before it)."""
    if not model.batch_invariant:
        raise ValueError("token_logprobs needs a batch-invariant model (trainer_model)")
    width = max(len(s) for s in sequences)
    ids = torch.tensor([list(s) + [0] * (width - len(s)) for s in sequences], dtype=torch.long,
                       device=model.device)
    positions = torch.arange(width, device=model.device).expand(len(sequences), -1)
    hidden = model.forward(ids, positions, None)["hidden_states"]
    logp = bi.log_softmax(model.compute_logits(hidden[:, :-1]))
    picked = logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return [picked[i, :len(s) - 1] for i, s in enumerate(sequences)]


def hf_named_parameters(model: CausalLM) -> list[tuple[str, torch.Tensor]]:
    """The trainer model's weights under HF names and shapes (detached views), what the engine's
    `load_weights` takes: fused q/k/v and gate/up split back, the vocabulary's padding dropped,
    a tied head given once (as the embedding). A whole dense model on one rank only."""
    from spmd_engine.model.weights import hf_tensor_shapes
    if model.spec.moe:
        raise ValueError("hf_named_parameters: dense models only (MoE experts are not exported)")
    shapes = hf_tensor_shapes(model.spec)
    spec = model.spec
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    offsets = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv),
               0: (0, spec.intermediate_size), 1: (spec.intermediate_size, spec.intermediate_size)}
    out = {}
    for hf_name, param_name, shard_id in model.checkpoint_tensors():
        if hf_name in out:
            continue
        tensor = model.get_parameter(param_name).detach()
        if shard_id is not None:
            start, size = offsets[shard_id]
            tensor = tensor.narrow(0, start, size)
        for dim, n in enumerate(shapes[hf_name]):
            tensor = tensor.narrow(dim, 0, n)
        out[hf_name] = tensor
    return list(out.items())
