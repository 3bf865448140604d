"""Following a default through vLLM's source, read with `ast` (vLLM is never imported: it needs
CUDA wheels), to the literal it ends at; the page shows that literal, or the source where there is none."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from audit_vllm import REQUIRED


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
