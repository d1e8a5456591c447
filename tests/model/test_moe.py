"""The grouped mixture-of-experts MLP against transformers' Mixtral and Qwen3-MoE blocks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from service.model.moe import MoeRouting, moe_mlp, route


def _mixtral_block(experts: int, top_k: int) -> torch.nn.Module:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = MixtralConfig(hidden_size=32, intermediate_size=48, num_local_experts=experts,
                        num_experts_per_tok=top_k)
    return MixtralSparseMoeBlock(cfg)


def _qwen3_block(experts: int, top_k: int, norm: bool) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=48, num_experts=experts,
                         num_experts_per_tok=top_k, norm_topk_prob=norm)
    return Qwen3MoeSparseMoeBlock(cfg)


def _randomize(block: torch.nn.Module) -> None:
    torch.manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * 0.3)


@pytest.mark.parametrize(("family", "experts", "top_k", "norm"), [
    ("mixtral", 8, 2, True), ("mixtral", 4, 1, True),
    ("qwen3_moe", 8, 3, True), ("qwen3_moe", 8, 3, False),
])
def test_grouped_experts_match_the_reference_block(
    family: str, experts: int, top_k: int, norm: bool
) -> None:
    block = (_mixtral_block(experts, top_k) if family == "mixtral"
             else _qwen3_block(experts, top_k, norm))
    _randomize(block)
    x = torch.randn(37, 32)
    with torch.no_grad():
        want = block(x[None])[0]
        got = moe_mlp(x, block.gate.weight, block.experts.gate_up_proj,
                      block.experts.down_proj, MoeRouting(experts, top_k, norm), F.silu)
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-5), (got - want).abs().max()


def test_routing_normalizes_only_where_the_family_says() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    w_norm, e = route(logits, MoeRouting(4, 2, True))
    w_raw, _ = route(logits, MoeRouting(4, 2, False))
    assert e.tolist() == [[0, 1]]
    assert torch.allclose(w_norm.sum(), torch.tensor(1.0))
    assert torch.allclose(w_raw, torch.softmax(logits, -1)[:, :2])


def test_each_expert_runs_once_on_its_whole_group() -> None:
    calls: list[int] = []
    x = torch.randn(64, 8)
    router = torch.randn(4, 8)
    gate_up, down = torch.randn(4, 12, 8), torch.randn(4, 8, 6)

    def act(t: torch.Tensor) -> torch.Tensor:
        calls.append(t.shape[0])
        return F.silu(t)

    moe_mlp(x, router, gate_up, down, MoeRouting(4, 2, True), act)
    assert len(calls) <= 4 and sum(calls) == 64 * 2
