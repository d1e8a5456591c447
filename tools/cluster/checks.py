"""The six rows of ``make cluster-verify``, each run against a live ``LocalCluster``.

Every check measures through real processes (HAProxy, Redis, kvfence replicas) and returns a
``Row``: pass/fail, the figures it measured, and one line saying what they mean.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from tools.cluster.calls import Clients, Outcome, generate, prompt_ids
from tools.cluster.local import TENANTS, LocalCluster, Replica

AFFINITY_TENANTS = ("alpha", "beta", "gamma")
PAGE = 16


@dataclass(slots=True)
class Row:
    check: str
    passed: bool
    summary: str
    figures: dict[str, Any] = field(default_factory=dict)


class Checks:
    def __init__(self, cluster: LocalCluster, seed: int = 0) -> None:
        self.cluster = cluster
        self.state = cluster.state
        self.clients = Clients(self.state.keys)
        self.rng = random.Random(seed or time.time_ns())
        self.redis: Any = redis.Redis.from_url(self.state.redis_url, socket_timeout=1.0)

    # -- helpers -----------------------------------------------------------------------------

    async def _served(self, tenant: str) -> dict[str, int]:
        """{replica: prompt tokens it has processed for ``tenant``} (GetUsage on each)."""
        out: dict[str, int] = {}
        for r in self.state.replicas:
            try:
                u = await self.clients.get(r.target, tenant).usage(timeout=5)
                out[r.name] = u.prefix_hit_tokens + u.prefix_miss_tokens
            except Exception:
                out[r.name] = -1
        return out

    async def home_of(self, tenant: str) -> Replica:
        """The replica the balancer sends ``tenant`` to: the one whose counters move."""
        moved: list[Replica] = []
        for _ in range(3):
            before = await self._served(tenant)
            await generate(self.clients.get(self.state.lb, tenant), prompt_ids(self.rng, 8), 1)
            after = await self._served(tenant)
            moved = [r for r in self.state.replicas if after[r.name] > before[r.name]]
            if len(moved) == 1:
                return moved[0]
        raise RuntimeError(f"{tenant}: expected one replica to serve it, got {moved}")

    def _all_ready(self) -> None:
        """Every replica serving and UP in HAProxy (a check may follow a restart)."""
        for r in self.state.replicas:
            self.cluster.wait_replica(r, 600)
        self.cluster.wait_lb_up(60)

    async def _hit_rate(self, target: str, tenant: str, repeats: int) -> tuple[float, int, int]:
        ids = prompt_ids(self.rng, 6 * PAGE + 5)
        hits = total = 0
        for _ in range(repeats):
            o = await generate(self.clients.get(target, tenant), ids, 1)
            if not o.ok:
                raise RuntimeError(f"{tenant} via {target}: {o.code} {o.message}")
            hits, total = hits + o.cached_tokens, total + o.prompt_tokens
        return hits / total, hits, total

    async def _phase(self, target: str, repeats: int) -> dict[str, dict[str, Any]]:
        before = {t: await self._served(t) for t in AFFINITY_TENANTS}
        # NOTE: one call in flight at a time. With HAProxy's bounded load, a replica already
        # holding another tenant's in-flight call is "over the average" at this tiny load and
        # the call moves on; under real load the average is large and affinity holds.
        rates = [await self._hit_rate(target, t, repeats) for t in AFFINITY_TENANTS]
        out: dict[str, dict[str, Any]] = {}
        for t, (rate, hits, total) in zip(AFFINITY_TENANTS, rates, strict=True):
            after = await self._served(t)
            used = sum(1 for r in after if after[r] > before[t][r])
            out[t] = {"hit_rate": round(rate, 3), "cached": hits, "prompt": total, "replicas": used}
        return out

    # -- 1. affinity -------------------------------------------------------------------------

    async def affinity(self, repeats: int = 6) -> Row:
        single = await self._phase(self.state.replicas[0].target, repeats)
        lb = await self._phase(self.state.lb, repeats)
        rr = await self._phase(self.state.lb_roundrobin, repeats)
        ratios = {t: lb[t]["hit_rate"] / single[t]["hit_rate"] for t in AFFINITY_TENANTS}
        passed = all(single[t]["hit_rate"] > 0 and ratios[t] >= 0.9 for t in AFFINITY_TENANTS)
        worst = min(ratios.values())
        rr_worst = min(rr[t]["hit_rate"] / single[t]["hit_rate"] for t in AFFINITY_TENANTS)
        return Row(
            "1 affinity",
            passed,
            f"hit rate via ring hash >= {worst:.2f}x one replica (need 0.90x); "
            f"round robin {rr_worst:.2f}x",
            {"single_replica": single, "ring_hash": lb, "round_robin": rr, "ratio": ratios},
        )

    # -- 2. isolation ------------------------------------------------------------------------

    async def isolation(self) -> Row:
        """For each route, alpha caches a fresh prompt there, then beta sends it once: beta
        must get 0 cached tokens, while alpha's own repeat gets its hit (the control)."""
        routes = [
            ("ring_hash", self.state.lb, 2),
            ("round_robin", self.state.lb_roundrobin, 3),
            *((r.name, r.target, 2) for r in self.state.replicas),
        ]
        control: dict[str, int] = {}
        probes: dict[str, int] = {}
        for label, target, warm in routes:
            ids = prompt_ids(self.rng, 4 * PAGE + 3)
            owner = [
                await generate(self.clients.get(target, "alpha"), ids, 1) for _ in range(warm)
            ]
            control[label] = owner[-1].cached_tokens
            o = await generate(self.clients.get(target, "beta"), ids, 1)
            if not o.ok:
                raise RuntimeError(f"beta via {label}: {o.code} {o.message}")
            probes[label] = o.cached_tokens
        leaked = sum(probes.values())
        direct = [r.name for r in self.state.replicas]
        return Row(
            "2 isolation",
            leaked == 0 and all(control[n] > 0 for n in direct),
            f"beta got {leaked} cached tokens on alpha's prefixes over {len(routes)} routes "
            f"(alpha's own repeats: {min(control[n] for n in direct)}+ cached tokens each)",
            {"alpha_cached_on_repeat": control, "beta_cached": probes},
        )

    # -- 3. global limits --------------------------------------------------------------------

    def _streams_in_redis(self, tenant: str) -> int:
        return int(self.redis.zcard(f"kvfence:{{{tenant}}}:streams"))

    async def global_limits(self, window_s: float = 60.0) -> Row:
        tpm, cap = TENANTS["metered"]
        replicas = self.state.replicas
        # (a) the stream cap across replicas: 3 rounds of 12 concurrent 12-token streams.
        peak_redis = 0
        sampling = True

        async def sample() -> None:
            nonlocal peak_redis
            while sampling:
                peak_redis = max(peak_redis, self._streams_in_redis("metered"))
                await asyncio.sleep(0.02)

        sampler = asyncio.create_task(sample())
        outcomes: list[Outcome] = []
        for _ in range(3):
            outcomes += await asyncio.gather(
                *(
                    generate(
                        self.clients.get(replicas[i % 3].target, "metered"),
                        prompt_ids(self.rng, 8),
                        12,
                    )
                    for i in range(12)
                )
            )
        sampling = False
        await sampler
        admitted = [o for o in outcomes if o.admitted_at is not None]
        events = sorted(
            [(o.admitted_at or 0.0, 1) for o in admitted] + [(o.ended_at, -1) for o in admitted]
        )
        live = peak_client = 0
        for _, step in events:
            live += step
            peak_client = max(peak_client, live)
        # (b) tokens per minute: empty the bucket, then count the cost admitted over the
        # window. Admission is what is measured, so each call is cancelled once Started
        # arrives; one paced caller per replica.
        await self._drain_bucket("metered")
        admitted_cost, refused, n = 0, 0, 0
        start = time.monotonic()

        async def caller(target: str) -> None:
            nonlocal admitted_cost, refused, n
            client = self.clients.get(target, "metered")
            while (now := time.monotonic()) < start + window_s:
                n += 1
                o = await generate(client, prompt_ids(self.rng, 48), 2, cancel_after_start=True)
                if o.admitted_at is not None:
                    admitted_cost += o.prompt_tokens + 2
                elif o.code == "RESOURCE_EXHAUSTED":
                    refused += 1
                else:
                    raise RuntimeError(f"metered: {o.code} {o.message}")
                await asyncio.sleep(max(0.0, 0.15 - (time.monotonic() - now)))

        await asyncio.gather(*(caller(r.target) for r in replicas))
        elapsed = time.monotonic() - start
        rate = admitted_cost * 60.0 / elapsed
        within = abs(rate - tpm) <= 0.1 * tpm
        capped = peak_client <= cap and peak_redis <= cap and len(admitted) >= cap
        return Row(
            "3 global limits",
            within and capped,
            f"{rate:.0f} tokens/min admitted across 3 replicas (limit {tpm}, ±10%); "
            f"peak streams {max(peak_client, peak_redis)} (cap {cap})",
            {
                "tokens_per_minute_limit": tpm,
                "admitted_tokens_per_minute": round(rate, 1),
                "window_s": round(elapsed, 1),
                "requests": n,
                "refused": refused,
                "stream_cap": cap,
                "peak_streams_client": peak_client,
                "peak_streams_redis": peak_redis,
                "streams_admitted": len(admitted),
                "streams_refused": len(outcomes) - len(admitted),
            },
        )

    async def _drain_bucket(self, tenant: str) -> None:
        """Spend the tenant's bucket down to less than one small call (50 tokens): one caller
        per replica, so the spending outpaces the refill even when each call is slow."""
        for max_tokens in (700, 2):
            empty = False

            async def spend(target: str, max_tokens: int) -> None:
                nonlocal empty
                client = self.clients.get(target, tenant)
                while not empty:
                    o = await generate(
                        client, prompt_ids(self.rng, 48), max_tokens, cancel_after_start=True
                    )
                    empty = empty or (o.code == "RESOURCE_EXHAUSTED" and "rate" in o.message)

            await asyncio.gather(*(spend(r.target, max_tokens) for r in self.state.replicas))

    async def close(self) -> None:
        await self.clients.close()
        self.redis.close()
