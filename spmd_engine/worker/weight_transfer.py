"""A worker's end of the trainer-to-engine weight transfer (the RPCs init_weight_transfer_engine,
update_weights, shutdown_weight_transfer_engine).

Why here and not in the transport: the worker owns the model, so it checks a manifest against
the whole model's names and shapes (the same check every rank makes, so every rank refuses
alike) and applies each bucket with the model's in-place update, inside the versioned-update
watch (model/weights.py): a transfer that breaks half-way is a failed load there, so
finish_weight_update fails on every rank and nothing half-new is served. Errors are returned
as text, not raised: an exception in an mp worker would end the executor.
"""

from __future__ import annotations

from spmd_engine.distributed.weight_transfer.config import TransferInitInfo, TransferUpdateInfo
from spmd_engine.distributed.weight_transfer.packing import DTYPES


class WorkerWeightTransfer:
    def __init__(self):
        self.receiver = None

    def init(self, worker, init_info: dict) -> str | None:
        if self.receiver is not None and self.receiver.failed is None:
            return (f"rank {worker.rank}: a trainer is connected (weight transfer already initialised): "
                    f"shutdown_weight_transfer_engine() first")
        self.shutdown()
        from spmd_engine.distributed.weight_transfer.receiver import WeightReceiver
        try:
            info = TransferInitInfo.from_dict(init_info)
            self.receiver = WeightReceiver(info, worker.world_group.rank_in_group, worker.device)
        except Exception as exc:
            return f"rank {worker.rank}: {type(exc).__name__}: {exc}"
        return None

    def update(self, worker, update_info) -> str | None:
        model = worker.model
        if self.receiver is None:
            reason = "update_weights before init_weight_transfer_engine"
        elif self.receiver.failed:
            reason = f"the transfer group failed ({self.receiver.failed}): init_weight_transfer_engine again"
        else:
            reason = None
        if reason is None:
            try:
                self.receiver.receive(TransferUpdateInfo.from_dict(update_info),
                                      lambda m: check_manifest(model, m),
                                      lambda m: model.open_weight_update(m.names))
                return None
            except Exception as exc:
                reason = f"{type(exc).__name__}: {exc}"
                if self.receiver.failed:
                    self.shutdown()
        model.note_update_error(reason)
        return f"rank {worker.rank}: {reason}"

    def shutdown(self) -> None:
        receiver, self.receiver = self.receiver, None
        if receiver is not None:
            receiver.close()


def check_manifest(model, manifest) -> str | None:
    """The first tensor this model cannot take (named), or None."""
    from spmd_engine.model.weights import hf_tensor_shapes, is_skipped_name
    shapes = hf_tensor_shapes(model.spec)
    for name, dtype, shape in zip(manifest.names, manifest.dtype_names, manifest.shapes):
        if is_skipped_name(name):
            continue
        if name not in shapes:
            return f"unknown weight name {name!r} (not a tensor of this {model.spec.architecture} model)"
        if dtype not in DTYPES:
            return f"{name} has dtype {dtype}, not a floating-point dtype a weight can take ({sorted(DTYPES)})"
        if tuple(shape) != shapes[name]:
            return f"{name} has shape {list(shape)}, expected {list(shapes[name])}"
    return None
