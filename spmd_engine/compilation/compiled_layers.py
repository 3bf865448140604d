"""The compiled forward (vLLM's `enforce_eager=False`): decoder layers through torch.compile.

What is compiled is a run of up to `layers_per_graph` consecutive decoder layers (a "chunk"):
every layer of a model runs the same code on its own weights, so dynamo traces one chunk and
inductor's C++ backend fuses the work between the matmuls (RMSNorm with its residual add,
rotary, the SwiGLU product, splits and casts, and across a layer boundary the residual add into
the next norm) into a few loops. Every chunk of the same length then shares that graph: the
layers are cut into chunks of as equal length as can be, so a model has one or two graphs
whatever its depth, and compiling costs one chunk's tracing however deep the model is (the
first layer gets a zero residual: x + 0 == x). A chunk rather than one layer per graph because
each entry into a graph has a fixed cost (dynamo's frame and guards, the wrapper), and at
decode sizes eight of them a step cost more than the fusion gained (docs/performance.md). On
the last pipeline stage every chunk also returns the final norm of its result (RMSNorm of hidden
+ residual, with the model's norm weight): the last chunk's is the model's output, so the final
norm costs no eager ops, and every chunk keeping one signature
keeps one graph per chunk length (an earlier chunk's norm, one small fused loop, is thrown away).
The embedding, rotary cos/sin, the LM head and sampling stay eager.

Three things inside a layer are opaque to the compiler, each a custom op with a shape-only
("fake") implementation, so the graph has no break in it:
  - `spmd_engine::attention`: the paged KV-cache write and the attention read, given the
    step's AttentionMetadata through `forward_context` (Python lists and dataclasses, never
    traced: a step's metadata is not a guard, so a new batch does not recompile);
  - `spmd_engine::linear`: the matmul, oneDNN-packed weight or not: inductor cannot read a
    packed tensor, and traced, a packed weight looks like a plain one (a weight packed for
    vnni_gemm is a plain 4-D tensor: the graph calls that kernel's C++ op itself, with no Python
    on the way);
  - `spmd_engine::all_reduce`: the TP sum over our shared-memory path (distributed/), never
    traced: the group is looked up by a number fixed at set-up.
A step's token count N varies: the chunk's inputs are marked dynamic along it, so one graph
serves every N >= 2. Decode-shaped steps (one new token per request, each with a cache: most
steps of a generation) get graphs of their own, where attention is not the opaque op but
traced (attention.decode_attention, its metadata a tuple of tensors passed in: slots, block
tables dynamic along N and the number of blocks, sequence lengths), so inductor fuses the cache
reads into a few loops; at decode sizes the opaque op's Python, dispatch and SDPA's fixed work
cost more than the attention itself (docs/performance.md). One decode token (a single request's decode) has a graph of its own,
since dynamo specialises a size of 1; a lone one-token step of another kind runs eager, as do
steps of fewer than `min_tokens` tokens. On CPU only: on CUDA decode steps run their layers
eager, replayed as CUDA graphs (CompiledLayers.decode_graphs says why).

With inductor (and its caches on) each chunk length's graph is built ahead of time into an
AOTInductor package on disk (precompiled.py, chunk_program.py): exported once, then loaded by
torch's C++ loader in this process and every later one, so a warm start imports neither dynamo
nor inductor. Other backends (and inductor with its caches forced off) go through dynamo at
every start: each model then gets its own copy of the compiled function's code object, so
dynamo's cache is per model (two models in one process, as in tests or an RL trainer beside its
engine, never share a graph), and guards on the layer modules are skipped (every compiled layer
is built alike; weights are inputs, only their values change).

Not compiled, by design: batch-invariant mode (its kernels fix every reduction order and
inductor would choose its own: eager keeps it bitwise exact), MoE layers (data-dependent
routing), routing replay. CUDA graphs of decode steps are the worker's (worker/decode_graphs.py).
"""

from __future__ import annotations

import logging
import time
import types
import weakref

import torch

from spmd_engine.compilation import precompiled
from spmd_engine.compilation.chunk_program import ChunkProgram, windows
from spmd_engine.forward_context import COMPILED, set_forward_context, set_lora_chunk
from spmd_engine.kernels.packed_weights import eager_linear

logger = logging.getLogger("spmd_engine")

# Steps with fewer tokens than this run eager by default (measured, docs/performance.md).
DEFAULT_MIN_TOKENS = 1
# Decoder layers per compiled graph by default (measured, docs/performance.md).
DEFAULT_LAYERS_PER_GRAPH = 8

# The ops a compiled layer calls that the compiler keeps opaque; `spmd_engine::attention` is the
# attention layer's own (model/layers/attention.py), its metadata read from forward_context.
_lib = torch.library.Library("spmd_engine", "FRAGMENT")  # the ops live as long as the process
_lib.define("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_lib.define("all_reduce(Tensor x, int group) -> Tensor")


def _linear(x, weight, bias):
    # Not packed_weights.linear, whose is_compiling check costs a few us of the op's 4 calls
    # a layer.
    return eager_linear(x, weight, bias)


_groups: dict[int, weakref.ref] = {}


def register_group(group) -> int:
    """A number for `group` that a compiled graph can carry as a constant."""
    for key, ref in _groups.items():
        if ref() is group:
            return key
    key = len(_groups)
    _groups[key] = weakref.ref(group)
    return key


def _all_reduce(x, group):
    # A new tensor: the op is functional to the compiler, and the group sums in place.
    return _groups[group]().all_reduce(x.clone())


for _name, _fn in (("linear", _linear), ("all_reduce", _all_reduce)):
    _lib.impl(_name, _fn, "CompositeExplicitAutograd")


@torch.library.register_fake("spmd_engine::linear")
def _linear_fake(x, weight, bias):
    out_features = weight.shape[0] * 16 if weight.dim() == 4 else weight.shape[0]  # vnni_gemm.pack's blocks
    return x.new_empty(*x.shape[:-1], out_features)


@torch.library.register_fake("spmd_engine::all_reduce")
def _all_reduce_fake(x, group):
    return torch.empty_like(x)


def _chunk_step(layers, cos, sin, hidden, residual, decode, norm):
    # decode: a DecodeStep's tensors as a plain tuple (a saved graph cannot guard on a class),
    # and the layers trace attention; None: the opaque op reads forward_context. norm: the
    # model's final RMSNorm on the last stage (its result comes back too), else None.
    attn = COMPILED if decode is None else decode
    for layer in layers:  # unrolled by dynamo: one graph for the chunk's length
        hidden, residual = layer((cos, sin), hidden, residual, attn)
    if norm is None:
        return hidden, residual
    return hidden, residual, norm(hidden, residual)[0]


def chunks(layers: list, layers_per_graph: int) -> list[tuple]:
    """`layers` cut into the fewest runs of at most `layers_per_graph`, of as equal length as can
    be (two lengths at most, so two graphs at most)."""
    if not layers:
        return []
    count = -(-len(layers) // max(1, layers_per_graph))
    base, longer = divmod(len(layers), count)
    out, at = [], 0
    for i in range(count):
        size = base + (i < longer)
        out.append(tuple(layers[at:at + size]))
        at += size
    return out


def _skip_module_guards(entries):
    return torch.compiler.skip_guard_on_all_nn_modules_unsafe(entries)


class CompiledLayers:
    """One model's compiled decoder layers: `run(rope, hidden, residual, attn)` gives (hidden,
    residual, the final norm's output: None where this stage has no norm or its last chunk ran
    eager).

    With inductor each chunk length's graph is an AOTInductor package kept on disk
    (precompiled.py), loaded without tracing; other backends (and inductor with its caches
    forced off) go through dynamo at every start."""

    def __init__(self, model, backend: str = "inductor", mode: str | None = None,
                 min_tokens: int = DEFAULT_MIN_TOKENS, layers_per_graph: int = DEFAULT_LAYERS_PER_GRAPH):
        for module in model.modules():  # the row-parallel linears: their all-reduce is an op of ours
            if hasattr(module, "compile_group") and module.tp_size > 1:
                module.compile_group = register_group(module.group)
        self.model_ref = weakref.ref(model)
        self.backend, self.mode = backend, mode
        self.chunks = chunks(list(model.model.layers.values()), layers_per_graph)
        # Each chunk's LoRA layers (model/lora/), numbered by their place in the chunk: its
        # graph's `spmd_engine::lora` ops name them so (forward_context.set_lora_chunk).
        self.chunk_loras = [[m.lora for layer in chunk for m in layer.modules() if getattr(m, "lora", None)]
                            for chunk in self.chunks]
        for loras in self.chunk_loras:
            for position, lora in enumerate(loras):
                lora.chunk_position = position
        self.lora = any(self.chunk_loras)
        self.norm = model.model.norm  # the last stage's final norm, fused into its graphs; else None
        self.ahead = precompiled.applies(backend, model.device)
        # Decode graphs trace attention, its in-place cache write included: on CPU the compiled
        # graph writes the slots in place; through dynamo on CUDA the write became a copy of the
        # whole cache every step (many times eager's step, and out of memory at
        # --gpu-memory-utilization 0.9: docs/performance.md). There decode steps run their layers eager (replayed
        # as CUDA graphs, worker/decode_graphs.py) and the other steps go through the graph.
        self.decode_graphs = model.device.type == "cpu"
        self.min_tokens = max(1, int(min_tokens))
        self.built: dict[tuple[int, bool, bool], object] = {}  # (chunk length, one token?, decode?) -> graph
        self.loaded: list[str] = []  # files the built graphs came from (the rest were compiled now)
        self.refused = 0  # calls whose inputs the graph's checks refused (run eager)
        if self.ahead:
            self.programs = [ChunkProgram(chunk, self.norm) for chunk in self.chunks]
            return
        # One dynamo cache per chunk's sliding windows (its guards skip the modules, so a graph
        # traced for one chunk's windows must never serve a chunk of other windows).
        self.codes, self.fns = {}, {}
        options = {"guard_filter_fn": _skip_module_guards}
        kwargs = {"mode": mode} if mode and backend == "inductor" else {}
        for chunk in self.chunks:
            if (key := windows(chunk)) not in self.fns:
                self.codes[key] = _chunk_step.__code__.replace()  # this model's own dynamo cache
                step = types.FunctionType(self.codes[key], _chunk_step.__globals__, "_chunk_step")
                self.fns[key] = torch.compile(step, backend=backend, fullgraph=True, dynamic=None, options=options,
                                              **kwargs)

    def mark_caches_dynamic(self, attention_layers) -> None:
        """A traced graph serves any number of KV blocks: the caches' first dim is dynamic.
        Marked here, not where a cache is bound, so that an eager model never imports dynamo (a
        second of start-up); a package's caches are inputs with that dim dynamic already."""
        if self.ahead:
            return
        for attention in attention_layers:
            for cache in (attention.k_cache, attention.v_cache):
                if cache is not None and cache.shape[0] > 1:
                    torch._dynamo.maybe_mark_dynamic(cache, 0)

    def graphs(self) -> int:
        """How many graphs this model holds: per chunk length, one for general steps of 2 or more
        tokens and one each for decode steps of one token and of more (so 3 or 6 when nothing
        recompiled)."""
        if self.ahead:
            return len(self.built)
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
        return sum(len(_debug_get_cache_entry_list(code)) for code in self.codes.values())

    def applies(self, attn) -> bool:
        """Whether this step runs compiled: enough tokens, and not a one-token step other than
        a decode (a lone one-token prompt, a DP wave's dummy step: rare, and a graph each)."""
        if isinstance(attn, tuple):  # a DecodeStep itself (worker/decode_graphs.py's buffers)
            return self.decode_graphs and attn[0].shape[0] >= self.min_tokens
        if attn.num_tokens < self.min_tokens:
            return False
        return attn.num_tokens > 1 or (self.decode_graphs and attn.decode_step() is not None)

    def warm_up_steps(self) -> list[tuple[int, bool]]:
        """(token count, decode?) of the start-up steps that build every graph later steps use."""
        n = max(2, self.min_tokens)
        if not self.decode_graphs:
            return [(n, False)]
        return ([(1, True)] if self.min_tokens == 1 else []) + [(n, True), (n, False)]

    def run(self, rope, hidden, residual, attn):
        if residual is None:  # the first stage's first layer: one graph for all (x + 0 == x)
            residual, hidden = hidden, torch.zeros_like(hidden)
        cos, sin = rope
        decode = (attn if isinstance(attn, tuple) else attn.decode_step()) if self.decode_graphs else None
        decode = None if decode is None else tuple(decode)
        with set_forward_context(attn):
            if not self.ahead:
                for t in (cos, sin, hidden, residual, *(decode or ())):
                    torch._dynamo.maybe_mark_dynamic(t, 0)
                if decode is not None:
                    torch._dynamo.maybe_mark_dynamic(decode[1], 1)  # the block tables
                for chunk, loras in zip(self.chunks, self.chunk_loras):
                    with set_lora_chunk(loras):
                        hidden, residual, *normed = self.fns[windows(chunk)](chunk, cos, sin, hidden, residual,
                                                                             decode, self.norm)
                return hidden, residual, (normed or [None])[0]
            kind = (hidden.shape[0] == 1, decode is not None)
            for chunk, program, loras in zip(self.chunks, self.programs, self.chunk_loras):
                package = self.built.get((len(chunk), windows(chunk), *kind)) or self._build(program, cos, sin, hidden, residual,
                                                                              decode, *kind)
                flat = program.flat_inputs(cos, sin, hidden, residual, decode)
                if package.accepts(flat):
                    package.remember(flat, program.leading)
                    with set_lora_chunk(loras):
                        hidden, residual, *normed = package(flat)
                else:
                    hidden, residual = self._eager(chunk, cos, sin, hidden, residual, attn)
                    normed = []  # the eager caller norms
        return hidden, residual, (normed or [None])[0]

    def _build(self, program, cos, sin, hidden, residual, decode, single: bool, is_decode: bool):
        """The package for this chunk length and kind (one token or more, decode or general):
        from disk, or exported, built and saved now (or, if another process was building it,
        from disk once it is done)."""
        chunk = program.chunk
        key = precompiled.digest(self.model_ref(), len(chunk), self.backend, self.mode, single, is_decode,
                                 windows(chunk))
        path = precompiled.path_for(key)
        package, built = precompiled.load(path), False
        if package is None:
            with precompiled.build_lock(path) as waited:
                package = precompiled.load(path) if waited else None  # what the other process saved
                if package is None:
                    kind = "decode steps of one token" if single else "decode steps" if is_decode else "steps"
                    logger.info("compiling the graph of %d layers for %s into %s (a first start "
                                "on this cache only; later starts load it)", len(chunk), kind, path.parent)
                    started = time.perf_counter()
                    example = _export_example(program, cos, sin, hidden, residual, decode, single)
                    package, built = precompiled.build_and_save(program, *example, self.mode, path), True
                    logger.info("compiled the graph for %s in %.1f s", kind,
                                time.perf_counter() - started)
        if not built:
            self.loaded.append(str(path))
        self.built[len(chunk), windows(chunk), single, is_decode] = package
        return package

    def _eager(self, chunk, cos, sin, hidden, residual, attn):
        if not self.refused:
            logger.warning("compiled forward: a step's inputs do not fit the compiled graph (%d tokens); "
                           "running its layers eager", hidden.shape[0])
        self.refused += 1
        for layer in chunk:
            hidden, residual = layer((cos, sin), hidden, residual, attn)
        return hidden, residual


def _export_example(program, cos, sin, hidden, residual, decode, single: bool):
    """(example inputs, their dynamic dims, which flat inputs may be packed weights) for
    exporting `program`: packed weights get dense stand-ins of their shape and dtype (the export
    cannot fake an oneDNN tensor; the graph passes them to spmd_engine::linear unread)."""
    from torch.export import Dim
    weights, caches = program.weights(), program.caches()
    stand_ins = [torch.empty(w.shape, dtype=w.dtype, device=w.device) if w.is_mkldnn else w for w in weights]
    n, width = (None if single else Dim("N", min=2)), Dim("B", min=2)
    # One block-count dim per sliding window: a KV cache of several groups (core/kv_groups.py)
    # gives each group's layers a pool of its own size.
    blocks = {}
    for window in program.cache_windows():
        blocks.setdefault(window, Dim("NB" if not blocks else f"NB{len(blocks)}", min=2))
    tokens = None if n is None else {0: n}
    step = None if decode is None else (tokens, {**(tokens or {}), 1: width}, tokens)
    example = (stand_ins, caches, cos, sin, hidden, residual, decode)
    dims = ([None] * len(weights),
            [{0: blocks[w]} if c.shape[0] > 1 else None for c, w in zip(caches, program.cache_windows())],
            tokens, tokens, tokens, tokens, step)
    any_layout = program.packed() + [False] * (len(caches) + 4 + len(decode or ()))
    return example, dims, any_layout
