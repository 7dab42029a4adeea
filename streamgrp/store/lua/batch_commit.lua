-- The batcher's commit: steps, discarded groups and terminal events, applied atomically with the
-- acknowledgements of the decision entries they account for, fenced by the batcher lease.
--
-- KEYS: 1 decisions, 2 steps, 3 discarded, 4 counts, 5 lease, 6 batcher state, 7 control
--       [8 unacked: a partitioned run's decisions live in other hash slots, so their acknowledgements
--        are recorded here (field: the batcher's reference `entry@partition`) in the same call, and the
--        batcher applies and clears them afterwards, also first thing when it takes over; KEYS[1] is
--        then this hash too and nothing is acknowledged here,
--        9 settled: hash task id -> 1 of the tasks a partitioned run's steps and discards used (op settle),
--        which the batcher checks a decision against before using it: a partition whose server lost
--        its last writes can decide a task a second time]
-- ARGV: 1 lease token, 2 consumer group, then operations (encoded by streamgrp.store.batcher_store, the
-- only caller; the names are private to the two):
--   step step header n_groups n_ack ids...   write step (only if it is the next one), ack its groups
--   discard reason header entry_id           discard a group (stale / filtered / leftover), ack it
--   ack n_ack ids...                         ack decisions the assembler already dropped
--   terminal header                          terminal run event (stall), written once
--   finished header                          run finished, written once
--   settle n task_ids...                     (partitioned runs) mark tasks settled in KEYS[9]
-- The terminal and finished markers in the batcher state (KEYS[6]) hold the control entry id of the
-- event: other roles may append to control (trainers advance the policy version there), so readers
-- trust a terminal or finished event only when the state, which only the batcher writes, names it.
-- The whole input is checked before anything is written (a STEP or BAD_INPUT error leaves the
-- server as it was), and acknowledgements go in bounded chunks (acks.lua).
if redis.call('GET', KEYS[5]) ~= ARGV[1] then
  return redis.error_reply('LEASE lost: another batcher holds the lease')
end
local group = ARGV[2]
local recorded = KEYS[8]

-- Acknowledge ARGV[first .. first + n - 1], or record them for the batcher to acknowledge.
local function acks(first, n)
  if not recorded then return ack_range(KEYS[1], group, first, n) end
  for k = first, first + n - 1 do redis.call('HSET', recorded, ARGV[k], 1) end
  return n
end

-- Whether a discarded group's decision is settled by this call (not by an earlier one).
local function first_settled(ref)
  if recorded then return redis.call('HSETNX', recorded, ref, 1) == 1 end
  return redis.call('XACK', KEYS[1], group, ref) == 1
end

-- Pass 1: parse and check. ops[k] = {kind, first argument index}
local ops = {}
local expected = tonumber(redis.call('HGET', KEYS[6], 'next_step') or '0')
local i = 3
while i <= #ARGV do
  local op = ARGV[i]
  if op == 'step' then
    local step = tonumber(ARGV[i + 1])
    if step ~= expected then
      return redis.error_reply('STEP ' .. tostring(ARGV[i + 1]) .. ' is not the next step ' .. expected)
    end
    local n_ack = count_at(i + 4, 1, 'step acknowledgements')
    if tonumber(ARGV[i + 3]) == nil then error('BAD_INPUT step group count ' .. tostring(ARGV[i + 3])) end
    ops[#ops + 1] = {op, i}
    expected = expected + 1
    i = i + 5 + n_ack
  elseif op == 'discard' then
    if i + 3 > #ARGV then error('BAD_INPUT discard at argument ' .. i .. ' runs past the end of the input') end
    ops[#ops + 1] = {op, i}
    i = i + 4
  elseif op == 'ack' or op == 'settle' then
    local n = count_at(i + 1, 1, op == 'ack' and 'acknowledgements' or 'settled tasks')
    if op == 'settle' and not KEYS[9] then error('BAD_INPUT settled tasks without the settled hash (KEYS[9])') end
    ops[#ops + 1] = {op, i}
    i = i + 2 + n
  elseif op == 'terminal' or op == 'finished' then
    if i + 1 > #ARGV then error('BAD_INPUT ' .. op .. ' without its header') end
    ops[#ops + 1] = {op, i}
    i = i + 2
  else
    return redis.error_reply('BAD_INPUT unknown batcher operation ' .. tostring(op))
  end
end

-- Pass 2: apply.
local steps = 0
for _, parsed in ipairs(ops) do
  local op, at = parsed[1], parsed[2]
  if op == 'step' then
    local step, header, n_groups, n_ack = tonumber(ARGV[at + 1]), ARGV[at + 2], tonumber(ARGV[at + 3]), tonumber(ARGV[at + 4])
    redis.call('XADD', KEYS[2], step .. '-1', 'h', header)
    redis.call('HSET', KEYS[6], 'next_step', step + 1)
    incr(KEYS[4], 'steps', 1)
    incr(KEYS[4], 'groups:batched', n_groups)
    acks(at + 5, n_ack)
    steps = steps + 1
  elseif op == 'discard' then
    local reason, header, entry_id = ARGV[at + 1], ARGV[at + 2], ARGV[at + 3]
    if first_settled(entry_id) then
      redis.call('XADD', KEYS[3], '*', 'h', header)
      incr(KEYS[4], 'dropped:' .. reason, 1)
      incr(KEYS[4], 'groups:discarded', 1)
    end
  elseif op == 'ack' then
    acks(at + 2, tonumber(ARGV[at + 1]))
  elseif op == 'settle' then
    for k = at + 2, at + 1 + tonumber(ARGV[at + 1]) do redis.call('HSET', KEYS[9], ARGV[k], 1) end
  else
    local marker = op  -- 'terminal' or 'finished': the state field is named as the operation
    if redis.call('HEXISTS', KEYS[6], marker) == 0 then
      redis.call('HSET', KEYS[6], marker, redis.call('XADD', KEYS[7], '*', 'h', ARGV[at + 1]))
    end
  end
end
return with_counts({steps})
