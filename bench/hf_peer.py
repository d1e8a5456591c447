"""Peer: Hugging Face transformers `generate()` in static, left-padded batches.

Each batch runs to its longest member (max_new_tokens = the batch max, EOS suppressed with
min_new_tokens), so padded rows keep computing, as static batching does. Only each request's
own output length counts as useful output.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.common import Throughput, Work, throughput


def load_hf_model(gguf: Path, dtype: torch.dtype) -> Any:
    """The same GGUF, de-quantised at load into dense weights of the dtype kvfence runs in
    (as kvfence does), so both run the same dense matmuls rather than GGUF block kernels."""
    from transformers import AutoModelForCausalLM, GgufConfig

    model: Any = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent),
        gguf_file=gguf.name,
        dtype=dtype,
        quantization_config=GgufConfig(dequantize=True),
    )
    return model.eval()


def _pad_left(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p) :] = 1
    return ids, mask


def generate_batch(model: Any, batch: Sequence[Work], outputs: list[list[int]] | None = None) -> int:
    """Greedy-generate one static batch; returns the number of generated positions per row.
    ``outputs`` (when given) receives each row's first max_tokens generated ids."""
    pad_id = model.generation_config.pad_token_id
    pad_id = 0 if pad_id is None else int(pad_id)
    ids, mask = _pad_left([w.prompt_ids for w in batch], pad_id)
    new = max(w.max_tokens for w in batch)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=pad_id,
        )
    generated = int(out.shape[1] - ids.shape[1])
    if generated != new:
        raise RuntimeError(f"transformers generated {generated} tokens, expected {new}")
    if outputs is not None:
        tail = out[:, ids.shape[1] :].tolist()
        outputs.extend(row[: w.max_tokens] for row, w in zip(tail, batch, strict=True))
    return generated


def run_static(
    model: Any, work: Sequence[Work], batch_size: int, outputs: list[list[int]] | None = None
) -> Throughput:
    """Time static batches of ``batch_size``; ``outputs`` receives each request's ids."""
    padded = 0
    got: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(work), batch_size):
        batch = work[i : i + batch_size]
        padded += generate_batch(model, batch, got) * len(batch)
    wall = time.perf_counter() - start
    if outputs is not None:
        outputs[:] = got
    useful = sum(w.max_tokens for w in work)
    return throughput(
        f"transformers generate b={batch_size}",
        work,
        wall,
        f"static batches; {padded} generated positions of which {useful} useful",
    )
