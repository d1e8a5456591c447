"""The real Gemma 3 270M GGUF (a pullable model): its SentencePiece tokenizer against
transformers' for the same file, and the shape its metadata gives the decoder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from service.model import ModelFile, open_model
from tools.parity.corpus import tokenizer_corpus

# slow: the 262k-token GGUF parsed twice (ours, transformers') and a served 270M model
pytestmark = pytest.mark.slow

_EXTRA = (
    "a  b   c    d",  # whitespace runs: user-defined pieces rebuilt from "▁"
    "\n\n\ntabs\t\tand\r\nreturns",
    "数字123456 ünïcödé 🚀🦀 \x07bell \U0010fffd",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<table><td>1</td></table>",
    "    def f(x):\n        return x**2\n",
)


@pytest.fixture(scope="module")
def gemma3() -> tuple[ModelFile, Any]:
    from transformers import AutoTokenizer

    from service.model.catalog import GEMMA3_270M, ensure_model

    path: Path = ensure_model(GEMMA3_270M.name)
    ref = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return open_model(path), ref


def test_the_gemma3_tokenizer_equals_transformers_on_a_varied_text_set(
    gemma3: tuple[ModelFile, Any],
) -> None:
    opened, ref = gemma3
    tok = opened.checkpoint.tokenizer
    texts = [*tokenizer_corpus(), *_EXTRA]
    fallback = 0
    for text in texts:
        ids = tok.encode(text, add_special_tokens=True)
        assert ids == ref(text)["input_ids"], repr(text)
        assert b"".join(tok.id_to_token_bytes(i) for i in ids[1:]) == text.encode(), repr(text)
        fallback += sum(1 for i in ids if 238 <= i < 238 + 256)  # <0x00>..<0xFF>
    assert fallback > 0  # the set reaches byte fallback


def test_the_gemma3_metadata_gives_local_and_global_layers(gemma3: tuple[ModelFile, Any]) -> None:
    c = gemma3[0].config
    assert (c.arch, c.num_layers, c.head_dim, c.num_kv_heads) == ("gemma3", 18, 256, 1)
    assert [i for i, w in enumerate(c.layer_windows) if w == 0] == [5, 11, 17]
    assert set(c.layer_windows) == {0, 512}
    assert {c.layer_rope_thetas[i] for i in (5, 11, 17)} == {1_000_000.0}
    assert c.layer_rope_thetas[0] == 10_000.0 and c.norm_offset == 0.0
    assert c.qk_norm and c.sandwich_norms and c.tie_word_embeddings


def test_kvfence_serve_by_name_serves_gemma3_over_grpc(tmp_path: Path) -> None:
    import grpc

    from protos.kvfence.v1 import inference_pb2, inference_pb2_grpc
    from tests.serverutil import TenantSpec, start_server_process, write_tenants_file

    keys = write_tenants_file(tmp_path / "tenants.toml", {"a": TenantSpec()})
    proc = start_server_process(Path("gemma-3-270m"), tmp_path / "tenants.toml", timeout=900.0)
    try:
        stub = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(proc.target))
        req = inference_pb2.GenerateRequest(
            text="The capital of France is",
            sampling=inference_pb2.SamplingParams(temperature=0.0),
            stopping=inference_pb2.StoppingParams(max_tokens=8, ignore_eos=True),
        )
        auth = [("authorization", f"Bearer {keys['a']}")]
        text = "".join(r.chunk.text for r in stub.Generate(req, metadata=auth) if r.HasField("chunk"))
        # float32 greedy, as transformers continues the same file (tools/parity/second.py)
        assert text == " the capital of the country of France."
    finally:
        proc.popen.terminate()
        proc.popen.wait(60)
