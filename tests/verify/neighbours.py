"""The noisy-neighbour harness: a victim tenant's latency while an attacker tenant works.

``Victim.run(n)`` sends ``n`` short greedy requests one after another and keeps each stream's
TTFT and inter-token gaps. ``Attack`` runs attacker loops on threads (each with its own
channel) until stopped, counting calls, status codes and tokens. Every attacker loop stays
within the attacker's own limits: it only sends what the server accepts from any tenant.
"""

from __future__ import annotations

import collections
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc

from protos.kvfence.v1 import inference_pb2, inference_pb2_grpc
from tests.verify.calls import Metadata, StreamResult, collect, gen_request
from tests.verify.stats import median, percentile


@dataclass(slots=True)
class Latency:
    """A victim's figures over a run."""

    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    def add(self, result: StreamResult) -> None:
        if not result.ok or result.ttft is None:
            self.failed.append(result.code.name)
            return
        self.ttft.append(result.ttft)
        self.itl.extend(result.itls())

    def summary(self) -> dict[str, float]:
        return {
            "ttft_p50": median(self.ttft),
            "ttft_p99": percentile(self.ttft, 99),
            "itl_p50": median(self.itl),
            "itl_p99": percentile(self.itl, 99),
        }


class Victim:
    """Short greedy requests, one at a time, like an interactive user."""

    def __init__(
        self, target: str, auth: Metadata, vocab: tuple[int, int], prompt: int, max_tokens: int
    ) -> None:
        self._stub = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(target))
        self._auth = auth
        self._rng = random.Random(11)
        self._vocab = vocab
        self._prompt = prompt
        self._max_tokens = max_tokens

    def run(self, n: int, timeout: float = 120.0) -> Latency:
        out = Latency()
        for _ in range(n):
            ids = [self._rng.randrange(*self._vocab) for _ in range(self._prompt)]
            req = gen_request(ids, max_tokens=self._max_tokens)
            out.add(collect(self._stub.Generate(req, metadata=self._auth, timeout=timeout)))
        return out


@dataclass(slots=True)
class AttackStats:
    calls: int = 0
    codes: collections.Counter[str] = field(default_factory=collections.Counter)
    prompt_tokens: int = 0
    output_tokens: int = 0
    seconds: float = 0.0

    def count(self, code: grpc.StatusCode, prompt: int = 0, output: int = 0) -> None:
        self.calls += 1
        self.codes[code.name] += 1
        self.prompt_tokens += prompt
        self.output_tokens += output

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_s(self) -> float:
        total = self.prompt_tokens + self.output_tokens
        return total / self.seconds if self.seconds else 0.0


Worker = Callable[[grpc.Channel, AttackStats, threading.Event, int], None]


@contextmanager
def attack(target: str, worker: Worker, threads: int, settle_s: float) -> Iterator[AttackStats]:
    """Run ``worker(channel, stats, stop, index)`` on ``threads`` threads until the block ends.

    The block starts after ``settle_s`` seconds, so the victim meets the attack at full
    strength, not its ramp-up."""
    stats = AttackStats()
    stop = threading.Event()
    lock = threading.Lock()
    local = [AttackStats() for _ in range(threads)]

    def run(i: int) -> None:
        channel = grpc.insecure_channel(target)
        try:
            worker(channel, local[i], stop, i)
        finally:
            channel.close()

    pool = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(threads)]
    start = time.monotonic()
    for t in pool:
        t.start()
    time.sleep(settle_s)
    try:
        yield stats
    finally:
        stop.set()
        for t in pool:
            t.join(120)
        with lock:
            stats.seconds = time.monotonic() - start
            for s in local:
                stats.calls += s.calls
                stats.codes.update(s.codes)
                stats.prompt_tokens += s.prompt_tokens
                stats.output_tokens += s.output_tokens


def stream_tokens(call: object) -> tuple[grpc.StatusCode, int, int]:
    """(status, prompt tokens, output tokens) of a Generate stream read to its end."""
    result = collect(call)  # type: ignore[arg-type]
    prompt = result.started.prompt_tokens if result.started is not None else 0
    return result.code, prompt if result.ok else 0, len(result.tokens)


def generate_loop(
    auth: Metadata,
    make: Callable[[random.Random], inference_pb2.GenerateRequest],
    timeout: float = 300.0,
) -> Worker:
    """A worker that sends ``make(rng)`` requests back to back and reads each stream."""

    def work(channel: grpc.Channel, stats: AttackStats, stop: threading.Event, i: int) -> None:
        stub = inference_pb2_grpc.InferenceStub(channel)
        rng = random.Random(1000 + i)
        while not stop.is_set():
            code, prompt, output = stream_tokens(
                stub.Generate(make(rng), metadata=auth, timeout=timeout)
            )
            stats.count(code, prompt, output)
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                stop.wait(0.05)  # a refused request costs the server nothing; do not spin

    return work
