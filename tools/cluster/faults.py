"""Rows 4-6 of ``make cluster-verify``: breaking the cluster under load (SIGKILL a replica,
SIGTERM one, stop Redis) and checking what callers saw and what the cluster did."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from collections.abc import Awaitable, Callable

import redis

from tools.cluster.calls import Outcome, generate, prompt_ids, scrape
from tools.cluster.checks import AFFINITY_TENANTS, Checks, Row
from tools.cluster.health import replica_serving
from tools.cluster.local import alive as is_alive


class FaultChecks(Checks):
    """``Checks`` plus the three checks that break something."""

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
