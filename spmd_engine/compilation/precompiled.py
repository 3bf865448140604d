"""Compiled chunks of layers kept on disk as AOTInductor packages, so a warm start imports no compiler.

A chunk's graph is exported (torch.export) and built by AOTInductor into a package: a shared
library of inductor's kernels and a wrapper that calls them, in one zip file beside inductor's
cache. A later process loads it with torch's C++ loader (`torch._C._aoti`) and calls it with a
flat list of tensors. Loading neither imports dynamo nor inductor (about 1.3 s of a start), runs
inductor's instruction-set probes (1.6 s: six child processes), nor deserialises graphs (1.2 s):
a warm compiled start then costs about what an eager one does (docs/performance.md). The first
process builds and saves each package, then loads it like any later one, so every process runs
the same code.

The weights are inputs, not constants baked into the package: every call passes the chunk's
current tensors, so a weight update (in place, or a repacked Parameter) is what the next step
uses, and one package serves every model of the same shapes. Packed (oneDNN) weights reach the
graph only through `spmd_engine::linear`, which is eager code; the export sees a dense tensor
of the same shape in their place. The KV caches are inputs too, written in place.

A package carries no guards on the code it came from, so a file's name is a digest of everything
that decides the graph: torch's and Python's versions, the CPU's instruction set and the thread
count (baked into the kernels' OpenMP loops), the source the graph is traced from (the model,
the compiler, the kernels: GRAPH_SOURCES), the model's shape facts, dtype, device, TP size and group numbers, which weights are packed, whether the stage
ends in the final norm (the last pipeline stage's graphs return it too), how many LoRA layers a
layer carries (their `spmd_engine::lora` ops are in the graph), the chunk's length,
the graph's kind (one token or more, decode or general), backend and mode. Any change is another
file. What the package needs of its inputs (dtype, rank, fixed sizes, contiguity, the token
count: >= 2, or exactly 1 for the one-token graph) is written into its metadata and checked
before every call (`Package.accepts`); a call it refuses runs eager. A file that cannot be read
is built afresh and replaced; files are written to a temporary name and renamed, so no reader
ever sees half a file. Processes on one machine that need the same package (TP ranks and PP
stages of one shape, DP replicas, two jobs) build it once: the builder holds a lock on the file's
name (`build_lock`), the others wait for it and then load what it saved, instead of all
compiling the same graph at once on the same cores.

A package is native code that the engine loads and runs: whoever can write the inductor cache
directory can run code in the engine, as with inductor's own cached kernels there
(docs/security.md).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

from spmd_engine.kernels import decode_attention
from spmd_engine.kernels.native import build_lock, cache_dir  # noqa: F401  (build_lock: the compiler's too)
from spmd_engine.kernels.packed_weights import layout

logger = logging.getLogger("spmd_engine")

FOLDER = "spmd_engine_precompiled"
SUFFIX = ".pt2"
_SPEC_KEY = "spmd_engine.inputs"
# The dynamic dims: tokens in the step, KV blocks in a cache (NB, NB1, ...: one per KV cache
# group), blocks a decode token reads.
_MIN = {"N": 2, "NB": 2, "B": 2}
# What a graph is traced from, under spmd_engine/ (digest hashes their source).
GRAPH_SOURCES = ("model", "compilation", "kernels", "forward_context.py", "platform.py")


def applies(backend: str, device: torch.device | str = "cpu") -> bool:
    """Inductor with its caches on (`torch.compiler.config`, which inductor's own config
    aliases: reading it imports no compiler), on CPU: loading a CUDA package crashed the process
    (docs/performance.md), so compiled CUDA models go through dynamo at every start."""
    import torch.compiler.config
    return (backend == "inductor" and not torch.compiler.config.force_disable_caches
            and torch.device(device).type == "cpu")


@functools.lru_cache(maxsize=None)
def _source_digest() -> str:
    """The source of everything a graph is traced from: the model, this compiler, the kernels
    and the forward-time state."""
    root = Path(__file__).resolve().parent.parent  # spmd_engine/
    h = hashlib.sha256()
    for part in GRAPH_SOURCES:
        for path in sorted((root / part).rglob("*.py")) if (root / part).is_dir() else [root / part]:
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def digest(model, chunk_length: int, backend: str, mode: str | None, single: bool = False,
           decode: bool = False, windows: tuple = ()) -> str:
    """What decides a chunk's graph, hashed (the module docstring lists it); `single`: the graph
    of one-token steps; `decode`: of decode-shaped steps (attention traced); `windows`: the
    chunk's layers' sliding windows."""
    first = next(iter(model.model.layers.values()))
    packed = tuple(layout(m.weight) for m in first.modules() if getattr(m, "packable_weight", False))
    kernel = decode and decode_attention.usable(model.device)  # the graph calls the kernel's op
    groups = tuple(m.compile_group for m in model.modules() if hasattr(m, "compile_group"))  # row-parallel linears
    lora = sum(getattr(m, "lora", None) is not None for m in first.modules())  # the graph's LoRA ops
    facts = ("aoti", torch.__version__, sys.version, platform.machine(), torch.backends.cpu.get_cpu_capability(),
             torch.get_num_threads(), _source_digest(), repr(model.spec), str(model.dtype), model.device.type,
             model.tp_group.world_size, groups, packed, chunk_length, backend, mode, single, decode, kernel,
             model.model.norm is not None, lora)  # the last stage's graphs end in the final norm
    if any(w is not None for w in windows):  # (full attention keeps its packages' names)
        facts += (windows,)
    return hashlib.sha256(repr(facts).encode()).hexdigest()[:32]


def path_for(key: str) -> Path:
    return cache_dir() / FOLDER / f"{key}{SUFFIX}"


def _entry(t: torch.Tensor, dims: dict[int, str] | None, any_layout: bool) -> list:
    sizes = [(dims or {}).get(i, s) for i, s in enumerate(t.shape)]
    return [str(t.dtype), t.device.type, sizes, any_layout]


class Package:
    """A loaded package: `accepts(flat)` says whether it was built for these inputs, `(flat)` runs it."""

    def __init__(self, path: Path, loader):
        self.path, self._loader = path, loader
        spec = json.loads(loader.get_metadata()[_SPEC_KEY])
        self._spec = [(getattr(torch, dtype.removeprefix("torch.")), device, sizes, any_layout)
                      for dtype, device, sizes, any_layout in spec]
        self._fixed = 0  # inputs, from the first, that were accepted as the same objects last time
        self._last: list = []
        self._fixed_bound: dict[str, int] = {}  # the dynamic sizes those inputs had then, by name
        self._intact = False  # the last accepts() found them the same objects

    def __call__(self, flat: list) -> list:
        return self._loader.run(flat)

    def accepts(self, flat: list) -> bool:
        """Dtype, device, rank, every fixed size, contiguity (not for a packed weight's place),
        dynamic sizes at their minimum and equal where they share a name. The weights and caches
        (a list's leading inputs) are checked again only when one is another object than last
        time; until then the dynamic sizes they had (a cache's block count) stand for them: the
        engine never resizes a tensor in place."""
        if len(flat) != len(self._spec):
            return False
        lead = self._fixed
        self._intact = bool(lead) and all(a is b for a, b in zip(flat[:lead], self._last))
        if not self._intact:
            lead = 0
        accepted = self._check(flat, range(lead, len(flat)), dict(self._fixed_bound) if lead else {}) is not None
        self._intact = self._intact and accepted  # remember() after a refusal looks at its inputs afresh
        return accepted

    def _check(self, flat: list, indices, bound: dict[str, int]) -> dict[str, int] | None:
        """The dynamic sizes bound by `indices`' inputs (on top of `bound`), or None if one is
        not what the package was built for."""
        for i in indices:
            t, (dtype, device, sizes, any_layout) = flat[i], self._spec[i]
            if t.dtype != dtype or t.device.type != device or t.dim() != len(sizes):
                return None
            if not (any_layout or t.is_contiguous()):
                return None
            for want, got in zip(sizes, t.shape):
                if isinstance(want, str):
                    if bound.setdefault(want, got) != got or got < _MIN[want.rstrip("0123456789")]:
                        return None
                elif want != got:
                    return None
        return bound

    def remember(self, flat: list, leading: int) -> None:
        """The first `leading` inputs (weights, caches) of an accepted call: the same objects next
        time need no checks."""
        if self._intact and leading == self._fixed:
            return
        self._fixed, self._last = leading, list(flat[:leading])
        self._fixed_bound = self._check(flat, range(leading), {}) or {}
        self._intact = False


def load(path: Path) -> Package | None:
    """The package at `path`, or None if there is none or it cannot be read."""
    if not path.exists():
        return None
    try:
        loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
        return Package(path, loader)
    except Exception as exc:  # a torch upgrade's leftovers, a truncated file: build again
        logger.warning("compiled forward: cannot load %s (%s: %s); compiling it again", path,
                       type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return None


def build_and_save(program, example: tuple, dynamic_shapes: tuple, any_layout: list[bool],
                   mode: str | None, path: Path) -> Package:
    """Export `program` (a torch.nn.Module) on `example`, build it with AOTInductor into `path`
    (through a temporary name), and load it. `any_layout[i]`: flat input i may be a packed
    weight (the export gets a dense stand-in). Without a writable cache the package is built in
    a temporary directory and used from there, not kept."""
    import torch._inductor
    from torch.utils import _pytree
    ep = torch.export.export(program, example, dynamic_shapes=dynamic_shapes, strict=False)
    flat_example = _pytree.tree_leaves(example)
    flat_dims = _flat_dims(example, dynamic_shapes)
    spec = [_entry(t, d, a) for t, d, a in zip(flat_example, flat_dims, any_layout)]
    configs = {k: v for k, v in torch._inductor.list_mode_options(mode).items() if not k.startswith("triton.")} \
        if mode else {}
    configs["aot_inductor.metadata"] = {_SPEC_KEY: json.dumps(spec)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        target, keep = path, True
    except OSError as exc:
        logger.warning("compiled forward: not saved to %s (%s); the next start compiles again", path, exc)
        target, keep = Path(tempfile.mkdtemp()) / path.name, False
    tmp = target.with_name(f"{target.stem}.{os.getpid()}.tmp{SUFFIX}")  # AOTInductor wants the suffix
    try:
        torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp), inductor_configs=configs)
        os.replace(tmp, target)
        package = load(target)
    finally:
        tmp.unlink(missing_ok=True)
        if not keep:
            target.unlink(missing_ok=True)
            target.parent.rmdir()
    if package is None:
        raise RuntimeError(f"compiled forward: the package just built at {target} does not load")
    return package


def _flat_dims(example, dynamic_shapes) -> list:
    """dynamic_shapes (a tree like `example`'s, dicts of dim -> torch.export.Dim at the tensors)
    -> one {dim: name} or None per flat tensor, in `example`'s leaf order."""
    out = []

    def walk(x, d):
        if isinstance(x, torch.Tensor):
            out.append({i: dim.__name__ for i, dim in d.items()} if d else None)
        elif isinstance(x, (list, tuple)):
            for i, item in enumerate(x):
                walk(item, d[i] if d is not None else None)

    walk(example, dynamic_shapes)
    return out
