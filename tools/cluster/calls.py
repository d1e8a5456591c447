"""The calls the cluster checks make, each returning what happened instead of raising."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import grpc
from prometheus_client.parser import text_string_to_metric_families

from clients import AsyncClient, Chunk, Finished, KvfenceError, Started
from clients.retry import RetryPolicy

NO_RETRIES = RetryPolicy(enabled=False)
FIRST_PLAIN_TOKEN = 1000


def prompt_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(FIRST_PLAIN_TOKEN, 40_000) for _ in range(n)]


@dataclass(slots=True)
class Outcome:
    """One Generate call as the client saw it."""

    started_at: float
    ended_at: float = 0.0
    code: str = "OK"  # gRPC status name of the error, or OK
    message: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    chunks: int = 0
    finished: bool = False
    admitted_at: float | None = None  # when Started arrived

    @property
    def ok(self) -> bool:
        return self.code == "OK" and self.finished


async def generate(
    client: AsyncClient,
    ids: list[int],
    max_tokens: int,
    *,
    cancel_after_start: bool = False,
    timeout: float = 120.0,
) -> Outcome:
    """Greedy generation of ``max_tokens`` tokens (EOS ignored), recorded event by event."""
    out = Outcome(started_at=time.monotonic())
    stream = client.generate(
        token_ids=ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, timeout=timeout
    )
    try:
        async for event in stream:
            if isinstance(event, Started):
                out.admitted_at = time.monotonic()
                out.prompt_tokens = event.prompt_tokens
                out.cached_tokens = event.cached_prompt_tokens
                if cancel_after_start:
                    break
            elif isinstance(event, Chunk):
                out.chunks += 1
                out.token_ids.extend(event.token_ids)
            elif isinstance(event, Finished):
                out.finished = True
    except KvfenceError as err:
        out.code, out.message = err.code.name, err.message
    except grpc.RpcError as err:  # pragma: no cover - the client maps these
        out.code = err.code().name if hasattr(err, "code") else "UNKNOWN"
    finally:
        await stream.aclose()
    out.ended_at = time.monotonic()
    if cancel_after_start and out.admitted_at is not None:
        out.finished = True
    return out


class Clients:
    """One AsyncClient per (target, tenant, retrying) — channels are reused across calls."""

    def __init__(self, keys: dict[str, str]) -> None:
        self._keys = keys
        self._clients: dict[tuple[str, str, bool], AsyncClient] = {}

    def get(self, target: str, tenant: str, retries: bool = False) -> AsyncClient:
        key = (target, tenant, retries)
        if key not in self._clients:
            policy = RetryPolicy(max_attempts=6) if retries else NO_RETRIES
            self._clients[key] = AsyncClient(target, api_key=self._keys[tenant], retries=policy)
        return self._clients[key]

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._clients.values()))
        self._clients.clear()


def scrape(port: int, timeout_s: float = 2.0) -> dict[str, float]:
    """A replica's /metrics as {"name{label=value,...}": value}; {} when unreachable."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout_s) as r:
            text = r.read().decode()
    except OSError:
        return {}
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}"] = s.value
    return samples
