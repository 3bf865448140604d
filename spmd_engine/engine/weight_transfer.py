"""The front end of vLLM 0.34's four-phase weight transfer: `init_weight_transfer_engine`,
`start_weight_update`, `update_weights`, `finish_weight_update(weight_version)`, plus
`shutdown_weight_transfer_engine`.

The phases are the versioned updates of engine/weight_update.py with a different source of
tensors: instead of load_weights calls from this process, every worker receives the
trainer's buckets from the transfer group (worker/weight_transfer.py). So start .. finish is
the same fence (no step runs in between), a transfer that breaks or is refused fails the
update on every rank, and generate refuses until a complete update. init_info is checked
here before any worker connects.
"""

from __future__ import annotations

from spmd_engine.distributed.weight_transfer.config import TransferInitInfo, TransferUpdateInfo, WeightTransferConfig

CONNECTED = "a trainer is connected"  # the workers' refusal of a second init (worker/weight_transfer.py)


class WeightTransferFrontEnd:
    def __init__(self, llm_engine, config: WeightTransferConfig | None):
        self._engine, self.config = llm_engine, config

    def _configured(self) -> WeightTransferConfig:
        if self.config is None:
            raise RuntimeError("Weight transfer not configured: LLM(weight_transfer_config=WeightTransferConfig("
                               "backend='nccl' | 'ipc')) to enable it")
        return self.config

    def init(self, request) -> None:
        backend = self._configured().backend
        info = dict(_field(request, "init_info"), backend=backend)
        TransferInitInfo.from_dict(info)  # a bad field is a ValueError before any worker connects
        problems = [p for p in self._engine.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": info})
                    if p]
        if problems:
            if not all(CONNECTED in p for p in problems):  # ranks that joined leave again; a live
                self._engine.collective_rpc("shutdown_weight_transfer_engine")  # connection stays
            raise RuntimeError(f"init_weight_transfer_engine failed ({problems[0]}"
                               + (f"; and {len(problems) - 1} more" if len(problems) > 1 else "") + ")")

    def update(self, request) -> None:
        self._configured()
        info = _field(request, "update_info")
        if isinstance(info, list):
            raise ValueError("update_info as a list per worker is not supported: every worker receives the "
                             "same stream, so pass one dict")
        TransferUpdateInfo.from_dict(info)
        if not self._engine.updates.in_progress:
            raise RuntimeError("start_weight_update must be called before update_weights")
        problems = [p for p in self._engine.collective_rpc("update_weights", kwargs={"update_info": info}) if p]
        if problems:
            message = problems[0] + (f"; and {len(problems) - 1} more" if len(problems) > 1 else "")
            self._engine.updates.note_load_error(RuntimeError(message))
            refused = "ValueError: weight update refused" in problems[0]
            raise (ValueError if refused else RuntimeError)(f"update_weights failed: {message}")

    def shutdown(self) -> None:
        if self._engine.updates.in_progress:
            raise RuntimeError("Cannot release a trainer connection during a weight update")
        self._engine.collective_rpc("shutdown_weight_transfer_engine")


def _field(request, name: str):
    """vLLM's request forms: a dict {name: ...} or an object with that attribute."""
    if isinstance(request, dict):
        if name not in request:
            raise ValueError(f"expected a dict with the key {name!r} (vLLM's request form), got keys {sorted(request)}")
        return request[name]
    if hasattr(request, name):
        return getattr(request, name)
    raise TypeError(f"expected a dict {{{name!r}: ...}} or a request with .{name}, got {type(request).__name__}")
