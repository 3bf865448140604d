"""One rank's adapters: the loaded ones on the host, the `max_loras` slots a step runs from.

The engine decides which adapters are loaded (an LRU of `max_cpu_loras`, engine/lora_adapters.py)
and tells every rank alike, with the step that needs them, so the ranks never disagree about
what an id means. A rank keeps only its shard of each adapter (its TP slice of A or B, its PP
stage's layers) and copies the adapters a step uses into slots on its device; the step's
mapping sends each token's rows through its adapter's slot.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from spmd_engine.config import ConfigError, LoRAConfig
from spmd_engine.core.step_messages import AdapterSource
from spmd_engine.model.layers.linear import RowParallelLinear
from spmd_engine.model.lora.linear_lora import LinearLoRA, LoRAState, SlotWeights, StepMapping
from spmd_engine.model.lora.peft_files import LoRAAdapterError, read_adapter
from spmd_engine.model.lora.stacked import plan

# HF module name -> (our layer's attribute path inside a decoder layer, the part it fills)
_TARGETS = {"q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
            "v_proj": ("self_attn.qkv_proj", 2), "o_proj": ("self_attn.o_proj", 0),
            "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
            "down_proj": ("mlp.down_proj", 0)}


@dataclass
class LoadedAdapter:
    name: str
    rank: int
    layers: dict[str, tuple[list, list[int]]]  # layer path -> (its parts' (A, B) shards, the parts' sizes)


class LoRAManager:
    def __init__(self, model, config: LoRAConfig, device: torch.device):
        self.model, self.config, self.device = model, config, torch.device(device)
        self.dtype = model.dtype if config.lora_dtype == "auto" else getattr(torch, config.lora_dtype)
        self.state = LoRAState()
        self.layers = attach_lora_layers(model, self.state, config.max_loras)
        self.adapters: OrderedDict[int, LoadedAdapter] = OrderedDict()
        self.slots: list[int | None] = [None] * config.max_loras  # adapter id in each slot
        self._used: list[int] = []  # filled slots, least recently used first
        self.pinned: set[int] = set()

    # -- loading ------------------------------------------------------------------------
    def add(self, source: AdapterSource, replace: bool = False) -> bool:
        """Load (or with `replace`, load again) an adapter; a slot holding it takes the new
        weights at once. False: it was loaded already and is kept."""
        if source.lora_int_id in self.adapters and not replace:
            self.adapters.move_to_end(source.lora_int_id)
            return True
        adapter = self._read(source)
        self.adapters[source.lora_int_id] = adapter
        self.adapters.move_to_end(source.lora_int_id)
        if source.lora_int_id in self.slots:
            self._fill(self.slots.index(source.lora_int_id), adapter)
        return True

    def _read(self, source: AdapterSource) -> LoadedAdapter:
        spec = self.model.spec
        found = read_adapter(source.lora_name, source.lora_path, source.in_memory, spec, self.config.max_lora_rank)
        parts: dict[str, list] = {}
        for (layer_index, module), (a, b) in found.tensors.items():
            path, part = _TARGETS[module]
            key = f"model.layers.{layer_index}.{path}"
            if key not in self.layers:  # another stage's layer, or none of this model's
                continue
            base = self.model.get_submodule(key)
            try:
                a_local, b_local = base.lora_shard(part, a, b)
            except Exception as exc:  # a tensor that fails to read
                raise LoRAAdapterError(source.lora_name, f"layer {layer_index} {module}: {exc}") from None
            scaled = (b_local.to(torch.float32) * found.scaling).to(self.dtype)
            slot_parts = parts.setdefault(key, [None] * len(self.layers[key].part_sizes))
            slot_parts[part] = (a_local.to(self.dtype).contiguous(), scaled.contiguous())
        return LoadedAdapter(source.lora_name, found.rank, {k: (v, self.layers[k].part_sizes) for k, v in parts.items()})

    def remove(self, lora_id: int) -> bool:
        if self.adapters.pop(lora_id, None) is None:
            return False
        self.pinned.discard(lora_id)
        if lora_id in self.slots:
            self._empty(self.slots.index(lora_id))
        return True

    def pin(self, lora_id: int) -> bool:
        if lora_id not in self.adapters:
            return False
        self.pinned.add(lora_id)
        return True

    def list(self) -> set[int]:
        return set(self.adapters)

    # -- every step -------------------------------------------------------------------------
    def set_step(self, token_adapters: list[int]) -> None:
        """This forward's mapping from each token's adapter id (0: the base model): the adapters
        take slots (the least recently used slot not needed now is reused)."""
        ids = sorted(set(token_adapters) - {0})
        if not ids:
            self.state.mapping = None
            return
        if len(ids) > len(self.slots):
            raise RuntimeError(f"a step uses {len(ids)} LoRA adapters, more than max_loras={len(self.slots)}")
        slot_of = {}
        for lora_id in ids:
            if lora_id not in self.adapters:
                raise RuntimeError(f"LoRA adapter id {lora_id} is not loaded on this rank")
            if lora_id in self.slots:
                slot_of[lora_id] = self.slots.index(lora_id)
        for lora_id in ids:
            if lora_id in slot_of:
                continue
            free = next(s for s in self._slot_order() if s not in slot_of.values())
            self._fill(free, self.adapters[lora_id])
            self.slots[free] = lora_id
            slot_of[lora_id] = free
        for lora_id in ids:
            self._touch(slot_of[lora_id])
        index = torch.tensor(token_adapters)
        groups = []
        for lora_id in ids:
            rows = (index == lora_id).nonzero().flatten()
            groups.append((slot_of[lora_id], None if len(rows) == len(token_adapters) else rows.to(self.device)))
        self.state.mapping = StepMapping(groups, stack=plan(groups, self.device) if len(groups) > 1 else None)

    def clear_step(self) -> None:
        self.state.mapping = None

    def _slot_order(self) -> list[int]:
        """Empty slots first, then the least recently used."""
        return [s for s, held in enumerate(self.slots) if held is None] + list(self._used)

    def _touch(self, slot: int) -> None:
        if slot in self._used:
            self._used.remove(slot)
        self._used.append(slot)

    def _fill(self, slot: int, adapter: LoadedAdapter) -> None:
        for key, layer in self.layers.items():
            weights = adapter.layers.get(key)
            layer.slots[slot] = None if weights is None else SlotWeights(
                [None if p is None else (p[0].to(self.device), p[1].to(self.device)) for p in weights[0]], weights[1])

    def _empty(self, slot: int) -> None:
        self.slots[slot] = None
        if slot in self._used:
            self._used.remove(slot)
        for layer in self.layers.values():
            layer.slots[slot] = None


def attach_lora_layers(model, state: LoRAState, max_loras: int) -> dict[str, LinearLoRA]:
    """A LinearLoRA on every layer of `model` (this rank's stage) an adapter may target, all
    reading `state`; by layer path ("model.layers.3.self_attn.qkv_proj")."""
    layers: dict[str, LinearLoRA] = {}
    for index, decoder in model.model.layers.items():
        for path, _ in _TARGETS.values():
            layer = _find(decoder, path)
            if layer is None or f"model.layers.{index}.{path}" in layers:
                continue
            reduce = layer.group if isinstance(layer, RowParallelLinear) else None
            layer.lora = LinearLoRA(state, layer.lora_part_sizes(), max_loras, reduce,
                                    batch_invariant=getattr(layer, "batch_invariant", False))
            layers[f"model.layers.{index}.{path}"] = layer.lora
    if not layers:
        raise ConfigError(f"enable_lora: {type(model).__name__} has no layer LoRA applies to")
    return layers


def target_of(module: str) -> tuple[str, int]:
    """(the layer path inside a decoder layer, the part) an HF module name fills."""
    return _TARGETS[module]


def _find(decoder, path: str):
    module = decoder
    for attr in path.split("."):
        module = getattr(module, attr, None)
        if module is None:
            return None
    return module if hasattr(module, "lora_shard") else None
