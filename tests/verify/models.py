"""Random-weight models for the verify suite (no network, written once per session).

The tiny Llama of ``tests/fixtures/tiny_models.py`` serves most tests. The timing side
channel needs a prefill whose cost stands well above gRPC overhead, so ``write_medium_llama``
writes a wider, deeper one: a 1,024-token prefill takes a few hundred milliseconds on one
CPU core, while a 16-token suffix takes a few.
"""

from __future__ import annotations

from pathlib import Path

import torch

MEDIUM_HIDDEN = 256
MEDIUM_LAYERS = 4
MEDIUM_CONTEXT = 2048


def write_medium_llama(directory: Path, *, seed: int = 7, std: float = 0.05) -> Path:
    """A 4-layer, 256-wide Llama with a 2,048-token context and the tiny BPE tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.fixtures.tiny_models import write_tiny_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    tok = write_tiny_tokenizer(directory)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=MEDIUM_HIDDEN,
        intermediate_size=4 * MEDIUM_HIDDEN,
        num_hidden_layers=MEDIUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MEDIUM_CONTEXT,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * std
            p.copy_(noise + 1.0 if "norm" in name else noise)
    model.save_pretrained(str(directory))
    return directory
