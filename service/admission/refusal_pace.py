"""Pacing of refused calls, per peer host (and, on the HTTP front, of cheap calls per tenant).

A refused call is cheap but not free: gRPC still reads its body off the socket (up to the
receive limit), and a client that retries at once on every refusal keeps a core busy with
that alone. Measured on a 2-core machine, four threads sending 1 MiB bodies with a wrong
key made about 850 refused calls a second at 0.8 ms of server CPU each, and tripled another
tenant's inter-token gap. So refusals are paced by a token bucket per peer host: the first
``burst`` are answered at once, later ones wait for their token, and a client that waits for
its answer (as every client does before it retries) is slowed to ``rate`` calls a second.

A waiting refusal holds its call (and what gRPC buffered of the body), so at most
``max_waiting`` wait per host and none longer than ``max_wait_s``; past that a refusal is
answered at once. Authenticated calls never touch the buckets.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float
    waiting: int = 0


class RefusalPace:
    """Token buckets of refusals, one per peer host (``reserve`` / ``release``)."""

    def __init__(
        self,
        rate: float = 50.0,
        burst: int = 100,
        max_waiting: int = 32,
        max_wait_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        max_hosts: int = 4096,
    ) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("rate must be > 0 and burst >= 1")
        self._rate = rate
        self._burst = float(burst)
        self._max_waiting = max_waiting
        self._max_wait_s = max_wait_s
        self._clock = clock
        self._max_hosts = max_hosts
        self._buckets: dict[str, _Bucket] = {}

    def reserve(self, peer: str) -> float:
        """Seconds the refusal of a call from ``peer`` waits before it is answered (0: at
        once). A positive wait must be followed by ``release(peer)``."""
        bucket = self._bucket(peer)
        if bucket.tokens >= 1:
            bucket.tokens -= 1
            return 0.0
        wait = (1 - bucket.tokens) / self._rate
        if wait > self._max_wait_s or bucket.waiting >= self._max_waiting:
            return 0.0  # answered at once: holding more calls would cost memory instead
        return self._wait(bucket, wait)

    def hold(self, key: str) -> float:
        """Seconds to hold the answer of a call counted against ``key`` (0: at once). Unlike
        ``reserve``, a call past the rate is never answered early: when its turn is further
        off than ``max_wait_s`` it is held ``max_wait_s`` without taking a token, so each
        call of a flood costs its sender that long. ``max_waiting`` does not apply: the
        caller bounds how many calls can wait (the HTTP front, by its connection caps).
        A positive wait must be followed by ``release(key)``."""
        bucket = self._bucket(key)
        if bucket.tokens >= 1:
            bucket.tokens -= 1
            return 0.0
        wait = (1 - bucket.tokens) / self._rate
        if wait > self._max_wait_s:
            bucket.waiting += 1
            return self._max_wait_s
        return self._wait(bucket, wait)

    @staticmethod
    def _wait(bucket: _Bucket, wait: float) -> float:
        bucket.tokens -= 1
        bucket.waiting += 1
        return wait

    def _bucket(self, peer: str) -> _Bucket:
        """The peer host's bucket, refilled to now."""
        host = peer_host(peer)
        now = self._clock()
        bucket = self._buckets.get(host)
        if bucket is None:
            self._prune(now)
            bucket = self._buckets[host] = _Bucket(self._burst, now)
        bucket.tokens = min(self._burst, bucket.tokens + (now - bucket.at) * self._rate)
        bucket.at = now
        return bucket

    def release(self, peer: str) -> None:
        bucket = self._buckets.get(peer_host(peer))
        if bucket is not None and bucket.waiting > 0:
            bucket.waiting -= 1

    @property
    def num_hosts(self) -> int:
        return len(self._buckets)

    def _prune(self, now: float) -> None:
        """Forget hosts whose bucket has refilled (nothing to remember) once there are many."""
        if len(self._buckets) < self._max_hosts:
            return
        for host, b in list(self._buckets.items()):
            if not b.waiting and b.tokens + (now - b.at) * self._rate >= self._burst:
                del self._buckets[host]
        if len(self._buckets) >= self._max_hosts:  # all busy: drop the longest quiet one
            oldest = min(self._buckets, key=lambda h: self._buckets[h].at)
            if not self._buckets[oldest].waiting:
                del self._buckets[oldest]


def peer_host(peer: str) -> str:
    """``ipv4:10.0.0.1:5555`` -> ``ipv4:10.0.0.1``, ``ipv6:[::1]:5555`` -> ``ipv6:[::1]``;
    other forms (``unix:``) unchanged."""
    if peer.startswith(("ipv4:", "ipv6:")):
        host, sep, port = peer.rpartition(":")
        if sep and port.isdigit() and host not in ("ipv4", "ipv6"):
            return host
    return peer
