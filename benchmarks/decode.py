"""Figure decode: the engine's decode against transformers on the same weights, and against
the machine itself. A decode step reads every weight once, so memory bandwidth is its roofline;
the step's weight matmuls timed alone are the ceiling these kernels allow, and the step over its
matmuls is what the engine adds around them (scheduling, attention, sampling)."""

from __future__ import annotations

import statistics
import time

from benchmarks.harness import LLAMA_SHAPE, emit, loadavg, prompts_for, random_llama, time_engine


def hf_generator(model_dir: str, dtype):
    """(tokens/s function, kind): transformers' generate if importable, else a plain torch loop."""
    import torch
    try:
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()

        def run(prompts, new_tokens):
            ids = torch.tensor(prompts)
            t = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                     min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            dt = time.perf_counter() - t
            assert out.shape[1] == ids.shape[1] + new_tokens
            return len(prompts) * new_tokens / dt
        return run, "transformers.generate"
    except ImportError:
        return plain_torch_generator(model_dir, dtype), "plain PyTorch decode loop"


def plain_torch_generator(model_dir: str, dtype):
    """Unsharded reference decode: our CausalLM without the engine (no scheduler, no RPC)."""
    import torch

    from spmd_engine.model.layers.attention import AttentionMetadata
    from spmd_engine.model.loader import load_model
    from spmd_engine.model.solo import SoloGroup
    g = SoloGroup()
    model = load_model(model_dir, g, g, dtype=dtype)

    def run(prompts, new_tokens):
        B, T = len(prompts), len(prompts[0])
        bs = 16
        per_seq = -(-(T + new_tokens) // bs)
        model.allocate_kv_cache(B * per_seq, bs)
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(B)]
        ids = prompts
        t = time.perf_counter()
        with torch.inference_mode():
            ctx, q = [0] * B, [T] * B
            for step in range(new_tokens):
                md = AttentionMetadata.build(ctx, q, tables, bs, "cpu")
                h = model.forward(torch.tensor(md.pack(ids)), md.positions, md)["hidden_states"]
                last = torch.tensor([md.row_start[i] + q[i] - 1 for i in range(B)])
                ids = model.compute_logits(h[last]).argmax(-1).view(B, 1).tolist()
                ctx, q = [c + n for c, n in zip(ctx, q)], [1] * B
        return B * new_tokens / (time.perf_counter() - t)
    return run


def read_bandwidth(mib: int = 512) -> float:
    """Bytes/s of a large tensor sum (one read pass), all threads: the roofline's bandwidth.

    The fastest of 5 passes: noise on this shared box only slows a pass (single passes vary
    widely here), and the roofline is what the memory can do, so the best pass is the honest
    (and strictest) denominator."""
    import torch
    x = torch.ones(mib * 2 ** 20 // 4)
    x.sum()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best


def weight_bytes_per_step(model_dir: str, itemsize: int) -> int:
    """Bytes of weights read per decode step: every matrix except the embedding (a gather)."""
    s = LLAMA_SHAPE
    h, v = s["hidden_size"], s["vocab_size"]
    return (layer_params(s["num_layers"]) + h + v * h) * itemsize


def layer_params(layers: int) -> int:
    """Parameters of `layers` decoder layers of LLAMA_SHAPE."""
    s = LLAMA_SHAPE
    h, i = s["hidden_size"], s["intermediate_size"]
    d = h // s["num_heads"]
    return layers * (h * (s["num_heads"] + 2 * s["num_kv_heads"]) * d + s["num_heads"] * d * h + 3 * h * i + 2 * h)


def matmul_seconds(llm, rows: int, reps: int = 20) -> dict[str, float]:
    """Seconds per call of each weight matmul of a uni engine's model (its own, packed,
    weights) on `rows` rows, by module name, timed in model order with nothing else running."""
    import torch

    from spmd_engine.kernels.packed_weights import dense_shape, linear
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    weights = {name: m.weight for name, m in model.named_modules() if getattr(m, "packable_weight", False)}
    width = {name: dense_shape(w)[1] for name, w in weights.items()}  # in_features, whatever the layout
    inputs = {k: torch.randn(rows, k).to(model.dtype) for k in width.values()}
    seconds = dict.fromkeys(weights, 0.0)
    with torch.inference_mode():
        for name, w in weights.items():
            linear(inputs[width[name]], w)
        for _ in range(reps):
            for name, w in weights.items():
                t = time.perf_counter()
                linear(inputs[width[name]], w)
                seconds[name] += time.perf_counter() - t
    return {name: t / reps for name, t in seconds.items()}


def step_matmul_seconds(llm, batch: int) -> float:
    """One decode step's weight matmuls alone: every layer's qkv, o, gate_up, down and the LM
    head on `batch` rows, nothing else. The step as a whole can stream weights no faster."""
    return sum(matmul_seconds(llm, batch).values())


def fig_decode(args) -> None:
    """Decode tokens/s vs transformers at B=8 (fp32, bf16); the bf16 roofline fraction at
    B=1, 8 and 32, beside the fraction the step's matmuls alone reach (its ceiling here)."""
    import torch

    from spmd_engine import LLM
    model_dir = random_llama(args)
    plen, new = 32, (16 if args.quick else 64)
    runs = [("float32", torch.float32, 8), ("bfloat16", torch.bfloat16, 8),
            ("bfloat16", torch.bfloat16, 1), ("bfloat16", torch.bfloat16, 32)]
    for dtype_name, dtype, batch in runs:
        prompts = prompts_for(batch, plen, LLAMA_SHAPE["vocab_size"])
        llm = LLM(model=model_dir, dtype=dtype_name, max_model_len=plen + new + 8, max_num_seqs=batch,
                  distributed_executor_backend="uni")
        compare = batch == 8  # transformers at the batch size only
        ref, kind = hf_generator(model_dir, dtype) if compare else (None, None)
        time_engine(llm, prompts, 4)
        if compare:
            ref(prompts, 4)  # warm-up
        ours, theirs, bws, matmuls, decode_steps = [], [], [], [], []
        for _ in range(args.reps):
            ours.append(time_engine(llm, prompts, new))
            # A decode step alone: the generation's time less one of the first token only (the
            # prompts' prefill, generate's own start and end), over the steps left.
            first_only = batch / time_engine(llm, prompts, 1)
            decode_steps.append((batch * new / ours[-1] - first_only) / (new - 1))
            if compare:
                theirs.append(ref(prompts, new))
            bws.append(read_bandwidth())
            matmuls.append(step_matmul_seconds(llm, batch))
        llm.shutdown()
        v = statistics.median(ours)
        if compare:
            b = statistics.median(theirs)
            emit(f"decode_tokens_per_s_{dtype_name}", v, b, v / b, "tokens/s", batch=batch, prompt=plen,
                 new_tokens=new, greedy=True, threads=torch.get_num_threads(), reps=args.reps, baseline_is=kind,
                 loadavg_1m=loadavg(), ratio_is="value/baseline, higher is better"
                 + ("; target >= 1.5" if dtype_name == "bfloat16" else ""))
        bw = statistics.median(bws)
        step_bytes = weight_bytes_per_step(model_dir, dtype.itemsize)
        achieved = step_bytes * v / batch  # weight bytes read per second at our step rate
        suffix = dtype_name if batch == 8 else f"{dtype_name}_b{batch}"
        emit(f"decode_roofline_fraction_{suffix}", achieved / 1e9, bw / 1e9, achieved / bw, "GB/s", batch=batch,
             ratio_is="weight bytes read per step x steps/s over measured read bandwidth (1.0 = roofline)"
             + ("; target >= 0.5" if (dtype_name, batch) == ("bfloat16", 8) else ""),
             weight_bytes_per_step=step_bytes, bandwidth_probe="torch.sum over 512 MiB fp32, all threads, fastest of 5 passes",
             step_ms=round(batch / v * 1e3, 3))
        t_mm = statistics.median(matmuls)
        emit(f"decode_matmul_ceiling_fraction_{suffix}", step_bytes / t_mm / 1e9, bw / 1e9, step_bytes / t_mm / bw,
             "GB/s", batch=batch, matmuls_ms=round(t_mm * 1e3, 3), step_ms=round(batch / v * 1e3, 3),
             ratio_is="the step's weight matmuls alone (the model's packed weights, nothing else) over the "
                      "measured read bandwidth: the most a whole step could reach with these kernels")
        step = statistics.median(decode_steps)
        emit(f"decode_step_over_matmuls_{suffix}", step * 1e3, t_mm * 1e3, step / t_mm, "ms", batch=batch,
             step_ms_with_prefill=round(batch / v * 1e3, 3), loadavg_1m=loadavg(),
             value_is=f"a decode step: (generate of {new} tokens - generate of 1) / {new - 1}",
             baseline_is="the step's weight matmuls alone (as decode_matmul_ceiling_fraction)",
             ratio_is="value/baseline, lower is better"
             + ("; target <= 1.3" if (dtype_name, batch) == ("bfloat16", 8) else ""))
