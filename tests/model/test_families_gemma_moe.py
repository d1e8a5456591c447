"""Gemma 2, Gemma 3, Mixtral and Qwen3-MoE against transformers: tiny random-weight
checkpoints, float32, in process and served over gRPC, on prompts shorter and longer than the
sliding window; Mixtral and Qwen3-MoE also as llama.cpp's converter writes their GGUFs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from protos.kvfence.v1 import inference_pb2, inference_pb2_grpc
from service.model import ModelLoadError, load_model
from service.serve.app import EngineSizing
from tests.fixtures import tiny_families as tf
from tests.fixtures.oracles import Tiny, tiny_oracles, weights_of
from tests.fixtures.tiny_gguf import write_gguf_from_hf
from tests.serverutil import TenantSpec, running_server
from tools.parity import checks as parity

# slow: four transformers oracles, four servers
pytestmark = pytest.mark.slow

SHORT = "Hello!"
LONG = "The quick brown fox jumps over the lazy dog. def main(): return 42\n" * 2
W = tf.WINDOW
_GEMMA3_ROPE = {
    "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
}
# Each checkpoint turns on what its family computes beyond Llama, with values that matter in
# a tiny model: query_pre_attn_scalar 24 against head_dim 16, an attention softcap of 1 and
# a final one of 3, distinct RoPE bases, a window shorter than LONG, top-2 of 4 experts.
CHECKPOINTS: dict[str, dict[str, Any]] = {
    "gemma2": dict(
        head_dim=16, sliding_window=W, query_pre_attn_scalar=24, attn_logit_softcapping=1.0,
        final_logit_softcapping=3.0, seed=21,
    ),
    "gemma3_text": dict(
        head_dim=16, sliding_window=W, query_pre_attn_scalar=24, rope_parameters=_GEMMA3_ROPE,
        layer_types=["sliding_attention", "full_attention"], seed=22,
    ),
    "mixtral": dict(
        num_local_experts=4, num_experts_per_tok=2, sliding_window=W, head_dim=16, seed=23
    ),
    "qwen3_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=False,
        head_dim=16, seed=24,
    ),
}


# Mixture-of-experts checkpoints for their GGUFs: no window (llama.cpp's converter writes
# none for Mixtral), Qwen3-MoE renormalising its top-k (as llama.cpp computes qwen3moe).
GGUF_CHECKPOINTS: dict[str, dict[str, Any]] = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, seed=25),
    "qwen3_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
        head_dim=16, seed=26,
    ),
}


def _writer(model_type: str, config: dict[str, Any]) -> Any:
    return lambda d: tf.write_tiny(d, model_type, **config)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tiny]:
    return tiny_oracles(tmp_path_factory, {t: _writer(t, c) for t, c in CHECKPOINTS.items()})


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tiny]:
    """Each MoE checkpoint's llama.cpp-style GGUF loaded by kvfence, beside transformers on
    the HF directory it was converted from."""
    dirs = tiny_oracles(
        tmp_path_factory, {t: _writer(t, c) for t, c in GGUF_CHECKPOINTS.items()}
    )
    out = {}
    for name, (path, _, hf_model) in dirs.items():
        gguf = write_gguf_from_hf(path, path / "model.gguf")
        out[name] = Tiny(gguf, load_model(gguf, dtype="float32", progress=False), hf_model)
    return out


@pytest.mark.parametrize("model_type", list(CHECKPOINTS))
def test_each_family_matches_transformers_shorter_and_longer_than_the_window(
    tiny: dict[str, Tiny], model_type: str
) -> None:
    _, ours, hf_model = tiny[model_type]
    assert len(ours.tokenizer.encode(SHORT)) < W < len(ours.tokenizer.encode(LONG))
    assert parity.max_logit_diff(ours, hf_model, (SHORT, LONG)) <= 1e-4
    assert parity.greedy_matches(ours, hf_model, (SHORT, LONG), n=16) == 2


def test_the_configs_carry_each_family_s_features(tiny: dict[str, Tiny]) -> None:
    g2, g3, mx, qm = (tiny[t].ours.model.config for t in CHECKPOINTS)
    assert g2.final_softcap == 3.0 and g2.layer_windows == (W, 0) and not g2.qk_norm
    assert g2.attn_softcap == 1.0 and g2.layer_softcaps == (1.0, 1.0)
    assert g3.attn_softcap == 0.0 and g3.layer_softcaps == ()
    assert g3.qk_norm and g3.layer_rope_thetas == (10_000.0, 1_000_000.0)
    for g in (g2, g3):
        assert g.sandwich_norms and g.activation == "gelu_tanh" and g.norm_offset == 1.0
        assert g.embed_scale == pytest.approx(64**0.5) and g.query_scale == pytest.approx((16 / 24) ** 0.5)
    assert (mx.num_experts, mx.experts_per_token, mx.normalize_top_k) == (4, 2, True)
    assert mx.layer_windows == (W, W)
    assert (qm.num_experts, qm.normalize_top_k, qm.intermediate_size) == (4, False, 48)


def _hf_greedy(hf_model: Any, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n
        )
    return [int(t) for t in out[0, len(ids) :]]


def test_gemma2_s_attention_softcap_changes_the_output_it_is_matched_on(
    tiny: dict[str, Tiny],
) -> None:
    """Guards the parity tests: Gemma 2 with its attention softcap switched off is far from
    transformers, so matching it means the cap is computed."""
    _, ours, hf_model = tiny["gemma2"]
    m = ours.model
    off = type(m)(dataclasses.replace(m.config, attn_softcap=0.0), weights_of(m))
    ids = ours.tokenizer.encode(LONG)
    diff = (parity.logits_ours(off, ids) - parity.logits_hf(hf_model, ids)).abs().max().item()
    assert diff > 1e-2


@pytest.mark.parametrize("model_type", list(GGUF_CHECKPOINTS))
def test_a_llama_cpp_moe_gguf_matches_transformers_on_its_hf_checkpoint(
    moe_gguf: dict[str, Tiny], model_type: str
) -> None:
    """Stacked experts (ffn_*_exps), the router (ffn_gate_inp) and the expert counts in the
    metadata give transformers' logits and greedy tokens, in float32."""
    _, ours, hf_model = moe_gguf[model_type]
    c = ours.model.config
    assert (c.num_experts, c.experts_per_token, c.normalize_top_k) == (4, 2, True)
    assert c.arch == ("llama" if model_type == "mixtral" else "qwen3_moe")
    assert c.intermediate_size == (48 if model_type == "qwen3_moe" else 128)
    assert parity.max_logit_diff(ours, hf_model, (SHORT, LONG)) <= 1e-4
    assert parity.greedy_matches(ours, hf_model, (SHORT, LONG), n=16) == 2


@pytest.mark.parametrize(
    ("model_type", "keys", "named"),
    [
        ("qwen3_moe", {"qwen3moe.expert_weights_scale": 2.0}, "qwen3moe.expert_weights_scale"),
        ("mixtral", {"llama.expert_shared_count": 1.0}, "llama.expert_shared_count"),
    ],
)
def test_an_moe_gguf_key_kvfence_does_not_compute_is_refused_by_name(
    moe_gguf: dict[str, Tiny], tmp_path: Path, model_type: str, keys: dict[str, float], named: str
) -> None:
    hf_dir = moe_gguf[model_type].path.parent
    gguf = write_gguf_from_hf(hf_dir, tmp_path / "m.gguf", extra_keys=keys)
    with pytest.raises(ModelLoadError, match=named):
        load_model(gguf, dtype="float32", progress=False)


def test_expert_tensors_without_an_expert_count_are_refused_by_name(
    moe_gguf: dict[str, Tiny], tmp_path: Path
) -> None:
    """A llama GGUF whose metadata names no experts but whose layers hold them: the experts
    are tensors the dense llama decoder would not compute with."""
    from gguf import GGUFReader

    src = GGUFReader(moe_gguf["mixtral"].path)
    experts = {str(t.name): np.array(t.data) for t in src.tensors if "_exps" in t.name}
    hf_dir = moe_gguf["mixtral"].path.parent
    dense = hf_dir.parent / "dense"
    path = tf.write_tiny(dense, "llama", head_dim=16, seed=25)
    gguf = write_gguf_from_hf(path, tmp_path / "m.gguf", extra_tensors=experts)
    with pytest.raises(ModelLoadError, match=r"does not compute with: blk\.0\.ffn_down_exps"):
        load_model(gguf, dtype="float32", progress=False)


def test_each_family_is_served_over_grpc_with_transformers_greedy_tokens(
    tiny: dict[str, Tiny], moe_gguf: dict[str, Tiny]
) -> None:
    sizing = EngineSizing(dtype="float32", kv_memory="32MiB", warmup=False)
    served = {**tiny, **{f"{t} GGUF": entry for t, entry in moe_gguf.items()}}
    for model_type, (path, ours, hf_model) in served.items():
        with running_server(path, {"a": TenantSpec()}, sizing=sizing) as srv:
            stub = inference_pb2_grpc.InferenceStub(srv.channel())
            for text in (SHORT, LONG):
                ids = ours.tokenizer.encode(text)
                req = inference_pb2.GenerateRequest(
                    sampling=inference_pb2.SamplingParams(temperature=0.0),
                    stopping=inference_pb2.StoppingParams(max_tokens=12, ignore_eos=True),
                )
                req.token_ids.ids.extend(ids)
                got = [
                    t
                    for r in stub.Generate(req, metadata=srv.auth("a"))
                    if r.HasField("chunk")
                    for t in r.chunk.token_ids
                ]
                assert got == _hf_greedy(hf_model, ids, 12), (model_type, text)


def _edit_config(path: Path, **changes: Any) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    ("model_type", "changes", "named"),
    [
        ("gemma2", {"attn_logit_softcapping": -1.0}, "attn_logit_softcapping=-1.0"),
        ("gemma2", {"final_logit_softcapping": 0.0}, "final_logit_softcapping=0.0"),
        ("gemma3_text", {"hidden_activation": "relu"}, "'relu'"),
        ("qwen3_moe", {"mlp_only_layers": [0]}, "mlp_only_layers"),
        ("gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ],
)
def test_what_a_family_does_not_compute_is_refused_by_name(
    tmp_path: Path, model_type: str, changes: dict[str, Any], named: str
) -> None:
    path = tf.write_tiny(tmp_path / model_type, model_type, **CHECKPOINTS[model_type])
    _edit_config(path, **changes)
    with pytest.raises(ModelLoadError, match=named.replace("[", r"\[")):
        load_model(path, dtype="float32", progress=False)
