"""A seeded soak of real jobs with random faults (issue 25): does every fault end in the
same output file as an unfaulted run, within a bound, with nothing left behind?

Each trial runs `python -m spmd_engine.run` on the bundled model, under torchrun
(`--nproc-per-node 2 --max-restarts 3 -tp 2`) or mp (`-tp 2`), with 1-3 faults drawn from:

- kill:  SIGKILL of a random rank (torchrun) or mp worker, at a random moment;
- stop:  SIGSTOP of one for longer than --timeout (a hang), then SIGCONT;
- stopforever: SIGSTOP of one, never continued (a rank hung for good, issue 55), half the
         time in the first seconds of the ranks' lives (import, rendezvous, groups, load),
         half at a random moment of the job;
- term:  SIGTERM of the whole job, then the same command with --resume;
- disk:  the job's file size limit (RLIMIT_FSIZE, SIGXFSZ ignored) set so part-file writes
         fail with EFBIG mid-run, as on a full disk; then room again and --resume;
- shm:   /dev/shm names of the engine's patterns planted before start (segment names carry
         a random token, so an exact collision cannot be forced from outside: these are the
         look-alikes a crashed job of another user would leave).

After a failed attempt the trial reruns with --resume (as a person or SLURM would), at most
MAX_ATTEMPTS times. Checks: every attempt ends within `bound` (from --timeout); the final
file is byte-identical to the unfaulted reference; no process of the trial (its tag in the
environment), so no port, and no /dev/shm name it made is left: a process still there when
an attempt's launcher has exited is a leak, even though it is then killed. One line per trial, then
`trials, survived, identical, leaks, worst recovery time`; the seed replays a trial.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/chaos.py --trials 50 --seed 1
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "helpers"))
from launch import PYTHON, _reap, base_env, scratch_tmpdir, tagged_pids, with_tmpdir  # noqa: E402

PROMPTS = ["Beautiful is", "Explicit is", "Simple is", "Complex is", "Flat is", "Sparse is"]
FAULTS = ("kill", "stop", "stopforever", "term", "disk", "shm")
EARLY_S = 4.0  # "the first seconds of a rank's life": a stop-forever drawn early lands this soon after the ranks appear
MAX_ATTEMPTS = 4
START_ALLOWANCE_S = 90.0  # python, torch and the model on a loaded 2-core machine


def job_command(launcher: str, prompts: Path, out: Path, args) -> list[str]:
    flags = ["-m", "spmd_engine.run", "--prompts-file", str(prompts), "--output", str(out), "--max-tokens",
             str(args.max_tokens), "--max-num-seqs", "2", "--timeout", str(args.timeout), "--quiet", "-tp", "2"]
    if launcher == "torchrun":
        return [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "3",
                "--monitor-interval", "0.2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
                "--rdzv-id", uuid.uuid4().hex[:8], *flags]
    return [PYTHON, *flags, "--distributed-executor-backend", "mp"]


def targets(tag: str, root: int) -> list[int]:
    """The ranks (torchrun's workers: the agent's children) or mp workers of a job; not what
    a rank starts itself (its stop guard, a compiler), whose faults are not a rank's."""
    found = []
    try:
        agent = b"torch.distributed.run" in Path(f"/proc/{root}/cmdline").read_bytes()
    except OSError:
        return found
    for pid in tagged_pids(tag):
        if pid == root:
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if b"spawn_main" in cmd or (agent and ppid == root):
            found.append(pid)
    return found


def limit_file_size(limit: int):
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def attempt(cmd, tag, faults, rng, args, bound, seen: set[int]) -> tuple[int | None, float, str, list[int]]:
    """One run of the job with `faults` injected at random moments; (rc or None if over
    the bound, seconds, stderr tail, pids still there after the launcher exited)."""
    limit = rng.randrange(300, 1500) if "disk" in faults else None
    with tempfile.TemporaryFile("w+") as err, scratch_tmpdir(tag) as scratch:
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=REPO, env=with_tmpdir(base_env(tag), scratch), stdout=subprocess.DEVNULL, stderr=err,
                                text=True, start_new_session=True,
                                preexec_fn=limit_file_size(limit) if limit else None)
        plan = sorted((rng.uniform(2.0, 14.0), f) for f in faults if f in ("kill", "stop", "term"))
        early = None  # a stop-forever in the ranks' first seconds: the delay after they appear
        if "stopforever" in faults:
            if rng.random() < 0.5:
                early = rng.uniform(0.0, EARLY_S)
            else:
                plan = sorted(plan + [(rng.uniform(2.0, 14.0), "stopforever")])
        stopped: list[tuple[float, int]] = []
        while proc.poll() is None and time.monotonic() - start < bound:
            seen.update(tagged_pids(tag))
            now = time.monotonic() - start
            if early is not None and targets(tag, proc.pid):
                plan, early = sorted(plan + [(now + early, "stopforever")]), None
            while plan and plan[0][0] <= now:
                _, fault = plan.pop(0)
                pool = targets(tag, proc.pid)
                if fault == "term":
                    os.kill(proc.pid, signal.SIGTERM)
                elif pool:
                    victim = rng.choice(pool)
                    os.kill(victim, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)  # stopforever: no SIGCONT
                    if fault == "stop":
                        stopped.append((now + args.timeout + 3, victim))
            for when, pid in [s for s in stopped if s[0] <= now]:
                stopped.remove((when, pid))
                _signal(pid, signal.SIGCONT)
            time.sleep(0.1)
        for _, pid in stopped:
            _signal(pid, signal.SIGCONT)
        rc = proc.poll()
        if rc is None:
            _signal(-proc.pid, signal.SIGKILL)
        proc.wait()
        left = _reap(tag, grace_s=5.0)
        err.seek(0)
        return rc, time.monotonic() - start, err.read()[-300:].strip().replace("\n", " | "), left


def _signal(pid: int, sig) -> None:
    try:
        os.kill(pid, sig) if pid > 0 else os.killpg(-pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def shm_names() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def plant_shm(rng) -> list[Path]:
    dead = 2 ** 22 + rng.randrange(2 ** 20)  # a pid above pid_max's default: surely not alive
    names = [f"spmd_ar_{dead}_{rng.randrange(16 ** 8):08x}", f"spmd_mq_{rng.randrange(16 ** 12):012x}",
             f"psm_{rng.randrange(16 ** 8):08x}"]
    paths = [Path("/dev/shm") / n for n in names]
    for p in paths:
        p.write_bytes(b"\0" * 4096)
        p.chmod(0o600)
    return paths


def trial(index: int, seed: int, launcher_choice: str, reference: bytes, work: Path, args) -> dict:
    rng = random.Random(seed * 100003 + index)
    launcher = launcher_choice if launcher_choice != "both" else rng.choice(["torchrun", "mp"])
    faults = rng.sample(FAULTS, rng.randint(1, 3))
    tdir = work / f"trial{index:03d}"
    tdir.mkdir()
    out, prompts = tdir / "out.jsonl", work / "prompts.txt"
    cmd = job_command(launcher, prompts, out, args)
    bound = START_ALLOWANCE_S + 4 * args.timeout + 60
    tag = f"chaos-{uuid.uuid4().hex[:10]}"
    shm_before = shm_names()
    planted = plant_shm(rng) if "shm" in faults else []
    start, rcs, over, note, seen, left_behind = time.monotonic(), [], False, "", set(), []
    try:
        pending = faults
        for n in range(MAX_ATTEMPTS):
            rc, took, note, left = attempt(cmd + (["--resume"] if n else []), tag, pending, rng, args, bound, seen)
            rcs.append(rc)
            left_behind += left
            over |= rc is None
            if rc == 0:
                break
            pending = []  # the faults were this attempt's; the rerun resumes in peace
        recovery = time.monotonic() - start
    finally:
        for p in planted:
            p.unlink(missing_ok=True)
    left_pids = left_behind + tagged_pids(tag)
    # Other jobs share /dev/shm: only names carrying a pid of this trial count (spmd_*_<pid>_<token>).
    left_shm = sorted(n for n in shm_names() - shm_before
                      if n.startswith("spmd") and any(f"_{pid}_" in n for pid in seen))
    parts = sorted(p.name for p in tdir.glob("out.jsonl.part-*"))
    identical = out.exists() and out.read_bytes() == reference
    return dict(index=index, launcher=launcher, faults=faults, rcs=rcs, survived=rcs[-1] == 0 and not over,
                identical=identical, leaks=left_pids + left_shm + parts, recovery=recovery, note=note)


def reference_output(work: Path, args) -> bytes:
    out = work / "reference.jsonl"
    cmd = [PYTHON, "-m", "spmd_engine.run", "--prompts-file", str(work / "prompts.txt"), "--output", str(out),
           "--max-tokens", str(args.max_tokens), "--quiet"]
    subprocess.run(cmd, cwd=REPO, env=base_env(f"chaos-ref-{uuid.uuid4().hex[:8]}"), check=True, timeout=300)
    return out.read_bytes()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--first", type=int, default=0, help="index of the first trial (replay one: --first K --trials 1)")
    p.add_argument("--launcher", choices=["torchrun", "mp", "both"], default="both")
    p.add_argument("--timeout", type=float, default=20.0, help="the job's --timeout (a hang's limit)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--workdir", default=None)
    args = p.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    (work / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    # One compile cache for every job (the kernels are built by the reference run), as a real
    # deployment keeps one: each attempt's scratch TMPDIR would otherwise rebuild them, and on a
    # busy host that build alone outlasts the mp workers' --timeout to start.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(work / "compile-cache"))
    print(f"chaos: seed {args.seed}, {args.trials} trials, work dir {work}", flush=True)
    reference = reference_output(work, args)
    results = []
    for i in range(args.first, args.first + args.trials):
        r = trial(i, args.seed, args.launcher, reference, work, args)
        results.append(r)
        print(f"trial {r['index']:3d} seed {args.seed} {r['launcher']:8s} faults={','.join(r['faults']):15s} "
              f"rcs={r['rcs']} survived={r['survived']} identical={r['identical']} leaks={r['leaks']} "
              f"recovery={r['recovery']:.1f}s" + ("" if r["survived"] else f" last stderr: {r['note']}"), flush=True)
    survived = sum(r["survived"] for r in results)
    identical = sum(r["identical"] for r in results)
    leaks = sum(len(r["leaks"]) for r in results)
    worst = max((r["recovery"] for r in results), default=0.0)
    print(f"trials {len(results)}, survived {survived}, identical {identical}, leaks {leaks}, "
          f"worst recovery time {worst:.1f}s", flush=True)
    return 0 if survived == identical == len(results) and leaks == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
