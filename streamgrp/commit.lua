-- The assembler's commit: every output of one read round, applied atomically with the
-- acknowledgements of the slot-log entries it accounts for, and fenced by the assembler lease.
--
-- KEYS: 1 slots, 2 decisions, 3 deadletter, 4 decided, 5 counts, 6 lease, 7 control
-- ARGV: 1 lease token, 2 consumer group, then a flat list of operations:
--   D task_id header n_ack ids... n_incr (field amount)...   decide once (HSETNX marker), ack, count
--   A count_field n_ack ids...                               ack; count what was really acknowledged
--   L task_id entry_id detail n_fields (k v)...              late if decided, else dead-letter unknown_task
--   X reason entry_id detail n_fields (k v)...               dead-letter with the original fields, ack
--   F header                                                 terminal run event, written once
-- Returns {decisions written, redundant decisions, then counter field, amount pairs applied}, or an
-- error when the lease is not ours.
if redis.call('GET', KEYS[6]) ~= ARGV[1] then
  return redis.error_reply('LEASE lost: another assembler holds the lease')
end
local group = ARGV[2]
local written, redundant = 0, 0
local i = 3

local function dead_letter(reason, entry_id, detail, n_fields)
  local fields = {'reason', reason, 'detail', detail, 'stream', KEYS[1], 'entry', entry_id}
  for f = 0, n_fields - 1 do
    fields[#fields + 1] = 'f:' .. ARGV[i + 2 * f]
    fields[#fields + 1] = ARGV[i + 2 * f + 1]
  end
  i = i + 2 * n_fields
  if redis.call('XACK', KEYS[1], group, entry_id) == 1 then
    redis.call('XADD', KEYS[3], '*', unpack(fields))
    incr(KEYS[5], 'deadletter:' .. reason, 1)
    incr(KEYS[5], 'slots:invalid', 1)
  end
end

while i <= #ARGV do
  local op = ARGV[i]
  if op == 'D' then
    local task_id, header, n_ack = ARGV[i + 1], ARGV[i + 2], tonumber(ARGV[i + 3])
    local ids = {}
    for a = 1, n_ack do ids[a] = ARGV[i + 3 + a] end
    i = i + 4 + n_ack
    local n_incr = tonumber(ARGV[i])
    i = i + 1
    if redis.call('HSETNX', KEYS[4], task_id, '') == 1 then
      local id = redis.call('XADD', KEYS[2], '*', 'h', header)
      redis.call('HSET', KEYS[4], task_id, id)
      written = written + 1
      for c = 0, n_incr - 1 do
        incr(KEYS[5], ARGV[i + 2 * c], tonumber(ARGV[i + 2 * c + 1]))
      end
    else
      redundant = redundant + 1
      incr(KEYS[5], 'redundant_decisions', 1)
    end
    i = i + 2 * n_incr
    if n_ack > 0 then redis.call('XACK', KEYS[1], group, unpack(ids)) end
  elseif op == 'A' then
    local field, n_ack = ARGV[i + 1], tonumber(ARGV[i + 2])
    local ids = {}
    for a = 1, n_ack do ids[a] = ARGV[i + 2 + a] end
    i = i + 3 + n_ack
    local acked = redis.call('XACK', KEYS[1], group, unpack(ids))
    if field ~= '' and acked > 0 then incr(KEYS[5], field, acked) end
  elseif op == 'L' then
    local task_id, entry_id, detail, n_fields = ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], tonumber(ARGV[i + 4])
    i = i + 5
    if redis.call('HEXISTS', KEYS[4], task_id) == 1 then
      i = i + 2 * n_fields
      if redis.call('XACK', KEYS[1], group, entry_id) == 1 then
        incr(KEYS[5], 'slots:late', 1)
      end
    else
      dead_letter('unknown_task', entry_id, detail, n_fields)
    end
  elseif op == 'X' then
    local reason, entry_id, detail, n_fields = ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], tonumber(ARGV[i + 4])
    i = i + 5
    dead_letter(reason, entry_id, detail, n_fields)
  elseif op == 'F' then
    if redis.call('HSETNX', KEYS[5], 'run_failed', 1) == 1 then
      redis.call('XADD', KEYS[7], '*', 'h', ARGV[i + 1])
    end
    i = i + 2
  else
    return redis.error_reply('unknown commit operation ' .. tostring(op))
  end
end
return with_counts({written, redundant})
