#!/usr/bin/env python
"""Write a random-weight HF-format Llama, Mistral, Qwen2/3 or MoE (Mixtral, Qwen2-MoE, Qwen3-MoE) checkpoint.

For tests and benchmarks that need a checkpoint of a given size or sharding
without downloading one. Tensor names and layout follow HF exactly (separate
q/k/v and gate/up, [out, in] weights) and are produced here independently of
spmd_engine's model code, so comparing our model against them tests the loader
too. Weights are scaled by 1/sqrt(fan_in) so activations and logits stay O(1)
and differences show. MoE checkpoints store one tensor per expert and
projection, as the HF hub checkpoints do (Mixtral: `block_sparse_moe.experts.E.
w1/w3/w2`; Qwen: `mlp.experts.E.gate_proj/up_proj/down_proj`); router
weights are larger than the rest so routing is decisive, not a near-tie.

    python scripts/make_random_checkpoint.py OUT_DIR --hidden-size 256 --num-layers 4 --num-shards 3
    python scripts/make_random_checkpoint.py OUT_DIR --architecture Qwen3MoeForCausalLM --num-experts 16 \
        --num-experts-per-tok 4 --moe-intermediate-size 256 --hidden-size 512
or  from make_random_checkpoint import make_random_checkpoint
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral",
               "Qwen3ForCausalLM": "qwen3", "MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
               "Qwen3MoeForCausalLM": "qwen3_moe"}
QWEN_FAMILY = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


def moe_config(architecture: str, num_layers: int, num_experts: int, num_experts_per_tok: int,
               moe_intermediate_size: int | None, norm_topk_prob: bool, decoder_sparse_step: int,
               mlp_only_layers: list[int] | None, shared_expert_intermediate_size: int | None) -> dict[str, Any]:
    """The MoE keys each architecture's HF config reads."""
    if architecture == "MixtralForCausalLM":
        return {"num_local_experts": num_experts, "num_experts_per_tok": num_experts_per_tok,
                "router_jitter_noise": 0.0, "output_router_logits": False}
    config = {"num_experts": num_experts, "num_experts_per_tok": num_experts_per_tok,
              "moe_intermediate_size": moe_intermediate_size, "norm_topk_prob": norm_topk_prob,
              "decoder_sparse_step": decoder_sparse_step, "mlp_only_layers": list(mlp_only_layers or []),
              "output_router_logits": False}
    if architecture == "Qwen2MoeForCausalLM":
        config["shared_expert_intermediate_size"] = shared_expert_intermediate_size
    return config


def is_sparse_layer(config: dict[str, Any], layer: int) -> bool:
    if config["architectures"][0] == "MixtralForCausalLM":
        return True
    if "num_experts" not in config:
        return False
    return layer not in config["mlp_only_layers"] and (layer + 1) % config["decoder_sparse_step"] == 0


def hf_config(architecture: str, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
              intermediate_size: int, vocab_size: int, dtype: str, tie_word_embeddings: bool,
              rope_theta: float, rope_scaling: dict | None, max_position_embeddings: int,
              head_dim: int | None = None, attention_bias: bool = False, mlp_bias: bool = False) -> dict[str, Any]:
    config = {
        "architectures": [architecture],
        "model_type": MODEL_TYPES[architecture],
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "vocab_size": vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings,
        "torch_dtype": dtype,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if head_dim is not None:
        config["head_dim"] = head_dim
    if architecture == "LlamaForCausalLM":
        config.update(attention_bias=attention_bias, mlp_bias=mlp_bias)
    if architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        config.update(attention_bias=attention_bias)
    if architecture in QWEN_FAMILY:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=num_layers)
    if architecture in ("MistralForCausalLM", "MixtralForCausalLM"):
        config.update(sliding_window=None)
    return config


def random_tensors(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """HF-named tensors in float32, deterministic in `seed`."""
    gen = torch.Generator().manual_seed(seed)
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or h // heads
    arch = config["architectures"][0]
    qkv_bias = arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM") or config.get("attention_bias", False)
    o_bias, mlp_bias = config.get("attention_bias", False), config.get("mlp_bias", False)

    def linear(out_f: int, in_f: int) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=gen) * in_f ** -0.5

    def near_one(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=gen)

    def small(n: int) -> torch.Tensor:
        return 0.1 * torch.randn(n, generator=gen)

    tensors = {"model.embed_tokens.weight": torch.randn(vocab, h, generator=gen)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = near_one(h)
        tensors[p + "self_attn.q_proj.weight"] = linear(heads * head_dim, h)
        tensors[p + "self_attn.k_proj.weight"] = linear(kv_heads * head_dim, h)
        tensors[p + "self_attn.v_proj.weight"] = linear(kv_heads * head_dim, h)
        if qkv_bias:
            tensors[p + "self_attn.q_proj.bias"] = small(heads * head_dim)
            tensors[p + "self_attn.k_proj.bias"] = small(kv_heads * head_dim)
            tensors[p + "self_attn.v_proj.bias"] = small(kv_heads * head_dim)
        tensors[p + "self_attn.o_proj.weight"] = linear(h, heads * head_dim)
        if o_bias:
            tensors[p + "self_attn.o_proj.bias"] = small(h)
        tensors[p + "post_attention_layernorm.weight"] = near_one(h)
        if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
            tensors[p + "self_attn.q_norm.weight"] = near_one(head_dim)
            tensors[p + "self_attn.k_norm.weight"] = near_one(head_dim)
        if is_sparse_layer(config, i):
            tensors.update(moe_tensors(config, p, linear))
            continue
        tensors[p + "mlp.gate_proj.weight"] = linear(inter, h)
        tensors[p + "mlp.up_proj.weight"] = linear(inter, h)
        tensors[p + "mlp.down_proj.weight"] = linear(h, inter)
        if mlp_bias:
            tensors[p + "mlp.gate_proj.bias"] = small(inter)
            tensors[p + "mlp.up_proj.bias"] = small(inter)
            tensors[p + "mlp.down_proj.bias"] = small(h)
    tensors["model.norm.weight"] = near_one(h)
    if not config["tie_word_embeddings"]:
        tensors["lm_head.weight"] = linear(vocab, h)
    return tensors


def moe_tensors(config: dict[str, Any], p: str, linear) -> dict[str, torch.Tensor]:
    """One sparse layer's router, experts and (Qwen2-MoE) shared expert, HF-named."""
    h = config["hidden_size"]
    if config["architectures"][0] == "MixtralForCausalLM":
        width, experts = config["intermediate_size"], config["num_local_experts"]
        block, names = p + "block_sparse_moe.", ("w1", "w3", "w2")
    else:
        width, experts = config["moe_intermediate_size"], config["num_experts"]
        block, names = p + "mlp.", ("gate_proj", "up_proj", "down_proj")
    tensors = {block + "gate.weight": linear(experts, h) * 4.0}
    for e in range(experts):
        tensors[f"{block}experts.{e}.{names[0]}.weight"] = linear(width, h)
        tensors[f"{block}experts.{e}.{names[1]}.weight"] = linear(width, h)
        tensors[f"{block}experts.{e}.{names[2]}.weight"] = linear(h, width)
    shared = config.get("shared_expert_intermediate_size")
    if shared:
        tensors[block + "shared_expert.gate_proj.weight"] = linear(shared, h)
        tensors[block + "shared_expert.up_proj.weight"] = linear(shared, h)
        tensors[block + "shared_expert.down_proj.weight"] = linear(h, shared)
        tensors[block + "shared_expert_gate.weight"] = linear(1, h)
    return tensors


def save_sharded(tensors: dict[str, torch.Tensor], out_dir: Path, num_shards: int) -> list[Path]:
    """One model.safetensors, or num_shards files plus model.safetensors.index.json."""
    if num_shards <= 1:
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        return [out_dir / "model.safetensors"]
    names = list(tensors)
    per_shard = -(-len(names) // num_shards)
    weight_map, files = {}, []
    for s in range(num_shards):
        file = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        chunk = {n: tensors[n] for n in names[s * per_shard : (s + 1) * per_shard]}
        save_file(chunk, str(out_dir / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, file))
        files.append(out_dir / file)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return files


def make_random_checkpoint(out_dir, architecture: str = "LlamaForCausalLM", hidden_size: int = 64,
                           num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                           intermediate_size: int = 128, vocab_size: int = 256, dtype: str = "float32",
                           num_shards: int = 1, tie_word_embeddings: bool = False, rope_theta: float = 10000.0,
                           rope_scaling: dict | None = None, max_position_embeddings: int = 2048,
                           seed: int = 0, head_dim: int | None = None, attention_bias: bool = False,
                           mlp_bias: bool = False, num_experts: int = 8, num_experts_per_tok: int = 2,
                           moe_intermediate_size: int | None = None, norm_topk_prob: bool = True,
                           decoder_sparse_step: int = 1, mlp_only_layers: list[int] | None = None,
                           shared_expert_intermediate_size: int | None = None) -> Path:
    """Write config.json and safetensors file(s) into out_dir; returns out_dir.

    The MoE arguments apply to Mixtral (whose expert width is `intermediate_size`),
    Qwen2-MoE and Qwen3-MoE; the Qwen expert width defaults to intermediate_size // 2
    and Qwen2-MoE's shared expert to intermediate_size."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = hf_config(architecture, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size,
                       vocab_size, dtype, tie_word_embeddings, rope_theta, rope_scaling, max_position_embeddings,
                       head_dim, attention_bias, mlp_bias)
    if architecture in ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        config.update(moe_config(architecture, num_layers, num_experts, num_experts_per_tok,
                                 moe_intermediate_size or intermediate_size // 2, norm_topk_prob,
                                 decoder_sparse_step, mlp_only_layers,
                                 shared_expert_intermediate_size or intermediate_size))
    tensors = {n: t.to(DTYPES[dtype]).contiguous() for n, t in random_tensors(config, seed).items()}
    save_sharded(tensors, out_dir, num_shards)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("out_dir")
    parser.add_argument("--architecture", default="LlamaForCausalLM",
                        choices=sorted(MODEL_TYPES))
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--intermediate-size", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--num-shards", type=int, default=1)
    parser.add_argument("--tie-word-embeddings", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-experts", type=int, default=8)
    parser.add_argument("--num-experts-per-tok", type=int, default=2)
    parser.add_argument("--moe-intermediate-size", type=int, default=None)
    parser.add_argument("--no-norm-topk-prob", dest="norm_topk_prob", action="store_false")
    parser.add_argument("--decoder-sparse-step", type=int, default=1)
    parser.add_argument("--shared-expert-intermediate-size", type=int, default=None)
    args = parser.parse_args(argv)
    out = make_random_checkpoint(
        args.out_dir, args.architecture, args.hidden_size, args.num_layers, args.num_heads, args.num_kv_heads,
        args.intermediate_size, args.vocab_size, args.dtype, args.num_shards, args.tie_word_embeddings,
        seed=args.seed, num_experts=args.num_experts, num_experts_per_tok=args.num_experts_per_tok,
        moe_intermediate_size=args.moe_intermediate_size, norm_topk_prob=args.norm_topk_prob,
        decoder_sparse_step=args.decoder_sparse_step,
        shared_expert_intermediate_size=args.shared_expert_intermediate_size,
    )
    print(out)


if __name__ == "__main__":
    main()
