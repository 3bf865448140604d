"""LoRARequest: which adapter a request runs with (vLLM's `vllm.lora.request.LoRARequest`).

An adapter is named by its `lora_int_id`, unique per adapter and > 0 (0 is the base model), and
read from `lora_path`, a PEFT directory (adapter_config.json + adapter_model.safetensors).
A trainer that holds the adapter in memory instead sets two more attributes on the request, as
verl's TensorLoRARequest subclass does: `peft_config` (the adapter_config.json dict) and
`lora_tensors` (PEFT's tensor names -> tensors); the path is then only a label.
`load_inplace=True` makes `add_lora` replace an adapter already loaded under the same id (an RL
step's new adapter) instead of keeping the loaded one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(eq=False)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    load_inplace: bool = False
    is_3d_lora_weight: bool = False  # vLLM's MoE expert layout flag: expert LoRA is refused here

    def __post_init__(self):
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise TypeError(f"lora_int_id must be an integer, got {self.lora_int_id!r}")
        if self.lora_int_id < 1:
            raise ValueError(f"id must be > 0, got {self.lora_int_id}")
        if not self.lora_path:
            raise ValueError("lora_path cannot be empty")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __eq__(self, other: object) -> bool:
        """As vLLM's: the name and the id (a name loaded again gets a new id while requests of
        the old one may still run)."""
        return (isinstance(other, LoRARequest) and self.lora_name == other.lora_name
                and self.lora_int_id == other.lora_int_id)

    def __hash__(self) -> int:
        return hash((self.lora_name, self.lora_int_id))


def in_memory_adapter(request: LoRARequest) -> tuple[dict, dict] | None:
    """(peft_config, lora_tensors) of a request that carries its adapter, else None."""
    tensors = getattr(request, "lora_tensors", None)
    if tensors is None:
        return None
    config = getattr(request, "peft_config", None)
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {request.lora_name!r}: lora_tensors need a peft_config dict "
                         f"(adapter_config.json's contents), got {type(config).__name__}")
    return config, tensors
