"""Step 3: offline batched decode of the 8B-shaped model, kvfence (graphed) against
transformers ``generate()`` with a static cache on the same weights, each against the roofline.

Both are timed the same way: decode seconds over ``new_tokens - 1`` steps after the prefill
(kvfence times its phases directly; transformers' decode time is a run of ``n`` new tokens
minus a run of one, which leaves only its decode steps).
"""

from __future__ import annotations

import dataclasses
import random
import time
from typing import Any

import torch

from tools.gpu.loop import generate
from tools.gpu.models import hf_twin, random_llama
from tools.gpu.plan import Plan
from tools.gpu.roofline import (
    generation_bytes,
    measure_bandwidth,
    roofline_fraction,
    weight_bytes,
)
from tools.gpu.setup import make_cache, make_graphs


def _prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(batch)]


def _hf_seconds(hf: Any, prompts: list[list[int]], new_tokens: int) -> float:
    device = next(hf.parameters()).device
    ids = torch.tensor(prompts, device=device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            cache_implementation="static",
        )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if out.shape[1] != ids.shape[1] + new_tokens:
        raise RuntimeError(f"transformers generated {out.shape[1] - ids.shape[1]} tokens")
    return time.perf_counter() - start


def throughput_check(plan: Plan) -> dict[str, Any]:
    device = torch.device(plan.device)
    max_len = plan.prompt_len + plan.new_tokens
    model = random_llama(plan.big, max_len + 8, plan.big_dtype, device)
    cfg, itemsize = model.config, model.embed.element_size()
    bandwidth = measure_bandwidth(device, plan.bandwidth_bytes)
    pages_per_seq = -(-max_len // plan.page_size)
    cache, backend = make_cache(
        model, plan.throughput_backend, plan.page_size, max(plan.batches) * pages_per_seq + 1
    )
    started = time.perf_counter()
    graphs = make_graphs(model, cache, backend, plan.batches, max_len)
    capture_s = time.perf_counter() - started
    hf = hf_twin(model)
    warm = _prompts(1, plan.prompt_len, cfg.vocab_size, seed=99)
    generate(model, cache, warm, 3, graphs)  # NOTE: first-call costs stay out of the timings
    _hf_seconds(hf, warm, 2)
    rows = []
    for batch in plan.batches:
        prompts = _prompts(batch, plan.prompt_len, cfg.vocab_size, seed=batch)
        gen = generate(model, cache, prompts, plan.new_tokens, graphs)
        steps = plan.new_tokens - 1
        ours_bytes = generation_bytes(cfg, itemsize, batch, plan.prompt_len, plan.new_tokens)
        hf_decode = _hf_seconds(hf, prompts, plan.hf_new_tokens) - _hf_seconds(hf, prompts, 1)
        hf_steps = plan.hf_new_tokens - 1
        hf_bytes = generation_bytes(cfg, itemsize, batch, plan.prompt_len, plan.hf_new_tokens)
        ours_tps = batch * steps / gen.decode_s
        hf_tps = batch * hf_steps / hf_decode
        rows.append(
            {
                "batch": batch,
                "kvfence_tokens_per_s": ours_tps,
                "kvfence_step_ms": 1e3 * gen.decode_s / steps,
                "kvfence_roofline_fraction": roofline_fraction(ours_bytes, gen.decode_s, bandwidth),
                "kvfence_graph_replays": gen.graph_replays,
                "kvfence_decode_steps": steps,
                "transformers_tokens_per_s": hf_tps,
                "transformers_step_ms": 1e3 * hf_decode / hf_steps,
                "transformers_roofline_fraction": roofline_fraction(hf_bytes, hf_decode, bandwidth),
                "speedup": ours_tps / hf_tps,
                "roofline_step_ms": 1e3 * ours_bytes / steps / bandwidth.bytes_per_s,
            }
        )
    return {
        "model": {
            "shape": dataclasses.asdict(plan.big),
            "dtype": str(plan.big_dtype),
            "weight_bytes": weight_bytes(cfg, itemsize),
        },
        "backend": plan.throughput_backend,
        "graph_buckets": list(graphs.buckets),
        "graph_capture_s": capture_s,
        "bandwidth_bytes_per_s": bandwidth.bytes_per_s,
        "bandwidth_copy_bytes": bandwidth.copy_bytes,
        "prompt_len": plan.prompt_len,
        "new_tokens": plan.new_tokens,
        "transformers_new_tokens": plan.hf_new_tokens,
        "rows": rows,
    }
