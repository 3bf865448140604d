"""LLM.chat (vLLM's signature) and `run --prompts-file` conversations: the prompt is the one
transformers' `apply_chat_template` renders from the checkpoint's files, and the outputs are
those of `generate` on that prompt's token ids (from transformers, not from us)."""

from __future__ import annotations

import json
import sys

import pytest
from chat_checkpoint import CHATML, LLAMA3, TOOLS, make_chat_checkpoint
from conftest import require_reference
from launch import run_checked

from spmd_engine import LLM, SamplingParams
from spmd_engine.config import ConfigError

CONVERSATIONS = [
    [{"role": "user", "content": "Beautiful is better than"}],
    [{"role": "system", "content": "Recite."}, {"role": "user", "content": "Simple is"},
     {"role": "assistant", "content": "better than complex."}, {"role": "user", "content": "Flat is"}],
]
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
CLOCK = {"type": "function", "function": {"name": "now"}}  # a short tool: the model's context is 256 tokens


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    require_reference("tokenizers")
    return make_chat_checkpoint(tmp_path_factory.mktemp("chat"), chat_template=CHATML)


@pytest.fixture(scope="module")
def hf(ckpt):
    return require_reference("transformers").AutoTokenizer.from_pretrained(str(ckpt))


@pytest.fixture(scope="module")
def llm(ckpt):
    with LLM(model=str(ckpt)) as llm:
        yield llm


def hf_prompt(hf, conversation, **kwargs):
    kwargs.setdefault("add_generation_prompt", True)
    return (hf.apply_chat_template(conversation, tokenize=False, **kwargs),
            list(hf.apply_chat_template(conversation, return_dict=False, **kwargs)))


def generated(llm, ids):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": i} for i in ids], PARAMS)]


@pytest.mark.timeout(120)
def test_chat_equals_generate_on_the_rendered_prompt(llm, hf):
    expected = [hf_prompt(hf, c) for c in CONVERSATIONS]
    outs = llm.chat(CONVERSATIONS, PARAMS)
    assert [o.prompt for o in outs] == [text for text, _ in expected]
    assert [o.prompt_token_ids for o in outs] == [ids for _, ids in expected]
    assert [o.outputs[0].token_ids for o in outs] == generated(llm, [ids for _, ids in expected])
    one = llm.chat(CONVERSATIONS[0], PARAMS)  # one conversation, not a list of them
    assert len(one) == 1 and one[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


@pytest.mark.timeout(120)
def test_chat_template_tools_and_continue_final_message(llm, hf):
    tool_talk = CONVERSATIONS[0]
    text, ids = hf_prompt(hf, tool_talk, chat_template=TOOLS, tools=[CLOCK])
    out = llm.chat(tool_talk, PARAMS, chat_template=TOOLS, tools=[CLOCK])[0]
    assert (out.prompt, out.prompt_token_ids) == (text, ids) and '"now"' in text
    partial = CONVERSATIONS[1][:3]
    text, ids = hf_prompt(hf, partial, chat_template=LLAMA3, add_generation_prompt=False,
                          continue_final_message=True)
    out = llm.chat(partial, PARAMS, chat_template=LLAMA3, add_generation_prompt=False, continue_final_message=True)[0]
    assert (out.prompt, out.prompt_token_ids) == (text, ids) and text.endswith("better than complex.")
    assert out.outputs[0].token_ids == generated(llm, [ids])[0]


@pytest.mark.timeout(60)
def test_chat_errors(llm):
    with pytest.raises(ConfigError, match="cannot both be set"):
        llm.chat(CONVERSATIONS[0], PARAMS, continue_final_message=True)
    with pytest.raises(TypeError, match="lora_request must be a LoRARequest or None, got object"):
        llm.chat(CONVERSATIONS[0], PARAMS, lora_request=object())
    from spmd_engine import LoRARequest
    with pytest.raises(ValueError, match="LoRA is not enabled: start the engine with enable_lora=True"):
        llm.chat(CONVERSATIONS[0], PARAMS, lora_request=LoRARequest("a", 1, "/nowhere"))


def run_cli(*args):
    return run_checked([sys.executable, "-m", "spmd_engine.run", *map(str, args), "--quiet"], "chat-cli", 120)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_run_prompts_file_with_messages(ckpt, hf, tmp_path):
    prompts = tmp_path / "chat.jsonl"
    prompts.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS)
                       + json.dumps({"prompt": "Now is"}) + "\n")
    template = tmp_path / "llama3.jinja"
    template.write_text(LLAMA3)
    flags = ["--model", ckpt, "--prompts-file", prompts, "--max-tokens", 6, "--max-model-len", 128]
    for extra, source in (([], None), (["--chat-template", template], LLAMA3)):
        out = tmp_path / f"out{len(extra)}.jsonl"
        proc = run_cli(*flags, *extra, "--output", out)
        assert proc.returncode == 0, proc.stderr
        records = [json.loads(line) for line in out.read_text().splitlines()]
        expected = [hf_prompt(hf, c, chat_template=source) for c in CONVERSATIONS]
        assert [(r["prompt"], r["prompt_token_ids"]) for r in records[:2]] == expected
        assert records[2]["prompt"] == "Now is"  # plain prompts beside conversations
    no_template = make_chat_checkpoint(tmp_path / "plain")  # tokenizer files, no template
    proc = run_cli("--model", no_template, "--prompts-file", prompts, "--max-tokens", 4)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("error: no chat template:") and "--chat-template FILE" in proc.stderr
