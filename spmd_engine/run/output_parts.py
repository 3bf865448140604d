"""Streamed, durable output for long batch jobs: part files, resume, the final merge.

With `--output OUT`, each writer (a replica's head rank under a launcher, or
the launching process) appends every finished record, one JSON line, to its own
part file `OUT.part-<replica>-<token>` as soon as the request finishes; lines
are flushed at once and fsynced at least every FSYNC_S seconds and at the end.
The first line of a part is a header naming the job it belongs to (a digest of
the model, the output-shaping flags and the prompts, plus those parts in the
clear so a mismatch can be named).

At the end one process merges every part into OUT in input order: it indexes
the parts (record index -> file, offset, length; no record is held), copies
the lines in order into a temporary file, fsyncs it, renames it over OUT and
removes the parts. A run that was interrupted (SIGKILL, preemption, a torchrun
restart) leaves its parts; the next run with `--resume` (or automatically under
a torchrun restart or a SLURM requeue) reads which prompts are done and only
generates the rest. A record cut short by a kill (last line without its
newline) does not count as done.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import secrets
import time
from dataclasses import dataclass, field

from spmd_engine.config import ConfigError

logger = logging.getLogger("spmd_engine")

FSYNC_S = 2.0
PART_MAGIC = "spmd_engine_part"


def job_identity(args, job) -> dict:
    """What a part file must match to be resumed: model, the job's output-shaping flags
    (layout and timing flags are not among them), its inputs (see run/records.py)."""
    from spmd_engine.config import ModelConfig
    flags = {name: getattr(args, name, None) for name in job.output_flags}
    flags["model"] = os.path.abspath(ModelConfig(model=args.model).model_dir)
    prompts_digest = hashlib.sha256(job.key().encode()).hexdigest()
    ident = {"flags": flags, "prompts": prompts_digest, "num_prompts": len(job)}
    ident["digest"] = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()
    return ident


def part_paths(output: str) -> list[str]:
    return sorted(glob.glob(glob.escape(output) + ".part-*"))


@dataclass
class PartIndex:
    """Where each finished record sits: index -> (path, offset, length)."""
    locations: dict[int, tuple[str, int, int]] = field(default_factory=dict)
    duplicates: int = 0
    parts: list[str] = field(default_factory=list)


def _differences(theirs: dict, ours: dict) -> str:
    diffs = []
    for name in ours["flags"]:
        a, b = theirs.get("flags", {}).get(name), ours["flags"][name]
        if a != b:
            diffs.append(f"{name.replace('_', '-')} {a!r} (now {b!r})")
    if theirs.get("num_prompts") != ours["num_prompts"] or theirs.get("prompts") != ours["prompts"]:
        diffs.append(f"prompts ({theirs.get('num_prompts')} prompts, now {ours['num_prompts']}, "
                     f"{'same' if theirs.get('prompts') == ours['prompts'] else 'different'} content)")
    return ", ".join(diffs) or "the job digest"


def index_parts(output: str, ident: dict) -> PartIndex:
    """Read every part of `output`; ConfigError when one belongs to a different job."""
    index = PartIndex(parts=part_paths(output))
    for path in index.parts:
        with open(path, "rb") as f:
            header_line = f.readline()
            try:
                header = json.loads(header_line)
            except ValueError:
                header = None
            if not isinstance(header, dict) or header.get(PART_MAGIC) != 1:
                if not header_line.endswith(b"\n"):
                    continue  # killed while writing its header: holds nothing
                raise ConfigError(f"{path} is not a part file of spmd_engine.run; move it away")
            if header.get("digest") != ident["digest"]:
                raise ConfigError(f"cannot resume: {path} was written by a different job: "
                                  f"{_differences(header, ident)}")
            offset = len(header_line)
            for line in f:
                if not line.endswith(b"\n"):
                    break  # cut short by a kill
                try:
                    record_index = json.loads(line)["index"]
                except (ValueError, KeyError, TypeError):
                    break
                if record_index in index.locations:
                    index.duplicates += 1
                else:
                    index.locations[record_index] = (path, offset, len(line))
                offset += len(line)
    return index


class PartWriter:
    """Appends one writer's finished records to its own part file, durably."""

    def __init__(self, output: str, ident: dict, replica: int):
        self.path = f"{output}.part-{replica:04d}-{secrets.token_hex(4)}"
        self._f = open(self.path, "x", encoding="utf-8")
        header = {PART_MAGIC: 1, "digest": ident["digest"], "flags": ident["flags"],
                  "prompts": ident["prompts"], "num_prompts": ident["num_prompts"], "replica": replica}
        self._f.write(json.dumps(header, sort_keys=True) + "\n")
        self._sync()

    def append(self, record: dict) -> None:
        self._f.write(record_line(record))
        self._f.flush()  # in the kernel at once: a killed process loses nothing written
        if time.monotonic() - self._synced >= FSYNC_S:
            self._sync()  # on disk every few seconds: a lost node loses at most that

    def _sync(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._synced = time.monotonic()

    def close(self) -> None:
        if not self._f.closed:
            self._sync()
            self._f.close()


def record_line(record: dict) -> str:
    return json.dumps(record, ensure_ascii=False) + "\n"


def merge_parts(output: str, ident: dict, num_prompts: int, drop_index: bool = False) -> None:
    """Every part into `output`, in input order, atomically; then the parts go. With
    `drop_index` each line leaves out the "index" the parts needed (run_batch's lines are
    OpenAI's batch output objects, which have none)."""
    index = index_parts(output, ident)
    missing = [i for i in range(num_prompts) if i not in index.locations]
    if missing:
        raise RuntimeError(f"cannot write {output}: no record for {len(missing)} prompts "
                           f"(first: {missing[:5]}); the part files are kept for --resume")
    tmp = f"{output}.tmp.{os.getpid()}"
    handles: dict[str, object] = {}
    try:
        with open(tmp, "wb") as out:
            for i in range(num_prompts):
                path, offset, length = index.locations[i]
                f = handles.get(path)
                if f is None:
                    f = handles[path] = open(path, "rb")
                f.seek(offset)
                line = f.read(length)
                if drop_index:
                    record = json.loads(line)
                    del record["index"]
                    line = record_line(record).encode("utf-8")
                out.write(line)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, output)  # readers see the whole file or none
        _fsync_dir(os.path.dirname(os.path.abspath(output)))
    finally:
        for f in handles.values():
            f.close()
        if os.path.exists(tmp):
            os.unlink(tmp)
    for path in index.parts:
        os.unlink(path)
    logger.info("merged %d records from %d part files into %s (%d generated twice)", num_prompts,
                len(index.parts), output, index.duplicates)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def restarted() -> str | None:
    """Why this run continues an earlier attempt by itself (torchrun restart, SLURM requeue)."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        return "torchrun restart"
    if int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0:
        return "SLURM requeue"
    return None
