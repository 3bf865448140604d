"""Compiled chunks of layers kept on disk between processes, so that a warm start skips dynamo.

Inductor's cache makes a second process's compile a lookup of kernels, but dynamo still traces
the chunk's Python at every start: with importing inductor, most of a warm start's compile
seconds (docs/performance.md). torch can save what dynamo and inductor made of a function
(`aot_compile`, `save_compiled_function`) and load it in another process without tracing.

A saved graph carries no guards on the code it came from (those cannot be saved), so a file's
name is a digest of everything that decides the graph: torch's and Python's versions, the CPU's
instruction set, the source of spmd_engine/model, the model's shape facts, dtype, device, TP
size and group numbers, which weights are packed, the chunk's length, the graph's kind (one
token or more, decode or general), backend and mode. Any change is another file. A file that
cannot be read is compiled afresh and replaced; files are written to a temporary name and
renamed, so TP ranks saving the same chunk at once cannot corrupt it. What is kept are the guards on the inputs
(dtypes, strides, the token count: N >= 2, or exactly 1 for the one-token graph; the chunk's
length), checked before every call: a call they refuse runs eager.

A file is a pickle: whoever can write the inductor cache directory can run code in the engine,
as with inductor's own cached kernels there (docs/security.md).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
import sys
from pathlib import Path

import torch

logger = logging.getLogger("spmd_engine")

FOLDER = "spmd_engine_precompiled"
# Guards on the Python modules and functions the layers call: the first three cannot be saved,
# and a global DUPLICATE_INPUT guard names modules by aliases only the tracing process defines
# (it fails in any other). The digest (the source of spmd_engine/model) stands in for them.
UNSAVABLE_GUARDS = frozenset({"MODULE_MATCH", "CLOSURE_MATCH", "BUILTIN_MATCH"})


def applies(backend: str) -> bool:
    """Inductor with its caches on: aot_compile refuses to run with them forced off."""
    return backend == "inductor" and not torch._inductor.config.force_disable_caches


def savable_guards(entries, keep) -> list[bool]:
    """`keep` (a guard filter's verdicts) less the guards that cannot be saved."""
    return [k and e.guard_type not in UNSAVABLE_GUARDS
            and not (e.guard_type == "DUPLICATE_INPUT" and e.name.startswith("G["))
            for k, e in zip(keep, entries)]


@functools.lru_cache(maxsize=None)
def _source_digest() -> str:
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def digest(model, chunk_length: int, backend: str, mode: str | None, single: bool = False,
           decode: bool = False) -> str:
    """What decides a chunk's graph, hashed (the module docstring lists it); `single`: the graph
    of one-token steps; `decode`: of decode-shaped steps (attention traced)."""
    from spmd_engine.model.layers.linear import RowParallelLinear
    first = next(iter(model.model.layers.values()))
    packed = tuple(m.weight.is_mkldnn for m in first.modules() if getattr(m, "packable_weight", False))
    groups = tuple(getattr(m, "compile_group", None) for m in model.modules() if isinstance(m, RowParallelLinear))
    facts = (torch.__version__, sys.version, platform.machine(), torch.backends.cpu.get_cpu_capability(),
             _source_digest(), repr(model.spec), str(model.dtype), model.device.type,
             model.tp_group.world_size, groups, packed, chunk_length, backend, mode, single, decode)
    return hashlib.sha256(repr(facts).encode()).hexdigest()[:32]


def path_for(key: str) -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    return Path(cache_dir()) / FOLDER / f"{key}.bin"


def load(path: Path, f_globals: dict):
    """The saved function at `path`, its globals (and its guards' globals) `f_globals`, or None
    if there is none or it cannot be read."""
    if not path.exists():
        return None
    try:
        with open(path, "rb") as f:
            return torch.compiler.load_compiled_function(f, f_globals=f_globals)
    except Exception as exc:  # a torch upgrade's leftovers, a truncated file: compile again
        logger.warning("compiled forward: cannot load %s (%s: %s); compiling it again", path,
                       type(exc).__name__, exc)
        return None


def compile_and_save(compiled, example_args: tuple, path: Path):
    """aot_compile `compiled` (a torch.compile'd function) on `example_args` and save it."""
    fn = compiled.aot_compile((example_args, {}))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fn.save_compiled_function(str(path))
    except (OSError, RuntimeError) as exc:  # a read-only cache, a graph torch cannot pickle
        logger.warning("compiled forward: not saved to %s (%s); the next start traces again", path, exc)
    return fn
