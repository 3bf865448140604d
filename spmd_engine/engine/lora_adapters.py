"""The engine's LoRA adapters: which are known, which are loaded on the ranks, what a cached
prefix of each is keyed by.

An adapter is checked here first (its files or tensors against the base model), so a bad one
fails the call that brought it, in one line, on every rank alike, and the engine keeps serving
the others. At most `max_cpu_loras` stay loaded on the ranks: beyond that the least recently
used unpinned one is dropped, with the next step, and loaded again (from its path, or from the
tensors it was given) with the step that needs it. All of that is decided here, from the calls
and the schedule only, so every rank of every layout loads and drops the same adapters at the
same step. A load bumps the adapter's generation, which roots its requests' prefix-cache
hashes: a prefix computed by an adapter is found only by requests of that adapter's same load
(`load_inplace=True` replaces the weights; the old prefixes are never hit again).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from spmd_engine.config import LoRAConfig
from spmd_engine.core.step_messages import AdapterSource, SchedulerOutput
from spmd_engine.lora_request import LoRARequest, in_memory_adapter
from spmd_engine.model.lora.peft_files import LoRAAdapterError, read_adapter

NOT_ENABLED = "LoRA is not enabled: start the engine with enable_lora=True"


class LoRAAdapters:
    def __init__(self, config: LoRAConfig | None, spec, executor):
        self.config, self.spec, self.executor = config, spec, executor
        self.sources: dict[int, AdapterSource] = {}  # every adapter added and not removed
        self.loaded: OrderedDict[int, None] = OrderedDict()  # on the ranks, least recently used first
        self.pinned: set[int] = set()
        self.generation: dict[int, int] = {}  # loads of each id so far (never reset)

    def add(self, request: LoRARequest) -> bool:
        """Load the adapter on every rank (again with `load_inplace`); True once it is loaded."""
        self._check_enabled()
        if not isinstance(request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        lora_id, name = request.lora_int_id, request.lora_name
        for other_id, other in self.sources.items():
            if other.lora_name == name and other_id != lora_id:
                raise LoRAAdapterError(name, f"the name is already loaded with lora_int_id {other_id} (this "
                                             f"request has {lora_id}): remove_lora({other_id}) first")
        known = self.sources.get(lora_id)
        if known is not None and known.lora_name != name and not request.load_inplace:
            raise LoRAAdapterError(name, f"lora_int_id {lora_id} is loaded as {known.lora_name!r}: an id names "
                                         f"one adapter (load_inplace=True replaces it)")
        if lora_id in self.sources and not request.load_inplace:
            if lora_id not in self.loaded:
                self._load_now(self.sources[lora_id], replace=False)
            self.loaded.move_to_end(lora_id)
            return True
        source = AdapterSource(lora_id, name, request.lora_path, in_memory_adapter(request))
        read_adapter(name, source.lora_path, source.in_memory, self.spec, self.config.max_lora_rank)  # checked here
        self._load_now(source, replace=lora_id in self.sources)
        self.sources[lora_id] = source
        self.generation[lora_id] = self.generation.get(lora_id, -1) + 1
        return True

    def _load_now(self, source: AdapterSource, replace: bool) -> None:
        errors = [e for e in self.executor.collective_rpc("add_lora", (source, replace)) if e]
        if errors:
            self.executor.collective_rpc("remove_lora", (source.lora_int_id,))
            self.loaded.pop(source.lora_int_id, None)  # a replaced one's old source loads again when used
            raise LoRAAdapterError(source.lora_name, f"failed to load: {errors[0]}")
        self.loaded[source.lora_int_id] = None
        self.loaded.move_to_end(source.lora_int_id)

    def remove(self, lora_id: int, in_use: int = 0) -> bool:
        """Forget an adapter (False if unknown); refused while `in_use` requests run with it."""
        self._check_enabled()
        if lora_id not in self.sources:
            return False
        if in_use:
            raise ValueError(f"remove_lora({lora_id}): {in_use} unfinished requests use adapter "
                             f"{self.sources[lora_id].lora_name!r}; abort or finish them first")
        self.executor.collective_rpc("remove_lora", (lora_id,))
        del self.sources[lora_id]
        self.loaded.pop(lora_id, None)
        self.pinned.discard(lora_id)
        return True

    def pin(self, lora_id: int) -> bool:
        """Never drop this adapter to make room (vLLM's pin_lora); False if unknown."""
        self._check_enabled()
        if lora_id not in self.sources:
            return False
        self.pinned.add(lora_id)
        if lora_id not in self.loaded:
            self._load_now(self.sources[lora_id], replace=False)
        return True

    def list(self) -> set[int]:
        """The adapters loaded on the ranks (vLLM's list_loras)."""
        return set(self.loaded)

    def cache_root(self, lora_id: int) -> bytes | None:
        """What a request of this adapter's prefix-cache hashes chain from (None: the base model)."""
        if not lora_id:
            return None
        if self.config is None or lora_id not in self.sources:
            raise ValueError(f"LoRA adapter id {lora_id} is not loaded: add_lora it first")
        key = f"lora:{lora_id}:{self.generation[lora_id]}".encode()
        return hashlib.sha256(key).digest()

    def plan_step(self, out: SchedulerOutput) -> None:
        """The loads and drops every rank makes before this step: its adapters loaded, the least
        recently used others dropped down to max_cpu_loras."""
        if self.config is None:
            return
        for lora_id in out.active_loras:
            if lora_id not in self.loaded:
                out.lora_loads.append(self.sources[lora_id])
                self.loaded[lora_id] = None
            self.loaded.move_to_end(lora_id)
        spare = [i for i in self.loaded if i not in out.active_loras and i not in self.pinned]
        while len(self.loaded) > self.config.max_cpu_loras and spare:
            lora_id = spare.pop(0)
            del self.loaded[lora_id]
            out.lora_evictions.append(lora_id)

    def _check_enabled(self) -> None:
        if self.config is None:
            raise ValueError(NOT_ENABLED)
