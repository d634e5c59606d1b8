"""The Redis limiter's read-only scripts (``fleet/worker/limiter.py`` runs them after
its prelude, which defines ``now`` and ``k``): what ``fleet limits`` shows of each
limit and ``fleet status`` of a run's waiting steps. They decide nothing.
"""

from __future__ import annotations

# ARGV: run, fresh ms: {step, "due why key"} of the run's steps still waiting.
WAITING_ON = """
local out = {}
local all = redis.call('HGETALL', 'fleet:waiting:' .. ARGV[1])
for i = 1, #all, 2 do
  local due = tonumber(string.match(all[i + 1], '^(%d+)'))
  if due > now - tonumber(ARGV[2]) then out[#out + 1] = {all[i], all[i + 1]} end
end
return out
"""

# ARGV: window ms, fresh ms, keys...: {running, requests, tokens, waiting, paused ms} each.
USES = """
local out = {}
for i = 3, #ARGV do
  local key = ARGV[i]
  local sum = 0
  local live = redis.call('ZRANGEBYSCORE', k(key, 'events'), now - tonumber(ARGV[1]), '+inf')
  for _, tok in ipairs(live) do
    sum = sum + tonumber(redis.call('HGET', k(key, 'tokens'), tok) or '0')
  end
  local paused = tonumber(redis.call('GET', k(key, 'paused')) or '0')
  out[#out + 1] = {
    redis.call('ZCOUNT', k(key, 'slots'), now, '+inf'), #live, sum,
    redis.call('ZCOUNT', k(key, 'due'), now - tonumber(ARGV[2]), '+inf'),
    math.max(0, paused - now)}
end
return out
"""
