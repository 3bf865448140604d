#!/usr/bin/env python
"""The vLLM compatibility audit (docs/vllm-compatibility.md): vLLM's public names, and ours against them.

The page promises every public name of vLLM's offline API one verdict (same / differs /
ignored / refused). Keeping that promise by hand over hundreds of names drifts, so:

    # 1. vLLM's names, read from its source with `ast` (vLLM is never imported: it needs CUDA
    #    wheels), written to a snapshot that CI reads instead of vLLM
    python scripts/vllm_audit.py --vllm-src /tmp/vllm/src/vllm
    # 2. a first guess for each name by probing our code (this checkout, or another one)
    python scripts/vllm_audit.py --classify [--package-root /tmp/base] [--diff]
    # 3. missing verdicts seeded from the guesses (then reviewed by hand), and the page written
    python scripts/vllm_audit.py --init-verdicts
    python scripts/vllm_audit.py --write-doc

The reviewed verdicts live in docs/vllm-compatibility-verdicts.json (name -> verdict, note,
probe): the page is generated from the snapshot plus that file, so it can be rewritten after
the code changes, and tests/unit/test_vllm_compatibility.py checks it against the code.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parent.parent
SNAPSHOT = REPO / "docs" / "vllm-0.34-names.json"
VERDICTS = REPO / "docs" / "vllm-compatibility-verdicts.json"
PAGE = REPO / "docs" / "vllm-compatibility.md"
VERDICT_NAMES = ("same", "differs", "ignored", "refused")
GUESS_NAMES = VERDICT_NAMES + ("absent",)
REQUIRED = "<required>"

# The classes of the audit, in page order: (key, title, where vLLM defines it).
CLASSES = (
    ("LLM", "`LLM`: constructor parameters and methods", "vllm/entrypoints/llm.py"),
    ("LLMEngine", "`LLMEngine` (v1): methods", "vllm/v1/engine/llm_engine.py"),
    ("EngineArgs", "`EngineArgs`: fields", "vllm/engine/arg_utils.py"),
    ("SamplingParams", "`SamplingParams`: fields, methods and properties", "vllm/sampling_params.py"),
    ("StructuredOutputsParams", "`StructuredOutputsParams`: fields", "vllm/sampling_params.py"),
    ("RequestOutput", "`RequestOutput`: constructor parameters", "vllm/outputs.py"),
    ("CompletionOutput", "`CompletionOutput`: fields", "vllm/outputs.py"),
    ("LoRARequest", "`LoRARequest`: fields", "vllm/lora/request.py"),
    ("run-batch flags", "run-batch: command-line flags", "vllm/entrypoints/launchers/run_batch.py"),
    ("CompletionRequest", "run-batch: `/v1/completions` request body", "vllm/entrypoints/openai/completion/protocol.py"),
    ("ChatCompletionRequest", "run-batch: `/v1/chat/completions` request body",
     "vllm/entrypoints/openai/chat_completion/protocol.py"),
)


# --------------------------------------------------------------------------------------------
# Extraction: vLLM's source, read with ast
# --------------------------------------------------------------------------------------------

class SourceTree:
    """vLLM's modules parsed on demand, with just enough name resolution to follow a default such
    as `ModelConfig.seed` or `get_field(CacheConfig, "x")` to the literal it ends at."""

    def __init__(self, package_dir: Path):
        self.root = package_dir.resolve().parent  # the directory holding the `vllm` package
        self._modules: dict[str, ast.Module | None] = {}

    def module(self, dotted: str) -> ast.Module | None:
        if dotted not in self._modules:
            base = self.root.joinpath(*dotted.split("."))
            path = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
            self._modules[dotted] = ast.parse(path.read_text()) if path.is_file() else None
        return self._modules[dotted]

    def find_class(self, module: str, name: str, depth: int = 0) -> tuple[str, ast.ClassDef] | None:
        """The class `name` as `module` sees it: defined there or imported (re-exports followed)."""
        tree = self.module(module)
        if tree is None or depth > 8:
            return None
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return module, node
        origin = self._imported_from(module, tree, name)
        return self.find_class(origin[0], origin[1], depth + 1) if origin else None

    def find_constant(self, module: str, name: str, depth: int = 0) -> tuple[str, ast.expr] | None:
        """A module-level `NAME = value` as `module` sees it."""
        tree = self.module(module)
        if tree is None or depth > 8:
            return None
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) and node.value is not None else []
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return module, node.value
        origin = self._imported_from(module, tree, name)
        return self.find_constant(origin[0], origin[1], depth + 1) if origin else None

    def _imported_from(self, module: str, tree: ast.Module, name: str) -> tuple[str, str] | None:
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        return self._absolute(module, node), alias.name
        return None

    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        parts = module.split(".")
        is_package = self.root.joinpath(*parts, "__init__.py").is_file()
        base = parts if is_package else parts[:-1]
        base = base[:len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))


@dataclass
class Default:
    """A default as the page shows it: repr() of the value where it is a literal, else its source."""
    text: str
    literal: bool


def class_field(tree: SourceTree, module: str, cls: ast.ClassDef, name: str, depth: int = 0) -> tuple[str, ast.expr] | None:
    """The default expression of field `name` in `cls` or its bases (None: no default)."""
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return (module, node.value) if node.value is not None else None
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return module, node.value
    for base in cls.bases:
        if isinstance(base, ast.Name) and depth < 8:
            found = tree.find_class(module, base.id)
            if found and (hit := class_field(tree, found[0], found[1], name, depth + 1)):
                return hit
    return None


def evaluate(tree: SourceTree, module: str, expr: ast.expr | None, depth: int = 0) -> Default:
    """The default `expr` stands for, following class attributes, get_field, Field(default=...)
    and module constants; where it ends in no literal, its source text."""
    if expr is None:
        return Default(REQUIRED, False)
    try:
        return Default(repr(ast.literal_eval(expr)), True)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        pass
    if depth > 10:
        return Default(ast.unparse(expr), False)
    if isinstance(expr, ast.Call):
        return _evaluate_call(tree, module, expr, depth)
    if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
        found = tree.find_class(module, expr.value.id)
        if found and _is_enum(found[1]):
            return Default(ast.unparse(expr), False)  # a member stays a member: RequestOutputKind.CUMULATIVE
        if found and (hit := class_field(tree, found[0], found[1], expr.attr)):
            return evaluate(tree, hit[0], hit[1], depth + 1)
    if isinstance(expr, ast.Name) and (hit := tree.find_constant(module, expr.id)):
        return evaluate(tree, hit[0], hit[1], depth + 1)
    if isinstance(expr, ast.BinOp):
        left, right = evaluate(tree, module, expr.left, depth + 1), evaluate(tree, module, expr.right, depth + 1)
        if left.literal and right.literal:
            node = ast.BinOp(ast.parse(left.text, mode="eval").body, expr.op, ast.parse(right.text, mode="eval").body)
            try:
                code = compile(ast.fix_missing_locations(ast.Expression(node)), "<default>", "eval")
                return Default(repr(eval(code, {"__builtins__": {}})), True)
            except Exception:
                pass
    return Default(ast.unparse(expr), False)


def _is_enum(cls: ast.ClassDef) -> bool:
    return any(ast.unparse(b).split(".")[-1] in ("Enum", "IntEnum", "StrEnum") for b in cls.bases)


def _evaluate_call(tree: SourceTree, module: str, call: ast.Call, depth: int) -> Default:
    """Field(...) / field(...) / msgspec.field(...) / get_field(Class, "name") / list() and kin."""
    func = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
    keywords = {k.arg: k.value for k in call.keywords if k.arg}
    if func in ("Field", "field"):
        if "default" in keywords:
            return evaluate(tree, module, keywords["default"], depth + 1)
        if "default_factory" in keywords:
            return _factory(tree, module, keywords["default_factory"], depth)
        if call.args and not (isinstance(call.args[0], ast.Constant) and call.args[0].value is Ellipsis):
            return evaluate(tree, module, call.args[0], depth + 1)
        return Default(REQUIRED, False)
    if func == "get_field" and len(call.args) == 2 and isinstance(call.args[0], ast.Name):
        found = tree.find_class(module, call.args[0].id)
        name = ast.literal_eval(call.args[1])
        if found and (hit := class_field(tree, found[0], found[1], name)):
            return evaluate(tree, hit[0], hit[1], depth + 1)
    if func in ("list", "dict", "set", "tuple") and not call.args and not call.keywords:
        return Default(repr({"list": [], "dict": {}, "set": set(), "tuple": ()}[func]), func != "set")
    return Default(ast.unparse(call), False)


def _factory(tree: SourceTree, module: str, factory: ast.expr, depth: int) -> Default:
    if isinstance(factory, ast.Name) and factory.id in ("list", "dict", "tuple"):
        return Default(repr({"list": [], "dict": {}, "tuple": ()}[factory.id]), True)
    if isinstance(factory, ast.Name) and factory.id == "set":
        return Default("set()", False)
    if isinstance(factory, ast.Lambda):
        return evaluate(tree, module, factory.body, depth + 1)
    return Default(f"{ast.unparse(factory)}()", False)


def entry(name: str, kind: str, default: Default | None = None, **extra: Any) -> dict:
    row = {"name": name, "kind": kind}
    if default is not None:
        row.update(default=default.text, literal=default.literal)
    row.update(extra)
    return row


def dataclass_fields(tree: SourceTree, module: str, cls_name: str, kind: str = "field") -> list[dict]:
    """Public annotated fields of a dataclass / msgspec Struct / pydantic model, with defaults
    (own fields after the bases', as dataclasses order them)."""
    found = tree.find_class(module, cls_name)
    if found is None:
        raise SystemExit(f"vllm_audit: class {cls_name} not found from {module}")
    mod, cls = found
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
    found = tree.find_class(module, cls_name)
    if found is None:
        raise SystemExit(f"vllm_audit: class {cls_name} not found from {module}")
    mod, cls = found
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
    print(f"wrote {path.relative_to(REPO)}: vLLM {data['vllm_version']}: {counts}")


# --------------------------------------------------------------------------------------------
# Classification: our code probed for each name, in a process with the chosen checkout first
# --------------------------------------------------------------------------------------------

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


def _names_it(exc: BaseException, name: str) -> bool:
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


class Prober:
    """Runs inside the probing process: imports spmd_engine from the checkout under test."""

    def __init__(self) -> None:
        import logging
        logging.getLogger("spmd_engine").setLevel(logging.CRITICAL)
        from spmd_engine.config import ModelConfig
        self.model_dir = ModelConfig().model_dir

    # -- constructors -------------------------------------------------------------------------
    def _ignored(self) -> frozenset:
        from spmd_engine.engine import vllm_args
        return vllm_args.IGNORED_VLLM_ARGS

    def engine_args(self, row: dict) -> Guess:
        import dataclasses

        from spmd_engine.engine.arg_utils import EngineArgs
        return self._constructed(row, lambda **kw: EngineArgs(**({"model": self.model_dir} | kw)),
                                 {f.name: f.default for f in dataclasses.fields(EngineArgs)})

    def llm_param(self, row: dict) -> Guess:
        """LLM(...) with the model's construction cut off before anything loads."""
        import dataclasses
        import inspect

        from spmd_engine.engine import arg_utils, llm

        class Accepted(Exception):
            pass

        def stop(*args, **kwargs):
            raise Accepted

        saved = arg_utils.EngineArgs.create_engine_config
        arg_utils.EngineArgs.create_engine_config = stop
        try:
            ours = {n: p.default for n, p in inspect.signature(llm.LLM.__init__).parameters.items()
                    if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and n != "self"}
            fields = {f.name: f.default for f in dataclasses.fields(arg_utils.EngineArgs)}
            defaults = {**{k: v for k, v in fields.items() if k not in self._ignored()}, **ours}

            def make(**kw):
                try:
                    llm.LLM(**({"model": self.model_dir} | kw))
                except Accepted:
                    return
            return self._constructed(row, make, defaults)
        finally:
            arg_utils.EngineArgs.create_engine_config = saved

    def sampling_field(self, row: dict) -> Guess:
        import dataclasses

        from spmd_engine.sampling_params import SamplingParams
        return self._constructed(row, SamplingParams, {f.name: f.default for f in dataclasses.fields(SamplingParams)},
                                 strict_refusal=True)

    def optional_class_field(self, row: dict, attribute: str, required: dict) -> Guess:
        """StructuredOutputsParams / LoRARequest: the class may not exist at all."""
        import dataclasses
        import inspect
        cls = self._find_class(attribute)
        if cls is None:
            return Guess("absent", f"no {attribute} in spmd_engine")
        if dataclasses.is_dataclass(cls):
            defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        else:
            defaults = {n: p.default for n, p in inspect.signature(cls).parameters.items()}
        return self._constructed(row, lambda **kw: cls(**({**required, **kw})), defaults, strict_refusal=True)

    @staticmethod
    def _find_class(attribute: str):
        import importlib
        for module in ("spmd_engine", "spmd_engine.sampling_params", "spmd_engine.lora.request", "spmd_engine.lora"):
            try:
                found = getattr(importlib.import_module(module), attribute, None)
            except ImportError:
                continue
            if found is not None:
                return found
        return None

    def request_output(self, row: dict) -> Guess:
        import inspect

        from spmd_engine.engine.outputs import RequestOutput
        params = {n: p for n, p in inspect.signature(RequestOutput.__init__).parameters.items() if n != "self"}
        if row["name"] not in params:
            return Guess("absent" if not any(p.kind == p.VAR_KEYWORD for p in params.values()) else "ignored",
                         "not a parameter" + (" (**kwargs: accepted with a warning)" if params else ""))
        default = params[row["name"]].default
        return self._compare_default(row, REQUIRED if default is inspect.Parameter.empty else default)

    def completion_output(self, row: dict) -> Guess:
        import dataclasses

        from spmd_engine.engine.outputs import CompletionOutput
        fields = {f.name: f for f in dataclasses.fields(CompletionOutput)}
        if row["name"] not in fields:
            return Guess("absent", "not a field")
        f = fields[row["name"]]
        return self._compare_default(row, REQUIRED if f.default is dataclasses.MISSING else f.default)

    def _constructed(self, row: dict, make, defaults: dict, strict_refusal: bool = False) -> Guess:
        """make(name=probe): TypeError 'unexpected keyword' -> absent; an error naming it -> refused
        (with `strict_refusal`, only our "not supported" wording counts, since a bad probe of a
        real field is named too); accepted -> same / differs by default, or ignored."""
        import dataclasses
        name, probe = row["name"], probe_value(row)
        try:
            make(**{name: probe})
        except TypeError as exc:
            if "unexpected keyword" in str(exc) and _names_it(exc, name):
                return Guess("absent", f"TypeError: {exc}", probe)
            if _names_it(exc, name) and not strict_refusal:
                return Guess("refused", f"{type(exc).__name__}: {exc}", probe)
            if name not in defaults:
                return Guess("differs", f"probe {probe!r} raised {type(exc).__name__}: {exc}", probe)
        except Exception as exc:  # noqa: BLE001 (any refusal counts, if it names the argument)
            refused = _names_it(exc, name) and (not strict_refusal or "not supported" in str(exc))
            if refused:
                return Guess("refused", f"{type(exc).__name__}: {exc}", probe)
            if name not in defaults:
                return Guess("differs", f"probe {probe!r} raised {type(exc).__name__}: {exc}", probe)
        if name in defaults:
            ours = defaults[name]
            return self._compare_default(row, REQUIRED if ours is dataclasses.MISSING else ours)
        if name in self._ignored():
            return Guess("ignored", "accepted (IGNORED_VLLM_ARGS)", probe)
        return Guess("differs", "accepted, but neither a parameter nor an ignored name", probe)

    @staticmethod
    def _compare_default(row: dict, ours: Any) -> Guess:
        if row.get("default") == REQUIRED:
            return Guess("same" if ours == REQUIRED else "differs", f"ours: {ours!r}")
        if ours == REQUIRED:
            return Guess("differs", "required here")
        if default_matches(row["default"], row["literal"], ours):
            return Guess("same")
        return Guess("differs", f"default {ours!r} here, {row['default']} in vLLM")

    # -- methods ------------------------------------------------------------------------------
    def method(self, row: dict, cls) -> Guess:
        import inspect
        name = row["name"].removesuffix("()")
        if not hasattr(cls, name):
            return Guess("absent", f"AttributeError: {cls.__name__} has no attribute {name!r}")
        if row["kind"] == "property":
            return Guess("same", "property" if isinstance(inspect.getattr_static(cls, name), property) else "attribute")
        try:
            sig = inspect.signature(getattr(cls, name))
        except (TypeError, ValueError):
            return Guess("differs", "not callable")
        problems = method_problems(row["params"], sig, is_static_or_bound=row["kind"] != "method")
        return Guess("differs", "; ".join(problems)) if problems else Guess("same")

    # -- run-batch ----------------------------------------------------------------------------
    def flag(self, row: dict) -> Guess:
        from spmd_engine.run_batch.main import build_parser
        parser = build_parser()
        actions = parser._option_string_actions
        name = row["name"]
        if name not in actions:
            matches = [o for o in actions if o.startswith(name)] if parser.allow_abbrev else []
            if len(matches) == 1:
                return Guess("differs", f"silently taken as {matches[0]} (argparse abbreviation): BUG")
            return Guess("absent", f"error: unrecognized arguments: {name}")
        missing = [a for a in row.get("aliases", []) if a not in actions]
        wrong = [a for a in row.get("aliases", []) if a in actions and actions[a] is not actions[name]]
        guess = self._compare_default(row, actions[name].default)
        if missing or wrong:
            extra = ", ".join([f"alias {a} missing" for a in missing] + [f"alias {a} is another flag" for a in wrong])
            return Guess("differs", "; ".join(x for x in (guess.detail, extra) if x))
        return guess

    def body_field(self, row: dict, is_chat: bool) -> Guess:
        """One line with the field at a probe value: refused if the line's error names it; else
        read / accepted / ignored by the runner's field tables (or, in a checkout without them,
        by whether run_batch's code names the field at all)."""
        from spmd_engine.run_batch import requests
        name, probe = row["name"], probe_value(row)
        body = body_base(is_chat)
        line = {"custom_id": "a", "method": "POST", "url": requests.CHAT_URL if is_chat else requests.COMPLETIONS_URL,
                "body": {**body, name: probe}}
        parsed = requests.parse_line(json.dumps(line), 1)
        if parsed.error and _names_it(Exception(parsed.error), name) and "not supported" in parsed.error:
            return Guess("refused", parsed.error, probe)
        tables = _field_tables(is_chat)
        if tables is not None:
            read, accepted = tables
            if name in accepted:
                return Guess("ignored", "accepted (fields.ACCEPTED)", probe)
            if name not in read:
                return Guess("ignored", "outside the runner's tables: ignored with a warning", probe)
        elif name not in _run_batch_strings():
            return Guess("ignored", "never read by run_batch: silently ignored", probe)
        if row.get("literal") and not body_default_is_neutral(row, is_chat):
            return Guess("differs", f"vLLM's default {row['default']} changes the sampling parameters here")
        return Guess("same", "read")

    def classify(self, snapshot: dict) -> dict[str, dict[str, dict]]:
        from spmd_engine.engine.llm import LLM
        from spmd_engine.engine.llm_engine import LLMEngine
        from spmd_engine.sampling_params import SamplingParams
        out: dict[str, dict[str, dict]] = {}
        for key, rows in snapshot["classes"].items():
            out[key] = {}
            for row in rows:
                try:
                    guess = self._one(key, row, LLM, LLMEngine, SamplingParams)
                except Exception as exc:  # noqa: BLE001 (a probe that breaks is reported, not fatal)
                    guess = Guess("differs", f"probe failed: {type(exc).__name__}: {exc}")
                out[key][row["name"]] = {"guess": guess.guess, "detail": guess.detail[:300],
                                         **({"probe": guess.probe} if guess.guess == "refused" else {})}
        return out

    def _one(self, key: str, row: dict, llm, engine, sampling) -> Guess:
        if row["kind"] in ("method", "classmethod", "staticmethod", "property"):
            return self.method(row, {"LLM": llm, "LLMEngine": engine, "SamplingParams": sampling}[key])
        if key == "LLM":
            return self.llm_param(row)
        if key == "EngineArgs":
            return self.engine_args(row)
        if key == "SamplingParams":
            return self.sampling_field(row)
        if key == "StructuredOutputsParams":
            return self.optional_class_field(row, "StructuredOutputsParams", {})
        if key == "LoRARequest":
            return self.optional_class_field(row, "LoRARequest", {"lora_name": "a", "lora_int_id": 1,
                                                                  "lora_path": "/nonexistent"})
        if key == "RequestOutput":
            return self.request_output(row)
        if key == "CompletionOutput":
            return self.completion_output(row)
        if key == "run-batch flags":
            return self.flag(row)
        return self.body_field(row, key == "ChatCompletionRequest")


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


def _field_tables(is_chat: bool) -> tuple[set, set] | None:
    try:
        from spmd_engine.run_batch import fields
    except ImportError:
        return None
    return set(fields.READ[is_chat]), set(fields.ACCEPTED[is_chat])


def _run_batch_strings() -> set[str]:
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


def run_probe(package_root: Path, snapshot: Path) -> dict:
    """The guesses for `package_root`'s spmd_engine, made in a process of their own (so another
    checkout's modules never mix with this one's)."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONPATH=str(package_root))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--probe-in-process", "--package-root", str(package_root),
           "--snapshot", str(snapshot)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(package_root))
    if done.returncode:
        raise SystemExit(f"vllm_audit: probing {package_root} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def probe_in_process(package_root: Path, snapshot: Path) -> None:
    sys.path.insert(0, str(package_root))
    import spmd_engine
    where = Path(spmd_engine.__file__).resolve()
    if package_root.resolve() not in where.parents:
        raise SystemExit(f"vllm_audit: imported {where}, not the spmd_engine under {package_root}")
    result = Prober().classify(json.loads(snapshot.read_text()))
    sys.stdout.write(json.dumps(result) + "\n")


def totals(verdicts: dict[str, dict[str, dict]], key: str, names: tuple[str, ...]) -> dict[str, dict[str, int]]:
    return {cls: {n: sum(1 for v in rows.values() if v[key] == n) for n in names} for cls, rows in verdicts.items()}


def print_totals(counts: dict[str, dict[str, int]], names: tuple[str, ...]) -> None:
    width = max(len(c) for c in counts)
    sys.stdout.write(f"{'class':<{width}}  " + "  ".join(f"{n:>7}" for n in names) + "\n")
    for cls, row in counts.items():
        sys.stdout.write(f"{cls:<{width}}  " + "  ".join(f"{row[n]:>7}" for n in names) + "\n")


# --------------------------------------------------------------------------------------------
# Verdicts and the page
# --------------------------------------------------------------------------------------------

def load_verdicts(path: Path = VERDICTS) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {"before": {}, "classes": {}}


def save_verdicts(data: dict, path: Path = VERDICTS) -> None:
    """One line per name, so a review shows up in a diff as the lines it changed."""
    def one(value: Any) -> str:
        return json.dumps(value, ensure_ascii=False)
    lines = ["{", ' "before": {']
    lines += [",\n".join(f"  {one(cls)}: {one(counts)}" for cls, counts in data.get("before", {}).items())]
    lines += [" },", ' "classes": {']
    blocks = []
    for cls, rows in data["classes"].items():
        body = ",\n".join(f"   {one(name)}: {one(v)}" for name, v in rows.items())
        blocks.append(f"  {one(cls)}: {{\n{body}\n  }}")
    lines += [",\n".join(blocks), " }", "}"]
    path.write_text("\n".join(lines) + "\n")


def seeded_note(guess: dict) -> str:
    """A first note from a guess, for a reviewer to correct."""
    detail = guess["detail"]
    if guess["guess"] == "absent":
        return detail.split(" (and ")[0]
    return detail


def init_verdicts(guesses: dict, snapshot: dict, path: Path = VERDICTS) -> int:
    """Add a verdict for every snapshot name that has none (absent becomes refused: Python's own
    error names it), marked unreviewed; existing verdicts are kept as they are."""
    data = load_verdicts(path)
    added = 0
    for cls, rows in snapshot["classes"].items():
        mine = data["classes"].setdefault(cls, {})
        for row in rows:
            if row["name"] in mine:
                continue
            g = guesses[cls][row["name"]]
            verdict = "refused" if g["guess"] == "absent" else g["guess"]
            mine[row["name"]] = {"verdict": verdict, "note": seeded_note(g), "reviewed": False,
                                 **({"probe": g["probe"]} if "probe" in g else {})}
            added += 1
    save_verdicts(data, path)
    return added


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_page(snapshot: dict, verdicts: dict) -> str:
    """The page: how it is made, the totals before and after, then one table per class."""
    titles = {key: (title, src) for key, title, src in CLASSES}
    before = verdicts.get("before", {})
    after = totals(verdicts["classes"], "verdict", VERDICT_NAMES)
    lines = [PAGE_INTRO.format(version=snapshot["vllm_version"]).rstrip(), ""]
    lines += ["| class | names | before: same / differs / ignored / refused | after: same / differs / ignored / refused |",
              "|---|---:|---|---|"]
    for key, rows in snapshot["classes"].items():
        b = before.get(key)
        b_text = _before_cell(b) if b else "n/a"
        a_text = " / ".join(str(after[key][n]) for n in VERDICT_NAMES)
        lines.append(f"| [{key}](#{_anchor(titles[key][0])}) | {len(rows)} | {b_text} | {a_text} |")
    lines += ["", PAGE_TOTALS_NOTE.rstrip(), ""]
    unreviewed = sum(1 for rows in verdicts["classes"].values() for v in rows.values() if not v.get("reviewed", True))
    if unreviewed:
        lines += [f"**{unreviewed} rows are automatic guesses not reviewed yet** (`reviewed: false` in the verdict "
                  "file).", ""]
    for key, rows in snapshot["classes"].items():
        title, src = titles[key]
        lines += [f"## {title}", "", f"<!-- class: {key} -->", f"vLLM: `{src}`.", "",
                  "| name | vLLM default (or parameters) | verdict | note |",
                  "|---|---|---|---|"]
        for row in rows:
            v = verdicts["classes"][key][row["name"]]
            lines.append(f"| `{_cell(row['name'])}` | {_default_cell(row)} | {v['verdict']} | {_cell(v['note'])} |")
        lines.append("")
    return "\n".join(lines)


def _before_cell(counts: dict[str, int]) -> str:
    """Automatic totals with "absent" counted as refused (Python's own error names the name)."""
    refused = counts["refused"] + counts.get("absent", 0)
    shown = [counts["same"], counts["differs"], counts["ignored"], refused]
    return " / ".join(map(str, shown)) + (f" ({counts['absent']} absent)" if counts.get("absent") else "")


def _default_cell(row: dict) -> str:
    if "params" in row:
        params = [p["name"] if p["kind"] != "VAR_KEYWORD" else "**" + p["name"] for p in row["params"]]
        return _cell("(" + ", ".join(params) + ")") if params else "()"
    if row["kind"] == "property":
        return "(property)"
    text = row.get("default", "")
    aliases = row.get("aliases")
    shown = f"`{_cell(text)}`" if len(text) <= 40 else f"`{_cell(text[:37])}...`"
    return shown + (f" ({', '.join(aliases)})" if aliases else "")


def _anchor(title: str) -> str:
    keep = "".join(ch for ch in title.lower() if ch.isalnum() or ch in " -_")
    return keep.replace(" ", "-")


PAGE_INTRO = """\
# vLLM compatibility audit

Every public name of vLLM {version}'s offline API, with one verdict each:

- **same**: the name exists here with vLLM's default and meaning;
- **differs**: it exists, but something about it differs (the note says how);
- **ignored**: accepted and ignored, because it cannot change a result here (the note says why);
- **refused**: setting it is an error that names it (the note gives the error).

Nothing that changes a result is ignored silently: a row whose note says "silently ignored:
BUG" is one that does, until it is fixed.

The reference is vLLM {version}'s source (its `vllm/` package), read with Python's `ast`, never
imported: `LLM.__init__`'s parameters and the public methods of `LLM` (with its mixins) and the v1
`LLMEngine`; the fields of `EngineArgs` (all of them: `LLM(**kwargs)` passes any of them on;
`AsyncEngineArgs`' server-only field is left out), `SamplingParams` (and its public methods and
properties), `StructuredOutputsParams`, `CompletionOutput` and `LoRARequest`; `RequestOutput`'s
constructor; and run-batch's flags (`BatchFrontendArgs` and the engine flags it adds) and the
fields of the two request bodies it runs. The names are kept in
[`vllm-0.34-names.json`](vllm-0.34-names.json), so the checks need no vLLM; the verdicts and notes
in [`vllm-compatibility-verdicts.json`](vllm-compatibility-verdicts.json); this page is generated
from both. `tests/unit/test_vllm_compatibility.py` checks every row against the code: each
`same` name exists with vLLM's default (a method accepts vLLM's parameter names, in vLLM's
positions), each `refused` constructor name raises an error naming it, each `ignored` `LLM` /
`EngineArgs` name is accepted.

After a change to the code, see where the automatic guesses and the verdicts part (then fix the
code or the verdict file), and write this page again:

```bash
.venv/bin/python scripts/vllm_audit.py --classify --diff
.venv/bin/python scripts/vllm_audit.py --write-doc
```

For a new vLLM, the snapshot comes from its unpacked `vllm/` package (`--vllm-src
/tmp/vllm/src/vllm`), `--init-verdicts` adds a guessed verdict (marked `reviewed: false`) for
each new name, to be reviewed; `--classify --package-root /tmp/base --save-before` stores the
"before" totals of another checkout.

## Totals
"""

PAGE_TOTALS_NOTE = """\
"Before" is the code before the audit's round, classified automatically by probing it (each
name set to a value other than vLLM's default); a name it did not know ("absent": a TypeError
or AttributeError naming it) counts as refused there. "After" is the reviewed verdicts below.
Before, `LLM(...)` accepted vLLM's `tokenizer`, `hf_overrides`, `logits_processors`, ... with a
warning and ignored them, and run-batch ignored, without a word, every body field it did not
read (`top_k`, `min_p`, the penalties, `logit_bias`, `stop_token_ids`, `priority`, ...): those
"ignored" counts hold names that changed a result.
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-src", type=Path, help="vLLM's unpacked package directory: write the snapshot")
    p.add_argument("--snapshot", type=Path, default=SNAPSHOT)
    p.add_argument("--classify", action="store_true", help="guess each name's verdict by probing our code")
    p.add_argument("--package-root", type=Path, default=REPO, help="the checkout whose spmd_engine to probe")
    p.add_argument("--diff", action="store_true", help="with --classify: rows whose guess disagrees with the verdicts")
    p.add_argument("--json", action="store_true", help="with --classify: print every guess as JSON")
    p.add_argument("--save-before", action="store_true", help="with --classify: store the totals as 'before'")
    p.add_argument("--init-verdicts", action="store_true", help="add guessed verdicts for names without one")
    p.add_argument("--write-doc", action="store_true", help="write docs/vllm-compatibility.md")
    p.add_argument("--probe-in-process", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.probe_in_process:
        probe_in_process(args.package_root, args.snapshot)
        return 0
    if args.vllm_src:
        write_snapshot(args.vllm_src, args.snapshot)
    snapshot = json.loads(args.snapshot.read_text())
    if args.classify or args.init_verdicts:
        guesses = run_probe(args.package_root, args.snapshot)
        if args.classify:
            report_guesses(guesses, args)
        if args.init_verdicts:
            sys.stdout.write(f"{init_verdicts(guesses, snapshot)} verdicts added to {VERDICTS.relative_to(REPO)}\n")
    if args.write_doc:
        PAGE.write_text(render_page(snapshot, load_verdicts()))
        sys.stdout.write(f"wrote {PAGE.relative_to(REPO)}\n")
    return 0


def report_guesses(guesses: dict, args: argparse.Namespace) -> None:
    counts = totals(guesses, "guess", GUESS_NAMES)
    sys.stdout.write(f"guesses for {args.package_root}:\n")
    print_totals(counts, GUESS_NAMES)
    if args.json:
        sys.stdout.write(json.dumps(guesses, indent=1) + "\n")
    if args.save_before:
        data = load_verdicts()
        data["before"] = counts
        save_verdicts(data)
    if args.diff:
        for cls, name, guess, verdict in disagreements(guesses, load_verdicts()):
            sys.stdout.write(f"{cls}: {name}: guess {guess['guess']} ({guess['detail']}), verdict {verdict}\n")


def disagreements(guesses: dict, verdicts: dict) -> Iterator[tuple[str, str, dict, str]]:
    """Rows whose guess is not their verdict (absent counts as refused); a reviewer reads these."""
    for cls, rows in guesses.items():
        for name, guess in rows.items():
            verdict = verdicts["classes"].get(cls, {}).get(name, {}).get("verdict", "(none)")
            if ("refused" if guess["guess"] == "absent" else guess["guess"]) != verdict:
                yield cls, name, guess, verdict


if __name__ == "__main__":
    sys.exit(main())
