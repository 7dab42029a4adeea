-- Record one turn of an open session (streamgrp.store.sessions, for the gateway): its TurnRecorded
-- event on the sessions stream KEYS[2] and its entry id in the session's hash KEYS[1], before the turn
-- is answered. Turns are numbered from 1 without gaps, so two writers of one session (two gateways, or
-- a stale one) can never interleave: the second is refused (TURN) and reloads the session.
-- ARGV: 1 the turn's number, 2 a digest of its event, 3 the TurnRecorded header, 4 its tensors.
-- Returns the turn's entry id; the same turn sent again (after a lost reply) returns the first one's.
-- Refuses, before any write: an unknown session (UNKNOWN), one no longer open (ENDED), one whose
-- group deadline passed (EXPIRED, by the server's clock), a turn out of order (TURN).
local turn = tonumber(ARGV[1])
if #ARGV ~= 4 or turn == nil or turn < 1 or turn > MAX_TURNS or turn ~= math.floor(turn) or ARGV[2] == ''
    or ARGV[3] == '' then
  return redis.error_reply('BAD_INPUT session_turn takes a turn number of 1 to ' .. MAX_TURNS .. ', a digest, a '
                           .. 'header and its tensors')
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
local id = redis.call('XADD', KEYS[2], '*', 'h', ARGV[3], 'b', ARGV[4])
redis.call('HSET', KEYS[1], 'turns', turn, 'turn:' .. turn, id, 'digest:' .. turn, ARGV[2])
return id
