"""Five real clients of vLLM replayed call for call against this engine
(tests/helpers/dist_scripts/vllm_clients.py says what each one calls, from which source file):
torchtitan's RL generator, verl's last SPMD rollout, ms-swift's GRPO colocate mode and its
torchrun batch inference, lm-evaluation-harness's vLLM backend, AgileRL's LoRA colocate mode
(checked against PEFT on each step's adapter).

Each client runs once in this process on the uni executor and once under torchrun with two
ranks (external_launcher, gloo): one launch runs all six in turn and every test reads its
client's REPORT lines. The references: a fresh engine on the pushed checkpoint for the RL
clients (the tokens of each step come from the weights pushed for it, and differ from the
weights before), a plain `generate` with the replica's seed for ms-swift's batch inference,
and Hugging Face transformers for lm-evaluation-harness's loglikelihoods and greedy texts.
A call a client makes that the engine lacks is a gap, listed by the last test.

Negative controls seen failing: with VLLM_CLIENTS_BREAK=torchtitan,verl,swift_grpo (the rank
script then skips those clients' weight pushes) their uni and torchrun tests fail, since the
tokens come from the old (or dummy) weights; the lm-eval comparison fails against a reference
that skips the stop strings or mixes up the requests (test_the_lm_eval_references_can_fail);
ms-swift's per-replica seed is checked against the other replica's seed.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import sys

import pytest
import torch
from conftest import require_reference
from engine_helpers import make_tiny_checkpoint
from launch import REPO, run_torchrun
from safetensors.torch import load_file, save_file
from zen import zen

from spmd_engine import LLM, SamplingParams

SCRIPT = REPO / "tests" / "helpers" / "dist_scripts" / "vllm_clients.py"
PROMPTS = [[40, 41, 42, 43, 44, 45], [60, 61, 62], [80, 81, 82, 83, 84, 85, 86, 87], [100, 101, 102, 103]]
EOS = 1  # the tokenizer's "</s>"
ZEN = ["Beautiful is better than", "Explicit is better than", "Simple is better than complex.",
       "Flat is better", "Readability counts.", "Errors should never"]
CONTINUATIONS = [" ugly.", " implicit.", " Complex is", " than nested.", " Special cases", " pass silently."]
MAX_GEN = 8


def clients_module():
    """The rank script, imported once (its replays run here too, on the uni executor)."""
    if "vllm_clients" not in sys.modules:
        spec = importlib.util.spec_from_file_location("vllm_clients", SCRIPT)
        module = sys.modules["vllm_clients"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["vllm_clients"]


def make_text_checkpoint(path) -> str:
    """A tiny random Llama whose every token is text: a byte-level BPE trained on the Zen of
    Python with no alphabet beyond the text's own characters (no token is a stray byte of a
    multi-byte character, so any generated sequence decodes the same incrementally and at
    once), and exactly as many rows in the model as the tokenizer has tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(zen().splitlines() * 4, trainers.BpeTrainer(vocab_size=200, special_tokens=["<s>", "</s>"],
                                                                        show_progress=False))
    make_tiny_checkpoint(path, seed=5, vocab_size=tok.get_vocab_size())
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "</s>"}))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "bos_token_id": 0, "eos_token_id": EOS}))
    return path


@torch.inference_mode()
def hf_references(path, tokenizer) -> tuple[dict, dict]:
    """lm-evaluation-harness's requests, tokenized as it does, and transformers' answers:
    the loglikelihood and greedy flag of each continuation, and each context's greedy text cut
    at its stop strings (chosen inside that text, so the engine must stop there)."""
    transformers = require_reference("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()

    def encode(text):
        return tokenizer(text).input_ids

    loglikelihood, ll_ref = [], []
    for context, continuation in zip(ZEN, CONTINUATIONS):  # TemplateLM._encode_pair
        whole, context_enc = encode(context + continuation), encode(context)
        continuation_enc = whole[len(context_enc):]
        loglikelihood.append([context_enc, continuation_enc])
        ids = torch.tensor([context_enc + continuation_enc])
        logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        rows = logprobs[len(context_enc) - 1:-1]
        ll_ref.append([float(rows[range(len(continuation_enc)), continuation_enc].sum()),
                       bool((rows.argmax(-1) == torch.tensor(continuation_enc)).all())])
    generate, texts, uncut = [], [], []
    for k, context in enumerate(ZEN):
        ids = encode(context)
        generated = []
        for _ in range(MAX_GEN):
            token = int(model(torch.tensor([ids + generated])).logits[0, -1].argmax())
            generated.append(token)
            if token == EOS:
                break
        full = tokenizer.decode(generated, skip_special_tokens=False)
        # Even requests stop on a string inside the greedy text; odd ones run to their length.
        stop = next((s for n in range(2, len(generated)) for s in [tokenizer.decode(generated[n:n + 1])]
                     if s.strip() and full.find(s) > 0), None) if k % 2 == 0 else None
        until = [stop] if stop else ["\n\n\n"]
        text = full
        for term in until + [tokenizer.decode([EOS])]:
            text = text.split(term)[0]
        generate.append({"context": context, "context_ids": ids, "until": until, "max_gen_toks": MAX_GEN})
        texts.append(text)
        uncut.append(full)
    requests = {"loglikelihood": loglikelihood, "generate": generate, "eos": tokenizer.decode([EOS])}
    return requests, {"loglikelihood": ll_ref, "generate_until": texts, "uncut": uncut}


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    """The checkpoints (a tiny Llama with real tokenizer files, and two training steps with
    every tensor perturbed), the clients' inputs, and transformers' answers."""
    transformers = require_reference("transformers")
    root = tmp_path_factory.mktemp("vllm_clients")
    orig = make_text_checkpoint(root / "orig")
    steps, weights = [], load_file(orig / "model.safetensors")
    for step in (1, 2):
        out = root / f"step{step}"
        shutil.copytree(orig, out)
        g = torch.Generator().manual_seed(step)
        weights = {n: t + 0.5 * t.float().std() * torch.randn(t.shape, generator=g) for n, t in weights.items()}
        save_file(weights, out / "model.safetensors")
        steps.append(str(out))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(orig))
    lm_requests, hf = hf_references(orig, tokenizer)
    stop_words = ["\n\n", "</s>"]
    cfg = {"orig": str(orig), "steps": steps, "prompts": PROMPTS, "stop_token_id": EOS, "out_dir": str(root),
           "swift_stop": {"template_words": ["</s>"],
                          "encoded": {w: tokenizer.encode(w, add_special_tokens=False) for w in stop_words}},
           "lm_eval": lm_requests}
    path = root / "config.json"
    path.write_text(json.dumps(cfg))
    return {"cfg": cfg, "path": str(path), "hf": hf}


@pytest.fixture(scope="module")
def torchrun_reports(setup) -> dict:
    """All six clients in one torchrun launch of two ranks: {(client, rank): report}."""
    launch = run_torchrun(2, [str(SCRIPT), setup["path"]], timeout=560)
    assert launch.returncode == 0 and not launch.timed_out, launch.describe()
    assert not launch.leftover_pids and not launch.stale_segments(), launch.describe()
    reports = {}
    for line in launch.stdout.splitlines():  # a replay that raised is reported by its test
        if line.startswith("REPORT "):
            report = json.loads(line[len("REPORT "):])
            reports[(report["client"], report["rank"])] = report
    assert sorted(reports) == sorted((c, r) for c in clients_module().CLIENTS for r in (0, 1)), launch.describe()
    return reports


def uni_report(setup, client: str) -> dict:
    return clients_module().run_client(client, setup["cfg"], "uni")


def completed(report: dict) -> dict:
    """The report of a replay that ran to its end (else the error it raised)."""
    assert "error" not in report, f"{report['client']} rank {report['rank']} raised:\n{report['error']}"
    return report


def tokens(completions) -> list:
    return [c["tokens"] for c in completions]


def check_sampled_logprobs(completions, max_tokens: int) -> None:
    """logprobs=0: one entry per position, the sampled token's, a finite log-probability."""
    for c in completions:
        assert 1 <= len(c["tokens"]) <= max_tokens
        assert c["entries"] == [1] * len(c["tokens"])
        assert all(math.isfinite(lp) and lp <= 0 for lp in c["logprobs"])


# ---- torchtitan -------------------------------------------------------------------------------

def check_torchtitan(report: dict) -> None:
    completed(report)
    first, second = report["first"], report["second"]
    assert None not in first and None not in second, "a request never finished"
    assert report["outputs_per_request"] == [1]  # FINAL_ONLY: each request's output comes once
    assert report["decisions"] > 5  # bursts of two steps: rank 0 decided (and broadcast) many times
    check_sampled_logprobs(first + second, 6)
    assert tokens(first) == tokens(report["fresh_orig"])  # a plain generate with the same seeds
    for ours, ref in zip(first, report["fresh_orig"]):
        assert ours["logprobs"] == pytest.approx(ref["logprobs"], abs=1e-4)
    assert tokens(second) == tokens(report["fresh_step"]), "tokens after the pull are not the pushed weights'"
    assert tokens(second) != tokens(first), "the pull changed nothing"
    assert tokens(first)[0] != tokens(first)[1] or tokens(first)[2] != tokens(first)[3]  # per-sample seeds
    assert not report["world_left_after_drop"]


@pytest.mark.timeout(180)
def test_torchtitan_generator_uni(setup):
    check_torchtitan(uni_report(setup, "torchtitan"))


@pytest.mark.slow  # one torchrun launch of all six clients
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_torchtitan_generator_torchrun_tp2(torchrun_reports):
    reports = [torchrun_reports[("torchtitan", r)] for r in (0, 1)]
    for report in reports:
        check_torchtitan(report)
    assert reports[0]["first"] == reports[1]["first"] and reports[0]["second"] == reports[1]["second"]


# ---- verl -------------------------------------------------------------------------------------

def check_verl(report: dict) -> None:
    completed(report)
    rollouts, fresh = report["rollouts"], report["fresh"]
    assert len(rollouts) == 3  # two training steps, then the greedy validation pass
    for k, (ours, ref) in enumerate(zip(rollouts, fresh)):
        assert tokens(ours) == tokens(ref), f"call {k}: not the tokens of the weights pushed for it"
        check_sampled_logprobs(ours, 6)
    assert tokens(rollouts[0]) != tokens(report["dummy"]), "the rollout kept the dummy weights"
    assert tokens(rollouts[1]) != tokens(rollouts[0])
    assert report["asleep_at_end"]


@pytest.mark.timeout(180)
def test_verl_spmd_rollout_uni(setup):
    check_verl(uni_report(setup, "verl"))


@pytest.mark.slow  # one torchrun launch of all six clients
@pytest.mark.timeout(600)
def test_verl_spmd_rollout_torchrun_tp2(torchrun_reports):
    reports = [torchrun_reports[("verl", r)] for r in (0, 1)]
    for report in reports:
        check_verl(report)
    assert reports[0]["rollouts"] == reports[1]["rollouts"]  # one TP group: the same batch on both ranks


# ---- ms-swift GRPO colocate -----------------------------------------------------------------

def check_swift_grpo(report: dict, steps: list[str], orig: str) -> None:
    completed(report)
    assert len(report["steps"]) == len(steps)
    for k, (ours, path) in enumerate(zip(report["steps"], steps)):
        assert tokens(ours) == tokens(report["fresh"][path][k]), f"step {k}: not the pushed weights' tokens"
        assert tokens(ours) != tokens(report["fresh"][orig][k]), f"step {k} generated from the original weights"
        check_sampled_logprobs(ours, 6)
        for c in ours:
            assert c["finish_reason"] in ("length", "stop") and "\n\n" not in c["text"]


@pytest.mark.timeout(180)
def test_swift_grpo_colocate_uni(setup):
    report = uni_report(setup, "swift_grpo")
    check_swift_grpo(report, setup["cfg"]["steps"], setup["cfg"]["orig"])
    assert not report["seeded"]  # TP 1: no per-request seeds, the engine's seed stream


@pytest.mark.slow  # one torchrun launch of all six clients
@pytest.mark.timeout(600)
def test_swift_grpo_colocate_torchrun_tp2(torchrun_reports, setup):
    reports = [torchrun_reports[("swift_grpo", r)] for r in (0, 1)]
    for report in reports:
        check_swift_grpo(report, setup["cfg"]["steps"], setup["cfg"]["orig"])
        assert report["seeded"]
    assert tokens(reports[0]["steps"][0]) != tokens(reports[1]["steps"][0])  # each rank keeps its own slice


# ---- ms-swift batch inference ---------------------------------------------------------------

def plain_generate(setup, prompts: list[list[int]], seed: int) -> list[list[int]]:
    """What ms-swift's requests ask for (the generation config's sampling values, its template's
    stop word), through LLM.generate on an engine with that seed."""
    encoded = setup["cfg"]["swift_stop"]["encoded"]["</s>"]
    params = SamplingParams(max_tokens=6, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                            stop=["</s>"], stop_token_ids=encoded)
    with LLM(model=setup["cfg"]["orig"], seed=seed, dtype="float32") as llm:
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


@pytest.mark.timeout(180)
def test_swift_batch_infer_uni(setup):
    report = completed(uni_report(setup, "swift_infer"))
    assert report["seed"] == 42 and report["shard"] == PROMPTS
    assert tokens(report["written"]) == plain_generate(setup, PROMPTS, 42)


@pytest.mark.slow  # one torchrun launch of all six clients
@pytest.mark.timeout(600)
def test_swift_batch_infer_torchrun_two_replicas(torchrun_reports, setup):
    """Seed 42 + rank on each replica, the prompts split in two halves in order, every result
    gathered and written by rank 0."""
    r0, r1 = (completed(torchrun_reports[("swift_infer", r)]) for r in (0, 1))
    assert (r0["seed"], r1["seed"]) == (42, 43)
    assert (r0["shard"], r1["shard"]) == (PROMPTS[:2], PROMPTS[2:])
    assert r1["written"] is None
    expected = plain_generate(setup, PROMPTS[:2], 42) + plain_generate(setup, PROMPTS[2:], 43)
    assert tokens(r0["written"]) == expected
    assert expected[:2] != plain_generate(setup, PROMPTS[:2], 43)  # the seed of the replica mattered


# ---- lm-evaluation-harness -------------------------------------------------------------------

def check_lm_eval(report: dict, hf: dict) -> None:
    completed(report)
    assert report["max_length"] == 256  # the checkpoint's max_position_embeddings
    for k, ((ours, greedy), (ref, ref_greedy)) in enumerate(zip(report["loglikelihood"], hf["loglikelihood"],
                                                                   strict=True)):
        assert ours == pytest.approx(ref, abs=1e-3), f"request {k}"
        assert greedy == ref_greedy, f"request {k}"
    assert report["generate_until"] == hf["generate_until"]


@pytest.fixture(scope="module")
def lm_eval_uni(setup) -> dict:
    return uni_report(setup, "lm_eval")


@pytest.mark.timeout(180)
def test_lm_eval_vllm_backend_uni(setup, lm_eval_uni):
    check_lm_eval(lm_eval_uni, setup["hf"])


@pytest.mark.slow  # one torchrun launch of all six clients
@pytest.mark.timeout(600)
def test_lm_eval_vllm_backend_torchrun_dp2(torchrun_reports, setup):
    for rank in (0, 1):
        check_lm_eval(torchrun_reports[("lm_eval", rank)], setup["hf"])


@pytest.mark.timeout(180)
def test_the_lm_eval_references_can_fail(setup, lm_eval_uni):
    """The stop strings really cut the greedy texts, and the comparison fails against a
    reference that skips them, or whose loglikelihoods belong to other requests."""
    hf = setup["hf"]
    assert sum(cut != full for cut, full in zip(hf["generate_until"], hf["uncut"])) >= 2
    with pytest.raises(AssertionError):
        check_lm_eval(lm_eval_uni, {**hf, "generate_until": hf["uncut"]})
    with pytest.raises(AssertionError):
        check_lm_eval(lm_eval_uni, {**hf, "loglikelihood": hf["loglikelihood"][1:] + hf["loglikelihood"][:1]})


# ---- what the clients call that the engine lacks -----------------------------------------------

# The one call a client makes that the engine answers differently, documented in
# docs/vllm-compatibility.md: the CPU engine packs its linear weights (VNNI / oneDNN layouts), so a
# ---- AgileRL LoRA colocate ------------------------------------------------------------------

def check_agilerl(report: dict, orig: str) -> None:
    """Every step's sampled tokens have PEFT's logprobs under that step's adapter (the one the
    replay saved and pushed in place). Control seen failing: VLLM_CLIENTS_BREAK=agilerl (no in-place push after the first step)."""
    from lora_helpers import peft_model, reference_logprobs
    require_reference("peft")
    completed(report)
    assert len(report["steps"]) == 3
    for k, step in enumerate(report["steps"]):
        model = peft_model(orig, step["adapter"])
        for sample in step["samples"]:
            assert 1 <= len(sample["tokens"]) <= 6  # sampled: an EOS may end it early
            want = reference_logprobs(model, sample["prompt"], sample["tokens"])
            worst = max(abs(a - b) for a, b in zip(sample["logprobs"], want))
            assert worst < 1e-4, f"step {k}: the engine did not run that step's adapter ({worst})"


@pytest.mark.timeout(240)
def test_agilerl_lora_colocate_uni(setup):
    check_agilerl(uni_report(setup, "agilerl"), setup["cfg"]["orig"])


@pytest.mark.slow  # one torchrun launch of all six clients
@pytest.mark.timeout(600)
def test_agilerl_lora_colocate_torchrun_tp2(torchrun_reports, setup):
    reports = [torchrun_reports[("agilerl", r)] for r in (0, 1)]
    for report in reports:
        check_agilerl(report, setup["cfg"]["orig"])
    assert [s["samples"] for s in reports[0]["steps"]] == [s["samples"] for s in reports[1]["steps"]]


# state dict read from the model holds packed tensors a trainer's dense ones cannot be copied into;
# the replay then pushes the same weights by HF name through load_weights, torchtitan's other route.
KNOWN_GAPS = {"torchtitan": ["get_model().state_dict() filled in place + load_state_dict(strict=False)"]}


@pytest.mark.slow  # one torchrun launch of all six clients
@pytest.mark.timeout(600)
def test_every_client_call_exists_but_the_documented_one(torchrun_reports):
    """A new gap fails here, and so does the documented one closing (then drop it from the list
    and from the page)."""
    for (client, _), report in torchrun_reports.items():
        calls = [gap.split(": ")[0] for gap in completed(report)["gaps"]]
        assert calls == KNOWN_GAPS.get(client, []), (client, completed(report)["gaps"])
