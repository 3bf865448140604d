"""Constraints the structured-output tests sample under, each with an independent check of its
outputs (jsonschema, Python's re, set membership), and a switch that turns the mask off (the
negative control: the same requests must then be seen to break their constraint)."""

from __future__ import annotations

import json
import re
from contextlib import contextmanager

from spmd_engine import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["alpha", "beta", "gamma"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["x", "yy", "zzz"]}, "minItems": 1, "maxItems": 3},
        "inner": {"type": "object", "properties": {"level": {"type": "integer", "minimum": 0, "maximum": 9},
                                                   "kind": {"enum": ["a", "b"]}},
                  "required": ["level", "kind"], "additionalProperties": False},
    },
    "required": ["name", "ok", "tags", "inner"],
    "additionalProperties": False,
}
DATE = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
EMAIL = r"[a-z]{1,8}@[a-z]{1,8}\.(com|org|net)"
CHOICES = ["better", "worse", "ugly", "flat", "nested"]
# A small bounded arithmetic grammar, and the regex that recognises exactly its sentences.
EBNF = r'''root ::= expr
expr ::= term (op term){0,2}
op ::= "+" | "-" | "*"
term ::= num | "(" num op num ")"
num ::= [1-9] [0-9]{0,2}'''
EBNF_RE = r"(N|\(NON\))(O(N|\(NON\))){0,2}".replace("N", r"[1-9][0-9]{0,2}").replace("O", r"[+\-*]")


def _json_ok(text: str, schema: dict | None) -> bool:
    import jsonschema
    try:
        value = json.loads(text)
    except ValueError:
        return False
    if schema is None:
        return isinstance(value, dict)
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    return True


# name -> (StructuredOutputsParams fields, check(text) -> bool)
CONSTRAINTS = {
    "json": ({"json": SCHEMA, "disable_any_whitespace": True}, lambda t: _json_ok(t, SCHEMA)),
    "json_object": ({"json_object": True, "disable_any_whitespace": True}, lambda t: _json_ok(t, None)),
    "date": ({"regex": DATE}, lambda t: re.fullmatch(DATE, t) is not None),
    "email": ({"regex": EMAIL}, lambda t: re.fullmatch(EMAIL, t) is not None),
    "choice": ({"choice": CHOICES}, lambda t: t in CHOICES),
    "grammar": ({"grammar": EBNF}, lambda t: re.fullmatch(EBNF_RE, t) is not None),
}


def closing_bias(tokenizer, vocab_size: int) -> dict[int, float]:
    """logit_bias toward ids whose bytes hold a quote (strongly: strings end) or a closing brace:
    a free-form JSON object from a model that never saw JSON then closes within a few dozen
    tokens (the bias shortens the samples; only the mask makes them valid)."""
    from spmd_engine.model.token_bytes import token_bytes
    out = {}
    for i, b in enumerate(token_bytes(tokenizer, vocab_size)):
        if b is not None and (b'"' in b or b"}" in b):
            out[i] = 10.0 if b'"' in b else 6.0
    return out


@contextmanager
def mask_off():
    """Every engine in this process ships no grammar rows: the negative control."""
    from spmd_engine.engine.structured.manager import StructuredOutputManager
    original = StructuredOutputManager.bitmask
    StructuredOutputManager.bitmask = lambda self, out, requests: None
    try:
        yield
    finally:
        StructuredOutputManager.bitmask = original


def structured_params(name: str, seed: int, bias: dict | None = None, **kw) -> SamplingParams:
    fields, _ = CONSTRAINTS[name]
    extra = {"logit_bias": bias} if name == "json_object" else {}
    return SamplingParams(temperature=1.0, max_tokens=300, seed=seed, structured_outputs=dict(fields), **extra, **kw)


def check_samples(llm, model_dir, prompt: str, count: int, names=tuple(CONSTRAINTS)) -> None:
    """`count` seeded samples per constraint all pass its check; `count // 4` with the mask
    off do not all pass (the negative control)."""
    bias = closing_bias(_tokenizer(model_dir), llm.llm_engine.inputs.vocab_size)
    for name in names:
        check = CONSTRAINTS[name][1]
        params = [structured_params(name, seed, bias) for seed in range(count)]
        texts = [o.outputs[0].text for o in llm.generate([prompt] * count, params)]
        bad = [t for t in texts if not check(t)]
        assert not bad, (name, bad[:3])
        with mask_off():
            free = [o.outputs[0].text for o in llm.generate([prompt] * (count // 4), params[:count // 4])]
        assert not all(check(t) for t in free), (name, "the check passes without the mask", free[:3])


def _tokenizer(model_dir):
    from spmd_engine.model.tokenizer import load_tokenizer
    return load_tokenizer(model_dir)
