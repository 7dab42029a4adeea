-- The batcher's commit: steps, discarded groups and terminal events, applied atomically with the
-- acknowledgements of the decision entries they account for, fenced by the batcher lease.
--
-- KEYS: 1 decisions, 2 steps, 3 discarded, 4 counts, 5 lease, 6 batcher state, 7 control
-- ARGV: 1 lease token, 2 consumer group, then operations:
--   S step header n_groups n_ack ids...   write step (only if it is the next one), ack its groups
--   G reason header entry_id              discard a group (stale / filtered / leftover), ack it
--   A n_ack ids...                        ack decisions the assembler already dropped
--   T header                              terminal run event (stall), written once
--   F header                              run finished, written once
if redis.call('GET', KEYS[5]) ~= ARGV[1] then
  return redis.error_reply('LEASE lost: another batcher holds the lease')
end
local group = ARGV[2]
local i = 3
local steps = 0
while i <= #ARGV do
  local op = ARGV[i]
  if op == 'S' then
    local step, header, n_groups, n_ack = tonumber(ARGV[i + 1]), ARGV[i + 2], tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4])
    local expected = tonumber(redis.call('HGET', KEYS[6], 'next_step') or '0')
    if step ~= expected then
      return redis.error_reply('STEP ' .. step .. ' is not the next step ' .. expected)
    end
    redis.call('XADD', KEYS[2], step .. '-1', 'h', header)
    redis.call('HSET', KEYS[6], 'next_step', step + 1)
    incr(KEYS[4], 'steps', 1)
    incr(KEYS[4], 'groups:batched', n_groups)
    local ids = {}
    for a = 1, n_ack do ids[a] = ARGV[i + 4 + a] end
    if n_ack > 0 then redis.call('XACK', KEYS[1], group, unpack(ids)) end
    i = i + 5 + n_ack
    steps = steps + 1
  elseif op == 'G' then
    local reason, header, entry_id = ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
    if redis.call('XACK', KEYS[1], group, entry_id) == 1 then
      redis.call('XADD', KEYS[3], '*', 'h', header)
      incr(KEYS[4], 'dropped:' .. reason, 1)
      incr(KEYS[4], 'groups:discarded', 1)
    end
    i = i + 4
  elseif op == 'A' then
    local n_ack = tonumber(ARGV[i + 1])
    local ids = {}
    for a = 1, n_ack do ids[a] = ARGV[i + 1 + a] end
    if n_ack > 0 then redis.call('XACK', KEYS[1], group, unpack(ids)) end
    i = i + 2 + n_ack
  elseif op == 'T' or op == 'F' then
    local marker = (op == 'T') and 'terminal' or 'finished'
    if redis.call('HSETNX', KEYS[6], marker, 1) == 1 then
      redis.call('XADD', KEYS[7], '*', 'h', ARGV[i + 1])
    end
    i = i + 2
  else
    return redis.error_reply('unknown batcher operation ' .. tostring(op))
  end
end
return with_counts({steps})
