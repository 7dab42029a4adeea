-- Open the sessions of one task, one per slot (streamgrp.store.sessions, for the gateway), in one atomic
-- call: each session's state hash (KEYS[4..]), its SessionOpened event on the sessions stream KEYS[2],
-- its group deadline in the deadlines set KEYS[3], and the task's acknowledgement in the task queue
-- KEYS[1]. From here the sessions own the task, not the pending entry: no reclaim runs it a second
-- time, and a session nobody ends times out with its group.
-- ARGV: 1 the workers' consumer group, 2 the task's entry id, 3 task id, 4 deadline (server seconds; ''
--       for none), 5 policy version, 6 n, then n (session id, slot, key digest, SessionOpened header).
-- Returns 'OPENED', or 'REPEAT' when this very call ran before (sent again after a lost reply).
-- Refuses with TAKEN, before any write, a task entry no longer pending: its sessions were opened by
-- another call, or a worker published it. The whole input is checked before the first write.
local n = tonumber(ARGV[6])
if n == nil or n < 1 or n > MAX_SESSIONS or n ~= math.floor(n) or #ARGV ~= 6 + 4 * n or #KEYS ~= 3 + n then
  return redis.error_reply('BAD_INPUT session_open takes 6 arguments and 1 to ' .. MAX_SESSIONS .. ' (id, slot, '
                           .. 'key digest, header) quadruples with one session key each, got ' .. #ARGV
                           .. ' arguments and ' .. #KEYS .. ' keys')
end
if ARGV[1] == '' or ARGV[2] == '' or ARGV[3] == '' or tonumber(ARGV[5]) == nil
    or (ARGV[4] ~= '' and tonumber(ARGV[4]) == nil) then
  return redis.error_reply('BAD_INPUT session_open needs a group, a task entry, a task id, a deadline or nothing, '
                           .. 'and a version')
end
for i = 0, n - 1 do
  local at = 7 + 4 * i
  local slot = tonumber(ARGV[at + 1])
  if ARGV[at] == '' or slot == nil or slot < 0 or slot ~= math.floor(slot) or ARGV[at + 2] == ''
      or ARGV[at + 3] == '' then
    return redis.error_reply('BAD_INPUT session ' .. (i + 1) .. ' needs an id, a slot, a key digest and a header')
  end
end
local entry = redis.call('HGET', KEYS[4], 'entry')
if entry then
  if entry == ARGV[2] and redis.call('HGET', KEYS[4], 'task') == ARGV[3] then return 'REPEAT' end
  return redis.error_reply('EXISTS session ' .. ARGV[7] .. ' belongs to another task')
end
if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1) == 0 then
  return redis.error_reply('TAKEN task entry ' .. ARGV[2] .. ' is not pending in ' .. ARGV[1]
                           .. ': its sessions were opened already, or its results were published')
end
local now = redis.call('TIME')
local opened = now[1] .. '.' .. string.format('%06d', tonumber(now[2]))
for i = 0, n - 1 do
  local at = 7 + 4 * i
  redis.call('HSET', KEYS[4 + i], 'task', ARGV[3], 'slot', ARGV[at + 1], 'entry', ARGV[2], 'deadline', ARGV[4],
             'version', ARGV[5], 'status', 'open', 'turns', 0, 'key', ARGV[at + 2], 'opened', opened)
  redis.call('XADD', KEYS[2], '*', 'h', ARGV[at + 3])
  if ARGV[4] ~= '' then redis.call('ZADD', KEYS[3], ARGV[4], ARGV[at]) end
end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
return 'OPENED'
