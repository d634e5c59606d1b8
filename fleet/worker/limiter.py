"""Fleet-wide limits kept in Redis, when the broker is Redis: the same answers as the
store's limiter (``fleet/store/limits.py``), each decision one Lua script, so it is
atomic across every worker without a database transaction.

Per limit key ``K`` (a limit's name, or ``name#tenant``), under ``fleet:limit:K:``:
``slots`` (a sorted set: the steps holding a concurrency slot, scored by when the slot
lapses unless renewed) and ``owners`` (which delivery holds each), ``events`` and
``tokens`` and ``who`` (the requests of the last minute, by delivery, the tokens each
reserved or reported and its tenant), ``since``, ``due`` and ``wt`` (the steps waiting:
their places in order of arrival, ``seq`` counting them; when each looks again; its
tenant), ``paused`` (until when a provider's 429 closed it). A rated limit is paced: the
same ``events`` fill a bucket that drains at its rate (``fleet.limits.pace``). Times
are Redis's clock (``TIME``), in milliseconds, so workers' clocks do not matter. The
keys are made in the scripts from the limit keys given (one Redis, not a cluster).
After a flush, held slots are made again from the store first (``limit_flush.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

from fleet.limits import (
    EARLY,
    FRESH,
    PIECES,
    WINDOW,
    LimitUse,
    Throttled,
    Want,
    held_for,
    look_again,
    pace,
)
from fleet.worker.limit_flush import RESTORE, Held, answered
from fleet.worker.limit_flush import holder as _holder
from fleet.worker.limit_flush import text as _text
from fleet.worker.limit_reads import USES, WAITING_ON

_PRELUDE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function k(key, part) return 'fleet:limit:' .. key .. ':' .. part end
local function mine(key, h, tok) -- tok's, or made again after a flush (limit_flush.RESTORED)
  local o = redis.call('HGET', k(key, 'owners'), h); return o == tok or o == '?' end
"""

# ARGV: holder, token, ttl ms, window ms (an event counts this long: with its margin),
# fresh ms, early ms, run, step, the window without its margin (ms: waiting steps' turns
# are spaced by it over the rate), a piece of it (ms: how recent a lighter tenant's
# calls count), then 8 per limit: key, concurrency, requests and tokens per minute (-1:
# none), tokens reserved, tenant, the pace's bucket in requests and in tokens (-1: none).
# Returns 0 (room taken in every limit) or {key, wait ms, why, due ms or -1, woken...}:
# woken, the steps to send now, each next in line of a concurrency limit the step had
# room in but leaves, waiting on another (a step waits in one line at a time).
_ACQUIRE = (
    _PRELUDE
    + """
local holder, token, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local window, fresh, early = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local spacing, span = tonumber(ARGV[9]), tonumber(ARGV[10])
local wants = {}
for i = 11, #ARGV, 8 do
  wants[#wants + 1] = {ARGV[i], tonumber(ARGV[i+1]), tonumber(ARGV[i+2]),
                       tonumber(ARGV[i+3]), tonumber(ARGV[i+4]), ARGV[i+5],
                       tonumber(ARGV[i+6]), tonumber(ARGV[i+7])}
  if wants[#wants][2] >= 0 and redis.call('EXISTS', 'fleet:limits:alive') == 0 then
    return {ARGV[i], 0, 'restore', -1}
  end
end
local function drop(zset, hashes, upto)
  local gone = redis.call('ZRANGEBYSCORE', zset, '-inf', upto)
  if #gone > 0 then
    redis.call('ZREMRANGEBYSCORE', zset, '-inf', upto)
    for _, hash in ipairs(hashes) do redis.call('HDEL', hash, unpack(gone)) end
  end
end
local function leave(key, h)
  redis.call('ZREM', k(key, 'since'), h)
  redis.call('ZREM', k(key, 'due'), h)
  redis.call('HDEL', k(key, 'wt'), h)
end
-- The steps waiting on key ahead of this one that still look: since before it (all,
-- if it is new); with use (a rated limit: calls in the window by tenant), first those
-- of a tenant that used less (fleet.store.limits._ahead).
local function ahead_of(key, use, tenant)
  local mine = tonumber(redis.call('ZSCORE', k(key, 'since'), holder) or math.huge)
  local mine_use = use and (use[tenant] or 0) or 0
  local ahead = 0
  for _, h in ipairs(redis.call('ZRANGEBYSCORE', k(key, 'due'), now - fresh, '+inf')) do
    if h ~= holder then
      local s = tonumber(redis.call('ZSCORE', k(key, 'since'), h) or math.huge)
      local u = 0
      if use then u = use[redis.call('HGET', k(key, 'wt'), h) or '-'] or 0 end
      if u < mine_use or (u == mine_use and s < mine) then ahead = ahead + 1 end
    end
  end
  return ahead
end
-- Whether the window's calls (times t, tokens toks: oldest first) leave room behind the
-- ahead steps for one more of want tokens: nil, or {wait ms, why}; first the window
-- (rpm, tpm: -1 none), then the pace, buckets of preq calls and ptok tokens draining at
-- the limit's rate (fleet.limits.no_rated_room, level).
local function full(t, toks, rpm, tpm, preq, ptok, want, ahead)
  local n, sum = #t, 0
  for i = 1, n do sum = sum + toks[i] end
  local function left(i) return math.floor(math.max(0, t[i] + window - now)) end
  if rpm >= 0 and n + 1 + ahead > rpm then
    local place, step = n + ahead - rpm, spacing / rpm
    if n == 0 then return {math.floor(step * (place + 1)), 'requests'} end
    if place < n then return {left(place + 1), 'requests'} end
    return {math.floor(left(n) + (place - n + 1) * step), 'requests'}
  end
  local need, got = sum + want * (1 + ahead) - tpm, 0
  if tpm >= 0 and sum > 0 and need > 0 then
    for i = 1, n do
      got = got + toks[i]
      if got >= need or i == n then return {left(i), 'tokens'} end
    end
  end
  local function level(rate, tokens)
    local filled = 0
    for i = 1, n do
      if i > 1 then filled = math.max(0, filled - (t[i] - t[i - 1]) * rate) end
      filled = filled + (tokens and toks[i] or 1)
    end
    return n == 0 and 0 or math.max(0, filled - (now - t[n]) * rate)
  end
  if rpm >= 0 and preq >= 0 then
    local over = level(rpm / spacing, false) + 1 + ahead - preq
    if over > 0 then return {math.floor(over * spacing / rpm), 'requests'} end
  end
  if tpm >= 0 and ptok >= 0 then
    local filled = level(tpm / spacing, true)
    local over = filled + want * (1 + ahead) - ptok
    if filled > 0 and over > 0 then return {math.floor(over * spacing / tpm), 'tokens'} end
  end
  return nil
end
local function no_room(w)
  local key, conc, rpm, tpm, want, tenant = w[1], w[2], w[3], w[4], w[5], w[6]
  local preq, ptok = w[7], w[8]
  local paused = tonumber(redis.call('GET', k(key, 'paused')) or '0')
  if paused > now then return {key, paused - now, 'paused'} end
  if conc >= 0 then
    local slots = k(key, 'slots')
    local score = redis.call('ZSCORE', slots, holder)
    local owner = redis.call('HGET', k(key, 'owners'), holder)
    if score and owner and owner ~= token then return {key, tonumber(score) - now, 'held'} end
    local running = redis.call('ZCARD', slots)
    if score then running = running - 1 end
    if running + ahead_of(key, nil, tenant) >= conc then return {key, 0, 'concurrency'} end
  end
  if rpm >= 0 or tpm >= 0 then
    local use, spare = {}, 0
    for _, t in ipairs(redis.call('HVALS', k(key, 'who'))) do use[t] = (use[t] or 0) + 1 end
    local ahead = ahead_of(key, use, tenant)
    local evs, t, toks = redis.call('ZRANGE', k(key, 'events'), 0, -1, 'WITHSCORES'), {}, {}
    for i = 1, #evs, 2 do
      t[#t + 1] = tonumber(evs[i + 1])
      toks[#toks + 1] = tonumber(redis.call('HGET', k(key, 'tokens'), evs[i]) or '0')
      -- A lighter tenant's call in the last piece: a place left to it (no_rated_room).
      local who = redis.call('HGET', k(key, 'who'), evs[i]) or '-'
      if t[#t] > now - span and (use[who] or 0) < (use[tenant] or 0) then spare = spare + 1 end
    end
    local no = full(t, toks, rpm, tpm, preq, ptok, want, ahead + spare)
    if no and spare > 0 then no = full(t, toks, rpm, tpm, preq, ptok, want, ahead) or {0, no[2]} end
    if no then return {key, no[1], no[2]} end
  end
  return nil
end
for _, w in ipairs(wants) do
  local key = w[1]
  redis.call('SADD', 'fleet:limits', key)
  drop(k(key, 'slots'), {k(key, 'owners')}, now)
  drop(k(key, 'events'), {k(key, 'tokens'), k(key, 'who')}, now - window)
  local stale = redis.call('ZRANGEBYSCORE', k(key, 'due'), '-inf', now - 600000)
  for _, h in ipairs(stale) do leave(key, h) end
end
-- The first in line on key still asleep (not woken already, nor about to come), woken.
local function next_in_line(key, woken)
  for _, h in ipairs(redis.call('ZRANGE', k(key, 'since'), 0, 99)) do
    if tonumber(redis.call('ZSCORE', k(key, 'due'), h) or '0') > now + early then
      redis.call('ZADD', k(key, 'due'), now, h)
      woken[#woken + 1] = h
      return
    end
  end
end
for i, w in ipairs(wants) do
  local no = no_room(w)
  if no then
    local due = -1
    for _, v in ipairs(wants) do
      local d = redis.call('ZSCORE', k(v[1], 'due'), holder)
      if d and tonumber(d) > due then due = tonumber(d) end
    end
    if due > now + early then return {no[1], due - now, no[3], due} end
    local out = {no[1], no[2], no[3], -1}
    if no[3] ~= 'held' then
      for j, v in ipairs(wants) do
        if v[1] ~= no[1] then
          leave(v[1], holder)
          if j < i and v[2] >= 0 then next_in_line(v[1], out) end
        end
      end
    end
    return out
  end
end
for _, w in ipairs(wants) do
  local key = w[1]
  if w[2] >= 0 then
    redis.call('ZADD', k(key, 'slots'), now + ttl, holder)
    redis.call('HSET', k(key, 'owners'), holder, token)
  end
  if w[3] >= 0 or w[4] >= 0 then
    redis.call('ZADD', k(key, 'events'), now, token)
    redis.call('HSET', k(key, 'tokens'), token, w[5])
    redis.call('HSET', k(key, 'who'), token, w[6])
  end
  leave(key, holder)
end
redis.call('HDEL', 'fleet:waiting:' .. ARGV[7], ARGV[8])
return 0
"""
)

# ARGV: holder, key, after ms, run, step, why, tenant: the step waits on key, looks again
# after; the run's waiting steps (step -> "due key why") kept beside, for status.
_WAIT = (
    _PRELUDE
    + """
local due = now + tonumber(ARGV[3])
if not redis.call('ZSCORE', k(ARGV[2], 'since'), ARGV[1]) then
  -- Its place in line: a count per key, so two arriving in one millisecond keep order.
  redis.call('ZADD', k(ARGV[2], 'since'), redis.call('INCR', k(ARGV[2], 'seq')), ARGV[1])
end
redis.call('ZADD', k(ARGV[2], 'due'), due, ARGV[1])
redis.call('HSET', k(ARGV[2], 'wt'), ARGV[1], ARGV[7])
local waiting = 'fleet:waiting:' .. ARGV[4]
redis.call('HSET', waiting, ARGV[5], due .. ' ' .. ARGV[6] .. ' ' .. ARGV[2])
redis.call('PEXPIRE', waiting, tonumber(ARGV[3]) + 600000)
return 0
"""
)

# ARGV: holder, token, ttl ms, keys...: renew the holder's slots it still owns.
_RENEW = (
    _PRELUDE
    + """
local n = 0
for i = 4, #ARGV do
  if mine(ARGV[i], ARGV[1], ARGV[2]) then
    redis.call('HSET', k(ARGV[i], 'owners'), ARGV[1], ARGV[2])
    n = n + redis.call('ZADD', k(ARGV[i], 'slots'), 'XX', 'CH', now + tonumber(ARGV[3]), ARGV[1])
  end
end
return n
"""
)

# ARGV: holder, token, used tokens (-1 unknown, -2 NO_REQUEST: its call taken out), fresh
# ms, early ms, n, n slot keys, rated keys: slots given back (returned: each one's next).
_RELEASE = (
    _PRELUDE
    + """
local holder, token, used = ARGV[1], ARGV[2], tonumber(ARGV[3])
local fresh, early, n = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local woken = {}
for i = 7, 6 + n do
  local key = ARGV[i]
  if mine(key, holder, token) then
    redis.call('ZREM', k(key, 'slots'), holder)
    redis.call('HDEL', k(key, 'owners'), holder)
    -- The first still asleep: one already woken (or about to come) has its slot.
    for _, h in ipairs(redis.call('ZRANGE', k(key, 'since'), 0, 99)) do
      if tonumber(redis.call('ZSCORE', k(key, 'due'), h) or '0') > now + early then
        redis.call('ZADD', k(key, 'due'), now, h)
        woken[#woken + 1] = h
        break
      end
    end
  end
end
for i = 7 + n, #ARGV do
  if used == -2 then
    redis.call('ZREM', k(ARGV[i], 'events'), token)
    redis.call('HDEL', k(ARGV[i], 'tokens'), token); redis.call('HDEL', k(ARGV[i], 'who'), token)
  elseif used >= 0 and redis.call('HEXISTS', k(ARGV[i], 'tokens'), token) == 1 then
    redis.call('HSET', k(ARGV[i], 'tokens'), token, used)
  end
end
return woken
"""
)

# ARGV: key, ms: paused until now + ms, never shortened.
_PAUSE = (
    _PRELUDE
    + """
local till = now + tonumber(ARGV[2])
local cur = tonumber(redis.call('GET', k(ARGV[1], 'paused')) or '0')
if cur < till then redis.call('SET', k(ARGV[1], 'paused'), till, 'PX', tonumber(ARGV[2])) end
redis.call('SADD', 'fleet:limits', ARGV[1])
return 0
"""
)


def _ms(seconds: float) -> int:
    return max(0, int(seconds * 1000))


class RedisLimits:
    """The limiter on the broker's Redis: the same methods as ``LimitStore``."""

    def __init__(self, url: str, held: Held | None = None) -> None:
        import redis

        self.redis = redis.Redis.from_url(url)
        self._held, self._restore = held, self.redis.register_script(RESTORE)
        self._acquire = self.redis.register_script(_ACQUIRE)
        self._wait = self.redis.register_script(_WAIT)
        self._renew = self.redis.register_script(_RENEW)
        self._release = self.redis.register_script(_RELEASE)
        self._pause = self.redis.register_script(_PAUSE)
        self._uses = self.redis.register_script(_PRELUDE + USES)
        self._waiting_on = self.redis.register_script(_PRELUDE + WAITING_ON)

    def acquire(
        self,
        wants: Sequence[Want],
        run_id: str,
        step_id: str,
        token: str,
        ttl: float,
        *,
        jitter: float,
        cap: float,
    ) -> Throttled | None:
        holder = _holder(run_id, step_id)
        window = _ms(held_for(WINDOW))
        args: list[Any] = [holder, token, _ms(ttl), window, _ms(FRESH), _ms(EARLY)]
        args += [run_id, step_id, _ms(WINDOW), _ms(WINDOW / PIECES)]
        for w in wants:
            rate = pace(w, WINDOW)
            args += [
                w.key,
                *(_or_none(v) for v in (w.concurrency, w.requests_per_minute)),
                _or_none(w.tokens_per_minute),
                int(w.tokens),
                w.tenant,
                *(_or_none(v) for v in (rate.requests, rate.tokens)),
            ]
        found = answered(partial(self._acquire, args=args), self._restore, self._held, _ms(ttl))
        if found == 0:
            return None
        key, wait_ms, why, due, *woken = found
        key, why = _text(key), _text(why)
        if int(due) >= 0:
            return Throttled(key, int(wait_ms) / 1000, why, redundant=True)
        after = look_again(why, int(wait_ms) / 1000, ttl, jitter, cap)
        if why != "held":  # a duplicate of a running step waits on nobody's room
            tenant = next((w.tenant for w in wants if w.key == key), "-")
            self._wait(args=[holder, key, _ms(after), run_id, step_id, why, tenant])
        return Throttled(key, after, why, woken=_steps(woken))

    def renew(self, keys: Sequence[str], run_id: str, step_id: str, token: str, ttl: float) -> int:
        return int(self._renew(args=[_holder(run_id, step_id), token, _ms(ttl), *keys]))

    def release(
        self,
        keys: Sequence[str],
        rated: Sequence[str],
        run_id: str,
        step_id: str,
        token: str,
        used_tokens: int | None,
    ) -> list[tuple[str, str]]:
        used = -1 if used_tokens is None else int(used_tokens)
        holder = _holder(run_id, step_id)
        args: list[Any] = [holder, token, used, _ms(FRESH), _ms(EARLY), len(keys), *keys, *rated]
        return list(_steps(self._release(args=args)))

    def pause(self, key: str, seconds: float) -> None:
        self._pause(args=[key, _ms(seconds)])

    def uses(self, keys: Sequence[str]) -> list[LimitUse]:
        keys = sorted(set(keys))
        if not keys:
            return []
        rows = self._uses(args=[_ms(held_for(WINDOW)), _ms(FRESH), *keys])
        return [
            LimitUse(key, int(r[0]), int(r[1]), int(r[2]), int(r[3]), int(r[4]) / 1000)
            for key, r in zip(keys, rows, strict=True)
        ]

    def waiting_on(self, run_id: str) -> dict[str, tuple[str, str]]:
        found: dict[str, tuple[str, str]] = {}
        for step, value in self._waiting_on(args=[run_id, _ms(FRESH)]):
            _due, why, key = _text(value).split(" ", 2)
            found[_text(step)] = (key, why)
        return found

    def keys_like(self, prefix: str) -> list[str]:
        known = (_text(k) for k in self.redis.smembers("fleet:limits"))
        return sorted(k for k in known if k.startswith(prefix + "#"))


def _steps(holders: Sequence[Any]) -> tuple[tuple[str, str], ...]:
    """(run id, step id) of each holder named, once each."""
    pairs = (_text(h).split("\x1f", 1) for h in holders)
    return tuple(dict.fromkeys((run, step) for run, step in pairs))


def _or_none(value: int | None) -> int:
    return -1 if value is None else int(value)
