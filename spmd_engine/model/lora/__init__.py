"""LoRA adapters: PEFT's files read and checked (peft_files.py), each linear layer's share of the
adapters' low-rank products (linear_lora.py), and one rank's loaded adapters and slots
(manager.py). The engine's side (which adapters are loaded, which requests use which) is
engine/lora_adapters.py."""
