"""CUDA graphs for decode steps (vLLM's `cudagraph_mode`, here always FULL_DECODE_ONLY).

On a GPU a small model's decode step is hundreds of kernel launches, and the host's few
microseconds for each, not the GPU, set the step's time. A graph launches the whole forward and
the LM head at once. It replays fixed shapes on fixed memory, so each batch size in
`sizes` gets its own graph, and a step of B requests replays the smallest size >= B: its extra
rows are padding, pointed at a spare KV block that the scheduler never hands out (the runner
allocates the cache one block larger), so padding never reads or writes a request's cache. The
graph's inputs are buffers every step copies into (token ids, positions and a DecodeStep:
slots, block tables as wide as max_model_len needs, sequence lengths); its outputs (the final
hidden states and every row's logits) are read before the next step replays.

A graph holds the addresses its kernels read. When any weight or cache tensor is not the one
captured against (sleep and wake_up, a KV cache allocated again, a weight replaced rather than
copied into), every graph is stale: each step compares the model's tensors' addresses with
those at capture and captures again when they differ, so no graph reads memory that is no longer
the model's.

Other steps (prompts, chunks, mixed batches, batches above the largest size) run as before.
With `capture=False` the same buffers and padding run without a graph, each call a forward:
how tests on a machine without CUDA check everything but the capture.
"""

from __future__ import annotations

import logging
import time

import torch

logger = logging.getLogger("spmd_engine")

MAX_CAPTURE_SIZE = 512  # vLLM's default cap


def default_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's capture sizes (1, 2, 4, then multiples of 8) up to the first that holds max_num_seqs."""
    sizes = []
    for n in [1, 2, 4, *range(8, MAX_CAPTURE_SIZE + 1, 8)]:
        sizes.append(n)
        if n >= max_num_seqs:
            break
    return sizes


class DecodeGraphs:
    """`run(input_ids, positions, step)` -> (hidden [B, H], logits [B, vocab]) for a decode step of
    B <= max(sizes) requests, through the graph of the smallest size that holds it."""

    def __init__(self, model, sizes, max_blocks_per_seq: int, spare_block: int, block_size: int,
                 device, capture: bool = True):
        self.model = model
        self.sizes = sorted(set(sizes))
        self.block_size = block_size
        self.spare_block = spare_block
        self.capture = capture
        n, width = self.sizes[-1], max(2, max_blocks_per_seq)  # a width of 1 would be its own compiled graph
        as_long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(n, **as_long)
        self.positions = torch.zeros(n, **as_long)
        self.slots = torch.zeros(n, **as_long)
        self.block_tables = torch.zeros(n, width, **as_long)
        self.seq_lens = torch.zeros(n, **as_long)
        self._graphs: dict[int, tuple] = {}  # size -> (graph or None, hidden, logits)
        self._addresses: tuple | None = None  # the weights' and caches' at capture
        self.captures = 0  # how many times every size was captured (1 unless the memory moved)
        self.steps = 0  # decode steps run through the graphs
        self.capture_seconds = 0.0

    def size_for(self, num_tokens: int) -> int | None:
        return next((n for n in self.sizes if n >= num_tokens), None)

    def release(self) -> None:
        """Drop the graphs and their memory (sleep); the next run captures again."""
        self._graphs.clear()
        self._addresses = None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, step) -> tuple[torch.Tensor, torch.Tensor]:
        n = input_ids.shape[0]
        size = self.size_for(n)
        if size is None:
            raise ValueError(f"a decode step of {n} requests is above the largest graph ({self.sizes[-1]})")
        if self._addresses != self._model_addresses():
            self.capture_all()
        if step.block_tables.shape[1] > self.block_tables.shape[1]:
            raise ValueError(f"block tables {step.block_tables.shape[1]} wide, the graphs' hold "
                             f"{self.block_tables.shape[1]}")
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(step.slots)
        self.seq_lens[:n].copy_(step.seq_lens)
        # Columns past this step's width keep older block ids: every one is a block of the cache,
        # and no key there is within a row's sequence length, so none is read unmasked.
        self.block_tables[:n, :step.block_tables.shape[1]].copy_(step.block_tables)
        self._pad(n, size)
        graph, hidden, logits = self._graphs[size]
        self.steps += 1
        if graph is None:
            hidden, logits = self._forward(size)
        else:
            graph.replay()
        return hidden[:n], logits[:n]

    def capture_all(self) -> None:
        """A graph for every size, largest first (the smaller ones reuse its memory pool), against
        the model's tensors as they are now; every row is padding meanwhile, so the warm-up and
        capture forwards write only the spare block."""
        t = time.perf_counter()
        self.release()
        pool = torch.cuda.graph_pool_handle() if self.capture else None
        for size in reversed(self.sizes):
            self._pad(0, size)
            if not self.capture:
                self._graphs[size] = (None, None, None)
                continue
            for _ in range(2):  # compiles and autotunes (dynamo, inductor), allocates outside the graph
                self._forward(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden, logits = self._forward(size)
            self._graphs[size] = (graph, hidden, logits)
        self._addresses = self._model_addresses()
        self.captures += 1
        self.capture_seconds = time.perf_counter() - t
        if self.capture:
            logger.info("CUDA graphs: decode steps of %s requests captured in %.2f s", _ranges(self.sizes),
                        self.capture_seconds)

    def _pad(self, start: int, end: int) -> None:
        """Rows [start, end) as padding: token 0 at position 0 of the spare block, one key seen."""
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.slots[start:end] = self.spare_block * self.block_size
        self.seq_lens[start:end] = 1
        self.block_tables[start:end] = self.spare_block

    def _forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        from spmd_engine.model.layers.attention import DecodeStep
        step = DecodeStep(self.slots[:size], self.block_tables[:size], self.seq_lens[:size])
        hidden = self.model.forward(self.input_ids[:size], self.positions[:size], step)["hidden_states"]
        return hidden, self.model.compute_logits(hidden)

    def _model_addresses(self) -> tuple:
        caches = [c for a in self.model._attention_layers() for c in (a.k_cache, a.v_cache)]
        return tuple(t.data_ptr() if t is not None else 0 for t in (*self.model.parameters(), *caches))


def _ranges(sizes: list[int]) -> str:
    return ", ".join(map(str, sizes)) if len(sizes) <= 6 else f"{', '.join(map(str, sizes[:4]))}, ..., {sizes[-1]}"
