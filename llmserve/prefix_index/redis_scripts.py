"""The Lua scripts of the Redis routing index (key layout: llmserve.prefix_index.redis_index).

Each runs atomically, so a reader never sees half a batch and a sweep never races a replica's
write. Block hashes travel as 16-digit hex strings: Lua numbers are doubles and would round a
64-bit hash. ARGV[1] is always the key prefix, ARGV[2] the replica id where one is involved.
"""

from __future__ import annotations

# Drop everything one replica holds: its entries in every block set, its stream position.
_FORGET = """
local function forget(prefix, replica_id)
  local replica_key = prefix .. ':replica:' .. replica_id
  for _, block_hash in ipairs(redis.call('SMEMBERS', replica_key .. ':blocks')) do
    redis.call('SREM', prefix .. ':block:' .. block_hash, replica_id)
  end
  redis.call('DEL', replica_key .. ':blocks', replica_key .. ':stream')
  redis.call('SREM', prefix .. ':replicas', replica_id)
end
"""

# ARGV: prefix, replica_id, incarnation, sequence_number, is_snapshot (1/0), ttl_ms, load,
# then the events: 'C' (all cleared), or 'S'/'R' (stored/removed), a count, that many hashes.
# Answers 'resync' (and drops the replica) when the batch does not continue its stream.
APPLY = _FORGET + """
local prefix, replica_id, incarnation, sequence_number = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local replica_key = prefix .. ':replica:' .. replica_id
local blocks_key = replica_key .. ':blocks'
if ARGV[5] == '1' then
  forget(prefix, replica_id)
else
  local stream = redis.call('HMGET', replica_key .. ':stream', 'incarnation', 'sequence_number')
  local expected = tonumber(stream[2]) or -1
  if ARGV[8] then expected = expected + 1 end
  if stream[1] ~= incarnation or sequence_number ~= expected then
    forget(prefix, replica_id)
    return 'resync'
  end
end
local i = 8
while ARGV[i] do
  local kind = ARGV[i]
  if kind == 'C' then
    forget(prefix, replica_id)
    i = i + 1
  else
    local count = tonumber(ARGV[i + 1])
    for j = i + 2, i + 1 + count do
      local block_key = prefix .. ':block:' .. ARGV[j]
      if kind == 'S' then
        redis.call('SADD', block_key, replica_id)
        redis.call('SADD', blocks_key, ARGV[j])
      else
        redis.call('SREM', block_key, replica_id)
        redis.call('SREM', blocks_key, ARGV[j])
      end
    end
    i = i + 2 + count
  end
end
redis.call('HSET', replica_key .. ':stream', 'incarnation', incarnation, 'sequence_number', ARGV[4])
redis.call('SADD', prefix .. ':replicas', replica_id)
redis.call('SET', replica_key .. ':live', ARGV[7], 'PX', ARGV[6])
return 'ok'
"""

# KEYS: the block keys of a prompt, in chain order. Answers a flat list: replica id, number of
# leading blocks it holds, ... (a replica drops out at its first missing block).
LOOKUP = """
local holders = nil
local matches = {}
for position, block_key in ipairs(KEYS) do
  local next_holders = {}
  local any = false
  for _, replica_id in ipairs(redis.call('SMEMBERS', block_key)) do
    if holders == nil or holders[replica_id] then
      next_holders[replica_id] = true
      matches[replica_id] = position
      any = true
    end
  end
  if not any then break end
  holders = next_holders
end
local flat = {}
for replica_id, count in pairs(matches) do
  flat[#flat + 1] = replica_id
  flat[#flat + 1] = count
end
return flat
"""

# ARGV: prefix. Forgets every replica whose liveness key has expired; answers their ids.
SWEEP = _FORGET + """
local prefix = ARGV[1]
local swept = {}
for _, replica_id in ipairs(redis.call('SMEMBERS', prefix .. ':replicas')) do
  if redis.call('EXISTS', prefix .. ':replica:' .. replica_id .. ':live') == 0 then
    forget(prefix, replica_id)
    swept[#swept + 1] = replica_id
  end
end
return swept
"""

# ARGV: prefix, replica_id. Forgets the replica now (it is stopping), liveness key included.
REMOVE = _FORGET + """
forget(ARGV[1], ARGV[2])
redis.call('DEL', ARGV[1] .. ':replica:' .. ARGV[2] .. ':live')
return 'ok'
"""
