"""Our code classified against vLLM's names, in a process of its own with the chosen checkout
first on the path, so that another checkout's modules (the "before" totals) never mix with this one's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from audit_vllm import REQUIRED
from audit_vllm.guess import (
    Guess,
    body_base,
    body_default_is_neutral,
    default_matches,
    field_tables,
    method_problems,
    names_it,
    probe_value,
    run_batch_strings,
)

ENTRY = Path(__file__).resolve().parent.parent / "vllm_audit.py"  # the command, run again to probe


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
        for module in ("spmd_engine", "spmd_engine.sampling_params", "spmd_engine.lora_request"):
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
            if "unexpected keyword" in str(exc) and names_it(exc, name):
                return Guess("absent", f"TypeError: {exc}", probe)
            if names_it(exc, name) and not strict_refusal:
                return Guess("refused", f"{type(exc).__name__}: {exc}", probe)
            if name not in defaults:
                return Guess("differs", f"probe {probe!r} raised {type(exc).__name__}: {exc}", probe)
        except Exception as exc:  # noqa: BLE001 (any refusal counts, if it names the argument)
            refused = names_it(exc, name) and (not strict_refusal or "not supported" in str(exc))
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
        if parsed.error and names_it(Exception(parsed.error), name) and "not supported" in parsed.error:
            return Guess("refused", parsed.error, probe)
        tables = field_tables(is_chat)
        if tables is not None:
            read, accepted = tables
            if name in accepted:
                return Guess("ignored", "accepted (fields.ACCEPTED)", probe)
            if name not in read:
                return Guess("ignored", "outside the runner's tables: ignored with a warning", probe)
        elif name not in run_batch_strings():
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


def run_probe(package_root: Path, snapshot: Path) -> dict:
    """The guesses for `package_root`'s spmd_engine, made in a process of their own (so another
    checkout's modules never mix with this one's)."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONPATH=str(package_root))
    cmd = [sys.executable, str(ENTRY), "--probe-in-process", "--package-root", str(package_root),
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
