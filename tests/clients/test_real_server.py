"""The clients against the real kvfence server (tests/serverutil.py) on a tiny random Llama."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")  # the base install (clients only) has no server to start
pytest.importorskip("transformers")

from clients import (
    AsyncClient,
    Chunk,
    Client,
    Finished,
    InvalidArgument,
    Started,
    Unauthenticated,
    cli,
)
from tests.serverutil import ServerHandle, TenantSpec, running_server


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    from service.model import load_model
    from tests.fixtures.tiny_models import write_tiny_llama

    model_dir: Path = write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-clients"))
    model: Any = load_model(model_dir, dtype="float32", progress=False)
    with running_server(
        model,
        {"acme": TenantSpec(), "globex": TenantSpec()},
        tenants_dir=tmp_path_factory.mktemp("tenants"),
    ) as handle:
        yield handle


def test_sync_client_streams_from_the_real_server(real: ServerHandle) -> None:
    with Client(real.target, api_key=real.keys["acme"], timeout=60) as client:
        events = list(
            client.generate(
                "Hello, world",
                max_tokens=6,
                temperature=0.0,
                ignore_eos=True,
                client_request_id="real-1",
            )
        )
        again = client.generate_text("Hello, world", max_tokens=6, temperature=0.0, ignore_eos=True)
        tokens = client.tokenize("Hello, world")
        assert client.models()[0].architecture == "llama"
        usage = client.usage()
    started, finished = events[0], events[-1]
    assert isinstance(started, Started) and started.client_request_id == "real-1"
    assert started.prompt_tokens == len(tokens.token_ids) > 0
    assert isinstance(finished, Finished) and finished.reason == "length"
    assert finished.usage.completion_tokens == 6
    chunks = [e for e in events if isinstance(e, Chunk)]
    assert sum(len(c.token_ids) for c in chunks) == 6
    # Greedy decoding is deterministic: the collected text equals the streamed one.
    assert again.text == "".join(c.text for c in chunks)
    assert again.token_ids == tuple(t for c in chunks for t in c.token_ids)
    assert usage.page_size > 0


def test_async_client_and_typed_errors_from_the_real_server(real: ServerHandle) -> None:
    async def main() -> int:
        async with AsyncClient(real.target, api_key="not-a-key", retries=0) as bad:
            with pytest.raises(Unauthenticated):
                await bad.usage()
        async with AsyncClient(real.target, api_key=real.keys["globex"], timeout=60) as client:
            with pytest.raises(InvalidArgument) as caught:
                await client.generate_text("hi", top_p=1.5)
            bad_request = caught.value.details.bad_request
            assert bad_request is not None
            assert [v.field for v in bad_request.field_violations] == ["sampling.top_p"]
            result = await client.generate_text("hi", max_tokens=3, ignore_eos=True)
            assert result.usage.completion_tokens == 3
            return await client.purge()

    assert asyncio.run(main()) >= 0


def test_cli_generate_against_the_real_server(
    real: ServerHandle, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(
        [
            "generate",
            "Hello",
            "--target",
            real.target,
            "--api-key",
            real.keys["acme"],
            "--max-tokens",
            "4",
            "--temperature",
            "0",
        ]
    )
    out, err = capsys.readouterr()
    with Client(real.target, api_key=real.keys["acme"]) as client:
        expected = client.generate_text("Hello", max_tokens=4, temperature=0.0).text
    assert (code, out, err) == (0, expected + "\n", "")
