"""The Redis backend: counters shared by every replica, one Lua script per step.

Each step (reserve, settle, renew one lease) is a single ``EVALSHA`` (one
round trip); if the server does not know the script yet (a restart, a
failover, ``SCRIPT FLUSH``), the same call is repeated as ``EVAL``, which
also caches it. A script runs atomically, so two replicas can never both take
the last unit of a limit.

Keys are ``<prefix>:{<tenant id>}:...``: namespaced, and hash-tagged by
tenant so that every key one request touches lives in one Redis Cluster slot.
All of them expire: window counters a little after their window, quota
counters two days after their period, concurrency sets a little after their
newest lease. A concurrency slot is a member of a sorted set scored by its
lease expiry: the limiter renews the leases of running requests, and a lease
whose replica died is dropped by the next check after it expires, so slots
cannot leak.

Times come from the caller's clock (the replicas must agree, as NTP gives,
to well under one window bucket). Every Redis failure becomes
``BackendUnavailable``; the limiter decides what that means.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError

from inferflux.policy.ratelimit.checks import (
    CONCURRENCY_RETRY_MS,
    QUOTA_GRACE_SECONDS,
    BackendUnavailable,
    Check,
    CheckResult,
    Dimension,
)

DEFAULT_PREFIX = "inferflux:rl"

# ARGV: now, lease id, lease expiry, quota grace, concurrency retry ms; then six per check: kind,
# limit, cost, window, buckets, period end. Returns admitted, then for each
# check: allowed, used, retry-after ms, reset ms (as before this request's charge). Mirrors policy.ratelimit.checks
# and MemoryBackend operation for operation.
RESERVE = """
local now = tonumber(ARGV[1])
local lease = ARGV[2]
local lease_until = tonumber(ARGV[3])
local grace = tonumber(ARGV[4])
local function millis(seconds)
  local ms = math.ceil(seconds * 1000)
  if ms < 0 then return 0 end
  return ms
end
local out = {1}
local commits = {}
for i, key in ipairs(KEYS) do
  local a = 5 + (i - 1) * 6
  local kind = ARGV[a + 1]
  local limit = tonumber(ARGV[a + 2])
  local cost = tonumber(ARGV[a + 3])
  local allowed, used, retry, reset
  retry = 0
  if kind == 'w' then
    local window = tonumber(ARGV[a + 4])
    local n = tonumber(ARGV[a + 5])
    local g = window / n
    local current = math.floor(now / g)
    local flat = redis.call('HGETALL', key)
    local live, stale = {}, {}
    used = 0
    for j = 1, #flat, 2 do
      local index = tonumber(flat[j])
      if index < current - n then
        stale[#stale + 1] = flat[j]
      else
        local count = tonumber(flat[j + 1])
        live[#live + 1] = {index, count}
        used = used + count
      end
    end
    if #stale > 0 then redis.call('HDEL', key, unpack(stale)) end
    table.sort(live, function(x, y) return x[1] < y[1] end)
    local newest = nil
    for _, e in ipairs(live) do
      if e[2] > 0 then newest = e[1] end
    end
    allowed = used + cost <= limit
    if allowed then
      if cost > 0 then commits[#commits + 1] = {'w', key, current, cost, millis(window + 2 * g)} end
    elseif cost > limit then
      retry = millis(window)
    else
      local need, released = used + cost - limit, 0
      for _, e in ipairs(live) do
        released = released + e[2]
        if released >= need then
          retry = millis((e[1] + n + 1) * g - now)
          break
        end
      end
    end
    if newest == nil then reset = 0 else reset = millis((newest + n + 1) * g - now) end
  elseif kind == 'c' then
    redis.call('ZREMRANGEBYSCORE', key, '-inf', ARGV[1])
    used = redis.call('ZCARD', key)
    allowed = used + 1 <= limit
    reset = 0
    if allowed then
      commits[#commits + 1] = {'c', key}
    else
      retry = tonumber(ARGV[5])
    end
  else
    used = tonumber(redis.call('GET', key) or '0')
    local period_end = tonumber(ARGV[a + 6])
    if kind == 'b' then allowed = used < limit else allowed = used + cost <= limit end
    reset = millis(period_end - now)
    if allowed then
      commits[#commits + 1] = {'q', key, cost, math.ceil((period_end + grace) * 1000)}
    else
      retry = reset
    end
  end
  if not allowed then out[1] = 0 end
  out[#out + 1] = allowed and 1 or 0
  out[#out + 1] = used
  out[#out + 1] = retry
  out[#out + 1] = reset
end
if out[1] == 1 then
  local lease_ttl = millis(lease_until - now) + 1000
  for _, c in ipairs(commits) do
    if c[1] == 'w' then
      redis.call('HINCRBY', c[2], c[3], c[4])
      redis.call('PEXPIRE', c[2], c[5])
    elseif c[1] == 'c' then
      redis.call('ZADD', c[2], lease_until, lease)
      if redis.call('PTTL', c[2]) < lease_ttl then redis.call('PEXPIRE', c[2], lease_ttl) end
    else
      redis.call('INCRBY', c[2], c[3])
      redis.call('PEXPIREAT', c[2], c[4])
    end
  end
end
return out
"""

# ARGV: now, lease id, reserved at, (unused), quota grace; then five per check: kind (t: token
# window, q: quota, b: budget, c: concurrency), window, buckets, period end, its delta. Returns the
# budget counters' values after the correction, in order.
SETTLE = """
local now = tonumber(ARGV[1])
local lease = ARGV[2]
local reserved = tonumber(ARGV[3])
local grace = tonumber(ARGV[5])
local out = {}
for i, key in ipairs(KEYS) do
  local a = 5 + (i - 1) * 5
  local kind = ARGV[a + 1]
  local delta = tonumber(ARGV[a + 5])
  if kind == 'c' then
    redis.call('ZREM', key, lease)
  elseif kind == 'b' or kind == 'q' then
    local value = tonumber(redis.call('GET', key) or '0')
    if delta ~= 0 then
      value = redis.call('INCRBY', key, delta)
      if value < 0 then
        redis.call('SET', key, 0)
        value = 0
      end
      redis.call('PEXPIREAT', key, math.ceil((tonumber(ARGV[a + 4]) + grace) * 1000))
    end
    if kind == 'b' then out[#out + 1] = value end
  elseif delta == 0 then
    -- nothing to correct
  else
    local window = tonumber(ARGV[a + 2])
    local n = tonumber(ARGV[a + 3])
    local g = window / n
    local charged = math.floor(reserved / g)
    local current = math.floor(now / g)
    local index = nil
    if charged >= current - n then index = charged elseif delta > 0 then index = current end
    if index ~= nil then
      if redis.call('HINCRBY', key, index, delta) < 0 then redis.call('HSET', key, index, 0) end
      local ttl = math.ceil(((index + n + 1) * g - now) * 1000) + math.ceil(g * 1000)
      if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
    end
  end
end
return out
"""

# ARGV: now, lease id, new expiry. Extends the lease where it is still held
# (XX: a lease that already expired is not brought back).
RENEW = """
local now = tonumber(ARGV[1])
local ttl = math.ceil((tonumber(ARGV[3]) - now) * 1000) + 1000
for _, key in ipairs(KEYS) do
  local held = redis.call('ZSCORE', key, ARGV[2])
  if held and tonumber(held) > now then
    redis.call('ZADD', key, ARGV[3], ARGV[2])
    if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
  end
end
return 1
"""


class _Script:
    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()


_RESERVE, _SETTLE, _RENEW = _Script(RESERVE), _Script(SETTLE), _Script(RENEW)


def _num(value: float) -> str:
    return repr(float(value))  # the shortest text that reads back as the same double in Lua


class RedisBackend:
    """Counters in Redis, shared by every replica that uses the same ``prefix``."""

    def __init__(self, client: Redis, *, prefix: str = DEFAULT_PREFIX) -> None:
        """Use ``client`` (its owner closes it unless ``from_url`` made it); keys start with ``prefix:``."""
        self.client = client
        self.prefix = prefix
        self._owns_client = False

    @classmethod
    def from_url(cls, url: str, *, prefix: str = DEFAULT_PREFIX, timeout: float = 0.5) -> RedisBackend:
        """A backend on its own client, with short timeouts and one immediate reconnect on error.

        redis-py's default retries back off for seconds; on the request path a
        dead Redis must be noticed in about ``timeout``, not after a pause.
        """
        client = Redis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 1),
        )
        backend = cls(client, prefix=prefix)
        backend._owns_client = True
        return backend

    async def reserve(
        self, checks: Sequence[Check], lease_id: str, lease_expires_at: float, now: float
    ) -> tuple[bool, list[CheckResult]]:
        args: list[str | int] = [
            _num(now), lease_id, _num(lease_expires_at), QUOTA_GRACE_SECONDS, CONCURRENCY_RETRY_MS
        ]
        for check in checks:
            kind, window, period_end = check.dimension.kind, _num(check.window), _num(check.expires_at)
            args += [kind, check.limit, check.cost, window, check.buckets, period_end]
        reply = await self._run(_RESERVE, [self._key(c) for c in checks], args)
        values = [int(v) for v in reply]
        results = [
            CheckResult(bool(values[i]), values[i + 1], values[i + 2], values[i + 3]) for i in range(1, len(values), 4)
        ]
        return bool(values[0]), results

    async def settle(
        self, checks: Sequence[Check], lease_id: str, reserved_at: float, token_delta: int, now: float,
        spend_delta: int = 0,
    ) -> list[int]:
        keys: list[str] = []
        args: list[str | int] = [_num(now), lease_id, _num(reserved_at), 0, QUOTA_GRACE_SECONDS]
        for check in checks:
            kind = check.dimension.kind
            delta = spend_delta if check.dimension is Dimension.SPEND else token_delta
            # A request is a request whatever it cost, and an exact estimate needs no correction
            # (a budget's value is read all the same, for its thresholds).
            if check.dimension is Dimension.REQUESTS or (kind not in ("c", "b") and delta == 0):
                continue
            keys.append(self._key(check))
            args += ["t" if kind == "w" else kind, _num(check.window), check.buckets, _num(check.expires_at), delta]
        if not keys:
            return []
        return [int(v) for v in await self._run(_SETTLE, keys, args)]

    async def renew(self, leases: Sequence[tuple[str, Sequence[Check]]], expires_at: float, now: float) -> None:
        # One call per lease rather than one for all: a lease's keys share a
        # cluster slot, different tenants' keys do not.
        for lease_id, checks in leases:
            keys = [self._key(c) for c in checks if c.dimension is Dimension.CONCURRENCY]
            if keys:
                await self._run(_RENEW, keys, [_num(now), lease_id, _num(expires_at)])

    async def start(self) -> None:
        """Nothing to start: the client connects on first use."""

    async def ping(self) -> None:
        """BackendUnavailable unless Redis answers now (for readiness)."""
        try:
            await self.client.ping()
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            raise BackendUnavailable(f"Redis: {exc}") from None

    async def close(self) -> None:
        if self._owns_client:
            await self.client.aclose()

    async def delete_all(self) -> int:
        """Delete every key under this backend's prefix (tests, and an operator's reset)."""
        try:
            deleted = 0
            async for key in self.client.scan_iter(match=f"{self.prefix}:*", count=500):
                deleted += await self.client.delete(key)
            return deleted
        except (RedisError, OSError) as exc:
            raise BackendUnavailable(f"Redis: {exc}") from None

    def _key(self, check: Check) -> str:
        return f"{self.prefix}:{check.key}"

    async def _run(self, script: _Script, keys: list[str], args: list[str | int]) -> Any:
        try:
            try:
                return await self.client.evalsha(script.sha, len(keys), *keys, *args)
            except NoScriptError:
                return await self.client.eval(script.source, len(keys), *keys, *args)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            raise BackendUnavailable(f"Redis: {exc}") from None
