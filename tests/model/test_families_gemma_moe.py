"""Gemma 2, Gemma 3, Mixtral and Qwen3-MoE against transformers: tiny random-weight
checkpoints, float32, in process and served over gRPC, on prompts shorter and longer than the
sliding window."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from protos.kvfence.v1 import inference_pb2, inference_pb2_grpc
from service.app import EngineSizing
from service.model import LoadedModel, ModelLoadError, load_model
from tests.fixtures import tiny_families as tf
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
# a tiny model: query_pre_attn_scalar 24 against head_dim 16, a final softcap of 3, distinct
# RoPE bases, a window shorter than LONG, top-2 of 4 experts.
CHECKPOINTS: dict[str, dict[str, Any]] = {
    "gemma2": dict(
        head_dim=16, sliding_window=W, query_pre_attn_scalar=24, attn_logit_softcapping=None,
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


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, LoadedModel, Any]]:
    out = {}
    for model_type, config in CHECKPOINTS.items():
        path = tf.write_tiny(tmp_path_factory.mktemp(model_type), model_type, **config)
        hf_model, _ = parity.load_hf_oracle(path)
        out[model_type] = (path, load_model(path, dtype="float32", progress=False), hf_model)
    return out


@pytest.mark.parametrize("model_type", list(CHECKPOINTS))
def test_each_family_matches_transformers_shorter_and_longer_than_the_window(
    tiny: dict[str, tuple[Path, LoadedModel, Any]], model_type: str
) -> None:
    _, ours, hf_model = tiny[model_type]
    assert len(ours.tokenizer.encode(SHORT)) < W < len(ours.tokenizer.encode(LONG))
    assert parity.max_logit_diff(ours, hf_model, (SHORT, LONG)) <= 1e-4
    assert parity.greedy_matches(ours, hf_model, (SHORT, LONG), n=16) == 2


def test_the_configs_carry_each_family_s_features(
    tiny: dict[str, tuple[Path, LoadedModel, Any]],
) -> None:
    g2, g3, mx, qm = (tiny[t][1].model.config for t in CHECKPOINTS)
    assert g2.final_softcap == 3.0 and g2.layer_windows == (W, 0) and not g2.qk_norm
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


def test_each_family_is_served_over_grpc_with_transformers_greedy_tokens(
    tiny: dict[str, tuple[Path, LoadedModel, Any]],
) -> None:
    sizing = EngineSizing(dtype="float32", kv_memory="32MiB", warmup=False)
    for model_type, (path, ours, hf_model) in tiny.items():
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
        ("gemma2", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
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
