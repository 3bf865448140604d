"""A tiny random checkpoint with real tokenizer files: a byte-level BPE `tokenizer.json`
(trained here on the Zen text, so merges are real) and a `tokenizer_config.json` with
special tokens and, optionally, a chat template. Both we and transformers read these
same files, so chat prompts can be compared token for token. Also the chat templates the
tests render, written here in the styles checkpoints use."""

from __future__ import annotations

import json
from pathlib import Path

from engine_helpers import make_tiny_checkpoint
from zen import zen

SPECIAL = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
           "<|end_header_id|>", "<|eot_id|>", "<tool_call>", "</tool_call>"]
VOCAB_SIZE = 300  # the tiny checkpoint's

CHATML = ("{% for message in messages %}"
          "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
          "{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# Whitespace control by trim_blocks / lstrip_blocks (block lines leave no newline or indent),
# a default system prompt, `| trim`, bos_token from tokenizer_config.json.
LLAMA3 = """{{ bos_token }}
{% if messages[0]['role'] == 'system' %}
    {% set system = messages[0]['content'] %}
    {% set messages = messages[1:] %}
{% else %}
    {% set system = 'Be brief.' %}
{% endif %}
<|start_header_id|>system<|end_header_id|>\n\n{{ system }}<|eot_id|>
{% for message in messages %}
    <|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>
{% endfor %}
{% if add_generation_prompt %}
<|start_header_id|>assistant<|end_header_id|>\n\n
{% endif %}"""

# Roles must alternate (raise_exception), a generation prompt or an EOS after the last answer,
# loop controls.
ALTERNATING = """{% set offset = 1 if messages[0]['role'] == 'system' else 0 %}
{% for message in messages %}
{% if message['role'] == 'system' %}{{ message['content'] }}\n\n{% continue %}{% endif %}
{% if (message['role'] == 'user') != ((loop.index0 - offset) % 2 == 0) %}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{% endif %}
{% if message['role'] == 'user' %}### User: {{ message['content'] }}\n{% else %}### Assistant: {{ message['content'] }}{{ eos_token }}\n{% endif %}
{% endfor %}
{% if add_generation_prompt %}### Assistant:{% elif messages[-1]['role'] == 'user' %}{{ eos_token }}{% endif %}"""

# Tools as JSON (tojson must not HTML-escape), tool calls in an assistant message, tool results.
TOOLS = """{% if tools %}<|im_start|>system
You may call these tools:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{% for message in messages %}
<|im_start|>{{ message.role }}
{% if message.tool_calls is defined %}
{% for call in message.tool_calls %}<tool_call>{{ call.function | tojson }}</tool_call>{% endfor %}
{% else %}{{ message.content }}{% endif %}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather <now> at a place, in °C",
    "parameters": {"type": "object", "properties": {"place": {"type": "string"}}, "required": ["place"]}}}


def write_tokenizer(path: Path, chat_template: str | None = None) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE - 4, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(zen().splitlines() * 4, trainer)
    assert tok.get_vocab_size() <= VOCAB_SIZE
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
              "eos_token": {"__type": "AddedToken", "content": "</s>", "lstrip": False,
                                                      "normalized": False, "rstrip": False, "single_word": False,
                                                      "special": True}, "pad_token": "</s>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def make_chat_checkpoint(path: Path, chat_template: str | None = None, seed: int = 3) -> Path:
    ckpt = make_tiny_checkpoint(path, seed=seed)
    write_tokenizer(ckpt, chat_template)
    return ckpt
