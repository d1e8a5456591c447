"""The shape of a decoder, independent of the family and file format it came from.

Every registered family (:mod:`service.model.families`) turns its checkpoint's config into
one :class:`ModelConfig`; the shared decoder (:mod:`service.model.decoder`) computes with
exactly these fields and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

# RoPE frequency rules a checkpoint may name (``rope_type``); see service/model/rope.py.
ROPE_KINDS = ("llama3", "linear", "dynamic", "yarn", "longrope")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling. ``kind`` picks the rule; each rule reads only its fields.

    - ``llama3``: ``factor``, ``low_freq_factor``, ``high_freq_factor``, ``original_...``;
    - ``linear``: positions divided by ``factor`` (frequencies divided);
    - ``dynamic``: NTK scaling that changes nothing up to ``original_...`` positions, the
      longest context served (the decoder's table stops there);
    - ``yarn``: ``factor``, ``beta_fast``, ``beta_slow``, ``original_...``,
      ``attention_factor`` (cos/sin scale), ``truncate``;
    - ``longrope``: ``short_factor`` per frequency and ``attention_factor``; served up to
      ``original_...`` positions, where the short factors are the ones that apply.
    """

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0
    kind: str = "llama3"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True
    short_factor: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class ModelConfig:
    arch: str  # the registered family's name: "llama", "qwen2", "qwen3", "mistral", "phi3", ...
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q, k and v projections carry a bias
    qk_norm: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    o_bias: bool = False  # the attention output projection carries a bias
    mlp_bias: bool = False  # gate, up and down projections carry a bias
    # Per layer: how many most recent keys a query attends to (itself included); 0 = all.
    # Empty means every layer attends to every earlier key.
    layer_windows: tuple[int, ...] = ()
    # Gemma: embeddings times ``embed_scale``; a norm on the attention output and on the MLP
    # output before each residual add (``sandwich_norms``); the MLP gate's ``activation``;
    # q times ``query_scale`` (so the kvcache's head_dim**-0.5 gives query_pre_attn_scalar's
    # scale); a RoPE base per layer; logits softcapped as cap * tanh(logits / cap).
    embed_scale: float = 1.0
    sandwich_norms: bool = False
    activation: str = "silu"  # "silu" | "gelu_tanh"
    query_scale: float = 1.0
    layer_rope_thetas: tuple[float, ...] = ()  # empty: rope_theta on every layer
    final_softcap: float = 0.0  # 0: none
    # Gemma 2: every layer's attention scores softcapped as cap * tanh(s / cap) before the
    # softmax; kvcache computes it (kvcache.attention.LayerAttention.softcap). 0: none.
    attn_softcap: float = 0.0
    norm_offset: float = 0.0  # added to every RMSNorm weight at load ((1 + w) norms)
    # Mixture of experts (Mixtral, Qwen3-MoE): each layer's MLP is ``num_experts`` gated MLPs
    # of ``intermediate_size``, ``experts_per_token`` picked per token by a router.
    num_experts: int = 0
    experts_per_token: int = 0
    normalize_top_k: bool = True

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def plain_layers(self) -> bool:
        """Whether every layer is the plain Llama layer the fused native paths compute."""
        return (
            not self.sandwich_norms
            and self.activation == "silu"
            and not self.num_experts
            and not self.layer_rope_thetas
            and self.query_scale == 1.0
        )

    @property
    def layer_softcaps(self) -> tuple[float, ...]:
        """Each layer's attention-logit softcap; empty where no layer has one."""
        return (self.attn_softcap,) * self.num_layers if self.attn_softcap else ()

    @property
    def windowed(self) -> bool:
        """Whether some layer attends to a window of recent keys only."""
        return any(self.layer_windows)
