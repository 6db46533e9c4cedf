"""The sidecar's one connection to Redis (or Valkey) in share mode: one script call per change.

The rules are :func:`sidecar.shares.step`; :data:`STEP_LUA` is the same
function run inside Redis, atomically, on the server's ``TIME``. One hash per
provider holds the table: ``~touched`` and ``~rebuild`` (server milliseconds),
``~cap`` (the capacity last reported by a gateway that knew it), ``~server`` (the
``run_id`` of the Redis that wrote it: a replica promoted by a failover drops and
rebuilds the copy it was sent, which may lack the last grants) and one field per
gateway, ``g:<id>`` = ``"reserved demand expires_ms token seq lease_ms capacity
tokens_reserved tokens_demand pool"`` and ``~tcap`` (the token pool last reported by a
gateway that knew it). The call's arguments: gateway, capacity, held, demand, floor,
lease_ms, ttl_ms, token, seq, pool, tokens_held, tokens_demand, request_tokens; its
answer: limit, reserved, gateways, rebuilding, others' reserved, server ms, refused,
run_id, rebuild left ms, tokens_limit, tokens_reserved, pool.

Only the sidecar imports this module (and redis-py); handlers never talk to
Redis. The password comes from ``credentialFile`` (the provider key's rules)
and is handed to redis-py as a keyword, never in the URL, argv or a log line.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import ipaddress
import logging
import os
import pwd
import socket
from dataclasses import dataclass
from typing import Any, Final

from capacity_contract import listeners
from shm_layout.errors import GatewayCapacityError
from sidecar.shares import DUPLICATE, STALE, Grant, Report, table_ttl_ms

log = logging.getLogger("gateway_capacity.sidecar")

# the users a distribution's Redis or Valkey package runs as: trusted to own a loopback
# Redis's listener when capacityShare.listenerOwner is not set (only root makes users)
PACKAGE_USERS: Final = ("redis", "valkey")

KEY_PREFIX: Final = "gateway-capacity:share:"
CALL_TIMEOUT_S: Final = 1.0

STEP_LUA: Final = r"""
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- this server's identity: a table another one wrote (a promoted replica's copy, which
-- may lack the last grants) is not trusted
local server = string.match(redis.call('INFO', 'server'), 'run_id:(%x+)') or ''
local me = 'g:' .. ARGV[1]
local cap = tonumber(ARGV[2])
local held = tonumber(ARGV[3])
local demand = tonumber(ARGV[4])
local floor = tonumber(ARGV[5])
local lease = math.max(1, tonumber(ARGV[6]))
local ttl = tonumber(ARGV[7])
local token = ARGV[8]
local seq = tonumber(ARGV[9])
-- the token part (absent: a caller of an older version, nothing shared in tokens)
local pool = tonumber(ARGV[10] or '0') or 0
local theld = tonumber(ARGV[11] or '0') or 0
local tdemand = tonumber(ARGV[12] or '0') or 0
local tfloor = math.max(0, floor) * math.max(0, tonumber(ARGV[13] or '0') or 0)
local keep = lease + math.floor(lease / 2)

local raw = redis.call('HGETALL', KEYS[1])
local touched, rebuild, known, tknown, writer = nil, 0, nil, nil, nil
local fields = {}
for i = 1, #raw, 2 do
  local k, v = raw[i], raw[i + 1]
  if k == '~touched' then touched = tonumber(v)
  elseif k == '~rebuild' then rebuild = tonumber(v)
  elseif k == '~cap' then known = tonumber(v)
  elseif k == '~tcap' then tknown = tonumber(v)
  elseif k == '~server' then writer = v
  else fields[k] = v end
end

-- a lease: "reserved demand expires_ms[ token seq[ lease_ms capacity[ tokens_reserved
-- tokens_demand pool]]]" (absent: older writer; capacity or pool -1: unknown at that
-- gateway; pool 0: none stated)
local function parse(v)
  local r, d, e, rest = string.match(v, '^(%d+) (%d+) (%d+)(.*)$')
  if r == nil then return nil end
  local tok, sq, ls, c, tr, td, tp = '', 0, 0, -1, 0, 0, 0
  if rest ~= '' then
    tok, sq, ls = string.match(rest, '^ (%w+) (%d+)(.*)$')
    if tok == nil then return nil end
    if ls ~= '' then
      local more
      ls, c, more = string.match(ls, '^ (%d+) (%-?%d+)(.*)$')
      if ls == nil then return nil end
      if more ~= '' then
        tr, td, tp = string.match(more, '^ (%d+) (%d+) (%-?%d+)$')
        if tr == nil then return nil end
      end
    end
    sq, ls, c = tonumber(sq), tonumber(ls) or 0, tonumber(c)
  end
  return {tonumber(r), tonumber(d), tonumber(e), tok, sq, ls, c, tonumber(tr), tonumber(td),
    tonumber(tp)}
end

-- gateways may run on different leases: a silence is judged on the shortest one in
-- the table, a rebuild waits out the longest (see step())
local shortest, longest = lease, lease
for _, v in pairs(fields) do
  local l = parse(v)
  if l ~= nil and l[6] > 0 then
    shortest = math.min(shortest, l[6])
    longest = math.max(longest, l[6])
  end
end
if touched == nil then shortest, longest = lease, lease end
ttl = math.max(ttl, 3 * longest)

local leases, ids = {}, {}
if touched == nil or writer ~= server or now - touched > math.floor(shortest / 2) then
  redis.call('DEL', KEYS[1])
  rebuild = now + longest + math.floor(longest / 2)
  known, tknown = nil, nil
else
  local mine = fields[me] and parse(fields[me])
  if mine ~= nil and mine[3] > now then
    if mine[4] ~= '' and mine[4] ~= token then return {0, 0, 0, 0, 0, now, 1, server} end
    if mine[4] == token and mine[5] > seq then return {0, 0, 0, 0, 0, now, 2, server} end
  end
  for k, v in pairs(fields) do
    local l = parse(v)
    if l == nil or l[3] <= now or k == me then
      redis.call('HDEL', KEYS[1], k)
    else
      leases[k] = l
      ids[#ids + 1] = k
    end
  end
end
ids[#ids + 1] = me
table.sort(ids)
local rebuilding = now < rebuild

-- _part(): one dimension of the call, the others' leases read at r (reserved), d
-- (demand) and c (reported capacity); returns limit, reserved, demand, known, capacity
local function part(reported, remembered, r, d, c, mine_held, mine_demand, fl)
  mine_held = math.max(0, mine_held)
  local capacity, ceiling
  if reported < 0 then
    capacity = remembered or 0
    ceiling = math.max(0, fl)
  else
    -- a gateway reading a stale (higher) capacity is held to the lowest a live one reported
    remembered = reported
    capacity = reported
    for _, l in pairs(leases) do
      if l[c] >= 0 then capacity = math.min(capacity, l[c]) end
    end
    ceiling = capacity
  end
  mine_demand = math.min(math.max(0, mine_demand), ceiling)
  -- targets(): a floor each, the rest max-min fair by demand
  local n = #ids
  local base = math.min(math.max(0, fl), math.floor(math.max(0, capacity) / n))
  local want, given = {}, {}
  for _, g in ipairs(ids) do
    local x = mine_demand
    if g ~= me then x = leases[g][d] end
    given[g] = base
    want[g] = math.max(0, x - base)
  end
  local left = math.max(0, capacity) - base * n
  while left > 0 do
    local active = {}
    for _, g in ipairs(ids) do if want[g] > 0 then active[#active + 1] = g end end
    if #active == 0 then break end
    local quantum = math.max(1, math.floor(left / #active))
    for _, g in ipairs(active) do
      local share = math.min(quantum, want[g], left)
      given[g] = given[g] + share
      want[g] = want[g] - share
      left = left - share
      if left == 0 then break end
    end
  end
  local taken = 0
  for _, l in pairs(leases) do taken = taken + l[r] end
  local limit = math.max(0, math.min(given[me], capacity - taken, ceiling))
  if rebuilding then limit = math.min(limit, mine_held) end
  return limit, math.max(limit, mine_held), mine_demand, remembered, capacity
end

-- a pool nobody states counts as unknown among the others (index 11: pool or -1)
for _, l in pairs(leases) do
  if l[10] == 0 then l[11] = -1 else l[11] = l[10] end
end
local limit, reserved, sdemand
limit, reserved, sdemand, known = part(cap, known, 1, 2, 7, held, demand, floor)
local tlimit, treserved, tdem, tcap = 0, math.max(0, theld), 0, 0
if pool ~= 0 then
  tlimit, treserved, tdem, tknown, tcap = part(pool, tknown, 8, 9, 11, theld, tdemand, tfloor)
end
local others = 0
for _, l in pairs(leases) do others = others + l[1] end
local ident = ''
if token ~= '' then
  ident = ' ' .. token .. ' ' .. seq .. ' ' .. lease .. ' ' .. ARGV[2] .. ' ' .. treserved
    .. ' ' .. tdem .. ' ' .. pool
end
redis.call('HSET', KEYS[1], me, reserved .. ' ' .. sdemand .. ' ' .. (now + keep) .. ident,
  '~touched', now, '~rebuild', rebuild, '~server', server)
if known ~= nil then redis.call('HSET', KEYS[1], '~cap', known) end
if tknown ~= nil then redis.call('HSET', KEYS[1], '~tcap', tknown) end
redis.call('PEXPIRE', KEYS[1], ttl)
local r, left = 0, 0
if rebuilding then r, left = 1, rebuild - now end
return {limit, reserved, #ids, r, others, now, 0, server, left, tlimit, treserved, tcap}
"""


def instance_token(segment: str) -> str:
    """This sidecar's instance token: one per host and segment, the same across restarts.

    Beside the configured gateway name it tells two instances apart that were given
    one name by accident (one config copied to two hosts, or two gateways on one host
    with one name): the table refuses the second while the first's lease lives. It is
    the host's machine id (or its host name where there is none) and the segment name,
    hashed: stable across a sidecar restart, so a restarted sidecar is the same instance.
    """
    host = ""
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            with open(path, encoding="ascii") as f:
                host = f.read().strip()
        except (OSError, UnicodeDecodeError):
            continue
        if host:
            break
    if not host:
        host = "host:" + socket.gethostname()
    return hashlib.sha256(f"{host}\0{segment}".encode()).hexdigest()[:16]


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


CLIENT_OPTIONS: Final = {
    "socket_timeout": CALL_TIMEOUT_S,
    "socket_connect_timeout": CALL_TIMEOUT_S,
    "retry_on_timeout": False,
    "health_check_interval": 0,
}
"""The sidecar's own Redis deadlines; a URL's query would override them (redis-py lets
the query win), so ``check_share`` refuses those names."""


def url_problem(url: str) -> str | None:
    """Why redis-py would not build a connection from ``url`` as :class:`ShareClient`
    does (a value it cannot parse, an option the connection class does not take), or
    ``None``. Builds objects only: no file is read and nothing connects."""
    try:
        import redis.asyncio as aioredis
    except ImportError:
        return "share mode needs the Python package redis (pip install 'gateway-capacity[share]')"
    try:
        pool: Any = aioredis.ConnectionPool.from_url(url, password="-", **CLIENT_OPTIONS)
        pool.make_connection()
    except Exception as exc:  # redis-py says ValueError, TypeError or ConnectionError
        return f"{type(exc).__name__}: {exc}"
    return None


def _default_owners() -> frozenset[int]:
    uids = {0, os.geteuid()}
    for name in PACKAGE_USERS:
        try:
            uids.add(pwd.getpwnam(name).pw_uid)
        except KeyError:
            continue
    return frozenset(uids)


def peer_problem(
    host: str, port: int, owner: int | str | None, *, password: bool, tls: bool
) -> str | None:
    """Why nothing may be sent to the Redis (or sentinel) this connection reached at
    ``host:port``, or ``None``.

    On loopback any local user may listen on Redis's port while Redis is down, and would
    get the password (``AUTH``) and could answer any grant: the listener must belong to
    ``owner`` (``listenerOwner``; unset: root, this sidecar's user, or a user named
    ``redis`` or ``valkey``), the rule of the sidecar's hop (capacity_contract/listeners.py). Off
    this host a password goes only over TLS (the certificate verified, ``rediss://``).
    """
    try:
        ip = ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return f"{host}:{port} is not an address"
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if not ip.is_loopback:
        if password and not tls:
            return f"{ip}:{port} is not on this host: the password goes there only over TLS"
        return None
    shown = f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"
    if owner is not None:
        return listeners.check_listener(str(ip), port, owner).refused
    uids = listeners.listening_uids(str(ip), port)
    if uids is None:
        return None  # no table here (macOS): as the hop without listenerOwner
    foreign = sorted(uids - _default_owners())
    if foreign:
        return (
            f"{shown} is listened on by {', '.join(listeners.user_name(u) for u in foreign)}, "
            "not root, this sidecar's user or a redis/valkey user (set "
            "capacityShare.listenerOwner to the user Redis runs as)"
        )
    return None


_said: set[str] = set()


class _OwnerChecked:
    """A redis-py connection that checks who it reached before the handshake (``AUTH``,
    ``HELLO``) leaves: :func:`peer_problem`. Mixed in before redis-py's class."""

    share_owner: int | str | None = None

    async def _connect(self) -> None:
        await super()._connect()  # type: ignore[misc]
        me: Any = self
        peer = me._writer.get_extra_info("peername") if me._writer is not None else None
        if not peer:
            return
        from redis.asyncio.connection import SSLConnection

        problem = peer_problem(
            str(peer[0]),
            int(peer[1]),
            self.share_owner,
            password=me.password is not None,
            tls=isinstance(self, SSLConnection),
        )
        if problem is None:
            return
        if problem not in _said:
            _said.add(problem)
            log.warning("capacityShare: nothing sent to Redis: %s", problem)
        me._writer.close()
        me._reader = me._writer = None
        raise ConnectionRefusedError(f"refused to talk: {problem}")


@functools.cache
def checked(base: type, owner: int | str | None) -> type:
    """``base`` (a redis-py asyncio connection class) checking its peer first."""
    return type(f"OwnerChecked{base.__name__}", (_OwnerChecked, base), {"share_owner": owner})


class ShareClient:
    """One redis-py asyncio client and the script's SHA; ``call`` is one EVALSHA."""

    def __init__(
        self,
        url: str | None,
        password: str | None,
        *,
        sentinel: tuple[str, list[tuple[str, int]]] | None = None,
        sentinel_password: str | None = None,
        owner: int | str | None = None,
    ) -> None:
        """``url`` is ``capacityShare.redis``, or ``sentinel`` the master's name and the
        sentinels' addresses of ``capacityShare.sentinel``, already checked
        (``sidecar.config``); ``owner`` its ``listenerOwner``."""
        kwargs: dict[str, Any] = dict(CLIENT_OPTIONS)
        if password is not None:
            kwargs["password"] = password
        self._sentinel: Any = None
        pool: Any
        if sentinel is not None:
            from redis.asyncio.sentinel import Sentinel, SentinelManagedConnection

            master, addresses = sentinel
            asked: dict[str, Any] = dict(CLIENT_OPTIONS)
            if sentinel_password is not None:
                asked["password"] = sentinel_password
            self._sentinel = Sentinel(addresses, sentinel_kwargs=asked)
            for node in self._sentinel.sentinels:
                pool = node.connection_pool
                pool.connection_class = checked(pool.connection_class, owner)
            self._redis: Any = self._sentinel.master_for(
                master, connection_class=checked(SentinelManagedConnection, owner), **kwargs
            )
        else:
            import redis.asyncio as aioredis

            pool = aioredis.ConnectionPool.from_url(url or "", **kwargs)
            pool.connection_class = checked(pool.connection_class, owner)
            self._redis = aioredis.Redis.from_pool(pool)
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
            report.token,
            report.seq,
            report.tokens,
            report.tokens_held,
            report.tokens_demand,
            report.request_tokens,
        ]
        try:
            out = await asyncio.wait_for(
                self._script(keys=[table_key(provider_id)], args=args), CALL_TIMEOUT_S * 2
            )
        except (redis.RedisError, OSError, TimeoutError) as exc:
            raise ShareUnavailable(_describe(exc)) from None
        limit, reserved, gateways, rebuilding, others, now, refused = (int(x) for x in out[:7])
        why = {1: DUPLICATE, 2: STALE}.get(refused, "")
        left = int(out[8]) if len(out) > 8 else 0  # the 9th: how long the rebuild lasts
        # the 10th to 12th: the token share, its reservation and the pool it is of
        tokens_limit, tokens_reserved, pool = (
            (int(x) for x in out[9:12]) if len(out) > 11 else (0, 0, 0)
        )
        grant = Grant(
            limit,
            reserved,
            gateways,
            bool(rebuilding),
            others,
            why,
            left,
            tokens_limit,
            tokens_reserved,
            pool,
        )
        return Answer(grant, now)

    async def aclose(self) -> None:
        await self._redis.aclose()
        if self._sentinel is not None:
            await self._sentinel.aclose()


def _describe(exc: BaseException) -> str:
    """A short reason; redis-py's messages name host and port, never the password."""
    text = str(exc).strip() or type(exc).__name__
    text = text.splitlines()[0]
    if len(text) > 120:
        text = text[:119] + "…"
    return f"Redis unavailable: {type(exc).__name__}: {text}"
