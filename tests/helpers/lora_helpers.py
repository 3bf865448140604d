"""LoRA adapters made by PEFT itself (the reference), with random non-zero A and B.

PEFT starts B at zero, which would make every adapter the base model: `make_adapter` fills both
with seeded random values scaled so the adapter moves the logits clearly but not wildly. The
reference logprobs come from transformers + PEFT, teacher-forced on given tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_model(model_dir, adapter_dir=None, r: int = 8, alpha: float = 16, rslora: bool = False,
               targets=ALL_TARGETS, seed: int = 0, scale: float = 0.3):
    """transformers' model of `model_dir` in fp32 with a PEFT LoRA: loaded from `adapter_dir`, or
    new with random A and B (seeded)."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    if adapter_dir is not None:
        return PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora,
                        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale / param.shape[-1] ** 0.5)
    return model.eval()


def make_adapter(model_dir, out_dir: Path, **kwargs) -> Path:
    """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors)."""
    model = peft_model(model_dir, **kwargs)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return Path(out_dir)


def adapter_tensors(adapter_dir: Path) -> tuple[dict, dict]:
    """(peft_config dict, tensors) of a saved adapter: what a trainer hands over in memory."""
    import json

    from safetensors.torch import load_file
    config = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    return config, load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))


@torch.no_grad()
def reference_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """log p(tokens[i] | prompt + tokens[:i]) under `model` (transformers, PEFT or not)."""
    ids = torch.tensor([prompt + tokens])
    logits = model(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]


@torch.no_grad()
def reference_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    ids = list(prompt)
    for _ in range(max_tokens):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]
