"""Every registered family served over gRPC (float32), greedy tokens equal to transformers'
on prompts shorter and longer than the sliding window."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from service.model import load_model
from tests.fixtures import tiny_families as tf
from tests.serverutil import TenantSpec, running_server
from tests.service.rpc import generate, request
from tools.parity import checks as parity

WRITERS: dict[str, Callable[[Path], Path]] = {
    "llama_biased": tf.write_llama_biased,
    "qwen2_windowed": tf.write_qwen2_windowed,
    "qwen3_biased": lambda d: tf.write_tiny(d, "qwen3", attention_bias=True, head_dim=32),
    "mistral": tf.write_mistral,
    "phi3_longrope": lambda d: tf.write_phi3(d, longrope=True),
}
NEW_TOKENS = 12
PROMPTS = ([5, 40, 77], [(17 * i + 3) % 300 + 10 for i in range(3 * tf.WINDOW)])


@pytest.mark.parametrize("name", list(WRITERS))
def test_a_family_served_over_grpc_decodes_what_transformers_decodes(
    tmp_path: Path, name: str
) -> None:
    path = WRITERS[name](tmp_path / name)
    loaded = load_model(path, dtype="float32", progress=False)
    hf_model, _ = parity.load_hf_oracle(path)
    assert len(PROMPTS[0]) < tf.WINDOW < len(PROMPTS[1])
    with running_server(loaded, {"acme": TenantSpec()}) as srv:
        for ids in PROMPTS:
            responses = generate(srv, "acme", request(None, ids=ids, max_tokens=NEW_TOKENS))
            tokens = [t for r in responses for t in r.chunk.token_ids]
            assert len(tokens) == NEW_TOKENS
            assert parity.hf_agrees_with_greedy(hf_model, ids, tokens), (name, ids, tokens)
