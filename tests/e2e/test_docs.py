"""Docs that run: every ```bash and ```python block of README.md and docs/*.md, as written.

A command on a page that nothing runs goes stale without a sound (a renamed flag, a moved
script, a package the README's install lacks). So each page's blocks run here, in order, in
a directory of their own, against an install made exactly as the README's first command
makes it: a fresh copy of this checkout, `python3 -m venv .venv` (no system site-packages)
and `pip install -c constraints.txt -e .` (no test extra). That command runs once per
session, its own run of the bundled model checked too, and its directory is removed at the
end (the venv holds a whole torch), in the background.

Output samples are ```text or bare ``` blocks and do not run, except `plan` samples (a first
line `$ python -m spmd_engine.plan ...`): the command runs, and every sample line but `...`
must appear in its output, in order. A block that cannot run here has
`<!-- docs-test: skip (why) -->` on the line before it, and SKIPPED below lists every one, so
a new skip has to be added here too. Every block runs through launch.Launch: bounded in
time, and no process or /dev/shm segment of its own may outlive it.

All pages run in one test, so that one install serves them: a module-scoped fixture is made
once per xdist worker, and an xdist_group does not keep tests on one worker under pytest 9
(xdist 3.8 renames `item._nodeid`, which pytest 9 no longer reads). A failing page does not
stop the others; the test reports every failing block.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from launch import REPO, SHM_DIR, Launch, base_env, free_port, unique_tag
from zen import continuation

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LANGUAGES = {"bash", "python", "text", ""}  # anything else would be neither run nor meant as output
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
SKIP = re.compile(r"^\s*<!-- docs-test: skip \((.+)\) -->\s*$")
PLAN_SAMPLE = "$ python -m spmd_engine.plan"
BLOCK_TIMEOUT_S = 240
# Not copied into the install: what the README's command builds, and what git ignores.
NOT_COPIED = (".git", ".venv", "*.egg-info", "__pycache__", ".pytest_cache", "build", "dist")

# Every block marked skip, by (page, its first line): why it cannot run here.
SKIPPED = {
    ("README.md", "python3 -m venv .venv && .venv/bin/pip install -c constraints.txt -e '.[test]' && "
                  ".venv/bin/ruff check . && .venv/bin/python -m pytest -n 2 -m \"not slow\" -rs tests"): "the quick suite",
    ("README.md", ".venv/bin/python -m pytest -n 2 -m slow -rs tests"): "the slow suite",
    ("docs/rl-colocation.md", 'dist.init_process_group("gloo")                            '
                              "# the trainer's world, first"): "an outline of scripts/examples/rl_colocate.py",
    ("docs/slurm-and-multinode.md", "TP=4 DP=2 PYTHON=$PWD/.venv/bin/python PROMPTS_FILE=$PWD/prompts.jsonl "
                                    "OUTPUT=$PWD/out.jsonl \\"): "needs sbatch and a SLURM cluster",
    ("docs/slurm-and-multinode.md", "TP=8 PP=2 PYTHON=$PWD/.venv/bin/python MODEL=/shared/models/my-llama \\"):
        "needs sbatch and a SLURM cluster",
    ("docs/slurm-and-multinode.md", "TP=8 PP=2 PYTHON=$PWD/.venv/bin/python PROMPTS_FILE=$PWD/prompts.jsonl "
                                    "OUTPUT=$PWD/out.jsonl \\"): "needs sbatch and a SLURM cluster",
}


@dataclass
class Block:
    page: str  # relative to the repository
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    skip: str | None

    @property
    def first_line(self) -> str:
        return self.code.split("\n", 1)[0]

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.lang in ("bash", "python") and self.skip is None

    @property
    def is_plan_sample(self) -> bool:
        return self.lang in ("text", "") and self.first_line.startswith(PLAN_SAMPLE)


def read_blocks(path: Path) -> list[Block]:
    """The fenced blocks of one page, with the fence's indentation (a block in a list item)
    taken off every line."""
    page = str(path.relative_to(REPO))
    lines = path.read_text().split("\n")
    found, i = [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, lang = match.groups()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        assert end is not None, f"{page}:{i + 1}: a fence that never closes"
        body = [line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines[i + 1:end]]
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        skip = SKIP.match(before)
        found.append(Block(page, i + 1, lang, "\n".join(body) + "\n", skip.group(1) if skip else None))
        i = end + 1
    return found


BLOCKS = [block for path in PAGES for block in read_blocks(path)]


def main_job_block() -> Block:
    """README's "Run the main job" command: the install every other block runs in."""
    readme = (REPO / "README.md").read_text()
    line = readme[:readme.index("**Run the main job**")].count("\n") + 1
    return next(b for b in BLOCKS if b.page == "README.md" and b.line > line and b.lang == "bash")


def uni_output(prompt: str) -> str:
    """What `spmd_engine.run --prompt PROMPT` prints: the bundled model recites the rest of the Zen."""
    text = continuation(prompt)  # one token a byte, and the EOS that ends it
    return f"=== prompt 0 (stop, {len(text) + 1} tokens)\n{prompt}{text}\n"


# ---------------------------------------------------------------- the pages themselves (no processes)

def test_every_block_is_run_or_an_output_sample():
    for block in BLOCKS:
        assert block.lang in LANGUAGES, f"{block.where}: ```{block.lang} is neither run nor an output sample"
        assert block.skip is None or block.lang in ("bash", "python"), f"{block.where}: a skip on a sample"


def test_skipped_blocks_are_the_listed_ones():
    skipped = {(b.page, b.first_line): b.skip for b in BLOCKS if b.skip is not None}
    assert set(skipped) == set(SKIPPED), (sorted(set(skipped) ^ set(SKIPPED)))
    for key, reason in skipped.items():
        assert reason.startswith(SKIPPED[key]), (key, reason)
    markers = sum(1 for path in PAGES for line in path.read_text().split("\n") if SKIP.match(line))
    assert markers == len(skipped), "a skip marker that is not right before a block"


def test_readme_stays_short_and_links_every_page():
    readme = (REPO / "README.md").read_text()
    assert len(readme.encode()) < 12 * 1024, "README.md is the first screen; put the rest in docs/"
    for page in (REPO / "docs").glob("*.md"):
        assert f"(docs/{page.name})" in readme, f"docs/{page.name} is not linked from README.md"


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_pages_resolve():
    for path in [*PAGES, REPO / "tests" / "README.md"]:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            file, _, fragment = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            assert dest.exists(), f"{path.relative_to(REPO)}: link to {target}: no such file"
            if fragment:
                headings = [anchor(line.lstrip("#")) for line in dest.read_text().split("\n") if line.startswith("#")]
                assert fragment in headings, f"{path.relative_to(REPO)}: link to {target}: no such heading"


def test_files_named_in_the_docs_exist():
    """A path in backquotes that starts at the repository's top (spmd_engine/, scripts/,
    tests/, docs/) names a file or folder that is there: code moves, pages must follow."""
    for path in [*PAGES, REPO / "tests" / "README.md"]:
        for name in re.findall(r"`((?:spmd_engine|scripts|tests|docs)/[\w./-]*)`", path.read_text()):
            assert (REPO / name).exists(), f"{path.relative_to(REPO)} names {name}, which does not exist"


# ---------------------------------------------------------------- running them

def block_env(tag: str) -> dict[str, str]:
    """A reader's shell: no launcher variables, one thread a process (2 shared cores), and no
    PYTHONPATH, so `spmd_engine` is the install's own, not this checkout's. A torchrun line
    without rendezvous flags listens on 29500 unless PET_MASTER_PORT says otherwise: here it
    gets a port from the OS, so pages running side by side (or another checkout's tests) never
    meet on it."""
    env = base_env(tag, {"PET_MASTER_PORT": str(free_port())})
    for name in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):
        env.pop(name, None)
    return env


def shm_names_with(pids) -> list[str]:
    """/dev/shm entries whose name carries one of these pids (every segment we make does)."""
    if not SHM_DIR.is_dir():
        return []
    return sorted(p.name for p in SHM_DIR.iterdir() if any(f"_{pid}_" in p.name for pid in pids))


def launch_in(cmd: list[str], cwd: Path, what: str, timeout: float = BLOCK_TIMEOUT_S) -> Launch:
    """Run one command in `cwd`; it must end in time, exit 0 and leave nothing behind. A port
    taken between free_port() and torchrun's bind is retried with another."""
    for _ in range(3):
        tag = unique_tag("docs")
        launch = Launch([cmd], [block_env(tag)], tag, timeout, cwd=cwd)
        if not launch.port_in_use():
            break
    assert not launch.timed_out and launch.returncode == 0, f"{what}\n{launch.describe()}"
    assert not launch.leftover_pids, f"{what}: processes left behind\n{launch.describe()}"
    assert not launch.stale_segments() and not shm_names_with(launch.seen_pids), \
        f"{what}: /dev/shm segments left behind: {shm_names_with(launch.seen_pids)}"
    return launch


def run_block(block: Block, cwd: Path) -> Launch:
    script = cwd / f"docs_block_{Path(block.page).stem}_{block.line}.{'py' if block.lang == 'python' else 'sh'}"
    script.write_text(block.code)
    if block.lang == "python":
        cmd = [str(cwd / ".venv" / "bin" / "python"), script.name]
    else:
        cmd = ["bash", "-e", "-o", "pipefail", script.name]
    return launch_in(cmd, cwd, f"{block.where}: the block\n{block.code}")


def check_plan_sample(block: Block, cwd: Path, python: str | None = None) -> None:
    """A `plan` sample: its command (continued over lines ending in a backslash) runs with the
    install's python, and the sample's lines, `...` aside, appear in the output in that order."""
    lines = block.code.rstrip("\n").split("\n")
    command = lines[0][2:]
    n = 1
    while command.endswith("\\"):
        command, n = command[:-1] + lines[n], n + 1
    args = shlex.split(command)
    assert args[:3] == ["python", "-m", "spmd_engine.plan"], block.where
    python = python or str(cwd / ".venv" / "bin" / "python")
    launch = launch_in([python, *args[1:]], cwd, f"{block.where}: {command}")
    actual = iter(line.rstrip() for line in launch.stdout.split("\n"))
    for line in lines[n:]:
        if line.strip() in ("", "..."):
            continue
        assert any(got == line.rstrip() for got in actual), \
            f"{block.where}: the sample line {line!r} is not in the output (in order):\n{launch.stdout}"


def test_negative_controls_of_the_runner(tmp_path):
    """What each check catches: a block that fails, one that leaves a process or a /dev/shm
    file of its own behind, and a plan sample with a line the output does not have."""
    def bash(code):
        return Block("docs/x.md", 1, "bash", code, None)

    with pytest.raises(AssertionError, match=r"rc=\[3\]"):
        run_block(bash("true\nexit 3\n"), tmp_path)
    with pytest.raises(AssertionError, match="processes left behind"):
        run_block(bash("sleep 30 &\n"), tmp_path)
    # The file carries its creator's pid, as our segments do; the creator lives long enough
    # (0.6 s) to be seen: the launch samples its processes every 0.25 s.
    make = "import os, time; open(f'/dev/shm/docs_test_{os.getpid()}_x', 'w'); time.sleep(0.6)"
    try:
        with pytest.raises(AssertionError, match=r"/dev/shm segments left behind: \['docs_test_"):
            run_block(bash(f'python3 -c "{make}"\n'), tmp_path)
    finally:
        for leftover in SHM_DIR.glob("docs_test_*_x"):
            leftover.unlink()
    sample = next(b for b in BLOCKS if b.is_plan_sample and b.page == "README.md")
    check_plan_sample(sample, REPO, sys.executable)  # the control's control: the sample as written
    wrong = Block(sample.page, sample.line, sample.lang, sample.code.replace("[0, 4] [1, 5]", "[0, 4] [1, 6]"), None)
    assert wrong.code != sample.code
    with pytest.raises(AssertionError, match="is not in the output"):
        check_plan_sample(wrong, REPO, sys.executable)


@dataclass
class Install:
    root: Path
    checkout: Path  # the copy, with its .venv, where the README's first command ran


@pytest.fixture(scope="module")
def install(tmp_path_factory):
    root = tmp_path_factory.mktemp("docs")
    checkout = root / "checkout"
    shutil.copytree(REPO, checkout, symlinks=True, ignore=shutil.ignore_patterns(*NOT_COPIED))
    block = main_job_block()
    assert block.first_line.startswith("python3 -m venv .venv && .venv/bin/pip install -c constraints.txt -e . &&")
    try:
        launch = run_block(block, checkout)
        assert launch.stdout.endswith(uni_output("Beautiful is")), launch.describe()  # after pip's lines
        venv = checkout / ".venv"
        assert "include-system-site-packages = false" in (venv / "pyvenv.cfg").read_text()
        probe = launch_in([str(venv / "bin" / "python"), "-c",
                           "import importlib.util as u; print(u.find_spec('spmd_engine').origin); "
                           "print(u.find_spec('pytest') is None, u.find_spec('transformers') is None)"],
                          checkout, "where spmd_engine comes from")
        origin, no_test_extra = probe.stdout.split("\n")[:2]
        assert origin == str(checkout / "spmd_engine" / "__init__.py"), origin
        assert no_test_extra == "True True", "the README install must not hold the test extra"
        yield Install(root, checkout)
    finally:
        # A venv with torch takes tens of seconds to delete on a busy disk; the tests after this
        # module need not wait for it. Not a daemon: the interpreter waits for it at exit.
        threading.Thread(target=shutil.rmtree, args=(root,), kwargs={"ignore_errors": True},
                         name="remove-docs-install").start()


def page_dir(install: Install, page: str) -> Path:
    """A directory of the page's own where the install's files are at hand (.venv, scripts/,
    spmd_engine/, ...), so what one page writes (out.jsonl, prompts files) meets no other's."""
    path = install.root / ("page-" + page.replace("/", "-"))
    path.mkdir()
    for entry in install.checkout.iterdir():
        (path / entry.name).symlink_to(entry)
    return path


def check_three_launches(launch, cwd, install):
    assert launch.stdout == 3 * uni_output("Beautiful is"), launch.describe()  # "All three print the same text."


def check_python_example(launch, cwd, install):
    assert launch.stdout == continuation("Beautiful is")[:40] + "\n[0, 1]\n", launch.describe()


def check_plan_json_and_live(launch, cwd, install):
    plan = json.loads(launch.stdout.split("\n", 1)[0])
    assert (plan["world_size"], plan["external_data_parallel_size"]) == (2, 2), plan
    assert "live check passed: 4 ranks" in launch.stdout + launch.stderr, launch.describe()


def check_records(n):
    def check(launch, cwd, install):
        records = (cwd / "out.jsonl").read_text().splitlines()
        assert [r.split(",", 1)[0] for r in records] == [f'{{"index": {i}' for i in range(n)], records
    return check


# Checks beyond "exit 0, nothing left behind", by (page, the block's first line).
CHECKS = {
    ("README.md", '.venv/bin/python -m spmd_engine.run --prompt "Beautiful is"                           '
                  "# uni: one process"): check_three_launches,
    ("README.md", "from spmd_engine import LLM, SamplingParams"): check_python_example,
    ("docs/layouts-and-plan.md", ".venv/bin/python -m spmd_engine.plan -tp 2 --world-size 4 --json"):
        check_plan_json_and_live,
    ("docs/running.md", "printf '%s\\n' '{\"prompt\": \"Simple is\"}' '{\"prompt_token_ids\": [256, 70, 108, 97]}' "
                        "> prompts.jsonl"): check_records(2),
    ("docs/long-jobs-and-failures.md", "printf '%s\\n' 'Simple is' 'Errors should' 'Now is' > prompts.txt"):
        check_records(3),
}


def test_every_check_has_its_block():
    keys = {(b.page, b.first_line) for b in BLOCKS if b.runs}
    assert set(CHECKS) <= keys, set(CHECKS) - keys


RUN_PAGES = sorted({b.page for b in BLOCKS if b.runs or b.is_plan_sample})


def run_page(page: str, install: Install) -> None:
    """The page's blocks and plan samples, in order, in one directory: a reader's session."""
    cwd = page_dir(install, page)
    main = main_job_block()
    for block in (b for b in BLOCKS if b.page == page and b != main):
        if block.is_plan_sample:
            check_plan_sample(block, cwd)
        elif block.runs:
            launch = run_block(block, cwd)
            check = CHECKS.get((block.page, block.first_line))
            if check is not None:
                check(launch, cwd, install)


@pytest.mark.timeout(1200)
def test_every_page_runs(install):
    """Two pages at a time (the README's, the longest, first): a page's blocks are one process
    or a few, which leaves a core idle most of the time."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        order = sorted(RUN_PAGES, key=lambda page: page != "README.md")
        runs = {page: pool.submit(run_page, page, install) for page in order}
    errors = {page: run.exception() for page, run in runs.items() if run.exception() is not None}
    failures = [f"---- {page}\n{e if isinstance(e, AssertionError) else repr(e)}" for page, e in errors.items()]
    assert not failures, f"{len(failures)} of {len(RUN_PAGES)} pages failed:\n" + "\n".join(failures)
