"""The generator job of the weight-transfer tests.

`push TP PP DP BACKEND PORT WORLD OUT [EXECUTOR]` (batch-invariant; under torchrun with the
default external_launcher, or one process whose "mp" executor spawns the ranks): join the
trainer's group, take one update as version "v3", write each rank's greedy tokens and logprobs
to OUT/rank{r}.json (the mp engine's driver writes rank0.json).

`faults PORT_A OUT` (one uni engine): trainer A (another process, stalled, SIGKILLed by the
test) breaks an update; a trainer thread that hangs past timeout_s; a second trainer on a
taken endpoint; an init while connected; a wrong shape and a wrong dtype; then complete
updates, one with a request in flight across it. OUT gets one JSON object of outcomes."""

import json
import os
import sys
import threading
import time

import torch

from spmd_engine import LLM, SamplingParams
from spmd_engine.distributed.weight_transfer.trainer import trainer_engine

sys.path.insert(0, os.path.dirname(__file__))
from wt_trainer import BUNDLED, trainer_weights  # noqa: E402

PROMPTS = ["Beautiful is", "Errors should", "Now is better"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, logprobs=2, ignore_eos=True)


def outcome(call):
    t0 = time.monotonic()
    try:
        result = call()
        try:
            json.dumps(result)
        except TypeError:  # outputs of a call expected to fail: the report names what came back
            result = repr(result)[:300]
        return ["ok", result, round(time.monotonic() - t0, 2)]
    except Exception as exc:
        return [type(exc).__name__, str(exc), round(time.monotonic() - t0, 2)]


def records(outs):
    return [{"token_ids": o.outputs[0].token_ids, "version": o.weight_version,
             "logprobs": [[[k, v.logprob] for k, v in sorted(step.items())] for step in o.outputs[0].logprobs]}
            for o in outs]


def push(tp, pp, dp, backend, port, world, out, executor="external_launcher"):
    rank = int(os.environ.get("RANK", "0"))
    with LLM(model=BUNDLED, tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp,
             distributed_executor_backend=executor, batch_invariant=True, seed=0, max_model_len=128,
             weight_transfer_config={"backend": backend}) as llm:
        llm.init_weight_transfer_engine({"init_info": {"master_address": "127.0.0.1", "master_port": port,
                                                       "world_size": world, "rank_offset": 1, "timeout_s": 60}})
        llm.start_weight_update()
        llm.update_weights({"update_info": {"names": [], "dtype_names": [], "shapes": []}})
        llm.finish_weight_update("v3")
        llm.reset_prefix_cache()
        result = {"rank": rank, "version": llm.get_weight_version(), "outs": records(llm.generate(PROMPTS, GREEDY))}
        llm.shutdown_weight_transfer_engine()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    sys.stdout.write(f"generator rank {rank} done\n")


def info(port, timeout_s):
    return {"init_info": {"master_address": "127.0.0.1", "master_port": port, "world_size": 2, "timeout_s": timeout_s}}


HANG_TIMEOUT_S = 6  # the hung trainer's timeout_s: long enough for both sides to join the group on a busy host


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def faults(port_a, out):
    report = {}
    llm = LLM(model=BUNDLED, distributed_executor_backend="uni", seed=0, max_model_len=128,
              weight_transfer_config={"backend": "nccl"})
    report["reference"] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    # 1. trainer A (another process) stalls mid-stream and is SIGKILLed there by the test
    report["init_a"] = outcome(lambda: llm.init_weight_transfer_engine(info(port_a, 30)))
    llm.start_weight_update()
    sys.stdout.write("ENGINE RECEIVING\n")
    sys.stdout.flush()
    report["killed_update"] = outcome(lambda: llm.update_weights({"update_info": {}}))
    report["killed_finish"] = outcome(lambda: llm.finish_weight_update(1))
    report["killed_generate"] = outcome(lambda: llm.generate(PROMPTS, GREEDY))

    # 2. a trainer that hangs mid-stream: the engine gives up after timeout_s, and so does the trainer
    port_b, trainer_side = free_port(), {}

    def hanging():
        t = trainer_engine("nccl").trainer_init(info(port_b, HANG_TIMEOUT_S)["init_info"]
                                                | {"packed_buffer_size_bytes": 4096})
        broadcast_async = t.group.broadcast_async  # every bucket goes through it

        def stalls(tensor, what):
            if what == "bucket 8":
                time.sleep(2 * HANG_TIMEOUT_S)
            return broadcast_async(tensor, what)
        t.group.broadcast_async = stalls
        trainer_side["hang"] = outcome(lambda: t.send_weights(trainer_weights(3).items()))
        t.shutdown()
    th = threading.Thread(target=hanging)
    th.start()
    report["init_b"] = outcome(lambda: llm.init_weight_transfer_engine(info(port_b, HANG_TIMEOUT_S)))
    llm.start_weight_update()
    report["hung_update"] = outcome(lambda: llm.update_weights({"update_info": {}}))
    report["hung_finish"] = outcome(lambda: llm.finish_weight_update(2))
    th.join(30)
    report["hung_trainer"] = trainer_side.get("hang")

    # 3. a restarted trainer; a second one on its endpoint; bad buckets; then complete updates
    port_c, good = free_port(), trainer_weights(3)
    from safetensors.torch import load_file
    original = load_file(os.path.join(BUNDLED, "model.safetensors"))
    bad_shape = dict(original, **{"model.norm.weight": torch.ones(7)})
    bad_dtype = dict(original, **{"model.norm.weight": original["model.norm.weight"].to(torch.int32)})
    connected = threading.Event()

    def restarted():
        t = trainer_engine("nccl").trainer_init(info(port_c, 30)["init_info"])
        connected.set()
        for key, weights in (("bad_shape", bad_shape), ("bad_dtype", bad_dtype), ("original", original),
                             ("new", good)):
            trainer_side[key] = outcome(lambda: t.send_weights(weights.items()))
        t.shutdown()
    th = threading.Thread(target=restarted)
    th.start()
    report["init_c"] = outcome(lambda: llm.init_weight_transfer_engine(info(port_c, 30)))
    connected.wait(30)
    report["second_trainer"] = outcome(lambda: trainer_engine("nccl").trainer_init(info(port_c, 5)["init_info"]))
    report["init_while_connected"] = outcome(lambda: llm.init_weight_transfer_engine(info(port_c, 5)))
    for key in ("bad_shape", "bad_dtype"):
        llm.start_weight_update()
        report[key] = outcome(lambda: llm.update_weights({"update_info": {}}))
        report[key + "_finish"] = outcome(lambda: llm.finish_weight_update(3))
    llm.start_weight_update()
    report["update_original"] = outcome(lambda: llm.update_weights({"update_info": {}}))
    report["finish_v4"] = outcome(lambda: llm.finish_weight_update("v4"))
    llm.reset_prefix_cache()
    report["after_restart"] = [[o.outputs[0].token_ids, o.weight_version] for o in llm.generate(PROMPTS, GREEDY)]

    # 4. a request in flight across an update: kept, paused, continued on the new weights
    engine = llm.llm_engine
    engine.add_request("inflight", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    for _ in range(4):
        engine.step()
    llm.start_weight_update()
    report["step_during_update"] = outcome(engine.step)
    report["update_new"] = outcome(lambda: llm.update_weights({"update_info": {}}))
    report["finish_v5"] = outcome(lambda: llm.finish_weight_update("v5"))
    llm.reset_prefix_cache(reset_running_requests=True)
    final = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                final = o
    report["inflight"] = {"token_ids": final.outputs[0].token_ids, "version": final.weight_version,
                          "prompt_token_ids": final.prompt_token_ids}
    th.join(30)
    report["trainer"] = {k: trainer_side.get(k) for k in ("bad_shape", "bad_dtype", "original", "new")}
    llm.shutdown_weight_transfer_engine()
    llm.shutdown()
    with open(out, "w") as f:
        json.dump(report, f)
    sys.stdout.write("generator done\n")


if __name__ == "__main__":
    if sys.argv[1] == "push":
        a = sys.argv[2:]
        push(int(a[0]), int(a[1]), int(a[2]), a[3], int(a[4]), int(a[5]), a[6], *a[7:])
    else:
        faults(int(sys.argv[2]), sys.argv[3])
