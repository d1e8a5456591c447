"""Random-weight models for the GPU check: tiny HF checkpoints (greedy equality) and a
Llama-3.1-8B-shaped decoder built directly on the device (throughput), with a transformers
twin that shares its weight storage (so both read the same bytes and memory holds one copy)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from service.model.decoder import DecoderModel, DecoderWeights
from service.model.model_config import ModelConfig
from tests.fixtures.tiny_models import write_tiny_tokenizer


@dataclass(frozen=True, slots=True)
class Shape:
    """Decoder geometry shared by the tiny checkpoints and the throughput model."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int


LLAMA_31_8B = Shape(
    hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, head_dim=128, vocab=128256
)


def write_tiny(directory: Path, arch: str, shape: Shape, seed: int) -> Path:
    """A random-weight HF checkpoint (``llama``, ``qwen2`` or ``qwen3``) with a tiny BPE
    tokenizer, written the way ``tests.fixtures.tiny_models`` writes its own."""
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    tok = write_tiny_tokenizer(directory)
    common: dict[str, Any] = {
        "vocab_size": tok.get_vocab_size(),
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": arch == "qwen3",
    }
    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }
    config_cls, model_cls = classes[arch]
    model = model_cls(config_cls(**common))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.15
            p.copy_(noise + 1.0 if "norm" in name else noise)
    model.save_pretrained(str(directory))
    return directory


def model_config(shape: Shape, max_positions: int) -> ModelConfig:
    return ModelConfig(
        arch="llama",
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_layers=shape.layers,
        num_heads=shape.heads,
        num_kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=None,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        attention_bias=False,
        qk_norm=False,
        bos_token_id=None,
        eos_token_ids=(),
    )


def random_llama(
    shape: Shape, max_positions: int, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> DecoderModel:
    """A Llama decoder with random weights generated on ``device`` (no file, no host copy)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    s = shape
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim

    def rand(*dims: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(dims, generator=gen, device=device, dtype=dtype) * std).contiguous()

    def ones(*dims: int) -> torch.Tensor:
        return torch.ones(dims, device=device, dtype=dtype)

    weights = DecoderWeights(
        embed=rand(s.vocab, s.hidden),
        lm_head=rand(s.vocab, s.hidden),
        final_norm=ones(s.hidden),
        attn_norm=ones(s.layers, s.hidden),
        qkv=rand(s.layers, q + 2 * kv, s.hidden),
        qkv_bias=None,
        qk_norm=None,
        o=rand(s.layers, s.hidden, q),
        mlp_norm=ones(s.layers, s.hidden),
        gate_up=rand(s.layers, 2 * s.intermediate, s.hidden),
        down=rand(s.layers, s.hidden, s.intermediate),
    )
    return DecoderModel(model_config(shape, max_positions), weights).eval()


def hf_twin(model: DecoderModel) -> Any:
    """transformers ``LlamaForCausalLM`` whose parameters are views of ``model``'s weights."""
    import transformers

    c = model.config
    config = transformers.LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(config)
    q, kv, inter = c.q_size, c.kv_size, c.intermediate_size

    def put(module: torch.nn.Module, name: str, t: torch.Tensor) -> None:
        setattr(module, name, torch.nn.Parameter(t, requires_grad=False))

    put(hf.model.embed_tokens, "weight", model.embed)
    put(hf.lm_head, "weight", model.lm_head)
    put(hf.model.norm, "weight", model.final_norm)
    for i, layer in enumerate(hf.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        put(layer.input_layernorm, "weight", model.attn_norm[i])
        put(layer.post_attention_layernorm, "weight", model.mlp_norm[i])
        put(attn.q_proj, "weight", model.qkv[i][:q])
        put(attn.k_proj, "weight", model.qkv[i][q : q + kv])
        put(attn.v_proj, "weight", model.qkv[i][q + kv :])
        put(attn.o_proj, "weight", model.o[i])
        put(mlp.gate_proj, "weight", model.gate_up[i][:inter])
        put(mlp.up_proj, "weight", model.gate_up[i][inter:])
        put(mlp.down_proj, "weight", model.down[i])
    # Non-persistent buffers (rotary inv_freq) were built on meta: rebuild them on the device.
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=config).to(model.device)
    return hf.eval()
