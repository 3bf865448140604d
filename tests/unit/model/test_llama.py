"""The whole model: TP/PP layouts against the single-rank reference, the
layer placement over pipeline stages, the loader, and the errors users see.

Distributed layouts run in real gloo processes (one spawn per world size runs
several layouts); the pipeline hand-off between stages is done here with
send/recv, as the engine's worker will do with send/recv_tensor_dict.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import require_reference
from engine_helpers import packed_step
from fake_groups import ShardOnlyGroup, SoloGroup, make_grid_groups, run_distributed
from make_random_checkpoint import make_random_checkpoint  # noqa: E402
from model_helpers import _TOKENS, BLOCK_SIZE, LLAMA, QWEN_TIED, SCHEDULE, SEQ_NAMES, run_schedule

from spmd_engine.config import ConfigError
from spmd_engine.model import check_model_parallel, load_model, pp_layer_range
from spmd_engine.model import loader as loader_module
from spmd_engine.model.partition import PP_PARTITION_ENV


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {"llama": str(make_random_checkpoint(root / "llama", **LLAMA)),
            "qwen_tied": str(make_random_checkpoint(root / "qwen", **QWEN_TIED))}


def reference_logits(path) -> list[np.ndarray]:
    solo = SoloGroup()
    with torch.no_grad():
        return run_schedule(load_model(path, solo, solo))


# ---------------------------------------------------------------- layouts

def _layout_worker(rank, world_size, layouts):
    import torch.distributed as dist

    groups = [make_grid_groups(tp, pp) for _, tp, pp, _, _ in layouts]  # collective: all ranks, all layouts
    results = {}
    for (name, tp, pp, path, partition), mine in zip(layouts, groups):
        if mine is None:
            continue
        tp_group, pp_group = mine
        model = load_model(path, tp_group, pp_group, pp_partition=partition)

        def send(t, dst=rank + tp):
            dist.send(t.contiguous(), dst)

        def recv(shape, src=rank - tp):
            t = torch.empty(shape)
            dist.recv(t, src)
            return t

        with torch.no_grad():
            logits = run_schedule(model, send, recv)
        results[name] = {"logits": logits, "layers": (model.start_layer, model.end_layer)}
    return results


def _check_layouts(world_size, layouts, checkpoints):
    layouts = [(name, tp, pp, checkpoints[ckpt], part) for name, tp, pp, ckpt, part in layouts]
    results = run_distributed(_layout_worker, world_size, layouts, timeout=100)
    refs = {path: reference_logits(path) for path in {layout[3] for layout in layouts}}
    report = {}
    for name, tp, pp, path, _ in layouts:
        last_stage = [results[r][name]["logits"] for r in range((pp - 1) * tp, pp * tp)]
        for other in last_stage[1:]:  # every TP rank of the last stage has identical logits
            assert all(np.array_equal(a, b) for a, b in zip(other, last_stage[0])), name
        ref = refs[path]
        scale = max(np.abs(r).max() for r in ref)
        report[name] = max(np.abs(a - b).max() for a, b in zip(last_stage[0], ref)) / scale
    bad = {k: v for k, v in report.items() if not v < 1e-5}
    assert not bad, f"layouts off the TP=1/PP=1 reference (relative): {bad}; all: {report}"
    return results


@pytest.mark.timeout(120)
def test_layouts_world2_match_reference(checkpoints):
    layouts = [("tp2", 2, 1, "llama", None), ("pp2", 1, 2, "llama", None),
               ("pp2 partition 4,1", 1, 2, "llama", "4,1"), ("tp2 qwen tied", 2, 1, "qwen_tied", None)]
    results = _check_layouts(2, layouts, checkpoints)
    assert [results[r]["pp2"]["layers"] for r in range(2)] == [(0, 3), (3, 5)]
    assert [results[r]["pp2 partition 4,1"]["layers"] for r in range(2)] == [(0, 4), (4, 5)]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_layouts_world4_match_reference(checkpoints):
    layouts = [("tp4", 4, 1, "llama", None), ("pp4", 1, 4, "llama", None), ("tp2 pp2", 2, 2, "llama", None),
               ("tp2 pp2 qwen tied", 2, 2, "qwen_tied", None), ("tp4 qwen tied", 4, 1, "qwen_tied", None)]
    results = _check_layouts(4, layouts, checkpoints)
    assert [results[r]["pp4"]["layers"] for r in range(4)] == [(0, 1), (1, 2), (2, 4), (4, 5)]


def test_kv_cache_schedule_matches_full_forward(checkpoints):
    """Cached, chunked, mixed-batch logits equal one uncached pass over each whole sequence."""
    solo = SoloGroup()
    model = load_model(checkpoints["llama"], solo, solo)
    with torch.no_grad():
        cached = reference_logits(checkpoints["llama"])
        full = {}
        for name, tokens in _TOKENS.items():
            ids = torch.tensor([tokens])
            hidden = model(ids, torch.arange(len(tokens))[None], None)["hidden_states"]
            full[name] = model.compute_logits(hidden[0]).numpy()
    for step, logits in zip(SCHEDULE, cached):
        row = 0
        for seq, tokens, ctx in step:
            expected = full[SEQ_NAMES[seq]][ctx : ctx + len(tokens)]
            np.testing.assert_allclose(logits[row : row + len(tokens)], expected, atol=1e-4, rtol=1e-5)
            row += len(tokens)


def test_a_step_of_new_prompts_attends_causally_without_a_mask():
    """Step 1 holds only new prompts (rows of different lengths): they attend to their own
    tokens, no cache read and no mask; step 2's rows with cached prefixes read blocks under a
    mask, and its fresh prompt does not. All checked against the uncached pass above."""
    first = packed_step(SCHEDULE[0], BLOCK_SIZE)[2]
    assert all(g.mask is None and g.block_tables is None for g in first.groups)
    second = packed_step(SCHEDULE[1], BLOCK_SIZE)[2]
    assert [g.mask is None for g in second.groups].count(True) == 1
    # The one-token decode and the three-token chunk are not padded to each other.
    assert sorted(g.width for g in second.groups if g.mask is not None) == [1, 3]


# ---------------------------------------------------------------- placement over stages

def vllm_placement(num_layers, pp_size):
    """vLLM get_pp_indices (vllm/distributed/utils.py), restated as an oracle."""
    partitions = [num_layers // pp_size] * pp_size
    remaining = num_layers % pp_size
    for i in range(2, remaining + 2):
        partitions[-i] += 1
    return partitions


@pytest.mark.parametrize("num_layers,pp,expected", [
    (8, 3, [3, 3, 2]), (5, 4, [1, 1, 2, 1]), (10, 4, [2, 3, 3, 2]), (7, 2, [4, 3]),
    (32, 5, [6, 6, 7, 7, 6]), (8, 8, [1] * 8), (9, 1, [9]),
])
def test_pp_layer_range_places_remainder_like_vllm(num_layers, pp, expected, monkeypatch):
    monkeypatch.delenv(PP_PARTITION_ENV, raising=False)
    ranges = [pp_layer_range(num_layers, r, pp) for r in range(pp)]
    assert [end - start for start, end in ranges] == expected == vllm_placement(num_layers, pp)
    assert ranges[0][0] == 0 and ranges[-1][1] == num_layers
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_pp_layer_range_agrees_with_vllm_everywhere(monkeypatch):
    monkeypatch.delenv(PP_PARTITION_ENV, raising=False)
    for layers in range(1, 41):
        for pp in range(1, min(layers, 12) + 1):
            counts = [e - s for s, e in (pp_layer_range(layers, r, pp) for r in range(pp))]
            assert counts == vllm_placement(layers, pp), (layers, pp)


def test_partition_override_by_argument_and_env(monkeypatch):
    monkeypatch.delenv(PP_PARTITION_ENV, raising=False)
    assert [pp_layer_range(8, r, 3, "2,2,4") for r in range(3)] == [(0, 2), (2, 4), (4, 8)]
    assert [pp_layer_range(8, r, 3, [1, 6, 1]) for r in range(3)] == [(0, 1), (1, 7), (7, 8)]
    monkeypatch.setenv(PP_PARTITION_ENV, "3,3,2")
    assert [pp_layer_range(8, r, 3) for r in range(3)] == [(0, 3), (3, 6), (6, 8)]
    assert pp_layer_range(8, 0, 3, "1,1,6") == (0, 1)  # the argument wins over the environment


@pytest.mark.parametrize("partition,match", [
    ("3,3", "has 2 entries but pipeline_parallel_size is 3"),
    ("3,3,3", "sums to 9 but the model has 8 layers"),
    ("4,4,0", "every stage needs at least 1 layer"),
    ("5,-1,4", "every stage needs at least 1 layer"),
    ("3;3;2", "not a comma-separated list of integers"),
])
def test_bad_partition_strings(partition, match, monkeypatch):
    monkeypatch.delenv(PP_PARTITION_ENV, raising=False)
    with pytest.raises(ConfigError, match=match):
        pp_layer_range(8, 0, 3, partition)
    monkeypatch.setenv(PP_PARTITION_ENV, partition)
    with pytest.raises(ConfigError, match=PP_PARTITION_ENV):
        pp_layer_range(8, 0, 3)


def test_stage_owns_embedding_norm_and_head(checkpoints, monkeypatch):
    monkeypatch.delenv(PP_PARTITION_ENV, raising=False)
    stages = [load_model(checkpoints["qwen_tied"], SoloGroup(), ShardOnlyGroup(3, r)) for r in range(3)]
    first, middle, last = stages
    assert first.model.embed_tokens is not None and first.lm_head is None and first.model.norm is None
    assert middle.model.embed_tokens is None and middle.lm_head is None and middle.model.norm is None
    assert last.model.embed_tokens is None and last.model.norm is not None
    # tied embeddings: the last stage loaded the embedding matrix as its head
    assert torch.equal(last.lm_head.weight, first.model.embed_tokens.weight)
    assert [sorted(s.model.layers) for s in stages] == [["0"], ["1", "2"], ["3"]]


def test_tied_embedding_shares_one_parameter_on_a_single_stage(checkpoints):
    model = load_model(checkpoints["qwen_tied"], SoloGroup(), SoloGroup())
    assert model.lm_head.weight is model.model.embed_tokens.weight


# ---------------------------------------------------------------- checks before any collective

def _config(**overrides):
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 100}
    config.update(overrides)
    return config


@pytest.mark.parametrize("tp,pp,config,match", [
    (3, 1, {}, "tensor_parallel_size 3 must divide num_attention_heads 8"),
    (4, 1, {"num_key_value_heads": 8, "num_attention_heads": 8, "intermediate_size": 98},
     "must divide intermediate_size 98"),
    (4, 1, {"num_attention_heads": 12, "num_key_value_heads": 6, "hidden_size": 96},
     "tensor_parallel_size 4 and num_key_value_heads 6 of this model must divide one another"),
    (2, 1, {"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 96},
     "tensor_parallel_size 2 and num_key_value_heads 3 of this model must divide one another"),
    (1, 5, {}, "pipeline_parallel_size 5 exceeds num_hidden_layers 4"),
    (1, 1, {"architectures": ["GPT2LMHeadModel"]},
     "unsupported architecture GPT2LMHeadModel in config.json; supported: LlamaForCausalLM"),
    (1, 1, {"hidden_size": None}, "'hidden_size' must be a positive integer"),
    (1, 1, {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    (1, 1, {"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "rope_scaling type 'dynamic' is not supported"),
    (1, 1, {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "needs 'low_freq_factor'"),
])
def test_check_model_parallel_rejects_bad_layouts(tp, pp, config, match):
    with pytest.raises(ConfigError, match=match):
        check_model_parallel(_config(**config), tp, pp)


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 4), (4, 1), (8, 2)])
def test_check_model_parallel_accepts_valid_layouts(tp, pp):
    spec = check_model_parallel(_config(intermediate_size=128), tp, pp)
    assert spec.num_kv_heads == 2


def test_sliding_window_longer_than_cache_is_refused(tmp_path):
    path = make_random_checkpoint(tmp_path, "MistralForCausalLM", num_layers=1)
    config = json.loads((path / "config.json").read_text())
    config["sliding_window"] = 8
    (path / "config.json").write_text(json.dumps(config))
    model = load_model(path, SoloGroup(), SoloGroup())
    model.check_max_model_len(8)
    with pytest.raises(ConfigError, match="sliding_window 8"):
        model.check_max_model_len(9)


# ---------------------------------------------------------------- loader

class CountingSafeOpen:
    """safe_open that counts the bytes handed out by get_slice indexing."""

    def __init__(self, real):
        self.real, self.bytes_read, self.full_reads = real, 0, []

    def __call__(self, *args, **kwargs):
        counter = self
        handle = self.real(*args, **kwargs)

        class Slice:
            def __init__(self, name, inner):
                self.name, self.inner = name, inner

            def get_shape(self):
                return self.inner.get_shape()

            def __getitem__(self, index):
                t = self.inner[index]
                counter.bytes_read += t.numel() * t.element_size()
                if list(t.shape) == list(self.inner.get_shape()):
                    counter.full_reads.append(self.name)
                return t

        class Handle:
            def __enter__(self):
                handle.__enter__()
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            def keys(self):
                return handle.keys()

            def get_slice(self, name):
                return Slice(name, handle.get_slice(name))

        return Handle()


def test_loader_reads_only_this_ranks_slice(tmp_path, monkeypatch):
    path = make_random_checkpoint(tmp_path, hidden_size=128, num_layers=4, num_heads=8, num_kv_heads=4,
                                  intermediate_size=512, vocab_size=1024)
    ckpt_bytes = (path / "model.safetensors").stat().st_size
    counter = CountingSafeOpen(loader_module.safe_open)
    monkeypatch.setattr(loader_module, "safe_open", counter)
    model = load_model(path, ShardOnlyGroup(4, 1), ShardOnlyGroup(2, 1))  # TP rank 1 of 4, last of 2 stages
    shard_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert counter.bytes_read <= shard_bytes
    assert counter.bytes_read < ckpt_bytes / 7  # 1/4 of the weights of half the layers, plus norms
    # Only replicated tensors (norms) are ever read whole.
    assert counter.full_reads and all(name.endswith("norm.weight") for name in counter.full_reads)
    assert all(p.device.type == "cpu" for p in model.parameters())


class OpenFiles:
    """safe_open that counts how many checkpoint handles are open at once."""

    def __init__(self, real):
        self.real, self.open, self.most, self.opened = real, 0, 0, 0

    def __call__(self, *args, **kwargs):
        tracker, handle = self, self.real(*args, **kwargs)

        class Tracked:
            def __enter__(self):
                tracker.open += 1
                tracker.opened += 1
                tracker.most = max(tracker.most, tracker.open)
                return handle.__enter__()

            def __exit__(self, *exc):
                tracker.open -= 1
                return handle.__exit__(*exc)
        return Tracked()


def test_loader_keeps_one_checkpoint_file_mapped_at_a_time(tmp_path, monkeypatch):
    """A safetensors handle maps its whole file and read pages stay in RSS until it
    closes: the loader opens one per tensor, so the mapped pages never add up to
    the checkpoint (scripts/bench.py --only load measures the peak)."""
    path = make_random_checkpoint(tmp_path, num_shards=2, **LLAMA)
    tracker = OpenFiles(loader_module.safe_open)
    monkeypatch.setattr(loader_module, "safe_open", tracker)
    model = load_model(path, SoloGroup(), SoloGroup())
    assert tracker.most == 1 and tracker.open == 0
    assert tracker.opened >= len(list(model.checkpoint_tensors()))
    # A tensor missing mid-load still leaves nothing open.
    monkeypatch.setattr(type(model), "checkpoint_tensors",
                        lambda self: iter([("model.norm.weight", "model.norm.weight", None),
                                           ("model.no_such.weight", "model.norm.weight", None)]))
    with pytest.raises(ConfigError, match="no_such"):
        load_model(path, SoloGroup(), SoloGroup())
    assert tracker.open == 0


def test_sharded_checkpoint_loads_like_single_file(tmp_path):
    single = make_random_checkpoint(tmp_path / "one", **LLAMA)
    sharded = make_random_checkpoint(tmp_path / "three", num_shards=3, **LLAMA)
    assert len(list(sharded.glob("*.safetensors"))) == 3
    for tp_rank in range(2):
        a = load_model(single, ShardOnlyGroup(2, tp_rank), ShardOnlyGroup(2, 1))
        b = load_model(sharded, ShardOnlyGroup(2, tp_rank), ShardOnlyGroup(2, 1))
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_half_precision_checkpoints_are_cast(tmp_path, monkeypatch):
    bf16 = make_random_checkpoint(tmp_path / "bf16", dtype="bfloat16", **LLAMA)
    fp32 = make_random_checkpoint(tmp_path / "fp32", **LLAMA)
    solo = SoloGroup()
    monkeypatch.setenv("SPMD_ENGINE_CPU_BF16", "0")  # auto on a CPU without native bf16: float32
    a = load_model(bf16, solo, solo)
    assert a.dtype == torch.float32
    b = load_model(fp32, solo, solo, dtype="bfloat16")
    assert b.dtype == torch.bfloat16
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k].float()) for k in sa)  # same bf16 rounding either way


# ---------------------------------------------------------------- loader errors

def test_missing_and_bad_config(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_model(tmp_path / "nope", SoloGroup(), SoloGroup())
    with pytest.raises(ConfigError, match="config.json not found"):
        load_model(tmp_path, SoloGroup(), SoloGroup())
    (tmp_path / "config.json").write_text('{\n  "hidden_size": 64,\n  "vocab_size": \n}\n')
    with pytest.raises(ConfigError, match=r"config.json: invalid JSON at line 4"):
        load_model(tmp_path, SoloGroup(), SoloGroup())


def test_unsupported_architecture_names_the_file(tmp_path):
    path = make_random_checkpoint(tmp_path, num_layers=1)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=rf"unsupported architecture FalconForCausalLM in {path}/config.json; "
                                          r"supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
        load_model(path, SoloGroup(), SoloGroup())


def test_missing_tensor_names_tensor_and_file(tmp_path):
    from safetensors.torch import load_file, save_file

    path = make_random_checkpoint(tmp_path, num_layers=2)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ConfigError, match=rf"tensor model.layers.1.mlp.up_proj.weight not found in checkpoint {path}"):
        load_model(path, SoloGroup(), SoloGroup())
    # ...but a stage that does not own layer 1 loads fine
    load_model(path, SoloGroup(), ShardOnlyGroup(2, 0))


def test_wrong_tensor_shape_names_tensor_and_file(tmp_path):
    from safetensors.torch import load_file, save_file

    path = make_random_checkpoint(tmp_path, num_layers=1)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ConfigError, match=r"tensor model.layers.0.self_attn.k_proj.weight: .*shape \[3, 64\].*"
                                          r"model.safetensors"):
        load_model(path, SoloGroup(), SoloGroup())


def test_corrupt_and_missing_safetensors_files(tmp_path):
    path = make_random_checkpoint(tmp_path / "corrupt", num_layers=1)
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    with pytest.raises(ConfigError, match=r"model.safetensors is not a readable safetensors file"):
        load_model(path, SoloGroup(), SoloGroup())
    path = make_random_checkpoint(tmp_path / "truncated", num_layers=1)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match=r"model.safetensors is not a readable safetensors file"):
        load_model(path, SoloGroup(), SoloGroup())
    path = make_random_checkpoint(tmp_path / "sharded", num_layers=2, num_shards=2)
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"checkpoint file .*model-00002-of-00002.safetensors not found"):
        load_model(path, SoloGroup(), SoloGroup())
    path = make_random_checkpoint(tmp_path / "empty", num_layers=1)
    (path / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"no \*.safetensors files in"):
        load_model(path, SoloGroup(), SoloGroup())


# ---------------------------------------------------------------- against transformers (installed by .[test]; required under CI)

@pytest.mark.timeout(60)
@pytest.mark.parametrize("ckpt", ["llama", "qwen_tied"])
def test_logits_match_transformers(checkpoints, ckpt):
    transformers = require_reference("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[ckpt], dtype=torch.float32).eval()
    solo = SoloGroup()
    ours = load_model(checkpoints[ckpt], solo, solo)
    ids = torch.randint(0, 150, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf(ids).logits
        hidden = ours(ids, torch.arange(24).expand(2, 24), None)["hidden_states"]
        got = ours.compute_logits(hidden.reshape(48, -1)).view(2, 24, -1)
        cached = reference_logits(checkpoints[ckpt])  # the KV-cache path, vs HF on each whole sequence
        full = {n: hf(torch.tensor([t])).logits[0] for n, t in _TOKENS.items()}
    diff = (got - expected).abs().max().item()
    print(f"{ckpt}: max |ours - transformers| = {diff:.3g} (logit scale {expected.abs().max().item():.3g})")
    assert diff <= 1e-4 * max(1.0, expected.abs().max().item())
    for step, logits in zip(SCHEDULE, cached):
        row = 0
        for seq, tokens, ctx in step:
            ref = full[SEQ_NAMES[seq]][ctx : ctx + len(tokens)].numpy()
            np.testing.assert_allclose(logits[row : row + len(tokens)], ref, atol=1e-4 * max(1.0, np.abs(ref).max()))
            row += len(tokens)
