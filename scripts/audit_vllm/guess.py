"""The pieces a guess is made of, apart from the prober that runs them: a probe value other than
vLLM's default, defaults and signatures compared with vLLM's, and how run-batch reads a body field."""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from audit_vllm import REQUIRED


def probe_value(row: dict) -> Any:
    """A value other than vLLM's default, valid enough that only a refusal (or an unknown name)
    makes the constructor fail: the opposite bool, the next int, a string, a one-item list."""
    default = ast.literal_eval(row["default"]) if row.get("literal") else None
    annotation = row.get("annotation", "")
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    if isinstance(default, float):
        return 0.5 if default != 0.5 else 0.25
    if isinstance(default, str):
        return "x" if default != "x" else "y"
    for word, value in (("bool", True), ("dict", {"x": 1}), ("list[int]", [1]), ("list", ["x"]), ("float", 0.5),
                        ("int", 3), ("str", "x")):
        if word in annotation:
            return value
    return "x"


@dataclass
class Guess:
    guess: str
    detail: str = ""
    probe: Any = field(default=None)


def names_it(exc: BaseException, name: str) -> bool:
    return name.strip("-").replace("-", "_") in str(exc).replace("-", "_")


def default_matches(recorded: str, literal: bool, ours: Any) -> bool:
    """vLLM's recorded default against our value: equal literals, an enum member by its dotted
    name, else the same repr."""
    if literal:
        try:
            theirs = ast.literal_eval(recorded)
        except ValueError:
            return False
        return type(theirs) is type(ours) and theirs == ours if isinstance(ours, bool) or isinstance(
            theirs, bool) else theirs == ours
    import enum
    if isinstance(ours, enum.Enum):
        return recorded in (f"{type(ours).__name__}.{ours.name}", repr(ours))
    return repr(ours) == recorded


def method_problems(vllm_params: list[dict], sig, is_static_or_bound: bool) -> list[str]:
    """What keeps a call written for vLLM's signature from meaning the same here: a vLLM parameter
    name we do not accept, a positional slot holding another name, another default."""
    params = list(sig.parameters.values())
    if not is_static_or_bound and params and params[0].name in ("self", "cls"):
        params = params[1:]
    ours = {p.name: p for p in params}
    takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in params)
    problems = []
    ours_positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    theirs_positional = [p["name"] for p in vllm_params if p["kind"] in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")]
    for index, name in enumerate(theirs_positional):
        if index >= len(ours_positional) or ours_positional[index] != name:
            problems.append(f"positional {index} is {ours_positional[index] if index < len(ours_positional) else 'none'}"
                            f" here, {name} in vLLM")
            break
    for p in vllm_params:
        if p["kind"].startswith("VAR_"):
            continue
        if p["name"] not in ours:
            if not takes_kwargs:
                problems.append(f"no {p['name']}")
            continue
        mine = ours[p["name"]]
        if p["default"] == REQUIRED:
            continue
        if mine.default is mine.empty:
            problems.append(f"{p['name']} required here")
        elif not default_matches(p["default"], p["literal"], mine.default):
            problems.append(f"{p['name']}={mine.default!r} here, {p['default']} in vLLM")
    return problems


def body_base(is_chat: bool) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}]} if is_chat else {"prompt": "hi"}


def body_default_is_neutral(row: dict, is_chat: bool) -> bool:
    """A body that spells out vLLM's default gets the SamplingParams of one that leaves it out
    (an empty list counts as None: both mean nothing to sample by)."""
    from spmd_engine.run_batch import requests
    if row["default"] == REQUIRED or row["name"] in ("messages", "prompt"):
        return True
    url = requests.CHAT_URL if is_chat else requests.COMPLETIONS_URL

    def params(body: dict):
        line = requests.parse_line(json.dumps({"custom_id": "a", "method": "POST", "url": url, "body": body}), 1)
        if line.error:
            return line.error
        return normalized(vars(requests.sampling_params(line, 2, 64)))
    base = body_base(is_chat)
    return params(base) == params({**base, row["name"]: ast.literal_eval(row["default"])})


def normalized(values: dict) -> dict:
    return {k: (None if v in ([], {}, ()) else v) for k, v in values.items() if not k.startswith("_")}


def field_tables(is_chat: bool) -> tuple[set, set] | None:
    try:
        from spmd_engine.run_batch import fields
    except ImportError:
        return None
    return set(fields.READ[is_chat]), set(fields.ACCEPTED[is_chat])


def run_batch_strings() -> set[str]:
    """The names run_batch's modules look up in a dict (`x.get("name")`, `x["name"]`, `"name" in x`):
    the body fields a checkout without the field tables reads."""
    import spmd_engine.run_batch as pkg
    out = set()
    for path in Path(pkg.__file__).parent.glob("*.py"):
        for n in ast.walk(ast.parse(path.read_text())):
            keys = ([n.args[0]] if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                    and n.func.attr == "get" and n.args else [n.slice] if isinstance(n, ast.Subscript)
                    else [n.left] if isinstance(n, ast.Compare) and isinstance(n.ops[0], ast.In) else [])
            out |= {k.value for k in keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    return out
