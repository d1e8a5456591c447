"""Tenant limits shared by every replica, kept in Redis by two Lua scripts.

Per tenant, two keys that share a hash tag (so they live on one Redis Cluster slot):

- ``<prefix>:{<tenant>}:bucket``: a hash ``level``/``ts``, the token bucket over
  ``prompt + max_tokens`` refilled at ``tokens_per_minute``.
- ``<prefix>:{<tenant>}:streams``: a sorted set of stream leases, member = lease id,
  score = the Redis time at which the lease expires unless its replica renews it.

``ACQUIRE`` drops expired leases, checks the stream cap, refills and checks the bucket, and
only when both pass takes the tokens and adds the lease: one script, so it runs atomically
and a refused request consumes nothing. Time is Redis's own ``TIME``, so replicas' clocks
never matter. Every Redis error reaches the caller (``ClusterLimiter`` decides what an
outage means).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from redis.asyncio import Redis

from service.admission.tenants import Quotas

# NOTE: Lua numbers come back from Redis truncated to integers, so fractional results are
# returned as strings.
ACQUIRE = """
local capacity = tonumber(ARGV[1])
local rate = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])
local max_streams = tonumber(ARGV[4])
local lease = ARGV[5]
local ttl = tonumber(ARGV[6])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local active = redis.call('ZCARD', KEYS[2])
if active >= max_streams then
  return {1, active, '1'}
end
if capacity > 0 then
  local b = redis.call('HMGET', KEYS[1], 'level', 'ts')
  local level = tonumber(b[1]) or capacity
  local ts = tonumber(b[2]) or now
  level = math.min(capacity, level + math.max(0, now - ts) * rate)
  if level < cost then
    return {2, active, tostring((cost - level) / rate)}
  end
  redis.call('HSET', KEYS[1], 'level', tostring(level - cost), 'ts', tostring(now))
  redis.call('PEXPIRE', KEYS[1], math.ceil(capacity / rate * 1000) + 60000)
end
redis.call('ZADD', KEYS[2], now + ttl, lease)
redis.call('PEXPIRE', KEYS[2], math.ceil(ttl * 2000))
return {0, active + 1, '0'}
"""

# KEYS[i] is the streams set of lease ARGV[i + 1]; ARGV[1] is the TTL. Every lease this
# replica still holds is re-added, not only pushed back: a Redis restarted empty (or a lease
# expired while Redis was unreachable) would otherwise drop live streams from the cap for
# good, and other replicas would admit past it. Returns how many leases were missing.
# A lease released while this ran is removed again by the caller (``ClusterLimiter``).
RENEW = """
local t = redis.call('TIME')
local expires = tonumber(t[1]) + tonumber(t[2]) / 1000000 + tonumber(ARGV[1])
local restored = 0
for i, key in ipairs(KEYS) do
  restored = restored + redis.call('ZADD', key, expires, ARGV[i + 1])
  redis.call('PEXPIRE', key, math.ceil(tonumber(ARGV[1]) * 2000))
end
return restored
"""

ADMITTED, STREAMS_FULL, TOKENS_SHORT = 0, 1, 2


@dataclass(frozen=True, slots=True)
class Decision:
    """What ``ACQUIRE`` answered: ``outcome`` is one of ADMITTED, STREAMS_FULL, TOKENS_SHORT."""

    outcome: int
    active: int  # the tenant's leases across the cluster, this one included when admitted
    retry_after_s: float


@dataclass(frozen=True, slots=True)
class LeaseKey:
    tenant: str
    lease_id: str


class RedisLimitStore:
    """The two scripts and the calls around them; one instance per process."""

    def __init__(self, client: Redis, prefix: str = "kvfence") -> None:
        self._client = client
        self._prefix = prefix
        self._acquire = client.register_script(ACQUIRE)
        self._renew = client.register_script(RENEW)

    def streams_key(self, tenant: str) -> str:
        return f"{self._prefix}:{{{tenant}}}:streams"

    def bucket_key(self, tenant: str) -> str:
        return f"{self._prefix}:{{{tenant}}}:bucket"

    async def acquire(
        self, lease: LeaseKey, cost: int, quotas: Quotas, lease_ttl_s: float
    ) -> Decision:
        tpm = quotas.tokens_per_minute
        keys = [self.bucket_key(lease.tenant), self.streams_key(lease.tenant)]
        args: list[str | int | float] = [
            tpm,
            tpm / 60.0,
            cost,
            quotas.max_concurrent_streams,
            lease.lease_id,
            lease_ttl_s,
        ]
        outcome, active, wait = await self._acquire(keys=keys, args=args)
        return Decision(int(outcome), int(active), float(wait))

    async def renew(self, leases: Sequence[LeaseKey], lease_ttl_s: float) -> int:
        """Push back the expiry of ``leases``, re-adding any Redis lost; returns how many
        were missing."""
        if not leases:
            return 0
        keys = [self.streams_key(lease.tenant) for lease in leases]
        args: list[str | float] = [lease_ttl_s, *(lease.lease_id for lease in leases)]
        return int(await self._renew(keys=keys, args=args))

    async def release(self, lease: LeaseKey) -> None:
        await self._client.zrem(self.streams_key(lease.tenant), lease.lease_id)

    async def active(self, tenant: str) -> int:
        """Unexpired leases of ``tenant`` across the cluster (for tests and operators)."""
        now_s, now_us = await self._client.time()
        now = now_s + now_us / 1e6
        return int(await self._client.zcount(self.streams_key(tenant), f"({now}", "+inf"))

    async def ping(self) -> None:
        await self._client.ping()

    async def close(self) -> None:
        await self._client.aclose()
