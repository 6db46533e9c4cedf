"""The sidecar's one connection to Redis (or Valkey) in share mode: one script call per change.

The rules are :func:`sidecar.shares.step`; :data:`STEP_LUA` is the same
function run inside Redis, atomically, on the server's ``TIME``. One hash per
provider holds the table: ``~touched`` and ``~rebuild`` (server milliseconds)
and one field per gateway, ``g:<id>`` = ``"reserved demand expires_ms"``.

Only the sidecar imports this module (and redis-py); handlers never talk to
Redis. The password comes from ``credentialFile`` (the provider key's rules)
and is handed to redis-py as a keyword, never in the URL, argv or a log line.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from shm_layout.errors import GatewayCapacityError
from sidecar.shares import Grant, Report, table_ttl_ms

if TYPE_CHECKING:
    from sidecar.config import CapacityShare

KEY_PREFIX: Final = "gateway-capacity:share:"
CALL_TIMEOUT_S: Final = 1.0

STEP_LUA: Final = r"""
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local me = 'g:' .. ARGV[1]
local cap = math.max(0, tonumber(ARGV[2]))
local held = math.max(0, tonumber(ARGV[3]))
local demand = math.max(0, tonumber(ARGV[4]))
local floor = tonumber(ARGV[5])
local lease = math.max(1, tonumber(ARGV[6]))
local ttl = tonumber(ARGV[7])

local raw = redis.call('HGETALL', KEYS[1])
local touched, rebuild = nil, 0
local fields = {}
for i = 1, #raw, 2 do
  local k, v = raw[i], raw[i + 1]
  if k == '~touched' then touched = tonumber(v)
  elseif k == '~rebuild' then rebuild = tonumber(v)
  else fields[k] = v end
end

local leases, ids = {}, {}
if touched == nil or now - touched > math.floor(lease / 2) then
  redis.call('DEL', KEYS[1])
  rebuild = now + lease
else
  for k, v in pairs(fields) do
    local r, d, e = string.match(v, '^(%d+) (%d+) (%d+)$')
    if r == nil or tonumber(e) <= now or k == me then
      redis.call('HDEL', KEYS[1], k)
    else
      leases[k] = {tonumber(r), tonumber(d)}
      ids[#ids + 1] = k
    end
  end
end
ids[#ids + 1] = me
table.sort(ids)
local rebuilding = now < rebuild

-- targets(): a floor each, the rest max-min fair by demand
local n = #ids
local base = math.min(math.max(0, floor), math.floor(cap / n))
local want, given = {}, {}
for _, g in ipairs(ids) do
  local d = demand
  if g ~= me then d = leases[g][2] end
  given[g] = base
  want[g] = math.max(0, d - base)
end
local left = cap - base * n
while left > 0 do
  local active = {}
  for _, g in ipairs(ids) do if want[g] > 0 then active[#active + 1] = g end end
  if #active == 0 then break end
  local quantum = math.max(1, math.floor(left / #active))
  for _, g in ipairs(active) do
    local part = math.min(quantum, want[g], left)
    given[g] = given[g] + part
    want[g] = want[g] - part
    left = left - part
    if left == 0 then break end
  end
end

local others = 0
for g, l in pairs(leases) do others = others + l[1] end
local limit = math.max(0, math.min(given[me], cap - others))
if rebuilding then limit = math.min(limit, held) end
local reserved = math.max(limit, held)
redis.call('HSET', KEYS[1], me, reserved .. ' ' .. demand .. ' ' .. (now + lease),
  '~touched', now, '~rebuild', rebuild)
redis.call('PEXPIRE', KEYS[1], ttl)
local r = 0
if rebuilding then r = 1 end
return {limit, reserved, n, r, others, now}
"""


def table_key(provider_id: str) -> str:
    """The Redis key of a provider's table (a hash tag, so a cluster keeps it on one node).

    Every gateway sharing a farm must give the provider the same id.
    """
    return KEY_PREFIX + "{" + provider_id + "}"


@dataclass(frozen=True, slots=True)
class Answer:
    grant: Grant
    server_ms: int


class ShareUnavailable(GatewayCapacityError):
    """Redis did not answer the call (down, unreachable, slow, refused the password)."""


class ShareClient:
    """One redis-py asyncio client and the script's SHA; ``call`` is one EVALSHA."""

    def __init__(self, share: CapacityShare, password: str | None) -> None:
        import redis.asyncio as aioredis

        kwargs: dict[str, Any] = {
            "socket_timeout": CALL_TIMEOUT_S,
            "socket_connect_timeout": CALL_TIMEOUT_S,
            "retry_on_timeout": False,
            "health_check_interval": 0,
        }
        if password is not None:
            kwargs["password"] = password
        self._redis: Any = aioredis.Redis.from_url(share.redis, **kwargs)
        self._script: Any = self._redis.register_script(STEP_LUA)
        self.calls = 0

    async def call(self, provider_id: str, report: Report) -> Answer:
        import redis

        self.calls += 1
        args = [
            report.gateway,
            report.capacity,
            report.held,
            report.demand,
            report.floor,
            report.lease_ms,
            table_ttl_ms(report.lease_ms),
        ]
        try:
            out = await asyncio.wait_for(
                self._script(keys=[table_key(provider_id)], args=args), CALL_TIMEOUT_S * 2
            )
        except (redis.RedisError, OSError, TimeoutError) as exc:
            raise ShareUnavailable(_describe(exc)) from None
        limit, reserved, gateways, rebuilding, others, now = (int(x) for x in out)
        grant = Grant(limit, reserved, gateways, bool(rebuilding), others)
        return Answer(grant, now)

    async def aclose(self) -> None:
        await self._redis.aclose()


def _describe(exc: BaseException) -> str:
    """A short reason; redis-py's messages name host and port, never the password."""
    text = str(exc).strip() or type(exc).__name__
    text = text.splitlines()[0]
    if len(text) > 120:
        text = text[:119] + "…"
    return f"Redis unavailable: {type(exc).__name__}: {text}"
