"""Behaviour of the decoder itself: logits rows, chunked prefill, batching, dtypes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvcache.dense import DenseAttention, causal_attention
from service.model import LoadedModel, load_model
from tests.fixtures.tiny_models import write_tiny_qwen3
from tools.parity.checks import logits_ours


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(
        write_tiny_qwen3(tmp_path_factory.mktemp("q3")), dtype="float32", progress=False
    )


def _ids(model: LoadedModel, n: int) -> list[int]:
    return [(7 * i + 3) % model.model.config.vocab_size for i in range(n)]


def test_logits_indices_selects_rows(tiny: LoadedModel) -> None:
    ids = _ids(tiny, 12)
    full = logits_ours(tiny.model, ids)
    rows = torch.tensor([11, 0, 5])
    x = torch.tensor(ids)
    picked = tiny.model(x, torch.arange(12), DenseAttention(2), rows)
    assert picked.shape == (3, tiny.model.config.vocab_size) and picked.dtype == torch.float32
    assert torch.allclose(picked, full[rows], atol=1e-5, rtol=0)


def test_chunked_prefill_equals_one_shot(tiny: LoadedModel) -> None:
    ids = _ids(tiny, 20)
    full = logits_ours(tiny.model, ids)
    attn = DenseAttention(2)
    first = tiny.model(torch.tensor(ids[:13]), torch.arange(13), attn)
    second = tiny.model(torch.tensor(ids[13:]), torch.arange(13, 20), attn)
    assert torch.allclose(torch.cat([first, second]), full, atol=1e-5, rtol=0)


class TwoSequenceAttention:
    """Attention over a flattened batch of two independent sequences (for the batching test)."""

    def __init__(self, split: int) -> None:
        self.split = split

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        s = self.split
        return torch.cat(
            [causal_attention(q[:s], k[:s], v[:s], 0), causal_attention(q[s:], k[s:], v[s:], 0)]
        )


def test_flattened_batch_matches_separate_runs(tiny: LoadedModel) -> None:
    a, b = _ids(tiny, 9), _ids(tiny, 14)[::-1]
    x = torch.tensor(a + b)
    positions = torch.cat([torch.arange(9), torch.arange(14)])
    both = tiny.model(x, positions, TwoSequenceAttention(9), torch.tensor([8, 22]))
    assert torch.allclose(both[0], logits_ours(tiny.model, a)[-1], atol=1e-5, rtol=0)
    assert torch.allclose(both[1], logits_ours(tiny.model, b)[-1], atol=1e-5, rtol=0)


def test_attention_receives_rope_applied_qkv_shapes(tiny: LoadedModel) -> None:
    seen: list[tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = []
    dense = DenseAttention(2)

    def spy(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        seen.append((layer, tuple(q.shape), tuple(k.shape), tuple(v.shape)))
        return dense(layer, q, k, v)

    tiny.model(torch.tensor(_ids(tiny, 5)), torch.arange(5), spy)
    assert seen == [
        (0, (5, 4, 32), (5, 2, 32), (5, 2, 32)),
        (1, (5, 4, 32), (5, 2, 32), (5, 2, 32)),
    ]


def test_bfloat16_weights_give_close_float32_logits(tmp_path: Path) -> None:
    path = write_tiny_qwen3(tmp_path / "q3")
    fp32 = load_model(path, dtype="float32", progress=False)
    bf16 = load_model(path, dtype="bfloat16", progress=False)
    assert bf16.model.qkv.dtype == torch.bfloat16 and bf16.dtype == torch.bfloat16
    ids = _ids(fp32, 16)
    ref, got = logits_ours(fp32.model, ids), logits_ours(bf16.model, ids)
    assert got.dtype == torch.float32
    assert (ref - got).abs().max().item() < 0.1 * ref.abs().max().item()
