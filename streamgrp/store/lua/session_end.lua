-- End a session (streamgrp.store.sessions, for the gateway) and publish its slot result, in one atomic
-- call: a session is ended exactly when its result is in the group log, so a crash between the two
-- cannot lose the result or publish it twice. The publish is publish.lua's: the header to the group log
-- KEYS[4] and, for a sample, its payload to the payloads stream KEYS[5] at the same entry id (after a
-- foreign entry there, both move after it, as in publish.lua). A timeout
-- publishes nothing (the assembler times the slot out at the same deadline).
-- KEYS: 1 the session's hash, 2 the sessions stream, 3 the deadlines set, 4 the group log, 5 payloads,
--       6 (a keys-layout run's sample, streamgrp.store.payloads) the payload's staged key: no payload byte
--       passes through here then, ARGV 6 and 7 are '' and the staged key is renamed to '<KEYS[5]>:<id>'.
-- ARGV: 1 session id, 2 outcome (sample, rejected, failed, timeout), 3 the turns the result was built
--       from ('' for a timeout), 4 the SessionEnded header, 5 the slot result header ('' for a timeout),
--       6 the payload header ('' without a sample), 7 the payload's tensors, 8 '1' when the sample's
--       reward comes later (its result is published with reward_pending), else ''.
-- Returns the slot result's entry id ('' for a timeout); a session that ended with this outcome
-- before returns the same (a repeat after a lost reply, or two gateways timing one session out).
-- Refuses, before any write: UNKNOWN, ENDED (another outcome first), TURN (a turn was recorded
-- after the result was built), EXPIRED (its deadline passed: it can only time out), EARLY (a timeout
-- before the deadline). PAYLOAD (nothing written) when the payloads stream holds the largest id there
-- is, so no payload can ever be written: the caller ends the session as failed instead. STAGED (nothing
-- written) when the staged payload is gone (expired): the caller stages it again.
local outcome = ARGV[2]
local outcomes = {sample = true, rejected = true, failed = true, timeout = true}
local staged = KEYS[6]
if staged ~= nil and (ARGV[6] ~= '' or ARGV[7] ~= '' or string.sub(staged, 1, #KEYS[5] + 8) ~= KEYS[5] .. ':staged:') then
  return redis.error_reply('BAD_INPUT session_end takes either a staged key of ' .. KEYS[5] .. ' or the payload itself')
end
if #ARGV ~= 8 or not outcomes[outcome] or ARGV[1] == '' or ARGV[4] == ''
    or (outcome == 'timeout') ~= (ARGV[5] == '') or (outcome == 'sample') ~= (ARGV[6] ~= '' or staged ~= nil)
    or (ARGV[8] ~= '' and (ARGV[8] ~= '1' or outcome ~= 'sample'))
    or (outcome ~= 'timeout' and tonumber(ARGV[3]) == nil) then
  return redis.error_reply('BAD_INPUT session_end takes a session id, an outcome, the turns, the SessionEnded '
                           .. 'header, a slot result (none for a timeout; a payload for a sample) and whether '
                           .. 'a sample\'s reward comes later')
end
local state = redis.call('HMGET', KEYS[1], 'status', 'turns', 'deadline', 'result')
if not state[1] then return redis.error_reply('UNKNOWN no session ' .. ARGV[1]) end
if state[1] ~= 'open' then
  if state[1] == outcome then return state[4] or '' end
  return redis.error_reply('ENDED the session ended (' .. state[1] .. ')')
end
local expired = false
if state[3] and state[3] ~= '' then
  local now = redis.call('TIME')
  expired = tonumber(now[1]) + tonumber(now[2]) / 1e6 >= tonumber(state[3])
end
if outcome == 'timeout' then
  if not expired then return redis.error_reply('EARLY the session\'s group deadline has not passed') end
else
  if tonumber(state[2]) ~= tonumber(ARGV[3]) then
    return redis.error_reply('TURN the session has ' .. state[2] .. ' turns, the result was built from ' .. ARGV[3])
  end
  if expired then return redis.error_reply('EXPIRED the session\'s group deadline passed') end
end
if staged ~= nil and redis.call('EXISTS', staged) == 0 then
  return redis.error_reply('STAGED the staged payload ' .. staged .. ' is gone (expired); nothing was written: stage '
                           .. 'the payload again and end the session again')
end
local id = ''
if outcome ~= 'timeout' then
  id = redis.call('XADD', KEYS[4], '*', 'h', ARGV[5])
  if staged ~= nil then
    redis.call('RENAME', staged, KEYS[5] .. ':' .. id)
    redis.call('PERSIST', KEYS[5] .. ':' .. id)
  elseif ARGV[6] ~= '' then
    local written = redis.pcall('XADD', KEYS[5], id, 'h', ARGV[6], 'b', ARGV[7])
    if type(written) == 'table' and written.err then
      -- Only a write outside streamgrp puts an id at or after this one in the payloads stream (a plain
      -- XADD in the same millisecond, an explicit id in the future, written and deleted or not). As in
      -- publish.lua, the payload goes after the stream's last id and its header moves there too (above
      -- the header's own id, since the payloads stream had passed it), so both share one id and the
      -- session still ends.
      redis.call('XDEL', KEYS[4], id)
      written = redis.pcall('XADD', KEYS[5], '*', 'h', ARGV[6], 'b', ARGV[7])
      if type(written) == 'table' and written.err then  -- the stream's last id is the largest there is
        return redis.error_reply('PAYLOAD cannot be written after ' .. id .. ' (' .. written.err .. '); the '
                                 .. 'payloads stream holds an entry streamgrp did not write')
      end
      id = redis.call('XADD', KEYS[4], written, 'h', ARGV[5])
    end
  end
end
redis.call('HSET', KEYS[1], 'status', outcome, 'result', id, 'pending', ARGV[8])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('XADD', KEYS[2], '*', 'h', ARGV[4])
return id
