-- Record one turn of an open session (streamgrp.store.sessions, for the gateway): its TurnRecorded
-- event on the sessions stream KEYS[2] and its entry id in the session's hash KEYS[1], before the turn
-- is answered. Turns are numbered from 1 without gaps, so two writers of one session (two gateways, or
-- a stale one) can never interleave: the second is refused (TURN) and reloads the session.
-- KEYS: 1 the session's hash, 2 the sessions stream, 3 (a keys-layout run, streamgrp.store.payloads) the
--       turn's staged key '<KEYS[2]>:staged:<hex>', holding its header and tensors framed: no tensor byte
--       passes through here then, ARGV 4 is '', the entry holds the header only and the staged key is
--       renamed to '<KEYS[2]>:turn:<entry id>'.
-- ARGV: 1 the turn's number, 2 a digest of its event, 3 the TurnRecorded header, 4 its tensors ('' with
--       a staged key).
-- Returns the turn's entry id; the same turn sent again (after a lost reply) returns the first one's,
-- whatever its staged key (a fresh one, or the first call's, renamed already: either expires unused).
-- Refuses, before any write: an unknown session (UNKNOWN), one no longer open (ENDED), one whose
-- group deadline passed (EXPIRED, by the server's clock), a turn out of order (TURN), a staged key that
-- is gone (STAGED: expired; stage the turn again).
local turn = tonumber(ARGV[1])
local staged = KEYS[3]
if #ARGV ~= 4 or #KEYS > 3 or turn == nil or turn < 1 or turn > MAX_TURNS or turn ~= math.floor(turn)
    or ARGV[2] == '' or ARGV[3] == '' then
  return redis.error_reply('BAD_INPUT session_turn takes a turn number of 1 to ' .. MAX_TURNS .. ', a digest, a '
                           .. 'header and its tensors')
end
if staged ~= nil and (ARGV[4] ~= '' or string.sub(staged, 1, #KEYS[2] + 8) ~= KEYS[2] .. ':staged:') then
  return redis.error_reply('BAD_INPUT session_turn takes either a staged key of ' .. KEYS[2] .. ' or the tensors '
                           .. 'themselves')
end
local state = redis.call('HMGET', KEYS[1], 'status', 'turns', 'deadline')
if not state[1] then return redis.error_reply('UNKNOWN no session ' .. KEYS[1]) end
local turns = tonumber(state[2])
if turns >= turn then
  if redis.call('HGET', KEYS[1], 'digest:' .. turn) == ARGV[2] then
    return redis.call('HGET', KEYS[1], 'turn:' .. turn)
  end
  return redis.error_reply('TURN the session has ' .. turns .. ' turns already; turn ' .. turn .. ' was recorded '
                           .. 'by another writer')
end
if state[1] ~= 'open' then return redis.error_reply('ENDED the session ended (' .. state[1] .. ')') end
if turn ~= turns + 1 then
  return redis.error_reply('TURN the session has ' .. turns .. ' turns; the next is ' .. (turns + 1) .. ', not ' .. turn)
end
if state[3] and state[3] ~= '' then
  local now = redis.call('TIME')
  if tonumber(now[1]) + tonumber(now[2]) / 1e6 >= tonumber(state[3]) then
    return redis.error_reply('EXPIRED the session\'s group deadline passed')
  end
end
if staged ~= nil and redis.call('EXISTS', staged) == 0 then
  return redis.error_reply('STAGED the staged turn ' .. staged .. ' is gone (expired); nothing was written: stage '
                           .. 'the turn again and record it again')
end
local id
if staged ~= nil then
  id = redis.call('XADD', KEYS[2], '*', 'h', ARGV[3])
  redis.call('RENAME', staged, KEYS[2] .. ':turn:' .. id)
  redis.call('PERSIST', KEYS[2] .. ':turn:' .. id)
else
  id = redis.call('XADD', KEYS[2], '*', 'h', ARGV[3], 'b', ARGV[4])
end
redis.call('HSET', KEYS[1], 'turns', turn, 'turn:' .. turn, id, 'digest:' .. turn, ARGV[2])
return id
