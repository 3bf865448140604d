"""The reviewed verdicts (docs/vllm-compatibility-verdicts.json) and the page generated from them
and the snapshot (docs/vllm-compatibility.md): the page is never edited by hand, so it can be
written again whenever the code or a verdict changes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from audit_vllm import CLASSES, VERDICT_NAMES, VERDICTS


def totals(verdicts: dict[str, dict[str, dict]], key: str, names: tuple[str, ...]) -> dict[str, dict[str, int]]:
    return {cls: {n: sum(1 for v in rows.values() if v[key] == n) for n in names} for cls, rows in verdicts.items()}


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

For a new vLLM, the snapshot comes from its unpacked `vllm/` package (`pip download
vllm==X --no-deps`, unzip, then `--vllm-src DIR/vllm`), `--init-verdicts` adds a guessed
verdict (marked `reviewed: false`) for each new name, to be reviewed; `--classify
--package-root CHECKOUT --save-before` stores the "before" totals of another checkout.

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
