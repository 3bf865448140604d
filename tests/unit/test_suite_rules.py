"""The suite's own rules: a missing reference package skips locally and fails under CI; CI runs
the README's command; rank scripts write whole lines."""

import pytest
from _pytest.outcomes import Failed, Skipped
from conftest import require_reference


def test_reference_package_is_imported_when_present():
    assert require_reference("json").dumps([1]) == "[1]"


def test_missing_reference_skips_locally(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(Skipped, match="no_such_reference_pkg"):
        require_reference("no_such_reference_pkg")


def test_missing_reference_fails_under_ci(monkeypatch):
    """Negative control for CI: the same missing package is a failure, never a skip."""
    monkeypatch.setenv("CI", "1")
    with pytest.raises(Failed, match="CI is set: reference package 'no_such_reference_pkg'"):
        require_reference("no_such_reference_pkg")


def test_ci_runs_the_readme_test_commands_verbatim():
    """.ci/run's two commands are the README's, character for character: it lints, runs the quick
    suite, then the slow one, and prints skip reasons; together they select every test."""
    from launch import REPO

    readme = (REPO / "README.md").read_text()
    section = readme.split("**Run the tests**", 1)[1]
    blocks = [part.split("```", 1)[0].strip() for part in section.split("```bash\n")[1:3]]
    ci_lines = (REPO / ".ci" / "run").read_text().strip().splitlines()
    assert blocks == ci_lines[-2:], (blocks, ci_lines[-2:])
    quick, slow = ci_lines[-2:]
    assert quick.endswith('-m "not slow" -rs tests') and slow.endswith("-m slow -rs tests")
    assert "'.[test]'" in quick and ".venv/bin/ruff check . && " in quick  # the lint runs first, in CI too
    assert "set -euo pipefail" in ci_lines  # a failing first command stops CI
    assert any(line.startswith('export CI="${CI:-1}"') for line in ci_lines)  # missing references fail


def print_calls(source: str) -> list[int]:
    """Lines of `source` that call print()."""
    import ast
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"]


def test_rank_scripts_write_whole_lines():
    """The ranks of one launch share its stdout, and the harness runs them with
    PYTHONUNBUFFERED, where print() writes its text and its newline apart: two ranks' lines ran
    together once (CI, the srun test). So the rank scripts write each line in one call."""
    from launch import REPO

    assert print_calls("print('a', 1)\nsys.stdout.write('b\\n')\n") == [1]  # the check sees a print
    offenders = {path.name: lines for path in sorted((REPO / "tests" / "helpers" / "dist_scripts").glob("*.py"))
                 if (lines := print_calls(path.read_text()))}
    assert not offenders, f"print() in rank scripts (write whole lines with sys.stdout.write): {offenders}"


FIGURE = __import__("re").compile(
    r"\b\d+(\.\d+)?x\b(?! ?\d)|\b\d+(\.\d+)?(-\d+(\.\d+)?)? ?(ms|us|µs|tok/s|GB/s)\b|\b(H100|H200|A100)\b.*\b(step|ms|crash)")


def prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every docstring and comment of a module."""
    import ast
    import io
    import tokenize
    texts = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                texts.append((getattr(node, "lineno", 1), doc))
    return texts


def test_code_says_what_and_why_not_how_fast():
    """Measured figures (ratios, times, a named card's step) belong in docs/performance.md, where
    their machine and date are; a docstring keeps the decision and the invariant."""
    from launch import REPO

    assert sorted(line for line, _ in prose('"""0.36x synchronous."""\nx = 1  # about 200 us a step\n')
            if FIGURE.search(_)) == [1, 2]  # the check sees both kinds
    offenders = [f"{path.relative_to(REPO)}:{line}: {FIGURE.search(text).group(0)}"
                 for path in sorted((REPO / "spmd_engine").rglob("*.py"))
                 for line, text in prose(path.read_text()) if FIGURE.search(text)]
    assert not offenders, "figures in docstrings or comments:\n" + "\n".join(offenders)


# The package's layers, bottom up (DESIGN.md section 5): a module imports only from its own
# layer or below. The root package (its lazy front door) is above them all.
LAYERS = {"topology": 0, "config": 0, "envs": 0, "sampling_params": 0, "lora_request": 0, "distributed": 1, "platform": 1,
          "forward_context": 1, "kernels": 2, "core": 2, "compilation": 3, "model": 4, "sample": 5, "worker": 6,
          "executor": 7, "engine": 8, "run": 9, "run_batch": 9, "plan": 9}


def import_graph(root) -> tuple[dict, dict]:
    """(module -> modules it imports at its top level, module -> every module it imports, functions'
    imports included), over the package's own modules."""
    import ast
    modules = {".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"): p
               for p in root.rglob("*.py")}
    top, every = {}, {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        body = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        for kind, nodes in (("top", body), ("every", list(ast.walk(tree)))):
            targets = set()
            for node in nodes:
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    targets |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
                elif isinstance(node, ast.Import):
                    targets |= {a.name for a in node.names}
            (top if kind == "top" else every)[name] = {t for t in targets if t in modules and t != name}
    return top, every


def cycles(graph: dict) -> list[list[str]]:
    """The strongly connected components of more than one module."""
    index, low, stack, found = {}, {}, [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))
    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def upward(graph: dict) -> list[str]:
    layer = lambda m: LAYERS.get(m.split(".")[1], 10) if "." in m else 10  # noqa: E731
    return [f"{a} -> {b}" for a, targets in graph.items() for b in targets
            if b != "spmd_engine" and layer(b) > layer(a)]


def test_the_package_imports_form_no_cycle_and_never_run_up():
    """Module-level imports form no cycle (a change to attention touches neither the compiler nor
    the loader), and no import, a function's included, runs from a lower layer to a higher one."""
    from launch import REPO

    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the checks see
    assert upward({"spmd_engine.core.x": {"spmd_engine.model.y"}}) == ["spmd_engine.core.x -> spmd_engine.model.y"]
    top, every = import_graph(REPO / "spmd_engine")
    assert not cycles(top), cycles(top)
    assert not upward(every), upward(every)
