-- The assembler's commit: every output of one read round, applied atomically with the
-- acknowledgements of the slot-log entries it accounts for, and fenced by the assembler lease.
--
-- KEYS: 1 slots, 2 decisions, 3 deadletter, 4 decided, 5 counts, 6 lease
-- ARGV: 1 lease token, 2 consumer group, then a flat list of operations (encoded by
-- streamgrp.store.assembler_store, the only caller; the names are private to the two):
--   decide task_id header n_ack ids... n_incr (field amount)...      decide once (HSETNX marker), ack, count
--   ack_count count_field n_ack ids...                               ack; count what was really acknowledged
--   late_or_unknown task_id entry_id detail n_fields (k v)...        late if decided, else dead-letter unknown_task
--   dead_letter reason entry_id detail n_fields (k v)...             dead-letter with the given fields, ack
-- Dead-letter fields are built by streamgrp.store.deadletter: at most MAX_DEAD_LETTER_FIELDS pairs (a
-- stub stands in for a large or many-field entry), so the XADD of a dead letter is bounded.
-- The whole input is checked before anything is written, and acknowledgements go in bounded
-- chunks (acks.lua): an error never leaves half a round behind.
-- Returns {decisions written, redundant decisions, then counter field, amount pairs applied}, or an
-- error when the lease is not ours.
if redis.call('GET', KEYS[6]) ~= ARGV[1] then
  return redis.error_reply('LEASE lost: another assembler holds the lease')
end
local group = ARGV[2]

-- Pass 1: parse and check. ops[k] = {kind, first argument index}
local ops = {}
local i = 3
while i <= #ARGV do
  local op = ARGV[i]
  ops[#ops + 1] = {op, i}
  if op == 'decide' then
    local n_ack = count_at(i + 3, 1, 'decision acknowledgements')
    local n_incr = count_at(i + 4 + n_ack, 2, 'decision counters')
    i = i + 5 + n_ack + 2 * n_incr
  elseif op == 'ack_count' then
    local n_ack = count_at(i + 2, 1, 'acknowledgements')
    i = i + 3 + n_ack
  elseif op == 'late_or_unknown' or op == 'dead_letter' then
    local n_fields = count_at(i + 4, 2, 'dead-letter fields')
    if n_fields > MAX_DEAD_LETTER_FIELDS then
      error('BAD_INPUT a dead letter of ' .. n_fields .. ' fields; streamgrp.store.deadletter sends at most '
            .. MAX_DEAD_LETTER_FIELDS)
    end
    i = i + 5 + 2 * n_fields
  else
    return redis.error_reply('BAD_INPUT unknown commit operation ' .. tostring(op))
  end
end

-- Pass 2: apply. The decisions' own acknowledgements go in one XACK at the end (nothing in between
-- reads them: every other operation acknowledges entries of its own).
local written, redundant = 0, 0
local decided_acks = {}

local function dead_letter(reason, entry_id, detail, at, n_fields)
  if redis.call('XACK', KEYS[1], group, entry_id) == 1 then
    local fields = {'reason', reason, 'detail', detail, 'stream', KEYS[1], 'entry', entry_id}
    for f = 0, n_fields - 1 do
      fields[#fields + 1] = ARGV[at + 2 * f]
      fields[#fields + 1] = ARGV[at + 2 * f + 1]
    end
    redis.call('XADD', KEYS[3], '*', unpack(fields))
    incr(KEYS[5], 'deadletter:' .. reason, 1)
    incr(KEYS[5], 'slots:invalid', 1)
  end
end

for _, parsed in ipairs(ops) do
  local op, at = parsed[1], parsed[2]
  if op == 'decide' then
    local task_id, header, n_ack = ARGV[at + 1], ARGV[at + 2], tonumber(ARGV[at + 3])
    local n_incr = tonumber(ARGV[at + 4 + n_ack])
    local counters = at + 5 + n_ack
    if redis.call('HSETNX', KEYS[4], task_id, '') == 1 then
      local id = redis.call('XADD', KEYS[2], '*', 'h', header)
      redis.call('HSET', KEYS[4], task_id, id)
      written = written + 1
      for c = 0, n_incr - 1 do
        incr(KEYS[5], ARGV[counters + 2 * c], tonumber(ARGV[counters + 2 * c + 1]))
      end
    else
      redundant = redundant + 1
      incr(KEYS[5], 'redundant_decisions', 1)
    end
    for a = at + 4, at + 3 + n_ack do decided_acks[#decided_acks + 1] = ARGV[a] end
  elseif op == 'ack_count' then
    local field, n_ack = ARGV[at + 1], tonumber(ARGV[at + 2])
    local acked = ack_range(KEYS[1], group, at + 3, n_ack)
    if field ~= '' and acked > 0 then incr(KEYS[5], field, acked) end
  elseif op == 'late_or_unknown' then
    local task_id, entry_id, detail, n_fields = ARGV[at + 1], ARGV[at + 2], ARGV[at + 3], tonumber(ARGV[at + 4])
    if redis.call('HEXISTS', KEYS[4], task_id) == 1 then
      if redis.call('XACK', KEYS[1], group, entry_id) == 1 then
        incr(KEYS[5], 'slots:late', 1)
      end
    else
      dead_letter('unknown_task', entry_id, detail, at + 5, n_fields)
    end
  else  -- 'dead_letter'
    local reason, entry_id, detail, n_fields = ARGV[at + 1], ARGV[at + 2], ARGV[at + 3], tonumber(ARGV[at + 4])
    dead_letter(reason, entry_id, detail, at + 5, n_fields)
  end
end
ack_list(KEYS[1], group, decided_acks)
return with_counts({written, redundant})
