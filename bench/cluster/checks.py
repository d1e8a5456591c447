"""The six rows of ``make cluster-verify``, each run against a live ``LocalCluster``.

Every check measures through real processes (HAProxy, Redis, kvfence replicas) and returns a
``Row``: pass/fail, the figures it measured, and one line saying what they mean.
"""

from __future__ import annotations

import asyncio
import random
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from bench.cluster.calls import Clients, Outcome, generate, prompt_ids, scrape
from bench.cluster.health import replica_serving
from bench.cluster.local import TENANTS, LocalCluster, Replica
from bench.cluster.local import alive as is_alive

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

    # -- 4. replica loss ---------------------------------------------------------------------

    async def _load(
        self, tenants: tuple[str, ...], seconds: float, event_at: float, event: Callable[[], None],
        max_tokens: int, workers: int = 2,
    ) -> tuple[list[tuple[str, Outcome]], dict[str, list[int]], float]:
        prompts = {t: prompt_ids(self.rng, 24) for t in tenants}
        reference: dict[str, list[int]] = {}
        for t in tenants:
            o = await generate(self.clients.get(self.state.lb, t, True), prompts[t], max_tokens)
            if not o.ok:
                raise RuntimeError(f"{t}: reference call failed: {o.code} {o.message}")
            reference[t] = o.token_ids
        results: list[tuple[str, Outcome]] = []
        start = time.monotonic()
        fired_at = 0.0

        async def worker(t: str) -> None:
            while time.monotonic() < start + seconds:
                client = self.clients.get(self.state.lb, t, True)
                results.append((t, await generate(client, prompts[t], max_tokens)))

        async def trigger() -> None:
            nonlocal fired_at
            await asyncio.sleep(event_at)
            fired_at = time.monotonic()
            event()

        await asyncio.gather(trigger(), *(worker(t) for t in tenants for _ in range(workers)))
        return results, reference, fired_at

    async def replica_loss(self) -> Row:
        self._all_ready()
        homes = {t: await self.home_of(t) for t in AFFINITY_TENANTS}
        victim = homes["alpha"]
        moved = tuple(t for t in AFFINITY_TENANTS if homes[t] is victim)
        prefix = f"{socket.gethostname()}:{victim.pid}:"
        ttl = float(self.state.settings["lease_ttl_s"])  # type: ignore[arg-type]

        watch: list[asyncio.Task[float | None]] = []
        leases_at_kill = 0

        def kill() -> None:
            nonlocal leases_at_kill
            leases_at_kill = self._leases_of(prefix)
            self.cluster.signal_replica(victim, signal.SIGKILL)
            watch.append(asyncio.ensure_future(self._wait_leases_gone(prefix, ttl + 2.0)))

        results, reference, killed_at = await self._load(AFFINITY_TENANTS, 12.0, 3.0, kill, 12)
        released_after = await watch[0]
        wrong = [o for t, o in results if o.ok and o.token_ids != reference[t]]
        partial = [(t, o) for t, o in results if not o.ok and o.chunks > 0]
        failed_clean = [(t, o) for t, o in results if not o.ok and o.chunks == 0]
        partial_ok = all(o.code == "UNAVAILABLE" and t in moved for t, o in partial)
        after = [o for t, o in results if t in moved and o.started_at > killed_at and o.ok]
        others_ok = all(o.ok for t, o in results if t not in moved)
        released_ok = released_after is not None and released_after <= ttl + 0.25
        self.cluster.start_replica(victim)
        self.cluster.state.save()
        passed = (
            not wrong and not failed_clean and partial_ok and bool(after) and others_ok
            and released_ok
        )
        return Row(
            "4 replica loss",
            passed,
            f"SIGKILL {victim.name}: {len(results)} calls, {len(wrong)} wrong, "
            f"{len(partial)} cut after tokens (UNAVAILABLE), {len(failed_clean)} failed before "
            f"a token; leases gone {released_after if released_after is None else round(released_after, 2)} s after kill (TTL {ttl})",
            {
                "victim": victim.name,
                "tenants_moved": list(moved),
                "calls": len(results),
                "completed_exact": sum(1 for _, o in results if o.ok) - len(wrong),
                "wrong_output": len(wrong),
                "cut_after_tokens_unavailable": len(partial),
                "cut_codes": sorted({f"{o.code}: {o.message}"[:120] for _, o in partial}),
                "failed_before_first_token": len(failed_clean),
                "moved_tenant_calls_ok_after_kill": len(after),
                "leases_at_kill": leases_at_kill,
                "lease_release_s": released_after,
                "lease_ttl_s": ttl,
            },
        )

    def _leases_of(self, prefix: str) -> int:
        count = 0
        for key in self.redis.scan_iter("kvfence:*:streams"):
            count += sum(1 for m in self.redis.zrange(key, 0, -1) if m.decode().startswith(prefix))
        return count

    async def _wait_leases_gone(self, prefix: str, limit_s: float) -> float | None:
        """Seconds from now until no unexpired lease of ``prefix`` is left (None: not within
        ``limit_s``)."""
        since = time.monotonic()
        while time.monotonic() < since + limit_s:
            # A lease past its expiry no longer counts (the acquire script drops it first).
            now_s, now_us = self.redis.time()
            now = now_s + now_us / 1e6
            live = 0
            for key in self.redis.scan_iter("kvfence:*:streams"):
                live += sum(
                    1
                    for m, score in self.redis.zrange(key, 0, -1, withscores=True)
                    if m.decode().startswith(prefix) and score > now
                )
            if live == 0:
                return time.monotonic() - since
            await asyncio.sleep(0.05)
        return None

    # -- 5. drain ----------------------------------------------------------------------------

    async def drain(self) -> Row:
        self._all_ready()
        victim = await self.home_of("beta")
        left_at: list[float] = []

        def term() -> None:
            self.cluster.signal_replica(victim, signal.SIGTERM)

        async def watch() -> None:
            while not left_at:
                if self.cluster.lb_states().get(victim.name) not in ("UP", None):
                    left_at.append(time.monotonic())
                await asyncio.sleep(0.02)

        watcher = asyncio.create_task(watch())
        results, reference, termed_at = await self._load(("beta",), 6.0, 2.0, term, 4, workers=3)
        await asyncio.wait_for(watcher, 10)
        left_s = left_at[0] - termed_at
        failed = [o for t, o in results if not o.ok or o.token_ids != reference[t]]
        exited = self.cluster.wait_exit(victim.pid, 30)
        self.cluster.start_replica(victim)
        self.cluster.state.save()
        return Row(
            "5 drain",
            left_s <= 2.0 and not failed and exited,
            f"SIGTERM {victim.name}: out of the rotation {left_s:.2f} s later (need <= 2 s); "
            f"{len(failed)} of {len(results)} calls failed",
            {
                "victim": victim.name,
                "left_rotation_s": round(left_s, 3),
                "calls": len(results),
                "failed": len(failed),
                "exited": exited,
            },
        )

    # -- 6. Redis down -----------------------------------------------------------------------

    async def redis_down(self, outage_s: float = 10.0) -> Row:
        self._all_ready()
        mode = str(self.state.settings["on_redis_failure"])
        logs = {r.name: self.cluster.logs / f"{r.name}.log" for r in self.state.replicas}
        offsets = {n: p.stat().st_size for n, p in logs.items()}
        self.cluster.stop_redis()
        start = time.monotonic()
        outcomes: list[Outcome] = []
        serving_throughout = True
        n = 0
        while time.monotonic() < start + outage_s:
            r = self.state.replicas[n % 3]
            n += 1
            outcomes.append(
                await generate(self.clients.get(r.target, "alpha"), prompt_ids(self.rng, 8), 1)
            )
            serving_throughout = serving_throughout and replica_serving(r.target)
            await asyncio.sleep(0.2)
        self.cluster.start_redis()
        self.cluster.state.save()
        await asyncio.sleep(1.5)  # past the replicas' retry interval
        resumed = await self._wait_for(
            lambda: self._admits_through_redis("alpha"), timeout_s=10.0
        )
        alive = all(is_alive(r.pid) and replica_serving(r.target) for r in self.state.replicas)
        codes: dict[str, int] = {}
        for o in outcomes:
            key = "admitted" if o.ok else o.code
            codes[key] = codes.get(key, 0) + 1
        outage_logs = {
            n: p.read_bytes()[offsets[n]:].count(b'"limits.redis_unavailable"')
            for n, p in logs.items()
        }
        failures = sum(
            v
            for r in self.state.replicas
            for k, v in scrape(r.metrics_port).items()
            if k.startswith("kvfence_limits_redis_failures_total")
        )
        expected = {"admitted": len(outcomes)} if mode == "open" else {"UNAVAILABLE": len(outcomes)}
        passed = (
            codes == expected and alive and serving_throughout and resumed and failures > 0
            and all(v <= 1 for v in outage_logs.values()) and sum(outage_logs.values()) >= 1
        )
        return Row(
            "6 redis down",
            passed,
            f"mode {mode}: {codes} over {outage_s:.0f} s, replicas up throughout: "
            f"{alive and serving_throughout}, limits back in Redis: {resumed}",
            {
                "mode": mode,
                "outage_s": outage_s,
                "calls": codes,
                "replicas_serving": alive and serving_throughout,
                "outage_log_lines": outage_logs,
                "failures_metric_total": failures,
                "limits_resumed": resumed,
            },
        )

    async def _admits_through_redis(self, tenant: str) -> bool:
        before = self.redis.exists(f"kvfence:{{{tenant}}}:streams")
        if before:
            self.redis.delete(f"kvfence:{{{tenant}}}:streams")
        ids = prompt_ids(self.rng, 8)
        target = self.state.replicas[0].target
        task = asyncio.create_task(generate(self.clients.get(target, tenant), ids, 24))
        seen = False
        while not task.done():
            seen = seen or self._streams_in_redis(tenant) > 0
            await asyncio.sleep(0.01)
        return seen and (await task).ok

    async def _wait_for(self, probe: Callable[[], Awaitable[bool]], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if await probe():
                    return True
            except redis.RedisError:
                pass
            await asyncio.sleep(0.2)
        return False

    async def close(self) -> None:
        await self.clients.close()
        self.redis.close()
