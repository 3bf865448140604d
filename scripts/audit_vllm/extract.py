"""vLLM's audited names, class by class (constructor parameters, dataclass fields, public methods,
run-batch flags), into the snapshot CI reads instead of vLLM."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

from audit_vllm.source import Default, SourceTree, class_field, evaluate


def entry(name: str, kind: str, default: Default | None = None, **extra: Any) -> dict:
    row = {"name": name, "kind": kind}
    if default is not None:
        row.update(default=default.text, literal=default.literal)
    row.update(extra)
    return row


def audited_class(tree: SourceTree, module: str, cls_name: str) -> tuple[str, ast.ClassDef]:
    """(defining module, class) of a class the audit reads; a vLLM that moved it stops the run."""
    found = tree.find_class(module, cls_name)
    if found is None:
        raise SystemExit(f"vllm_audit: class {cls_name} not found from {module}")
    return found


def dataclass_fields(tree: SourceTree, module: str, cls_name: str, kind: str = "field") -> list[dict]:
    """Public annotated fields of a dataclass / msgspec Struct / pydantic model, with defaults
    (own fields after the bases', as dataclasses order them)."""
    mod, cls = audited_class(tree, module, cls_name)
    rows: dict[str, dict] = {}
    for base in cls.bases:
        if isinstance(base, ast.Name) and tree.find_class(mod, base.id):
            for row in dataclass_fields(tree, mod, base.id, kind):
                rows[row["name"]] = row
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        name, annotation = node.target.id, ast.unparse(node.annotation)
        if name.startswith("_") or annotation.startswith(("ClassVar", "typing.ClassVar")):
            continue
        if isinstance(node.value, ast.Call) and any(k.arg == "init" and isinstance(k.value, ast.Constant)
                                                    and k.value.value is False for k in node.value.keywords):
            continue
        rows[name] = entry(name, kind, evaluate(tree, mod, node.value), annotation=annotation)
    return list(rows.values())


def _decorators(fn: ast.FunctionDef) -> set[str]:
    return {ast.unparse(d).split("(")[0].split(".")[-1] for d in fn.decorator_list}


def signature_of(tree: SourceTree, module: str, fn: ast.FunctionDef, drop_first: bool) -> list[dict]:
    """A def's parameters: name, kind (inspect's names) and default."""
    a = fn.args
    positional = [(p, "POSITIONAL_ONLY") for p in a.posonlyargs] + [(p, "POSITIONAL_OR_KEYWORD") for p in a.args]
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    params = [(p, kind, d) for (p, kind), d in zip(positional, defaults)]
    if a.vararg:
        params.append((a.vararg, "VAR_POSITIONAL", None))
    params += [(p, "KEYWORD_ONLY", d) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        params.append((a.kwarg, "VAR_KEYWORD", None))
    if drop_first and params and params[0][1] != "VAR_POSITIONAL":
        params = params[1:]
    out = []
    for p, kind, d in params:
        default = None if kind.startswith("VAR_") else evaluate(tree, module, d)
        out.append({"name": p.arg, "kind": kind, **({"default": default.text, "literal": default.literal}
                                                     if default else {})})
    return out


def public_methods(tree: SourceTree, module: str, cls_name: str, with_bases: bool = True) -> list[dict]:
    """Public defs of a class and (first definition winning, as the MRO would) of its vLLM bases;
    an @overload stub gives way to the implementation."""
    mod, cls = audited_class(tree, module, cls_name)
    rows: dict[str, dict] = {}
    for node in cls.body:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        decorators = _decorators(node)
        if "overload" in decorators:
            continue
        kind = ("property" if decorators & {"property", "cached_property"} else
                "staticmethod" if "staticmethod" in decorators else
                "classmethod" if "classmethod" in decorators else "method")
        key = node.name if kind == "property" else f"{node.name}()"
        row = {"name": key, "kind": kind}
        if kind != "property":
            row["params"] = signature_of(tree, mod, node, drop_first=kind != "staticmethod")
        rows.setdefault(key, row)
    if with_bases:
        for base in cls.bases:
            if isinstance(base, ast.Name) and tree.find_class(mod, base.id):
                for row in public_methods(tree, mod, base.id):
                    rows.setdefault(row["name"], row)
    return list(rows.values())


def init_params(tree: SourceTree, module: str, cls_name: str) -> list[dict]:
    """The parameters of `cls.__init__` (not *args / **kwargs) as rows."""
    mod, cls = tree.find_class(module, cls_name)
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return [entry(p["name"], "parameter", Default(p["default"], p["literal"]), param_kind=p["kind"])
            for p in signature_of(tree, mod, init, drop_first=True) if not p["kind"].startswith("VAR_")]


def engine_cli_flags(tree: SourceTree, module: str, cls_name: str) -> list[dict]:
    """The flags `cls.add_cli_args` registers: each add_argument call's option strings, and its
    default (an explicit default=, or the config field its `**x_kwargs["name"]` stands for)."""
    mod, cls = tree.find_class(module, cls_name)
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "add_cli_args")
    kwargs_of: dict[str, str] = {}  # model_kwargs -> ModelConfig
    for node in ast.walk(fn):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and getattr(node.value.func, "id", "") == "get_kwargs" and node.value.args
                and isinstance(node.value.args[0], ast.Name) and isinstance(node.targets[0], ast.Name)):
            kwargs_of[node.targets[0].id] = node.value.args[0].id
    calls = sorted((n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                    and n.func.attr == "add_argument"), key=lambda n: (n.lineno, n.col_offset))
    rows = []
    for call in calls:
        options = [a.value for a in call.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")]
        longs = [o for o in options if o.startswith("--")]
        if not longs:
            continue
        rows.append(entry(longs[0], "flag", _flag_default(tree, mod, call, kwargs_of),
                          aliases=[o for o in options if o != longs[0]]))
    return rows


def _flag_default(tree: SourceTree, module: str, call: ast.Call, kwargs_of: dict[str, str]) -> Default:
    for kw in call.keywords:
        if kw.arg == "default":
            return evaluate(tree, module, kw.value)
    for kw in call.keywords:
        value = kw.value
        if (kw.arg is None and isinstance(value, ast.Subscript) and isinstance(value.value, ast.Name)
                and value.value.id in kwargs_of and isinstance(value.slice, ast.Constant)):
            found = tree.find_class(module, kwargs_of[value.value.id])
            hit = found and class_field(tree, found[0], found[1], value.slice.value)
            if hit:
                return evaluate(tree, hit[0], hit[1])
    return Default("None", True)


def frontend_flags(tree: SourceTree, module: str, cls_name: str) -> list[dict]:
    """BatchFrontendArgs (and its base's) fields as the flags `add_cli_args` makes of them:
    --field-name, plus the extra flags `_customize_cli_kwargs` adds (-i, -o)."""
    fields = dataclass_fields(tree, module, cls_name, kind="flag")
    extra: dict[str, list[str]] = {}
    mod, cls = tree.find_class(module, cls_name)
    for node in ast.walk(cls):
        if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Subscript)
                and isinstance(node.targets[0].slice, ast.Constant) and node.targets[0].slice.value == "flags"):
            holder = node.targets[0].value
            if isinstance(holder, ast.Subscript) and isinstance(holder.slice, ast.Constant):
                extra[holder.slice.value] = list(ast.literal_eval(node.value))
    return [dict(row, name="--" + row["name"].replace("_", "-"), aliases=extra.get(row["name"], []))
            for row in fields]


def extract(package_dir: Path) -> dict:
    """Every audited name of vLLM, per class, in source order."""
    tree = SourceTree(package_dir)
    classes = {
        "LLM": init_params(tree, "vllm.entrypoints.llm", "LLM") + public_methods(tree, "vllm.entrypoints.llm", "LLM"),
        "LLMEngine": public_methods(tree, "vllm.v1.engine.llm_engine", "LLMEngine"),
        "EngineArgs": dataclass_fields(tree, "vllm.engine.arg_utils", "EngineArgs"),
        "SamplingParams": (dataclass_fields(tree, "vllm.sampling_params", "SamplingParams")
                           + public_methods(tree, "vllm.sampling_params", "SamplingParams", with_bases=False)),
        "StructuredOutputsParams": dataclass_fields(tree, "vllm.sampling_params", "StructuredOutputsParams"),
        "RequestOutput": init_params(tree, "vllm.outputs", "RequestOutput"),
        "CompletionOutput": dataclass_fields(tree, "vllm.outputs", "CompletionOutput"),
        "LoRARequest": dataclass_fields(tree, "vllm.lora.request", "LoRARequest"),
        "run-batch flags": (frontend_flags(tree, "vllm.entrypoints.launchers.run_batch", "BatchFrontendArgs")
                            + engine_cli_flags(tree, "vllm.engine.arg_utils", "EngineArgs")
                            + engine_cli_flags(tree, "vllm.engine.arg_utils", "AsyncEngineArgs")),
        "CompletionRequest": dataclass_fields(tree, "vllm.entrypoints.openai.completion.protocol",
                                              "CompletionRequest", kind="body field"),
        "ChatCompletionRequest": dataclass_fields(tree, "vllm.entrypoints.openai.chat_completion.protocol",
                                                  "ChatCompletionRequest", kind="body field"),
    }
    for key, rows in classes.items():
        names = [r["name"] for r in rows]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise SystemExit(f"vllm_audit: {key} has a name twice: {dupes}")
    return {"vllm_version": vllm_version(tree), "classes": classes}


def vllm_version(tree: SourceTree) -> str:
    """`__version__` from vllm/_version.py (written by the release build)."""
    found = tree.find_constant("vllm._version", "__version__")
    return str(ast.literal_eval(found[1])) if found else "unknown"


def write_snapshot(package_dir: Path, path: Path) -> None:
    data = extract(package_dir)
    path.write_text(json.dumps(data, indent=1) + "\n")
    counts = ", ".join(f"{k} {len(v)}" for k, v in data["classes"].items())
    print(f"wrote {path}: vLLM {data['vllm_version']}: {counts}")
