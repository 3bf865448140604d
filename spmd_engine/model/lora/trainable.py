"""A LoRA adapter a trainer trains on the engine's own model (spmd_engine.model.trainer).

The adapter's A and B are Parameters; each forward hands them to the same LinearLoRA the
engine runs (B times the scaling computed as the engine computes it once at load), so in
batch-invariant mode a token's logprob here equals the engine's bit for bit after the adapter
is pushed (`peft_config()` and `peft_tensors()`: what a LoRARequest carries in memory,
PEFT's names and shapes). A starts random and B at zero, as PEFT does: the first adapter
is the base model.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from torch import nn

from spmd_engine.model.lora.linear_lora import LoRAState, SlotWeights, StepMapping
from spmd_engine.model.lora.manager import attach_lora_layers, target_of
from spmd_engine.model.lora.peft_files import TARGET_MODULES, base_shapes


class TrainableLoRA(nn.Module):
    def __init__(self, model, r: int, alpha: float, target_modules=TARGET_MODULES, use_rslora: bool = False,
                 seed: int = 0):
        super().__init__()
        if model.spec.moe:
            raise ValueError("TrainableLoRA: dense models only (expert LoRA is not supported)")
        self.model_ref = [model]  # not a submodule: the base stays frozen and out of parameters()
        self.r, self.alpha, self.use_rslora = r, alpha, use_rslora
        self.targets = list(target_modules)
        self.scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
        self.state = LoRAState()
        self.layers = attach_lora_layers(model, self.state, max_loras=1)
        model.lora_state = self.state
        shapes = base_shapes(model.spec)
        gen = torch.Generator().manual_seed(seed)
        self.a, self.b = nn.ParameterDict(), nn.ParameterDict()
        for layer in range(model.spec.num_layers):
            for module in self.targets:
                out_features, in_features = shapes[module]
                bound = 1 / math.sqrt(in_features)
                a = (torch.rand(r, in_features, generator=gen) * 2 - 1) * bound
                self.a[f"{layer}_{module}"] = nn.Parameter(a.to(model.dtype))
                self.b[f"{layer}_{module}"] = nn.Parameter(torch.zeros(out_features, r, dtype=model.dtype))

    @contextmanager
    def active(self):
        """The model's forwards inside run with this adapter (every row)."""
        parts = {path: [None] * len(lora.part_sizes) for path, lora in self.layers.items()}
        for key, a in self.a.items():
            layer, module = key.split("_", 1)
            path, part = target_of(module)
            b = self.b[key]
            parts[f"model.layers.{layer}.{path}"][part] = (a, (b.to(torch.float32) * self.scaling).to(b.dtype))
        for path, lora in self.layers.items():
            lora.slots[0] = SlotWeights(parts[path], lora.part_sizes) if any(parts[path]) else None
        self.state.mapping = StepMapping([(0, None)])
        try:
            yield
        finally:
            self.state.mapping = None

    def peft_config(self) -> dict:
        return {"peft_type": "LORA", "r": self.r, "lora_alpha": self.alpha, "use_rslora": self.use_rslora,
                "target_modules": self.targets, "bias": "none", "lora_dropout": 0.0}

    def peft_tensors(self) -> dict[str, torch.Tensor]:
        """PEFT's names and [r, in] / [out, r] shapes, detached."""
        out = {}
        for key in self.a:
            layer, module = key.split("_", 1)
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"base_model.model.model.layers.{layer}.{block}.{module}"
            out[f"{name}.lora_A.weight"] = self.a[key].detach().clone()
            out[f"{name}.lora_B.weight"] = self.b[key].detach().clone()
        return out
