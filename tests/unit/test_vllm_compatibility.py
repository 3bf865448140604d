"""docs/vllm-compatibility.md against the code: every vLLM name it lists has one row, and each
verdict holds.

The names are vLLM 0.34's (docs/vllm-0.34-names.json, read from vLLM's source by
scripts/vllm_audit.py, so no vLLM is needed here); the verdicts and their probe values are in
docs/vllm-compatibility-verdicts.json. Checked per row: `same` names exist here with vLLM's default
(methods accept vLLM's parameter names in vLLM's positions, with its defaults; run-batch body
fields are read, and vLLM's default means what leaving them out means); `refused` names raise an
error naming them when set (or do not exist); `ignored` LLM / EngineArgs / body names are
accepted. The last tests feed the checks rows broken on purpose: each must be caught.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
import json
import logging
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SNAPSHOT = json.loads((REPO / "docs" / "vllm-0.34-names.json").read_text())
VERDICTS = json.loads((REPO / "docs" / "vllm-compatibility-verdicts.json").read_text())
PAGE = (REPO / "docs" / "vllm-compatibility.md").read_text()
CLASSES = list(SNAPSHOT["classes"])
REQUIRED = "<required>"
METHOD_KINDS = ("method", "classmethod", "staticmethod", "property")
BODY_CLASSES = {"CompletionRequest": False, "ChatCompletionRequest": True}


@pytest.fixture(autouse=True)
def quiet_engine_logs(caplog):
    """The ignored names' warning, once per probe, says nothing these checks read."""
    caplog.set_level(logging.ERROR, logger="spmd_engine")


def rows_with(cls: str, verdict: str) -> list[dict]:
    return [row for row in SNAPSHOT["classes"][cls] if VERDICTS["classes"][cls][row["name"]]["verdict"] == verdict]


def page_rows() -> dict[str, list[tuple[str, str]]]:
    """(name, verdict) of every table row, per class (each section starts with its marker)."""
    out: dict[str, list[tuple[str, str]]] = {}
    for section in PAGE.split("<!-- class: ")[1:]:
        cls, body = section.split(" -->", 1)
        out[cls] = []
        for line in body.splitlines():
            if line.startswith("| `"):
                cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
                out[cls].append((cells[0].strip("`").replace("\\|", "|"), cells[2]))
    return out


def other_value(row: dict):
    """A value other than vLLM's default (the verdict file's probe, where one is recorded)."""
    default = ast.literal_eval(row["default"]) if row.get("literal") else None
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default + 1
    if isinstance(default, str):
        return default + "x"
    return "x"


def probe_of(cls: str, row: dict):
    verdict = VERDICTS["classes"][cls][row["name"]]
    return verdict["probe"] if "probe" in verdict else other_value(row)


def default_equal(recorded: str, literal: bool, ours) -> bool:
    """vLLM's recorded default (repr text) against ours: equal literals (a bool only equals a bool),
    an enum member by its dotted name."""
    if literal:
        theirs = ast.literal_eval(recorded)
        if isinstance(theirs, bool) or isinstance(ours, bool):
            return type(theirs) is type(ours) and theirs == ours
        return theirs == ours
    if isinstance(ours, enum.Enum):
        return recorded == f"{type(ours).__name__}.{ours.name}"
    return recorded == REQUIRED and ours is REQUIRED


# -- our side of each class ------------------------------------------------------------------

def bundled_model() -> str:
    from spmd_engine.config import ModelConfig
    return ModelConfig().model_dir


def our_class(cls: str):
    import importlib
    if cls == "LLM":
        from spmd_engine.engine.llm import LLM
        return LLM
    if cls == "LLMEngine":
        from spmd_engine.engine.llm_engine import LLMEngine
        return LLMEngine
    if cls == "EngineArgs":
        from spmd_engine.engine.arg_utils import EngineArgs
        return EngineArgs
    if cls == "SamplingParams":
        from spmd_engine.sampling_params import SamplingParams
        return SamplingParams
    if cls in ("RequestOutput", "CompletionOutput"):
        from spmd_engine.engine import outputs
        return getattr(outputs, cls)
    for module in ("spmd_engine", "spmd_engine.sampling_params", "spmd_engine.lora.request"):
        try:
            found = getattr(importlib.import_module(module), cls, None)
        except ImportError:
            continue
        if found is not None:
            return found
    return None


def field_defaults(klass) -> dict:
    if dataclasses.is_dataclass(klass):
        return {f.name: REQUIRED if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                else f.default if f.default is not dataclasses.MISSING else f.default_factory()
                for f in dataclasses.fields(klass)}
    params = inspect.signature(klass).parameters
    return {n: REQUIRED if p.default is p.empty else p.default for n, p in params.items()
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def llm_defaults() -> dict:
    """What LLM(name=...) reaches: its own parameters, then EngineArgs' fields through **kwargs
    (the names vllm_args ignores excepted)."""
    from spmd_engine.engine.vllm_args import IGNORED_VLLM_ARGS
    own = field_defaults(our_class("LLM"))
    passed = {k: v for k, v in field_defaults(our_class("EngineArgs")).items() if k not in IGNORED_VLLM_ARGS}
    return {**passed, **own}


def method_problem(klass, row: dict) -> str | None:
    """None when a call written for vLLM's method means the same here: the method exists, every
    vLLM parameter name binds, vLLM's positional parameters sit at the same positions, defaults equal."""
    name = row["name"].removesuffix("()")
    if not hasattr(klass, name):
        return f"no {name}"
    if row["kind"] == "property":
        return None
    params = list(inspect.signature(getattr(klass, name)).parameters.values())
    if row["kind"] == "method" and params and params[0].name == "self":
        params = params[1:]
    sig = inspect.Signature(params)
    theirs = [p for p in row["params"] if not p["kind"].startswith("VAR_")]
    try:
        sig.bind_partial(**{p["name"]: None for p in theirs})
    except TypeError as exc:
        return str(exc)
    ours_positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    theirs_positional = [p["name"] for p in theirs if p["kind"] != "KEYWORD_ONLY"]
    if ours_positional[:len(theirs_positional)] != theirs_positional:
        return f"positional parameters {ours_positional} here, {theirs_positional} in vLLM"
    ours = {p.name: p for p in params}
    for p in theirs:
        mine = ours.get(p["name"])
        if mine is None or p["default"] == REQUIRED:
            continue
        if mine.default is mine.empty or not default_equal(p["default"], p["literal"], mine.default):
            return f"{p['name']}: default {mine.default!r} here, {p['default']} in vLLM"
    return None


class ParseError(Exception):
    pass


def batch_parser():
    """run_batch's parser, its usage errors raised rather than printed and exited on."""
    from spmd_engine.run_batch.main import build_parser
    parser = build_parser()

    def error(message):
        raise ParseError(message)
    parser.error = error
    return parser


def body_line(is_chat: bool, extra: dict):
    from spmd_engine.run_batch import requests
    body = {"messages": [{"role": "user", "content": "hi"}]} if is_chat else {"prompt": "hi"}
    url = requests.CHAT_URL if is_chat else requests.COMPLETIONS_URL
    line = {"custom_id": "a", "method": "POST", "url": url, "body": {**body, **extra}}
    return requests.parse_line(json.dumps(line), 1)


def body_params(is_chat: bool, extra: dict):
    """The SamplingParams a line's body makes (an empty list counts as None), or its error."""
    from spmd_engine.run_batch import requests
    line = body_line(is_chat, extra)
    if line.error:
        return line.error
    params = vars(requests.sampling_params(line, 2, 64))
    return {k: None if v in ([], {}) else v for k, v in params.items() if not k.startswith("_")}


# -- the checks, one row at a time -------------------------------------------------------------

def same_problem(cls: str, row: dict) -> str | None:
    """Why `row` is not `same` here (None: it is)."""
    name = row["name"]
    if row["kind"] in METHOD_KINDS:
        return method_problem(our_class(cls), row)
    if cls in BODY_CLASSES:
        from spmd_engine.run_batch import fields
        is_chat = BODY_CLASSES[cls]
        if name not in fields.READ[is_chat]:
            return f"{name} is not read by run_batch"
        if row["literal"] and name not in ("prompt", "messages"):
            given, left_out = body_params(is_chat, {name: ast.literal_eval(row["default"])}), body_params(is_chat, {})
            if given != left_out:
                return f"vLLM's default {row['default']} gives {given}, leaving it out {left_out}"
        return None
    if cls == "run-batch flags":
        actions = batch_parser()._option_string_actions
        if name not in actions:
            return f"no {name}"
        if any(actions.get(alias) is not actions[name] for alias in row["aliases"]):
            return f"aliases {row['aliases']} are not all {name}"
        ours = actions[name].default
    else:
        klass = our_class(cls)
        if klass is None:
            return f"no {cls}"
        defaults = llm_defaults() if cls == "LLM" else field_defaults(klass)
        if name not in defaults:
            return f"no {name}"
        ours = defaults[name]
    if not default_equal(row["default"], row["literal"], ours):
        return f"default {ours!r} here, {row['default']} in vLLM"
    return None


def names_it(message: str, name: str) -> bool:
    return name.strip("-").replace("-", "_") in message.replace("-", "_")


def construct(cls: str, name: str, value) -> BaseException | None:
    """The error of setting `name` on `cls`'s constructor (None: accepted). LLM(...) stops where
    the model would load: what it refuses, it refuses before."""
    from spmd_engine.engine.arg_utils import EngineArgs
    klass = our_class(cls)

    class Accepted(Exception):
        pass

    def stop(self, *args, **kwargs):
        raise Accepted

    saved = EngineArgs.create_engine_config
    EngineArgs.create_engine_config = stop
    try:
        if cls == "LLM":
            klass(**{"model": bundled_model(), name: value})
        elif cls == "EngineArgs":
            klass(**{"model": bundled_model(), name: value})
        elif cls == "LoRARequest":
            klass(**{"lora_name": "a", "lora_int_id": 1, "lora_path": "/nonexistent", name: value})
        else:
            klass(**{name: value})
    except Accepted:
        return None
    except Exception as exc:  # noqa: BLE001 (any error counts, if it names the argument)
        return exc
    finally:
        EngineArgs.create_engine_config = saved
    return None


def refused_problem(cls: str, row: dict) -> str | None:
    """Why `row` is not refused with an error naming it (None: it is)."""
    name, value = row["name"], probe_of(cls, row)
    if row["kind"] in METHOD_KINDS:
        klass = our_class(cls)
        return f"{cls}.{name} exists" if hasattr(klass, name.removesuffix("()")) else None
    if cls in BODY_CLASSES:
        line = body_line(BODY_CLASSES[cls], {name: value})
        return None if line.error and names_it(line.error, name) else f"{name}={value!r} gives {line.error!r}"
    if cls == "run-batch flags":
        try:
            batch_parser().parse_args(["-i", "in.jsonl", "-o", "out.jsonl", name, "1"])
        except ParseError as exc:
            return None if names_it(str(exc), name) else f"{name}: {exc}"
        return f"{name} 1 accepted"
    if cls in ("StructuredOutputsParams", "LoRARequest") and our_class(cls) is None:
        return carrier_problem(cls)
    exc = construct(cls, name, value)
    if exc is None:
        return f"{name}={value!r} accepted"
    return None if names_it(str(exc), name) else f"{name}={value!r}: {type(exc).__name__}: {exc} (not naming it)"


def carrier_problem(cls: str) -> str | None:
    """Without the class here, the argument that carries one into a request must be refused."""
    if cls == "StructuredOutputsParams":
        exc = construct("SamplingParams", "structured_outputs", {"json": {}})
        return None if exc is not None and names_it(str(exc), "structured_outputs") else "structured_outputs accepted"
    from spmd_engine.engine.llm_engine import check_request_extras
    try:
        check_request_extras(object(), 0)
    except Exception as exc:  # noqa: BLE001
        return None if names_it(str(exc), "lora_request") else f"lora_request: {exc}"
    return "lora_request accepted"


def ignored_problem(cls: str, row: dict) -> str | None:
    """Why an ignored name is not accepted (None: it is)."""
    name, value = row["name"], probe_of(cls, row)
    if cls in BODY_CLASSES:
        line = body_line(BODY_CLASSES[cls], {name: value})
        return f"{name}={value!r}: {line.error}" if line.error else None
    exc = construct(cls, name, value)
    return None if exc is None else f"{name}={value!r}: {type(exc).__name__}: {exc}"


# -- the page ---------------------------------------------------------------------------------

def test_every_vllm_name_has_one_row_with_one_verdict():
    rows = page_rows()
    assert list(rows) == CLASSES
    for cls in CLASSES:
        names = [name for name, _ in rows[cls]]
        assert names == [r["name"] for r in SNAPSHOT["classes"][cls]], cls
        bad = [(name, verdict) for name, verdict in rows[cls] if verdict not in ("same", "differs", "ignored", "refused")]
        assert not bad, (cls, bad)


def test_the_page_is_the_snapshot_and_verdicts_rendered():
    """The page is regenerated from the two files (never edited by hand), every verdict reviewed."""
    from audit_vllm.page import render_page
    assert render_page(SNAPSHOT, VERDICTS) == PAGE, "run: scripts/vllm_audit.py --write-doc"
    unreviewed = [(c, n) for c, rows in VERDICTS["classes"].items() for n, v in rows.items()
                  if v.get("reviewed") is False]
    assert not unreviewed, unreviewed
    for cls in CLASSES:
        assert set(VERDICTS["classes"][cls]) == {r["name"] for r in SNAPSHOT["classes"][cls]}, cls


def test_rows_marked_bug_are_not_called_same_or_ignored():
    marked = [(c, n, v["verdict"]) for c, rows in VERDICTS["classes"].items() for n, v in rows.items()
              if "BUG" in v["note"]]
    assert all(verdict == "differs" for _, _, verdict in marked), marked


# -- the verdicts against the code ------------------------------------------------------------

@pytest.mark.parametrize("cls", CLASSES)
def test_same_rows_exist_with_vllms_defaults(cls):
    problems = {row["name"]: p for row in rows_with(cls, "same") if (p := same_problem(cls, row))}
    assert not problems, problems


@pytest.mark.parametrize("cls", CLASSES)
def test_refused_rows_raise_an_error_naming_them(cls):
    problems = {row["name"]: p for row in rows_with(cls, "refused") if (p := refused_problem(cls, row))}
    assert not problems, problems


@pytest.mark.parametrize("cls", ["LLM", "EngineArgs", "CompletionRequest", "ChatCompletionRequest"])
def test_ignored_rows_are_accepted(cls):
    problems = {row["name"]: p for row in rows_with(cls, "ignored") if (p := ignored_problem(cls, row))}
    assert not problems, problems


# -- negative controls: rows broken on purpose must be caught --------------------------------

def snapshot_row(cls: str, name: str) -> dict:
    return dict(next(r for r in SNAPSHOT["classes"][cls] if r["name"] == name))


@pytest.mark.parametrize("cls, name, change", [
    ("SamplingParams", "temperature", {"default": "0.0"}),  # another default
    ("EngineArgs", "max_logprobs", {"default": "5"}),
    ("RequestOutput", "metrics", {"default": "0", "literal": True}),
    ("EngineArgs", "quantization", {}),  # a refused name called same: no such field
    ("LLM", "generate()", {}),  # use_tqdm's default differs
    ("LLMEngine", "add_request()", {}),  # session_id missing
    ("run-batch flags", "--seed", {"default": "1"}),
    ("run-batch flags", "--tensor-parallel-size", {"aliases": ["-tp", "-t"]}),
    ("CompletionRequest", "max_tokens", {"default": "7"}),  # vLLM's default no longer means leaving it out
    ("CompletionRequest", "user", {}),  # accepted, but not read
])
def test_same_check_catches_a_broken_row(cls, name, change):
    assert same_problem(cls, {**snapshot_row(cls, name), **change}) is not None


@pytest.mark.parametrize("cls, name", [
    ("EngineArgs", "tensor_parallel_size"), ("EngineArgs", "trust_remote_code"), ("LLM", "seed"),
    ("SamplingParams", "top_k"), ("LLM", "generate()"), ("run-batch flags", "--seed"),
    ("CompletionRequest", "user"), ("ChatCompletionRequest", "top_k"),
])
def test_refused_check_catches_an_accepted_name(cls, name):
    assert refused_problem(cls, snapshot_row(cls, name)) is not None


@pytest.mark.parametrize("cls, name", [("EngineArgs", "quantization"), ("EngineArgs", "master_addr"),
                                       ("LLM", "logits_processors"), ("CompletionRequest", "priority")])
def test_ignored_check_catches_a_refused_name(cls, name):
    assert ignored_problem(cls, snapshot_row(cls, name)) is not None
