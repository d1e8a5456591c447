"""The model registry: one module per family, all computing on the shared decoder.

Contract for a family module (``service/model/families/<name>.py``):

- It defines ``FAMILY``, a :class:`~service.model.families.base.Family` naming the
  config.json ``model_type`` values and GGUF ``general.architecture`` values it serves.
- ``hf_config(keys, tokens)`` / ``gguf_config(keys, shapes, tokens)`` build the
  :class:`~service.model.model_config.ModelConfig`, reading *every* value they honour through
  ``keys`` (:class:`~service.model.families.keys.ConfigKeys`). The loader then refuses, by
  name, each arithmetic key left unread (``keys.HF_ARITHMETIC``; for GGUF every ``{arch}.*``
  key not read and not in ``Family.gguf_harmless``). Anything the shared decoder cannot
  compute is refused there with one :class:`~service.model.load_error.ModelLoadError` line.
- ``source(config, name)`` says where each decoder tensor (HF names,
  ``service.model.weights.tensor_names``) lives in the file: the default is the tensor of
  that name; a family that fuses tensors (Phi-3's ``qkv_proj``) answers row ranges.
  ``gguf_layer_names`` maps llama.cpp's per-layer names onto the file names ``source`` uses.
  The loader refuses a file holding any tensor no decoder tensor comes from, or lacking one.
- A family adds features to the decoder only through :class:`ModelConfig` fields, and a
  field the native CPU paths (packed GEMV fusions, the native decoder stack) cannot honour
  turns them off for that model (``service.model.layers``), never silently.
- Per-layer attention facts (``layer_windows``, ``attn_softcap``) travel to kvcache as data
  (:class:`kvcache.attention.LayerAttention`); every attention backend honours them.

Adding a family is its module, one line in :data:`FAMILIES`, and a parity test against
transformers (tests/model/test_families.py).
"""

from __future__ import annotations

from service.model.families import gemma, llama, mistral, moe, phi3, qwen2, qwen3
from service.model.families.base import Family, Source, Tokens
from service.model.families.keys import ConfigKeys
from service.model.load_error import ModelLoadError

FAMILIES: tuple[Family, ...] = (
    llama.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    mistral.FAMILY,
    phi3.FAMILY,
    gemma.GEMMA2,
    gemma.GEMMA3,
    moe.MIXTRAL,
    moe.QWEN3_MOE,
)


def hf_family(model_type: object) -> Family:
    """The family serving config.json's ``model_type``; refuses an unregistered one."""
    for family in FAMILIES:
        if model_type in family.hf_model_types:
            return family
    served = ", ".join(t for f in FAMILIES for t in f.hf_model_types)
    raise ModelLoadError(f"unsupported architecture {model_type!r} (supported: {served})")


def gguf_family(arch: object) -> Family:
    """The family serving a GGUF ``general.architecture``; refuses an unregistered one."""
    for family in FAMILIES:
        if arch in family.gguf_archs:
            return family
    served = ", ".join(a for f in FAMILIES for a in f.gguf_archs)
    raise ModelLoadError(f"unsupported architecture {arch!r} (supported: {served})")


__all__ = ["FAMILIES", "ConfigKeys", "Family", "Source", "Tokens", "gguf_family", "hf_family"]
